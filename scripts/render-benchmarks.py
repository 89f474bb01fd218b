#!/usr/bin/env python3
"""Renders docs/BENCHMARKS.md from the JSON lines of `hkvm bench all --json`, and
the scale sweep's plot (docs/bench/scale.svg, hand-built SVG: no extra packages).

usage: render-benchmarks.py RESULTS.jsonl COMMAND [SVG_PATH]
"""
import datetime
import json
import os
import platform
import re
import subprocess
import sys
from collections import OrderedDict

# What each table says and how to read it; a workload without an entry gets none.
HOW_TO_READ = {
    "events": "Encode/decode rates are per event against plain rmp-serde of the same "
    "structs; append and replay go through the event log against raw JetStream "
    "publish/replay of the same message bytes. A ratio above 1 is faster than the baseline.",
    "put": "Durable puts (acknowledged only after JetStream stored the event) against "
    "raw JetStream publish+ack at the same concurrency. Group commit is what lets many "
    "clients share one append. A put goes one of two ways: put_start (the sub-master "
    "reserves space) and put_end (it commits), or, once the client holds a space lease "
    "(a range on each replica's segment, asked for in the background), one put_commit "
    "into the lease: one request round trip instead of two, the same append. The client "
    "library puts the second way whenever it holds a lease. One client's two-request "
    "put is taken apart: put_start and a ping against a NATS request to a responder that "
    "answers at once (the floor of any RPC here), put_end against a raw publish+ack, so "
    "what is left over is the sub-master's own time. Then put_end's mean is split into "
    "the sub-master's stages, read from its own hkvm_submaster_write_stage_seconds "
    "histograms (queued: RPC front to request loop; handled: the state transition; "
    "batched: to the group commit's append; stored: JetStream's round trip; replied: "
    "acknowledgement to reply), and what is left outside the sub-master (NATS both "
    "ways, the client). A durable put here cannot be faster than one request round "
    "trip plus one fenced JetStream append (put_commit answers only once the append is "
    "stored): with the floor rows of this run that is more than the 250 us target, "
    "which assumed a faster network. The leased rows count the lease requests in their "
    "time (a 16 MiB lease holds 64 of these 256 KiB objects). The end-to-end rows time "
    "their put and get phases separately (16 clients in lockstep: each puts 32 blocks, "
    "then reads them back; removes are not timed), with space leases and, in a second "
    "run, without. The last rows are the durability profiles (docs/operations.md): the "
    "same cases on two fresh nats-servers, each with its own sub-master, run in turn "
    "case by case: the durable profile (sync_interval: always, every write fsynced "
    "before it is acknowledged: what survives a power loss) against nats-server's "
    "default (fsync every 2 minutes); the ratio is the price of power-loss safety, "
    "which group commit spreads over the puts of one append.",
    "breakdown": "Where one client's 4 KiB get and put spend their microseconds, one "
    "call at a time against a sub-master in the bench's process, each layer's p50 "
    "against the layer below it in the same run. A get of a value the client's own "
    "segment holds is one get_replica_list on the direct link to the leader, then a "
    "local copy with its checksum; under it: a plain TCP round trip of 64 bytes each "
    "way (the floor of any request), a ping on the direct link (framing, the link and "
    "the leader's direct front, no request loop), an exist of one key (adds the "
    "request loop and a lookup), a get_replica_list (adds the replica list). A put is "
    "the local copy and one put_commit into a space lease, answered once JetStream "
    "stored its event: its floor is a raw JetStream publish+ack fenced as the "
    "sub-master appends (a message id and an expected last sequence), and its mean is "
    "split into the sub-master's write stages (queued, handled, batched, stored, "
    "replied) and what is left outside it. The nats-server CPU rows are the broker's "
    "user + system time per operation over the same samples: a raw fenced append's "
    "is the CPU floor any durable put pays the broker, against the whole CPU a "
    "Mooncake master spends on a put (about 95 us for its two RPCs, measured beside "
    "it on this machine), which is why HKVM's server CPU stays above Mooncake's for "
    "one client putting one object at a time (see the mooncake table).",
    "transfer": "Data-plane GB/s against plain TCP and memcpy on the same machine. "
    "Each TCP write and read is one value answered before the next (as a put to a "
    "replica and a get are), so each row is read twice: against plain tokio TCP "
    "with the same round trip per value (a value then a 1-byte answer; a 16-byte "
    "request then the value), its floor, and against a plain stream of the same "
    "bytes with no answers at all, the pipe's capacity. The checked rows carry an "
    "xxh3-64 of every payload computed on one side and verified on the other "
    "(the store's own reads leave that to its end-to-end check against the "
    "checksum recorded at the put); unchecked rows carry none. Every TCP row goes "
    "through a node's data port checking the grant each operation carries (a keyed "
    "BLAKE3 tag, docs/security.md); the rows against \"the same port admitting all\" "
    "are that check's cost. "
    "The WAN rows copy one object with FEC stripes and pacing, over an in-process lossy "
    "link and over UDP loopback with emulated delay and loss, against the cap.",
    "interdc": "The inter-DC replicator end to end: two pools on two nats-servers, a "
    "gateway and the inter-DC master in one process, the WAN over UDP loopback with "
    "25 ms of delay and 1% loss emulated in each end's egress. Goodput is payload "
    "bytes from the first copy to the last, against the bandwidth cap (which counts "
    "wire bytes: recovery shards, headers and resends). The wire row is bytes sent per "
    "payload byte against the stripe shape's nominal (data+parity)/data: the excess is "
    "packet headers, probes and retransmissions. With 64+16 the payload can reach at "
    "most 1/1.30 = 0.77 of the cap; the rest of the gap is one probe round trip per "
    "block per lane (more lanes hide it: compare 8 and 32 lanes), and a lost probe or "
    "acknowledgement costs a feedback timeout (three round trips plus 20 ms: 170 ms "
    "here, from `--wan-rtt-ms 50`), which is why 1% loss lowers goodput a little even "
    "when FEC repairs every stripe.",
    "python": "The hkvm Python package (`hkvm.store`, the PyO3 extension) timed from "
    "Python, one client, against the same operations through the Rust client "
    "(`hkvm_client::store::Store`) in the same run, against one sub-master in this "
    "process; each client is also the node holding the values. The ratio is what the "
    "binding costs (target: at least 0.8).",
    "dummies": "16 dummy clients behind one real client (shared memory, requests over a "
    "Unix socket, the real client coalescing their metadata calls) against 16 "
    "independent clients with the same offered load in the same run: sub-master "
    "requests per operation (target ratio at most 1/8; both sides put through space "
    "leases: a full client's put is one put_commit, so its operation of put, exist and "
    "get is 3 requests, and the real client commits its dummies' puts into its own "
    "leases inside the coalesced requests), throughput, a dummy's 1 MiB "
    "put_from/get_into against a full client's (target at least 0.8), and the p50 "
    "latency coalescing adds (target at most 100 us).",
    "mooncake": "HKVM next to Mooncake Store on this machine (its PyPI wheel "
    "mooncake-transfer-engine-non-cuda 0.3.13.post1, installed into .tools/mooncake-venv; "
    "without it the workload reports nothing and says why). One Python workload runs "
    "against `mooncake.store` on a `mooncake_master` and against `hkvm.store` on a "
    "sub-master and a global master (`hkvm` processes, one sub-cluster, a nats-server of "
    "their own), the servers started afresh for every run, in alternating rounds "
    "(Mooncake, HKVM, Mooncake, HKVM). Every row is HKVM's figure against Mooncake's in "
    "the same run: a ratio above 1 is a higher rate, a longer latency or more CPU for "
    "HKVM. Each client is a node with a 2 GiB segment, over TCP on loopback, and times "
    "its calls one at a time; each phase writes a fixed number of objects that fit the "
    "segment (4,000 values of 4 KiB, 600 of 1 MiB, 300 batches of 32 pages of 64 KiB), "
    "reads every one back and calls remove_all without force, as the yardstick script "
    "does: objects read within their lease stay, so Mooncake's later puts land on "
    "segment memory never touched before and fault it in (HKVM commits its segment at "
    "mount); after a forced remove_all Mooncake reuses warm memory and its 1 MiB "
    "put_from took about 340 us p50 instead of about 850 us on this machine, faster "
    "than HKVM's durable one. A rate is items over the time inside "
    "the calls (keys for batch_is_exist, whose 1000 keys are half present; pages for the "
    "batches), pooled over the rounds; p50 and p99 are the mean of the rounds'. Every "
    "read is checked outside the timed call: it is right only when it found its key "
    "with the bytes written under it (each value differs), and the rows of right "
    "results count them. The 4-client rows run 4 client processes at once, each with "
    "its own key prefix and a quarter of the objects, taking each operation together; "
    "none removes anything before all are done; their rates are summed and their p99 "
    "averaged. Server CPU is user + system time from /proc, from the clients' start to "
    "their last result: Mooncake's master against HKVM's sub-master, global master and "
    "nats-server together, and against the two masters alone. The puts do not give the "
    "same guarantee: HKVM acknowledges a put only once JetStream stored its event (it "
    "survives a master's restart, and the global master learns of it from the stream), "
    "so every put and remove pays a JetStream append and nats-server's CPU; Mooncake's "
    "master, as started here (no HA, no oplog, no snapshots), keeps its metadata in "
    "memory only and acknowledges at once. Where a put's time goes, and its floor (a "
    "fenced JetStream append, itself a loopback round trip to nats-server plus the "
    "store), is in the breakdown table. Client CPU is the client processes' user + "
    "system time over the same span: an HKVM call's wait spins (yielding the CPU to "
    "any other runnable thread) for up to HKVM_SPIN_US (1000 us by default) while that "
    "kind of call usually answers within it, instead of sleeping at once, because on "
    "this virtual machine waking a sleeping thread costs about as much as the round "
    "trip itself (see the breakdown table: a plain loopback TCP round trip between two "
    "tasks is 60-75 us); that trade of client CPU for latency is the client CPU row.",
    "ingest": "The projector's fold rate (every stream read at once, each decoded on "
    "its own task into key operations, one writer folding them into an index sized "
    "first for the sub-masters' object counts) against a raw JetStream replay of the same streams, also all at once; "
    "each replay takes about a second and moves by 15% or more from run to run "
    "here, so both are run five times, alternating, and their medians compared. "
    "On 2 cores the raw replay alone keeps both cores busy (nats-server and the "
    "socket reads), and the fold adds its decode and apply (about 30 and 40 ns per "
    "event in process) on the same cores, so its ratio here is bound by CPU; the "
    "single writer also gets only part of a core while the readers and nats-server "
    "run. A global master folds differently: each stream's task decodes and then "
    "applies under the projection's write lock (its start-to-serving row); "
    "index bytes per key; a global master's restart to serving from a "
    "checkpoint against the same restart replaying every stream (this is the "
    "global-master part of recovery).",
    "exist": "Global batch_is_exist from clients (on their direct link to a replica "
    "once it is up, over NATS before) against in-process lookups of the very "
    "same batches on the same projection: the ratio is what the round trip and the RPC "
    "layer cost. A client phase lasts about a second and moves by 15% or more from run to "
    "run here, so each runs three times, alternating with the in-process lookup, and "
    "the run of median rate is reported (its latencies and CPU; the in-process "
    "baseline likewise). The clients send the keys as their 64-bit hashes, as the Rust client and "
    "the Python package do (hashing counted in the client's time); the last rows send "
    "the same 4-client batches as strings for comparison. The 2-replica row sends the "
    "4-client batches again with a second global-master replica in the query group "
    "(its own NATS connection and its own projection, folded from the streams, in "
    "this process): NATS spreads the requests over both; on 2 cores the replicas "
    "share the cores the one replica had, so the row shows the cost of a second "
    "replica here, not what it adds on a host of its own. CPU per key adds this "
    "process's CPU time (clients and global master) and the nats-server child's over "
    "the run, divided by the keys looked up. Any query pays a round trip (the put "
    "table's ping rows: over NATS and on the direct link), so the 1-client ratio is "
    "bounded by how long a batch's lookup takes in process against that round trip.",
    "soak": "Running for a long time: a leader and a hot standby under churn (8 clients "
    "putting into segments small enough that the leader evicts all the time, removes, "
    "one leader kill half-way) with snapshots and purges running. The end of the run "
    "against its start: stream bytes and restore time stay flat (bounded history; "
    "a restore is the median of five, timed under the load at both ends), "
    "messages held against messages ever appended show what purging removed, put p99 "
    "stays flat. Then put p99 while a large state's snapshot is written as a hot "
    "standby writes it (encode, store, read back, paced at the sub-master's "
    "defaults: the encoder at half a core, storing and reading back at 32 MiB/s; "
    "the standby is a process of its own at the lowest CPU priority, but on this "
    "machine's two cores with the leader, the clients and nats-server, where a "
    "standby would have a host of its own) against the same load without (target: "
    "at most 2x): a window before the snapshot and one after it, the load's first "
    "seconds and the standby's exit counted on neither side; the row comparing the "
    "two windows shows how much the baseline moves by itself. Then p50 beside it "
    "(a p99 that moves while the p50 does not is the snapshot's tail, not a slower "
    "leader) and p99 in each phase of the snapshot, with its length and puts: "
    "encoding, storing, reading back.",
    "recover": "Sub-master time from start to its first served request (an `exist` "
    "answered by the leader): by full replay against a raw JetStream replay of the "
    "same stream (the floor: reading the bytes), and from a snapshot plus a tail "
    "against the full replay (below 1: the snapshot pays). Failover is the time from "
    "killing the leader (its task aborted and its runtime and NATS connection shut "
    "down, as a killed process's socket closes; at most 50 ms, counted) to the first put served by "
    "the hot standby, against a cold restart without a standby; it is bounded below "
    "by the leader lease TTL. The second failover row is a client with the default "
    "retry policy: its back-off ends when the new leader announces itself, so it "
    "should add next to nothing to the first row.",
    "scale": "Simulated clients (each a node with one segment: one ping a second plus "
    "puts, gets and global batch_is_exist; with the defaults of `hkvm bench scale`: "
    "2,000 ops/s offered in all, 20% puts of 64 KiB with 2 replicas, 60% gets, 20% "
    "batch_is_exist of 64 keys; 5 s warm-up, 15 s measured) spread over N "
    "sub-clusters; masters run as child processes so their CPU time and RSS come from "
    "/proc. Every column's ratio is against N = 1 (the centralized master) in the same "
    "run. Everything (clients, NATS, all masters) shares 2 cores, so absolute "
    "latencies include queueing behind the load generator; read how cost per request "
    "and latency move with N. The last rows are the split at N = 1: the same clients "
    "and load as dummy clients, 16 behind each real client (which alone mounts, pings "
    "and sends its dummies' coalesced calls), against the full clients of the N = 1 "
    "point. The break probe runs N = 1 and N = 8 at 20,000 and 50,000 clients (same "
    "operations, one ping a second per client); its summary row counts the clients "
    "held up to the first break. Holding "
    "means op p99 at most 10 ms, no failed request and at least 95% of the offered "
    "requests served. Each probed point says how busy the machine was: at 100% the "
    "break is this machine's (the clients and nats-server share it), not only the "
    "masters'.",
    "scale-engine": "The load of docs/traffic-model.md's typical case (`hkvm bench scale "
    "--model engine`): accelerator cards as dummy clients, 8 behind each real client (one "
    "node: it mounts a segment and pings once a second; its cards' sub-master calls share "
    "its coalescing client), half prefill and half decode, spread over N sub-clusters. A "
    "prefill card serves 1.07 requests/s (Poisson): a prefetch batch_is_exist of 128 "
    "prefix-chained pages (up to 79 of them written by its earlier requests), a get of "
    "the hits, a batch_is_exist of the 55 new pages and a put of them (4.5 MB pages, one "
    "replica); a decode card offloads 28.9 pages/s: a one-key batch_is_exist and a "
    "one-key put. A batch_is_exist asks the card's sub-master, then the global master "
    "for the keys it lacks, as hkvm.store does. No bytes move: the masters' work is the "
    "same. An engine call is one batch_is_exist, get or put (a put is put_start then "
    "put_end). CPU per 1000 calls and per 1000 keys is the masters' and nats-server's "
    "CPU time over the window divided by the calls (or keys) made, at this mix; ratios "
    "are against N = 1 in the same run. The extrapolated rows multiply the N = 1 "
    "point's CPU by the calls 10,000 cards of this mix make (a linear extrapolation, "
    "not a measurement) and compare each process with one core: a sub-master's command "
    "loop is one thread, so past about one core of its work it saturates, and more "
    "sub-clusters are needed. The break probe runs N = 1 and N = 8 at half, once and "
    "twice the cards; a point holds when every call kind's p99 is at most 10 ms and no "
    "call failed. Everything shares this machine's 2 cores: the machine-busy rows say "
    "when the break is the machine's rather than the masters'.",
    "memory": "Heap bytes per object in a sub-master state (counted by the hkvm-bench "
    "binary's allocator: requested bytes, without malloc's own overhead) against the "
    "design target of 200 B; the RSS growth row shows that overhead. Bytes per key in "
    "the global index are in the ingest and exist tables.",
}

