"""`hkvm.sglang.HKVMStore` (SGLang's HiCacheStorage) against a real local cluster,
with a stand-in host KV pool shaped like SGLang's page-first MHA/MLA pools."""

from __future__ import annotations

import ctypes
import importlib
import types

import pytest

from conftest import address, open_store

PAGE_BYTES = 4096


class FakeTensor:
    """The part of a torch tensor the backend reads: its address and size."""

    def __init__(self, buffer):
        self.buffer = buffer

    def data_ptr(self) -> int:
        return ctypes.addressof(self.buffer)

    def numel(self) -> int:
        return len(self.buffer)

    def element_size(self) -> int:
        return 1


class HostPool:
    """A page-first host pool: `pages` slots, one (MLA) or two (MHA: K then V)
    objects of PAGE_BYTES per page; host_indices are token slots of page_size."""

    page_size = 4

    def __init__(self, pages: int, objects_per_page: int, allocator=None):
        self.objects = objects_per_page
        size = pages * objects_per_page * PAGE_BYTES
        if allocator is None:
            self.buffer = ctypes.create_string_buffer(size)
        else:
            self.buffer = (ctypes.c_char * size).from_address(allocator.alloc(size))
        self.kv_buffer = FakeTensor(self.buffer)

    def get_page_buffer_meta(self, host_indices):
        base = ctypes.addressof(self.buffer)
        ptrs, sizes = [], []
        for first in host_indices[:: self.page_size]:
            page = first // self.page_size
            for obj in range(self.objects):
                ptrs.append(base + (page * self.objects + obj) * PAGE_BYTES)
                sizes.append(PAGE_BYTES)
        return ptrs, sizes

    def fill(self, page: int, byte: int) -> None:
        start = page * self.objects * PAGE_BYTES
        ctypes.memset(ctypes.addressof(self.buffer) + start, byte, self.objects * PAGE_BYTES)

    def page(self, page: int) -> bytes:
        start = page * self.objects * PAGE_BYTES
        return self.buffer.raw[start : start + self.objects * PAGE_BYTES]


def indices(pages):
    return [p * HostPool.page_size + t for p in pages for t in range(HostPool.page_size)]


def config(mla: bool, tp_rank: int = 0):
    return types.SimpleNamespace(
        tp_rank=tp_rank, tp_size=2, is_mla_model=mla, model_name="org/model",
        extra_config={"interface_v1": 1},
    )


@pytest.fixture(params=[False, True], ids=["mha", "mla"])
def backend(request, cluster):
    from hkvm.sglang import HKVMStore

    store = open_store(cluster, "sc-0")
    backend = HKVMStore(config(request.param), {}, store=store)
    pool = HostPool(pages=16, objects_per_page=1 if request.param else 2)
    backend.register_mem_pool_host(pool)
    yield backend, pool
    store.close()


def test_it_imports_without_sglang():
    module = importlib.import_module("hkvm.sglang")
    assert hasattr(module, "HKVMStore")


def test_keys_follow_sglangs_mooncake_backend(cluster):
    from hkvm.sglang import HKVMStore

    store = open_store(cluster, "sc-0", segment=0)
    try:
        mha = HKVMStore(config(False, tp_rank=1), {}, store=store)
        assert mha._keys(["h"]) == ["org-model_h_1_k", "org-model_h_1_v"]
        mla = HKVMStore(config(True), {}, store=store)
        assert mla._keys(["h"]) == ["org-model_h__k"]
    finally:
        store.close()


def test_set_then_get_zero_copy_and_prefix_count(backend, key):
    hkvm, pool = backend
    pages = [f"{key}-{i}" for i in range(6)]
    for i in range(6):
        pool.fill(i, 0x30 + i)
    assert hkvm.batch_set_v1(pages[:4], indices(range(4))) == [True] * 4
    assert hkvm.batch_exists(pages) == 4, "the hit prefix stops at the first missing page"
    assert hkvm.batch_exists([pages[5]] + pages[:4]) == 0
    assert hkvm.exists(pages[0]) and not hkvm.exists(pages[5])
    # Setting again is a success without rewriting.
    assert hkvm.batch_set_v1(pages[:2], indices(range(2))) == [True, True]
    # Read into other slots of the pool: byte-exact.
    got = hkvm.batch_get_v1(pages[:4] + [pages[5]], indices(range(8, 13)))
    assert got == [True, True, True, True, False]
    for i in range(4):
        assert pool.page(8 + i) == pool.page(i)
    assert hkvm.batch_get_v1([], []) == [] and hkvm.batch_set_v1([], []) == []


def test_generic_interface_with_explicit_buffers(backend, key):
    hkvm, pool = backend
    pool.fill(0, 0x41)
    ptrs, sizes = pool.get_page_buffer_meta(indices([0]))
    assert hkvm.set(key, None, ptrs, sizes)
    out_ptrs, out_sizes = pool.get_page_buffer_meta(indices([3]))
    assert hkvm.get(key, out_ptrs, out_sizes) == out_ptrs
    assert pool.page(3) == pool.page(0)
    assert hkvm.batch_get([key, key + "-missing"], [out_ptrs, out_ptrs], [out_sizes, out_sizes]) == 1
    assert hkvm.get(key + "-missing", out_ptrs, out_sizes) is None


