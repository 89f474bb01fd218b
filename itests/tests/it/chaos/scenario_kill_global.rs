//! Scenario 3: SIGKILL of a global-master replica while clients query: every query
//! keeps succeeding (the other replica answers), and the killed replica, restarted,
//! loads its checkpoint, catches up with what happened meanwhile, and then answers
//! alone for every key.

use std::time::{Duration, Instant};

use super::scenario_kill_leader::split;
use super::topology::{Container, Spec, Topology};
use super::{docker, global, loadgen, report};

/// How many times `needle` occurs in the container's stderr so far.
async fn log_count(container: &Container, needle: &str) -> usize {
    docker::logs(container).await.1.matches(needle).count()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn killing_a_global_replica_keeps_queries_answered() {
    let Some(scenario) = report::Scenario::start("3 kill -9 global-master replica") else {
        return;
    };
    let spec = Spec {
        subclusters: vec![("sc-0", "zone=a")],
        submasters: 1,
        ..Spec::default()
    };
    let topology = Topology::start(&spec).await;
    let run = loadgen::puts(&topology, "sc-0", "gq", 4, "2s")
        .await
        .finish_puts()
        .await;
    let (first, _) = split(&run);
    let global = global::client(&topology, 0).await;
    global::wait_all_held(&global, &first).await;
    // Both replicas have checkpointed the first keys (interval 1 s).
    tokio::time::sleep(Duration::from_millis(1500)).await;

    let probe = &first[..first.len().min(500)];
    let queries = loadgen::start(
        &topology,
        "sc-0",
        &["--mode", "query", "--clients", "4", "--duration", "5s"].map(str::to_owned),
        vec![("--keys-subject", probe)],
    )
    .await;
    tokio::time::sleep(Duration::from_secs(1)).await;
    docker::kill(&topology.globals[0]).await;
    // Keys written while the replica is down: it must catch up with them.
    let run = loadgen::puts(&topology, "sc-0", "gq-late", 4, "1s")
        .await
        .finish_puts()
        .await;
    let (late, _) = split(&run);
    let answered = queries.finish().await.pop().unwrap_or_default();
    let empty = answered["failed"].as_array().is_none_or(Vec::is_empty);
    assert!(
        empty && answered["unheld"] == 0,
        "queries failed: {answered}"
    );
    assert!(answered["ok"].as_u64().unwrap_or(0) > 10, "{answered}");

    let restarted = Instant::now();
    topology.globals[0].start().await.unwrap();
    while log_count(&topology.globals[0], "caught up: serving queries").await < 2 {
        if restarted.elapsed() >= Duration::from_secs(60) {
            // What the replica did instead is the diagnosis.
            let stderr = docker::logs(&topology.globals[0]).await.1;
            let tail: Vec<&str> = stderr.lines().rev().take(60).collect();
            let tail: Vec<&str> = tail.into_iter().rev().collect();
            panic!(
                "the replica never caught up within 60 s; its last log lines:\n{}",
                tail.join("\n")
            );
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    let catch_up_ms = restarted.elapsed().as_millis();
    assert_eq!(
        log_count(
            &topology.globals[0],
            "restored the projection from a checkpoint"
        )
        .await,
        1,
        "the restart loaded a checkpoint"
    );
    // Only the restarted replica is left: it alone must know every key.
    docker::kill(&topology.globals[1]).await;
    let all: Vec<String> = first.iter().chain(&late).cloned().collect();
    let held = global::holders(&global, &all, None).await;
    let unheld = held.iter().filter(|h| h.is_empty()).count();
    assert_eq!(unheld, 0, "the restarted replica misses keys");
    scenario.passed(
        &format!("restart to serving {catch_up_ms} ms"),
        0,
        &format!(
            "{} queries of {} keys all answered during the kill; {} keys known after restart",
            answered["ok"],
            probe.len(),
            all.len()
        ),
    );
}
