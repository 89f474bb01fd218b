//! Scenario 5: the sub-master leader's container is cut off the network while
//! writers put. The standby takes over; when the cut heals, the old leader's
//! appends (buffered while it was cut off) are refused by the stream's expected
//! last sequence, it steps down, and the stream holds exactly one history: epochs
//! never go back, and nothing of the old epoch follows the new one.

use std::time::{Duration, Instant};

use async_nats::jetstream;
use hkvm_events::subject::stream_name;
use hkvm_events::{decode_message, ClusterId, Limits, SubclusterId};

use super::scenario_kill_leader::{first_ack_after, split, unix_ms};
use super::topology::{Spec, Topology, CLUSTER};
use super::{docker, loadgen, report};

/// Every message of the stream as `(sequence, producer, epoch)`; empty messages
/// (epoch markers) are skipped, undecodable ones counted.
async fn history(topology: &Topology, subcluster: &str) -> (Vec<(u64, String, u64)>, usize) {
    let js = jetstream::new(topology.connect(0).await);
    let name = stream_name(
        &ClusterId::new(CLUSTER).unwrap(),
        &SubclusterId::new(subcluster).unwrap(),
    );
    let mut stream = js.get_stream(&name).await.unwrap();
    let last = stream.info().await.unwrap().state.last_sequence;
    let (mut entries, mut undecodable) = (Vec::new(), 0);
    for seq in 1..=last {
        let Ok(message) = stream.get_raw_message(seq).await else {
            continue;
        };
        if message.payload.is_empty() {
            continue;
        }
        match decode_message(&message.payload, &Limits::default()) {
            Ok(decoded) => entries.push((
                seq,
                decoded.header.producer.as_str().to_owned(),
                decoded.header.epoch,
            )),
            Err(_) => undecodable += 1,
        }
    }
    (entries, undecodable)
}

/// Asserts one linear history: epochs never decrease and each epoch has one
/// producer. Returns the epochs in order with their producers.
pub fn assert_one_history(entries: &[(u64, String, u64)]) -> Vec<(u64, String)> {
    let mut epochs: Vec<(u64, String)> = Vec::new();
    for (seq, producer, epoch) in entries {
        match epochs.last() {
            Some((last, owner)) if last == epoch => {
                assert_eq!(owner, producer, "two writers in epoch {epoch} (seq {seq})");
            }
            Some((last, _)) => {
                assert!(epoch > last, "seq {seq}: epoch {epoch} after epoch {last}");
                epochs.push((*epoch, producer.clone()));
            }
            None => epochs.push((*epoch, producer.clone())),
        }
    }
    epochs
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_partitioned_leader_cannot_fork_the_history() {
    let Some(scenario) = report::Scenario::start("5 network cut of a sub-master leader") else {
        return;
    };
    let topology = Topology::start(&Spec::one_subcluster(0)).await;
    tokio::time::sleep(Duration::from_millis(500)).await;
    let old_leader = topology.container("sc-0/0");
    let writers = loadgen::puts(&topology, "sc-0", "cut", 16, "8s").await;
    tokio::time::sleep(Duration::from_secs(2)).await;
    docker::disconnect(old_leader, &topology.network).await;
    let cut_ms = unix_ms();
    let cut = Instant::now();
    let client = topology.client("sc-0").await;
    loop {
        if let Ok(status) = client.status().await {
            if status.producer == "sc-0-sm1" {
                break;
            }
        }
        assert!(
            cut.elapsed() < Duration::from_secs(20),
            "the standby never took over"
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    let takeover_ms = cut.elapsed().as_millis();
    tokio::time::sleep(Duration::from_secs(2)).await;
    docker::connect(old_leader, &topology.network).await;
    let run = writers.finish_puts().await;
    let first_put_ms = first_ack_after(&run, cut_ms);

    // The healed old leader found out it was deposed and follows the new one.
    let healed = Instant::now();
    loop {
        if docker::logs(old_leader).await.1.contains("stepped down") {
            break;
        }
        assert!(
            healed.elapsed() < Duration::from_secs(30),
            "the old leader never stepped down"
        );
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
    let status = client.status().await.unwrap();
    assert_eq!(status.producer, "sc-0-sm1", "leadership did not flap back");

    let (acked, absent) = split(&run);
    let verified = loadgen::verify(&topology, "sc-0", &acked, &absent).await;
    loadgen::assert_verified(&verified, acked.len());
    // Puts that timed out may or may not have been committed: count the visible.
    let uncertain_present = client
        .exist(run.uncertain.clone())
        .await
        .unwrap()
        .iter()
        .filter(|p| **p)
        .count();
    let (entries, undecodable) = history(&topology, "sc-0").await;
    assert_eq!(undecodable, 0);
    let epochs = assert_one_history(&entries);
    assert_eq!(
        epochs.last().map(|(_, p)| p.as_str()),
        Some("sc-0-sm1"),
        "the new leader's epoch is the last: {epochs:?}"
    );
    scenario.passed(
        &format!("first put {first_put_ms} ms after the cut (status saw the standby lead after {takeover_ms} ms)"),
        0,
        &format!(
            "{} acked, {} revoked/failed absent, {} timed out (outcome unknown, {} of them committed); old leader fenced and stepped down; {} messages, epochs {:?}",
            acked.len(),
            absent.len(),
            run.uncertain.len(),
            uncertain_present,
            entries.len(),
            epochs.iter().map(|(e, _)| *e).collect::<Vec<_>>()
        ),
    );
}
