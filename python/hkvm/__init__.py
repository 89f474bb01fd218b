"""HKVM from Python: ``hkvm.store`` keeps Mooncake Store's client API
(``MooncakeDistributedStore``, ``ReplicateConfig``) on an HKVM pool, and
``hkvm.sglang`` is an SGLang HiCache storage backend."""

from .store import BufferHandle, ErrorCode, MooncakeDistributedStore, MooncakeHostMemAllocator, ReplicateConfig

__all__ = ["BufferHandle", "ErrorCode", "MooncakeDistributedStore", "MooncakeHostMemAllocator", "ReplicateConfig"]
