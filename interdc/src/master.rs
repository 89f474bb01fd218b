//! The inter-DC master: connect to both pools, load what earlier runs copied,
//! follow both pools' streams until caught up, then keep `lanes` copies in flight,
//! newest blocks first, each paced to its share of the bandwidth cap, and write a
//! status record every second.

use hkvm_log::follow::FollowConfig;
use hkvm_log::positions::Positions;
use std::net::{IpAddr, Ipv4Addr, SocketAddr};
use std::sync::Arc;
use std::time::{Duration, Instant};

use async_nats::jetstream;
use hkvm_events::ClusterId;
use hkvm_log::registry::now_unix_ms;
use hkvm_telemetry::metrics::{gauge_value, label};
use hkvm_telemetry::TelemetryError;
use hkvm_transfer::wan::{FecConfig, Impairment};
use tokio::sync::watch;
use tokio::task::JoinSet;

use crate::address::ClusterAddress;
use crate::copier::{Copier, CopyOutcome};
use crate::diff::{Backlog, Candidate, Diff, Side};
use crate::error::InterDcError;
use crate::follow::{discover, watch_pool, Pool};
use crate::policy::Policy;
use crate::progress::{CopiedRecord, InFlightRecord, Progress};
use crate::shared::Shared;
use crate::status::{InterDcStatus, StreamStatus};
use crate::wan::ReceiverSettings;
use hkvm_events::rpc::interdc::WanShape;

/// Settings of an inter-DC master.
#[derive(Debug, Clone)]
pub struct InterDcConfig {
    /// The pool copied from.
    pub source: ClusterAddress,
    /// The pool copied to.
    pub target: ClusterAddress,
    /// What to copy and how fast.
    pub policy: Policy,
    /// The stripe shape of WAN copies.
    pub fec: FecConfig,
    /// Address the receiving UDP sockets bind to.
    pub wan_bind_ip: IpAddr,
    /// Host name or address the source's gateways send to.
    pub wan_advertise_host: String,
    /// Emulated impairment of this end's WAN egress (tests, benchmarks).
    pub impairment: Impairment,
    /// The WAN round trip (sets how long a sender waits for a lost probe's
    /// answer before probing again).
    pub wan_rtt: Duration,
    /// Liveness TTL of both registries.
    pub registry_ttl: Duration,
    /// Replicas of the progress bucket.
    pub progress_replicas: usize,
    /// How long copy records are kept (zero: forever).
    pub progress_retention: Duration,
    /// Where to serve `/metrics`.
    pub metrics_addr: Option<SocketAddr>,
    /// How often the status record is written.
    pub status_interval: Duration,
    /// The target sub-masters' put timeout: a reservation left by a crashed run
    /// younger than this is given back at start (an older one expired already and
    /// the key may be someone else's put now).
    pub target_put_timeout: Duration,
    /// How both pools' streams are read (batch sizes, resync bounds).
    pub follow: FollowConfig,
}

impl InterDcConfig {
    /// Defaults for copying from `source` to `target`.
    pub fn new(source: ClusterAddress, target: ClusterAddress) -> Self {
        Self {
            source,
            target,
            policy: Policy::default(),
            fec: FecConfig::default(),
            wan_bind_ip: IpAddr::V4(Ipv4Addr::UNSPECIFIED),
            wan_advertise_host: "127.0.0.1".into(),
            impairment: Impairment::none(),
            wan_rtt: Duration::from_millis(200),
            registry_ttl: hkvm_log::registry::DEFAULT_TTL,
            progress_replicas: 1,
            progress_retention: Duration::from_secs(7 * 24 * 3600),
            metrics_addr: None,
            status_interval: Duration::from_secs(1),
            target_put_timeout: Duration::from_secs(30),
            follow: FollowConfig::default(),
        }
    }
}

/// A running inter-DC master. Dropping it stops it.
pub struct InterDc {
    shared: Arc<Shared>,
    status: watch::Receiver<InterDcStatus>,
    stop: watch::Sender<bool>,
    run: tokio::task::JoinHandle<()>,
    metrics_server: Option<hkvm_telemetry::MetricsServer>,
}

impl std::fmt::Debug for InterDc {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("InterDc").finish_non_exhaustive()
    }
}

