//! Kill -9 of a sub-master leader process while 64 clients put: the hot standby
//! (another `hkvm submaster` process) serves within a bounded time, every
//! acknowledged put is still there, and no revoked put is.

use std::path::Path;
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use hkvm_client::{RetryPolicy, SubmasterClient};
use hkvm_events::rpc::submaster::{ItemResult, MountSegment, PutEndItem, PutStartItem};
use hkvm_events::{NodeId, SegmentId};

use crate::fixture::{wait_count, Fixture, WAIT};
use crate::process::{Process, Stream};

/// `hkvm submaster` `id` of sub-cluster `sc` with the settings in `config`.
async fn submaster(fixture: &Fixture, id: &str, config: &Path) -> Process {
    let url = fixture.url();
    let config = config.to_str().unwrap();
    let args = [
        "submaster",
        "--nats",
        &url,
        "--cluster",
        "kill",
        "--subcluster",
        "sc",
        "--id",
        id,
        "--config",
        config,
    ];
    Process::hkvm(
        &format!("hkvm submaster {id}"),
        &args,
        "warn,hkvm_submaster=info",
    )
    .await
}

fn start(key: &str) -> PutStartItem {
    PutStartItem {
        key: key.into(),
        size: 65536,
        replicas: 2,
        preferred_segment: None,
        hard_pin: false,
        put_id: 0,
        avoid_nodes: Vec::new(),
    }
}

/// One put; `Ok(true)` when acknowledged, `Ok(false)` when revoked on purpose.
async fn put(client: &SubmasterClient, key: &str, revoke: bool) -> Result<bool, String> {
    let started = client
        .put_start(vec![start(key)])
        .await
        .map_err(|e| e.to_string())?;
    if let ItemResult::Err(error) = &started[0] {
        return Err(error.to_string());
    }
    if revoke {
        client
            .put_revoke(vec![key.into()])
            .await
            .map_err(|e| e.to_string())?;
        return Ok(false);
    }
    let ended = client
        .put_end(vec![PutEndItem {
            key: key.into(),
            checksum: 1,
            put_id: 0,
        }])
        .await
        .map_err(|e| e.to_string())?;
    match &ended[0] {
        ItemResult::Ok(()) => Ok(true),
        ItemResult::Err(error) => Err(error.to_string()),
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn killing_the_leader_process_loses_no_acknowledged_put() {
    let fixture = Fixture::new("kill").await;
    let dir = tempfile::tempdir().unwrap();
    let config = dir.path().join("submaster.toml");
    std::fs::write(
        &config,
        "leader_lease_ttl_ms = 1000\nsnapshot_every_events = 2000\n",
    )
    .unwrap();

    let mut leader = submaster(&fixture, "sm-a", &config).await;
    // Until the first sub-master has created the sub-cluster's stream, a client is
    // right to call the sub-cluster unknown: wait for it to lead.
    leader
        .wait_for_line(Stream::Stderr, "leading the sub-cluster", WAIT)
        .await;
    let client: SubmasterClient = fixture
        .submaster_client(
            "sc",
            RetryPolicy {
                request_timeout: Duration::from_secs(1),
                retry_deadline: Duration::from_secs(30),
                ..RetryPolicy::default()
            },
        )
        .await;
    for node in ["n1", "n2", "n3"] {
        client
            .mount_segment(MountSegment {
                node: NodeId::new(node).unwrap(),
                segment: SegmentId::new(format!("{node}-s")).unwrap(),
                size: 4 << 30,
                endpoint: format!("{node}:1"),
                rdma: None,
            })
            .await
            .unwrap();
    }
    assert_eq!(client.status().await.unwrap().producer, "sm-a");
    let standby = submaster(&fixture, "sm-b", &config).await;
    // Hot: the standby has replayed the stream (and follows it) before the kill.
    standby
        .wait_for_line(Stream::Stderr, "state restored", WAIT)
        .await;

    let stop = Arc::new(AtomicBool::new(false));
    let acked = Arc::new(AtomicUsize::new(0));
    let writers: Vec<_> = (0..64)
        .map(|w| {
            let (client, stop, acked) = (client.clone(), stop.clone(), acked.clone());
            tokio::spawn(async move {
                let (mut acknowledged, mut revoked) = (Vec::new(), Vec::new());
                let mut i = 0u64;
                while !stop.load(Ordering::Relaxed) {
                    let key = format!("w{w}-{i}");
                    let revoke = i % 10 == 9;
                    i += 1;
                    match put(&client, &key, revoke).await {
                        Ok(true) => {
                            acknowledged.push(key);
                            acked.fetch_add(1, Ordering::Relaxed);
                        }
                        Ok(false) => revoked.push(key),
                        Err(_) => {}
                    }
                }
                (acknowledged, revoked)
            })
        })
        .collect();
    wait_count("250 puts before the kill", &acked, 250).await;

    leader.kill(); // SIGKILL
    let killed = Instant::now();
    let mut probe = 0;
    loop {
        probe += 1;
        if put(&client, &format!("probe-{probe}"), false).await == Ok(true) {
            break;
        }
    }
    let failover_ms = killed.elapsed().as_millis();
    let after = acked.load(Ordering::Relaxed) + 260;
    wait_count("260 puts after the failover", &acked, after).await;
    stop.store(true, Ordering::Relaxed);

    let (mut acknowledged, mut revoked) = (Vec::new(), Vec::new());
    for writer in writers {
        let (a, r) = writer.await.unwrap();
        acknowledged.extend(a);
        revoked.extend(r);
    }
    let status = client.status().await.unwrap();
    println!(
        "failover: first put served {failover_ms} ms after SIGKILL of the leader; \
         {} puts acknowledged, {} revoked; new leader {} epoch {}",
        acknowledged.len(),
        revoked.len(),
        status.producer,
        status.epoch
    );
    assert_eq!(status.producer, "sm-b");
    assert!(
        acknowledged.len() > 500,
        "writers made progress before and after"
    );
    let present = client.exist(acknowledged.clone()).await.unwrap();
    let lost: Vec<_> = acknowledged
        .iter()
        .zip(&present)
        .filter(|(_, p)| !**p)
        .collect();
    assert!(
        lost.is_empty(),
        "{} acknowledged puts lost: {:?}",
        lost.len(),
        &lost[..lost.len().min(5)]
    );
    let resurrected = client.exist(revoked.clone()).await.unwrap();
    assert!(resurrected.iter().all(|p| !p), "a revoked put appeared");
}
