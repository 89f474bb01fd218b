//! Rebuilding and following the state from the event stream: restore the newest
//! snapshot, replay the tail, and (as a hot standby) keep applying new messages.

use futures::StreamExt as _;
use hkvm_events::{decode_message, Limits};
use hkvm_log::{EventLog, JetStreamLog, LogEntry, LogError, LogErrorKind, ReadOptions};
use hkvm_telemetry::metrics::gauge_value;
use tokio::time::Instant;

use crate::error::SubmasterError;
use crate::metrics::SubmasterMetrics;
use crate::state::State;
use hkvm_log::SnapshotStore;

/// Applies one stored message; returns how many events it applied. Undecodable
/// messages or events are skipped with an error log and a metric: only a foreign
/// publisher writes them, and stopping the whole sub-cluster for them would be
/// worse.
pub(crate) fn apply_entry(
    state: &mut State,
    entry: &LogEntry,
    limits: &Limits,
    metrics: &SubmasterMetrics,
) -> usize {
    let mut applied = 0;
    match decode_message(&entry.payload, limits) {
        Ok(message) => {
            let epoch = message.header.epoch;
            let mut events = Vec::new();
            for event in message.events {
                match event {
                    Ok(event) => events.push(event),
                    Err(error) => {
                        metrics.undecodable.inc();
                        tracing::error!(seq = entry.seq, %error, "skipping an undecodable event");
                    }
                }
            }
            state.apply_message(entry.seq, epoch, &events);
            applied = events.len();
        }
        Err(error) => {
            metrics.undecodable.inc();
            tracing::error!(seq = entry.seq, %error, "skipping an undecodable message");
            state.applied_seq = entry.seq;
        }
    }
    metrics.applied_seq.set(gauge_value(state.applied_seq));
    applied
}

/// Applies everything after `state.applied_seq` up to the current end of the log.
///
/// # Errors
/// When the log cannot be read (vanished, truncated past the state, gap).
pub(crate) async fn catch_up(
    log: &impl EventLog,
    state: &mut State,
    metrics: &SubmasterMetrics,
) -> Result<u64, SubmasterError> {
    let end = log.bounds().await?.last_seq;
    fold_until(log, state, end, metrics).await
}

/// Applies everything after `state.applied_seq` up to and including `end`;
/// returns how many messages it applied.
///
/// # Errors
/// When the log cannot be read (vanished, truncated past the state, gap).
pub(crate) async fn fold_until(
    log: &impl EventLog,
    state: &mut State,
    end: u64,
    metrics: &SubmasterMetrics,
) -> Result<u64, SubmasterError> {
    let started = Instant::now();
    let from = state.applied_seq + 1;
    if from > end {
        return Ok(0);
    }
    let total = end + 1 - from;
    let mut entries = log
        .read(ReadOptions {
            until_seq: Some(end),
            ..ReadOptions::from(from)
        })
        .await?;
    let limits = Limits::default();
    let mut applied = 0u64;
    let mut last_report = Instant::now();
    while let Some(entry) = entries.next().await {
        apply_entry(state, &entry?, &limits, metrics);
        applied += 1;
        metrics
            .standby_lag
            .set(gauge_value(end.saturating_sub(state.applied_seq)));
        if last_report.elapsed().as_secs() >= 1 {
            last_report = Instant::now();
            tracing::info!(
                applied,
                total,
                objects = state.object_count(),
                "replaying the event stream"
            );
        }
    }
    tracing::info!(
        messages = applied,
        applied_seq = state.applied_seq,
        objects = state.object_count(),
        ms = started.elapsed().as_millis() as u64,
        "caught up with the event stream"
    );
    Ok(applied)
}

/// How many times a restore loads the newest snapshot again after the log was
/// purged past the one it loaded: under load, a newer snapshot can be written
/// and the history before it purged while the restore reads.
const RELOADS_AFTER_PURGE: usize = 3;

/// Whether `error` says the log was purged past where the state stood.
fn purged_past_state(error: &SubmasterError) -> bool {
    std::error::Error::source(error)
        .and_then(|source| source.downcast_ref::<LogError>())
        .is_some_and(|log| matches!(log.kind(), LogErrorKind::Truncated { .. }))
}

/// A state from `load` caught up with the log; returns it, the sequence `load`
/// covered and the messages replayed. When the log was purged past what `load`
/// gave (a newer snapshot covers it), loads again, at most
/// [`RELOADS_AFTER_PURGE`] times.
///
/// # Errors
/// As `load`, or when the log cannot be read.
pub(crate) async fn load_and_catch_up<F, Fut>(
    log: &impl EventLog,
    metrics: &SubmasterMetrics,
    mut load: F,
) -> Result<(State, u64, u64), SubmasterError>
where
    F: FnMut() -> Fut,
    Fut: std::future::Future<Output = Result<State, SubmasterError>>,
{
    let mut reloads = 0;
    loop {
        let mut state = load().await?;
        let loaded_seq = state.applied_seq;
        match catch_up(log, &mut state, metrics).await {
            Ok(replayed) => return Ok((state, loaded_seq, replayed)),
            Err(error) if reloads < RELOADS_AFTER_PURGE && purged_past_state(&error) => {
                reloads += 1;
                tracing::info!(%error, loaded_seq, "the log was purged past the snapshot while restoring; loading the newest again");
            }
            Err(error) => return Err(error),
        }
    }
}

