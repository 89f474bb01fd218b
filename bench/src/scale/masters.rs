//! The masters of one point of the `scale` workload: N sub-masters and a global
//! master as `hkvm` child processes of a fresh cluster, started and waited
//! for, and the CPU time they (and nats-server) spend over a window.

use std::path::Path;

use anyhow::Context as _;
use async_nats::jetstream;
use hkvm_client::{GlobalClient, SubmasterClient};
use hkvm_events::rpc::global::{BatchIsExist, BatchIsExistReply, GlobalOp};
use hkvm_events::{ClusterId, SubclusterId};

use super::{clean, cpu_seconds, machine_cpu_ticks, Master};
use crate::BenchNats;

/// The running masters of a point; dropping it kills them.
pub(super) struct Masters {
    /// The point's cluster.
    pub(super) cluster: ClusterId,
    /// Its sub-clusters, `sc-0` .. `sc-<N-1>`.
    pub(super) ids: Vec<SubclusterId>,
    /// A connection for the point's own requests.
    pub(super) control: async_nats::Client,
    submasters: Vec<Master>,
    global: Master,
    nats_pid: Option<u32>,
}

/// Waits until a global master of `cluster` answers a `batch_is_exist`: it
/// serves once it follows every registered sub-cluster.
///
/// # Errors
/// When none answers.
pub(crate) async fn wait_global_serves(
    control: async_nats::Client,
    cluster: &ClusterId,
) -> anyhow::Result<()> {
    let _: BatchIsExistReply = GlobalClient::new(control, cluster.clone())
        .call(
            GlobalOp::BatchIsExist,
            &BatchIsExist {
                keys: vec!["probe".to_owned()],
                labels: None,
            },
        )
        .await
        .context("the global master did not start")?;
    Ok(())
}

/// CPU seconds so far of the sub-masters (together), the global master and
/// nats-server, and the machine's busy and total ticks.
#[derive(Debug, Clone, Copy)]
pub(super) struct CpuSample {
    pub(super) submasters: f64,
    pub(super) global: f64,
    pub(super) nats: f64,
    machine: Option<(u64, u64)>,
}

impl CpuSample {
    /// The share of the machine's CPU time (all cores) busy since `earlier`.
    pub(super) fn machine_busy_since(&self, earlier: &CpuSample) -> f64 {
        match (earlier.machine, self.machine) {
            (Some((busy0, total0)), Some((busy1, total1))) if total1 > total0 => {
                busy1.saturating_sub(busy0) as f64 / (total1 - total0) as f64
            }
            _ => 0.0,
        }
    }
}

impl Masters {
    /// Drops what an earlier run of cluster `name` left, starts `subclusters`
    /// sub-masters and a global master (`exe`), and waits until every
    /// sub-master answers.
    ///
    /// # Errors
    /// When a master cannot be started or does not answer.
    pub(super) async fn start(
        nats: &BenchNats,
        exe: &Path,
        name: String,
        subclusters: usize,
    ) -> anyhow::Result<Self> {
        let cluster = ClusterId::new(name)?;
        let control = nats.connect().await?;
        clean(&jetstream::new(control.clone()), &cluster, subclusters).await;
        let args = |command: &str, extra: &[&str]| {
            let mut args = vec![
                command.to_owned(),
                "--nats".to_owned(),
                nats.url.clone(),
                "--cluster".to_owned(),
                cluster.to_string(),
            ];
            args.extend(extra.iter().map(|arg| (*arg).to_owned()));
            args
        };
        let ids: Vec<SubclusterId> = (0..subclusters)
            .map(|i| SubclusterId::new(format!("sc-{i}")))
            .collect::<Result<_, _>>()?;
        let mut submasters = Vec::new();
        for id in &ids {
            submasters.push(Master::spawn(
                exe,
                &args("submaster", &["--subcluster", id.as_str()]),
            )?);
        }
        let global = Master::spawn(exe, &args("globalmaster", &["--no-restore"]))?;
        for id in &ids {
            SubmasterClient::new(control.clone(), cluster.clone(), id.clone())
                .status()
                .await
                .with_context(|| format!("sub-master {id} did not start"))?;
        }
        Ok(Self {
            cluster,
            ids,
            control,
            submasters,
            global,
            nats_pid: nats.pid(),
        })
    }

    /// Waits until the global master answers: it serves once it follows every
    /// registered sub-cluster (call it after the nodes mounted).
    ///
    /// # Errors
    /// When it does not answer.
    pub(super) async fn wait_global(&self) -> anyhow::Result<()> {
        wait_global_serves(self.control.clone(), &self.cluster).await
    }

    /// The CPU time spent so far.
    pub(super) fn cpu(&self) -> CpuSample {
        CpuSample {
            submasters: self.submasters.iter().map(|m| cpu_seconds(m.pid())).sum(),
            global: cpu_seconds(self.global.pid()),
            nats: cpu_seconds(self.nats_pid),
            machine: machine_cpu_ticks(),
        }
    }

    /// The process ids of the sub-masters and of the global master.
    pub(super) fn pids(&self) -> (Vec<Option<u32>>, Option<u32>) {
        (
            self.submasters.iter().map(Master::pid).collect(),
            self.global.pid(),
        )
    }
}
