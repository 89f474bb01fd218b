"""Dummy clients behind a real client (`hkvm node --dummy-port`): shared-memory
zero-copy calls from several processes, memory outside the shared region refused,
and failures — a dummy killed mid-put leaks nothing, a real client killed gives
its dummies an error at once and they reconnect by themselves."""

from __future__ import annotations

import ctypes
import json
import os
import re
import subprocess
import time

import pytest

from conftest import CLUSTER, RealClient, _hkvm_binary, open_dummy, open_store, python
from hkvm.store import ErrorCode, MooncakeHostMemAllocator


def test_memory_outside_the_shared_region_is_refused(real_client, key):
    store = open_dummy(real_client.port)
    try:
        private = ctypes.create_string_buffer(4096)
        assert store.register_buffer(ctypes.addressof(private), 4096) == ErrorCode.INVALID_PARAMS
        assert store.put_from(key, ctypes.addressof(private), 10) == ErrorCode.INVALID_PARAMS
        assert store.get_into(key, ctypes.addressof(private), 10) == ErrorCode.INVALID_PARAMS
        shared = store.alloc_from_mem_pool(4096)
        assert shared != 0
        ctypes.memmove(shared, b"shared", 6)
        assert store.put_from(key, shared, 6) == 0
        assert store.get(key) == b"shared"
        assert store.free_to_mem_pool(shared) == 0
        assert store.alloc_from_mem_pool(1 << 40) == 0, "larger than the pool"
    finally:
        store.close()


def test_a_dummy_reads_ranges_and_describes_replicas(real_client, key):
    store = open_dummy(real_client.port)
    try:
        shared = store.alloc_from_mem_pool(4096)
        ctypes.memmove(shared, b"0123456789", 10)
        assert store.put_from(key, shared, 10) == 0
        target = store.alloc_from_mem_pool(4096)
        assert store.get_into_ranges([target], [[key]], [[[0, 8]]], [[[3, 0]]], [[[4, 2]]]) == [[[4, 2]]]
        assert ctypes.string_at(target, 4) == b"3456"
        assert ctypes.string_at(target + 8, 2) == b"01"
        (replica,) = store.get_replica_desc(key)
        assert replica.get_memory_descriptor().buffer_descriptor.size == 10
        assert store.batch_get_replica_desc([key, f"{key}-absent"]).keys() == {key}
    finally:
        store.close()


WORKER = """
import ctypes, hashlib, sys
from hkvm.store import MooncakeDistributedStore
port, tag = int(sys.argv[1]), sys.argv[2]
s = MooncakeDistributedStore()
assert s.setup_dummy(8 << 20, 1 << 20, f"localhost:{port}") == 0
size = 256 * 1024
src, dst = s.alloc_from_mem_pool(size), s.alloc_from_mem_pool(size)
for i in range(20):
    data = hashlib.sha256(f"{tag}-{i}".encode()).digest() * (size // 32)
    ctypes.memmove(src, data, size)
    assert s.put_from(f"{tag}-{i}", src, size) == 0
for i in range(20):
    data = hashlib.sha256(f"{tag}-{i}".encode()).digest() * (size // 32)
    assert s.get_into(f"{tag}-{i}", dst, size) == size
    assert ctypes.string_at(dst, size) == data, i
print("ok")
"""


def test_eight_dummy_processes_put_from_and_get_into_byte_exact(real_client, key):
    workers = [
        subprocess.Popen(
            [python(), "-c", WORKER, str(real_client.port), f"{key}-w{n}"],
            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
        )
        for n in range(8)
    ]
    for worker in workers:
        out, err = worker.communicate(timeout=120)
        assert worker.returncode == 0 and "ok" in out, err
    cleanup = open_dummy(real_client.port)
    assert cleanup.remove_by_regex(f"^{key}-w", True) == 8 * 20
    cleanup.close()


def _dummy_mappings(pid: int) -> int:
    """How many shared regions of dummies the process maps."""
    with open(f"/proc/{pid}/maps") as maps:
        return sum(1 for line in maps if "hkvm-dummy" in line)


def _pending_puts(url: str, subcluster: str) -> int:
    out = subprocess.run(
        [str(_hkvm_binary()), "stat", "--nats", url, "--cluster", CLUSTER, "--subcluster", subcluster],
        capture_output=True, text=True, timeout=30, check=True,
    ).stdout
    found = re.search(r"\((\d+) pending puts\)", out)
    assert found, out
    return int(found.group(1))