SCALE_METRIC = re.compile(r"^N=(\d+), (\d+) clients: (.*)$")


def machine() -> str:
    cpu = "unknown CPU"
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    cpu = line.split(":", 1)[1].strip()
                    break
    except OSError:
        pass
    mem_gib = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / 2**30
    return f"{os.cpu_count()} cores ({cpu}), {mem_gib:.0f} GiB, {platform.system()} {platform.release()}"


def fmt(value: float) -> str:
    """A measured value as the page shows it (a measured 0 is 0)."""
    if value == 0:
        return "0"
    for scale, suffix in ((1e9, " G"), (1e6, " M"), (1e4, " k")):
        if abs(value) >= scale:
            shown = value / scale if suffix != " k" else value / 1e3
            return f"{shown:.2f}{suffix}"
    return f"{value:.3g}" if abs(value) < 100 else f"{value:.0f}"


TARGET_RATIO_AT_MOST = re.compile(r"target ratio <= ([0-9.]+)")
TARGET_RATIO_AT_LEAST = re.compile(r"target >= ([0-9.]+)")
TARGET_AT_MOST_MORE = re.compile(r"target: at most ([0-9.]+) \S+ more")


def verdict(r: dict) -> str:
    """Whether a row with a target meets it ("" for rows without one)."""
    baseline = r["baseline"]
    if m := TARGET_RATIO_AT_MOST.search(baseline):
        met = r["ratio"] <= float(m.group(1))
    elif m := TARGET_RATIO_AT_LEAST.search(baseline):
        met = r["ratio"] >= float(m.group(1))
    elif m := TARGET_AT_MOST_MORE.search(baseline):
        met = r["value"] - r["baseline_value"] <= float(m.group(1))
    elif baseline in ("target", "design target") and r["unit"] == "bytes":
        # Size budgets: at most the target.
        met = r["value"] <= r["baseline_value"]
    elif baseline == "target (at most)":
        met = r["value"] <= r["baseline_value"]
    elif baseline == "target (at least)":
        met = r["value"] >= r["baseline_value"]
    else:
        return ""
    return " (target met)" if met else " **(misses the target)**"


