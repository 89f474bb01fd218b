//! The sub-master process: rebuild the state from the newest snapshot and the log,
//! follow the stream as a hot standby while another instance leads, take the leader
//! lease when it frees up, lead until the lease is lost or an append is fenced, and
//! start over from the log. Shutdown hands the lease over at once.

mod direct;
mod follower;
mod leader;
mod purger;
mod removal;
mod renewer;
mod rpc;
mod snapshotter;

use hkvm_log::mooncake_admin::{MooncakeAdmin, RoleOf, Scope};
use std::time::Duration;

use async_nats::jetstream::{self, kv};
use futures::StreamExt as _;
use hkvm_events::grant::GrantKey;
use hkvm_events::subject::{event_subject, stream_name};
use hkvm_events::Limits;
use hkvm_log::stream::ensure_stream;
use hkvm_log::{grants, registry};
use hkvm_log::{EventLog, JetStreamLog, ReadOptions};
use hkvm_telemetry::metrics::gauge_value;
use hkvm_telemetry::{MetricsRegistry, TelemetryError};
use tokio::sync::watch;
use tokio::task::JoinHandle;

pub use rpc::QUEUE_GROUP;

use crate::config::SubmasterConfig;
use crate::election::{LeaderLease, LeaseHolder};
use crate::error::{SubmasterError, SubmasterErrorKind};
use crate::metrics::SubmasterMetrics;
use crate::state::State;
use hkvm_log::positions::Positions;
use hkvm_log::SnapshotStore;
use leader::LeadEnd;
use purger::Purger;
use snapshotter::{SnapshotSink, StandbySnapshots};

/// How often a standby looks at the leader lease.
const LEASE_POLL: Duration = Duration::from_millis(100);

/// What every phase of a sub-master uses.
pub(crate) struct Context {
    client: async_nats::Client,
    config: SubmasterConfig,
    log: JetStreamLog,
    lease: LeaderLease,
    snapshots: SnapshotStore,
    /// Where readers (this one's standby too) record their stream positions.
    positions: Option<Positions>,
    /// Purges the history a verified snapshot covers (none: history kept).
    purger: Option<Purger>,
    registry: Option<kv::Store>,
    /// The sub-cluster's data-port grant key, signed into the locations a
    /// leader hands out.
    grant_key: GrantKey,
    metrics: SubmasterMetrics,
}

fn setup_error(
    what: &str,
    error: impl std::error::Error + Send + Sync + 'static,
) -> SubmasterError {
    SubmasterError::caused(SubmasterErrorKind::Setup, what, error)
}

impl Context {
    async fn new(
        client: async_nats::Client,
        config: SubmasterConfig,
        metrics: SubmasterMetrics,
    ) -> Result<Self, SubmasterError> {
        let js = jetstream::new(client.clone());
        ensure_stream(&js, &config.cluster, &config.subcluster, &config.stream).await?;
        let log = JetStreamLog::new(
            js.clone(),
            stream_name(&config.cluster, &config.subcluster),
            event_subject(&config.cluster, &config.subcluster),
        );
        let replicas = config.stream.replicas;
        let lease = LeaderLease::open(
            &js,
            &config.cluster,
            &config.subcluster,
            config.leader_lease_ttl,
            replicas,
        )
        .await?;
        let snapshots = SnapshotStore::open(&js, &config.cluster, &config.subcluster, replicas)
            .await?
            .with_write_rate(Some(config.snapshot_pace.write_bytes_per_sec));
        let registry = match registry::ensure_replicated_registry_bucket(
            &js,
            &config.cluster,
            config.registry_ttl,
            replicas,
        )
        .await
        {
            Ok(store) => Some(store),
            Err(error) => {
                tracing::warn!(%error, "no registry: the global master will not see this sub-master");
                None
            }
        };
        // Without it every node would refuse every transfer: a start-up failure.
        let grant_key = grants::ensure_key(&js, &config.cluster, &config.subcluster, replicas)
            .await
            .map_err(|error| setup_error("reading or creating the grant key", error))?;
        let positions = match Positions::open(&js, &config.cluster, replicas).await {
            Ok(positions) => Some(positions),
            Err(error) => {
                // Not knowing where readers are, purging could strand them; and a
                // standby cannot say it writes the snapshots.
                tracing::warn!(%error, "no reader positions: the stream's history is kept");
                None
            }
        };
        let purger = positions
            .clone()
            .filter(|_| config.history.purge)
            .map(|positions| {
                Purger::new(
                    log.clone(),
                    positions,
                    config.subcluster.clone(),
                    config.history.reader_ttl,
                    metrics.clone(),
                )
            });
        Ok(Self {
            client,
            config,
            log,
            lease,
            snapshots,
            positions,
            purger,
            registry,
            grant_key,
            metrics,
        })
    }