def test_standalone_storage_is_a_dummy_of_the_hosts_real_client(real_client):
    """SGLang's standalone mode: the host pool comes from MooncakeHostMemAllocator,
    the backend is a dummy of the host's real client, pages move zero-copy."""
    from hkvm.sglang import HKVMStore
    from hkvm.store import MooncakeHostMemAllocator

    allocator = MooncakeHostMemAllocator()
    pool = HostPool(pages=8, objects_per_page=2, allocator=allocator)
    cfg = config(False)
    cfg.extra_config.update(
        {"standalone_storage": True, "client_server_address": f"localhost:{real_client.port}"}
    )
    backend = HKVMStore(cfg, {})
    try:
        backend.register_mem_pool_host(pool)
        pool.fill(0, 7)
        keys = [f"standalone-{id(pool)}"]
        assert backend.batch_set_v1(keys, indices([0])) == [True]
        pool.fill(1, 0)
        assert backend.batch_get_v1(keys, indices([1])) == [True]
        assert pool.page(1) == pool.page(0) == bytes([7]) * (2 * PAGE_BYTES)
        assert backend.batch_exists(keys) == 1
    finally:
        backend.store.close()
        allocator.free(ctypes.addressof(pool.buffer))


def test_standalone_storage_refuses_a_host_pool_it_cannot_share(real_client):
    from hkvm.sglang import HKVMStore

    cfg = config(True)
    cfg.extra_config.update(
        {"standalone_storage": True, "client_server_address": f"localhost:{real_client.port}"}
    )
    backend = HKVMStore(cfg, {})
    try:
        with pytest.raises(RuntimeError, match="MooncakeHostMemAllocator"):
            backend.register_mem_pool_host(HostPool(pages=2, objects_per_page=1))
    finally:
        backend.store.close()


class LayerFirstPool(HostPool):
    """An MLA pool in the layer_first layout: a page's object is `layers` buffers,
    one per layer, spread over the pool (each layer a region of its own)."""

    def __init__(self, pages: int, layers: int = 4):
        self.layers = layers
        super().__init__(pages, objects_per_page=1)

    def get_page_buffer_meta(self, host_indices):
        base = ctypes.addressof(self.buffer)
        per_layer = PAGE_BYTES // self.layers
        pages = len(self.buffer) // PAGE_BYTES
        ptrs, sizes = [], []
        for first in host_indices[:: self.page_size]:
            page = first // self.page_size
            for layer in range(self.layers):
                ptrs.append(base + layer * pages * per_layer + page * per_layer)
                sizes.append(per_layer)
        return ptrs, sizes


