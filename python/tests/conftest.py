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
            "--metrics-base-port", "0", "--no-demo", "--node-mib", "64",
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


def address(url: str, subcluster: str) -> str:
    return f"{url}/{CLUSTER}/{subcluster}"


def open_store(url: str, subcluster: str = "sc-0", segment: int = 32 << 20, buffer: int = 16 << 20):
    store = MooncakeDistributedStore()
    code = store.setup("localhost", "P2PHANDSHAKE", segment, buffer, "tcp", "", address(url, subcluster))
    assert code == 0, f"setup returned {code}"
    return store


@pytest.fixture
def store(cluster):
    """A store that is a node of sc-0."""
    s = open_store(cluster, "sc-0")
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
