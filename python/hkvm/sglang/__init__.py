"""An SGLang HiCache storage backend on HKVM.

SGLang loads it with::

    --enable-hierarchical-cache --hicache-storage-backend dynamic \\
    --hicache-storage-backend-extra-config '{"backend_name": "hkvm",
        "module_path": "hkvm.sglang", "class_name": "HKVMStore", "interface_v1": 1,
        "master_server_address": "nats://h1:4222/<cluster>/<subcluster>"}'

Pages are keyed as SGLang's own Mooncake backend keys them (:mod:`.keys`), so the
two backends can share a pool's naming. ``interface_v1`` selects the zero-copy
``batch_get_v1`` / ``batch_set_v1`` path: pages move straight between the host
KV pool (registered once) and the HKVM pool; without it, SGLang's copying path
(flat page tensors) works too. Hybrid models' side pools (Mamba, SWA, indexers,
draft models) go through the v2 calls (:mod:`.backend`).

Configuration (``extra_config`` first, then the environment):
``master_server_address`` / ``HKVM_MASTER`` (or ``MOONCAKE_MASTER``),
``local_hostname`` / ``MOONCAKE_LOCAL_HOSTNAME`` (default ``localhost``),
``global_segment_size`` / ``MOONCAKE_GLOBAL_SEGMENT_SIZE`` (default 4 GiB, split
over the TP and PP ranks), ``replica_num`` (default 1), ``tenant_id`` (its own key
space, as Mooncake's), ``extra_backend_tag`` (a key prefix). It imports without
SGLang installed (the base class is then a stand-in with the same methods).
"""

from .backend import HKVMStore, PoolTransferResult
from .keys import PageKeys

__all__ = ["HKVMStore", "PageKeys", "PoolTransferResult"]
