"""Mooncake Store's Python API on HKVM.

A program written for Mooncake runs on HKVM unchanged: installing the package
makes ``mooncake.store`` serve these classes (see ``hkvm.mooncake_store``), and the
master address (``nats://h1:4222,h2:4222/<cluster>/<subcluster>``, or any of
Mooncake's forms, see ``hkvm.address``) names the pool. Method names, argument
order and defaults, return types and Mooncake's integer error codes are kept; the
differences are listed in ``docs/python.md``.

Every call is safe from several threads at once; network waits and copies run with
the GIL released.
"""

from __future__ import annotations

import atexit
import ctypes
import logging
import threading
import weakref
from typing import Any, Callable, Dict, Iterable, List, Optional, Sequence, Union

from . import _native
from .address import AddressError, load_config_file, resolve
from .ranges import RangePlan
from .tenants import DEFAULT_TENANT, TENANT_MARK, key_prefix, tenant_refused
from .mooncake_types import (  # noqa: F401 - re-exported, and _parse_size for hkvm.sglang
    BufferHandle,
    Descriptor,
    ErrorCode,
    MemoryDescriptor,
    MooncakeHostMemAllocator,
    ReplicaDescriptor,
    ReplicaStatus,
    ReplicateConfig,
    SoftPinAction,
    _as_bytes,
    _parse_size,
)

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
]

log = logging.getLogger("hkvm.store")

_DEFAULT_SEGMENT = 16 * 1024 * 1024
_DEFAULT_LOCAL_BUFFER = 16 * 1024 * 1024


#: Every store object alive in this process: closed at interpreter exit.
_LIVE_STORES: "weakref.WeakSet[MooncakeDistributedStore]" = weakref.WeakSet()


@atexit.register
def _close_live_stores() -> None:
    """Closes the stores a program left open (Mooncake's destructor does; SGLang's
    backend relies on it): their segments are unmounted now rather than at the
    node timeout, so no put is placed on memory nobody serves any more."""
    for store in list(_LIVE_STORES):
        try:
            store.close()
        except Exception:  # pragma: no cover - best effort at exit
            log.debug("closing a store at exit failed", exc_info=True)


