//! Where one sub-master (N = 1) and eight (N = 8) break: the sweep's load with
//! more clients (20,000 and 50,000), each point judged against what holding means
//! (op p99 at most 10 ms, no failed request, at least 95% of the offered requests
//! served). Everything shares this machine, the simulated clients and nats-server
//! included, so each point also reports how busy the machine was: a point that
//! breaks with the machine saturated says as much about the machine as about the
//! masters.

use std::path::Path;

use super::client::Deployment;
use super::{run_point, Point, Sweep, WORKLOAD};
use crate::report::{BenchResult, Printer};
use crate::BenchNats;

/// Sub-cluster counts probed.
const SUBCLUSTERS: [usize; 2] = [1, 8];
/// Client counts probed past the sweep's.
const CLIENTS: [usize; 2] = [20_000, 50_000];
/// The op p99 a point must keep to hold (µs).
const HOLD_P99_US: f64 = 10_000.0;
/// The share of the offered requests a point must serve to hold.
const HOLD_SERVED: f64 = 0.95;

/// Requests offered per second at a sweep's sizes: the operations and one ping a
/// second per client.
fn offered_per_s(sweep: &Sweep) -> f64 {
    sweep.rate + sweep.clients as f64
}

/// Whether a point held its load.
fn held(sweep: &Sweep, point: &Point) -> bool {
    point.p99_us <= HOLD_P99_US
        && point.failures == 0
        && point.requests_per_s >= HOLD_SERVED * offered_per_s(sweep)
}

/// Probes each sub-cluster count at each client count and prints each point and
/// the most clients each count held before its first break (counting `swept`, the
/// sweep's own points at its client count). Every point runs, also past a break:
/// on a noisy machine one point's p99 can break where a larger load holds, and
/// the figures say so. A point that fails to run broke: its error is printed, not
/// returned.
pub(super) async fn probe(
    nats: &BenchNats,
    exe: &Path,
    sweep: &Sweep,
    swept: &[(usize, Point)],
    printer: &mut Printer,
) {
    for n in SUBCLUSTERS {
        let mut held_up_to = 0;
        let mut broke = match swept.iter().find(|(swept_n, _)| *swept_n == n) {
            Some((_, point)) if held(sweep, point) => {
                held_up_to = sweep.clients;
                false
            }
            _ => true,
        };
        for clients in CLIENTS {
            let sizes = Sweep { clients, ..*sweep };
            eprintln!(
                "bench scale: break probe: N={n}, {clients} clients, {} ops/s offered + 1 ping/s per client",
                sizes.rate
            );
            let tag = format!("break probe, N={n} at {clients} clients");
            match run_point(nats, exe, &sizes, n, Deployment::Full).await {
                Ok(point) => {
                    print_point(printer, &tag, &sizes, &point);
                    if !held(&sizes, &point) {
                        broke = true;
                    } else if !broke {
                        held_up_to = clients;
                    }
                }
                Err(error) => {
                    eprintln!("bench scale: {tag}: the point did not run, so it broke: {error:#}");
                    broke = true;
                }
            }
        }
        printer.print(&BenchResult::new(
            WORKLOAD,
            format!(
                "N={n}: most clients held before the first break (op p99 <= 10 ms, no failure, >= 95% of requests served; {}, {} and {} clients probed)",
                sweep.clients, CLIENTS[0], CLIENTS[1]
            ),
            held_up_to as f64,
            "clients",
            "none",
            0.0,
        ));
    }
}

fn print_point(printer: &mut Printer, tag: &str, sweep: &Sweep, point: &Point) {
    let window = sweep.window.as_secs_f64();
    let rows = [
        (
            "op latency p99",
            point.p99_us,
            "us",
            "target (at most)",
            HOLD_P99_US,
        ),
        (
            "requests served per second",
            point.requests_per_s,
            "req/s",
            "requests offered per second (computed)",
            offered_per_s(sweep),
        ),
        (
            "sub-master CPU per request (all N)",
            point.sub_cpu_per_k * 1e3,
            "us",
            "target (at most)",
            20.0,
        ),
        (
            "failed requests in the window",
            point.failures as f64,
            "requests",
            "requests offered in the window (computed)",
            offered_per_s(sweep) * window,
        ),
        (
            "machine CPU busy in the window (clients, NATS and masters share it)",
            point.machine_busy * 100.0,
            "%",
            "none",
            0.0,
        ),
    ];
    for (label, value, unit, baseline, baseline_value) in rows {
        printer.print(&BenchResult::new(
            WORKLOAD,
            format!("{tag}: {label}"),
            value,
            unit,
            baseline,
            baseline_value,
        ));
    }
}
