//! Scenario 7: NATS users per role (`hkvm_itests::security`, documented in
//! docs/security.md). The whole cluster runs under them; then a client, the global
//! master and one sub-master each try to append to an event stream that is not
//! theirs: every attempt is rejected and the streams do not change.

use std::time::Duration;

use async_nats::jetstream;
use hkvm_events::subject::{event_subject, stream_name};
use hkvm_events::{ClusterId, SubclusterId};
use hkvm_itests::security;

use super::scenario_kill_leader::split;
use super::topology::{Spec, Topology, CLUSTER};
use super::{global, loadgen, report};

/// The last sequence of `subcluster`'s stream, read as the operator.
async fn last_seq(topology: &Topology, subcluster: &str) -> u64 {
    let js = jetstream::new(topology.connect(0).await);
    let name = stream_name(
        &ClusterId::new(CLUSTER).unwrap(),
        &SubclusterId::new(subcluster).unwrap(),
    );
    js.get_stream(&name)
        .await
        .unwrap()
        .info()
        .await
        .unwrap()
        .state
        .last_sequence
}

/// Appends garbage to `subcluster`'s stream as `user`; `Ok` if JetStream stored it.
async fn append_as(topology: &Topology, user: &str, subcluster: &str) -> Result<u64, String> {
    let mut js = jetstream::new(topology.connect_as(0, user).await);
    js.set_timeout(Duration::from_secs(2));
    let subject = event_subject(
        &ClusterId::new(CLUSTER).unwrap(),
        &SubclusterId::new(subcluster).unwrap(),
    );
    let ack = js
        .publish(subject, b"forged".to_vec().into())
        .await
        .map_err(|e| e.to_string())?;
    ack.await.map(|a| a.sequence).map_err(|e| e.to_string())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn only_a_subclusters_own_submaster_can_append_to_its_stream() {
    let Some(scenario) = report::Scenario::start("7 security (per-role NATS users)") else {
        return;
    };
    let spec = Spec {
        submasters: 1,
        nodes: 2,
        globals: 1,
        secure: true,
        ..Spec::default()
    };
    let topology = Topology::start(&spec).await;
    // Every role works under its own user: nodes mounted, puts, reads, queries.
    let run = loadgen::puts(&topology, "sc-0", "sec", 4, "2s")
        .await
        .finish_puts()
        .await;
    let (acked, absent) = split(&run);
    assert!(acked.len() > 20, "{}", run.summary);
    let verified = loadgen::verify(&topology, "sc-0", &acked, &absent).await;
    loadgen::assert_verified(&verified, acked.len());
    let client_view = topology.connect_as(0, security::CLIENT_USER).await;
    let global = hkvm_client::GlobalClient::new(client_view, ClusterId::new(CLUSTER).unwrap());
    global::wait_all_held(&global, &acked).await;

    let before = (
        last_seq(&topology, "sc-0").await,
        last_seq(&topology, "sc-1").await,
    );
    let attempts = [
        (security::CLIENT_USER.to_owned(), "sc-0"),
        (security::GLOBAL_USER.to_owned(), "sc-0"),
        (security::submaster_user("sc-1"), "sc-0"),
        (security::submaster_user("sc-0"), "sc-1"),
    ];
    for (user, target) in &attempts {
        let result = append_as(&topology, user, target).await;
        assert!(
            result.is_err(),
            "{user} appended to {target}'s stream: {result:?}"
        );
    }
    tokio::time::sleep(Duration::from_millis(500)).await;
    let after = (
        last_seq(&topology, "sc-0").await,
        last_seq(&topology, "sc-1").await,
    );
    assert_eq!(before, after, "a rejected publish changed a stream");
    // The check can fail: the operator is allowed, and the stream moves.
    let allowed = append_as(&topology, security::ADMIN_USER, "sc-1").await;
    assert_eq!(allowed, Ok(after.1 + 1), "the operator's append is stored");

    let verified = loadgen::verify(&topology, "sc-0", &acked, &absent).await;
    loadgen::assert_verified(&verified, acked.len());
    scenario.passed(
        "-",
        0,
        &format!(
            "cluster ran under role users; {} forged appends rejected, streams unchanged",
            attempts.len()
        ),
    );
}