PUTTER = """
import ctypes, sys
from hkvm.store import MooncakeDistributedStore
port, tag = int(sys.argv[1]), sys.argv[2]
s = MooncakeDistributedStore()
assert s.setup_dummy(8 << 20, 1 << 20, f"localhost:{port}") == 0
src = s.alloc_from_mem_pool(1 << 20)
print("ready", flush=True)
i = 0
while True:
    s.put_from(f"{tag}-{i}", src, 1 << 20)
    i += 1
"""


# The failure tests run their real clients in sc-1: a killed node's segment stays
# mounted until the sub-master declares it lost, and puts placed on it fail
# meanwhile; the other tests use sc-0.


def test_a_dummy_killed_mid_put_leaks_nothing(cluster, key):
    real = RealClient(cluster, "sc-1").start()
    try:
        pid = real.process.pid
        before = _dummy_mappings(pid)
        putter = subprocess.Popen(
            [python(), "-c", PUTTER, str(real.port), key],
            stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True,
        )
        assert putter.stdout.readline().strip() == "ready"
        deadline = time.monotonic() + 20
        while _dummy_mappings(pid) == before and time.monotonic() < deadline:
            time.sleep(0.05)
        assert _dummy_mappings(pid) == before + 1, "the real client maps the dummy's region"
        time.sleep(0.3)  # let it be in the middle of its put loop
        putter.kill()
        putter.wait(timeout=10)
        # The real client finishes what was in flight, then unmaps the region and
        # holds no reservation.
        deadline = time.monotonic() + 20
        while time.monotonic() < deadline:
            if _dummy_mappings(pid) == before and _pending_puts(cluster, "sc-1") == 0:
                break
            time.sleep(0.1)
        assert _dummy_mappings(pid) == before, "the dummy's shared memory was reclaimed"
        assert _pending_puts(cluster, "sc-1") == 0, "no reservation leaked"
        # And it still serves others.
        other = open_dummy(real.port)
        assert other.put(key + "-after", b"still serving") == 0
        assert other.get(key + "-after") == b"still serving"
        assert other.remove_by_regex(f"^{key}", True) >= 1
        other.close()
    finally:
        real.stop()


def test_a_killed_real_client_fails_its_dummies_at_once_and_they_reconnect(cluster, key):
    real = RealClient(cluster, "sc-1").start()
    try:
        dummy = open_dummy(real.port)
        assert dummy.put(key, b"before") == 0
        real.kill()
        started = time.monotonic()
        assert dummy.put(key + "-during", b"x") == ErrorCode.RPC_FAIL
        assert dummy.get(key) == b""
        assert dummy.health_check() == 2
        assert time.monotonic() - started < 2, "the failure is immediate, not a timeout"
        # The real client comes back on the same port: the dummy reconnects by itself.
        restarted = RealClient(cluster, "sc-1")
        restarted.port, restarted.listen_port = real.port, real.listen_port
        real = restarted.start()
        assert dummy.put(key + "-after", b"after") == 0
        assert dummy.get(key + "-after") == b"after"
        assert dummy.health_check() == 0
        dummy.close()
    finally:
        real.stop()


def test_setup_dummy_without_a_real_client_fails_cleanly():
    from hkvm.store import MooncakeDistributedStore

    s = MooncakeDistributedStore()
    assert s.setup_dummy(1 << 20, 1 << 20, "localhost:1") == ErrorCode.RPC_FAIL
    assert s.setup_dummy(1 << 20, 1 << 20, "no-port") == ErrorCode.INVALID_PARAMS
    assert s.get("k") == b""
    assert os.environ.get("HKVM_NEVER_SET") is None


def _host_mappings(pid: int) -> int:
    """How many MooncakeHostMemAllocator regions the process maps."""
    with open(f"/proc/{pid}/maps") as maps:
        return sum(1 for line in maps if "hkvm-host" in line)


