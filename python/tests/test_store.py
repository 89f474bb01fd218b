"""`hkvm.store.MooncakeDistributedStore` against a real local cluster: every
method with its return values and Mooncake error codes."""

from __future__ import annotations

import ctypes
import hashlib
import subprocess
import threading
import time

import pytest

from conftest import address, open_store, python
from hkvm.store import BufferHandle, ErrorCode, MooncakeDistributedStore, ReplicateConfig


def registered(store, size=1 << 20):
    """A registered buffer from the store's pool (shared with the real client for
    a dummy) and its address."""
    address = store.alloc_from_mem_pool(size)
    assert address != 0
    return (ctypes.c_char * size).from_address(address), address


def test_put_get_exist_size(store, key):
    value = bytes(range(256)) * 16
    assert store.put(key, value) == 0
    assert store.get(key) == value
    assert store.is_exist(key) == 1
    assert store.get_size(key) == len(value)
    assert store.get(key + "-missing") == b""
    assert store.is_exist(key + "-missing") == 0
    assert store.get_size(key + "-missing") == ErrorCode.OBJECT_NOT_FOUND
    assert store.batch_is_exist([key, key + "-missing"]) == [1, 0]
    assert store.batch_is_exist([]) == []


def test_put_accepts_bytes_likes_and_first_writer_wins(store, key):
    assert store.put(key, bytearray(b"first")) == 0
    assert store.put(key, memoryview(b"second")) == 0, "an existing key is success"
    assert store.get(key) == b"first", "and keeps its value"
    assert store.put(key + "-e", b"") == ErrorCode.INVALID_PARAMS, "empty values are refused"


def test_batches(store, key):
    keys = [f"{key}-{i}" for i in range(20)]
    values = [bytes([i]) * (i * 100 + 1) for i in range(20)]
    assert store.put_batch(keys, values) == 0
    assert store.get_batch(keys + [key + "-missing"]) == values + [b""]
    assert store.put_batch(keys, values[:3]) == ErrorCode.INVALID_PARAMS
    assert store.batch_remove(keys[:2], True) == [0, 0]
    assert store.batch_remove(keys[:1]) == [ErrorCode.OBJECT_NOT_FOUND]


def test_put_parts_concatenates(store, key):
    assert store.put_parts(key, b"ab", bytearray(b"cd"), memoryview(b"ef")) == 0
    assert store.get(key) == b"abcdef"


def test_replicate_config(store, key):
    config = ReplicateConfig()
    config.replica_num = 2
    config.with_hard_pin = True
    config.preferred_segment = store.get_hostname()
    assert "2" in str(config)
    assert store.put(key, b"x" * 1000, config) == 0
    assert store.get(key) == b"x" * 1000
    too_many = ReplicateConfig()
    too_many.replica_num = 50
    assert store.put(key + "-many", b"y", too_many) < 0


def test_remove_respects_the_read_lease(store, key):
    assert store.put(key, b"v") == 0
    assert store.get(key) == b"v"  # takes a read lease
    assert store.remove(key) == ErrorCode.OBJECT_HAS_LEASE
    assert store.remove(key, True) == 0
    assert store.remove(key) == ErrorCode.OBJECT_NOT_FOUND
    assert store.is_exist(key) == 0


def test_upsert_inserts_or_replaces(store, key):
    assert store.put(key, b"first") == 0
    assert store.put(key, b"second") == 0, "put: the first writer wins"
    assert store.upsert(key, b"replaced") == 0
    assert store.upsert(key + "-new", b"inserted") == 0
    assert store.upsert_parts(key + "-parts", b"a", b"b") == 0
    assert store.get(key) == b"replaced"  # takes a read lease
    assert store.get(key + "-new") == b"inserted"
    assert store.get(key + "-parts") == b"ab"
    # A value a reader holds (its read lease) is replaced too, as on Mooncake.
    assert store.upsert(key, b"again") == 0
    assert store.get(key) == b"again"
    buffer, base = registered(store)
    buffer[0:8] = b"12345678"
    assert store.upsert_from(key, base, 4) == 0
    keys = [key + "-b0", key + "-b1"]
    assert store.put(keys[0], b"old") == 0
    assert store.batch_upsert_from(keys, [base, base + 4], [4, 4]) == [0, 0]
    assert store.batch_upsert_from(keys, [base], [4, 4]) == [ErrorCode.INVALID_PARAMS] * 2
    assert [store.get(k) for k in [key] + keys] == [b"1234", b"1234", b"5678"]


