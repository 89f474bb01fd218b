"""HKVM from Python: ``hkvm.store`` keeps Mooncake Store's client API
(``MooncakeDistributedStore``, ``ReplicateConfig``) on an HKVM pool, and
``hkvm.sglang`` is an SGLang HiCache storage backend. Installing the package also
makes ``mooncake.store`` HKVM's (see ``hkvm.mooncake_store``).

The names below load the native extension on first use, not on ``import hkvm``:
the import hook that serves ``mooncake.store`` runs in every interpreter of the
environment and must stay cheap."""

from __future__ import annotations

from typing import Any

__all__ = ["BufferHandle", "ErrorCode", "MooncakeDistributedStore", "MooncakeHostMemAllocator", "ReplicateConfig", "SoftPinAction"]


def __getattr__(name: str) -> Any:
    if name in __all__:
        from . import store

        return getattr(store, name)
    raise AttributeError(f"module 'hkvm' has no attribute {name!r}")


def __dir__() -> list:
    return sorted(list(globals()) + __all__)