impl Drop for InterDc {
    fn drop(&mut self) {
        let _ = self.stop.send(true);
        self.run.abort();
        self.shared.stop();
    }
}

async fn connect(address: &ClusterAddress) -> Result<async_nats::Client, InterDcError> {
    address.connect("hkvm-interdc").await
}

impl InterDc {
    /// Connects to both pools, loads the progress, starts following both pools
    /// and starts copying once both are caught up.
    ///
    /// # Errors
    /// [`InterDcError`] when a pool, the progress bucket or the metrics listener
    /// cannot be reached or set up, or the policy is invalid.
    pub async fn start(config: InterDcConfig) -> Result<Self, InterDcError> {
        config.policy.validate()?;
        let source_nats = connect(&config.source).await?;
        let target_nats = connect(&config.target).await?;
        let target_js = jetstream::new(target_nats.clone());
        let progress = Progress::open(
            &target_js,
            &config.source.cluster,
            &config.target.cluster,
            config.progress_replicas,
            config.progress_retention,
        )
        .await?;
        let mut diff = Diff::new();
        let loaded = progress.load().await?;
        tracing::info!(
            copied = loaded.copied.len(),
            in_flight = loaded.in_flight.len(),
            "loaded the progress of earlier runs"
        );
        for hash in loaded.copied {
            diff.mark_copied(hash);
        }
        release_reservations(
            &progress,
            &target_nats,
            &config.target.cluster,
            loaded.in_flight,
            config.target_put_timeout,
        )
        .await;
        let shared = Arc::new(Shared::new(config.policy.clone(), diff));
        let metrics_server = shared
            .metrics
            .registry()
            .serve(config.metrics_addr)
            .await
            .map_err(
                |TelemetryError::Bind { addr, source }| InterDcError::Metrics { addr, source },
            )?;
        let reader = format!("{}-to-{}", config.source.cluster, config.target.cluster);
        let source_js = jetstream::new(source_nats.clone());
        let pools = [
            Pool {
                side: Side::Source,
                cluster: config.source.cluster.clone(),
                positions: Positions::open_for_reader(
                    &source_js,
                    &config.source.cluster,
                    "inter-DC master",
                )
                .await,
                js: source_js,
                registry_ttl: config.registry_ttl,
                follow: config.follow,
                reader: reader.clone(),
            },
            Pool {
                side: Side::Target,
                cluster: config.target.cluster.clone(),
                positions: Positions::open_for_reader(
                    &target_js,
                    &config.target.cluster,
                    "inter-DC master",
                )
                .await,
                js: target_js,
                registry_ttl: config.registry_ttl,
                follow: config.follow,
                reader,
            },
        ];
        for pool in pools {
            discover(&shared, &pool).await;
            shared.keep(tokio::spawn(watch_pool(Arc::clone(&shared), pool)));
        }
        let copier = Copier::new(
            source_nats,
            config.source.cluster.clone(),
            target_nats,
            config.target.cluster.clone(),
            ReceiverSettings {
                bind_ip: config.wan_bind_ip,
                advertise_host: config.wan_advertise_host.clone(),
                impairment: config.impairment,
            },
            config.policy.clone(),
            progress.clone(),
        );
        let initial = InterDcStatus {
            source: config.source.cluster.to_string(),
            target: config.target.cluster.to_string(),
            cap_bytes_per_sec: config.policy.rate_bytes_per_sec,
            ..InterDcStatus::default()
        };
        let (status_tx, status) = watch::channel(initial);
        let (stop, stop_rx) = watch::channel(false);
        let runner = Runner {
            shared: Arc::clone(&shared),
            copier: Arc::new(copier),
            progress,
            config,
            status: status_tx,
            totals: Totals::default(),
        };
        let run = tokio::spawn(runner.run(stop_rx));
        Ok(Self {
            shared,
            status,
            stop,
            run,
            metrics_server,
        })
    }

    /// The latest status.
    pub fn status(&self) -> InterDcStatus {
        self.status.borrow().clone()
    }

    /// Waits for the next status update.
    pub async fn status_changed(&mut self) -> InterDcStatus {
        let _ = self.status.changed().await;
        self.status()
    }

