//! Scenario 9: the inter-DC level across two datacenters. Two complete pools, each
//! with its own 3-node NATS cluster on its own Docker network; a gateway container
//! in the source datacenter; the inter-DC master in the target one, reaching the
//! source's NATS and gateway over the "WAN" (the source's NATS and gateway are
//! attached to the target network, nothing else is), with 25 ms of delay and 1%
//! loss each way emulated in the gateway's and master's egress. The master is
//! killed with SIGKILL mid-run and started again: every block arrives byte-exact,
//! each committed once at the target, and the resumed run copies only the rest.

use std::collections::BTreeMap;
use std::time::{Duration, Instant};

use futures::StreamExt as _;
use hkvm_events::subject::{event_subject, stream_name};
use hkvm_events::{decode_message, ClusterId, KvEvent, Limits, SubclusterId};
use hkvm_interdc::ClusterAddress;
use hkvm_itests::images::hkvm_image;
use hkvm_log::{EventLog, JetStreamLog, ReadOptions};
use testcontainers::core::WaitFor;
use testcontainers::runners::AsyncRunner as _;
use testcontainers::ImageExt as _;

use super::topology::{Container, Spec, Topology, CLUSTER, SUBMASTER_TOML};
use super::{docker, loadgen, report};

/// Bytes per block.
const VALUE_SIZE: &str = "65536";

/// How many times each key was committed in `topology`'s `sc-0` stream.
///
/// Right after the containers start, the stream may have no elected leader yet
/// and a read fails ("no responders"): the stream counts as ready once one whole
/// read succeeds, which this waits for (60 s at most).
async fn commits(topology: &Topology) -> BTreeMap<String, u32> {
    let cluster = ClusterId::new(CLUSTER).unwrap();
    let subcluster = SubclusterId::new("sc-0").unwrap();
    let log = JetStreamLog::new(
        async_nats::jetstream::new(topology.connect(0).await),
        stream_name(&cluster, &subcluster),
        event_subject(&cluster, &subcluster),
    );
    let deadline = Instant::now() + Duration::from_secs(60);
    loop {
        match read_commits(&log).await {
            Ok(commits) => return commits,
            Err(error) if Instant::now() < deadline => {
                eprintln!("the source stream is not readable yet ({error}); reading again");
                tokio::time::sleep(Duration::from_millis(200)).await;
            }
            Err(error) => panic!("the source stream stayed unreadable for 60 s: {error}"),
        }
    }
}

/// One whole read of the stream; a stream that does not exist yet has no commits.
async fn read_commits(log: &JetStreamLog) -> Result<BTreeMap<String, u32>, hkvm_log::LogError> {
    let mut commits = BTreeMap::new();
    let mut entries = match log.read(ReadOptions::from(1)).await {
        Ok(entries) => entries,
        Err(error) if *error.kind() == hkvm_log::LogErrorKind::StreamNotFound => {
            return Ok(commits)
        }
        Err(error) => return Err(error),
    };
    while let Some(entry) = entries.next().await {
        let entry = entry?;
        let message = decode_message(&entry.payload, &Limits::default()).unwrap();
        for event in message.events {
            if let Ok(KvEvent::PutCommitted(put)) = event {
                *commits.entry(put.key).or_insert(0) += 1;
            }
        }
    }
    Ok(commits)
}

