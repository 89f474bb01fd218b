//! `hkvm globalmaster`, `hkvm locate` and `hkvm status` against a real nats-server:
//! a sub-cluster stream and registry entry written here, a global master run as the
//! `hkvm` binary, and the query commands' output.

use hkvm_events::{KvEvent, Placement, ProducerId, PutCommitted, SegmentId};

use crate::fixture::Fixture;
use crate::process::{hkvm_bin_async, run_hkvm, Process};

/// `hkvm <args> --nats <url> --cluster demo`: its stdout, and whether it succeeded.
async fn hkvm(fixture: &Fixture, args: &[&str]) -> (String, bool) {
    let url = fixture.url();
    let mut all = args.to_vec();
    all.extend(["--nats", &url, "--cluster", "demo"]);
    let ran = run_hkvm(&all).await;
    let ok = ran.success();
    (ran.stdout, ok)
}

#[tokio::test]
async fn locate_and_status_answer_through_a_running_global_master() {
    // The binary first: building it here can take longer than the registry
    // entry written below lives (10 s) without heartbeats.
    hkvm_bin_async().await;
    let fixture = Fixture::new("demo").await;
    // sc-0's stream and the registry entry of its (stand-in) sub-master sm-0.
    let mut sc = fixture.subcluster("sc-0", &[("pool", "prefill")]).await;
    let put = PutCommitted::new(
        "k1",
        64,
        1,
        vec![Placement {
            segment: SegmentId::new("seg").unwrap(),
            offset: 0,
        }],
    );
    let seq = sc.commit(vec![KvEvent::PutCommitted(put)]).await;
    sc.info.id = ProducerId::new("sm-0").unwrap();
    sc.info.used_bytes = 1 << 20;
    sc.info.objects = 1;
    sc.info.last_seq = seq;
    fixture.register(&sc.info).await;

    let url = fixture.url();
    let _global = Process::hkvm(
        "hkvm globalmaster",
        &[
            "globalmaster",
            "--nats",
            &url,
            "--cluster",
            "demo",
            "--replica",
            "g-cli",
        ],
        "info",
    )
    .await;

    // `locate` retries until the replica has joined and caught up.
    let (out, ok) = hkvm(&fixture, &["locate", "k1", "nowhere"]).await;
    assert!(ok, "{out}");
    assert!(
        out.contains("k1\tsc-0\tsm-0\thkvm.demo.sc-0.rpc\talive"),
        "{out}"
    );
    assert!(out.contains("nowhere\t-"), "{out}");

    let (out, ok) = hkvm(&fixture, &["exist", "--global", "k1"]).await;
    assert!(ok, "{out}");
    assert_eq!(out, "k1\tsc-0\n");
    let (out, ok) = hkvm(&fixture, &["exist", "--global", "k1", "gone"]).await;
    assert!(!ok);
    assert!(out.contains("gone\tno"), "{out}");

    let (out, ok) = hkvm(&fixture, &["status"]).await;
    assert!(ok, "{out}");
    assert!(out.contains("sm-0"), "{out}");
    assert!(out.contains("pool=prefill"), "{out}");
    assert!(
        out.contains("global master g-cli (serving): 1 keys"),
        "{out}"
    );
}