    /// Where snapshots go and what follows them.
    fn snapshot_sink(&self) -> SnapshotSink {
        SnapshotSink {
            store: self.snapshots.clone(),
            purger: self.purger.clone(),
            metrics: self.metrics.clone(),
            cpu_share: self.config.snapshot_pace.cpu_share,
        }
    }
}

/// What a standby saw of the leader lease.
#[derive(Debug, Default)]
struct LeaseWatch {
    /// The holder's revision and since when it stands still.
    watched: Option<(u64, tokio::time::Instant)>,
    /// Whether the last read of the lease failed (its bucket unavailable).
    unreadable: bool,
    /// When the bucket last answered again after being unavailable.
    readable_again: Option<tokio::time::Instant>,
}

impl LeaseWatch {
    /// A read failed. A revision is judged standing still only over a TTL of
    /// successful reads, so a leader that could not renew meanwhile is not taken
    /// over the moment the bucket answers again.
    fn unreadable(&mut self) {
        self.watched = None;
        self.unreadable = true;
    }

    fn readable(&mut self) {
        if std::mem::take(&mut self.unreadable) {
            self.readable_again = Some(tokio::time::Instant::now());
        }
    }

    /// Notes the holder's `revision`; whether it has stood still for `ttl`
    /// (since it was first seen).
    fn stood_still(&mut self, revision: u64, ttl: Duration) -> bool {
        match self.watched {
            Some((seen, since)) if seen == revision => since.elapsed() >= ttl,
            _ => {
                self.watched = Some((revision, tokio::time::Instant::now()));
                false
            }
        }
    }

    /// Whether a free lease may be taken: not within a TTL of the bucket coming
    /// back, when the entry of a live leader that could not renew has expired and
    /// that leader is about to take it again.
    fn may_take_free(&self, ttl: Duration) -> bool {
        self.readable_again
            .is_none_or(|since| since.elapsed() >= ttl)
    }
}

/// One look at the leader lease by a standby: takes it when it is free, or when
/// its holder's revision stood still for a whole TTL.
async fn poll_lease(
    ctx: &Context,
    holder: &LeaseHolder,
    view: &mut LeaseWatch,
) -> Result<Option<u64>, SubmasterError> {
    let ttl = ctx.config.leader_lease_ttl;
    let current = ctx.lease.holder().await?;
    view.readable();
    Ok(match current {
        None if view.may_take_free(ttl) => ctx.lease.try_acquire(holder).await?,
        None => None,
        Some((_, revision)) if view.stood_still(revision, ttl) => {
            tracing::warn!(
                revision,
                "the leader stopped renewing its lease; taking over"
            );
            ctx.lease.take_over_stale(holder, revision).await?
        }
        Some(_) => None,
    })
}

