//! `hkvm local`: the main job of a fresh checkout. Starts nats-server (JetStream, temp
//! store dir) as a child process and every HKVM service on top of it — by default two
//! sub-clusters, each with a leader and a hot-standby sub-master — prints where
//! everything is, and stops it all cleanly on Ctrl-C or SIGTERM.

use std::net::{SocketAddr, TcpListener};
use std::time::Duration;

use anyhow::Context as _;
use hkvm_events::{ClusterId, ProducerId, SubclusterId};
use hkvm_submaster::{SubmasterConfig, SubmasterHandle};
use hkvm_testkit::{NatsServer, ServerOptions};

/// Options of `hkvm local`.
#[derive(Debug, clap::Args)]
pub struct LocalArgs {
    /// Cluster name used in subjects and stream names.
    #[arg(long, default_value = "local")]
    pub cluster: ClusterId,
    /// Number of sub-clusters (each gets a leader and a standby sub-master).
    #[arg(long, default_value_t = 2)]
    pub subclusters: usize,
    /// NATS client port; 4222 (the CLI's default) when free, else an ephemeral one.
    #[arg(long, default_value_t = 4222)]
    pub port: u16,
    /// First port of the sub-masters' Prometheus endpoints (0: none).
    #[arg(long, default_value_t = 9400)]
    pub metrics_base_port: u16,
    /// Stop by itself after this long (e.g. `30s`); runs until Ctrl-C when absent.
    #[arg(long, value_parser = humantime::parse_duration)]
    pub run_for: Option<Duration>,
}

fn port_is_free(port: u16) -> bool {
    TcpListener::bind(("127.0.0.1", port)).is_ok()
}

/// Runs the local cluster until Ctrl-C, SIGTERM or `--run-for`.
///
/// # Errors
/// When nats-server cannot be found or started, or a service fails to start.
pub async fn run(args: LocalArgs) -> anyhow::Result<()> {
    let options = ServerOptions {
        name: format!("hkvm-{}", args.cluster),
        client_port: port_is_free(args.port).then_some(args.port),
        ..ServerOptions::default()
    };
    let mut nats = NatsServer::start_with(options)
        .await
        .context("starting the embedded nats-server")?;
    tracing::info!(url = %nats.url(), store = %nats.store_dir().display(), "nats-server with JetStream is up");

    let mut services = Vec::new();
    let mut metrics = Vec::new();
    for index in 0..args.subclusters {
        let subcluster = SubclusterId::new(format!("sc-{index}"))?;
        for role in ["a", "b"] {
            let producer = ProducerId::new(format!("sm-{index}{role}"))?;
            let mut config = SubmasterConfig::new(args.cluster.clone(), subcluster.clone(), producer);
            config.labels.insert("pool".into(), format!("pool-{}", index % 2));
            if args.metrics_base_port != 0 {
                let port = args.metrics_base_port + services.len() as u16;
                if port_is_free(port) {
                    config.metrics_addr = Some(SocketAddr::from(([127, 0, 0, 1], port)));
                    metrics.push(format!("{}{role}: http://127.0.0.1:{port}/metrics", config.subcluster));
                }
            }
            services.push(SubmasterHandle::spawn(nats.connect().await?, config));
            // Let the first instance of each sub-cluster take the lease.
            tokio::time::sleep(Duration::from_millis(200)).await;
        }
    }

    println!("HKVM local cluster '{}' is running.", args.cluster);
    println!("  NATS:        {}   (monitoring http://127.0.0.1:{}/)", nats.url(), nats.monitor_port());
    println!("  sub-masters: {} sub-clusters (sc-0..), each a leader + a hot standby", args.subclusters);
    for line in &metrics {
        println!("  metrics:     {line}");
    }
    println!("Try:");
    println!("  hkvm stat   --nats {} --cluster {} --subcluster sc-0", nats.url(), args.cluster);
    println!("  hkvm replay --nats {} --cluster {} --follow", nats.url(), args.cluster);
    println!("Press Ctrl-C to stop.");

    match args.run_for {
        Some(limit) => {
            tokio::select! {
                () = crate::signals::terminated() => {}
                () = tokio::time::sleep(limit) => {}
            }
        }
        None => crate::signals::terminated().await,
    }
    tracing::info!("stopping the local cluster");
    for service in services {
        if let Err(error) = service.shutdown().await {
            tracing::warn!(%error, "a sub-master stopped with an error");
        }
    }
    nats.stop();
    println!("Stopped.");
    Ok(())
}
