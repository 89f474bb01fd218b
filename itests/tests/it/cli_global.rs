//! `hkvm globalmaster`, `hkvm locate` and `hkvm status` against a real nats-server:
//! a sub-cluster stream and registry entry written here, a global master run as the
//! `hkvm` binary, and the query commands' output.
#![allow(clippy::unwrap_used)]

use std::collections::BTreeMap;
use std::process::{Child, Command, Stdio};
use std::time::Duration;

use async_nats::jetstream;
use hkvm_events::commit::{CommitConfig, GroupCommitter};
use hkvm_events::log::JetStreamLog;
use hkvm_events::registry::{ensure_registry_bucket, register, SubmasterInfo};
use hkvm_events::stream::{ensure_stream, StreamSettings};
use hkvm_events::subject::{event_subject, stream_name};
use hkvm_events::{
    ClusterId, KvEvent, Placement, ProducerId, PutCommitted, SegmentId, SubclusterId,
};
use hkvm_testkit::NatsServer;

/// Kills the global master when the test ends, however it ends.
struct Running(Child);

impl Drop for Running {
    fn drop(&mut self) {
        let _ = self.0.kill();
        let _ = self.0.wait();
    }
}

fn hkvm(server: &NatsServer, args: &[&str]) -> (String, bool) {
    let output = Command::new(env!("CARGO_BIN_EXE_hkvm"))
        .args(args)
        .args(["--nats", &server.url(), "--cluster", "demo"])
        .output()
        .unwrap();
    (
        String::from_utf8_lossy(&output.stdout).into_owned(),
        output.status.success(),
    )
}

#[tokio::test]
async fn locate_and_status_answer_through_a_running_global_master() {
    let server = NatsServer::start().await.unwrap();
    let js = jetstream::new(server.connect().await.unwrap());
    let cluster = ClusterId::new("demo").unwrap();
    let sc = SubclusterId::new("sc-0").unwrap();
    ensure_stream(&js, &cluster, &sc, &StreamSettings::default())
        .await
        .unwrap();
    let log = JetStreamLog::new(
        js.clone(),
        stream_name(&cluster, &sc),
        event_subject(&cluster, &sc),
    );
    let committer = GroupCommitter::spawn(
        log,
        ProducerId::new("sm-0").unwrap(),
        1,
        0,
        CommitConfig::default(),
    );
    let put = PutCommitted::new(
        "k1",
        64,
        1,
        vec![Placement {
            segment: SegmentId::new("seg").unwrap(),
            offset: 0,
        }],
    );
    committer
        .commit(vec![KvEvent::PutCommitted(put)])
        .await
        .unwrap();
    let store = ensure_registry_bucket(&js, &cluster, Duration::from_secs(10))
        .await
        .unwrap();
    register(
        &store,
        &SubmasterInfo {
            id: ProducerId::new("sm-0").unwrap(),
            cluster: cluster.clone(),
            subcluster: sc.clone(),
            rpc_prefix: "hkvm.demo.sc-0.rpc".into(),
            labels: BTreeMap::from([("pool".into(), "prefill".into())]),
            capacity_bytes: 1 << 30,
            used_bytes: 1 << 20,
            objects: 1,
            epoch: 1,
            stream: stream_name(&cluster, &sc),
            last_seq: 1,
            unix_ms: 0,
        },
    )
    .await
    .unwrap();

    let _global = Running(
        Command::new(env!("CARGO_BIN_EXE_hkvm"))
            .args(["globalmaster", "--nats", &server.url(), "--cluster", "demo"])
            .args(["--replica", "g-cli"])
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .spawn()
            .unwrap(),
    );

    // `locate` retries until the replica has joined and caught up.
    let (out, ok) = hkvm(&server, &["locate", "k1", "nowhere"]);
    assert!(ok, "{out}");
    assert!(
        out.contains("k1\tsc-0\tsm-0\thkvm.demo.sc-0.rpc\talive"),
        "{out}"
    );
    assert!(out.contains("nowhere\t-"), "{out}");

    let (out, ok) = hkvm(&server, &["exist", "--global", "k1"]);
    assert!(ok, "{out}");
    assert_eq!(out, "k1\tsc-0\n");
    let (out, ok) = hkvm(&server, &["exist", "--global", "k1", "gone"]);
    assert!(!ok);
    assert!(out.contains("gone\tno"), "{out}");

    let (out, ok) = hkvm(&server, &["status"]);
    assert!(ok, "{out}");
    assert!(out.contains("sm-0"), "{out}");
    assert!(out.contains("pool=prefill"), "{out}");
    assert!(
        out.contains("global master g-cli (serving): 1 keys"),
        "{out}"
    );
}