def test_host_memory_allocated_before_setup_is_shared_zero_copy(real_client, key):
    """SGLang's standalone mode: the host KV pool comes from MooncakeHostMemAllocator
    before the dummy store exists; registering it shares it with the real client,
    and batch_put_from / batch_get_into on it are byte-exact."""
    allocator = MooncakeHostMemAllocator()
    page, pages = 64 * 1024, 8
    pool = allocator.alloc(page * pages)
    assert pool != 0
    store = open_dummy(real_client.port, pool=1 << 20)
    real_pid = real_client.process.pid
    try:
        assert _host_mappings(real_pid) == 0
        assert store.register_buffer(pool, page * pages) == 0
        assert _host_mappings(real_pid) == 1, "the real client maps the host memory"
        keys = [f"{key}-p{i}" for i in range(pages // 2)]
        for i in range(pages // 2):
            ctypes.memmove(pool + i * page, os.urandom(16) * (page // 16), page)
        sources = [pool + i * page for i in range(pages // 2)]
        targets = [pool + (pages // 2 + i) * page for i in range(pages // 2)]
        assert store.batch_put_from(keys, sources, [page] * len(keys)) == [0] * len(keys)
        assert store.batch_get_into(keys, targets, [page] * len(keys)) == [page] * len(keys)
        for source, target in zip(sources, targets):
            assert ctypes.string_at(source, page) == ctypes.string_at(target, page)
        # Memory outside any allocation or registration is still refused.
        private = ctypes.create_string_buffer(page)
        assert store.register_buffer(ctypes.addressof(private), page) == ErrorCode.INVALID_PARAMS
        assert store.put_from(key, pool + page * pages - 8, 16) == ErrorCode.INVALID_PARAMS
        assert store.unregister_buffer(pool) == 0
        assert _host_mappings(real_pid) == 0, "unregistered host memory is released"
        assert store.put_from(key, pool, page) == ErrorCode.INVALID_PARAMS
        store.batch_remove(keys, True)
    finally:
        store.close()
        assert allocator.free(pool) == 0
    assert allocator.free(pool) == ErrorCode.INVALID_PARAMS, "freed twice"


def test_host_memory_is_shared_again_after_the_real_client_restarts(cluster, key):
    client = RealClient(cluster).start()
    allocator = MooncakeHostMemAllocator()
    size = 128 * 1024
    pool = allocator.alloc(size)
    store = open_dummy(client.port, pool=1 << 20)
    try:
        assert store.register_buffer(pool, size) == 0
        ctypes.memmove(pool, b"before" * 10, 60)
        assert store.put_from(f"{key}-a", pool, 60) == 0
        client.kill()
        client.start()
        # The first call reconnects and attaches the host memory again.
        ctypes.memmove(pool + 4096, b"after" * 10, 50)
        assert store.put_from(f"{key}-b", pool + 4096, 50) == 0
        assert _host_mappings(client.process.pid) == 1
        assert store.get_into(f"{key}-b", pool + 8192, 50) == 50
        assert ctypes.string_at(pool + 8192, 50) == b"after" * 10
    finally:
        store.close()
        allocator.free(pool)
        client.stop()


def test_host_memory_works_on_a_full_store(cluster, key):
    allocator = MooncakeHostMemAllocator(use_hugepage=False)
    pool = allocator.alloc(8192)
    store = open_store(cluster, "sc-0")
    try:
        assert store.register_buffer(pool, 8192) == 0
        ctypes.memmove(pool, b"x" * 100, 100)
        assert store.put_from(key, pool, 100) == 0
        assert store.get_into(key, pool + 4096, 100) == 100
        assert ctypes.string_at(pool + 4096, 100) == b"x" * 100
    finally:
        store.close()
        allocator.free(pool)


STRANGER = """
import json, logging, os
logging.basicConfig(level=logging.ERROR)
from hkvm.store import MooncakeDistributedStore
store = MooncakeDistributedStore()
# Everything loaded, this process becomes another user (nobody) for the rest.
os.setuid(65534)
print(json.dumps({{"uid": os.geteuid(), "code": store.setup_dummy(8 << 20, 4 << 20, "localhost:{port}")}}))
"""


@pytest.mark.skipif(os.geteuid() != 0, reason="running a process as another user needs root")
@pytest.mark.parametrize("trusts_the_server", [False, True])
def test_another_users_process_gets_nothing_through_the_dummy_channel(real_client, trusts_the_server):
    """The channel is an abstract socket, open to every user of the host. A
    process of another user (here nobody, uid 65534) is refused: by its own
    side, which sends its memory only to a real client of a user it trusts, and,
    when it trusts this one (HKVM_DUMMY_SERVER_UIDS), by the real client, which
    serves only its own user's dummies."""
    env = {k: v for k, v in os.environ.items() if k != "HKVM_DUMMY_SERVER_UIDS"}
    if trusts_the_server:
        env["HKVM_DUMMY_SERVER_UIDS"] = "0"
    done = subprocess.run(
        [python(), "-c", STRANGER.format(port=real_client.port)],
        env=env, capture_output=True, text=True, timeout=60,
    )
    assert done.returncode == 0, done.stderr
    result = json.loads(done.stdout.strip().splitlines()[-1])
    assert result == {"uid": 65534, "code": ErrorCode.INVALID_PARAMS}
    if trusts_the_server:
        assert "runs as uid 65534" in done.stderr, done.stderr
    else:
        assert "does not trust" in done.stderr and "uid 0" in done.stderr, done.stderr
    # The real client still serves its own user.
    own = open_dummy(real_client.port)
    assert own.health_check() == 0
    own.close()
