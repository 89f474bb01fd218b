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
