//! The engine model of the `scale` workload (`--model engine`): accelerator
//! cards that call the pool as an inference engine does, per the traffic model
//! of docs/traffic-model.md (its typical case, SGLang HiCache with the Mooncake
//! backend): cards are dummy clients, `--dummies-per-real` behind each real
//! client (one node: it mounts and pings once a second, and its cards' calls
//! share its coalescing sub-master client), spread over N sub-clusters.
//!
//! A prefill card serves Poisson requests; each is a prefetch `batch_is_exist`
//! of 128 prefix-chained pages (the first 79 written by earlier requests of the
//! card), a get of the 79 hits, a pre-put `batch_is_exist` of the 55 new pages
//! and a put of the 55 (4.29 MiB each, one replica). A decode card offloads
//! Poisson pages: a one-key `batch_is_exist` then a one-key put. A
//! `batch_is_exist` asks the card's sub-master first, then the global master
//! for the keys it lacks, as `hkvm.store` does. Values move no bytes: the
//! masters' work is the same, and that is what this measures.

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::Duration;

use anyhow::Context as _;
use hkvm_client::coalesce::CoalesceConfig;
use hkvm_client::{GlobalClient, SubmasterClient};
use hkvm_events::rpc::submaster::{MountSegment, Ping};
use hkvm_events::{NodeId, SegmentId};
use tokio::time::Instant;

mod card;
mod report;

use super::client::requests_sent;
use super::masters::Masters;
use super::percentile;
use crate::report::{BenchResult, Printer};
use crate::BenchNats;
use card::{run_card, Card, Record};
use report::{print_fleet, print_point};

const WORKLOAD: &str = "scale-engine";
/// NATS connections the simulated cards share.
const CONNECTIONS: usize = 8;

/// Options of the engine model.
#[derive(Debug, Clone, clap::Args)]
pub struct EngineArgs {
    /// Accelerator cards driven (`--model engine`; --quick uses a tenth).
    #[arg(long, default_value_t = 400)]
    pub cards: usize,
    /// Share of the cards that prefill (the rest decode).
    #[arg(long, default_value_t = 0.5)]
    pub prefill_share: f64,
    /// Requests per second of one prefill card.
    #[arg(long, default_value_t = 1.07)]
    pub prefill_rate: f64,
    /// Pages offloaded per second by one decode card.
    #[arg(long, default_value_t = 28.9)]
    pub decode_rate: f64,
    /// Cards (dummy clients) behind each real client.
    #[arg(long, default_value_t = 8)]
    pub dummies_per_real: usize,
}

/// What one point measured.
#[derive(Debug, Clone, Default)]
struct Point {
    calls_per_s: f64,
    keys_per_s: f64,
    /// Per call kind: p50 and p99 (µs).
    latency: [(f64, f64); 3],
    sub_requests_per_s: f64,
    global_requests_per_s: f64,
    /// CPU seconds per second of all sub-masters, the global master, nats-server.
    sub_cores: f64,
    global_cores: f64,
    nats_cores: f64,
    machine_busy: f64,
    failures: u64,
    /// The measured window, seconds.
    window_s: f64,
}

impl Point {
    fn per_kcall(&self, cores: f64) -> f64 {
        cores / (self.calls_per_s / 1000.0).max(1e-9)
    }

    fn per_kkey(&self, cores: f64) -> f64 {
        cores / (self.keys_per_s / 1000.0).max(1e-9)
    }
}