async fn master(target: &Topology, source_url: &str, rate: u64, until_idle: bool) -> Container {
    let name = format!("{}-idc-master", target.network);
    let mut cmd = vec![
        "interdc".to_owned(),
        "--source".to_owned(),
        format!("{source_url}:{CLUSTER}"),
        "--target".to_owned(),
        format!("{}:{CLUSTER}", target.client_url()),
        "--rate".to_owned(),
        rate.to_string(),
        "--lanes".to_owned(),
        "4".to_owned(),
        "--wan-advertise".to_owned(),
        name.clone(),
        "--wan-delay-ms".to_owned(),
        "25".to_owned(),
        "--wan-loss".to_owned(),
        "0.01".to_owned(),
        "--wan-rtt-ms".to_owned(),
        "50".to_owned(),
        "--progress-replicas".to_owned(),
        "3".to_owned(),
    ];
    if until_idle {
        cmd.push("--until-idle".to_owned());
    }
    hkvm_image()
        .with_wait_for(WaitFor::message_on_stderr(
            "loaded the progress of earlier runs",
        ))
        .with_network(&target.network)
        .with_container_name(name)
        .with_env_var("RUST_LOG", "info")
        .with_startup_timeout(Duration::from_secs(60))
        .with_cmd(cmd)
        .start()
        .await
        .unwrap()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn interdc_copies_over_a_lossy_wan_and_resumes_after_kill() {
    let Some(scenario) = report::Scenario::start("9 inter-DC copy, kill -9") else {
        return;
    };
    // The checks count every commit ever appended: the history is kept.
    let spec = |labels: &'static str| Spec {
        subclusters: vec![("sc-0", labels)],
        submasters: 1,
        nodes: 2,
        globals: 0,
        submaster_toml: format!("{SUBMASTER_TOML}purge_history = false\n"),
        ..Spec::default()
    };
    let (source_spec, target_spec) = (spec("pool=prefill"), spec("pool=decode"));
    let (source, target) =
        tokio::join!(Topology::start(&source_spec), Topology::start(&target_spec));
    let args: Vec<String> = [
        "--mode",
        "put",
        "--prefix",
        "idc",
        "--duration",
        "1s",
        "--value-size",
        VALUE_SIZE,
        "--replicas",
        "1",
        "--clients",
        "2",
    ]
    .map(str::to_owned)
    .to_vec();
    let puts = loadgen::start(&source, "sc-0", &args, Vec::new())
        .await
        .finish_puts()
        .await;
    let keys: Vec<String> = puts.acked.iter().map(|(k, _)| k.clone()).collect();
    assert!(keys.len() >= 20, "too few puts: {}", puts.summary);

    // The WAN: the source's NATS and its gateway are reachable from the target
    // network; the target's nodes and NATS are not reachable from the source.
    for nats in &source.nats {
        docker::connect(nats, &target.network).await;
    }
    let gateway = hkvm_image()
        .with_wait_for(WaitFor::message_on_stdout("inter-DC gateway of"))
        .with_network(&source.network)
        .with_container_name(format!("{}-idc-gateway", source.network))
        .with_env_var("RUST_LOG", "info")
        .with_startup_timeout(Duration::from_secs(60))
        .with_cmd([
            "interdc".to_owned(),
            "gateway".to_owned(),
            "--source".to_owned(),
            format!("{}:{CLUSTER}", source.client_url()),
            // The masters' containers: Docker's private address pools.
            "--peer".to_owned(),
            "172.16.0.0/12".to_owned(),
            "--peer".to_owned(),
            "192.168.0.0/16".to_owned(),
            "--peer".to_owned(),
            "10.0.0.0/8".to_owned(),
            "--wan-delay-ms".to_owned(),
            "25".to_owned(),
            "--wan-loss".to_owned(),
            "0.01".to_owned(),
        ])
        .start()
        .await
        .unwrap();
    docker::connect(&gateway, &target.network).await;

    // About six seconds of copying at the cap, so the kill lands mid-run.
    let total_bytes = keys.len() as u64 * VALUE_SIZE.parse::<u64>().unwrap();
    let rate = (total_bytes * 13 / 10 / 6).max(64 * 1024);
    let source_url = source.client_url();
    let started = Instant::now();
    let first = master(&target, &source_url, rate, false).await;
    let deadline = Instant::now() + Duration::from_secs(120);
    loop {
        let copied = commits(&target).await.len();
        if copied >= keys.len() / 4 {
            break;
        }
        assert!(Instant::now() < deadline, "no progress: {copied} copied");
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
    docker::kill(&first).await;
    drop(first);
    tokio::time::sleep(Duration::from_secs(1)).await;
    let before_kill = commits(&target).await.len();
    assert!(
        before_kill < keys.len(),
        "killed after everything was copied"
    );

    let second = master(&target, &source_url, rate, true).await;
    let (code, _, stderr) =
        tokio::time::timeout(Duration::from_secs(300), docker::wait_output(&second))
            .await
            .expect("the resumed master did not finish in five minutes");
    assert_eq!(code, 0, "the resumed master failed: {stderr}");
    let elapsed = started.elapsed();

    let verified = loadgen::verify(&target, "sc-0", &keys, &[]).await;
    loadgen::assert_verified(&verified, keys.len());
    let counts = commits(&target).await;
    let twice: Vec<_> = counts.iter().filter(|(_, n)| **n != 1).collect();
    assert!(twice.is_empty(), "committed more than once: {twice:?}");
    assert_eq!(counts.len(), keys.len());

    let address = ClusterAddress {
        url: target.host_url(0).await,
        cluster: ClusterId::new(CLUSTER).unwrap(),
    };
    let status = hkvm_interdc::read_status(&address, &address.cluster)
        .await
        .unwrap()
        .expect("a status record");
    assert_eq!(
        status.copied_blocks as usize,
        keys.len() - before_kill,
        "the resumed run copied exactly what the killed one had not finished"
    );
    assert!(status.fec_recoveries + status.stripes_retransmitted > 0);
    scenario.passed(
        &format!("{:.1} s for {} MB at a {:.1} MB/s cap", elapsed.as_secs_f64(), total_bytes / 1_000_000, rate as f64 / 1e6),
        keys.len().saturating_sub(verified["ok"].as_u64().unwrap_or(0) as usize),
        &format!(
            "{} blocks; {before_kill} before the kill, {} after; {} FEC recoveries, {} stripes resent; wire {:.2}x payload",
            keys.len(),
            status.copied_blocks,
            status.fec_recoveries,
            status.stripes_retransmitted,
            status.wire_bytes as f64 / status.copied_bytes.max(1) as f64
        ),
    );
}
