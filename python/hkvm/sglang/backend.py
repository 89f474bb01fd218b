"""``HKVMStore``: SGLang's ``HiCacheStorage`` over an HKVM pool.

Every call SGLang's cache controller makes on a storage backend, read from
sgl-project/sglang at 00fe477f32b3878f64d44cc36895e1de4a113afe
(``mem_cache/hicache_storage.py``, ``managers/cache_controller.py``,
``mem_cache/hybrid_cache/hybrid_cache_controller.py``):

- zero-copy (``interface_v1``): ``batch_get_v1`` / ``batch_set_v1`` move pages
  between the registered host pool and the HKVM pool, per page a bool;
- copying (without ``interface_v1``): ``batch_get`` fills the flat page tensors
  it is given and returns them (``None`` from the first miss), ``batch_set``
  stores flat page tensors;
- ``batch_exists``: how many pages from the start are stored;
- hybrid models (Mamba, SWA, indexers, draft models):
  ``register_mem_host_pool_v2`` for each side pool, then ``batch_exists_v2`` (a
  ``PoolTransferResult``: KV pages restorable with every side pool, per pool its
  hits, and the legal stop points), ``batch_get_v2`` and ``batch_set_v2`` (per
  pool, per page a bool).

Any host-pool layout works: the pool's ``get_page_buffer_meta`` gives a page's
buffers, and a page whose object spans several buffers (``layer_first``: one per
layer) is stored as one object from all of them. Keys are :mod:`.keys`'s.
"""

from __future__ import annotations

import ctypes
import logging
import os
from dataclasses import dataclass, field
from typing import Any, Dict, List, Optional, Sequence, Tuple

from ..store import MooncakeDistributedStore, ReplicateConfig, _parse_size
from .keys import PageKeys, pool_name

log = logging.getLogger("hkvm.sglang")

try:  # The real base class when SGLang is installed.
    from sglang.srt.mem_cache.hicache_storage import HiCacheStorage as _Base
except ImportError:  # pragma: no cover - exercised when SGLang is absent

    class _Base:  # type: ignore[no-redef]
        """Stand-in for SGLang's ``HiCacheStorage`` when SGLang is not installed."""

        def register_mem_pool_host(self, mem_pool_host: Any) -> None:
            self.mem_pool_host = mem_pool_host


try:
    from sglang.srt.mem_cache.hicache_storage import PoolTransferResult
except ImportError:

    @dataclass
    class PoolTransferResult:  # type: ignore[no-redef]
        """Stand-in for SGLang's ``PoolTransferResult`` (same fields)."""

        kv_hit_pages: int
        extra_pool_hit_pages: Dict[Any, int] = field(default_factory=dict)
        restorable_prefix_pages: Optional[List[int]] = None


_LOCAL_BUFFER = 16 * 1024 * 1024
_KV = "kv"


def _setting(extra: dict, key: str, *env: str, default: Any = None) -> Any:
    if extra.get(key) is not None:
        return extra[key]
    for name in env:
        if os.environ.get(name):
            return os.environ[name]
    return default


def _bytes_of(tensor: Any) -> int:
    return int(tensor.numel()) * int(tensor.element_size())


def _is_tensor(value: Any) -> bool:
    return hasattr(value, "data_ptr") and hasattr(value, "numel")


def _listed(value: Any) -> list:
    return list(value) if isinstance(value, (list, tuple)) else [value]


def _pages_ok(results: Sequence[Any], width: int, ok) -> List[bool]:
    """Per page (``width`` objects each) whether all its objects are ``ok``."""
    return [all(ok(r) for r in results[i : i + width]) for i in range(0, len(results), width)]


def _leading(flags: Sequence[bool]) -> int:
    return next((i for i, flag in enumerate(flags) if not flag), len(flags))


def _trailing_policy(transfer: Any) -> bool:
    policy = getattr(transfer, "hit_policy", None)
    return "TRAILING" in str(getattr(policy, "name", policy) or "").upper()