/// Runs one point: N sub-clusters and a global master as child processes, the
/// cards' real clients mounted, the cards driven for `warmup + window`.
async fn run_point(
    nats: &BenchNats,
    exe: &std::path::Path,
    args: &EngineArgs,
    subclusters: usize,
    (warmup, window): (Duration, Duration),
) -> anyhow::Result<Point> {
    let masters = Masters::start(nats, exe, format!("bengine{subclusters}"), subclusters).await?;
    let (cluster, ids) = (&masters.cluster, &masters.ids);
    let connections =
        futures::future::try_join_all((0..CONNECTIONS).map(|_| nats.connect())).await?;

    // Real clients: each mounts a (virtual) segment, pings, and carries its
    // cards' coalesced calls.
    let reals = args.cards.div_ceil(args.dummies_per_real.max(1));
    let global_requests = Arc::new(AtomicU64::new(0));
    let mut callers = Vec::new();
    let mut cards = Vec::new();
    let mut nodes = Vec::new();
    for real in 0..reals {
        let connection = connections[real % CONNECTIONS].clone();
        let plain = SubmasterClient::new(
            connection.clone(),
            cluster.clone(),
            ids[real % ids.len()].clone(),
        );
        let coalesced = plain.coalesced(CoalesceConfig::default());
        callers.push(coalesced.clone());
        let node = NodeId::new(format!("host-{real}"))?;
        coalesced
            .mount_segment(MountSegment {
                node: node.clone(),
                segment: SegmentId::new(format!("host-{real}-seg"))?,
                size: 1 << 42,
                endpoint: format!("10.{}.{}.1:7000", real / 256, real % 256),
                rdma: None,
            })
            .await
            .context("mounting a real client's segment")?;
        nodes.push((node, coalesced.clone()));
        let first = real * args.dummies_per_real;
        for index in first..(first + args.dummies_per_real).min(args.cards) {
            cards.push(Card {
                index,
                prefill: (index as f64 + 0.5) / args.cards as f64 <= args.prefill_share,
                submaster: coalesced.clone(),
                global: GlobalClient::new(connection.clone(), cluster.clone()),
                global_requests: Arc::clone(&global_requests),
            });
        }
    }
    masters.wait_global().await?;

    let start = Instant::now();
    let (measure_from, end) = (start + warmup, start + warmup + window);
    let pings: Vec<_> = nodes
        .into_iter()
        .map(|(node, client)| {
            tokio::spawn(async move {
                let mut tick = tokio::time::interval(Duration::from_secs(1));
                while Instant::now() < end {
                    tick.tick().await;
                    let _ = client.ping(Ping { node: node.clone() }).await;
                }
            })
        })
        .collect();
    let tasks: Vec<_> = cards
        .into_iter()
        .map(|card| tokio::spawn(run_card(card, args.clone(), measure_from, end)))
        .collect();
    tokio::time::sleep_until(measure_from).await;
    let sample = || {
        (
            masters.cpu(),
            requests_sent(&callers),
            global_requests.load(Ordering::Relaxed),
        )
    };
    let before = sample();
    tokio::time::sleep_until(end).await;
    let after = sample();
    let mut all = Record::default();
    for task in tasks {
        all.add(task.await.context("a simulated card failed")?);
    }
    for ping in pings {
        ping.abort();
    }
    drop(masters);

    let seconds = window.as_secs_f64();
    let mut latency = [(0.0, 0.0); 3];
    for (slot, times) in latency.iter_mut().zip(all.latencies.iter_mut()) {
        times.sort_unstable();
        *slot = (percentile(times, 0.5), percentile(times, 0.99));
    }
    Ok(Point {
        calls_per_s: all.calls() as f64 / seconds,
        keys_per_s: all.all_keys() as f64 / seconds,
        latency,
        sub_requests_per_s: after.1.saturating_sub(before.1) as f64 / seconds,
        global_requests_per_s: after.2.saturating_sub(before.2) as f64 / seconds,
        sub_cores: (after.0.submasters - before.0.submasters) / seconds,
        global_cores: (after.0.global - before.0.global) / seconds,
        nats_cores: (after.0.nats - before.0.nats) / seconds,
        machine_busy: after.0.machine_busy_since(&before.0),
        failures: all.failures,
        window_s: seconds,
    })
}

