"""Fixtures: one real local HKVM cluster (`hkvm local`: nats-server with JetStream,
two sub-clusters each with a leader and a standby sub-master, a global master) for
the whole session, and stores attached to its sub-clusters."""

from __future__ import annotations

import os
import re
import subprocess
import sys
import time
import uuid
from pathlib import Path

import pytest

from hkvm.store import MooncakeDistributedStore

ROOT = Path(__file__).resolve().parents[2]
CLUSTER = "pytest"


def _hkvm_binary() -> Path:
    explicit = os.environ.get("HKVM_BIN")
    if explicit:
        return Path(explicit)
    binary = ROOT / "target" / "debug" / "hkvm"
    if not binary.exists():
        subprocess.run(
            ["cargo", "build", "--locked", "-p", "hkvm-cli", "--bin", "hkvm"],
            cwd=ROOT,
            check=True,
        )
    return binary


@pytest.fixture(scope="session")
def cluster():
    """The NATS URL of a running local cluster; stopped at the end."""
    process = subprocess.Popen(
        [
            str(_hkvm_binary()), "local", "--cluster", CLUSTER, "--port", "0",
            "--metrics-base-port", "0", "--no-demo", "--node-mib", "256",
        ],
        stdout=subprocess.PIPE,
        stderr=subprocess.DEVNULL,
        text=True,
    )
    url = None
    running = False
    deadline = time.monotonic() + 60
    assert process.stdout is not None
    # Readiness: `hkvm local` prints "is running" once every service is up, then
    # the NATS URL it really uses.
    for line in process.stdout:
        running = running or "is running" in line
        found = re.search(r"NATS:\s+(nats://\S+)", line)
        if found:
            url = found.group(1)
        if (running and url) or time.monotonic() > deadline:
            break
    if not running or url is None or process.poll() is not None:
        process.kill()
        pytest.fail("hkvm local did not start")
    yield url
    process.terminate()
    try:
        process.wait(timeout=20)
    except subprocess.TimeoutExpired:
        process.kill()


def free_port() -> int:
    import socket

    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


def http_get(url: str):
    """(status, body text) of a GET; HTTP errors are answers too."""
    import urllib.error
    import urllib.request

    try:
        with urllib.request.urlopen(url, timeout=10) as answer:
            return answer.status, answer.read().decode()
    except urllib.error.HTTPError as error:
        return error.code, error.read().decode()