class HKVMStore(_Base):
    """``HiCacheStorage`` over an HKVM pool (constructed by SGLang as
    ``HKVMStore(storage_config, kwargs)``)."""

    def __init__(self, storage_config: Any = None, kwargs: Optional[dict] = None, store: Any = None):
        extra = dict(getattr(storage_config, "extra_config", None) or {})
        self.keys = PageKeys(storage_config, extra)
        tp_size = int(getattr(storage_config, "tp_size", 1) or 1)
        pp_size = int(getattr(storage_config, "pp_size", 1) or 1)
        self.replica = ReplicateConfig()
        self.replica.replica_num = int(extra.get("replica_num", 1))
        self.mem_pool_host = None
        self.pools: Dict[str, Any] = {}
        self._registered: set = set()
        self._parts_of: Dict[str, List[str]] = {}
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
        tenant = extra.get("tenant_id")
        code = self.store.setup(
            hostname, "", segment // max(1, tp_size * pp_size), _LOCAL_BUFFER,
            "tcp", "", master, **({"tenant_id": tenant} if tenant else {}),
        )
        if code != 0:
            raise RuntimeError(f"HKVM backend: setup failed with code {code}")

    # -- keys -----------------------------------------------------------------------

    def _keys(self, keys: List[str]) -> List[str]:
        """The stored KV objects of pages ``keys``: one per part, page after page."""
        return self.keys.objects(keys, self.keys.kv_parts())

    @property
    def suffixes(self) -> List[str]:
        """The KV parts of a page (its objects' suffixes)."""
        return self.keys.kv_parts()

    # -- host pools -------------------------------------------------------------------

    def _register(self, pool: Any) -> None:
        getter = getattr(pool, "get_hybrid_pool_buffer", None)
        tensors = list(getter() or []) if callable(getter) else []
        if not tensors:
            tensors = [getattr(pool, "kv_buffer", None)]
        for tensor in tensors:
            if tensor is None or _bytes_of(tensor) == 0 or tensor.data_ptr() in self._registered:
                continue
            code = self.store.register_buffer(tensor.data_ptr(), _bytes_of(tensor))
            if code != 0:
                raise RuntimeError(
                    f"HKVM backend: registering the host pool failed ({code}); a dummy store "
                    "needs the pool allocated by MooncakeHostMemAllocator"
                )
            self._registered.add(tensor.data_ptr())

    def register_mem_pool_host(self, mem_pool_host: Any) -> None:
        """Registers the host KV pool's buffers, so pages move without a copy."""
        super().register_mem_pool_host(mem_pool_host)
        self.mem_pool_host = mem_pool_host
        self._register(mem_pool_host)

    def register_mem_host_pool_v2(self, host_pool: Any, host_pool_name: Any) -> None:
        """Registers a hybrid model's side pool (Mamba, SWA, indexer, draft...)."""
        name = pool_name(host_pool_name)
        self.pools[name] = host_pool
        self._parts_of.pop(name, None)
        if name != _KV:
            self._register(host_pool)

    def _pool(self, name: str) -> Any:
        pool = self.pools.get(name) or (self.mem_pool_host if name == _KV else None)
        if pool is None:
            raise ValueError(f"HKVM backend: no host pool registered as {name!r}")
        return pool

    def _kv_is_anchor(self) -> bool:
        """Whether the KV pool holds no pages of its own (DeepSeek V4: a logical
        anchor for its side pools)."""
        pool = self.mem_pool_host
        return pool is not None and hasattr(pool, "kv_buffer") and pool.kv_buffer is None

    def _parts(self, name: str) -> List[str]:
        """The object suffixes of one page of pool ``name``."""
        if name == _KV:
            return self.keys.kv_parts()
        if name not in self._parts_of:
            pool = self._pool(name)
            page = list(range(int(getattr(pool, "page_size", 1) or 1)))
            buffers = len(pool.get_page_buffer_meta(page)[0])
            temporal = getattr(pool, "temporal_state_elem_size", 1) != 0
            self._parts_of[name] = self.keys.side_parts(name, buffers, temporal)
        return self._parts_of[name]

    @staticmethod
    def _buffers(pool: Any, host_indices: Any, pages: int, parts: int) -> Tuple[list, list]:
        """Each object's buffers (pointers and sizes) for ``pages`` pages at
        ``host_indices``: a page's buffers in order, split evenly over its parts."""
        ptrs, sizes = pool.get_page_buffer_meta(host_indices)
        ptrs, sizes = list(ptrs), list(sizes)
        if pages == 0 or len(ptrs) % (pages * parts) != 0:
            raise ValueError(
                f"host pool gave {len(ptrs)} buffers for {pages} pages of {parts} objects each"
            )
        width = len(ptrs) // (pages * parts)
        return (
            [ptrs[i : i + width] for i in range(0, len(ptrs), width)],
            [sizes[i : i + width] for i in range(0, len(sizes), width)],
        )

    def _read(self, objects: List[str], ptrs: list, sizes: list) -> List[int]:
        if all(len(p) == 1 for p in ptrs):
            return self.store.batch_get_into(objects, [p[0] for p in ptrs], [s[0] for s in sizes])
        return self.store.batch_get_into_multi_buffers(objects, ptrs, sizes)

    def _write(self, objects: List[str], ptrs: list, sizes: list) -> List[int]:
        """Stores the objects not stored yet; per object 0 when it is stored."""
        exists = self.store.batch_is_exist(objects)
        missing = [i for i, e in enumerate(exists) if e != 1]
        results = [0] * len(objects)
        if missing:
            chosen = [objects[i] for i in missing]
            if all(len(ptrs[i]) == 1 for i in missing):
                written = self.store.batch_put_from(
                    chosen, [ptrs[i][0] for i in missing], [sizes[i][0] for i in missing], self.replica
                )
            else:
                written = self.store.batch_put_from_multi_buffers(
                    chosen, [ptrs[i] for i in missing], [sizes[i] for i in missing], self.replica
                )
            for index, code in zip(missing, written):
                results[index] = code
        return results

    def _transfer(self, name: str, keys: List[str], host_indices: Any, write: bool) -> List[bool]:
        """Moves pages ``keys`` of pool ``name`` between its host slots and HKVM."""
        if not keys:
            return []
        if name == _KV and self._kv_is_anchor():
            return [True] * len(keys)
        parts = self._parts(name)
        ptrs, sizes = self._buffers(self._pool(name), host_indices, len(keys), len(parts))
        objects = self.keys.objects(keys, parts)
        if write:
            return _pages_ok(self._write(objects, ptrs, sizes), len(parts), lambda c: c == 0)
        return _pages_ok(self._read(objects, ptrs, sizes), len(parts), lambda n: n > 0)

    # -- the zero-copy interface (interface_v1) -----------------------------------------

    def batch_get_v1(self, keys: List[str], host_indices: Any, extra_info: Any = None) -> List[bool]:
        """Reads pages straight into the host pool; per page whether it was read."""
        return self._transfer(_KV, keys, host_indices, write=False)

    def batch_set_v1(self, keys: List[str], host_indices: Any, extra_info: Any = None) -> List[bool]:
        """Writes pages straight from the host pool (pages already stored are not
        written again); per page whether it is stored."""
        return self._transfer(_KV, keys, host_indices, write=True)

    # -- existence ------------------------------------------------------------------------

    def exists(self, key: str) -> bool:
        """Whether every object of page ``key`` is stored."""
        return self.batch_exists([key]) == 1

    def batch_exists(self, keys: List[str], extra_info: Any = None) -> int:
        """How many pages from the start of ``keys`` are stored (the hit prefix)."""
        if not keys:
            return 0
        if self._kv_is_anchor():
            return len(keys)
        width = len(self.keys.kv_parts())
        stored = _pages_ok(self.store.batch_is_exist(self._keys(keys)), width, lambda e: e == 1)
        return _leading(stored)

    # -- hybrid models (v2) -----------------------------------------------------------------

    def batch_exists_v2(self, keys: List[str], pool_transfers: Any = None, extra_info: Any = None) -> Any:
        """The pages of ``keys`` restorable with every side pool of
        ``pool_transfers``: a ``PoolTransferResult`` with the KV hit, each pool's
        hit and every legal stop point (a pool with the trailing-pages policy,
        Mamba or SWA, needs only its last ``len(transfer.keys)`` pages)."""
        transfers = list(pool_transfers or [])
        kv_objects = [] if self._kv_is_anchor() else self._keys(keys)
        side = [(t, self._parts(pool_name(t.name))) for t in transfers]
        objects = kv_objects + [o for t, parts in side for o in self.keys.objects(keys, parts)]
        flags = self.store.batch_is_exist(objects) if objects else []
        if kv_objects:
            width = len(self.keys.kv_parts())
            kv_pages = _leading(_pages_ok(flags[: len(kv_objects)], width, lambda e: e == 1))
        else:
            kv_pages = len(keys)
        restorable = set(range(1, kv_pages + 1))
        hits: Dict[Any, int] = {}
        at = len(kv_objects)
        for transfer, parts in side:
            span = len(keys) * len(parts)
            present = _pages_ok(flags[at : at + span], len(parts), lambda e: e == 1)
            at += span
            if _trailing_policy(transfer):
                window = max(1, len(getattr(transfer, "keys", None) or []))
                stops = {s for s in range(1, len(keys) + 1) if all(present[max(0, s - window) : s])}
            else:
                stops = set(range(1, _leading(present) + 1))
            hits[transfer.name] = max(stops, default=0)
            restorable &= stops
        stop_points = sorted(restorable)
        try:
            return PoolTransferResult(max(stop_points, default=0), hits, stop_points)
        except TypeError:  # an SGLang whose result has no stop points
            return PoolTransferResult(max(stop_points, default=0), hits)

    def batch_get_v2(self, transfers: Any, extra_info: Any = None) -> Dict[Any, List[bool]]:
        """Reads each transfer's pages into its pool; per pool, per page a bool."""
        return {
            t.name: self._transfer(pool_name(t.name), list(t.keys or []), t.host_indices, write=False)
            for t in transfers or []
        }

    def batch_set_v2(self, transfers: Any, extra_info: Any = None) -> Dict[Any, List[bool]]:
        """Stores each transfer's pages from its pool (those stored already are
        not written again); per pool, per page a bool."""
        return {
            t.name: self._transfer(pool_name(t.name), list(t.keys or []), t.host_indices, write=True)
            for t in transfers or []
        }

    # -- the copying interface (flat page tensors, or explicit buffers) ----------------------

    def _flat_parts(self, tensor: Any) -> List[Tuple[int, int]]:
        """A flat page tensor as (address, size) per KV part."""
        parts = len(self.keys.kv_parts())
        size = _bytes_of(tensor)
        if size % parts:
            raise ValueError(f"a flat page of {size} bytes does not split into {parts} parts")
        step = size // parts
        return [(tensor.data_ptr() + i * step, step) for i in range(parts)]

    def batch_get(self, keys: List[str], target_locations: Any = None, target_sizes: Any = None) -> Any:
        """Reads pages. Given flat page tensors (SGLang's copying path): each one
        filled and returned, ``None`` for a page not stored. Given explicit
        buffers (per page a list of pointers and one of sizes): how many pages from
        the start were read."""
        if not keys or not target_locations:
            return 0
        if _is_tensor(target_locations[0]):
            values = self.store.get_batch(self._keys(keys))
            width = len(self.keys.kv_parts())
            out = []
            for page, tensor in enumerate(target_locations):
                parts = self._flat_parts(tensor)
                got = values[page * width : (page + 1) * width]
                if all(len(v) == size for v, (_, size) in zip(got, parts)):
                    for value, (address, _) in zip(got, parts):
                        ctypes.memmove(address, value, len(value))
                    out.append(tensor)
                else:
                    out.append(None)
            return out
        if target_sizes is None:
            return 0
        ptrs = [p for page in target_locations for p in _listed(page)]
        sizes = [s for page in target_sizes for s in _listed(page)]
        read = self.store.batch_get_into(self._keys(keys), ptrs, sizes)
        return _leading(_pages_ok(read, len(self.keys.kv_parts()), lambda n: n > 0))

    def get(self, key: str, target_location: Any = None, target_sizes: Any = None) -> Any:
        """Reads page ``key`` into ``target_location`` (a flat page tensor, or its
        pointers with ``target_sizes``); it when read, else ``None``."""
        if target_location is None:
            return None
        if _is_tensor(target_location):
            return self.batch_get([key], [target_location])[0]
        if target_sizes is None:
            return None
        read = self.batch_get([key], [target_location], [target_sizes])
        return target_location if read == 1 else None

    def batch_set(self, keys: List[str], values: Any = None, target_locations: Any = None, target_sizes: Any = None) -> bool:
        """Stores pages from flat page tensors (``values``) or from explicit
        buffers; whether all are stored (pages stored already count)."""
        if not keys:
            return False
        objects = self._keys(keys)
        if values is not None:
            exists = self.store.batch_is_exist(objects)
            chunks = [
                ctypes.string_at(address, size)
                for tensor in values
                for address, size in self._flat_parts(tensor)
            ]
            missing = [i for i, e in enumerate(exists) if e != 1]
            if not missing:
                return True
            code = self.store.put_batch(
                [objects[i] for i in missing], [chunks[i] for i in missing], self.replica
            )
            return code == 0
        if target_locations is None or target_sizes is None:
            return False
        ptrs = [[p] for page in target_locations for p in _listed(page)]
        sizes = [[s] for page in target_sizes for s in _listed(page)]
        return all(c == 0 for c in self._write(objects, ptrs, sizes))

    def set(self, key: str, value: Any = None, target_location: Any = None, target_sizes: Any = None) -> bool:
        """Stores page ``key`` from a flat page tensor or explicit buffers."""
        if value is not None:
            return self.batch_set([key], [value])
        if target_location is None or target_sizes is None:
            return False
        return self.batch_set([key], None, [target_location], [target_sizes])

    # -- housekeeping --------------------------------------------------------------------------

    def clear(self) -> None:
        """Removes every page of the pool (the store's tenant's only)."""
        self.store.remove_all(True)

    def close(self) -> None:
        """Unregisters the host pools and leaves the pool."""
        self.store.close()

    def get_stats(self) -> Optional[dict]:
        """No statistics beyond HKVM's own metrics."""
        return None
