"""An SGLang HiCache storage backend on HKVM.

SGLang loads it with::

    --enable-hierarchical-cache --hicache-storage-backend dynamic \\
    --hicache-storage-backend-extra-config '{"backend_name": "hkvm",
        "module_path": "hkvm.sglang", "class_name": "HKVMStore", "interface_v1": 1,
        "master_server_address": "nats://h1:4222/<cluster>/<subcluster>"}'

Pages are keyed as SGLang's own Mooncake backend keys them (``<hash>_<tp_rank>_k``
and ``_v`` for MHA, ``<hash>__k`` for MLA, with the model name as prefix), so the
two backends can share a pool's naming. ``interface_v1`` selects the zero-copy
``batch_get_v1`` / ``batch_set_v1`` path: pages move straight between the host
KV pool (registered once) and the HKVM pool.

Configuration (``extra_config`` first, then the environment):
``master_server_address`` / ``HKVM_MASTER`` (or ``MOONCAKE_MASTER``),
``local_hostname`` / ``MOONCAKE_LOCAL_HOSTNAME`` (default ``localhost``),
``global_segment_size`` / ``MOONCAKE_GLOBAL_SEGMENT_SIZE`` (default 4 GiB, split
over the TP ranks), ``replica_num`` (default 1). It imports without SGLang
installed (the base class is then a stand-in with the same methods).
"""

from __future__ import annotations

import logging
import os
from typing import Any, List, Optional

from .store import MooncakeDistributedStore, ReplicateConfig, _parse_size

log = logging.getLogger("hkvm.sglang")

try:  # The real base class when SGLang is installed.
    from sglang.srt.mem_cache.hicache_storage import HiCacheStorage as _Base
except ImportError:  # pragma: no cover - exercised when SGLang is absent

    class _Base:  # type: ignore[no-redef]
        """Stand-in for SGLang's ``HiCacheStorage`` when SGLang is not installed."""

        def register_mem_pool_host(self, mem_pool_host: Any) -> None:
            self.mem_pool_host = mem_pool_host


_LOCAL_BUFFER = 16 * 1024 * 1024


def _setting(extra: dict, key: str, *env: str, default: Any = None) -> Any:
    if extra.get(key) is not None:
        return extra[key]
    for name in env:
        if os.environ.get(name):
            return os.environ[name]
    return default


