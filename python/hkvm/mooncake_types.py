"""The value types of Mooncake Store's Python API as HKVM keeps them: error
codes, ``ReplicateConfig`` and ``SoftPinAction``, the replica descriptors of
``get_replica_desc``, ``BufferHandle``, the host
memory allocator, and the parsing of sizes such as ``"16MB"``. ``hkvm.store``
re-exports them."""

from __future__ import annotations

import ctypes
import enum
import logging
import re
from typing import Any, Dict, List, Optional, Union

from . import _native

log = logging.getLogger("hkvm.store")


class ErrorCode:
    """Mooncake's error codes that HKVM returns (same numbers)."""

    OK = 0
    INTERNAL_ERROR = -1
    BUFFER_OVERFLOW = -10
    NO_AVAILABLE_HANDLE = -200
    INVALID_PARAMS = -600
    INVALID_WRITE = -700
    OBJECT_NOT_FOUND = -704
    OBJECT_ALREADY_EXISTS = -705
    OBJECT_HAS_LEASE = -706
    TRANSFER_FAIL = -800
    RPC_FAIL = -900
    RPC_TIMEOUT = -901
    UNAVAILABLE_IN_CURRENT_MODE = -1011
    TENANT_QUOTA_EXCEEDED = -1700


class SoftPinAction(enum.IntEnum):
    """Mooncake's soft-pin choice for a put: keep what the object had
    (``PRESERVE``), pin it softly (``ENABLE``) or not (``DISABLE``)."""

    PRESERVE = 0
    ENABLE = 1
    DISABLE = 2


class ReplicateConfig:
    """How a put is placed: ``replica_num`` copies on distinct nodes, the first on
    ``preferred_segment`` (``host:port`` of a store, as ``get_hostname()`` gives)
    when it has room; ``with_hard_pin`` objects are never evicted.

    The other fields of Mooncake's ``ReplicateConfig`` are accepted and have no
    effect (HKVM evicts oldest first among unpinned, unleased objects, and has no
    NoF or DFS tiers): ``soft_pin_action``, ``soft_pin_ttl_ms``, ``with_soft_pin``
    (older Mooncake's name), ``prefer_alloc_in_same_node``, ``group_ids``,
    ``nof_replica_num``, ``dfs_replica_num``, ``preferred_nof_segments``,
    ``data_type``. Any other attribute is an ``AttributeError``, as on
    Mooncake: a misspelt field must not pass silently."""

    __slots__ = (
        "replica_num",
        "with_hard_pin",
        "preferred_segment",
        "preferred_segments",
        "soft_pin_action",
        "soft_pin_ttl_ms",
        "with_soft_pin",
        "prefer_alloc_in_same_node",
        "group_ids",
        "nof_replica_num",
        "dfs_replica_num",
        "preferred_nof_segments",
        "data_type",
    )

    def __init__(self) -> None:
        self.replica_num: int = 1
        self.with_hard_pin: bool = False
        self.preferred_segment: str = ""
        self.preferred_segments: List[str] = []
        self.soft_pin_action: SoftPinAction = SoftPinAction.PRESERVE
        self.soft_pin_ttl_ms: Optional[int] = None
        self.with_soft_pin: bool = False
        self.prefer_alloc_in_same_node: bool = False
        self.group_ids: Optional[List[str]] = None
        self.nof_replica_num: int = 0
        self.dfs_replica_num: int = 0
        self.preferred_nof_segments: List[str] = []
        self.data_type: int = 0

    def settings(self) -> Dict[str, Any]:
        """Every field and its value."""
        return {name: getattr(self, name) for name in self.__slots__}

    def _preferred(self) -> Optional[str]:
        if self.preferred_segment:
            return self.preferred_segment
        if self.preferred_segments:
            return self.preferred_segments[0]
        return None

    def __repr__(self) -> str:
        return (
            f"ReplicateConfig(replica_num={self.replica_num}, with_hard_pin={self.with_hard_pin}, "
            f"preferred_segment={self.preferred_segment!r}, soft_pin_action={self.soft_pin_action!r})"
        )

    __str__ = __repr__


class ReplicaStatus(enum.IntEnum):
    """A replica's state, with Mooncake's numbers. HKVM describes only complete
    replicas: a put's replicas become visible together when it commits."""

    UNDEFINED = 0
    INITIALIZED = 1
    PROCESSING = 2
    COMPLETE = 3
    REMOVED = 4
    FAILED = 5