def test_remove_all_and_by_regex(store, other, key):
    for i in range(3):
        assert store.put(f"{key}-a-{i}", b"a") == 0
    assert store.put(f"{key}-b-0", b"b") == 0
    assert store.remove_by_regex(f"^{key}-a-", True) == 3
    assert store.is_exist(f"{key}-b-0") == 1
    assert store.remove_by_regex("(unclosed", True) == ErrorCode.INVALID_PARAMS
    removed = other.remove_all(True)
    assert removed >= 1, "remove_all reaches every sub-cluster"
    assert store.is_exist(f"{key}-b-0") == 0


def test_zero_copy_put_from_and_get_into(store, key):
    buffer, base = registered(store)
    buffer[0:5] = b"hello"
    assert store.put_from(key, base, 5) == 0
    assert store.get_into(key, base + 4096, 100) == 5
    assert buffer[4096:4101] == b"hello"
    assert store.get_into(key, base + 4096, 2) == ErrorCode.BUFFER_OVERFLOW
    assert store.get_into(key + "-missing", base, 100) == ErrorCode.OBJECT_NOT_FOUND
    outside = ctypes.create_string_buffer(64)
    assert store.get_into(key, ctypes.addressof(outside), 64) == ErrorCode.INVALID_PARAMS
    assert store.put_from(key + "-x", ctypes.addressof(outside), 5) == ErrorCode.INVALID_PARAMS
    assert store.get_into(key, base + (1 << 20) - 2, 5) == ErrorCode.INVALID_PARAMS, "runs past the end"
    assert store.unregister_buffer(base) == 0
    assert store.unregister_buffer(base) == ErrorCode.INVALID_PARAMS
    assert store.get_into(key, base + 4096, 100) == ErrorCode.INVALID_PARAMS


def test_memory_the_cpu_cannot_touch_is_refused_at_registration(store, key):
    """A GPU tensor's data_ptr() (vLLM registers its KV cache) is address space the
    CPU has no access to: CUDA reserves it as a PROT_NONE mapping. Registering
    such a range is refused (-600), so no later call dereferences it."""
    libc = ctypes.CDLL(None, use_errno=True)
    libc.mmap.restype = ctypes.c_void_p
    libc.mmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int, ctypes.c_int, ctypes.c_int, ctypes.c_long]
    libc.munmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t]
    size = 1 << 20
    prot_none, map_private_anonymous = 0, 0x02 | 0x20
    reserved = libc.mmap(None, size, prot_none, map_private_anonymous, -1, 0)
    assert reserved not in (None, ctypes.c_void_p(-1).value)
    try:
        assert store.register_buffer(reserved, size) == ErrorCode.INVALID_PARAMS
        assert store.put(key, b"v" * 4096) == 0
        assert store.get_into(key, reserved, size) == ErrorCode.INVALID_PARAMS
        # Host memory is still fine.
        buffer, base = registered(store)
        assert store.get_into(key, base, size) == 4096
        assert buffer[:4096] == b"v" * 4096
    finally:
        libc.munmap(reserved, size)


def test_zero_copy_batches_and_multi_buffers(store, key):
    buffer, base = registered(store)
    keys = [f"{key}-{i}" for i in range(4)]
    for i in range(4):
        buffer[i * 1000 : i * 1000 + 10] = bytes([65 + i]) * 10
    ptrs = [base + i * 1000 for i in range(4)]
    assert store.batch_put_from(keys, ptrs, [10] * 4) == [0] * 4
    assert store.batch_put_from(keys, ptrs[:2], [10] * 4) == [ErrorCode.INVALID_PARAMS] * 4
    out = [base + 100_000 + i * 1000 for i in range(4)]
    assert store.batch_get_into(keys, out, [10] * 4) == [10] * 4
    assert bytes(buffer[100_000:100_010]) == b"A" * 10
    assert store.batch_get_into(keys, out, [10] * 3) == [ErrorCode.INVALID_PARAMS] * 4
    # A value scattered over three buffers, read back scattered differently.
    buffer[200_000:200_003] = b"abc"
    buffer[200_100:200_104] = b"defg"
    buffer[200_200:200_201] = b"h"
    multi = [key + "-multi"]
    assert store.batch_put_from_multi_buffers(
        multi, [[base + 200_000, base + 200_100, base + 200_200]], [[3, 4, 1]]
    ) == [0]
    assert store.get(multi[0]) == b"abcdefgh"
    assert store.batch_get_into_multi_buffers(multi, [[base + 300_000, base + 300_100]], [[5, 10]]) == [8]
    assert bytes(buffer[300_000:300_005]) == b"abcde"
    assert bytes(buffer[300_100:300_103]) == b"fgh"
    assert store.batch_put_from_multi_buffers(multi, [[base]], [[1, 2]]) == [ErrorCode.INVALID_PARAMS]