# Baselines that are not measured in the run: a set figure or a computation.
CONSTANT_BASELINES = {
    "target",
    "target (at most)",
    "target (at least)",
    "design target",
    "pacing cap",
    "bandwidth cap",
    "nominal shape overhead",
    "(data + parity) / data shards",
    "HashSet<u64> per sub-cluster (computed)",
    "requests offered per second (computed)",
    "requests offered in the window (computed)",
}


def baseline_label(r: dict) -> str:
    """The baseline column: measured in the same run unless marked."""
    if r["baseline"] in CONSTANT_BASELINES:
        return f"{r['baseline']} (a constant, not measured)"
    return r["baseline"]


def plain_table(rows: list) -> None:
    print("| metric | value | unit | baseline (same run unless marked a constant) | baseline value | ratio |")
    print("|---|---:|---|---|---:|---:|")
    for r in rows:
        # No ratio against a baseline of 0 (or none): it would mean nothing.
        ratio = f"{r['ratio']:.3f}{verdict(r)}" if r["baseline_value"] else "-"
        baseline_value = "-" if r["baseline"] == "none" else fmt(r["baseline_value"])
        print(f"| {r['metric']} | {fmt(r['value'])} | {r['unit']} | {baseline_label(r)} | {baseline_value} | {ratio} |")


