"""The client side of ``hkvm bench mooncake``: one Python workload run against
Mooncake Store (``mooncake.store``) or HKVM (``hkvm.store``), which share the
``MooncakeDistributedStore`` API, so that the two masters are compared on the very
same calls.

Usage: ``python workload.py {mooncake,hkvm} --master ADDR [--metadata URL]
[--prefix P] [--scale F] [--shared]``. The process joins the pool as a node with a
2 GiB segment, then follows ``hkvm-bench``'s lead on stdin and stdout: before each
step it writes ``{"event": "wait", "at": STEP}`` and waits for a line, so that
several clients run every operation at the same time and the bench reads the
servers' CPU time at the right moments. After the operations it writes
``{"event": "results", "results": {...}}``: per operation the calls, items, seconds
spent inside the timed calls, p50 and p99 in microseconds, and ``ok``, the items
whose result was right (a put acknowledged with 0; a read that found the key and
returned the bytes written under it, every byte compared outside the timed call).

Each phase writes a fixed number of objects that fit the segment, reads every one
back, then calls ``remove_all``. With ``--shared`` several clients share the pool:
each keeps its own key prefix and removes nothing until ``hkvm-bench`` says all
are done, then removes its own keys.
"""

from __future__ import annotations

import argparse
import ctypes
import json
import os
import sys
import time
from typing import Any, Callable, Dict, List, Optional, TextIO

KIB = 1024
MIB = 1024 * KIB
SEGMENT = 2048 * MIB
LOCAL_BUFFER = 256 * MIB
PAGE = 64 * KIB
PAGES = 32
STAMP = 8

# Calls per operation at --scale 1. Every phase fits a 2 GiB segment: 600 values
# of 1 MiB, or 300 batches of 32 pages of 64 KiB (600 MiB).
SMALL_PUTS = 4000
EXIST_BATCHES = 1000
LARGE_PUTS = 600
PAGE_BATCHES = 300
# batch_is_exist asks for 500 present and 500 absent keys.
PRESENT = 500

Check = Callable[[int, Any], int]


def stamp(i: int) -> bytes:
    """The first bytes of the ``i``-th value: every key's value differs, so a read
    of the wrong key is a miss."""
    return i.to_bytes(STAMP, "little")


def right(value: bytes, i: int, body: bytes) -> int:
    """1 when ``value`` is the ``i``-th value with ``body`` after its stamp, else 0."""
    return int(len(value) == STAMP + len(body) and value[:STAMP] == stamp(i) and value[STAMP:] == body)


def no_argument(i: int) -> None:
    """For calls that need nothing prepared."""
    return None


class Measured:
    """The latencies and right results of one operation's calls."""

    def __init__(self, items_per_call: int) -> None:
        self.items_per_call = items_per_call
        self.latencies: List[float] = []
        self.ok = 0

    def summary(self) -> Dict[str, float]:
        """Calls, items, seconds inside the calls, p50/p99 in µs and right items."""
        ordered = sorted(self.latencies)

        def percentile(p: float) -> float:
            index = min(len(ordered) - 1, round((len(ordered) - 1) * p))
            return ordered[index] * 1e6

        return {
            "calls": len(ordered),
            "items": len(ordered) * self.items_per_call,
            "seconds": sum(ordered),
            "p50_us": percentile(0.50),
            "p99_us": percentile(0.99),
            "ok": self.ok,
        }


def measure(
    calls: int,
    call: Callable[[int, Any], Any],
    check: Check,
    prepare: Callable[[int], Any] = no_argument,
    items_per_call: int = 1,
) -> Dict[str, float]:
    """Times ``call(i, prepare(i))`` for each ``i`` in ``range(calls)``, one call
    at a time. ``prepare(i)`` (building a value, stamping or clearing a buffer)
    runs before the clock starts and ``check(i, result)`` (how many items came
    back right) after it stops."""
    measured = Measured(items_per_call)
    for i in range(calls):
        argument = prepare(i)
        started = time.perf_counter()
        result = call(i, argument)
        measured.latencies.append(time.perf_counter() - started)
        measured.ok += check(i, result)
    return measured.summary()


def acknowledged(i: int, code: int) -> int:
    """1 for a put that returned 0."""
    return int(code == 0)