class Descriptor:
    """Where one replica's bytes are: ``size``, ``buffer_address`` (HKVM: the
    offset in its segment, as HKVM places by offset) and ``transport_endpoint``
    (the holding node's ``host:port``, a segment name as ``get_hostname()``
    gives it)."""

    __slots__ = ("size", "buffer_address", "transport_endpoint")

    def __init__(self, size: int, buffer_address: int, transport_endpoint: str) -> None:
        self.size = size
        self.buffer_address = buffer_address
        self.transport_endpoint = transport_endpoint

    def __repr__(self) -> str:
        return (
            f"<Descriptor size={self.size} buffer_address={self.buffer_address} "
            f"transport_endpoint={self.transport_endpoint}>"
        )


class MemoryDescriptor:
    """A memory replica's place: its ``buffer_descriptor``."""

    __slots__ = ("buffer_descriptor",)

    def __init__(self, buffer_descriptor: Descriptor) -> None:
        self.buffer_descriptor = buffer_descriptor


class ReplicaDescriptor:
    """One replica of an object, as ``get_replica_desc`` describes it: always a
    memory replica in HKVM (it keeps no disk tier)."""

    __slots__ = ("status", "_memory")

    def __init__(self, memory: MemoryDescriptor, status: ReplicaStatus = ReplicaStatus.COMPLETE) -> None:
        self.status = status
        self._memory = memory

    def is_memory_replica(self) -> bool:
        return True

    def is_disk_replica(self) -> bool:
        return False

    def is_local_disk_replica(self) -> bool:
        return False

    def get_memory_descriptor(self) -> MemoryDescriptor:
        return self._memory

    def get_disk_descriptor(self) -> Any:
        """Raises ``RuntimeError``, as Mooncake does for a memory replica."""
        raise RuntimeError("Expected DiskDescriptor")

    def __repr__(self) -> str:
        return f"<ReplicaDescriptor {self.status.name} {self._memory.buffer_descriptor!r}>"


class BufferHandle(bytearray):
    """A value read by ``get_buffer``: a ``bytearray`` (so ``memoryview(handle)``,
    ``bytes(handle)`` and ``torch.frombuffer(handle, ...)`` work) with Mooncake's
    ``ptr()`` and ``size()``. The memory lives as long as the handle."""

    def ptr(self) -> int:
        """The address of the bytes (0 when empty)."""
        if not self:
            return 0
        return ctypes.addressof(ctypes.c_char.from_buffer(self))

    def size(self) -> int:
        """The number of bytes."""
        return len(self)


class MooncakeHostMemAllocator:
    """Host memory for buffers that zero-copy calls use, allocated before the
    store is set up (SGLang's host KV pool with ``standalone_storage``). Each
    allocation is shared memory: ``register_buffer`` on a dummy store
    (``setup_dummy``) shares it with the real client, so ``batch_put_from`` and
    ``batch_get_into`` on it move no byte through the socket. On a full store it is
    ordinary memory.

    ``use_hugepage`` and ``hugepage_size`` are accepted for compatibility; the
    memory is made of regular pages."""

    def __init__(self, use_hugepage: Optional[bool] = None, hugepage_size: Union[int, str, None] = None) -> None:
        if use_hugepage:
            log.info("MooncakeHostMemAllocator: hugepages are not used; allocating regular shared pages")
        self._hugepage_size = hugepage_size

    def alloc(self, size: int) -> int:
        """The address of ``size`` new bytes (zeroed); ``MemoryError`` when the
        memory cannot be had."""
        return _native.host_alloc(int(size))

    def free(self, ptr: int) -> int:
        """Frees an address from ``alloc``: 0, or -600 for any other address. A
        dummy store that registered the memory keeps it mapped until it
        unregisters it."""
        return _native.host_free(int(ptr))


_SIZE = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*([kmgt]?i?b?)?\s*$", re.IGNORECASE)
_UNITS = {"": 1, "b": 1, "k": 1 << 10, "m": 1 << 20, "g": 1 << 30, "t": 1 << 40}


def _parse_size(value: Union[int, str]) -> int:
    """A size as int or as text such as ``"16MB"``, ``"16 MiB"``, ``"4gb"``."""
    if isinstance(value, int):
        return value
    match = _SIZE.match(str(value))
    if not match:
        raise ValueError(f"not a size: {value!r}")
    number, unit = match.groups()
    return int(float(number) * _UNITS[(unit or "").lower()[:1]])


def _as_bytes(value: Any) -> bytes:
    """The value's bytes without a copy when it already is ``bytes``."""
    if isinstance(value, bytes):
        return value
    return bytes(memoryview(value).cast("B"))
