//! `hkvm bench interdc` (`hkvm-bench interdc`): the inter-DC replicator end to end. A source pool and a
//! target pool, each on its own nats-server with a sub-master and two nodes; a
//! gateway and an inter-DC master in this process, the WAN between them over UDP
//! loopback with 25 ms of delay and 1% loss each way (emulated in both ends'
//! egress). Reported: goodput against the bandwidth cap, and bytes on the wire per
//! payload byte against the stripe shape's nominal overhead — for the default
//! 64+16 shape, a lighter 64+4 shape, 64+16 on a clean link, and 64+16 with more
//! copies in flight (each lane waits one round trip per block).

use std::sync::Arc;
use std::time::{Duration, Instant};

use anyhow::Context as _;
use hkvm_client::{KvClient, NodeConfig, NodeHandle, SubmasterClient};
use hkvm_events::{ClusterId, NodeId, ProducerId, SubclusterId};
use hkvm_interdc::{ClusterAddress, Gateway, GatewayConfig, InterDc, InterDcConfig, Policy};
use hkvm_submaster::{SubmasterConfig, SubmasterHandle};
use hkvm_testkit::NatsServer;
use hkvm_transfer::wan::{FecConfig, Impairment};
use hkvm_transfer::TcpTransport;

use super::report::{BenchResult, Printer};
use super::BenchNats;

const WORKLOAD: &str = "interdc";
/// Bytes per block (a KV-cache block of a mid-size model).
const BLOCK: usize = 256 * 1024;

/// One pool: a sub-master and two nodes.
struct Pool {
    kv: KvClient,
    master: SubmasterHandle,
    nodes: Vec<NodeHandle>,
}

impl Pool {
    async fn start(
        nats: &async_nats::Client,
        cluster: &ClusterId,
        segment: u64,
    ) -> anyhow::Result<Self> {
        let subcluster = SubclusterId::new("sc-0")?;
        let mut config = SubmasterConfig::new(
            cluster.clone(),
            subcluster.clone(),
            ProducerId::new(format!("{cluster}-sm"))?,
        );
        config.registry_ttl = Duration::from_secs(3);
        let master = SubmasterHandle::spawn(nats.clone(), config);
        let metadata = SubmasterClient::new(nats.clone(), cluster.clone(), subcluster);
        let mut nodes = Vec::new();
        for n in 0..2 {
            let node = NodeConfig::new(NodeId::new(format!("{cluster}-n{n}"))?, segment)?;
            nodes.push(NodeHandle::start(node, metadata.clone()).await?);
        }
        Ok(Self {
            kv: KvClient::new(metadata, Arc::new(TcpTransport::default())),
            master,
            nodes,
        })
    }

    async fn stop(self) {
        for node in self.nodes {
            let _ = node.shutdown().await;
        }
        let _ = self.master.shutdown().await;
    }
}

/// One replication run into a fresh target pool.
struct Run {
    /// From the first copy to the last.
    seconds: f64,
    payload: u64,
    wire: u64,
    fec_recoveries: u64,
    stripes_retransmitted: u64,
}

/// The WAN case of one run.
struct Case {
    label: &'static str,
    target: &'static str,
    fec: FecConfig,
    loss: f64,
    lanes: usize,
}

