"""`from mooncake.store import ...` is HKVM's with no edit: the start-up hook the
package installs (hkvm_mooncake.pth) serves `mooncake.store`, the setup address
picks HKVM or an installed Mooncake wheel, and every other `mooncake.*` module
stays the wheel's.

Each case runs in a fresh interpreter of the venv, so the hook is installed the
way it is for a user: by the .pth file at start-up. A small stand-in wheel (a
`mooncake` package on PYTHONPATH, shaped as the real one: `extend_path` in its
`__init__`, which imports from `mooncake.store`) shows which backend a call
reached."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from conftest import CLUSTER, address
from hkvm.store import ReplicateConfig, SoftPinAction

WHEEL_INIT = """\
from pkgutil import extend_path

__path__ = extend_path(__path__, __name__)
try:
    from mooncake.store import WheelOnly
except (ImportError, AttributeError):
    WheelOnly = None
"""

WHEEL_STORE = """\
CALLS = []


class ReplicateConfig:
    __slots__ = ("replica_num", "with_hard_pin", "preferred_segment")

    def __init__(self):
        self.replica_num = 1
        self.with_hard_pin = False
        self.preferred_segment = ""


class WheelOnly:
    pass


class MooncakeDistributedStore:
    def setup(self, *args, **kwargs):
        CALLS.append(["setup", list(args)])
        return 0

    def put(self, key, value, config=None):
        assert config is None or isinstance(config, ReplicateConfig), type(config)
        CALLS.append(["put", key, config.replica_num if config else None])
        return 0

    def setup_dummy(self, *args):
        CALLS.append(["setup_dummy", list(args)])
        return 0

    def get(self, key):
        return b"from the wheel"

    def close(self):
        return 0
"""


@pytest.fixture
def wheel(tmp_path) -> Path:
    """A directory holding a stand-in Mooncake wheel (`mooncake.store`,
    `mooncake.engine`)."""
    package = tmp_path / "site" / "mooncake"
    package.mkdir(parents=True)
    (package / "__init__.py").write_text(WHEEL_INIT)
    (package / "store.py").write_text(WHEEL_STORE)
    (package / "engine.py").write_text('NAME = "the wheel\'s engine"\n')
    return tmp_path / "site"


def run(script: str, *, wheel: Path = None, env: dict = None) -> dict:
    """Runs `script` in a fresh interpreter of this venv; it prints one JSON
    object, returned here."""
    environment = {
        key: value
        for key, value in os.environ.items()
        if not key.startswith(("HKVM_CLUSTER", "HKVM_SUBCLUSTER", "HKVM_MOONCAKE", "MOONCAKE_"))
    }
    environment.pop("PYTHONPATH", None)
    if wheel is not None:
        environment["PYTHONPATH"] = str(wheel)
    environment.update(env or {})
    done = subprocess.run(
        [sys.executable, "-c", textwrap.dedent(script)],
        env=environment,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == 0, done.stderr
    result = json.loads(done.stdout.strip().splitlines()[-1])
    result["stderr"] = done.stderr
    return result


PUT_GET = """
    import json
    from mooncake.store import MooncakeDistributedStore, ReplicateConfig
    store = MooncakeDistributedStore()
    setup = store.setup("localhost", "P2PHANDSHAKE", 16 << 20, 16 << 20, "tcp", "", {address!r})
    config = ReplicateConfig()
    config.replica_num = 1
    put = store.put("mooncake-import-{tag}", b"hkvm value", config) if setup == 0 else None
    got = store.get("mooncake-import-{tag}") if setup == 0 else b""
    store.close()
    print(json.dumps({{"setup": setup, "put": put, "got": got.decode(), "class": type(store).__name__}}))