/// Runs the engine model at N = 1, 2, 4 (1 and 2 with `quick`) and prints
/// each point against N = 1, then the extrapolation to 10,000 cards.
///
/// # Errors
/// When a master does not start or NATS fails.
pub(super) async fn run(
    nats: &BenchNats,
    exe: &std::path::Path,
    args: &EngineArgs,
    quick: bool,
    printer: &mut Printer,
) -> anyhow::Result<()> {
    let (args, points, times) = if quick {
        let args = EngineArgs {
            cards: (args.cards / 10).max(args.dummies_per_real),
            ..args.clone()
        };
        (
            args,
            vec![1, 2],
            (Duration::from_secs(1), Duration::from_secs(2)),
        )
    } else {
        (
            args.clone(),
            vec![1, 2, 4],
            (Duration::from_secs(5), Duration::from_secs(15)),
        )
    };
    let mut results = Vec::new();
    for n in points {
        eprintln!(
            "bench scale --model engine: N={n}: {} cards ({:.0}% prefill at {}/s, decode at {}/s), \
             {} behind each real client, {} s",
            args.cards,
            args.prefill_share * 100.0,
            args.prefill_rate,
            args.decode_rate,
            args.dummies_per_real,
            times.1.as_secs_f64()
        );
        results.push((n, run_point(nats, exe, &args, n, times).await?));
    }
    let base = results[0].1.clone();
    for (n, point) in &results {
        print_point(printer, &args, *n, point, &base);
    }
    print_fleet(printer, &args, &base);
    if !quick {
        probe(nats, exe, &args, times, printer).await?;
    }
    Ok(())
}

/// The longest call p99 a point may have and still hold its cards.
const HOLD_P99_US: f64 = 10_000.0;

/// The break probe: at N = 1 and N = 8, half, once and twice the cards of the
/// sweep; each point holds when every call kind's p99 is within 10 ms and no
/// call failed. Reports each point and the most cards held.
async fn probe(
    nats: &BenchNats,
    exe: &std::path::Path,
    args: &EngineArgs,
    times: (Duration, Duration),
    printer: &mut Printer,
) -> anyhow::Result<()> {
    for n in [1usize, 8] {
        let mut held = 0;
        for cards in [args.cards / 2, args.cards, args.cards * 2] {
            let probed = EngineArgs {
                cards,
                ..args.clone()
            };
            eprintln!("bench scale --model engine: break probe, N={n}, {cards} cards");
            let point = run_point(nats, exe, &probed, n, times).await?;
            let worst = point
                .latency
                .iter()
                .map(|(_, p99)| *p99)
                .fold(0.0, f64::max);
            let tag = format!("break probe, N={n} at {cards} cards");
            printer.print(&BenchResult::new(
                WORKLOAD,
                format!("{tag}: slowest call kind's p99"),
                worst,
                "us",
                "target (at most)",
                HOLD_P99_US,
            ));
            printer.print(&BenchResult::new(
                WORKLOAD,
                format!("{tag}: engine calls/s"),
                point.calls_per_s,
                "calls/s",
                "none",
                0.0,
            ));
            printer.print(&BenchResult::new(
                WORKLOAD,
                format!("{tag}: failed calls in the window"),
                point.failures as f64,
                "calls",
                "none",
                0.0,
            ));
            printer.print(&BenchResult::new(
                WORKLOAD,
                format!("{tag}: machine CPU busy (cards, NATS and masters share it)"),
                point.machine_busy * 100.0,
                "%",
                "none",
                0.0,
            ));
            if worst <= HOLD_P99_US && point.failures == 0 {
                held = cards;
            } else {
                break;
            }
        }
        printer.print(&BenchResult::new(
            WORKLOAD,
            format!(
                "N={n}: most cards held (every call kind's p99 <= 10 ms, no failure; {}, {} and {} \
                 probed, stopping at the first that breaks)",
                args.cards / 2,
                args.cards,
                args.cards * 2
            ),
            held as f64,
            "cards",
            "none",
            0.0,
        ));
    }
    Ok(())
}
