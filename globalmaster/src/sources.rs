//! Which streams a replica follows and the tasks around them: the registry watch
//! (a newly registered sub-cluster is followed at once, without a restart), the
//! liveness refresh, the lag poll, periodic checkpoints and bloom filters. Every
//! task handle is kept here and aborted by [`Sources::stop`].

use std::collections::{BTreeMap, BTreeSet};
use std::sync::{Arc, Mutex, MutexGuard};
use std::time::Duration;

use async_nats::jetstream;
use futures::StreamExt as _;
use hkvm_events::subject::Bucket;
use hkvm_events::subject::{event_subject, stream_name};
use hkvm_events::SubclusterId;
use hkvm_log::positions::Positions;
use hkvm_log::registry::{self, Registered, RegistryChange};
use hkvm_log::{EventLog, JetStreamLog};
use tokio::task::JoinHandle;

use crate::checkpoints;
use crate::follower::follow;
use crate::state::Shared;
use crate::GlobalMasterError;

/// The most keys reserved up front from registered object counts (a bound, so a
/// wrong count cannot allocate without limit).
const MAX_RESERVE: u64 = 1 << 24;

/// The followed sources and every background task.
#[derive(Debug)]
pub(crate) struct Sources {
    shared: Arc<Shared>,
    js: jetstream::Context,
    followed: Mutex<BTreeSet<SubclusterId>>,
    tasks: Mutex<Vec<JoinHandle<()>>>,
}

impl Sources {
    pub fn new(shared: Arc<Shared>, js: jetstream::Context) -> Self {
        Self {
            shared,
            js,
            followed: Mutex::new(BTreeSet::new()),
            tasks: Mutex::new(Vec::new()),
        }
    }

