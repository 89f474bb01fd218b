//! The engine model's rows: each point against N = 1, and 10,000 cards on
//! paper.

use super::card::{Call, CALLS};
use super::{EngineArgs, Point, WORKLOAD};
use crate::report::{BenchResult, Printer};

/// Cards in 10,000 for the extrapolation.
const FLEET: f64 = 10_000.0;

type Row = (&'static str, &'static str, fn(&Point) -> f64);

pub(super) fn print_point(
    printer: &mut Printer,
    args: &EngineArgs,
    n: usize,
    point: &Point,
    base: &Point,
) {
    let tag = format!("N={n}, {} cards", args.cards);
    let rows: [Row; 12] = [
        (
            "engine calls/s (batch_is_exist, get, put)",
            "calls/s",
            |p| p.calls_per_s,
        ),
        ("keys/s in those calls", "keys/s", |p| p.keys_per_s),
        (
            "sub-master requests/s (after coalescing; pings included)",
            "req/s",
            |p| p.sub_requests_per_s,
        ),
        ("global-master requests/s", "req/s", |p| {
            p.global_requests_per_s
        }),
        ("sub-master CPU per 1000 calls (all N)", "cpu-s", |p| {
            p.per_kcall(p.sub_cores)
        }),
        ("sub-master CPU per 1000 keys (all N)", "cpu-s", |p| {
            p.per_kkey(p.sub_cores)
        }),
        ("global-master CPU per 1000 calls", "cpu-s", |p| {
            p.per_kcall(p.global_cores)
        }),
        ("nats-server CPU per 1000 calls", "cpu-s", |p| {
            p.per_kcall(p.nats_cores)
        }),
        ("batch_is_exist p99", "us", |p| {
            p.latency[Call::Exist as usize].1
        }),
        ("get p99", "us", |p| p.latency[Call::Get as usize].1),
        ("put p99", "us", |p| p.latency[Call::Put as usize].1),
        (
            "machine CPU busy (cards, NATS and masters share it)",
            "%",
            |p| p.machine_busy * 100.0,
        ),
    ];
    for (label, unit, figure) in rows {
        printer.print(&BenchResult::new(
            WORKLOAD,
            format!("{tag}: {label}"),
            figure(point),
            unit,
            "N=1 (same run)",
            figure(base),
        ));
    }
    for (call, name) in CALLS {
        printer.print(&BenchResult::new(
            WORKLOAD,
            format!("{tag}: {name} p50"),
            point.latency[call as usize].0,
            "us",
            "N=1 (same run)",
            base.latency[call as usize].0,
        ));
    }
    printer.print(&BenchResult::new(
        WORKLOAD,
        format!("{tag}: failed calls in the window"),
        point.failures as f64,
        "calls",
        "calls made in the window (same run)",
        point.calls_per_s * point.window_s,
    ));
}

/// 10,000 cards on paper: the N = 1 point's CPU per call (at this model's
/// mix) times the fleet's calls, against one core per process (a sub-master's
/// command loop is one thread: past about one core of its work it saturates).
pub(super) fn print_fleet(printer: &mut Printer, args: &EngineArgs, one: &Point) {
    let per_card = one.calls_per_s / args.cards as f64;
    let fleet_calls = per_card * FLEET;
    let scale = fleet_calls / one.calls_per_s.max(1e-9);
    let baseline = "one core (a constant: where one process saturates)";
    for n in [1usize, 2, 4, 8, 16] {
        printer.print(&BenchResult::new(
            WORKLOAD,
            format!(
                "extrapolated, 10000 cards ({fleet_calls:.0} calls/s): cores of each sub-master at N={n}"
            ),
            one.sub_cores * scale / n as f64,
            "cores",
            baseline,
            1.0,
        ));
    }
    printer.print(&BenchResult::new(
        WORKLOAD,
        "extrapolated, 10000 cards: sub-masters needed for at most one core each",
        (one.sub_cores * scale).ceil(),
        "sub-masters",
        "none",
        0.0,
    ));
    printer.print(&BenchResult::new(
        WORKLOAD,
        "extrapolated, 10000 cards: global-master cores (all its lookups on one replica)",
        one.global_cores * scale,
        "cores",
        baseline,
        1.0,
    ));
    printer.print(&BenchResult::new(
        WORKLOAD,
        "extrapolated, 10000 cards: nats-server cores (the appends of every put)",
        one.nats_cores * scale,
        "cores",
        baseline,
        1.0,
    ));
}