"""


def test_without_a_wheel_mooncake_store_is_hkvm(cluster):
    result = run(
        """
        import json, mooncake, mooncake.store
        print(json.dumps({"store": mooncake.store.__spec__.origin, "package": mooncake.__doc__}))
        """
    )
    assert result["store"] == "hkvm.mooncake_store"
    assert "Stand-in" in result["package"]

    result = run(PUT_GET.format(address=address(cluster, "sc-0"), tag="nats"))
    assert (result["setup"], result["put"], result["got"]) == (0, 0, "hkvm value")
    assert result["class"] == "MooncakeDistributedStore"


def test_host_port_joins_the_pool_the_environment_names(cluster):
    host_port = cluster.split("://", 1)[1]
    named = {"HKVM_CLUSTER": CLUSTER, "HKVM_SUBCLUSTER": "sc-1"}
    result = run(PUT_GET.format(address=host_port, tag="host-port"), env=named)
    assert (result["setup"], result["put"], result["got"]) == (0, 0, "hkvm value")
    # LMCache's URL form.
    result = run(PUT_GET.format(address=f"mooncakestore://{host_port}", tag="lmcache"), env=named)
    assert (result["setup"], result["got"]) == (0, "hkvm value")


def test_a_pool_nobody_named_fails_setup_and_says_why(cluster):
    host_port = cluster.split("://", 1)[1]
    result = run(PUT_GET.format(address=host_port, tag="unnamed"))
    assert result["setup"] == -600
    assert "HKVM_CLUSTER" in result["stderr"] and "HKVM_SUBCLUSTER" in result["stderr"]


def test_mooncake_config_path_file_is_read(cluster, tmp_path):
    config = tmp_path / "mooncake.json"
    config.write_text(
        json.dumps(
            {
                "local_hostname": "localhost",
                "metadata_server": "P2PHANDSHAKE",
                "global_segment_size": "16MB",
                "local_buffer_size": "16MB",
                "protocol": "tcp",
                "device_name": "",
                "master_server_address": address(cluster, "sc-0"),
            }
        )
    )
    result = run(
        """
        import json
        from mooncake.store import MooncakeDistributedStore
        store = MooncakeDistributedStore()
        setup = store.setup(None)
        put = store.put("mooncake-import-config-file", b"v")
        print(json.dumps({"setup": setup, "put": put, "hostname": store.get_hostname()}))
        store.close()
        """,
        env={"MOONCAKE_CONFIG_PATH": str(config)},
    )
    assert (result["setup"], result["put"]) == (0, 0)
    assert result["hostname"].startswith("localhost:")


def test_with_a_wheel_other_addresses_and_modules_stay_the_wheels(cluster, wheel):
    result = run(
        """
        import json, mooncake
        from mooncake.engine import NAME
        from mooncake.store import MooncakeDistributedStore, ReplicateConfig, WheelOnly
        import mooncake.store
        wheel_store = MooncakeDistributedStore()
        setup = wheel_store.setup("localhost", "P2PHANDSHAKE", 1 << 20, 1 << 20, "tcp", "", "127.0.0.1:50051")
        config = ReplicateConfig()
        config.replica_num = 2
        put = wheel_store.put("k", b"v", config)
        from hkvm._mooncake_hook import real_store
        print(json.dumps({
            "engine": NAME,
            "init_saw": mooncake.WheelOnly is WheelOnly,
            "store_module": mooncake.store.__spec__.origin,
            "setup": setup, "put": put, "got": wheel_store.get("k").decode(),
            "class": type(wheel_store).__name__,
            "calls": real_store().CALLS,
        }))
        """,
        wheel=wheel,
    )
    assert result["engine"] == "the wheel's engine"
    assert result["init_saw"] is True
    assert result["store_module"] == "hkvm.mooncake_store"
    assert (result["setup"], result["put"], result["got"]) == (0, 0, "from the wheel")
    assert result["class"] == "_OnWheel"
    # HKVM's ReplicateConfig reached the wheel as the wheel's own, its setting kept.
    assert result["calls"][0][0] == "setup" and result["calls"][0][1][-1] == "127.0.0.1:50051"
    assert result["calls"][1] == ["put", "k", 2]

    # Beside the wheel, an HKVM address (or HKVM_CLUSTER) still reaches HKVM.
    result = run(PUT_GET.format(address=address(cluster, "sc-0"), tag="beside-wheel"), wheel=wheel)
    assert (result["setup"], result["got"], result["class"]) == (0, "hkvm value", "MooncakeDistributedStore")
    host_port = cluster.split("://", 1)[1]
    result = run(
        PUT_GET.format(address=host_port, tag="beside-wheel-env"),
        wheel=wheel,
        env={"HKVM_CLUSTER": CLUSTER, "HKVM_SUBCLUSTER": "sc-0"},
    )
    assert (result["setup"], result["got"]) == (0, "hkvm value")
    # HKVM_MOONCAKE=hkvm sends every address to HKVM.
    result = run(PUT_GET.format(address="127.0.0.1:50051", tag="forced"), wheel=wheel, env={"HKVM_MOONCAKE": "hkvm"})
    assert result["setup"] == -600 and "HKVM_CLUSTER" in result["stderr"]


def test_a_dummy_goes_to_the_hkvm_real_client_that_serves_its_port(real_client, wheel):
    script = """
        import json
        from mooncake.store import MooncakeDistributedStore
        store = MooncakeDistributedStore()
        setup = store.setup_dummy(16 << 20, 16 << 20, {server!r})
        print(json.dumps({{"setup": setup, "class": type(store).__name__}}))
        store.close()
    """
    result = run(script.format(server=f"127.0.0.1:{real_client.port}"), wheel=wheel)
    assert (result["setup"], result["class"]) == (0, "MooncakeDistributedStore")
    # No HKVM real client on that port: the wheel's dummy.
    result = run(script.format(server="127.0.0.1:1"), wheel=wheel)
    assert (result["setup"], result["class"]) == (0, "_OnWheel")


def test_off_leaves_mooncake_to_the_wheel(wheel):
    result = run(
        """
        import json, mooncake.store
        print(json.dumps({"file": mooncake.store.__file__}))
        """,
        wheel=wheel,
        env={"HKVM_MOONCAKE": "off"},
    )
    assert result["file"] == str(wheel / "mooncake" / "store.py")
    result = run(
        """
        import json
        try:
            import mooncake.store
            found = True
        except ModuleNotFoundError:
            found = False
        print(json.dumps({"found": found}))
        """,
        env={"HKVM_MOONCAKE": "off"},
    )
    assert result["found"] is False


def test_replicate_config_refuses_misspelt_fields():
    config = ReplicateConfig()
    config.soft_pin_action = SoftPinAction.ENABLE
    config.soft_pin_ttl_ms = 30_000
    config.nof_replica_num = 0
    with pytest.raises(AttributeError):
        config.replica_nmu = 2  # type: ignore[attr-defined]
    assert config.settings()["soft_pin_action"] == SoftPinAction.ENABLE


def _free_port() -> int:
    import socket

    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


@pytest.fixture
def mooncake_wheel_python() -> str:
    """The interpreter of a venv holding the real Mooncake wheel
    (`HKVM_MOONCAKE_PYTHON`; scripts/test installs the pinned one)."""
    python = os.environ.get("HKVM_MOONCAKE_PYTHON")
    if not python:
        pytest.skip("HKVM_MOONCAKE_PYTHON names no interpreter with the Mooncake wheel (scripts/test sets it)")
    return python


def test_beside_the_real_mooncake_wheel(cluster, mooncake_admin, mooncake_wheel_python, tmp_path):
    """The real wheel (a pybind11 `store` extension, whose loading enters itself
    into sys.modules) beside HKVM's hook, installed as the wheel installs it (the
    .pth processed as at start-up): a Mooncake address reaches a real
    `mooncake_master`, an HKVM address reaches HKVM, in one process. The same
    `get_into_ranges` and `get_replica_desc` calls answer alike on both (codes,
    bytes copied, descriptor shapes). With a key stored on each, the real
    master's HTTP routes (its `--metrics_port`) and a sub-master's answer with the
    same statuses and every field Mooncake's has."""
    import shutil
    import socket
    import time

    hook = tmp_path / "hook"
    hook.mkdir()
    shutil.copy(Path(__file__).resolve().parents[1] / "hkvm_mooncake.pth", hook)
    located = subprocess.run(
        [mooncake_wheel_python, "-c", "import mooncake, os; print(os.path.dirname(mooncake.__file__))"],
        capture_output=True, text=True, check=True,
    )
    master_binary = Path(located.stdout.strip()) / "mooncake_master"
    rpc, http, metrics = _free_port(), _free_port(), _free_port()
    master = subprocess.Popen(
        [
            str(master_binary), "--rpc_address=127.0.0.1", f"--rpc_port={rpc}",
            "--enable_http_metadata_server=true", "--http_metadata_server_host=127.0.0.1",
            f"--http_metadata_server_port={http}", f"--metrics_port={metrics}", f"--log_dir={tmp_path}",
        ],
        stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
    )
    try:
        deadline = time.monotonic() + 60
        while True:  # readiness: the master accepts RPC connections
            assert master.poll() is None, "mooncake_master exited"
            try:
                socket.create_connection(("127.0.0.1", rpc), timeout=1).close()
                break
            except OSError:
                assert time.monotonic() < deadline, "mooncake_master did not listen"
                time.sleep(0.05)
        routes = [
            "/health", "/get_all_segments", "/get_segments_detail", "/query_segment?segment=absent",
            "/query_key?key=beside-the-wheel", "/query_key?key=absent", "/query_key",
            "/batch_query_keys?keys=beside-the-wheel,absent", "/batch_query_keys?keys=",
        ]
        script = f"""
import json, site
site.addsitedir({str(hook)!r})
from mooncake.store import MooncakeDistributedStore, ReplicateConfig
import mooncake.engine, mooncake.store
on_wheel = MooncakeDistributedStore()
wheel_setup = on_wheel.setup("127.0.0.1", "http://127.0.0.1:{http}/metadata", 32 << 20, 16 << 20,
                             "tcp", "", "127.0.0.1:{rpc}")
config = ReplicateConfig()
config.with_hard_pin = True
wheel_put = on_wheel.put("beside-the-wheel", b"on mooncake", config)
wheel_get = on_wheel.get("beside-the-wheel").decode()
on_hkvm = MooncakeDistributedStore()
hkvm_setup = on_hkvm.setup("localhost", "P2PHANDSHAKE", 16 << 20, 16 << 20, "tcp", "", {address(cluster, "sc-0")!r})
hkvm_put = on_hkvm.put("beside-the-wheel", b"on hkvm")
hkvm_get = on_hkvm.get("beside-the-wheel").decode()
import ctypes
def same_calls(store):
    # get_into_ranges and the replica descriptors, called alike on both
    store.put("ranges-a", bytes(range(256)) * 4)
    store.put("ranges-b", b"B" * 100)
    buffer = ctypes.create_string_buffer(4096)
    ptr = ctypes.addressof(buffer)
    unregistered = ctypes.addressof(ctypes.create_string_buffer(64))
    registered = store.register_buffer(ptr, 4096)
    calls = [
        ([ptr], [["ranges-a", "ranges-b", "absent"]], [[[0, 10], [100], [200]]], [[[0, 1000], [5], [0]]], [[[4, 8], [10], [5]]]),
        ([ptr], [["ranges-a"]], [[[0]]], [[[1020]]], [[[10]]]),
        ([ptr], [["ranges-a"]], [[[4090]]], [[[0]]], [[[10]]]),
        ([unregistered], [["ranges-a"]], [[[0]]], [[[0]]], [[[10]]]),
        ([ptr, ptr], [["ranges-a"], ["ranges-b"]], [[[0]], [[50]]], [[[0]], [[0]]], [[[3]], [[3]]]),
        ([ptr], [["ranges-a"]], [[[0]]], [[[0]]], [[[0]]]),
        ([ptr], [["ranges-a"]], [[[0, 1]]], [[[0]]], [[[3]]]),
    ]
    results = [store.get_into_ranges(*call) for call in calls]
    described = []
    for replica in store.get_replica_desc("ranges-a"):
        where = replica.get_memory_descriptor().buffer_descriptor
        described.append([
            replica.is_memory_replica(), replica.is_disk_replica(), replica.is_local_disk_replica(),
            int(replica.status), where.size, type(where.buffer_address).__name__,
            type(where.transport_endpoint).__name__,
        ])
    try:
        replica.get_disk_descriptor()
        disk = "no error"
    except RuntimeError as error:
        disk = str(error)
    batch = sorted(store.batch_get_replica_desc(["ranges-a", "absent"]))
    missing = store.get_replica_desc("absent")
    store.unregister_buffer(ptr)
    return [registered, results, buffer.raw[:128].hex(), described, disk, batch, missing]
same = {{"wheel": same_calls(on_wheel), "hkvm": same_calls(on_hkvm)}}
import urllib.error, urllib.request
def answer(base, path):
    try:
        with urllib.request.urlopen(base + path, timeout=10) as reply:
            status, body = reply.status, reply.read().decode()
    except urllib.error.HTTPError as error:
        status, body = error.code, error.read().decode()
    try:
        return [status, json.loads(body)]
    except ValueError:
        return [status, None]
routes = {routes!r}
http = {{
    "wheel": [answer("http://127.0.0.1:{metrics}", route) for route in routes],
    "hkvm": [answer({mooncake_admin!r}, route) for route in routes],
}}
print(json.dumps({{
    "same": same,
    "http": http,
    "module": mooncake.store.__spec__.origin,
    "engine": mooncake.engine.__file__,
    "wheel": [wheel_setup, wheel_put, wheel_get, type(on_wheel).__name__],
    "hkvm": [hkvm_setup, hkvm_put, hkvm_get, type(on_hkvm).__name__],
}}))
on_hkvm.close()
on_wheel.close()
"""
        environment = {k: v for k, v in os.environ.items() if not k.startswith(("HKVM_CLUSTER", "HKVM_SUBCLUSTER", "HKVM_MOONCAKE"))}
        environment["PYTHONPATH"] = str(Path(__file__).resolve().parents[1])
        environment["MC_TCP_BIND_ADDRESS"] = "127.0.0.1"
        done = subprocess.run(
            [mooncake_wheel_python, "-c", script], env=environment, capture_output=True, text=True, timeout=120
        )
        assert done.returncode == 0, done.stderr[-4000:]
        result = json.loads(done.stdout.strip().splitlines()[-1])
    finally:
        master.kill()
        master.wait(timeout=20)
    assert result["module"] == "hkvm.mooncake_store"
    assert result["engine"].endswith("engine.so")
    assert result["wheel"] == [0, 0, "on mooncake", "_OnWheel"]
    assert result["hkvm"] == [0, 0, "on hkvm", "MooncakeDistributedStore"]
    assert result["same"]["hkvm"] == result["same"]["wheel"]
    for route, wheel, hkvm in zip(routes, result["http"]["wheel"], result["http"]["hkvm"]):
        assert hkvm[0] == wheel[0], f"{route}: HKVM answers {hkvm}, Mooncake {wheel}"
        assert _has_every_field(hkvm[1], wheel[1]), f"{route}: HKVM answers {hkvm}, Mooncake {wheel}"


