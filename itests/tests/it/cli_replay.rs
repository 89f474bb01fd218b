//! `hkvm replay` against a real nats-server: decoded events, filters, stats, and a
//! corrupted message in the middle of a stream that is reported and skipped.

use bytes::Bytes;
use hkvm_events::codec::{encode_message, Header};
use hkvm_events::{
    Evicted, KvEvent, Limits, NodeId, Placement, ProducerId, PutCommitted, SegmentId,
    SegmentMounted,
};
use hkvm_log::{Append, EventLog};

use crate::fixture::Fixture;
use crate::process::{run_hkvm, Ran};

fn put(key: &str) -> KvEvent {
    KvEvent::PutCommitted(PutCommitted::new(
        key,
        64,
        0xabc,
        vec![Placement {
            segment: SegmentId::new("seg-0").unwrap(),
            offset: 128,
        }],
    ))
}

async fn write_stream(fixture: &Fixture, subcluster: &str, messages: Vec<Bytes>) {
    let log = fixture.stream(subcluster).await;
    for (i, payload) in messages.into_iter().enumerate() {
        log.append(Append {
            expected_last_seq: Some(i as u64),
            msg_id: format!("{subcluster}-{i}"),
            payload,
        })
        .await
        .unwrap();
    }
}

fn encoded(events: &[KvEvent]) -> Bytes {
    let header = Header {
        producer: ProducerId::new("sm-test").unwrap(),
        epoch: 2,
        unix_ms: 1,
    };
    Bytes::from(encode_message(&header, events, &Limits::default()).unwrap())
}

/// `hkvm replay` of cluster `demo` with `args`.
async fn run_replay(fixture: &Fixture, args: &[&str]) -> Ran {
    let url = fixture.url();
    let mut all = vec!["replay", "--nats", &url, "--cluster", "demo"];
    all.extend_from_slice(args);
    run_hkvm(&all).await
}

/// `hkvm replay` with `args`: its stdout, and whether it succeeded.
async fn replay(fixture: &Fixture, args: &[&str]) -> (String, bool) {
    let ran = run_replay(fixture, args).await;
    let ok = ran.success();
    (ran.stdout, ok)
}

#[tokio::test]
async fn replay_prints_events_and_survives_a_corrupted_message() {
    let fixture = Fixture::new("demo").await;
    let mounted = KvEvent::SegmentMounted(SegmentMounted {
        node: NodeId::new("node-0").unwrap(),
        segment: SegmentId::new("seg-0").unwrap(),
        size: 1 << 20,
        endpoint: "127.0.0.1:7000".into(),
        rdma: None,
    });
    write_stream(
        &fixture,
        "sc-0",
        vec![
            encoded(&[mounted, put("alpha")]),
            Bytes::from_static(b"\xc1garbage in the middle"),
            encoded(&[
                put("beta"),
                KvEvent::Evicted(Evicted {
                    keys: vec!["alpha".into()],
                }),
            ]),
        ],
    )
    .await;
    write_stream(&fixture, "sc-1", vec![encoded(&[put("gamma")])]).await;

    let (text, ok) = replay(&fixture, &[]).await;
    assert!(ok, "{text}");
    let lines: Vec<&str> = text.lines().collect();
    assert_eq!(lines.len(), 6, "{text}");
    assert!(text.contains("sc-0 #1.1 "), "{text}");
    assert!(text.contains("key=\"alpha\" size=64"), "{text}");
    assert!(text.contains("sc-0 #2 ERROR undecodable message"), "{text}");
    assert!(
        text.contains("sc-0 #3.0 ") && text.contains("key=\"beta\""),
        "replay goes on: {text}"
    );
    assert!(
        text.contains("sc-1 #1.0 ") && text.contains("sm-test/e2 put"),
        "{text}"
    );

    let (only_alpha, _) = replay(
        &fixture,
        &["--subcluster", "sc-0", "--key", "alpha", "--format", "json"],
    )
    .await;
    let events: Vec<serde_json::Value> = only_alpha
        .lines()
        .map(|l| serde_json::from_str(l).unwrap())
        .filter(|v: &serde_json::Value| v.get("kind").is_some())
        .collect();
    let kinds: Vec<&str> = events.iter().map(|v| v["kind"].as_str().unwrap()).collect();
    assert_eq!(kinds, vec!["put", "evicted"]);
    assert_eq!(events[0]["event"]["placements"][0]["offset"], 128);

    let (from_three, _) = replay(
        &fixture,
        &[
            "--subcluster",
            "sc-0",
            "--from-seq",
            "3",
            "--kind",
            "evicted",
        ],
    )
    .await;
    assert_eq!(from_three.lines().count(), 1, "{from_three}");

    let (last_one, _) = replay(&fixture, &["--subcluster", "sc-0", "--last", "1"]).await;
    assert!(
        last_one.lines().all(|l| l.starts_with("sc-0 #3.")),
        "{last_one}"
    );

    let (stats, _) = replay(&fixture, &["--stats", "--format", "json"]).await;
    let stats: serde_json::Value = serde_json::from_str(stats.trim()).unwrap();
    assert_eq!(stats["events"], 5);
    assert_eq!(stats["kinds"]["put"], 3);
    assert_eq!(stats["subclusters"]["sc-0"]["bad_messages"], 1);
    assert_eq!(stats["subclusters"]["sc-0"]["last_seq"], 3);
}

#[tokio::test]
async fn replay_of_a_missing_subcluster_fails_clearly() {
    let fixture = Fixture::new("demo").await;
    let ran = run_replay(&fixture, &["--subcluster", "nope"]).await;
    assert!(!ran.success());
    assert!(ran.stderr.contains("stream not found"), "{}", ran.stderr);
}