class Leader:
    """The protocol with ``hkvm-bench``: events on the original stdout, go-aheads
    on stdin. Native libraries that print to stdout write to stderr instead, so
    that nothing else lands between the events."""

    def __init__(self) -> None:
        self._events: TextIO = os.fdopen(os.dup(1), "w", buffering=1)
        os.dup2(2, 1)

    def send(self, event: Dict[str, Any]) -> None:
        """Writes one event line."""
        self._events.write(json.dumps(event) + "\n")

    def wait(self, step: str) -> None:
        """Says this client reached ``step`` and waits until the bench lets it go on."""
        self.send({"event": "wait", "at": step})
        if not sys.stdin.readline():
            raise SystemExit("hkvm-bench went away")


class Workload:
    """The operations on one store, phase by phase."""

    def __init__(self, store: Any, leader: Leader, prefix: str, scale: float, shared: bool) -> None:
        self.store = store
        self.leader = leader
        self.prefix = prefix
        self.shared = shared
        self.results: Dict[str, Dict[str, float]] = {}
        self.small_puts = max(PRESENT, int(SMALL_PUTS * scale))
        self.exist_batches = max(10, int(EXIST_BATCHES * scale))
        self.large_puts = max(10, int(LARGE_PUTS * scale))
        self.page_batches = max(10, int(PAGE_BATCHES * scale))
        # One registered region: a 1 MiB source and a 1 MiB destination for
        # put_from/get_into, then 32 source pages and 32 destination pages.
        self.region = (ctypes.c_char * (2 * MIB + 2 * PAGES * PAGE))()
        self.base = ctypes.addressof(self.region)
        self.pages = self.base + 2 * MIB
        self.body_small = os.urandom(4 * KIB - STAMP)
        self.body_large = os.urandom(MIB - STAMP)
        self.body_page = os.urandom(PAGE - STAMP)
        ctypes.memmove(self.base + STAMP, self.body_large, len(self.body_large))
        for j in range(PAGES):
            ctypes.memmove(self.pages + j * PAGE + STAMP, self.body_page, len(self.body_page))

    def key(self, kind: str, i: int) -> str:
        """The ``i``-th key of a phase."""
        return f"{self.prefix}{kind}/{i}"

    def step(self, name: str, run: Callable[[], Dict[str, float]]) -> None:
        """Runs one operation once every client is ready for it."""
        self.leader.wait(name)
        self.results[name] = run()

    def end_phase(self) -> None:
        """Removes the phase's objects, unless other clients share the pool.

        Without force, as an engine's cleanup (and the yardstick script) does:
        objects read within their lease stay. Mooncake's next puts then land on
        segment memory never touched before and fault it in; HKVM commits its
        segment at mount. (With force, Mooncake reuses warm memory: its 1 MiB
        put_from took about 340 us p50 instead of about 850 us on the test
        machine.)"""
        if not self.shared:
            removed = self.store.remove_all()
            if removed < 0:
                raise SystemExit(f"remove_all failed: {removed}")

    def run(self) -> Dict[str, Dict[str, float]]:
        """Every phase; the summaries by operation."""
        self.small_values()
        self.large_values()
        self.registered_values()
        self.paged_values()
        return self.results

    def small_values(self) -> None:
        """Put and get of 4 KiB, is_exist of each, batch_is_exist of 1000 keys."""
        store, n, body = self.store, self.small_puts, self.body_small
        self.step(
            "put_4k",
            lambda: measure(
                n,
                lambda i, value: store.put(self.key("s", i), value),
                acknowledged,
                prepare=lambda i: stamp(i) + body,
            ),
        )
        self.step(
            "get_4k",
            lambda: measure(n, lambda i, _: store.get(self.key("s", i)), lambda i, value: right(value, i, body)),
        )
        self.step(
            "is_exist",
            lambda: measure(n, lambda i, _: store.is_exist(self.key("s", i)), lambda i, found: int(found == 1)),
        )
        keys = [self.key("s", i) for i in range(PRESENT)] + [self.key("absent", i) for i in range(PRESENT)]
        expected = [1] * PRESENT + [0] * PRESENT
        self.step(
            "batch_is_exist_1000",
            lambda: measure(
                self.exist_batches,
                lambda i, _: store.batch_is_exist(keys),
                lambda i, found: sum(1 for a, b in zip(found, expected) if a == b),
                items_per_call=len(keys),
            ),
        )
        self.end_phase()

    def large_values(self) -> None:
        """Put and get of 1 MiB values passed as bytes."""
        store, n, body = self.store, self.large_puts, self.body_large
        self.step(
            "put_1m",
            lambda: measure(
                n,
                lambda i, value: store.put(self.key("l", i), value),
                acknowledged,
                prepare=lambda i: stamp(i) + body,
            ),
        )
        self.step(
            "get_1m",
            lambda: measure(n, lambda i, _: store.get(self.key("l", i)), lambda i, value: right(value, i, body)),
        )
        self.end_phase()

    def registered_values(self) -> None:
        """put_from and get_into of 1 MiB, from and into the registered region."""
        store, n = self.store, self.large_puts
        source, target = self.base, self.base + MIB

        def stamp_source(i: int) -> None:
            ctypes.memmove(source, stamp(i), STAMP)

        def clear_target(i: int) -> None:
            ctypes.memset(target, 0xFF, MIB)

        def read_right(i: int, size: int) -> int:
            return right(ctypes.string_at(target, MIB), i, self.body_large) if size == MIB else 0

        self.step(
            "put_from_1m",
            lambda: measure(
                n,
                lambda i, _: store.put_from(self.key("f", i), source, MIB),
                acknowledged,
                prepare=stamp_source,
            ),
        )
        self.step(
            "get_into_1m",
            lambda: measure(
                n, lambda i, _: store.get_into(self.key("f", i), target, MIB), read_right, prepare=clear_target
            ),
        )
        self.end_phase()

    def paged_values(self) -> None:
        """batch_put_from and batch_get_into of 32 pages of 64 KiB (a prefix of KV
        cache pages, as an inference engine's cache moves them)."""
        store, n = self.store, self.page_batches
        sources = [self.pages + j * PAGE for j in range(PAGES)]
        targets = [self.pages + (PAGES + j) * PAGE for j in range(PAGES)]
        sizes = [PAGE] * PAGES

        def keys(i: int) -> List[str]:
            return [self.key("p", i * PAGES + j) for j in range(PAGES)]

        def stamp_sources(i: int) -> List[str]:
            for j, address in enumerate(sources):
                ctypes.memmove(address, stamp(i * PAGES + j), STAMP)
            return keys(i)

        def clear_targets(i: int) -> List[str]:
            ctypes.memset(targets[0], 0xFF, PAGES * PAGE)
            return keys(i)

        def pages_right(i: int, sizes_read: List[int]) -> int:
            return sum(
                right(ctypes.string_at(address, PAGE), i * PAGES + j, self.body_page) if size == PAGE else 0
                for j, (address, size) in enumerate(zip(targets, sizes_read))
            )

        self.step(
            "batch_put_from_32x64k",
            lambda: measure(
                n,
                lambda i, batch: store.batch_put_from(batch, sources, sizes),
                lambda i, codes: sum(1 for code in codes if code == 0),
                prepare=stamp_sources,
                items_per_call=PAGES,
            ),
        )
        self.step(
            "batch_get_into_32x64k",
            lambda: measure(
                n,
                lambda i, batch: store.batch_get_into(batch, targets, sizes),
                pages_right,
                prepare=clear_targets,
                items_per_call=PAGES,
            ),
        )
        self.end_phase()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("store", choices=["mooncake", "hkvm"], help="the store module to import")
    parser.add_argument("--master", required=True, help="the master address setup() takes")
    parser.add_argument("--metadata", default="P2PHANDSHAKE", help="the metadata server setup() takes")
    parser.add_argument("--prefix", default="", help="the prefix of every key")
    parser.add_argument("--scale", type=float, default=1.0, help="objects per phase, as a share of the full sizes")
    parser.add_argument("--shared", action="store_true", help="other clients share the pool: remove only at the end")
    args = parser.parse_args()
    leader = Leader()
    if args.store == "mooncake":
        from mooncake.store import MooncakeDistributedStore
    else:
        from hkvm.store import MooncakeDistributedStore

    store = MooncakeDistributedStore()
    code = store.setup("127.0.0.1", args.metadata, SEGMENT, LOCAL_BUFFER, "tcp", "", args.master)
    if code != 0:
        raise SystemExit(f"setup failed: {code}")
    workload = Workload(store, leader, args.prefix, args.scale, args.shared)
    code = store.register_buffer(workload.base, len(workload.region))
    if code != 0:
        raise SystemExit(f"register_buffer failed: {code}")
    leader.wait("start")
    results = workload.run()
    leader.send({"event": "results", "results": results})
    # Shared pool: nobody removes its keys or unmounts its segment (which holds
    # other clients' values) before every client is done.
    leader.wait("close")
    if args.shared:
        store.remove_by_regex(f"^{args.prefix}", True)
    store.unregister_buffer(workload.base)
    store.close()


if __name__ == "__main__":
    main()