def test_a_layer_first_pool_stores_each_page_as_one_object_of_all_its_layers(cluster, key):
    from hkvm.sglang import HKVMStore

    store = open_store(cluster, "sc-0")
    try:
        backend = HKVMStore(config(True), {}, store=store)
        pool = LayerFirstPool(pages=8)
        backend.register_mem_pool_host(pool)
        ctypes.memset(ctypes.addressof(pool.buffer), 0x5A, len(pool.buffer) // 2)
        pages = [f"{key}-{i}" for i in range(2)]
        assert backend.batch_set_v1(pages, indices([0, 1])) == [True, True]
        assert store.get_size(backend._keys(pages)[0]) == PAGE_BYTES, "one object per page"
        assert backend.batch_get_v1(pages, indices([6, 7])) == [True, True]
        src_ptrs, sizes = pool.get_page_buffer_meta(indices([0, 1]))
        dst_ptrs, _ = pool.get_page_buffer_meta(indices([6, 7]))
        for src, dst, size in zip(src_ptrs, dst_ptrs, sizes):
            assert ctypes.string_at(dst, size) == ctypes.string_at(src, size)
    finally:
        store.close()


def test_the_copying_interface_fills_flat_page_tensors(backend, key):
    """SGLang without interface_v1: batch_set stores flat pages (get_data_page),
    batch_get fills the dummy flat pages it is given and returns them, None from
    the first page not stored."""
    hkvm, pool = backend
    width = len(hkvm.suffixes)
    size = width * PAGE_BYTES
    flat = [ctypes.create_string_buffer(bytes([0x60 + i]) * size, size) for i in range(2)]
    pages = [f"{key}-{i}" for i in range(2)]
    assert hkvm.batch_set(pages, [FakeTensor(f) for f in flat])
    assert hkvm.batch_set(pages, [FakeTensor(f) for f in flat]), "stored again: still a success"
    targets = [FakeTensor(ctypes.create_string_buffer(width * PAGE_BYTES)) for _ in range(3)]
    got = hkvm.batch_get(pages + [f"{key}-missing"], targets)
    assert got[:2] == targets[:2] and got[2] is None
    for i in range(2):
        assert targets[i].buffer.raw == flat[i].raw
    # The copying and zero-copy paths name pages alike.
    assert hkvm.batch_exists(pages) == 2
    assert hkvm.get(pages[0], FakeTensor(ctypes.create_string_buffer(width * PAGE_BYTES))) is not None
    assert hkvm.set(f"{key}-one", FakeTensor(flat[0]))


class MambaPool:
    """A Mamba side pool (page size 1): per slot a temporal state then two conv
    states, each its own region."""

    page_size = 1
    temporal_state_elem_size = 2

    def __init__(self, slots: int, sizes=(256, 512, 128)):
        self.sizes = sizes
        self.regions = [ctypes.create_string_buffer(slots * size) for size in sizes]

    def get_hybrid_pool_buffer(self):
        return [FakeTensor(region) for region in self.regions]

    def get_page_buffer_meta(self, host_indices):
        ptrs, sizes = [], []
        for slot in host_indices:
            for region, size in zip(self.regions, self.sizes):
                ptrs.append(ctypes.addressof(region) + slot * size)
                sizes.append(size)
        return ptrs, sizes

    def fill(self, slot: int, byte: int) -> None:
        for region, size in zip(self.regions, self.sizes):
            ctypes.memset(ctypes.addressof(region) + slot * size, byte, size)

    def slot(self, slot: int) -> bytes:
        return b"".join(r.raw[slot * s : (slot + 1) * s] for r, s in zip(self.regions, self.sizes))


def transfer(name, keys, host_indices, trailing=False):
    policy = types.SimpleNamespace(name="TRAILING_PAGES" if trailing else "ALL_PAGES")
    return types.SimpleNamespace(name=name, keys=keys, host_indices=host_indices, hit_policy=policy)


def test_hybrid_models_side_pools_through_the_v2_calls(backend, key):
    """A Mamba pool (trailing-pages policy: only the last pages' states are needed)
    beside the KV pool: batch_set_v2, batch_exists_v2's restorable stop points,
    batch_get_v2 byte-exact."""
    hkvm, pool = backend
    mamba = MambaPool(slots=8)
    hkvm.register_mem_host_pool_v2(pool, "kv")
    hkvm.register_mem_host_pool_v2(mamba, "mamba")
    pages = [f"{key}-{i}" for i in range(4)]
    assert hkvm.batch_set_v1(pages, indices(range(4))) == [True] * 4
    # The Mamba state of pages 1 and 3 only (as SGLang backs up the states at the
    # nodes it keeps).
    mamba.fill(1, 0x11)
    mamba.fill(3, 0x33)
    written = hkvm.batch_set_v2([transfer("mamba", [pages[1], pages[3]], [1, 3], trailing=True)])
    assert written == {"mamba": [True, True]}
    parts = hkvm._parts("mamba")
    assert parts[0].endswith("_temporal") and len(parts) == 3

    result = hkvm.batch_exists_v2(pages, [transfer("mamba", [pages[3]], [0], trailing=True)])
    # Every KV page is stored; a restore must stop where the Mamba state exists.
    assert result.restorable_prefix_pages == [2, 4]
    assert result.kv_hit_pages == 4
    assert result.extra_pool_hit_pages == {"mamba": 4}

    mamba.fill(6, 0)
    got = hkvm.batch_get_v2([transfer("mamba", [pages[3], f"{key}-none"], [6, 7])])
    assert got == {"mamba": [True, False]}
    assert mamba.slot(6) == mamba.slot(3)

    # An all-pages pool (an indexer) stops the restore at its first missing page.
    indexer = MambaPool(slots=8, sizes=(64,))
    indexer.temporal_state_elem_size = 0
    hkvm.register_mem_host_pool_v2(indexer, "indexer")
    assert hkvm.batch_set_v2([transfer("indexer", pages[:2], [0, 1])]) == {"indexer": [True, True]}
    result = hkvm.batch_exists_v2(pages, [transfer("indexer", pages, [])])
    assert result.kv_hit_pages == 2 and result.restorable_prefix_pages == [1, 2]


def test_tenants_do_not_see_each_others_pages(cluster, key):
    from hkvm.sglang import HKVMStore

    def tenant_backend(tenant):
        cfg = config(True)
        cfg.extra_config.update(
            {"master_server_address": address(cluster, "sc-0"), "tenant_id": tenant,
             "global_segment_size": 16 << 20}
        )
        backend = HKVMStore(cfg, {})
        pool = HostPool(pages=4, objects_per_page=1)
        backend.register_mem_pool_host(pool)
        return backend, pool

    (alice, alice_pool), (bob, bob_pool) = tenant_backend("alice"), tenant_backend("bob")
    try:
        alice_pool.fill(0, 0x0A)
        assert alice.batch_set_v1([key], indices([0])) == [True]
        assert alice.batch_exists([key]) == 1
        assert bob.batch_exists([key]) == 0, "another tenant's page"
        bob.clear()
        assert alice.batch_exists([key]) == 1, "another tenant's clear"
    finally:
        alice.close()
        bob.close()