async fn replicate(
    source_nats: &async_nats::Client,
    source: &ClusterAddress,
    target_server: &NatsServer,
    case: &Case,
    segment: u64,
    rate: u64,
    expected_blocks: u64,
) -> anyhow::Result<Run> {
    let (target_name, fec, loss) = (case.target, case.fec, case.loss);
    let gateway = Gateway::start(
        source_nats.clone(),
        GatewayConfig {
            cluster: source.cluster.clone(),
            bind_ip: "127.0.0.1".parse()?,
            impairment: Impairment {
                delay: Duration::from_millis(25),
                loss,
                seed: 11,
            },
            max_concurrent: 64,
            peers: vec!["127.0.0.0/8".parse()?],
        },
    )
    .await?;
    let target_cluster = ClusterId::new(target_name)?;
    let target_nats = target_server.connect().await?;
    let pool = Pool::start(&target_nats, &target_cluster, segment).await?;
    let impairment = Impairment {
        delay: Duration::from_millis(25),
        loss,
        seed: 7,
    };
    let mut config = InterDcConfig::new(
        source.clone(),
        ClusterAddress {
            url: target_server.url(),
            cluster: target_cluster,
        },
    );
    config.policy = Policy {
        rate_bytes_per_sec: rate,
        lanes: case.lanes,
        ..Policy::default()
    };
    config.fec = fec;
    config.impairment = impairment;
    config.wan_rtt = Duration::from_millis(50);
    config.status_interval = Duration::from_millis(200);
    let started = Instant::now();
    let mut master = InterDc::start(config).await?;
    let deadline = started + Duration::from_secs(600);
    let mut last_print = Instant::now();
    let status = loop {
        let status = tokio::time::timeout(Duration::from_secs(5), master.status_changed())
            .await
            .unwrap_or_else(|_| master.status());
        if status.copying && status.backlog_keys == 0 && status.in_flight == 0 {
            break status;
        }
        anyhow::ensure!(
            Instant::now() < deadline,
            "replication did not finish: {status:?}"
        );
        if last_print.elapsed() >= Duration::from_secs(5) {
            last_print = Instant::now();
            eprintln!(
                "  interdc {target_name}: {}/{expected_blocks} blocks copied",
                status.copied_blocks
            );
        }
    };
    // From the first copy to the last: start-up (connecting, catching up with both
    // pools) is not WAN time.
    let seconds = status.unix_ms.saturating_sub(status.copying_since_unix_ms) as f64 / 1e3;
    anyhow::ensure!(
        status.copied_blocks == expected_blocks,
        "copied {} of {expected_blocks} blocks (given up: {})",
        status.copied_blocks,
        status.given_up
    );
    drop(master);
    drop(gateway);
    pool.stop().await;
    Ok(Run {
        seconds,
        payload: status.copied_bytes,
        wire: status.wire_bytes,
        fec_recoveries: status.fec_recoveries,
        stripes_retransmitted: status.stripes_retransmitted,
    })
}

/// Runs the workload.
///
/// # Errors
/// When a pool, the gateway or the replicator cannot be set up, or a run does not
/// copy every block.
pub async fn run(nats: &BenchNats, quick: bool, printer: &mut Printer) -> anyhow::Result<()> {
    let (blocks, rate) = if quick {
        (24u64, 10_000_000)
    } else {
        (800, 40_000_000)
    };
    let segment = (blocks * BLOCK as u64).max(64 << 20);
    // The source pool lives on the benchmark's nats-server; each target on a second one.
    let source_cluster = ClusterId::new("bench-prefill")?;
    let source_nats = nats.connect().await?;
    let source = Pool::start(&source_nats, &source_cluster, segment).await?;
    for i in 0..blocks {
        let value: Vec<u8> = (0..BLOCK)
            .map(|j| (j as u64 ^ i.wrapping_mul(31)) as u8)
            .collect();
        source
            .kv
            .put(&format!("bench/block-{i:05}"), &value, 1)
            .await
            .context("filling the source pool")?;
    }
    let target_server = NatsServer::start()
        .await
        .context("starting the target's nats-server")?;
    let source_address = ClusterAddress {
        url: nats.url.clone(),
        cluster: source_cluster,
    };
    let heavy = FecConfig::default();
    let light = FecConfig {
        parity_shards: 4,
        ..FecConfig::default()
    };
    let cases = [
        Case {
            label: "64+16, 8 lanes, 25 ms + 1% loss each way",
            target: "bench-decode-a",
            fec: heavy,
            loss: 0.01,
            lanes: 8,
        },
        Case {
            label: "64+4, 8 lanes, 25 ms + 1% loss each way",
            target: "bench-decode-b",
            fec: light,
            loss: 0.01,
            lanes: 8,
        },
        Case {
            label: "64+16, 8 lanes, 25 ms, no loss",
            target: "bench-decode-c",
            fec: heavy,
            loss: 0.0,
            lanes: 8,
        },
        Case {
            label: "64+16, 32 lanes, 25 ms + 1% loss each way",
            target: "bench-decode-d",
            fec: heavy,
            loss: 0.01,
            lanes: 32,
        },
    ];
    for case in &cases {
        let run = replicate(
            &source_nats,
            &source_address,
            &target_server,
            case,
            segment,
            rate,
            blocks,
        )
        .await?;
        let (label, fec) = (case.label, case.fec);
        let nominal = fec.total_shards() as f64 / fec.data_shards as f64;
        printer.print(&BenchResult::new(
            WORKLOAD,
            format!("goodput, {blocks} x 256 KiB, {label}"),
            run.payload as f64 / run.seconds,
            "B/s",
            "bandwidth cap",
            rate as f64,
        ));
        printer.print(&BenchResult::new(
            WORKLOAD,
            format!(
                "wire bytes per payload byte, {label} ({} FEC recoveries, {} stripes resent)",
                run.fec_recoveries, run.stripes_retransmitted
            ),
            run.wire as f64 / run.payload.max(1) as f64,
            "x",
            "nominal shape overhead",
            nominal,
        ));
    }
    source.stop().await;
    Ok(())
}
