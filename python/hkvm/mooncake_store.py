"""``mooncake.store`` as HKVM serves it: the programs written for Mooncake import
``from mooncake.store import MooncakeDistributedStore, ReplicateConfig`` and run
on HKVM with no edit, the setup address deciding the backend.

:class:`MooncakeDistributedStore` here is :class:`hkvm.store.MooncakeDistributedStore`
until ``setup`` / ``setup_dummy`` decides (:func:`choose_backend`):

- HKVM when ``HKVM_MOONCAKE=hkvm``; when the address is HKVM's (``nats://…``);
  when ``HKVM_CLUSTER`` is set (then ``host:port`` names the NATS servers, see
  :mod:`hkvm.address`); for ``setup_dummy``, when an HKVM real client serves that
  port on this host; and whenever the Mooncake wheel is not installed;
- otherwise the Mooncake wheel's own store: the object then forwards every call
  to it (``ReplicateConfig`` objects are translated to the wheel's).

Names HKVM does not define (``BufferPool``, ``ObjectDataType``, …) come from the
wheel when it is installed. ``HKVM_MOONCAKE=off`` turns all of this off.
"""

from __future__ import annotations

import logging
import os
from typing import Any, Callable, Dict, Optional, Tuple

from . import _mooncake_hook
from .address import is_hkvm_address
from .store import (
    BufferHandle,
    Descriptor,
    ErrorCode,
    MemoryDescriptor,
    MooncakeHostMemAllocator,
    ReplicaDescriptor,
    ReplicaStatus,
    ReplicateConfig,
    SoftPinAction,
)
from .store import MooncakeDistributedStore as _HkvmStore

__all__ = [
    "BufferHandle",
    "Descriptor",
    "ErrorCode",
    "MemoryDescriptor",
    "MooncakeDistributedStore",
    "MooncakeHostMemAllocator",
    "ReplicaDescriptor",
    "ReplicaStatus",
    "ReplicateConfig",
    "SoftPinAction",
    "choose_backend",
]

log = logging.getLogger("hkvm.mooncake")

HKVM = "hkvm"
MOONCAKE = "mooncake"

# setup's positional order (Mooncake's): master_server_addr is the seventh.
_ADDRESS_AT = 6


def _hkvm_real_client_serves(server_address: Optional[str]) -> bool:
    """Whether an HKVM real client on this host serves dummies on the port of
    ``server_address`` (its abstract socket ``hkvm-node-<port>`` is bound)."""
    _, _, port = str(server_address or "").rpartition(":")
    if not port.isdigit():
        return False
    try:
        with open("/proc/net/unix", encoding="ascii", errors="replace") as table:
            return any(line.rstrip().endswith(f" @hkvm-node-{int(port)}") for line in table)
    except OSError:
        return False


def choose_backend(address: Optional[str], *, dummy: bool = False) -> str:
    """``"hkvm"`` or ``"mooncake"``: which backend a ``setup`` with master
    ``address`` (a ``setup_dummy`` with server ``address`` when ``dummy``) goes
    to. See the module's documentation for the rule."""
    mode = _mooncake_hook.mode()
    if mode == HKVM:
        return HKVM
    if mode in (MOONCAKE, "off"):
        return MOONCAKE
    if is_hkvm_address(address) or os.environ.get("HKVM_CLUSTER"):
        return HKVM
    if dummy and _hkvm_real_client_serves(address):
        return HKVM
    return MOONCAKE if _mooncake_hook.real_store() is not None else HKVM


def _setup_address(args: Tuple[Any, ...], kwargs: Dict[str, Any]) -> Optional[str]:
    """The master address a ``setup(*args, **kwargs)`` call carries."""
    first = args[0] if args else kwargs.get("local_hostname")
    if isinstance(first, dict):
        return first.get("master_server_address", first.get("master_server_addr"))
    if len(args) > _ADDRESS_AT:
        return args[_ADDRESS_AT]
    address = kwargs.get("master_server_addr", kwargs.get("master_server_address"))
    if address is None and os.environ.get("MOONCAKE_CONFIG_PATH"):
        try:
            from .address import load_config_file

            file = load_config_file()
            address = file.get("master_server_address", file.get("master_server_addr"))
        except ValueError:
            return None
    return address