class MooncakeDistributedStore:
    """A client (and, with a segment size, a node) of an HKVM pool with Mooncake
    Store's API. Construct it, then ``setup(...)``. A store dropped without
    ``close()`` (garbage collected, or left open at exit) is closed then."""

    def __init__(self) -> None:
        self._native: Any = None
        self._lock = threading.Lock()
        # Memory alloc_from_mem_pool handed out (a full store's private buffers).
        self._owned: Dict[int, Any] = {}
        # The tenant its keys belong to, and what its keys are stored under.
        self._tenant = DEFAULT_TENANT
        self._prefix = ""
        _native.init_logging()
        _LIVE_STORES.add(self)

    def __del__(self) -> None:
        # Garbage collected while set up: unmount, as Mooncake's destructor does.
        native = self.__dict__.get("_native")
        if native is not None:
            try:
                native.close()
            except Exception:  # pragma: no cover - never raise from __del__
                pass

    # -- setup and lifecycle ------------------------------------------------------

    def setup(
        self,
        local_hostname: Union[str, Dict[str, Any], None] = None,
        metadata_server: Optional[str] = None,
        global_segment_size: Union[int, str] = _DEFAULT_SEGMENT,
        local_buffer_size: Union[int, str] = _DEFAULT_LOCAL_BUFFER,
        protocol: str = "tcp",
        rdma_devices: str = "",
        master_server_addr: Optional[str] = None,
        engine: Any = None,
        **extras: Any,
    ) -> int:
        """Joins the pool: this process becomes a node of the sub-cluster named in
        ``master_server_addr`` contributing ``global_segment_size`` bytes (0: a
        client only). ``metadata_server`` and ``engine`` are accepted and ignored;
        so are Mooncake's extra keywords (``tenant_id``, ``enable_ssd_offload``...).
        Also takes one dict with the same keys (values may be strings such as
        ``"16MB"``). The address may be in any of Mooncake's forms
        (``host:port``, ``mooncakestore://host:port``; see :mod:`hkvm.address`);
        without one, ``MOONCAKE_CONFIG_PATH``'s file gives the settings.
        Returns 0, or a negative Mooncake error code."""
        config: Dict[str, Any] = {}
        if isinstance(local_hostname, dict):
            config = {str(k): v for k, v in local_hostname.items()}
            local_hostname = config.get("local_hostname")
            metadata_server = config.get("metadata_server", metadata_server)
            global_segment_size = config.get("global_segment_size", global_segment_size)
            local_buffer_size = config.get("local_buffer_size", local_buffer_size)
            protocol = config.get("protocol", protocol)
            rdma_devices = config.get("rdma_devices", config.get("device_name", rdma_devices))
            master_server_addr = config.get(
                "master_server_addr", config.get("master_server_address", master_server_addr)
            )
        config.update({key: extras.pop(key) for key in ("hkvm_cluster", "hkvm_subcluster", "hkvm_labels") if key in extras})
        tenant = extras.pop("tenant_id", None)
        if extras:
            log.debug("ignoring setup options HKVM does not use: %s", sorted(extras))
        try:
            if not master_server_addr:
                # Mooncake's configuration file: engines point MOONCAKE_CONFIG_PATH at it.
                file = load_config_file()
                for key, value in file.items():
                    config.setdefault(key, value)
                local_hostname = local_hostname or file.get("local_hostname")
                master_server_addr = file.get("master_server_address", file.get("master_server_addr"))
                if "global_segment_size" in file:
                    global_segment_size = file["global_segment_size"]
                if "local_buffer_size" in file:
                    local_buffer_size = file["local_buffer_size"]
                protocol = file.get("protocol", protocol)
                rdma_devices = file.get("device_name", file.get("rdma_devices", rdma_devices))
            address = resolve(master_server_addr, config)
        except AddressError as error:
            log.error("setup: %s", error)
            return ErrorCode.INVALID_PARAMS
        # The keyword, else the dict's or the configuration file's key; blank is
        # the default tenant, as on Mooncake.
        tenant = config.get("tenant_id") if tenant is None else tenant
        tenant = str(tenant if tenant is not None else "").strip() or DEFAULT_TENANT
        refused = tenant_refused(tenant)
        if refused:
            log.error("setup: tenant_id %r: %s", tenant, refused)
            return ErrorCode.INVALID_PARAMS
        if not local_hostname:
            log.error("setup needs local_hostname")
            return ErrorCode.INVALID_PARAMS
        try:
            segment = _parse_size(global_segment_size)
            buffer = _parse_size(local_buffer_size)
        except ValueError as error:
            log.error("setup: %s", error)
            return ErrorCode.INVALID_PARAMS
        if segment < 0 or buffer < 0:
            log.error("setup: sizes must not be negative")
            return ErrorCode.INVALID_PARAMS
        if str(protocol).lower() not in ("tcp", "rdma"):
            log.error("setup: unknown protocol %r (expected tcp or rdma)", protocol)
            return ErrorCode.INVALID_PARAMS
        with self._lock:
            if self._native is not None:
                log.error("setup: the store is set up already; close() it first")
                return ErrorCode.INVALID_PARAMS
            try:
                self._native = _native.NativeStore(
                    str(local_hostname),
                    address,
                    segment,
                    buffer,
                    str(protocol).lower(),
                    str(rdma_devices or ""),
                )
            except _native.HkvmError as error:
                code, message = error.args
                log.error("setup failed: %s", message)
                return int(code)
            self._tenant = tenant
            self._prefix = key_prefix(tenant)
        self._owned = {}
        return ErrorCode.OK

    def setup_dummy(self, mem_pool_size: Union[int, str], local_buffer_size: Union[int, str], server_address: str) -> int:
        """Makes this process a dummy client of the real client on this host
        (``hkvm node --dummy-port <port>``) serving ``server_address``
        (``host:port``; the port names its socket). The real client talks to the
        masters; values move through memory shared with it: ``mem_pool_size`` bytes
        for buffers from :meth:`alloc_from_mem_pool` (the only memory zero-copy
        calls accept) and ``local_buffer_size`` bytes for staging copying calls.
        Returns 0, or a negative code (-900 when no real client answers)."""
        try:
            pool = _parse_size(mem_pool_size)
            staging = _parse_size(local_buffer_size)
        except ValueError as error:
            log.error("setup_dummy: %s", error)
            return ErrorCode.INVALID_PARAMS
        with self._lock:
            if self._native is not None:
                log.error("setup_dummy: the store is set up already; close() it first")
                return ErrorCode.INVALID_PARAMS
            try:
                self._native = _native.NativeStore.dummy(pool, staging, str(server_address))
            except _native.HkvmError as error:
                code, message = error.args
                log.error("setup_dummy failed: %s", message)
                return int(code)
            self._tenant, self._prefix = DEFAULT_TENANT, ""
        self._owned = {}
        return ErrorCode.OK

    def alloc_from_mem_pool(self, size: int) -> int:
        """The address of ``size`` bytes of memory usable by zero-copy calls (0 when
        none is left). A dummy client allocates it in the memory it shares with its
        real client and registers it; a full store allocates and registers private
        memory. Give it back with :meth:`free_to_mem_pool`."""
        native = self._native
        if native is None or size <= 0:
            return 0
        if native.has_mem_pool():
            address = native.alloc_from_mem_pool(int(size))
        else:
            buffer = ctypes.create_string_buffer(int(size))
            address = ctypes.addressof(buffer)
            self._owned[address] = buffer
        if address and native.register_buffer(address, int(size)) != 0:
            self.free_to_mem_pool(address)
            return 0
        return address

    def free_to_mem_pool(self, address: int) -> int:
        """Gives memory from :meth:`alloc_from_mem_pool` back: 0 or -600."""
        native = self._native
        if native is None:
            return ErrorCode.INVALID_PARAMS
        native.unregister_buffer(int(address))
        if native.has_mem_pool():
            return native.free_to_mem_pool(int(address))
        return ErrorCode.OK if self._owned.pop(int(address), None) is not None else ErrorCode.INVALID_PARAMS

    def init_all(self, protocol: str, device_name: str, mount_segment_size: int = _DEFAULT_SEGMENT) -> int:
        """Mooncake's legacy all-in-one setup is not available: returns -1011."""
        log.error("init_all is not available; use setup()")
        return ErrorCode.UNAVAILABLE_IN_CURRENT_MODE

    def close(self) -> int:
        """Unmounts this process's segment and stops its node. A later ``setup``
        works again. Returns 0 (also when not set up)."""
        with self._lock:
            native, self._native = self._native, None
        if native is not None:
            native.close()
        self._owned = {}
        return ErrorCode.OK

    def health_check(self) -> int:
        """0 healthy, 1 not set up (or closed), 2 sub-master unreachable."""
        native = self._native
        if native is None:
            return 1
        return native.health()

    def get_hostname(self) -> str:
        """This process's transfer endpoint, ``host:port`` ("" before setup)."""
        native = self._native
        return native.hostname() if native is not None else ""

    # -- tenants -------------------------------------------------------------------

    def _stored(self, keys: Iterable[str]) -> List[str]:
        """The keys as stored: scoped to this store's tenant."""
        prefix = self._prefix
        return [prefix + key for key in keys] if prefix else list(keys)

    def _writing(self, keys: List[str], write: Callable[[Optional[List[int]], List[str]], List[int]]) -> List[int]:
        """Per key the code of ``write(chosen, stored)``, which writes the keys at
        the indexes ``chosen`` (None: all) under their stored names. A key of the
        default tenant that starts with the tenant mark would land in another
        tenant's key space: it is refused (-600)."""
        if self._prefix or not any(isinstance(k, str) and k.startswith(TENANT_MARK) for k in keys):
            return write(None, self._stored(keys))
        log.error("keys starting with \\x1e are reserved for tenants' keys: refused")
        chosen = [i for i, key in enumerate(keys) if not (isinstance(key, str) and key.startswith(TENANT_MARK))]
        codes = [ErrorCode.INVALID_PARAMS] * len(keys)
        if chosen:
            for index, code in zip(chosen, write(chosen, [keys[i] for i in chosen])):
                codes[index] = code
        return codes

    # -- copying data path --------------------------------------------------------

    @staticmethod
    def _placement(config: Optional[ReplicateConfig]):
        config = config or ReplicateConfig()
        return int(config.replica_num), config._preferred(), bool(config.with_hard_pin)

    def put(self, key: str, value: Any, config: Optional[ReplicateConfig] = None) -> int:
        """Stores ``value`` (any bytes-like) under ``key``. An existing key is left
        as it is and 0 returned (first writer wins). 0 or a negative code."""
        return self._put([key], [[value]], config)[0]

    def put_parts(self, key: str, *parts: Any, config: Optional[ReplicateConfig] = None) -> int:
        """Stores the concatenation of ``parts`` under ``key``. 0 or a negative code."""
        return self._put([key], [list(parts)], config)[0]

    def put_batch(self, keys: List[str], values: List[Any], config: Optional[ReplicateConfig] = None) -> int:
        """Stores many values; 0 when all succeeded, else the first failure's code."""
        if len(keys) != len(values):
            return ErrorCode.INVALID_PARAMS
        codes = self._put(list(keys), [[v] for v in values], config)
        return next((c for c in codes if c != 0), ErrorCode.OK)

    def _put(self, keys: List[str], values: List[List[Any]], config: Optional[ReplicateConfig]) -> List[int]:
        native = self._native
        if native is None:
            return [ErrorCode.INVALID_PARAMS] * len(keys)
        try:
            parts = [[_as_bytes(p) for p in value] for value in values]
        except TypeError:
            return [ErrorCode.INVALID_PARAMS] * len(keys)
        replicas, preferred, pin = self._placement(config)
        return self._writing(
            keys,
            lambda chosen, stored: native.put(
                stored, parts if chosen is None else [parts[i] for i in chosen], (replicas, preferred, pin), True
            ),
        )

    def get(self, key: str) -> bytes:
        """The value of ``key``, or ``b""`` when it is missing or unreadable."""
        return self.get_batch([key])[0]

    def get_batch(self, keys: List[str]) -> List[bytes]:
        """One ``bytes`` per key, ``b""`` for a missing or unreadable one."""
        native = self._native
        if native is None:
            return [b""] * len(keys)
        return [v if isinstance(v, bytes) else b"" for v in native.get(self._stored(keys))]

    def get_buffer(self, key: str) -> Optional[BufferHandle]:
        """The value of ``key`` in a :class:`BufferHandle`, or ``None``."""
        return self.batch_get_buffer([key])[0]

    def batch_get_buffer(self, keys: List[str]) -> List[Optional[BufferHandle]]:
        """One :class:`BufferHandle` (or ``None``) per key."""
        native = self._native
        if native is None:
            return [None] * len(keys)
        return native.get_buffer(self._stored(keys), BufferHandle)

    # -- existence, size, removal -------------------------------------------------

    def is_exist(self, key: str) -> int:
        """1 if ``key`` exists anywhere in the pool, 0 if not, -1 on error."""
        return self.batch_is_exist([key])[0]

    def batch_is_exist(self, keys: List[str]) -> List[int]:
        """Per key 1, 0 or -1 (error)."""
        native = self._native
        if native is None:
            return [-1] * len(keys)
        return native.exist(self._stored(keys))

    def get_size(self, key: str) -> int:
        """The size of ``key``'s value, or a negative code (-704 when missing)."""
        native = self._native
        if native is None:
            return ErrorCode.INVALID_PARAMS
        return native.size(self._stored([key]))[0]

    def get_replica_desc(self, key: str) -> List[ReplicaDescriptor]:
        """The replicas of ``key`` (an empty list when it is missing or the
        lookup failed), as Mooncake describes them."""
        return self._replica_descs([key])[0] or []

    def batch_get_replica_desc(self, keys: List[str]) -> Dict[str, List[ReplicaDescriptor]]:
        """Per key found its replicas; keys missing (or whose lookup failed) are
        left out, as on Mooncake."""
        found = self._replica_descs(list(keys))
        return {key: replicas for key, replicas in zip(keys, found) if replicas is not None}

    def _replica_descs(self, keys: List[str]) -> List[Optional[List[ReplicaDescriptor]]]:
        native = self._native
        if native is None:
            return [None] * len(keys)
        out: List[Optional[List[ReplicaDescriptor]]] = []
        for key, found in zip(keys, native.replicas(self._stored([str(k) for k in keys]))):
            if isinstance(found, int):
                if found != ErrorCode.OBJECT_NOT_FOUND:
                    log.warning("get_replica_desc(%r): code %d", key, found)
                out.append(None)
                continue
            out.append([
                ReplicaDescriptor(MemoryDescriptor(Descriptor(size, offset, endpoint)))
                for size, offset, endpoint in found
            ])
        return out

    def remove(self, key: str, force: bool = False) -> int:
        """Removes ``key`` wherever it is: 0, -704 when missing, -706 while a
        reader holds its lease (unless ``force``)."""
        return self.batch_remove([key], force)[0]

    def batch_remove(self, keys: List[str], force: bool = False) -> List[int]:
        """Per key 0 or a negative code."""
        native = self._native
        if native is None:
            return [ErrorCode.INVALID_PARAMS] * len(keys)
        return native.remove(self._stored(keys), bool(force))

    def remove_all(self, force: bool = False) -> int:
        """Removes every object of the pool; how many, or a negative code."""
        native = self._native
        if native is None:
            return ErrorCode.INVALID_PARAMS
        return native.remove_all(None, self._tenant, bool(force))

    def remove_by_regex(self, regex_pattern: str, force: bool = False) -> int:
        """Removes every object whose key matches ``regex_pattern`` (searched
        anywhere in the key unless anchored); how many, or a negative code."""
        native = self._native
        if native is None:
            return ErrorCode.INVALID_PARAMS
        return native.remove_all(str(regex_pattern), self._tenant, bool(force))

    # -- zero-copy data path ------------------------------------------------------

    def register_buffer(self, buffer_ptr: int, size: int) -> int:
        """Registers ``[buffer_ptr, buffer_ptr + size)`` for zero-copy calls: 0, or
        -600 for a null, empty or overlapping range."""
        native = self._native
        if native is None:
            return ErrorCode.INVALID_PARAMS
        return native.register_buffer(int(buffer_ptr), int(size))

    def unregister_buffer(self, buffer_ptr: int) -> int:
        """Forgets a registration: 0, or -600 when none starts at ``buffer_ptr``."""
        native = self._native
        if native is None:
            return ErrorCode.INVALID_PARAMS
        return native.unregister_buffer(int(buffer_ptr))

    def put_from(self, key: str, buffer_ptr: int, size: int, config: Optional[ReplicateConfig] = None) -> int:
        """Stores ``size`` bytes of registered memory at ``buffer_ptr``: 0 or a
        negative code (-600 for memory outside every registered buffer)."""
        return self._put_from([key], [[buffer_ptr]], [[size]], config)[0]

    def batch_put_from(
        self,
        keys: List[str],
        buffer_ptrs: List[int],
        sizes: List[int],
        config: Optional[ReplicateConfig] = None,
    ) -> List[int]:
        """Per key 0 or a negative code; every entry -600 when the lists differ in
        length."""
        if not (len(keys) == len(buffer_ptrs) == len(sizes)):
            return [ErrorCode.INVALID_PARAMS] * len(keys)
        return self._put_from(keys, [[p] for p in buffer_ptrs], [[s] for s in sizes], config)

    def batch_put_from_multi_buffers(
        self,
        keys: List[str],
        all_buffer_ptrs: List[List[int]],
        all_sizes: List[List[int]],
        config: Optional[ReplicateConfig] = None,
    ) -> List[int]:
        """Per key, stores the concatenation of its (pointer, size) parts: 0 or a
        negative code; every entry -600 when the shapes differ."""
        return self._put_from(keys, all_buffer_ptrs, all_sizes, config)

    # -- upsert (insert or replace) ---------------------------------------------------

    def _replaced(self, keys: List[str], put: Any) -> List[int]:
        """Removes the keys that exist, then runs ``put`` on the indexes of those
        removed or missing. The removal is forced, as Mooncake's upsert replaces a
        value a reader holds: a read in flight of the old value fails its
        end-to-end checksum if the memory is reused, and never returns other
        bytes."""
        removed = self.batch_remove(list(keys), True) if keys else []
        ready = [i for i, code in enumerate(removed) if code in (ErrorCode.OK, ErrorCode.OBJECT_NOT_FOUND)]
        results = list(removed)
        if ready:
            for index, code in zip(ready, put(ready)):
                results[index] = code
        return results

    def upsert(self, key: str, value: Any, config: Optional[ReplicateConfig] = None) -> int:
        """Stores ``value`` under ``key``, replacing what it held (also while a
        reader holds it, as on Mooncake): 0 or a negative code. Not atomic: a
        reader in between sees the key missing, and a concurrent ``put`` of the
        same key may be the one that stays."""
        return self._replaced([key], lambda ready: self._put([key], [[value]], config))[0]

    def upsert_parts(self, key: str, *parts: Any, config: Optional[ReplicateConfig] = None) -> int:
        """:meth:`upsert` of the concatenation of ``parts``."""
        return self._replaced([key], lambda ready: self._put([key], [list(parts)], config))[0]

    def upsert_from(self, key: str, buffer_ptr: int, size: int, config: Optional[ReplicateConfig] = None) -> int:
        """:meth:`upsert` from registered memory (as :meth:`put_from`)."""
        return self._replaced([key], lambda ready: self._put_from([key], [[buffer_ptr]], [[size]], config))[0]

    def batch_upsert_from(
        self,
        keys: List[str],
        buffer_ptrs: List[int],
        sizes: List[int],
        config: Optional[ReplicateConfig] = None,
    ) -> List[int]:
        """:meth:`upsert_from` per key; every entry -600 when the lists differ in
        length."""
        if not (len(keys) == len(buffer_ptrs) == len(sizes)):
            return [ErrorCode.INVALID_PARAMS] * len(keys)
        return self._replaced(
            keys,
            lambda ready: self.batch_put_from(
                [keys[i] for i in ready], [buffer_ptrs[i] for i in ready], [sizes[i] for i in ready], config
            ),
        )

    def _put_from(self, keys, ptrs, sizes, config) -> List[int]:
        native = self._native
        if native is None:
            return [ErrorCode.INVALID_PARAMS] * len(keys)
        replicas, preferred, pin = self._placement(config)
        try:
            ptrs, sizes = _int_lists(ptrs), _int_lists(sizes)
        except (TypeError, ValueError, OverflowError):
            return [ErrorCode.INVALID_PARAMS] * len(keys)

        def write(chosen: Optional[List[int]], stored: List[str]) -> List[int]:
            if chosen is None:
                return native.put_from(stored, ptrs, sizes, (replicas, preferred, pin))
            return native.put_from(
                stored, [ptrs[i] for i in chosen], [sizes[i] for i in chosen], (replicas, preferred, pin)
            )

        return self._writing(list(keys), write)

    def get_into(self, key: str, buffer_ptr: int, size: int) -> int:
        """Reads ``key``'s value into registered memory of ``size`` bytes at
        ``buffer_ptr``: its size, or a negative code (-704 missing, -10 buffer
        too small, -600 unregistered memory)."""
        return self._get_into([key], [[buffer_ptr]], [[size]])[0]

    def batch_get_into(self, keys: List[str], buffer_ptrs: List[int], sizes: List[int]) -> List[int]:
        """Per key its size or a negative code; every entry -600 when the lists
        differ in length."""
        if not (len(keys) == len(buffer_ptrs) == len(sizes)):
            return [ErrorCode.INVALID_PARAMS] * len(keys)
        return self._get_into(keys, [[p] for p in buffer_ptrs], [[s] for s in sizes])

    def batch_get_into_multi_buffers(
        self,
        keys: List[str],
        all_buffer_ptrs: List[List[int]],
        all_sizes: List[List[int]],
        prefer_alloc_in_same_node: bool = False,
    ) -> List[int]:
        """Per key, scatters its value over its (pointer, size) parts in order:
        total size or a negative code; every entry -600 when the shapes differ."""
        return self._get_into(keys, all_buffer_ptrs, all_sizes)

    def get_into_ranges(
        self,
        buffer_ptrs: List[int],
        all_keys: List[List[str]],
        all_dst_offsets: List[List[List[int]]],
        all_src_offsets: List[List[List[int]]],
        all_sizes: List[List[List[int]]],
    ) -> List[List[List[int]]]:
        """Copies byte ranges of objects into registered buffers: for buffer ``i``,
        its keys ``all_keys[i]``, and for key ``j`` its ranges ``k``:
        ``all_sizes[i][j][k]`` bytes from offset ``all_src_offsets[i][j][k]`` of the
        value to ``buffer_ptrs[i] + all_dst_offsets[i][j][k]``. Every value is read
        whole and checked against its checksum first. Per buffer, key and range
        the bytes copied or a negative code: -600 for a range beyond the value,
        memory outside every registered buffer or lists of unequal lengths, the
        read's code (-704 missing) otherwise."""
        plan = RangePlan.of(buffer_ptrs, all_keys, all_dst_offsets, all_src_offsets, all_sizes)
        native = self._native
        if native is None:
            return plan.refused_all()
        if plan.keys:
            try:
                copied = native.get_into_ranges(self._stored(plan.keys), plan.ranges)
            except OverflowError:  # a pointer or size beyond 64 bits
                copied = [[ErrorCode.INVALID_PARAMS] * len(r) for r in plan.ranges]
            plan.place(copied)
        return plan.out

    def _get_into(self, keys, ptrs, sizes) -> List[int]:
        native = self._native
        if native is None:
            return [ErrorCode.INVALID_PARAMS] * len(keys)
        try:
            return native.get_into(self._stored(keys), _int_lists(ptrs), _int_lists(sizes))
        except (TypeError, ValueError, OverflowError):
            return [ErrorCode.INVALID_PARAMS] * len(keys)


def _int_lists(rows: Iterable[Sequence[int]]) -> List[List[int]]:
    """Rows of ints (pointers or sizes) as plain lists; negative values are
    refused."""
    out = []
    for row in rows:
        values = [int(v) for v in row]
        if any(v < 0 for v in values):
            raise ValueError("negative pointer or size")
        out.append(values)
    return out
