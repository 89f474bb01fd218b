//! Scenario 4: SIGKILL of one NATS node of three while writers put, then its
//! restart: every acknowledged put survives (R3: acknowledged = on a quorum), the
//! stream stays writable throughout, the restarted node catches its replica up,
//! and the global master's consumers resume (it knows every key afterwards).
//!
//! The node killed is the one leading the sub-cluster's event stream, the worst
//! case for writes: they wait for JetStream to elect a new stream leader (4-9 s,
//! nats-server's Raft election timeout). Killing it every run makes the rows of
//! two runs comparable; the row gives the election's time beside the stall, so
//! that HKVM's own share (from the election to the next acknowledged put)
//! shows apart from JetStream's.

use std::time::{Duration, Instant};

use async_nats::jetstream;
use hkvm_events::subject::stream_name;
use hkvm_events::{ClusterId, SubclusterId};

use super::scenario_kill_leader::{first_ack_after, split, unix_ms};
use super::topology::{Spec, Topology, CLUSTER};
use super::{docker, global, loadgen, report};

/// The longest time without an acknowledged put between `from_ms` and `to_ms`.
fn longest_gap(run: &loadgen::PutRun, from_ms: u64, to_ms: u64) -> u64 {
    let mut times: Vec<u64> = run
        .acked
        .iter()
        .map(|(_, t)| *t)
        .filter(|t| (from_ms..=to_ms).contains(t))
        .collect();
    times.sort_unstable();
    let mut previous = from_ms;
    let mut longest = 0;
    for t in times.into_iter().chain([to_ms]) {
        longest = longest.max(t - previous);
        previous = t;
    }
    longest
}

/// The JetStream leader elections a nats-server logged after `after_ms` (unix
/// ms): (milliseconds after it, what got a new leader). Lines look like
/// `[1] 2026/12/01 02:15:46.943693 [INF] JetStream cluster new stream leader for
/// '$G > KV_x'` (the server logs UTC).
fn leader_elections(log: &str, after_ms: u64) -> Vec<(u64, String)> {
    let Ok(format) = time::format_description::parse_borrowed::<2>(
        "[year]/[month]/[day] [hour]:[minute]:[second].[subsecond]",
    ) else {
        return Vec::new();
    };
    log.lines()
        .filter_map(|line| {
            let (_, rest) = line.split_once("] ")?;
            let stamp = rest.get(..26)?;
            let at = time::PrimitiveDateTime::parse(stamp, &format)
                .ok()?
                .assume_utc();
            let at_ms = u64::try_from(at.unix_timestamp_nanos() / 1_000_000).ok()?;
            let what = if let Some((_, name)) = rest.split_once("new stream leader for '$G > ") {
                name.trim_end_matches('\'').to_owned()
            } else if let Some((_, name)) = rest.split_once("new consumer leader for '$G > ") {
                format!("consumer {}", name.trim_end_matches('\''))
            } else if rest.contains("metadata leader") {
                "metadata".to_owned()
            } else {
                return None;
            };
            (at_ms > after_ms).then(|| (at_ms - after_ms, what))
        })
        .collect()
}

/// What HKVM's own processes logged about the NATS node loss after `after_ms`
/// (unix ms): (milliseconds after it, `who: what`) for connection losses and
/// reconnections, appends left unanswered and answered again, and leader
/// re-announcements. Lines are `tracing`'s text format, `2026-12-01T02:15:46.943693Z
/// WARN …` (possibly in terminal colours).
fn hkvm_marks(log: &str, who: &str, after_ms: u64) -> Vec<(u64, String)> {
    const MARKS: [(&str, &str); 5] = [
        ("NATS connection lost", "connection lost"),
        ("NATS connection (re)established", "connected"),
        ("append unanswered", "append unanswered"),
        ("the event log answers again", "appends answered"),
        ("announcing this leader again", "leader re-announced"),
    ];
    log.lines()
        .filter_map(|line| {
            let line = strip_colours(line);
            let (_, what) = MARKS.iter().find(|(text, _)| line.contains(text))?;
            let stamp = line.split_whitespace().next()?;
            let at =
                time::OffsetDateTime::parse(stamp, &time::format_description::well_known::Rfc3339)
                    .ok()?;
            let at_ms = u64::try_from(at.unix_timestamp_nanos() / 1_000_000).ok()?;
            (at_ms > after_ms).then(|| (at_ms - after_ms, format!("{who}: {what}")))
        })
        .collect()
}