def _to_wheel(value: Any, wheel: Any) -> Any:
    """A wheel ``ReplicateConfig`` for one of HKVM's; anything else unchanged."""
    if not isinstance(value, ReplicateConfig):
        return value
    converted = wheel.ReplicateConfig()
    defaults = ReplicateConfig().settings()
    for name, setting in value.settings().items():
        if setting == defaults[name]:
            continue  # the wheel's own default stands
        enum_of = {"soft_pin_action": "SoftPinAction", "data_type": "ObjectDataType"}.get(name)
        if enum_of and hasattr(wheel, enum_of):
            setting = getattr(wheel, enum_of)(int(setting))
        try:
            if not hasattr(converted, name):
                raise AttributeError(name)
            setattr(converted, name, setting)
        except (AttributeError, TypeError) as error:
            log.warning("ReplicateConfig.%s = %r does not carry over to the Mooncake wheel (%s); ignored", name, setting, error)
    return converted


def _forwarding(method: Callable[..., Any], wheel: Any) -> Callable[..., Any]:
    def call(*args: Any, **kwargs: Any) -> Any:
        args = tuple(_to_wheel(arg, wheel) for arg in args)
        kwargs = {key: _to_wheel(arg, wheel) for key, arg in kwargs.items()}
        return method(*args, **kwargs)

    call.__name__ = getattr(method, "__name__", "call")
    call.__doc__ = getattr(method, "__doc__", None)
    return call


class MooncakeDistributedStore(_HkvmStore):
    """Mooncake's ``MooncakeDistributedStore``, on HKVM or on the Mooncake wheel as
    ``setup`` decides (see the module's documentation)."""

    def setup(self, *args: Any, **kwargs: Any) -> int:
        """Mooncake's ``setup``: on HKVM (see :meth:`hkvm.store.MooncakeDistributedStore.setup`)
        or on the wheel, which the address decides."""
        if choose_backend(_setup_address(args, kwargs)) == MOONCAKE:
            return self._switch_to_wheel().setup(*args, **kwargs)
        return super().setup(*args, **kwargs)

    def setup_dummy(self, *args: Any, **kwargs: Any) -> int:
        """Mooncake's ``setup_dummy``: on HKVM when an HKVM real client serves the
        port of ``server_address`` here, else on the wheel when it is installed."""
        address = args[2] if len(args) > 2 else kwargs.get("server_address")
        if choose_backend(address, dummy=True) == MOONCAKE:
            return self._switch_to_wheel().setup_dummy(*args, **kwargs)
        return super().setup_dummy(*args, **kwargs)

    def _switch_to_wheel(self) -> Any:
        wheel = _mooncake_hook.real_store()
        if wheel is None:  # pragma: no cover - choose_backend checked it
            raise ImportError("the Mooncake wheel is not installed")
        if self._native is not None:
            raise RuntimeError("the store is set up on HKVM already; close() it first")
        log.info("mooncake.store: this store runs on the Mooncake wheel (%s)", wheel.__file__)
        object.__setattr__(self, "_wheel", wheel)
        object.__setattr__(self, "_real", wheel.MooncakeDistributedStore())
        self.__class__ = _OnWheel
        return self


class _OnWheel(MooncakeDistributedStore):
    """A store that ``setup`` handed to the Mooncake wheel: every attribute is the
    wheel store's, with HKVM ``ReplicateConfig`` arguments translated."""

    def __getattribute__(self, name: str) -> Any:
        if name in ("_real", "_wheel", "__class__", "__dict__"):
            return object.__getattribute__(self, name)
        value = getattr(object.__getattribute__(self, "_real"), name)
        if callable(value) and not name.startswith("__"):
            return _forwarding(value, object.__getattribute__(self, "_wheel"))
        return value

    def __repr__(self) -> str:
        return f"<mooncake.store.MooncakeDistributedStore on the Mooncake wheel: {self._real!r}>"


def __getattr__(name: str) -> Any:
    """Names HKVM does not define, from the Mooncake wheel when it is installed."""
    if name.startswith("__"):
        raise AttributeError(name)
    wheel = _mooncake_hook.real_store()
    if wheel is None or not hasattr(wheel, name):
        raise AttributeError(f"module 'mooncake.store' (HKVM's) has no attribute {name!r}")
    return getattr(wheel, name)