/// Rebuilds the state: the newest valid snapshot (if any) plus the tail of the log.
///
/// # Errors
/// When the log cannot be read, or was purged past what the newest snapshot
/// covers even after reloading it.
pub(crate) async fn restore(
    log: &JetStreamLog,
    snapshots: &SnapshotStore,
    metrics: &SubmasterMetrics,
) -> Result<State, SubmasterError> {
    let started = Instant::now();
    let (state, from_snapshot, _) = load_and_catch_up(log, metrics, || async {
        Ok(match crate::snapshot::load_newest(snapshots).await {
            Ok(Some(state)) => state,
            Ok(None) => State::new(),
            Err(error) => {
                tracing::warn!(%error, "snapshots unavailable; replaying the whole stream");
                State::new()
            }
        })
    })
    .await?;
    tracing::info!(
        from_snapshot,
        applied_seq = state.applied_seq,
        ms = started.elapsed().as_millis() as u64,
        "state restored"
    );
    Ok(state)
}

#[cfg(test)]
mod tests {
    use std::sync::atomic::{AtomicUsize, Ordering};

    use bytes::Bytes;
    use hkvm_events::codec::{encode_message, Header};
    use hkvm_events::{KvEvent, NodeId, ProducerId, SegmentId, SegmentMounted};
    use hkvm_log::{Append, MemoryLog};

    use super::*;

    /// A log of `count` messages, message `i` mounting segment `seg-i`.
    async fn log_of(count: u64) -> MemoryLog {
        let log = MemoryLog::new("follower-test");
        let header = Header {
            producer: ProducerId::new("test").expect("a valid producer"),
            epoch: 1,
            unix_ms: 0,
        };
        for i in 1..=count {
            let mounted = KvEvent::SegmentMounted(SegmentMounted {
                node: NodeId::new("node-a").expect("a valid node"),
                segment: SegmentId::new(format!("seg-{i}")).expect("a valid segment"),
                size: 1 << 20,
                endpoint: "127.0.0.1:1".to_owned(),
                rdma: None,
            });
            let payload = encode_message(&header, &[mounted], &Limits::default())
                .expect("the message encodes");
            log.append(Append {
                expected_last_seq: None,
                msg_id: format!("m-{i}"),
                payload: Bytes::from(payload),
            })
            .await
            .expect("the memory log appends");
        }
        log
    }

    /// The state a snapshot covering `through` would hold.
    async fn snapshot_through(log: &MemoryLog, through: u64, metrics: &SubmasterMetrics) -> State {
        let mut state = State::new();
        fold_until(log, &mut state, through, metrics)
            .await
            .expect("the snapshot's messages are still there");
        state
    }

    #[tokio::test]
    async fn a_restore_loads_again_when_the_log_was_purged_past_its_snapshot() {
        let metrics = SubmasterMetrics::new();
        let log = log_of(30).await;
        // Popped from the end: the older snapshot is loaded first.
        let mut snapshots = vec![
            snapshot_through(&log, 20, &metrics).await,
            snapshot_through(&log, 10, &metrics).await,
        ];
        let loads = AtomicUsize::new(0);
        let (state, loaded_seq, replayed) = load_and_catch_up(&log, &metrics, || {
            // While the older snapshot was being read, the leader wrote the
            // newer one and purged the log through it.
            if loads.fetch_add(1, Ordering::SeqCst) == 0 {
                log.purge_through(20);
            }
            let state = snapshots.pop().expect("two loads at most");
            async move { Ok(state) }
        })
        .await
        .expect("the second load catches up");
        assert_eq!(loads.load(Ordering::SeqCst), 2);
        assert_eq!((loaded_seq, replayed), (20, 10));
        assert_eq!(state.applied_seq, 30);
        assert_eq!(state.slot_count(), 30);
    }

    #[tokio::test]
    async fn a_restore_gives_up_after_its_reloads() {
        let metrics = SubmasterMetrics::new();
        let log = log_of(30).await;
        let mut snapshots = Vec::new();
        for _ in 0..=RELOADS_AFTER_PURGE {
            snapshots.push(snapshot_through(&log, 10, &metrics).await);
        }
        log.purge_through(20);
        let loads = AtomicUsize::new(0);
        let result = load_and_catch_up(&log, &metrics, || {
            loads.fetch_add(1, Ordering::SeqCst);
            let state = snapshots.pop().expect("one load and its reloads");
            async move { Ok(state) }
        })
        .await;
        let Err(error) = result else {
            panic!("no snapshot ever covers the purge")
        };
        assert!(purged_past_state(&error), "{error}");
        assert_eq!(loads.load(Ordering::SeqCst), 1 + RELOADS_AFTER_PURGE);
    }
}
