//! The global master: a registry of sub-masters plus a projection of all their event
//! streams, answering cluster-wide `batch_is_exist`, `prefix_hit`, `locate` and a
//! proxied `get_replica_list` over NATS request/reply, in one queue group shared
//! by every replica.
//!
//! A replica starts as `load newest checkpoint → follow every registered stream
//! from its checkpointed sequence → serve`; until every stream known at start is
//! caught up it answers `Busy`. [`serve`] runs one replica until a shutdown future
//! resolves; [`GlobalMaster::start`] gives a handle (tests, `hkvm local`).

pub mod checkpoints;
mod config;
mod direct;
mod error;
mod follower;
pub mod metrics;
pub mod query;
mod rpc;
mod sources;
mod state;
mod sync;

use std::future::Future;
use std::net::SocketAddr;
use std::sync::Arc;

use async_nats::jetstream;
use hkvm_events::rpc::global::GlobalStatusReply;
use hkvm_events::subject::Bucket;
use hkvm_log::mooncake_admin::{MooncakeAdmin, Scope};
use hkvm_log::positions::Positions;
use hkvm_projector::Projection;
use hkvm_telemetry::TelemetryError;

pub use config::GlobalMasterConfig;
pub use error::{GlobalMasterError, GlobalMasterErrorKind};
pub use rpc::QUEUE_GROUP;

use crate::sources::Sources;
use crate::state::Shared;

/// A running global-master replica. Dropping it stops every task it started.
#[derive(Debug)]
pub struct GlobalMaster {
    shared: Arc<Shared>,
    sources: Arc<Sources>,
    js: jetstream::Context,
    restored_from: Option<String>,
    metrics_server: Option<hkvm_telemetry::MetricsServer>,
    /// The direct front, while it serves.
    _direct: Option<hkvm_direct::DirectServer>,
}

impl GlobalMaster {
    /// Loads the newest checkpoint (if configured), starts following every
    /// registered and static source, and joins the query queue group (answering
    /// `Busy` until caught up).
    ///
    /// # Errors
    /// When the registry bucket, the object store, the subscription or the metrics
    /// listener cannot be set up.
    pub async fn start(
        config: GlobalMasterConfig,
        client: async_nats::Client,
    ) -> Result<Self, GlobalMasterError> {
        let js = jetstream::new(client.clone());
        let mut restored_from = None;
        let mut projection = Projection::new();
        if config.restore_checkpoint {
            let store =
                checkpoints::object_store(&js, &config.cluster, Bucket::Checkpoints).await?;
            if let Some((name, restored)) = checkpoints::load_newest(&store).await? {
                tracing::info!(
                    name,
                    keys = restored.index().len(),
                    "restored the projection from a checkpoint"
                );
                projection = restored;
                restored_from = Some(name);
            }
        }
        let metrics_addr = config.metrics_addr;
        let shared = Arc::new(Shared::new(config, projection));
        let sources = Arc::new(Sources::new(Arc::clone(&shared), js.clone()));
        sources.start_initial().await?;
        sources.spawn_background().await?;
        let direct = direct::start(&shared, &client).await?;
        let rpc = rpc::serve(Arc::clone(&shared), client.clone()).await?;
        sources.keep(rpc);
        // The Mooncake master's read-only routes beside `/metrics`, over every
        // sub-cluster the registry (or the configuration) names.
        let admin = {
            let listed = Arc::clone(&shared);
            let serving = Arc::clone(&shared);
            MooncakeAdmin::new(
                client.clone(),
                shared.config.cluster.clone(),
                Scope::Registered(Arc::new(move || {
                    let mut subclusters: Vec<_> = listed.registry().keys().cloned().collect();
                    for subcluster in &listed.config.static_sources {
                        if !subclusters.contains(subcluster) {
                            subclusters.push(subcluster.clone());
                        }
                    }
                    subclusters
                })),
                Arc::new(move || {
                    if serving.is_replaying() {
                        "recovering"
                    } else {
                        "leader"
                    }
                }),
            )
        };
        let metrics_server = shared
            .metrics
            .registry()
            .serve_with_routes(metrics_addr, Some(Arc::new(admin)))
            .await
            .map_err(|TelemetryError::Bind { addr, source }| {
                GlobalMasterError::caused(
                    GlobalMasterErrorKind::Metrics,
                    format!("binding {addr}"),
                    source,
                )
            })?;
        Ok(Self {
            shared,
            sources,
            js,
            restored_from,
            metrics_server,
            _direct: direct,
        })
    }

    /// Whether the replica answers queries (not replaying any more).
    pub fn is_serving(&self) -> bool {
        !self.shared.is_replaying()
    }

    /// Waits until the replica serves queries.
    pub async fn wait_serving(&self) {
        while self.shared.is_replaying() {
            tokio::time::sleep(std::time::Duration::from_millis(5)).await;
        }
    }

    /// The checkpoint object the replica started from, if any.
    pub fn restored_from(&self) -> Option<&str> {
        self.restored_from.as_deref()
    }

    /// Where `/metrics` is served, if it is.
    pub fn metrics_addr(&self) -> Option<SocketAddr> {
        self.metrics_server
            .as_ref()
            .map(hkvm_telemetry::MetricsServer::addr)
    }

    /// The replica's state, as the status RPC reports it.
    pub fn status(&self) -> GlobalStatusReply {
        rpc::status(&self.shared)
    }

    /// Where this replica takes direct queries, if it does.
    pub fn direct_endpoint(&self) -> Option<&str> {
        self.shared
            .direct_endpoint
            .get()
            .map(|(endpoint, _)| endpoint.as_str())
    }

    /// Runs `f` over the projection (read-locked), for tests and benchmarks.
    pub fn with_projection<T>(&self, f: impl FnOnce(&Projection) -> T) -> T {
        f(&self.shared.read())
    }

    /// Writes a checkpoint now. Returns its size in bytes.
    ///
    /// # Errors
    /// When the object store fails.
    pub async fn checkpoint_now(&self) -> Result<usize, GlobalMasterError> {
        let store =
            checkpoints::object_store(&self.js, &self.shared.config.cluster, Bucket::Checkpoints)
                .await?;
        let positions =
            Positions::open_for_reader(&self.js, &self.shared.config.cluster, "global master")
                .await;
        checkpoints::write(&self.shared, &self.js, &store, positions.as_ref()).await
    }

    /// Stops every task of the replica.
    pub fn shutdown(self) {
        self.sources.stop();
    }
}

impl Drop for GlobalMaster {
    fn drop(&mut self) {
        self.sources.stop();
    }
}

/// Runs one global-master replica until `shutdown` resolves, then writes a final
/// checkpoint (if checkpoints are enabled) and stops.
///
/// # Errors
/// When the replica cannot start (see [`GlobalMaster::start`]).
pub async fn serve(
    config: GlobalMasterConfig,
    client: async_nats::Client,
    shutdown: impl Future<Output = ()>,
) -> Result<(), GlobalMasterError> {
    let checkpoints = config.checkpoint_interval_ms > 0;
    let master = GlobalMaster::start(config, client).await?;
    shutdown.await;
    if checkpoints && master.is_serving() {
        if let Err(error) = master.checkpoint_now().await {
            tracing::warn!(%error, "final checkpoint");
        }
    }
    master.shutdown();
    Ok(())
}