class HKVMStore(_Base):
    """``HiCacheStorage`` over an HKVM pool (constructed by SGLang as
    ``HKVMStore(storage_config, kwargs)``)."""

    def __init__(self, storage_config: Any = None, kwargs: Optional[dict] = None, store: Any = None):
        extra = dict(getattr(storage_config, "extra_config", None) or {})
        self.tp_rank = int(getattr(storage_config, "tp_rank", 0) or 0)
        self.tp_size = int(getattr(storage_config, "tp_size", 1) or 1)
        self.pp_rank = int(getattr(storage_config, "pp_rank", 0) or 0)
        self.pp_size = int(getattr(storage_config, "pp_size", 1) or 1)
        self.is_mla = bool(getattr(storage_config, "is_mla_model", False))
        model = getattr(storage_config, "model_name", None) or ""
        tag = extra.get("extra_backend_tag") or ""
        prefix = "_".join(p for p in (tag, model.replace("/", "-")) if p)
        self.prefix = f"{prefix}_" if prefix else ""
        if self.is_mla:
            self.suffixes = [f"_{self.pp_rank}_k" if self.pp_size > 1 else "__k"]
        else:
            rank = f"{self.tp_rank}_{self.pp_rank}" if self.pp_size > 1 else f"{self.tp_rank}"
            self.suffixes = [f"_{rank}_k", f"_{rank}_v"]
        self.replica = ReplicateConfig()
        self.replica.replica_num = int(extra.get("replica_num", 1))
        self.mem_pool_host = None
        self._registered = False
        if store is not None:
            self.store = store
            return
        self.store = MooncakeDistributedStore()
        client = _setting(extra, "client_server_address", "MOONCAKE_CLIENT")
        standalone = str(_setting(extra, "standalone_storage", "MOONCAKE_STANDALONE_STORAGE", default=""))
        if client and standalone.lower() in ("1", "true", "yes"):
            # A dummy of the host's real client (`hkvm node --dummy-port`): the host
            # pool must come from MooncakeHostMemAllocator to be shared with it.
            code = self.store.setup_dummy(_LOCAL_BUFFER, _LOCAL_BUFFER, str(client))
            if code != 0:
                raise RuntimeError(f"HKVM backend: setup_dummy({client}) failed with code {code}")
            return
        master = _setting(extra, "master_server_address", "HKVM_MASTER", "MOONCAKE_MASTER")
        if not master:
            raise ValueError(
                "HKVM backend: set master_server_address in the extra config "
                "(nats://host:4222/<cluster>/<subcluster>) or HKVM_MASTER, or "
                "standalone_storage with client_server_address"
            )
        hostname = _setting(extra, "local_hostname", "MOONCAKE_LOCAL_HOSTNAME", default="localhost")
        segment = _parse_size(
            _setting(extra, "global_segment_size", "MOONCAKE_GLOBAL_SEGMENT_SIZE", default="4gb")
        )
        code = self.store.setup(
            hostname, "", segment // max(1, self.tp_size * self.pp_size), _LOCAL_BUFFER,
            "tcp", "", master,
        )
        if code != 0:
            raise RuntimeError(f"HKVM backend: setup failed with code {code}")

    # -- keys -----------------------------------------------------------------------

    def _keys(self, keys: List[str]) -> List[str]:
        """The stored objects of pages ``keys``: one per suffix, page after page."""
        return [f"{self.prefix}{key}{suffix}" for key in keys for suffix in self.suffixes]

    def _per_page(self, results: List[Any], ok) -> List[bool]:
        width = len(self.suffixes)
        return [all(ok(r) for r in results[i : i + width]) for i in range(0, len(results), width)]

    # -- host pool --------------------------------------------------------------------

    def register_mem_pool_host(self, mem_pool_host: Any) -> None:
        """Registers the host KV pool's buffer, so pages move without a copy."""
        super().register_mem_pool_host(mem_pool_host)
        self.mem_pool_host = mem_pool_host
        buffer = getattr(mem_pool_host, "kv_buffer", None)
        if buffer is None:
            return
        code = self.store.register_buffer(buffer.data_ptr(), buffer.numel() * buffer.element_size())
        if code != 0:
            raise RuntimeError(
                f"HKVM backend: registering the host pool failed ({code}); a dummy store "
                "needs the pool allocated by MooncakeHostMemAllocator"
            )
        self._registered = True

    def _buffers(self, keys: List[str], host_indices: Any):
        ptrs, sizes = self.mem_pool_host.get_page_buffer_meta(host_indices)
        if len(ptrs) != len(keys) * len(self.suffixes):
            raise ValueError(
                f"host pool gave {len(ptrs)} buffers for {len(keys)} pages of "
                f"{len(self.suffixes)} objects each"
            )
        return list(ptrs), list(sizes)

    # -- the zero-copy interface (interface_v1) -----------------------------------------

    def batch_get_v1(self, keys: List[str], host_indices: Any, extra_info: Any = None) -> List[bool]:
        """Reads pages straight into the host pool; per page whether it was read."""
        if not keys:
            return []
        ptrs, sizes = self._buffers(keys, host_indices)
        read = self.store.batch_get_into(self._keys(keys), ptrs, sizes)
        return self._per_page(read, lambda n: n > 0)

    def batch_set_v1(self, keys: List[str], host_indices: Any, extra_info: Any = None) -> List[bool]:
        """Writes pages straight from the host pool (pages already stored are not
        written again); per page whether it is stored."""
        if not keys:
            return []
        objects = self._keys(keys)
        ptrs, sizes = self._buffers(keys, host_indices)
        exists = self.store.batch_is_exist(objects)
        missing = [i for i, e in enumerate(exists) if e != 1]
        results = [0] * len(objects)
        if missing:
            written = self.store.batch_put_from(
                [objects[i] for i in missing],
                [ptrs[i] for i in missing],
                [sizes[i] for i in missing],
                self.replica,
            )
            for index, code in zip(missing, written):
                results[index] = code
        return self._per_page(results, lambda c: c == 0)

    # -- existence ------------------------------------------------------------------------

    def exists(self, key: str) -> bool:
        """Whether every object of page ``key`` is stored."""
        return self.batch_exists([key]) == 1

    def batch_exists(self, keys: List[str], extra_info: Any = None) -> int:
        """How many pages from the start of ``keys`` are stored (the hit prefix)."""
        if not keys:
            return 0
        exists = self.store.batch_is_exist(self._keys(keys))
        width = len(self.suffixes)
        for index, flag in enumerate(exists):
            if flag != 1:
                return index // width
        return len(keys)

    # -- the generic interface (explicit buffers) --------------------------------------------

    def get(self, key: str, target_location: Any = None, target_sizes: Any = None) -> Any:
        """Reads page ``key`` into ``target_location`` (pointers, one per object);
        ``target_location`` when read, else ``None``."""
        if target_location is None or target_sizes is None:
            return None
        read = self.batch_get([key], [target_location], [target_sizes])
        return target_location if read == 1 else None

    def batch_get(self, keys: List[str], target_locations: Any = None, target_sizes: Any = None) -> int:
        """Reads pages into explicit buffers (per page a list of pointers and of
        sizes, one per object); how many pages from the start were read."""
        if not keys or target_locations is None or target_sizes is None:
            return 0
        ptrs = [p for page in target_locations for p in _listed(page)]
        sizes = [s for page in target_sizes for s in _listed(page)]
        read = self.store.batch_get_into(self._keys(keys), ptrs, sizes)
        pages = self._per_page(read, lambda n: n > 0)
        return next((i for i, ok in enumerate(pages) if not ok), len(pages))

    def set(self, key: str, value: Any = None, target_location: Any = None, target_sizes: Any = None) -> bool:
        """Stores page ``key`` from explicit buffers; whether it is stored."""
        if target_location is None or target_sizes is None:
            return False
        return self.batch_set([key], None, [target_location], [target_sizes])

    def batch_set(self, keys: List[str], values: Any = None, target_locations: Any = None, target_sizes: Any = None) -> bool:
        """Stores pages from explicit buffers; whether all are stored."""
        if not keys or target_locations is None or target_sizes is None:
            return False
        ptrs = [p for page in target_locations for p in _listed(page)]
        sizes = [s for page in target_sizes for s in _listed(page)]
        codes = self.store.batch_put_from(self._keys(keys), ptrs, sizes, self.replica)
        return all(c == 0 for c in codes)

    # -- housekeeping --------------------------------------------------------------------------

    def clear(self) -> None:
        """Removes every page of the pool."""
        self.store.remove_all(True)

    def close(self) -> None:
        """Unregisters the host pool and leaves the pool."""
        self.store.close()

    def get_stats(self) -> Optional[dict]:
        """No statistics beyond HKVM's own metrics."""
        return None


def _listed(value: Any) -> list:
    return list(value) if isinstance(value, (list, tuple)) else [value]
