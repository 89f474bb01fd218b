//! Following both pools: a registry watcher per pool starts one stream follower per
//! sub-master (on the source side only those the policy's labels allow) and keeps
//! each sub-cluster's labels and fill current. Each stream is read by the shared
//! follower of [`hkvm_log::follow`] (gaps, resets, re-created streams, purges,
//! undecodable messages, seeding from a snapshot), folding into one slot of the
//! shared [`Diff`](crate::diff::Diff) through [`DiffSlot`].

use std::sync::Arc;
use std::time::Duration;

use async_nats::jetstream;
use hkvm_events::codec::Decoded;
use hkvm_events::{key_hash, ClusterId};
use hkvm_log::follow::{FoldTarget, FollowConfig, Follower, OutOfOrder, ResyncReason, Seed};
use hkvm_log::positions::{Positions, ReaderKind};
use hkvm_log::registry::now_unix_ms;
use hkvm_log::registry::{list, open_registry};
use hkvm_telemetry::metrics::label;

use crate::diff::{Side, SourceBlock};
use crate::policy::Policy;
use crate::shared::{Shared, SubclusterInfo};

/// How often the registry is listed.
const REGISTRY_POLL: Duration = Duration::from_secs(1);
/// Registry lists between two records of the replicator's stream positions.
const POSITIONS_EVERY: u64 = 10;

/// One pool as seen from the replicator.
#[derive(Debug, Clone)]
pub(crate) struct Pool {
    /// Which side it is.
    pub side: Side,
    /// Its cluster id.
    pub cluster: ClusterId,
    /// JetStream of its NATS.
    pub js: jetstream::Context,
    /// The registry liveness TTL.
    pub registry_ttl: Duration,
    /// How its streams are read.
    pub follow: FollowConfig,
    /// Where this replicator records how far it has read each of the pool's
    /// streams, so their purges wait for it (none: they do not).
    pub positions: Option<Positions>,
    /// This replicator's name among the streams' readers.
    pub reader: String,
}

impl Pool {
    /// Records how far every followed stream of this pool has been read.
    async fn record_positions(&self, shared: &Shared) {
        let Some(positions) = &self.positions else {
            return;
        };
        let read: Vec<_> = shared
            .diff()
            .slots()
            .iter()
            .filter(|slot| slot.side == self.side)
            .map(|slot| (slot.subcluster.clone(), slot.applied_seq))
            .collect();
        for (subcluster, seq) in read {
            if let Err(error) = positions
                .record(&subcluster, ReaderKind::InterDc, &self.reader, seq)
                .await
            {
                tracing::debug!(side = self.side.name(), %subcluster, %error, "recording a reader position");
            }
        }
    }
}

/// Lists the pool's registry once and starts followers for sub-masters not yet
/// followed. Returns how many it started.
pub(crate) async fn discover(shared: &Arc<Shared>, pool: &Pool) -> usize {
    let store = match open_registry(&pool.js, &pool.cluster).await {
        Ok(store) => store,
        Err(error) => {
            tracing::debug!(side = pool.side.name(), %error, "no registry yet");
            return 0;
        }
    };
    let entries = match list(&store, pool.registry_ttl).await {
        Ok(entries) => entries,
        Err(error) => {
            tracing::warn!(side = pool.side.name(), %error, "listing the registry");
            return 0;
        }
    };
    let mut started = 0;
    for entry in entries {
        let info = &entry.info;
        let allowed = match pool.side {
            Side::Source => Policy::labels_match(&shared.policy.source_labels, &info.labels),
            Side::Target => true,
        };
        let fill = if info.capacity_bytes > 0 {
            info.used_bytes as f64 / info.capacity_bytes as f64
        } else {
            0.0
        };
        shared.topology(pool.side).insert(
            info.subcluster.clone(),
            SubclusterInfo {
                labels: info.labels.clone(),
                capacity_bytes: info.capacity_bytes,
                used_bytes: info.used_bytes,
                alive: entry.alive,
                followed: allowed,
            },
        );
        if !allowed {
            continue;
        }
        let (slot, new) = {
            let mut diff = shared.diff();
            let new = diff.find_slot(pool.side, &info.subcluster).is_none();
            let slot = diff.slot(pool.side, &info.subcluster);
            diff.set_fill(slot, fill);
            (slot, new)
        };
        if new {
            shared.catching_up().insert(slot);
            tracing::info!(side = pool.side.name(), subcluster = %info.subcluster, slot, "following");
            let target = DiffSlot {
                shared: Arc::clone(shared),
                side: pool.side,
                slot,
            };
            let follower = Follower::new(
                pool.js.clone(),
                pool.cluster.clone(),
                info.subcluster.clone(),
                target,
                pool.follow,
            );
            let task = tokio::spawn(follower.run());
            shared.keep(task);
            started += 1;
        }
    }
    started
}