def scale_sweep(rows: list) -> "tuple[list, OrderedDict, list]":
    """Splits the scale rows into the N values, {metric: {N: row}} and other rows."""
    ns: list = []
    metrics: "OrderedDict[str, dict]" = OrderedDict()
    other = []
    for r in rows:
        m = SCALE_METRIC.match(r["metric"])
        if not m:
            other.append(r)
            continue
        n = int(m.group(1))
        if n not in ns:
            ns.append(n)
        metrics.setdefault(m.group(3), {})[n] = r
    return ns, metrics, other


def scale_table(rows: list) -> None:
    ns, metrics, other = scale_sweep(rows)
    clients = {SCALE_METRIC.match(r["metric"]).group(2) for r in rows if SCALE_METRIC.match(r["metric"])}
    print(f"Clients: {', '.join(sorted(clients))}. Each N column shows the value and its ratio to N = 1 (same run).")
    print()
    print("| metric | unit | " + " | ".join(f"N={n}" for n in ns) + " |")
    print("|---|---|" + "---:|" * len(ns))
    for name, by_n in metrics.items():
        cells = []
        for n in ns:
            r = by_n.get(n)
            if r is None:
                cells.append("")
            elif r["baseline"].startswith("N=1"):
                cells.append(fmt(r["value"]) + ("" if n == ns[0] else f" ({r['ratio']:.2f}x)"))
            else:
                # Failures are compared with what was offered, not with N = 1.
                cells.append(f"{r['value']:.0f} of {r['baseline_value']:.0f}")
        unit = next(iter(by_n.values()))["unit"]
        print(f"| {name} | {unit} | " + " | ".join(cells) + " |")
    if other:
        print()
        plain_table(other)


