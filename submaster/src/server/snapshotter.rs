//! Snapshots that never hold up the leader's requests. The leader asks its
//! committer for a message boundary and copies its state right after, in its
//! request loop (no await in between), so the copy is exactly the fold of the
//! stream up to the boundary's message; everything else — waiting for that
//! message to be durable, encoding on a blocking thread, storing the object,
//! appending the marker event — runs on a task of its own. A stream or object
//! store that does not answer (a NATS node lost, a JetStream election) then
//! delays the snapshot, not the requests.

use hkvm_events::commit::{CommitError, GroupCommitter};
use hkvm_events::snapshot::SnapshotStore;
use hkvm_events::{KvEvent, SnapshotTaken};
use tokio::task::JoinHandle;

use crate::metrics::SubmasterMetrics;
use crate::state::State;

/// The leader's snapshot writer: at most one snapshot in progress.
#[derive(Default)]
pub(super) struct Snapshotter {
    running: Option<JoinHandle<()>>,
}

impl Snapshotter {
    /// Whether a snapshot is still being written.
    pub(super) fn busy(&self) -> bool {
        self.running
            .as_ref()
            .is_some_and(|task| !task.is_finished())
    }

    /// Copies `state` as of everything submitted to `committer` so far and
    /// writes it in the background.
    ///
    /// # Errors
    /// When the committer has stopped.
    pub(super) async fn start(
        &mut self,
        committer: &GroupCommitter,
        store: &SnapshotStore,
        metrics: &SubmasterMetrics,
        state: &State,
    ) -> Result<(), CommitError> {
        let boundary = committer.submit_boundary().await?;
        // Everything applied to `state` was submitted before the boundary.
        let mut file = crate::snapshot::to_file(state);
        let objects = state.object_count();
        let (committer, store, metrics) = (committer.clone(), store.clone(), metrics.clone());
        self.running = Some(tokio::spawn(async move {
            let covers_seq = match boundary.await {
                Ok(committed) => committed.seq,
                // The leader learns of the failure through its own writes.
                Err(error) => return tracing::debug!(%error, "snapshot abandoned"),
            };
            file.covers_seq = covers_seq;
            let encoded = tokio::task::spawn_blocking(move || file.encode()).await;
            let saved = match encoded {
                Ok(Ok(bytes)) => store.save_encoded(covers_seq, bytes).await,
                Ok(Err(error)) => Err(error),
                Err(error) => return tracing::warn!(%error, "snapshot encoding failed; will retry"),
            };
            let (object, checksum) = match saved {
                Ok(saved) => saved,
                Err(error) => return tracing::warn!(%error, "snapshot failed; will retry"),
            };
            metrics.snapshots.inc();
            tracing::info!(object, covers_seq, objects, "snapshot written");
            let marker = KvEvent::Snapshot(SnapshotTaken {
                covers_seq,
                object,
                checksum,
            });
            metrics.events_appended.inc();
            if let Err(error) = committer.commit(vec![marker]).await {
                tracing::debug!(%error, "the snapshot marker was not appended");
            }
        }));
        Ok(())
    }
}