/// Follows the stream, applying every message, until this instance takes the leader
/// lease (`Some(revision)`) or shutdown is asked (`None`).
async fn stand_by(
    ctx: &Context,
    state: &mut State,
    shutdown: &mut watch::Receiver<bool>,
) -> Result<Option<u64>, SubmasterError> {
    ctx.metrics.role.set(0);
    let mut entries = ctx
        .log
        .read(ReadOptions {
            follow: true,
            linger: ctx.config.standby_linger,
            ..ReadOptions::from(state.applied_seq + 1)
        })
        .await?;
    let limits = Limits::default();
    let mut poll = tokio::time::interval(LEASE_POLL);
    poll.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    let holder = LeaseHolder {
        producer: ctx.config.producer.clone(),
        epoch: state.max_epoch + 1,
        direct: None,
        direct_ticket: None,
    };
    // The leader renews every third of the TTL; a revision that stood still for a
    // whole TTL means the leader is gone, without waiting for the entry to expire.
    let mut lease = LeaseWatch::default();
    let mut snapshots = StandbySnapshots::new();
    loop {
        tokio::select! {
            _ = shutdown.changed() => return Ok(None),
            entry = entries.next() => match entry {
                Some(entry) => {
                    snapshots.events_since +=
                        follower::apply_entry(state, &entry?, &limits, &ctx.metrics) as u64;
                }
                None => return Err(SubmasterError::new(SubmasterErrorKind::Log, "the event stream ended")),
            },
            _ = poll.tick() => {
                snapshots.tick(ctx, state);
                if let Ok(bounds) = ctx.log.bounds().await {
                    ctx.metrics.standby_lag.set(gauge_value(bounds.last_seq.saturating_sub(state.applied_seq)));
                }
                let taken = match poll_lease(ctx, &holder, &mut lease).await {
                    Ok(taken) => taken,
                    Err(error) => {
                        // The lease bucket is unavailable (its JetStream leader is
                        // being re-elected): keep following, hot.
                        tracing::debug!(%error, "reading the leader lease");
                        lease.unreadable();
                        None
                    }
                };
                if let Some(revision) = taken {
                    return Ok(Some(revision));
                }
            }
        }
    }
}

/// Runs a sub-master until `shutdown` turns true.
///
/// # Errors
/// When setup fails (NATS, stream, buckets, metrics port). Failures after setup
/// (a lost lease, a fenced append, a broken stream) are handled by rebuilding the
/// state and standing by again.
pub async fn run(
    client: async_nats::Client,
    config: SubmasterConfig,
    shutdown: watch::Receiver<bool>,
) -> Result<(), SubmasterError> {
    run_observed(client, config, SubmasterMetrics::new(), shutdown).await
}

/// [`run`] with metrics created by the caller, who can read them.
async fn run_observed(
    client: async_nats::Client,
    config: SubmasterConfig,
    metrics: SubmasterMetrics,
    mut shutdown: watch::Receiver<bool>,
) -> Result<(), SubmasterError> {
    // Mooncake's read-only admin routes ride on the metrics port, as on a
    // Mooncake master's.
    let role: RoleOf = {
        let metrics = metrics.clone();
        std::sync::Arc::new(move || match metrics.role.get() {
            2 => "leader",
            1 => "recovering",
            _ => "standby",
        })
    };
    let admin = MooncakeAdmin::new(
        client.clone(),
        config.cluster.clone(),
        Scope::One(config.subcluster.clone()),
        role,
    );
    let _metrics_server = metrics
        .registry()
        .serve_with_routes(config.metrics_addr, Some(std::sync::Arc::new(admin)))
        .await
        .map_err(|TelemetryError::Bind { source, .. }| setup_error("metrics endpoint", source))?;
    let ctx = Context::new(client, config, metrics).await?;
    tracing::info!(
        subcluster = %ctx.config.subcluster,
        producer = %ctx.config.producer,
        stream = ctx.log.stream_name(),
        "sub-master starting"
    );
    while !*shutdown.borrow() {
        let mut state = match follower::restore(&ctx.log, &ctx.snapshots, &ctx.metrics).await {
            Ok(state) => state,
            Err(error) => {
                tracing::error!(%error, "cannot rebuild the state; retrying");
                pause(&mut shutdown, Duration::from_secs(1)).await;
                continue;
            }
        };
        let revision = match stand_by(&ctx, &mut state, &mut shutdown).await {
            Ok(Some(revision)) => revision,
            Ok(None) => break,
            Err(error) => {
                tracing::error!(%error, "standby failed; rebuilding");
                pause(&mut shutdown, Duration::from_millis(500)).await;
                continue;
            }
        };
        match leader::lead(&ctx, &mut state, revision, &mut shutdown).await {
            Ok(LeadEnd::Shutdown) => break,
            Ok(LeadEnd::SteppedDown(reason)) => {
                tracing::warn!(reason, "stepped down; rebuilding the state from the log")
            }
            Err(error) => {
                tracing::error!(%error, "takeover failed; standing by again");
                pause(&mut shutdown, Duration::from_millis(500)).await;
            }
        }
    }
    tracing::info!("sub-master stopped");
    Ok(())
}