    /// Where `/metrics` is served, if it is.
    pub fn metrics_addr(&self) -> Option<SocketAddr> {
        self.metrics_server
            .as_ref()
            .map(hkvm_telemetry::MetricsServer::addr)
    }

    /// Whether the key is known to be held by the target pool (from its events).
    pub fn target_has(&self, key: &str) -> bool {
        self.shared.diff().target_has(key)
    }
}

/// Totals of this run.
#[derive(Debug, Default)]
struct Totals {
    copied_blocks: u64,
    copied_bytes: u64,
    wire_bytes: u64,
    stripes_retransmitted: u64,
    fec_recoveries: u64,
    failures: u64,
    given_up: u64,
    settled: std::collections::BTreeMap<String, u64>,
}

struct Runner {
    shared: Arc<Shared>,
    copier: Arc<Copier>,
    progress: Progress,
    config: InterDcConfig,
    status: watch::Sender<InterDcStatus>,
    totals: Totals,
}

/// Pause after a settled copy, for the events that explain it to arrive.
const SETTLE_WAIT: Duration = Duration::from_secs(2);
/// Back-off unit after a failed copy (times the attempts so far).
const RETRY_BACKOFF: Duration = Duration::from_secs(1);

impl Runner {
    async fn run(mut self, mut stop: watch::Receiver<bool>) {
        let lanes = self.config.policy.lanes;
        let mut tasks: JoinSet<(Candidate, CopyOutcome)> = JoinSet::new();
        let mut tick = tokio::time::interval(Duration::from_millis(100));
        tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
        let mut last_status = Instant::now()
            .checked_sub(self.config.status_interval)
            .unwrap_or_else(Instant::now);
        let mut last_copied_bytes = 0u64;
        let mut goodput = 0.0;
        let mut copying = false;
        let mut copying_since = 0;
        let mut was_idle = false;
        loop {
            tokio::select! {
                Some(done) = tasks.join_next(), if !tasks.is_empty() => {
                    match done {
                        Ok((candidate, outcome)) => self.finish(candidate, outcome).await,
                        Err(error) => tracing::error!(%error, "a copy task failed"),
                    }
                }
                _ = tick.tick() => {}
                _ = stop.changed() => break,
            }
            let caught_up = self.shared.catching_up().is_empty();
            if caught_up && !copying {
                tracing::info!("both pools caught up: copying");
                copying = true;
                copying_since = now_unix_ms();
            }
            let now = now_unix_ms();
            let free = lanes.saturating_sub(tasks.len());
            let backlog = self.shared.diff().backlog(
                &self.config.policy,
                now,
                if caught_up { free } else { 0 },
            );
            self.shared
                .metrics
                .backlog_keys
                .set(gauge_value(backlog.keys));
            self.shared
                .metrics
                .backlog_bytes
                .set(gauge_value(backlog.bytes));
            if caught_up {
                for candidate in backlog.next.iter().cloned() {
                    self.launch(&mut tasks, candidate);
                }
            }
            self.shared.metrics.in_flight.set(gauge_value(tasks.len()));
            // Publish at once when the last copy ended, so "idle" is seen without
            // waiting for the next interval.
            let idle = copying && backlog.keys == 0 && tasks.is_empty();
            let became_idle = idle && !was_idle;
            was_idle = idle;
            let elapsed = last_status.elapsed();
            if elapsed >= self.config.status_interval || became_idle {
                // Over a too short interval the rate says nothing: keep the last one.
                if elapsed >= Duration::from_millis(100) {
                    goodput = (self.totals.copied_bytes - last_copied_bytes) as f64
                        / elapsed.as_secs_f64();
                    last_copied_bytes = self.totals.copied_bytes;
                    last_status = Instant::now();
                }
                let mut status = self.snapshot(&backlog, copying, goodput, tasks.len());
                status.copying_since_unix_ms = copying_since;
                if let Err(error) = self.progress.write_status(&status).await {
                    tracing::warn!(%error, "writing the status record");
                }
                let _ = self.status.send(status);
            }
        }
    }