def _serving_admin_routes(command, ready: str):
    """Starts `command` (an `hkvm` service given `--metrics 127.0.0.1:<port>` here)
    and waits until its `/health` answers with `ready` in the body: (process, base
    URL)."""
    import urllib.error

    port = free_port()
    process = subprocess.Popen(
        [str(_hkvm_binary()), *command, "--metrics", f"127.0.0.1:{port}"],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    base = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 60
    while True:
        if process.poll() is not None:
            pytest.fail(f"hkvm {command[0]} exited")
        try:
            status, body = http_get(f"{base}/health")
            if status == 200 and ready in body:
                return process, base
        except (OSError, urllib.error.URLError):
            pass
        if time.monotonic() > deadline:
            process.kill()
            pytest.fail(f"the admin routes of hkvm {command[0]} did not answer")
        time.sleep(0.1)


def _stop(process) -> None:
    process.terminate()
    try:
        process.wait(timeout=20)
    except subprocess.TimeoutExpired:
        process.kill()


@pytest.fixture(scope="module")
def mooncake_admin(cluster):
    """The base URL of the Mooncake master's admin routes on a sub-master of sc-0:
    a third, standby instance (`hkvm submaster --metrics`), whose routes answer
    from the leader; stopped at the end of the module."""
    process, base = _serving_admin_routes(
        ["submaster", "--nats", cluster, "--cluster", CLUSTER, "--subcluster", "sc-0",
         "--id", f"sm-admin-{uuid.uuid4().hex[:8]}"],
        '"service_ready":true',
    )
    yield base
    _stop(process)


@pytest.fixture(scope="module")
def global_admin(cluster):
    """The base URL of the same routes over the whole cluster, on a global-master
    replica of its own (`hkvm globalmaster --metrics`), once it serves."""
    process, base = _serving_admin_routes(
        ["globalmaster", "--nats", cluster, "--cluster", CLUSTER,
         "--replica", f"gm-admin-{uuid.uuid4().hex[:8]}"],
        '"role":"leader"',
    )
    yield base
    _stop(process)


def address(url: str, subcluster: str) -> str:
    return f"{url}/{CLUSTER}/{subcluster}"


def open_store(url: str, subcluster: str = "sc-0", segment: int = 32 << 20, buffer: int = 16 << 20):
    store = MooncakeDistributedStore()
    code = store.setup("localhost", "P2PHANDSHAKE", segment, buffer, "tcp", "", address(url, subcluster))
    assert code == 0, f"setup returned {code}"
    return store


class RealClient:
    """An `hkvm node --dummy-port` process: the real client of dummy stores."""

    def __init__(self, url: str, subcluster: str = "sc-0"):
        import random
        import socket

        self.url = url
        self.subcluster = subcluster
        # The dummy port names an abstract socket; the listen port is the node's
        # transfer endpoint, kept across restarts so a restarted real client is
        # the same node (its mount replaces the dead one's).
        self.port = random.randint(20000, 60000)
        with socket.socket() as probe:
            probe.bind(("127.0.0.1", 0))
            self.listen_port = probe.getsockname()[1]
        self.process = None

    def start(self) -> "RealClient":
        self.process = subprocess.Popen(
            [
                str(_hkvm_binary()), "node", "--nats", self.url, "--cluster", CLUSTER,
                "--subcluster", self.subcluster, "--segment-size", "64MiB",
                "--listen", f"127.0.0.1:{self.listen_port}", "--dummy-port", str(self.port),
            ],
            stdout=subprocess.PIPE,
            stderr=subprocess.DEVNULL,
            text=True,
        )
        assert self.process.stdout is not None
        # Readiness: the line it prints once its node is mounted and it listens.
        line = self.process.stdout.readline()
        if "real client of dummies" not in line:
            self.process.kill()
            pytest.fail(f"hkvm node did not start: {line!r}")
        return self

    def kill(self) -> None:
        """SIGKILL, as a crash."""
        if self.process is not None and self.process.poll() is None:
            self.process.kill()
            self.process.wait(timeout=20)

    def stop(self) -> None:
        if self.process is not None and self.process.poll() is None:
            self.process.terminate()
            try:
                self.process.wait(timeout=20)
            except subprocess.TimeoutExpired:
                self.process.kill()


@pytest.fixture(scope="session")
def real_client(cluster):
    """A real client of sc-0 serving dummies for the session."""
    client = RealClient(cluster).start()
    yield client
    client.stop()


def open_dummy(port: int, pool: int = 8 << 20, staging: int = 4 << 20):
    store = MooncakeDistributedStore()
    code = store.setup_dummy(pool, staging, f"localhost:{port}")
    assert code == 0, f"setup_dummy returned {code}"
    return store


@pytest.fixture(params=["full", "dummy"])
def store(request, cluster):
    """A store of sc-0: a full one (this process is a node), or a dummy client of
    the session's real client. Both must give the same results and codes."""
    if request.param == "full":
        s = open_store(cluster, "sc-0")
    else:
        s = open_dummy(request.getfixturevalue("real_client").port)
    yield s
    s.close()


@pytest.fixture
def other(cluster):
    """A client-only store of sc-1."""
    s = open_store(cluster, "sc-1", segment=0)
    yield s
    s.close()


@pytest.fixture
def key():
    """A fresh key prefix for one test."""
    return f"t-{uuid.uuid4().hex[:12]}"


def python() -> str:
    return sys.executable