/// `line` without terminal colour sequences (`ESC [ … m`).
fn strip_colours(line: &str) -> String {
    let mut plain = String::with_capacity(line.len());
    let mut chars = line.chars();
    while let Some(c) = chars.next() {
        if c == '\u{1b}' {
            for c in chars.by_ref() {
                if c == 'm' {
                    break;
                }
            }
        } else {
            plain.push(c);
        }
    }
    plain
}

#[test]
fn hkvm_log_marks_parse() {
    let log = "\u{1b}[2m2026-12-01T02:15:42.417000Z\u{1b}[0m \u{1b}[33m WARN\u{1b}[0m hkvm_log::connection: NATS connection lost; reconnecting\n\
               2026-12-01T02:15:42.500000Z  WARN hkvm_log::commit: append unanswered; sending it again\n\
               2026-12-01T02:15:40.000000Z  INFO hkvm_log::connection: NATS connection (re)established\n\
               2026-12-01T02:15:43.000000Z  INFO something else";
    let killed = 1_796_091_341_417;
    assert_eq!(
        hkvm_marks(log, "sm0", killed),
        vec![
            (1000, "sm0: connection lost".to_owned()),
            (1083, "sm0: append unanswered".to_owned()),
        ]
    );
}

#[test]
fn nats_leader_election_lines_parse() {
    let log = "[1] 2026/12/01 02:15:46.943693 [INF] JetStream cluster new stream leader for '$G > KV_hkvm_chaos_leader'\n\
               [1] 2026/12/01 02:15:27.304977 [INF] Self is new JetStream cluster metadata leader\n\
               [1] 2026/12/01 02:15:47.000000 [INF] Server is ready";
    // 02:15:41.417 UTC on that day.
    let killed = 1_796_091_341_417;
    assert_eq!(
        leader_elections(log, killed),
        vec![(5526, "KV_hkvm_chaos_leader".to_owned())]
    );
    let run = loadgen::PutRun {
        acked: vec![("a".into(), 100), ("b".into(), 150), ("c".into(), 900)],
        ..loadgen::PutRun::default()
    };
    assert_eq!(longest_gap(&run, 90, 1000), 750);
}

/// The index of the NATS node leading `stream` (server names are `n<index>`).
async fn stream_leader(js: &jetstream::Context, stream: &str) -> usize {
    let mut handle = js.get_stream(stream).await.unwrap();
    let info = handle.info().await.unwrap();
    let leader = info
        .cluster
        .as_ref()
        .and_then(|cluster| cluster.leader.clone())
        .expect("the event stream has a leader");
    leader
        .strip_prefix('n')
        .and_then(|index| index.parse().ok())
        .unwrap_or_else(|| panic!("a NATS server name that is not n<index>: {leader}"))
}