    fn shape(&self) -> WanShape {
        let lanes = self.config.policy.lanes.max(1) as u64;
        WanShape {
            rate_bytes_per_sec: (self.config.policy.rate_bytes_per_sec / lanes).max(1),
            data_shards: u16::try_from(self.config.fec.data_shards).unwrap_or(u16::MAX),
            parity_shards: u16::try_from(self.config.fec.parity_shards).unwrap_or(u16::MAX),
            shard_bytes: u32::try_from(self.config.fec.shard_bytes).unwrap_or(u32::MAX),
            feedback_timeout_ms: WanShape::feedback_timeout_for(self.config.wan_rtt),
        }
    }

    fn launch(&self, tasks: &mut JoinSet<(Candidate, CopyOutcome)>, candidate: Candidate) {
        self.shared.diff().mark_in_flight(candidate.hash);
        let copier = Arc::clone(&self.copier);
        let targets: Vec<_> = self
            .shared
            .topology(Side::Target)
            .iter()
            .map(|(id, info)| (id.clone(), info.clone()))
            .collect();
        let shape = self.shape();
        tracing::debug!(key = %candidate.block.key, size = candidate.block.size, "copying");
        tasks.spawn(async move {
            let outcome = copier.copy(&candidate, &targets, shape).await;
            (candidate, outcome)
        });
    }

    async fn finish(&mut self, candidate: Candidate, outcome: CopyOutcome) {
        let now = now_unix_ms();
        let metrics = &self.shared.metrics;
        match &outcome {
            CopyOutcome::Copied {
                subcluster,
                sent,
                fec_recoveries,
            } => {
                self.shared.diff().mark_copied(candidate.hash);
                let record = CopiedRecord {
                    key: candidate.block.key.clone(),
                    bytes: candidate.block.size,
                    subcluster: subcluster.to_string(),
                    unix_ms: now,
                };
                // The target's events already record the copy; this record also
                // covers a target that evicts it before a restarted replicator
                // reads them. Retry a few times, it is cheap.
                for attempt in 0..3 {
                    match self.progress.record_copied(candidate.hash, &record).await {
                        Ok(()) => break,
                        Err(error) if attempt == 2 => {
                            tracing::warn!(%error, key = %record.key, "recording a copy");
                        }
                        Err(_) => tokio::time::sleep(Duration::from_millis(100)).await,
                    }
                }
                self.totals.copied_blocks += 1;
                self.totals.copied_bytes += candidate.block.size;
                self.totals.wire_bytes += sent.wire_bytes;
                self.totals.stripes_retransmitted += sent.stripes_retransmitted;
                self.totals.fec_recoveries += fec_recoveries;
                metrics.copied_blocks.inc();
                metrics.copied_bytes.inc_by(candidate.block.size);
                metrics.wire_bytes.inc_by(sent.wire_bytes);
                metrics
                    .stripes_retransmitted
                    .inc_by(sent.stripes_retransmitted);
                metrics.fec_recoveries.inc_by(*fec_recoveries);
                tracing::debug!(key = %record.key, %subcluster, wire = sent.wire_bytes, "copied");
            }
            CopyOutcome::SourceGone | CopyOutcome::SourceChanged | CopyOutcome::AlreadyAtTarget => {
                let retry_at = now + SETTLE_WAIT.as_millis() as u64;
                self.shared.diff().mark_settled(candidate.hash, retry_at);
                *self
                    .totals
                    .settled
                    .entry(outcome.name().to_owned())
                    .or_default() += 1;
                metrics
                    .settled
                    .get_or_create(&label("reason", outcome.name()))
                    .inc();
                tracing::info!(key = %candidate.block.key, outcome = outcome.name(), "not copied");
            }
            CopyOutcome::NoTarget(reason) | CopyOutcome::Failed(reason) => {
                let attempts = self.shared.diff().attempts(candidate.hash) + 1;
                let retry_at = now + RETRY_BACKOFF.as_millis() as u64 * u64::from(attempts);
                let (_, given_up) = self.shared.diff().mark_failed(
                    candidate.hash,
                    self.config.policy.max_attempts,
                    retry_at,
                );
                self.totals.failures += 1;
                metrics
                    .failures
                    .get_or_create(&label("reason", outcome.name()))
                    .inc();
                if given_up {
                    self.totals.given_up += 1;
                    metrics.given_up.inc();
                    tracing::error!(key = %candidate.block.key, %reason, attempts, "giving up on a block");
                } else {
                    tracing::warn!(key = %candidate.block.key, %reason, attempts, "copy failed; will retry");
                }
            }
        }
    }

