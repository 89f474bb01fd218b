//! The inter-DC level end to end: two pools, each on its own nats-server (two
//! "datacenters"), a gateway process in the source one and an inter-DC master
//! process copying over UDP with 25 ms of delay and 1% loss each way (emulated in
//! both processes' WAN egress). Every missing block arrives byte-exact within the
//! time the bandwidth cap allows; the policy's filters and labels hold; a block
//! the target already had is not copied; and a master killed with SIGKILL mid-run
//! resumes without sending a finished block again.

use std::collections::{BTreeMap, BTreeSet};
use std::time::{Duration, Instant};

use hkvm_events::rpc::interdc::{FetchReply, WanShape};
use hkvm_events::subject::stream_name;
use hkvm_events::{value_checksum, SubclusterId};
use hkvm_interdc::diff::{Candidate, SourceBlock};
use hkvm_interdc::wan::{fetch, Fetched, ReceiverSettings};
use hkvm_interdc::InterDcStatus;
use hkvm_transfer::wan::Impairment;

use hkvm_itests::security;

use crate::fixture::{poll_until, Pool, PoolSpec, WAIT};
use crate::process::{run_hkvm, Process, Stream};

/// A pool of `cluster`: each of `subclusters` (`(name, label)`) labelled
/// `pool=<label>`, with two nodes of 32 MiB.
fn pool(cluster: &str, subclusters: &[(&str, &str)]) -> PoolSpec {
    // The checks count every commit ever appended: the history is kept.
    let spec = PoolSpec::new(cluster)
        .nodes(2, 32 << 20)
        .tweak(|config| config.history.purge = false);
    subclusters.iter().fold(spec, |spec, (name, label)| {
        spec.subcluster(name, &[("pool", label)])
    })
}

/// `hkvm <args>` with the inter-DC master's progress logged.
async fn hkvm(name: &str, args: &[&str]) -> Process {
    Process::hkvm(name, args, "warn,hkvm_interdc=info").await
}

/// A deterministic value of `len` bytes for block `i`.
fn value(i: usize, len: usize) -> Vec<u8> {
    let mut state = (i as u64 + 1).wrapping_mul(0x9E37_79B9_7F4A_7C15);
    (0..len)
        .map(|_| {
            state ^= state << 13;
            state ^= state >> 7;
            state ^= state << 17;
            state as u8
        })
        .collect()
}

const RATE: u64 = 2_000_000;