def test_get_buffer(store, key):
    assert store.put(key, b"buffered") == 0
    handle = store.get_buffer(key)
    assert isinstance(handle, BufferHandle)
    assert bytes(handle) == b"buffered" and len(handle) == 8 and handle.size() == 8
    assert memoryview(handle).tobytes() == b"buffered"
    assert ctypes.string_at(handle.ptr(), 8) == b"buffered"
    assert store.get_buffer(key + "-missing") is None
    handles = store.batch_get_buffer([key, key + "-missing"])
    assert bytes(handles[0]) == b"buffered" and handles[1] is None


def test_the_staging_buffer_bounds_copying_calls(cluster, key):
    small = open_store(cluster, "sc-0", segment=8 << 20, buffer=1024)
    try:
        assert small.put(key, b"x" * 2048) == ErrorCode.BUFFER_OVERFLOW
        assert small.put(key, b"x" * 1024) == 0
        assert small.get(key) == b"x" * 1024
    finally:
        small.close()


def test_a_value_crosses_sub_clusters_in_another_process(store, cluster, key):
    value = bytes((i * 31) % 256 for i in range(300_000))
    assert store.put(key, value) == 0
    expected = hashlib.sha256(value).hexdigest()
    # Another process, a client of the other sub-cluster, reads it through the
    # global master. The global master folds the put asynchronously: poll.
    script = f"""
import hashlib, sys, time
from hkvm.store import MooncakeDistributedStore
s = MooncakeDistributedStore()
assert s.setup("localhost", "", 0, 16 << 20, "tcp", "", {address(cluster, 'sc-1')!r}) == 0
deadline = time.monotonic() + 20
while time.monotonic() < deadline:
    got = s.get({key!r})
    if got:
        break
    time.sleep(0.05)
assert hashlib.sha256(got).hexdigest() == {expected!r}, len(got)
assert s.is_exist({key!r}) == 1
print("ok")
"""
    result = subprocess.run([python(), "-c", script], capture_output=True, text=True, timeout=60)
    assert result.returncode == 0 and "ok" in result.stdout, result.stderr


