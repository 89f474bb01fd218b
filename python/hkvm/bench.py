"""The Python side of ``hkvm bench python``: the operations of ``hkvm.store`` timed
from Python, one client, each for a fixed duration. ``hkvm-bench`` runs this
module and the same operations through the Rust client in the same run, and
reports their ratio.

Usage: ``python -m hkvm.bench --address nats://h:4222/<cluster>/<subcluster>
--seconds 3`` prints one JSON object: operation name to operations per second.
"""

from __future__ import annotations

import argparse
import ctypes
import json
import os
import time
from typing import Callable, Dict

from .store import MooncakeDistributedStore

KIB = 1024
MIB = 1024 * 1024


# 1 MiB values one phase writes at most: well inside the 4 GiB segment, below
# the eviction watermark, whatever the rate.
LARGE_VALUES = 1536


def _rate(
    seconds: float, step: Callable[[int], None], at_least: int = 1, at_most: int = 1 << 62
) -> float:
    """Operations per second of ``step(i)`` run for ``seconds`` (and at least
    ``at_least`` times, at most ``at_most`` times)."""
    done = 0
    started = time.perf_counter()
    deadline = started + seconds
    while True:
        step(done)
        done += 1
        now = time.perf_counter()
        if (now >= deadline and done >= at_least) or done >= at_most:
            return done / (now - started)


def _binding_rates(store: MooncakeDistributedStore, seconds: float) -> Dict[str, float]:
    """Calls per second of a plain extension function that does nothing, of the
    store's binding doing nothing (one key in, GIL released, a finished future
    waited for, one code out), and of the same through ``is_exist``'s Python
    layer: what the binding adds to every call."""
    from . import _native

    native = store._native  # noqa: SLF001 - the probe sits beside the real calls
    key = ["probe"]

    def wrapped(keys):
        # The shape of ``is_exist``: one key, a list through the native call.
        return native.idle_call(list(keys))[0]

    return {
        "noop_pyo3": _rate(seconds, lambda _: _native.noop()),
        "idle_call": _rate(seconds, lambda _: native.idle_call(key)),
        "idle_call_wrapped": _rate(seconds, lambda _: wrapped(key)),
    }


def run(address: str, seconds: float) -> Dict[str, float]:
    """Measures every operation; keys are namespaced by this process's id."""
    store = MooncakeDistributedStore()
    code = store.setup("localhost", "", 4096 * MIB, 8 * MIB, "tcp", "", address)
    if code != 0:
        raise SystemExit(f"setup failed: {code}")
    tag = f"py{os.getpid()}"
    small, large = os.urandom(4 * KIB), os.urandom(1 * MIB)
    results: Dict[str, float] = {}

    def put(prefix: str, value: bytes) -> Callable[[int], None]:
        def step(i: int) -> None:
            assert store.put(f"{tag}-{prefix}-{i}", value) == 0

        return step

    def get(prefix: str, count: int, size: int) -> Callable[[int], None]:
        def step(i: int) -> None:
            assert len(store.get(f"{tag}-{prefix}-{i % count}")) == size

        return step

    # At least 1000 small values: batch_is_exist asks for exactly those.
    results["put_4k"] = _rate(seconds, put("s", small), at_least=1000)
    results["get_4k"] = _rate(seconds, get("s", 1000, len(small)))
    results["put_1m"] = _rate(seconds, put("l", large), at_most=LARGE_VALUES)
    written = min(LARGE_VALUES, max(1, int(results["put_1m"] * seconds)))
    results["get_1m"] = _rate(seconds, get("l", written, len(large)))
    # Room for the next phase's values: the segment holds only so many.
    store.remove_by_regex(f"^{tag}-l-", True)

    buffer = ctypes.create_string_buffer(2 * MIB)
    base = ctypes.addressof(buffer)
    assert store.register_buffer(base, 2 * MIB) == 0
    ctypes.memmove(base, large, len(large))

    def put_from(i: int) -> None:
        assert store.put_from(f"{tag}-f-{i}", base, MIB) == 0

    results["put_from_1m"] = _rate(seconds, put_from, at_most=LARGE_VALUES)
    written = min(LARGE_VALUES, max(1, int(results["put_from_1m"] * seconds)))

    def get_into(i: int) -> None:
        assert store.get_into(f"{tag}-f-{i % written}", base + MIB, MIB) == MIB

    results["get_into_1m"] = _rate(seconds, get_into)
    keys = [f"{tag}-s-{i}" for i in range(1000)]
    assert store.batch_is_exist(keys) == [1] * len(keys)

    def exist(_: int) -> None:
        store.batch_is_exist(keys)

    results["batch_is_exist_1000"] = _rate(seconds, exist)
    results.update(_binding_rates(store, min(seconds, 1.0)))
    store.remove_by_regex(f"^{tag}-", True)
    store.close()
    return results


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--address", required=True, help="nats://host:port/<cluster>/<subcluster>")
    parser.add_argument("--seconds", type=float, default=3.0, help="duration of each operation")
    args = parser.parse_args()
    print(json.dumps(run(args.address, args.seconds)))


if __name__ == "__main__":
    main()
