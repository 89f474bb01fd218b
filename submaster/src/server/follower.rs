//! Rebuilding and following the state from the event stream: restore the newest
//! snapshot, replay the tail, and (as a hot standby) keep applying new messages.

use futures::StreamExt as _;
use hkvm_events::log::{EventLog, JetStreamLog, LogEntry, LogError, LogErrorKind, ReadOptions};
use hkvm_events::{decode_message, Limits};
use tokio::time::Instant;

use crate::error::SubmasterError;
use crate::metrics::{gauge_value, SubmasterMetrics};
use crate::state::State;
use hkvm_events::snapshot::SnapshotStore;

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
    log: &JetStreamLog,
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
    log: &JetStreamLog,
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
    log: &JetStreamLog,
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