def test_eight_threads_share_one_store(store, key):
    errors = []

    def hammer(thread: int) -> None:
        try:
            for i in range(40):
                k = f"{key}-{thread}-{i}"
                v = f"{thread}:{i}".encode() * 50
                assert store.put(k, v) == 0
                assert store.get(k) == v
                assert store.is_exist(k) == 1
        except Exception as error:  # noqa: BLE001 - reported below
            errors.append(error)

    threads = [threading.Thread(target=hammer, args=(t,)) for t in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert errors == []


def test_a_closed_store_answers_with_codes(cluster, key):
    s = open_store(cluster)
    assert s.health_check() == 0
    # Placed on this process's own segment, which close() unmounts.
    own = ReplicateConfig()
    own.preferred_segment = s.get_hostname()
    assert s.put(key, b"v", own) == 0
    assert s.close() == 0
    assert s.close() == 0, "closing twice is fine"
    assert s.health_check() == 1
    assert s.put(key, b"v") == ErrorCode.INVALID_PARAMS
    assert s.get(key) == b""
    assert s.is_exist(key) == -1
    assert s.batch_get_into([key], [1], [1]) == [ErrorCode.INVALID_PARAMS]
    assert s.get_hostname() == ""
    # It can be set up again; what lived on its old segment left with it.
    assert s.setup("localhost", "", 8 << 20, 1 << 20, "tcp", "", address(cluster, "sc-0")) == 0
    assert s.is_exist(key) == 0
    assert s.put(key, b"again") == 0
    assert s.get(key) == b"again"
    s.close()


def test_rdma_on_a_host_without_the_device_fails_at_once_and_says_why(cluster, caplog):
    s = MooncakeDistributedStore()
    with caplog.at_level("ERROR", logger="hkvm.store"):
        code = s.setup("localhost", "", "8MB", "1MB", "rdma", "no-such-device-0", address(cluster, "sc-0"))
    assert code == ErrorCode.INVALID_PARAMS
    assert 'no RDMA device "no-such-device-0"' in caplog.text, caplog.text
    assert s.health_check() == 1, "nothing was set up"
    assert s.setup("localhost", "", "8MB", "1MB", "infiniband-please", "", address(cluster, "sc-0")) == ErrorCode.INVALID_PARAMS
    # The same store over TCP works: the failed setup left nothing behind.
    assert s.setup("localhost", "", "8MB", "1MB", "tcp", "", address(cluster, "sc-0")) == 0
    assert s.put("rdma-then-tcp", b"value") == 0
    assert s.get("rdma-then-tcp") == b"value"
    s.close()


def test_setup_forms_and_bad_setups(cluster):
    s = MooncakeDistributedStore()
    config = {
        "local_hostname": "localhost",
        "metadata_server": "P2PHANDSHAKE",
        "global_segment_size": "8MB",
        "local_buffer_size": "1 MiB",
        "protocol": "tcp",
        "device_name": "",
        "master_server_address": address(cluster, "sc-1"),
    }
    assert s.setup(config) == 0
    assert s.get_hostname().startswith("localhost:")
    assert s.setup(config) == ErrorCode.INVALID_PARAMS, "already set up"
    s.close()
    bad = MooncakeDistributedStore()
    assert bad.setup("localhost", "", 0, 0, "tcp", "", "127.0.0.1:50051") == ErrorCode.INVALID_PARAMS
    assert bad.setup("localhost", "", 0, 0, "rdma", "mlx5_0", address(cluster, "sc-0")) == ErrorCode.INVALID_PARAMS
    assert bad.setup("localhost", "", "lots", 0, "tcp", "", address(cluster, "sc-0")) == ErrorCode.INVALID_PARAMS
    started = time.monotonic()
    assert bad.setup("localhost", "", 0, 0, "tcp", "", "nats://127.0.0.1:1/pytest/sc-0") == ErrorCode.RPC_FAIL
    assert time.monotonic() - started < 10
    assert bad.setup("localhost", "", 0, 0, "tcp", "", address(cluster, "no-such-sc")) == ErrorCode.RPC_FAIL
    assert bad.health_check() == 1


LEFT_OPEN = """
import gc, sys
from hkvm.store import MooncakeDistributedStore
store = MooncakeDistributedStore()
assert store.setup("localhost", "P2PHANDSHAKE", 32 << 20, 16 << 20, "tcp", "", {address!r}) == 0
print(store.get_hostname(), flush=True)
if {drop}:
    del store
    gc.collect()
    print("dropped", flush=True)
if {wait}:
    sys.stdin.readline()
"""


@pytest.mark.parametrize("how", ["garbage-collected", "left open at exit", "killed"])
def test_a_store_never_closed_leaves_no_segment_a_put_fails_on(cluster, key, how):
    """Mooncake's destructor tears a store down and SGLang's backend relies on it
    (its close() does nothing). A store garbage-collected, or still open when its
    program exits, unmounts its segment then. A killed one cannot: its segment
    stays mounted until the sub-master's node timeout, and a put placed there
    (here: preferring it) is placed again on a live node once its write fails.
    Either way a put lands elsewhere instead of failing on memory nobody serves
    (-800)."""
    drop = how == "garbage-collected"
    wait = how != "left open at exit"
    process = subprocess.Popen(
        [python(), "-c", LEFT_OPEN.format(address=address(cluster, "sc-0"), drop=drop, wait=wait)],
        stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True,
    )
    try:
        hostname = process.stdout.readline().strip()
        assert hostname.startswith("localhost:"), hostname
        if drop:
            assert process.stdout.readline().strip() == "dropped"
        elif how == "killed":
            process.kill()
            process.wait(timeout=60)
        else:
            assert process.wait(timeout=60) == 0
        checker = open_store(cluster, "sc-0", segment=0)
        try:
            config = ReplicateConfig()
            config.preferred_segment = hostname
            for i in range(20):
                assert checker.put(f"{key}-{i}", b"v" * 4096, config) == 0, f"put {i} went to the closed segment"
                assert checker.get(f"{key}-{i}") == b"v" * 4096
        finally:
            checker.close()
    finally:
        if process.poll() is None:
            process.stdin.close()
            process.wait(timeout=60)


def test_byte_ranges_of_values_land_in_registered_memory(cluster, key):
    """Mooncake's get_into_ranges: per buffer, key and range the bytes copied or
    a code; each value read whole and verified first."""
    store = open_store(cluster)
    try:
        value = bytes(range(256)) * 16
        assert store.put(key, value) == 0
        buffer = ctypes.create_string_buffer(8192)
        ptr = ctypes.addressof(buffer)
        assert store.register_buffer(ptr, 8192) == 0
        absent = f"{key}-absent"
        copied = store.get_into_ranges(
            [ptr], [[key, absent]], [[[0, 100, 4000], [200]]], [[[10, 0, 4090], [0]]], [[[5, 100, 6], [1]]]
        )
        assert copied == [[[5, 100, 6], [ErrorCode.OBJECT_NOT_FOUND]]]
        assert buffer.raw[0:5] == value[10:15]
        assert buffer.raw[100:200] == value[0:100]
        assert buffer.raw[4000:4006] == value[4090:4096]
        assert buffer.raw[200] == 0, "the absent key's range is left alone"
        beyond_value = store.get_into_ranges([ptr], [[key]], [[[0]]], [[[len(value) - 1]]], [[[2]]])
        beyond_buffer = store.get_into_ranges([ptr], [[key]], [[[8190]]], [[[0]]], [[[4]]])
        negative = store.get_into_ranges([ptr], [[key]], [[[-1]]], [[[0]]], [[[4]]])
        assert beyond_value == beyond_buffer == negative == [[[ErrorCode.INVALID_PARAMS]]]
        assert store.get_into_ranges([ptr], [[key]], [[[0, 1]]], [[[0]]], [[[1]]]) == [[[ErrorCode.INVALID_PARAMS] * 2]]
    finally:
        store.close()


def test_replica_descriptors_say_where_each_replica_is(cluster, key):
    store = open_store(cluster)
    try:
        assert store.put(key, b"d" * 3000, ReplicateConfig()) == 0
        (replica,) = store.get_replica_desc(key)
        assert replica.is_memory_replica() and not replica.is_disk_replica()
        assert replica.status == 3  # ReplicaStatus.COMPLETE
        where = replica.get_memory_descriptor().buffer_descriptor
        assert where.size == 3000
        host, _, port = where.transport_endpoint.rpartition(":")
        assert host and port.isdigit()
        with pytest.raises(RuntimeError):
            replica.get_disk_descriptor()
        absent = f"{key}-absent"
        assert store.get_replica_desc(absent) == []
        found = store.batch_get_replica_desc([key, absent])
        assert list(found) == [key] and found[key][0].get_memory_descriptor().buffer_descriptor.size == 3000
    finally:
        store.close()


def test_labels_choose_the_subcluster_every_process_of_a_node_joins(cluster, key, caplog):
    """`hkvm local` labels sc-0 `pool=pool-0` and sc-1 `pool=pool-1`: a store
    naming labels in place of a sub-cluster joins the one that carries them; one
    no sub-cluster carries fails setup saying which are registered."""
    chosen = MooncakeDistributedStore()
    assert chosen.setup("localhost", "P2PHANDSHAKE", 0, 16 << 20, "tcp", "", f"{cluster}/pytest/*?pool=pool-1") == 0
    named = open_store(cluster, "sc-1", segment=0)
    try:
        assert chosen.put(key, b"in sc-1") == 0
        assert named.get(key) == b"in sc-1"
    finally:
        chosen.close()
        named.close()
    nowhere = MooncakeDistributedStore()
    config = {"local_hostname": "localhost", "master_server_address": cluster.split("://")[1],
              "hkvm_cluster": "pytest", "hkvm_labels": "pool=absent"}
    assert nowhere.setup(config) == ErrorCode.INVALID_PARAMS
    assert "no live sub-cluster of pytest has the labels {pool=absent}" in caplog.text
    assert "sc-0 {pool=pool-0}" in caplog.text
