//! `hkvm local`: the main job of a fresh checkout. Starts nats-server (JetStream, temp
//! store dir) as a child process and every HKVM service on top of it, prints where
//! everything is, and stops it all cleanly on Ctrl-C.

use std::time::Duration;

use anyhow::Context as _;
use hkvm_testkit::{NatsServer, ServerOptions};

/// Options of `hkvm local`.
#[derive(Debug, clap::Args)]
pub struct LocalArgs {
    /// Cluster name used in subjects and stream names.
    #[arg(long, default_value = "local")]
    pub cluster: String,
    /// Stop by itself after this long (e.g. `30s`); runs until Ctrl-C when absent.
    #[arg(long, value_parser = humantime::parse_duration)]
    pub run_for: Option<Duration>,
}

/// Runs the local cluster until Ctrl-C (or `--run-for`).
///
/// # Errors
/// When nats-server cannot be found or started.
pub async fn run(args: LocalArgs) -> anyhow::Result<()> {
    let options = ServerOptions {
        name: format!("hkvm-{}", args.cluster),
        ..ServerOptions::default()
    };
    let nats = NatsServer::start_with(options)
        .await
        .context("starting the embedded nats-server")?;
    tracing::info!(
        url = %nats.url(),
        monitor = %format!("http://127.0.0.1:{}/jsz", nats.monitor_port()),
        store = %nats.store_dir().display(),
        "nats-server with JetStream is up"
    );
    println!("HKVM local cluster '{}' is running.", args.cluster);
    println!("  NATS:       {}", nats.url());
    println!("  monitoring: http://127.0.0.1:{}/", nats.monitor_port());
    println!("Press Ctrl-C to stop.");

    match args.run_for {
        Some(limit) => {
            tokio::select! {
                _ = tokio::signal::ctrl_c() => {}
                () = tokio::time::sleep(limit) => {}
            }
        }
        None => tokio::signal::ctrl_c()
            .await
            .context("waiting for Ctrl-C")?,
    }
    tracing::info!("stopping the local cluster");
    let mut nats = nats;
    nats.stop();
    println!("Stopped.");
    Ok(())
}