    fn tasks(&self) -> MutexGuard<'_, Vec<JoinHandle<()>>> {
        self.tasks.lock().unwrap_or_else(|p| p.into_inner())
    }

    fn followed(&self) -> MutexGuard<'_, BTreeSet<SubclusterId>> {
        self.followed.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// Keeps a task to abort on stop.
    pub fn keep(&self, task: JoinHandle<()>) {
        self.tasks().push(task);
    }

    /// Aborts every task.
    pub fn stop(&self) {
        for task in self.tasks().drain(..) {
            task.abort();
        }
    }

    /// The source index of `subcluster` (added if new). `gates_serving`: the
    /// replica answers `Busy` until this source has caught up.
    fn add_source(&self, subcluster: &SubclusterId, gates_serving: bool) -> (usize, String) {
        let stream = stream_name(&self.shared.config.cluster, subcluster);
        let source = self.shared.write().source_index(subcluster, &stream);
        self.shared
            .positions()
            .entry(source)
            .or_default()
            .gates_serving = gates_serving;
        (source, stream)
    }

    /// Starts following `subcluster` unless it already is.
    fn follow(&self, subcluster: &SubclusterId, gates_serving: bool) {
        if !self.followed().insert(subcluster.clone()) {
            return;
        }
        let (source, stream) = self.add_source(subcluster, gates_serving);
        tracing::info!(%subcluster, stream, "following a sub-cluster stream");
        let task = tokio::spawn(follow(
            Arc::clone(&self.shared),
            self.js.clone(),
            subcluster.clone(),
            source,
        ));
        self.keep(task);
    }

    /// Follows every registered, static and checkpointed source; the replica
    /// serves once they are all caught up (at once when there are none).
    pub async fn start_initial(&self) -> Result<(), GlobalMasterError> {
        let config = &self.shared.config;
        let store =
            registry::ensure_registry_bucket(&self.js, &config.cluster, config.registry_ttl())
                .await?;
        let registered = registry::list(&store, config.registry_ttl()).await?;
        // Sources of a restored checkpoint are followed too, registered or not: what
        // the checkpoint says of them must be brought up to date (or dropped, if
        // their stream is gone).
        let mut initial: BTreeSet<SubclusterId> = config.static_sources.iter().cloned().collect();
        initial.extend(
            self.shared
                .read()
                .sources()
                .iter()
                .filter_map(|s| s.subcluster.clone()),
        );
        {
            let mut map = self
                .shared
                .registry
                .write()
                .unwrap_or_else(|p| p.into_inner());
            let objects: u64 = registered.iter().map(|entry| entry.info.objects).sum();
            for entry in registered {
                initial.insert(entry.info.subcluster.clone());
                map.insert(entry.info.subcluster.clone(), entry);
            }
            // Sized once for what the sub-masters hold, an empty index does not
            // regrow (and rehash) step by step during a full replay. A restored one
            // is left alone: it is close to its size already.
            if self.shared.read().index().is_empty() {
                let wanted = usize::try_from(objects.min(MAX_RESERVE)).unwrap_or(0);
                self.shared.write().reserve(wanted);
            }
        }
        // Mark every initial source as gating before any follower can report
        // caught up, so one fast source does not open the gate for the others.
        for subcluster in &initial {
            self.add_source(subcluster, true);
        }
        for subcluster in &initial {
            self.follow(subcluster, true);
        }
        self.shared.open_gate_if_ready();
        Ok(())
    }

    /// Starts the registry watch, liveness refresh, lag poll, checkpoints and
    /// bloom filters.
    pub async fn spawn_background(self: &Arc<Self>) -> Result<(), GlobalMasterError> {
        let config = self.shared.config.clone();
        let store =
            registry::ensure_registry_bucket(&self.js, &config.cluster, config.registry_ttl())
                .await?;
        let mut changes = Box::pin(registry::watch(&store).await?);
        let this = Arc::clone(self);
        self.keep(tokio::spawn(async move {
            while let Some(change) = changes.next().await {
                match change {
                    Ok(RegistryChange::Put(info)) => {
                        let subcluster = info.subcluster.clone();
                        this.shared
                            .registry
                            .write()
                            .unwrap_or_else(|p| p.into_inner())
                            .insert(
                                subcluster.clone(),
                                Registered {
                                    info,
                                    alive: true,
                                    age_ms: 0,
                                },
                            );
                        this.follow(&subcluster, false);
                    }
                    Ok(RegistryChange::Deleted(subcluster)) => {
                        if let Some(entry) = this
                            .shared
                            .registry
                            .write()
                            .unwrap_or_else(|p| p.into_inner())
                            .get_mut(&subcluster)
                        {
                            entry.alive = false;
                        }
                    }
                    Err(error) => tracing::warn!(%error, "registry watch"),
                }
            }
            tracing::warn!("the registry watch ended");
        }));

        let this = Arc::clone(self);
        let ttl = config.registry_ttl();
        self.keep(tokio::spawn(async move {
            let period = (ttl / 4).max(Duration::from_millis(250));
            loop {
                tokio::time::sleep(period).await;
                match registry::list(&store, ttl).await {
                    Ok(listed) => this.refresh_liveness(listed),
                    Err(error) => tracing::warn!(%error, "listing the registry"),
                }
            }
        }));

        let this = Arc::clone(self);
        let poll = Duration::from_millis(config.lag_poll_ms.max(50));
        self.keep(tokio::spawn(async move {
            loop {
                tokio::time::sleep(poll).await;
                this.poll_lag().await;
            }
        }));

        self.spawn_periodic(config.checkpoint_interval_ms, Bucket::Checkpoints)
            .await?;
        self.spawn_periodic(config.bloom_interval_ms, Bucket::Blooms)
            .await
    }

    /// Registry entries that expired are kept but marked dead, so `locate` can
    /// say so.
    fn refresh_liveness(&self, listed: Vec<Registered>) {
        let mut map = self
            .shared
            .registry
            .write()
            .unwrap_or_else(|p| p.into_inner());
        let mut seen = BTreeMap::new();
        for entry in listed {
            seen.insert(entry.info.subcluster.clone(), entry);
        }
        for (subcluster, entry) in map.iter_mut() {
            if !seen.contains_key(subcluster) {
                entry.alive = false;
            }
        }
        map.extend(seen);
    }

    async fn poll_lag(&self) {
        let followed: Vec<SubclusterId> = self.followed().iter().cloned().collect();
        let cluster = &self.shared.config.cluster;
        for subcluster in followed {
            let log = JetStreamLog::new(
                self.js.clone(),
                stream_name(cluster, &subcluster),
                event_subject(cluster, &subcluster),
            );
            let Ok(bounds) = log.bounds().await else {
                continue;
            };
            let source = self.shared.read().find_source(&subcluster);
            if let Some(source) = source {
                self.shared
                    .observe_last_seq(source, &subcluster, bounds.last_seq);
            }
        }
        self.shared.update_index_gauges();
    }

    async fn spawn_periodic(
        self: &Arc<Self>,
        interval_ms: u64,
        bucket: Bucket,
    ) -> Result<(), GlobalMasterError> {
        if interval_ms == 0 {
            return Ok(());
        }
        let store =
            checkpoints::object_store(&self.js, &self.shared.config.cluster, bucket).await?;
        let positions = if bucket == Bucket::Checkpoints {
            Positions::open_for_reader(&self.js, &self.shared.config.cluster, "global master").await
        } else {
            None
        };
        let shared = Arc::clone(&self.shared);
        let js = self.js.clone();
        self.keep(tokio::spawn(async move {
            let mut ticks = tokio::time::interval(Duration::from_millis(interval_ms));
            ticks.tick().await;
            loop {
                ticks.tick().await;
                // A replica still replaying would checkpoint a partial projection
                // no better than the one it started from.
                if shared.is_replaying() {
                    continue;
                }
                let result = if bucket == Bucket::Blooms {
                    checkpoints::publish_blooms(&shared, &store).await
                } else {
                    checkpoints::write(&shared, &js, &store, positions.as_ref())
                        .await
                        .map(|_| ())
                };
                if let Err(error) = result {
                    tracing::warn!(%error, bucket = bucket.purpose(), "periodic write failed");
                }
            }
        }));
        Ok(())
    }
}