def scale_svg(rows: list) -> str:
    """A line chart of the ratio to N = 1 of the sweep's main metrics against N."""
    ns, metrics, _ = scale_sweep(rows)
    wanted = [
        ("op latency p99", "#d62728"),
        ("put latency p99", "#ff7f0e"),
        ("sub-master CPU per 1000 requests (all N)", "#1f77b4"),
        ("global-master CPU per 1000 requests", "#9467bd"),
        ("largest sub-master RSS", "#2ca02c"),
        ("sustained ops/s (puts, gets, exists)", "#7f7f7f"),
    ]
    series = [(name, color, [metrics[name][n]["ratio"] for n in ns if n in metrics.get(name, {})])
              for name, color in wanted if name in metrics]
    width, height, left, right, top, bottom = 760, 420, 70, 300, 40, 60
    plot_w, plot_h = width - left - right, height - top - bottom
    values = [v for _, _, vs in series for v in vs] or [1.0]
    y_max = max(1.2, max(values) * 1.1)
    y_min = min(0.0, min(values))

    def x(i: int) -> float:
        return left + (plot_w * i / max(1, len(ns) - 1))

    def y(v: float) -> float:
        return top + plot_h * (1 - (v - y_min) / (y_max - y_min))

    out = [f'<svg xmlns="http://www.w3.org/2000/svg" width="{width}" height="{height}" '
           f'font-family="sans-serif" font-size="12">',
           f'<rect width="{width}" height="{height}" fill="white"/>',
           f'<text x="{left}" y="22" font-size="14">scale sweep: ratio to N = 1 (same run)</text>']
    for k in range(6):
        v = y_min + (y_max - y_min) * k / 5
        out.append(f'<line x1="{left}" y1="{y(v):.1f}" x2="{left + plot_w}" y2="{y(v):.1f}" stroke="#ddd"/>')
        out.append(f'<text x="{left - 8}" y="{y(v) + 4:.1f}" text-anchor="end">{v:.2f}</text>')
    out.append(f'<line x1="{left}" y1="{y(1):.1f}" x2="{left + plot_w}" y2="{y(1):.1f}" stroke="#000" stroke-dasharray="4 3"/>')
    for i, n in enumerate(ns):
        out.append(f'<text x="{x(i):.1f}" y="{top + plot_h + 20}" text-anchor="middle">N={n}</text>')
    out.append(f'<text x="{left + plot_w / 2}" y="{height - 15}" text-anchor="middle">sub-clusters (clients per sub-cluster = clients / N)</text>')
    for j, (name, color, vs) in enumerate(series):
        points = " ".join(f"{x(i):.1f},{y(v):.1f}" for i, v in enumerate(vs))
        out.append(f'<polyline points="{points}" fill="none" stroke="{color}" stroke-width="2"/>')
        for i, v in enumerate(vs):
            out.append(f'<circle cx="{x(i):.1f}" cy="{y(v):.1f}" r="3" fill="{color}"/>')
        ly = top + 10 + 20 * j
        out.append(f'<line x1="{left + plot_w + 15}" y1="{ly}" x2="{left + plot_w + 35}" y2="{ly}" stroke="{color}" stroke-width="2"/>')
        out.append(f'<text x="{left + plot_w + 40}" y="{ly + 4}">{name}</text>')
    out.append("</svg>")
    return "\n".join(out) + "\n"


