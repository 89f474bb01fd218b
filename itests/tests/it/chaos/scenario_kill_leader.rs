//! Scenario 2: SIGKILL of a sub-master leader container while writers put through
//! the nodes: the standby container serves within a bounded time, every
//! acknowledged put is read back byte-exact, and no revoked or failed put appears.

use std::time::{Duration, SystemTime, UNIX_EPOCH};

use super::topology::{Spec, Topology};
use super::{docker, loadgen, report};

/// Unix time in ms (the containers share the host's clock).
pub fn unix_ms() -> u64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map_or(0, |d| u64::try_from(d.as_millis()).unwrap_or(u64::MAX))
}

/// The time from `cut_ms` to the first acknowledgement after it, in ms.
pub fn first_ack_after(run: &loadgen::PutRun, cut_ms: u64) -> u64 {
    run.acked
        .iter()
        .map(|(_, t)| *t)
        .filter(|t| *t > cut_ms)
        .min()
        .map(|t| t - cut_ms)
        .expect("no put was acknowledged after the fault")
}

/// The keys of a run: acknowledged, and those that must not exist (revoked, or
/// failed for certain; a put that timed out may or may not exist).
pub fn split(run: &loadgen::PutRun) -> (Vec<String>, Vec<String>) {
    let acked = run.acked.iter().map(|(k, _)| k.clone()).collect();
    let absent = run.revoked.iter().chain(&run.failed).cloned().collect();
    (acked, absent)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn killing_a_leader_container_loses_no_acknowledged_put() {
    let Some(scenario) = report::Scenario::start("2 kill -9 sub-master leader") else {
        return;
    };
    let topology = Topology::start(&Spec::one_subcluster(0)).await;
    // The standby must be following before the kill.
    tokio::time::sleep(Duration::from_millis(500)).await;
    let writers = loadgen::puts(&topology, "sc-0", "kill", 16, "6s").await;
    tokio::time::sleep(Duration::from_secs(2)).await;
    docker::kill(topology.container("sc-0/0")).await;
    let killed_ms = unix_ms();
    let run = writers.finish_puts().await;
    let failover_ms = first_ack_after(&run, killed_ms);

    let status = topology.client("sc-0").await.status().await.unwrap();
    assert_eq!(status.producer, "sc-0-sm1", "the standby leads");
    let (acked, absent) = split(&run);
    let before = run.acked.iter().filter(|(_, t)| *t < killed_ms).count();
    assert!(
        before > 20 && acked.len() > before + 20,
        "writers progressed before and after"
    );
    let verified = loadgen::verify(&topology, "sc-0", &acked, &absent).await;
    loadgen::assert_verified(&verified, acked.len());
    println!("kill -9 leader: {}", run.summary);
    assert!(failover_ms < 10_000, "failover took {failover_ms} ms");
    scenario.passed(
        &format!("failover {failover_ms} ms"),
        0,
        &format!(
            "{} acked ({} during), {} revoked/failed absent, {} timed out (outcome unknown), epoch {}",
            acked.len(),
            acked.len() - before,
            absent.len(),
            run.uncertain.len(),
            status.epoch
        ),
    );
}