/// Waits until every replica of `stream` is current; returns how long it took.
async fn wait_replicas_current(js: &jetstream::Context, stream: &str) -> Duration {
    let started = Instant::now();
    loop {
        if let Ok(mut handle) = js.get_stream(stream).await {
            if let Ok(info) = handle.info().await {
                let cluster = info.cluster.clone().unwrap_or_default();
                if cluster.replicas.len() == 2 && cluster.replicas.iter().all(|r| r.current) {
                    return started.elapsed();
                }
            }
        }
        assert!(
            started.elapsed() < Duration::from_secs(60),
            "{stream} never became current"
        );
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn losing_a_nats_node_loses_no_acknowledged_event() {
    let Some(scenario) = report::Scenario::start("4 kill -9 + restart NATS node") else {
        return;
    };
    // Room for every put of the run: nothing may be evicted.
    let spec = Spec {
        segment_size: "256MiB",
        ..Spec::one_subcluster(1)
    };
    let topology = Topology::start(&spec).await;
    let stream = stream_name(
        &ClusterId::new(CLUSTER).unwrap(),
        &SubclusterId::new("sc-0").unwrap(),
    );
    let writers = loadgen::puts(&topology, "sc-0", "nats", 8, "22s").await;
    tokio::time::sleep(Duration::from_secs(2)).await;
    let doomed = stream_leader(&jetstream::new(topology.connect(0).await), &stream).await;
    // From the moment the kill is asked for: its effects start before it returns.
    let killed_ms = unix_ms();
    docker::kill(&topology.nats[doomed]).await;
    // Long enough for JetStream to move stream and bucket leaders off the dead
    // node and for clients to reconnect: writes must resume before it returns.
    tokio::time::sleep(Duration::from_secs(15)).await;
    topology.nats[doomed].start().await.unwrap();
    let restarted_ms = unix_ms();
    let restarted = std::time::Instant::now();
    let run = writers.finish_puts().await;
    let (acked, absent) = split(&run);
    let while_down = run
        .acked
        .iter()
        .filter(|(_, t)| *t > killed_ms && *t < restarted_ms)
        .count();
    assert!(
        while_down > 0,
        "the stream stayed writable with one node down: {}",
        run.summary
    );
    let stall_ms = first_ack_after(&run, killed_ms);
    let stall = longest_gap(&run, killed_ms, restarted_ms);
    // Where the time went, from NATS's own logs: the JetStream leaders the
    // surviving nodes elected after the kill.
    let mut elections = Vec::new();
    for (index, container) in topology.nats.iter().enumerate() {
        if index != doomed {
            let (stdout, stderr) = docker::logs(container).await;
            elections.extend(leader_elections(&format!("{stdout}\n{stderr}"), killed_ms));
        }
    }
    elections.sort();
    // JetStream's share of the stall, and HKVM's after it.
    let stream_elected_ms = elections
        .iter()
        .find(|(_, what)| *what == stream)
        .map(|(after_ms, _)| *after_ms);
    let after_election = stream_elected_ms.map_or_else(
        || "no election of it found in the survivors' logs".to_owned(),
        |elected| {
            format!(
                "elected +{elected} ms, first put acknowledged {} ms after",
                first_ack_after(&run, killed_ms + elected)
            )
        },
    );
    let elections = elections
        .iter()
        .map(|(after_ms, what)| format!("{what} +{after_ms} ms"))
        .collect::<Vec<_>>()
        .join(", ");
    // And from HKVM's own logs: which connections went down with the node, and
    // what the sub-masters' appends went through.
    let mut marks = hkvm_marks(&run.log, "loadgen", killed_ms);
    for (name, container) in &topology.submasters {
        let (stdout, stderr) = docker::logs(container).await;
        let who = name.rsplit('/').next().unwrap_or(name);
        marks.extend(hkvm_marks(&format!("{stdout}\n{stderr}"), who, killed_ms));
    }
    marks.sort();
    let marks = marks
        .iter()
        .map(|(after_ms, what)| format!("{what} +{after_ms} ms"))
        .collect::<Vec<_>>()
        .join(", ");

    let js = jetstream::new(topology.connect(0).await);
    wait_replicas_current(&js, &stream).await;
    // An upper bound: the check starts only once the writers are done.
    let current_within = restarted.elapsed();
    let verified = loadgen::verify(&topology, "sc-0", &acked, &absent).await;
    loadgen::assert_verified(&verified, acked.len());
    // The restarted node serves clients too: read the stream's state through it.
    let through_restarted = jetstream::new(topology.connect(doomed).await);
    let info = through_restarted
        .get_stream(&stream)
        .await
        .unwrap()
        .info()
        .await
        .unwrap()
        .clone();
    assert!(info.state.last_sequence > 0);
    let global = global::client(&topology, doomed).await;
    global::wait_all_held(&global, &acked).await;
    scenario.passed(
        &format!(
            "longest write stall {stall} ms (first ack {stall_ms} ms after the kill of n{doomed}, the event stream's leader; its new leader {after_election}); restarted replica current within {:.1} s",
            current_within.as_secs_f64()
        ),
        0,
        &format!(
            "{} acked ({while_down} with the node down), global consumers resumed; new JetStream leaders: {elections}; HKVM: {marks}",
            acked.len()
        ),
    );
}