/// A state rebuilt from the stream, and where it started.
#[derive(Debug)]
pub struct LoadedState {
    /// The state.
    pub state: State,
    /// The sequence the snapshot covered (0: replayed from the start).
    pub snapshot_seq: u64,
    /// How many messages were replayed after the snapshot.
    pub replayed: u64,
}

/// Rebuilds a sub-cluster's state as a (re)starting sub-master would, from the newest
/// snapshot plus the tail, or (with `use_snapshot` false) by replaying everything.
/// For tools, tests and the recovery benchmark.
///
/// # Errors
/// When the stream or snapshot store cannot be read.
pub async fn load_state(
    js: &jetstream::Context,
    config: &SubmasterConfig,
    use_snapshot: bool,
) -> Result<LoadedState, SubmasterError> {
    let log = JetStreamLog::new(
        js.clone(),
        stream_name(&config.cluster, &config.subcluster),
        event_subject(&config.cluster, &config.subcluster),
    );
    let metrics = SubmasterMetrics::new();
    let snapshots = if use_snapshot {
        Some(
            SnapshotStore::open(
                js,
                &config.cluster,
                &config.subcluster,
                config.stream.replicas,
            )
            .await?,
        )
    } else {
        None
    };
    let (state, snapshot_seq, replayed) = follower::load_and_catch_up(&log, &metrics, || async {
        Ok(match &snapshots {
            Some(snapshots) => crate::snapshot::load_newest(snapshots)
                .await?
                .unwrap_or_default(),
            None => State::new(),
        })
    })
    .await?;
    Ok(LoadedState {
        state,
        snapshot_seq,
        replayed,
    })
}

async fn pause(shutdown: &mut watch::Receiver<bool>, delay: Duration) {
    let _ = tokio::time::timeout(delay, shutdown.changed()).await;
}

/// A sub-master running in this process (tests, `hkvm local`).
#[derive(Debug)]
pub struct SubmasterHandle {
    shutdown: watch::Sender<bool>,
    task: JoinHandle<Result<(), SubmasterError>>,
    registry: MetricsRegistry,
}

impl SubmasterHandle {
    /// Starts a sub-master task.
    pub fn spawn(client: async_nats::Client, config: SubmasterConfig) -> Self {
        let (shutdown, watch) = watch::channel(false);
        let metrics = SubmasterMetrics::new();
        let registry = metrics.registry();
        let task = tokio::spawn(run_observed(client, config, metrics, watch));
        Self {
            shutdown,
            task,
            registry,
        }
    }

    /// The sub-master's metrics in the Prometheus text format, as its metrics
    /// endpoint would serve them.
    pub fn metrics_text(&self) -> String {
        self.registry.text()
    }

    /// Stops gracefully (hands the lease over) and waits.
    ///
    /// # Errors
    /// The sub-master's own error, if it failed.
    pub async fn shutdown(self) -> Result<(), SubmasterError> {
        let _ = self.shutdown.send(true);
        self.task.await.map_err(|e| {
            SubmasterError::caused(SubmasterErrorKind::Setup, "the sub-master task", e)
        })?
    }

    /// Stops abruptly, as a crash would: no lease hand-over, in-flight work dropped.
    pub fn abort(self) {
        self.task.abort();
    }
}