def _has_every_field(hkvm, mooncake) -> bool:
    """Whether the JSON answer `hkvm` holds every field of `mooncake`'s, at every
    depth (lists by their first element; values may differ)."""
    if isinstance(mooncake, dict):
        return isinstance(hkvm, dict) and all(
            name in hkvm and _has_every_field(hkvm[name], value) for name, value in mooncake.items()
        )
    if isinstance(mooncake, list) and mooncake:
        return isinstance(hkvm, list) and bool(hkvm) and _has_every_field(hkvm[0], mooncake[0])
    return True


def test_the_calls_of_sglangs_own_mooncake_backend(cluster):
    """SGLang's `--hicache-storage-backend mooncake` (MooncakeStore in
    python/sglang/srt/mem_cache/storage/mooncake_store/mooncake_store.py of
    sgl-project/sglang, read at commit 00fe477f32b3878f64d44cc36895e1de4a113afe)
    imports `mooncake.store` and makes exactly these calls; each works on HKVM
    through the hook, with the arguments SGLang passes (SGLang itself needs torch
    and a GPU, so its calls are replayed here). Its failure paths: a setup code
    other than 0 raises (covered by the address and tenant tests), a
    register_buffer code other than 0 raises (the GPU-memory test in
    test_store.py)."""
    import ctypes
    import uuid

    from mooncake.store import MooncakeDistributedStore, ReplicateConfig

    assert hasattr(ReplicateConfig(), "group_ids")  # its group-semantics probe
    store = MooncakeDistributedStore()
    # setup(hostname, metadata, per-rank segment, local buffer, protocol, device,
    # master, transfer_engine, **kwargs): the engine and the HTTP-server keywords
    # are accepted.
    code = store.setup(
        "localhost", "P2PHANDSHAKE", 64 << 20, 16 << 20, "tcp", "", address(cluster, "sc-0"), None,
        enable_client_http_server=True, client_http_port=9300,
    )
    assert code == 0
    try:
        # warmup()
        warmup_key = "sglang_mooncake_store_warmup_key" + uuid.uuid4().hex
        assert store.put(warmup_key, bytes(4 * 1024)) == 0
        assert store.is_exist(warmup_key) == 1
        assert store.get(warmup_key) == bytes(4 * 1024)
        # register_mem_pool_host(): the host pool's buffer (a CPU tensor's data_ptr).
        page, pages = 8192, 8
        pool = ctypes.create_string_buffer(page * pages * 2)
        base = ctypes.addressof(pool)
        assert store.register_buffer(base, page * pages * 2) == 0
        for i in range(page * pages):
            pool[i] = i % 251
        prefix = f"sglang-{uuid.uuid4().hex}"
        keys = [f"{prefix}_{p}_0_k" for p in range(pages)]
        # batch_set_v1(): batch_is_exist, then batch_put_from of the missing ones.
        assert store.batch_is_exist(keys) == [0] * pages
        ptrs = [base + p * page for p in range(pages)]
        assert store.batch_put_from(keys, ptrs, [page] * pages) == [0] * pages
        # With group semantics: a ReplicateConfig carrying group_ids.
        config = ReplicateConfig()
        config.group_ids = [f"sglang-hicache:{k}" for k in keys]
        grouped = [k + "_g" for k in keys]
        assert store.batch_put_from(grouped, ptrs, [page] * pages, config) == [0] * pages
        # MLA layer_first layouts: several buffers per object.
        multi = [k + "_m" for k in keys[:2]]
        halves = [[base + p * page, base + p * page + page // 2] for p in range(2)]
        sizes = [[page // 2, page // 2] for _ in range(2)]
        assert store.batch_put_from_multi_buffers(multi, halves, sizes, ReplicateConfig()) == [0, 0]
        # batch_exists(): the hit prefix; batch_get_v1(): batch_get_into.
        assert store.batch_is_exist(keys + [prefix + "_missing"]) == [1] * pages + [0]
        into = [base + page * pages + p * page for p in range(pages)]
        assert store.batch_get_into(keys, into, [page] * pages) == [page] * pages
        assert pool[page * pages : page * pages * 2] == pool[: page * pages]
        out = [[base + page * pages + p * page, base + page * pages + p * page + page // 2] for p in range(2)]
        assert store.batch_get_into_multi_buffers(multi, out, sizes) == [page, page]
        # clear(): remove_all() without force.
        assert store.remove_all() >= 0
    finally:
        store.close()


def test_tenants_see_and_remove_only_their_own_keys(cluster):
    """Mooncake's `tenant_id` (setup keyword, or the dict's and configuration
    file's key): each tenant has its own key space in one pool. The same key
    under two tenants holds two values; no tenant sees, removes or clears
    another's; an invalid name fails setup with -600."""
    import uuid

    from mooncake.store import MooncakeDistributedStore

    at = address(cluster, "sc-0")
    run = uuid.uuid4().hex[:8]
    stores = {}
    for tenant in (f"a-{run}", f"b-{run}", "default"):
        store = MooncakeDistributedStore()
        if tenant == f"b-{run}":
            code = store.setup({"local_hostname": "localhost", "master_server_address": at, "tenant_id": tenant})
        else:
            code = store.setup("localhost", "P2PHANDSHAKE", 0, 16 << 20, "tcp", "", at, tenant_id=tenant)
        assert code == 0, tenant
        stores[tenant] = store
    a, b, default = stores[f"a-{run}"], stores[f"b-{run}"], stores["default"]
    key = f"tenant-page-{run}"
    try:
        assert a.put(key, b"of a") == 0
        assert b.put(key, b"of b") == 0
        assert default.is_exist(key) == 0
        assert a.get(key) == b"of a" and b.get(key) == b"of b"
        assert default.put(key, b"of default") == 0
        assert a.batch_is_exist([key, f"{key}-x"]) == [1, 0]
        assert default.get_size(key) == len(b"of default")
        assert default.put("\x1eforged\x1fkey", b"x") == -600, "a key in another tenant's space"
        # Removal and clearing stay inside the tenant.
        assert a.remove(key, force=True) == 0  # read above: leased without force
        assert b.get(key) == b"of b" and default.get(key) == b"of default"
        assert a.put(f"{key}-2", b"2") == 0 and a.put(f"{key}-3", b"3") == 0
        # Forced: a new leader counts every object leased for a grace period.
        assert a.remove_by_regex(f"^{key}-[23]$", force=True) == 2
        assert b.put(f"{key}-4", b"4") == 0
        assert default.remove_all(force=True) >= 1
        assert b.get(key) == b"of b" and b.get(f"{key}-4") == b"4"
        assert b.remove_all(force=True) == 2
        assert b.is_exist(key) == 0
    finally:
        for store in stores.values():
            store.close()
    bad = MooncakeDistributedStore()
    for invalid in ("_admin", "a\x00b"):
        assert bad.setup("localhost", "P2PHANDSHAKE", 0, 16 << 20, "tcp", "", at, tenant_id=invalid) == -600
    assert bad.setup("localhost", "P2PHANDSHAKE", 0, 16 << 20, "tcp", "", at, tenant_id=" ") == 0, "blank is default"
    bad.close()


def test_a_tenant_past_its_quota_gets_mooncakes_code(cluster, tmp_path):
    """A sub-master's `tenant_quotas` (its --config file) caps the bytes of a
    tenant's objects: a put past it returns -1700 (Mooncake's
    TENANT_QUOTA_EXCEEDED), other tenants put on, and a removal makes room."""
    import uuid

    from conftest import _serving_admin_routes, _stop
    from mooncake.store import MooncakeDistributedStore

    config = tmp_path / "quota.toml"
    config.write_text('[tenant_quotas]\n"q" = "10KiB"\n')
    process, _ = _serving_admin_routes(
        ["submaster", "--nats", cluster, "--cluster", CLUSTER, "--subcluster", "sc-quota",
         "--id", f"sm-quota-{uuid.uuid4().hex[:8]}", "--config", str(config)],
        '"service_ready":true',
    )
    stores = []
    try:
        at = address(cluster, "sc-quota")
        for tenant in ("q", "other"):
            store = MooncakeDistributedStore()
            assert store.setup("localhost", "P2PHANDSHAKE", 16 << 20, 16 << 20, "tcp", "", at, tenant_id=tenant) == 0
            stores.append(store)
        limited, other = stores
        value = b"v" * 4096
        assert limited.put("page-1", value) == 0
        assert limited.put("page-2", value) == 0
        assert limited.put("page-3", value) == -1700
        assert other.put("page-3", value) == 0
        assert limited.remove("page-1", force=True) == 0
        assert limited.put("page-3", value) == 0
    finally:
        for store in stores:
            store.close()
        _stop(process)
