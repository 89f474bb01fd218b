//! Read-your-writes for the lookups that ask for it (`sync`): before a key is
//! answered "held nowhere", the replica learns the last sequence of every stream
//! it follows or sees registered — asked after the request arrived — and waits
//! until it has applied that far. So a put acknowledged before the request is
//! seen, whoever made it. The wait is bounded (`sync_timeout_ms`); past it the
//! answer is a typed `Stale` error, never a not-found that may be wrong.
//!
//! Concurrent waiters share the look at the streams: one look runs at a time, and
//! a waiter takes the newest look that started after it arrived, so under load the
//! streams are asked at most once per round trip, not once per request.

use std::collections::BTreeSet;
use std::time::Duration;

use async_nats::jetstream;
use hkvm_events::rpc::{RpcError, RpcErrorCode};
use hkvm_events::subject::{event_subject, stream_name};
use hkvm_events::SubclusterId;
use hkvm_log::{EventLog as _, JetStreamLog};
use tokio::time::Instant;

use crate::state::{Shared, StreamEnds};

fn stale(message: impl Into<String>) -> RpcError {
    RpcError::new(RpcErrorCode::Stale, message)
}

/// The stream ends as of a look that started at or after `arrived`.
async fn ends_since(
    shared: &Shared,
    js: &jetstream::Context,
    arrived: Instant,
) -> Result<Vec<(SubclusterId, u64)>, RpcError> {
    // One look at a time; whoever waited for the lock may find a fresh one.
    let mut newest = shared.looks.newest.lock().await;
    if let Some(look) = newest.as_ref().filter(|look| look.started >= arrived) {
        return Ok(look.ends.clone());
    }
    let started = Instant::now();
    let ends = look(shared, js).await?;
    *newest = Some(StreamEnds {
        started,
        ends: ends.clone(),
    });
    Ok(ends)
}

/// The last stream sequence of every sub-cluster this replica follows or sees
/// alive in the registry (one it has not started reading yet counts too), asked
/// now.
async fn look(
    shared: &Shared,
    js: &jetstream::Context,
) -> Result<Vec<(SubclusterId, u64)>, RpcError> {
    let cluster = &shared.config.cluster;
    let mut subclusters: BTreeSet<SubclusterId> = shared
        .read()
        .sources()
        .iter()
        .filter_map(|state| state.subcluster.clone())
        .collect();
    subclusters.extend(
        shared
            .registry()
            .iter()
            .filter(|(_, entry)| entry.alive)
            .map(|(subcluster, _)| subcluster.clone()),
    );
    let logs: Vec<(SubclusterId, JetStreamLog)> = subclusters
        .into_iter()
        .map(|subcluster| {
            let log = JetStreamLog::new(
                js.clone(),
                stream_name(cluster, &subcluster),
                event_subject(cluster, &subcluster),
            );
            (subcluster, log)
        })
        .collect();
    let bounds = futures::future::join_all(logs.iter().map(|(_, log)| log.bounds())).await;
    logs.into_iter()
        .zip(bounds)
        .map(|((subcluster, log), bounds)| match bounds {
            Ok(bounds) => Ok((subcluster, bounds.last_seq)),
            Err(error) => Err(stale(format!(
                "could not learn how far stream {} goes: {error}",
                log.stream_name()
            ))),
        })
        .collect()
}

/// Waits until this replica has applied every followed stream as far as it went
/// when the request `arrived`.
///
/// # Errors
/// `Stale` when a stream cannot be asked or the replica has not caught up within
/// `sync_timeout_ms`.
pub(crate) async fn wait_current(
    shared: &Shared,
    js: &jetstream::Context,
    arrived: Instant,
) -> Result<(), RpcError> {
    let timeout = Duration::from_millis(shared.config.sync_timeout_ms);
    let deadline = arrived + timeout;
    // Subscribed before the first check, so no application between the check and
    // the wait goes unnoticed.
    let mut applied = shared.applied.subscribe();
    let ends = tokio::time::timeout_at(deadline, ends_since(shared, js, arrived))
        .await
        .map_err(|_| stale("the event streams did not say how far they go in time"))??;
    loop {
        applied.borrow_and_update();
        let behind: Vec<String> = {
            let projection = shared.read();
            ends.iter()
                .filter_map(|(subcluster, last)| {
                    let applied = projection
                        .find_source(subcluster)
                        .and_then(|source| projection.source(source))
                        .map_or(0, |state| state.applied_seq);
                    (applied < *last).then(|| format!("{subcluster} at {applied} of {last}"))
                })
                .collect()
        };
        if behind.is_empty() {
            return Ok(());
        }
        tokio::select! {
            changed = applied.changed() => {
                if changed.is_err() {
                    return Err(stale("the replica is shutting down"));
                }
            }
            () = tokio::time::sleep_until(deadline) => {
                return Err(stale(format!(
                    "not caught up within {} ms: {}",
                    timeout.as_millis(),
                    behind.join(", ")
                )));
            }
        }
    }
}