/// Re-lists the pool's registry every second and records the replicator's
/// positions in the pool's streams every [`POSITIONS_EVERY`] lists, until the task
/// is aborted.
pub(crate) async fn watch_pool(shared: Arc<Shared>, pool: Pool) {
    for round in 0u64.. {
        tokio::time::sleep(REGISTRY_POLL).await;
        discover(&shared, &pool).await;
        if round % POSITIONS_EVERY == 0 {
            pool.record_positions(&shared).await;
        }
    }
}

/// One slot of the diff (one sub-cluster of one pool) as a [`FoldTarget`].
struct DiffSlot {
    shared: Arc<Shared>,
    side: Side,
    slot: usize,
}

impl FoldTarget for DiffSlot {
    type Message = Decoded;

    fn applied_seq(&self) -> u64 {
        self.shared
            .diff()
            .slots()
            .get(self.slot)
            .map_or(0, |s| s.applied_seq)
    }

    fn reset(&mut self, reason: ResyncReason) {
        self.shared.diff().reset_slot(self.slot);
        let mut labels = label("side", self.side.name());
        labels.push(("reason".to_owned(), reason.as_str().to_owned()));
        self.shared.metrics.resyncs.get_or_create(&labels).inc();
    }

    /// The snapshot has no commit times: its blocks are dated by the first message
    /// left in the stream (they are at least that old).
    fn seed(&mut self, seed: Seed<'_>) {
        let dated = seed.first_unix_ms.unwrap_or_else(now_unix_ms);
        let objects = seed.snapshot.objects.iter().map(|object| {
            (
                key_hash(&object.key),
                SourceBlock {
                    key: object.key.to_string(),
                    size: object.size,
                    checksum: object.checksum,
                    committed_unix_ms: dated,
                },
            )
        });
        self.shared
            .diff()
            .seed_slot(self.slot, seed.snapshot.covers_seq, dated, objects);
    }

    fn apply(&mut self, messages: Vec<Decoded>) -> Result<(), OutOfOrder> {
        let mut events = 0u64;
        let mut result = Ok(());
        {
            let mut diff = self.shared.diff();
            for message in &messages {
                if let Err(error) = diff.apply_decoded(self.slot, message) {
                    result = Err(OutOfOrder {
                        expected: error.expected,
                        found: error.found,
                    });
                    break;
                }
                events += message.events.len() as u64;
            }
        }
        self.shared
            .metrics
            .events_applied
            .get_or_create(&label("side", self.side.name()))
            .inc_by(events);
        result
    }

    fn skip(&mut self, seq: u64, unix_ms: u64) {
        self.shared.diff().set_applied(self.slot, seq, unix_ms);
        let mut labels = label("side", self.side.name());
        labels.push(("reason".to_owned(), "corrupt message skipped".to_owned()));
        self.shared.metrics.resyncs.get_or_create(&labels).inc();
    }

    fn caught_up(&mut self) {
        self.shared.catching_up().remove(&self.slot);
    }
}
