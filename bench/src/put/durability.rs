//! Durable puts under the two JetStream profiles, in the same run: nats-server's
//! default (fsync every 2 minutes) against the power-loss-safe one
//! (`sync_interval: always`, what `hkvm local --durable` starts). Each profile
//! gets a nats-server and a sub-master of its own, both running throughout;
//! every case runs on the default profile and then on the durable one, so the
//! machine's drift hits both alike.

use std::time::Duration;

use hkvm_client::SubmasterClient;
use hkvm_events::{ClusterId, ProducerId, SubclusterId};
use hkvm_submaster::{SubmasterConfig, SubmasterHandle};
use hkvm_testkit::{Durability, ServerOptions};

use super::leased::run_leased_clients;
use super::{mount_bench_nodes, run_clients, WORKLOAD};
use crate::latency::quantile_us;
use crate::report::{BenchResult, Printer};
use crate::BenchNats;

/// One profile's nats-server, sub-master and client.
struct Profile {
    nats: BenchNats,
    master: SubmasterHandle,
    client: SubmasterClient,
    pinger: tokio::task::JoinHandle<()>,
}

impl Profile {
    async fn start(durability: Durability) -> anyhow::Result<Self> {
        let nats = BenchNats::start_with(ServerOptions {
            name: format!("hkvm-bench-{durability:?}").to_lowercase(),
            durability,
            ..ServerOptions::default()
        })
        .await?;
        let cluster = ClusterId::new("bench")?;
        let subcluster = SubclusterId::new("profile")?;
        let config = SubmasterConfig::new(
            cluster.clone(),
            subcluster.clone(),
            ProducerId::new("bench-profile")?,
        );
        let master = SubmasterHandle::spawn(nats.connect().await?, config);
        let client = SubmasterClient::new(nats.connect().await?, cluster, subcluster);
        let pinger = mount_bench_nodes(&client).await?;
        Ok(Self {
            nats,
            master,
            client,
            pinger,
        })
    }

    async fn stop(self) -> anyhow::Result<()> {
        self.pinger.abort();
        self.master.shutdown().await?;
        drop(self.nats);
        Ok(())
    }
}

/// One case's figure on a profile: its rate and, for single clients, its p50.
struct Measured {
    rate: f64,
    p50_us: Option<f64>,
}

/// Runs `case` (0..CASES) against `client`.
async fn run_case(
    client: &SubmasterClient,
    case: usize,
    duration: Duration,
) -> anyhow::Result<Measured> {
    Ok(match case {
        0 => {
            let (rate, latencies) = run_leased_clients(client, 1, duration, "dur-lease1").await?;
            Measured {
                rate,
                p50_us: Some(quantile_us(&latencies, 0.5)),
            }
        }
        1 => Measured {
            rate: run_leased_clients(client, 64, duration, "dur-lease64")
                .await?
                .0,
            p50_us: None,
        },
        2 => {
            let run = run_clients(client, 1, 1, duration, "dur-one").await?;
            Measured {
                rate: run.rate,
                p50_us: Some(quantile_us(&run.rounds, 0.5)),
            }
        }
        3 => Measured {
            rate: run_clients(client, 64, 1, duration, "dur-many").await?.rate,
            p50_us: None,
        },
        _ => Measured {
            rate: run_clients(client, 8, 256, duration, "dur-batch")
                .await?
                .rate,
            p50_us: None,
        },
    })
}

/// The cases, in the order [`run_case`] numbers them, with their units.
const CASES: [(&str, &str); 5] = [
    ("put_commit into a space lease, 1 client", "ops/s"),
    ("put_commit into a space lease, 64 clients", "ops/s"),
    ("put_start+put_end, 1 client", "ops/s"),
    ("put_start+put_end, 64 clients", "ops/s"),
    ("batch put, 8 clients x 256 objects", "objects/s"),
];

/// Measures every case on both profiles and prints the durable one against the
/// default.
///
/// # Errors
/// When a nats-server or a sub-master cannot start, or a put fails.
pub(crate) async fn durability_profiles(
    duration: Duration,
    printer: &mut Printer,
) -> anyhow::Result<()> {
    eprintln!(
        "bench put: the default JetStream profile against the durable one (sync_interval: always)"
    );
    let default = Profile::start(Durability::Default).await?;
    let durable = Profile::start(Durability::Durable).await?;
    for (case, (name, unit)) in CASES.iter().enumerate() {
        let on_default = run_case(&default.client, case, duration).await?;
        let on_durable = run_case(&durable.client, case, duration).await?;
        let baseline = format!("{name}, default profile (fsync every 2 min)");
        printer.print(&BenchResult::new(
            WORKLOAD,
            format!("{name}, durable profile (sync_interval: always)"),
            on_durable.rate,
            unit,
            baseline.as_str(),
            on_default.rate,
        ));
        if let (Some(durable_p50), Some(default_p50)) = (on_durable.p50_us, on_default.p50_us) {
            printer.print(&BenchResult::new(
                WORKLOAD,
                format!("{name} p50, durable profile (sync_interval: always)"),
                durable_p50,
                "us",
                format!("{baseline} p50"),
                default_p50,
            ));
        }
    }
    default.stop().await?;
    durable.stop().await
}