def main() -> None:
    if sys.argv[1:] == ["--machine"]:
        # For scripts/bench-report, which records the machine beside the results.
        print(machine())
        return
    results_path, command = sys.argv[1], sys.argv[2]
    svg_path = sys.argv[3] if len(sys.argv) > 3 else "docs/bench/scale.svg"
    by_workload: "OrderedDict[str, list]" = OrderedDict()
    with open(results_path) as f:
        for line in f:
            line = line.strip()
            if line:
                row = json.loads(line)
                by_workload.setdefault(row["workload"], []).append(row)
    # When and at which commit the run was made, as scripts/bench-report recorded
    # it beside the results (the page may be rendered later, from another commit).
    meta_path = os.path.splitext(results_path)[0] + ".meta.json"
    try:
        with open(meta_path) as f:
            meta = json.load(f)
        commit = meta["commit"]
        measured = datetime.datetime.fromisoformat(meta["measured_utc"])
        measured_on = meta["machine"]
    except (OSError, KeyError, ValueError):
        measured_on = machine()
        commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True).stdout.strip()
        measured = datetime.datetime.fromtimestamp(os.path.getmtime(results_path), datetime.timezone.utc)
    print("# Benchmarks")
    print()
    print("Generated by `scripts/bench-report` from the JSON lines of")
    print(f"`{command}` (saved in `{results_path}`); do not edit by hand.")
    print("Every figure is compared with a baseline measured in the same run, because")
    print("this machine is noisy: read the ratio, not the absolute value. A baseline of")
    print("`none` means no same-run comparison makes sense (a size, a count); one marked")
    print("a constant is a set figure (a target, a cap) or a computation, not a")
    print("measurement. A row with a target says whether the run met it.")
    print()
    print(f"- command: `{command}` (via `scripts/bench-report`)")
    print(f"- machine: {measured_on}")
    print(f"- date: {measured:%Y-%m-%d %H:%M} UTC")
    print(f"- commit: {commit or 'unknown'}, release build")
    print()
    for workload, rows in by_workload.items():
        print(f"## {workload}")
        print()
        if workload in HOW_TO_READ:
            print(f"How to read this: {HOW_TO_READ[workload]}")
            print()
        if workload == "scale":
            with open(svg_path, "w") as f:
                f.write(scale_svg(rows))
            rel = os.path.relpath(svg_path, "docs")
            print(f"![scale sweep: ratios to N = 1]({rel})")
            print()
            scale_table(rows)
        else:
            plain_table(rows)
        print()


if __name__ == "__main__":
    main()