fn master_args<'a>(source: &'a str, target: &'a str, policy: &'a str) -> Vec<&'a str> {
    vec![
        "interdc",
        "--source",
        source,
        "--target",
        target,
        "--policy",
        policy,
        "--wan-delay-ms",
        "25",
        "--wan-loss",
        "0.01",
        "--wan-rtt-ms",
        "50",
    ]
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn missing_blocks_cross_a_lossy_link_and_a_killed_master_resumes() {
    let source = Pool::start(pool("prefill", &[("p0", "prefill"), ("p1", "prefill")])).await;
    let target = Pool::start(pool("decode", &[("d0", "decode"), ("d1", "other")])).await;

    // 40 blocks of 32..160 KiB spread over both source sub-clusters, three that
    // the policy filters out, and one the target already holds.
    let mut wanted = BTreeMap::new();
    for i in 0..40 {
        let key = format!("model-a/block-{i:03}");
        let bytes = value(i, (32 + (i * 37) % 128) * 1024);
        let subcluster = if i % 2 == 0 { "p0" } else { "p1" };
        source.kv[subcluster].put(&key, &bytes, 1).await.unwrap();
        wanted.insert(key, bytes);
    }
    for i in 0..3 {
        let key = format!("scratch/tmp-{i}");
        source.kv["p0"]
            .put(&key, &value(100 + i, 4096), 1)
            .await
            .unwrap();
    }
    let shared = value(999, 50_000);
    source.kv["p0"]
        .put("model-a/shared", &shared, 1)
        .await
        .unwrap();
    target.kv["d1"]
        .put("model-a/shared", &shared, 1)
        .await
        .unwrap();
    let total_bytes: usize = wanted.values().map(Vec::len).sum();

    let dir = tempfile::tempdir().unwrap();
    let policy = dir.path().join("policy.toml");
    std::fs::write(
        &policy,
        format!(
            "exclude_prefixes = [\"scratch/\"]\nrate_bytes_per_sec = {RATE}\nlanes = 4\n\
             [target_labels]\npool = \"decode\"\n"
        ),
    )
    .unwrap();
    let (src, dst) = (source.address(), target.address());
    let policy = policy.to_str().unwrap();
    let gateway = hkvm(
        "hkvm interdc gateway",
        &[
            "interdc",
            "gateway",
            "--source",
            &src,
            "--peer",
            "127.0.0.0/8",
            "--wan-delay-ms",
            "25",
            "--wan-loss",
            "0.01",
        ],
    )
    .await;
    gateway
        .wait_for_line(Stream::Stdout, "inter-DC gateway of", WAIT)
        .await;

    // Run 1: kill -9 once about a third of the blocks are at the target.
    let started = Instant::now();
    let mut master = hkvm("hkvm interdc (killed)", &master_args(&src, &dst, policy)).await;
    let deadline = Instant::now() + Duration::from_secs(120);
    loop {
        let copied = target.commits("d0").await.len();
        if copied >= wanted.len() / 3 {
            break;
        }
        assert!(
            Instant::now() < deadline,
            "no progress: {copied} blocks copied"
        );
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
    master.kill();
    // A put_end sent just before the kill may still land. Once the target holds no
    // reservation (each one committed, or reclaimed after the put timeout), no
    // block of the killed run can land any more.
    poll_until(
        "the killed run's reservations to settle",
        Duration::from_secs(90),
        || async {
            for subcluster in ["d0", "d1"] {
                let status = target.kv[subcluster].metadata().status().await.ok()?;
                if status.pending_puts != 0 {
                    return None;
                }
            }
            Some(())
        },
    )
    .await;
    let before_kill: BTreeSet<String> = target.commits("d0").await.into_keys().collect();
    assert!(
        before_kill.len() < wanted.len(),
        "killed after everything was copied"
    );

    // Run 2: resume and exit when nothing is left.
    let mut args = master_args(&src, &dst, policy);
    args.push("--until-idle");
    let mut resumed = hkvm("hkvm interdc (resumed)", &args).await;
    // The cap allows the whole payload (with 25% recovery shards) in
    // total_bytes * 1.25 / RATE seconds; allow generous slack for this machine.
    let budget = Duration::from_secs_f64(total_bytes as f64 * 1.25 / RATE as f64);
    let exit = resumed
        .wait_exit(budget * 4 + Duration::from_secs(60))
        .await;
    assert!(exit.success(), "the resumed master failed: {exit}");
    let elapsed = started.elapsed();
    println!(
        "copied {total_bytes} bytes in {elapsed:?}; the cap allows {budget:?} \
         ({:.2}x the budget, kill and restart included)",
        elapsed.as_secs_f64() / budget.as_secs_f64()
    );

    // Every wanted block is at the target, in the allowed sub-cluster, byte-exact,
    // committed exactly once; filtered blocks are not; the shared one stayed put.
    let d0 = target.commits("d0").await;
    let d1 = target.commits("d1").await;
    for (key, bytes) in &wanted {
        assert_eq!(d0.get(key), Some(&1), "{key} committed once in d0");
        let fetched = target.kv["d0"].get(key).await.unwrap();
        assert_eq!(fetched.value.as_ref(), bytes.as_slice(), "{key} byte-exact");
    }
    assert!(
        !d0.keys().any(|k| k.starts_with("scratch/")),
        "filtered blocks copied"
    );
    assert!(
        !d0.contains_key("model-a/shared"),
        "a block the target had was copied"
    );
    assert_eq!(d1.get("model-a/shared"), Some(&1));
    assert_eq!(d1.len(), 1, "copies went outside the allowed target labels");

    // The resumed run sent only what the killed one had not finished.
    let output = run_hkvm(&[
        "interdc",
        "status",
        "--target",
        &dst,
        "--source-cluster",
        "prefill",
        "--json",
    ])
    .await;
    assert!(output.success(), "{}", output.stderr);
    let status: InterDcStatus = serde_json::from_str(&output.stdout).unwrap();
    println!("{}", status.render(status.unix_ms));
    assert_eq!(status.backlog_keys, 0);
    assert_eq!(
        status.copied_blocks as usize,
        wanted.len() - before_kill.len(),
        "the resumed run copied exactly the blocks the killed one had not finished"
    );
    // A put_start in flight at the kill may have reserved space at the target after
    // the wait above: the resumed run meets that reservation (without spending WAN
    // bytes) until it times out.
    let met_reservation = status
        .settled
        .get("already_at_target")
        .copied()
        .unwrap_or(0);
    println!("blocks that met a reservation of the killed run: {met_reservation}");
    assert!(status.copied_total >= status.copied_blocks);
    assert_eq!(status.skipped.get("filtered"), Some(&3));
    assert!(
        status.fec_recoveries + status.stripes_retransmitted > 0,
        "1% loss each way left no trace: is the loss emulated?"
    );
    assert!(status.wire_bytes >= status.copied_bytes * 5 / 4);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_block_evicted_at_the_source_mid_copy_is_a_clean_skip() {
    let source = Pool::start(pool("src", &[("s0", "prefill")])).await;
    let bytes = value(1, 100_000);
    source.kv["s0"].put("gone-soon", &bytes, 1).await.unwrap();
    let nats = source.fixture.connect().await;
    let _gateway = hkvm_interdc::Gateway::start(
        nats.clone(),
        hkvm_interdc::GatewayConfig {
            cluster: source.fixture.cluster.clone(),
            bind_ip: "127.0.0.1".parse().unwrap(),
            impairment: Impairment::none(),
            max_concurrent: 4,
            peers: vec!["127.0.0.0/8".parse().unwrap()],
        },
    )
    .await
    .unwrap();
    let settings = ReceiverSettings {
        bind_ip: "127.0.0.1".parse().unwrap(),
        advertise_host: "127.0.0.1".into(),
        impairment: Impairment::none(),
    };
    let shape = WanShape {
        rate_bytes_per_sec: 50_000_000,
        data_shards: 64,
        parity_shards: 16,
        shard_bytes: 1024,
        feedback_timeout_ms: 0,
    };
    let mut candidate = Candidate {
        hash: hkvm_events::key_hash("gone-soon"),
        block: SourceBlock {
            key: "gone-soon".into(),
            size: bytes.len() as u64,
            checksum: value_checksum(&bytes),
            committed_unix_ms: 0,
        },
        subcluster: SubclusterId::new("s0").unwrap(),
    };
    let fetched = fetch(&nats, &source.fixture.cluster, &settings, &candidate, shape)
        .await
        .unwrap();
    assert!(
        matches!(&fetched, Fetched::Block { value, .. } if value.as_ref() == bytes.as_slice()),
        "a present block arrives byte-exact"
    );
    // The checksum the master expects differs from the source's value: the
    // gateway says so instead of sending.
    candidate.block.checksum ^= 1;
    let fetched = fetch(&nats, &source.fixture.cluster, &settings, &candidate, shape)
        .await
        .unwrap();
    assert!(matches!(fetched, Fetched::Changed));
    candidate.block.checksum ^= 1;
    // Evicted (removed) at the source between the diff and the copy.
    source.kv["s0"]
        .metadata()
        .remove(vec!["gone-soon".into()], true)
        .await
        .unwrap();
    let fetched = fetch(&nats, &source.fixture.cluster, &settings, &candidate, shape)
        .await
        .unwrap();
    assert!(matches!(fetched, Fetched::Gone), "got {fetched:?}");

    // Garbage on the fetch subject gets a typed answer, not silence or a crash.
    let subject = hkvm_events::subject::interdc_fetch_subject(&source.fixture.cluster);
    for garbage in [&b""[..], b"\xc1\xff", b"not msgpack at all"] {
        let reply = nats
            .request(subject.clone(), garbage.to_vec().into())
            .await
            .unwrap();
        let reply: FetchReply = rmp_serde::from_slice(&reply.payload).unwrap();
        assert!(matches!(reply, FetchReply::BadRequest(_)), "{reply:?}");
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_source_stream_purged_up_to_a_snapshot_is_seeded_from_it() {
    let source = Pool::start(
        pool("snap", &[("s0", "prefill")]).tweak(|config| config.snapshot_every_events = 8),
    )
    .await;
    let target = Pool::start(pool("dst", &[("t0", "decode")])).await;
    let mut wanted = BTreeMap::new();
    for i in 0..30 {
        let key = format!("old/{i}");
        let bytes = value(i, 8192 + i);
        source.kv["s0"].put(&key, &bytes, 1).await.unwrap();
        wanted.insert(key, bytes);
    }
    // Wait for a snapshot covering every put above (more puts trigger snapshots).
    let js = async_nats::jetstream::new(source.fixture.connect().await);
    let subcluster = SubclusterId::new("s0").unwrap();
    let mut stream = js
        .get_stream(stream_name(&source.fixture.cluster, &subcluster))
        .await
        .unwrap();
    let needed = stream.info().await.unwrap().state.last_sequence;
    let store = hkvm_log::SnapshotStore::open(&js, &source.fixture.cluster, &subcluster, 1)
        .await
        .unwrap();
    let mut filler = 0;
    let covers = loop {
        if let Some(state) = hkvm_submaster::snapshot::load_newest(&store).await.unwrap() {
            if state.applied_seq >= needed {
                break state.applied_seq;
            }
        }
        assert!(filler < 200, "no snapshot covered the puts");
        let key = format!("new/{filler}");
        let bytes = value(1000 + filler, 1024);
        source.kv["s0"].put(&key, &bytes, 1).await.unwrap();
        wanted.insert(key, bytes);
        filler += 1;
        tokio::time::sleep(Duration::from_millis(20)).await;
    };
    stream.purge().sequence(covers + 1).await.unwrap();
    assert_eq!(
        stream.info().await.unwrap().state.first_sequence,
        covers + 1
    );

    let nats = source.fixture.connect().await;
    let _gateway = hkvm_interdc::Gateway::start(
        nats,
        hkvm_interdc::GatewayConfig {
            cluster: source.fixture.cluster.clone(),
            bind_ip: "127.0.0.1".parse().unwrap(),
            impairment: Impairment::none(),
            max_concurrent: 8,
            peers: vec!["127.0.0.0/8".parse().unwrap()],
        },
    )
    .await
    .unwrap();
    let mut config = hkvm_interdc::InterDcConfig::new(
        source.address().parse().unwrap(),
        target.address().parse().unwrap(),
    );
    config.policy.rate_bytes_per_sec = 50_000_000;
    config.status_interval = Duration::from_millis(100);
    let mut master = hkvm_interdc::InterDc::start(config).await.unwrap();
    let status = tokio::time::timeout(Duration::from_secs(60), async {
        loop {
            let status = master.status_changed().await;
            if status.copying && status.backlog_keys == 0 && status.in_flight == 0 {
                return status;
            }
        }
    })
    .await
    .expect("the copy did not finish");
    assert_eq!(status.copied_blocks as usize, wanted.len());
    for (key, bytes) in &wanted {
        let fetched = target.kv["t0"].get(key).await.unwrap();
        assert_eq!(fetched.value.as_ref(), bytes.as_slice(), "{key}");
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn under_the_generated_users_the_gateway_and_master_copy_with_their_own_credentials() {
    let source = Pool::start(pool("prefill", &[("p0", "prefill")]).secured(&["decode"], &[])).await;
    let target = Pool::start(pool("decode", &[("d0", "decode")]).secured(&[], &["prefill"])).await;
    let mut wanted = BTreeMap::new();
    for i in 0..8 {
        let key = format!("model-s/block-{i}");
        let bytes = value(200 + i, 48 * 1024);
        source.kv["p0"].put(&key, &bytes, 1).await.unwrap();
        wanted.insert(key, bytes);
    }
    let dir = tempfile::tempdir().unwrap();
    let policy = dir.path().join("policy.toml");
    std::fs::write(&policy, "[target_labels]\npool = \"decode\"\n").unwrap();
    let source_cluster = hkvm_events::ClusterId::new("prefill").unwrap();
    let target_cluster = hkvm_events::ClusterId::new("decode").unwrap();
    let gateway = hkvm(
        "hkvm interdc gateway (secured)",
        &[
            "interdc",
            "gateway",
            "--source",
            &source.address_as(security::GATEWAY_USER),
            "--peer",
            "127.0.0.0/8",
        ],
    )
    .await;
    gateway
        .wait_for_line(Stream::Stdout, "inter-DC gateway of", WAIT)
        .await;
    let mut master = hkvm(
        "hkvm interdc (secured)",
        &[
            "interdc",
            "--source",
            &source.address_as(&security::source_user(&target_cluster)),
            "--target",
            &target.address_as(&security::target_user(&source_cluster)),
            "--policy",
            policy.to_str().unwrap(),
            "--until-idle",
        ],
    )
    .await;
    let exit = master.wait_exit(Duration::from_secs(120)).await;
    assert!(exit.success(), "the secured master failed: {exit}");
    let d0 = target.commits("d0").await;
    for (key, bytes) in &wanted {
        assert_eq!(d0.get(key), Some(&1), "{key} committed once in d0");
        let fetched = target.kv["d0"].get(key).await.unwrap();
        assert_eq!(fetched.value.as_ref(), bytes.as_slice(), "{key} byte-exact");
    }
}