    fn snapshot(
        &self,
        backlog: &Backlog,
        copying: bool,
        goodput: f64,
        in_flight: usize,
    ) -> InterDcStatus {
        let now = now_unix_ms();
        let diff = self.shared.diff();
        let streams = diff
            .slots()
            .iter()
            .map(|slot| StreamStatus {
                side: slot.side.name().to_owned(),
                subcluster: slot.subcluster.to_string(),
                applied_seq: slot.applied_seq,
                lag_ms: if slot.applied_unix_ms == 0 {
                    0
                } else {
                    now.saturating_sub(slot.applied_unix_ms)
                },
            })
            .collect();
        InterDcStatus {
            source: self.config.source.cluster.to_string(),
            target: self.config.target.cluster.to_string(),
            unix_ms: now,
            copying,
            copying_since_unix_ms: 0,
            backlog_keys: backlog.keys,
            backlog_bytes: backlog.bytes,
            in_flight: in_flight as u64,
            skipped: backlog
                .skipped
                .iter()
                .map(|(k, v)| ((*k).to_owned(), *v))
                .collect(),
            copied_blocks: self.totals.copied_blocks,
            copied_total: diff.copied_count() as u64,
            copied_bytes: self.totals.copied_bytes,
            wire_bytes: self.totals.wire_bytes,
            goodput_bytes_per_sec: goodput,
            cap_bytes_per_sec: self.config.policy.rate_bytes_per_sec,
            stripes_retransmitted: self.totals.stripes_retransmitted,
            fec_recoveries: self.totals.fec_recoveries,
            settled: self.totals.settled.clone(),
            failures: self.totals.failures,
            given_up: self.totals.given_up,
            streams,
        }
    }
}

/// Gives back the target reservations of copies a stopped run left in flight, so
/// the blocks can be copied now instead of after the reservations time out.
async fn release_reservations(
    progress: &Progress,
    target_nats: &async_nats::Client,
    target: &ClusterId,
    in_flight: Vec<(u64, InFlightRecord)>,
    put_timeout: Duration,
) {
    let now = now_unix_ms();
    for (hash, record) in in_flight {
        let young = now.saturating_sub(record.unix_ms) < put_timeout.as_millis() as u64;
        if young {
            match hkvm_events::SubclusterId::new(record.subcluster.clone()) {
                Ok(subcluster) => {
                    let client = hkvm_client::SubmasterClient::new(
                        target_nats.clone(),
                        target.clone(),
                        subcluster,
                    )
                    .without_leader_watch();
                    // A reservation that was completed or expired answers
                    // NoPendingPut: nothing to give back then.
                    match client.put_revoke(vec![record.key.clone()]).await {
                        Ok(_) => {
                            tracing::info!(key = %record.key, "gave back a reservation of a stopped run")
                        }
                        Err(error) => {
                            tracing::warn!(key = %record.key, %error, "giving back a reservation")
                        }
                    }
                }
                Err(error) => tracing::warn!(%error, "in-flight record with a bad sub-cluster"),
            }
        }
        if let Err(error) = progress.clear_in_flight(hash).await {
            tracing::warn!(%error, "clearing an in-flight record");
        }
    }
}

/// Runs an inter-DC master until `shutdown` resolves.
///
/// # Errors
/// As for [`InterDc::start`].
pub async fn serve(
    config: InterDcConfig,
    shutdown: impl std::future::Future<Output = ()>,
) -> Result<(), InterDcError> {
    let master = InterDc::start(config).await?;
    shutdown.await;
    drop(master);
    Ok(())
}

/// Reads the status record of copies from `source` into the pool at `target`.
///
/// # Errors
/// [`InterDcError::Nats`] when the target cannot be reached or no replicator ever
/// ran for this pair.
pub async fn read_status(
    target: &ClusterAddress,
    source: &ClusterId,
) -> Result<Option<InterDcStatus>, InterDcError> {
    let nats = connect(target).await?;
    let js = jetstream::new(nats);
    let progress = Progress::open_existing(&js, source, &target.cluster).await?;
    progress.read_status().await
}
