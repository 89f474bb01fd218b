//! The in-memory twin of the JetStream log, for pure tests of anything built on
//! [`EventLog`]: same fencing, dedup, truncation and read semantics, no I/O.

use std::collections::HashMap;
use std::sync::{Arc, Mutex, MutexGuard};
use std::time::{SystemTime, UNIX_EPOCH};

use bytes::Bytes;
use futures::future::{ready, Ready};
use tokio::sync::Notify;

use super::{
    check_not_truncated, gap_checked, read_end, Append, AppendAck, EntryStream, EventLog,
    LogBounds, LogEntry, LogError, LogErrorKind, ReadOptions,
};

#[derive(Debug, Default)]
struct State {
    /// Sequence of `entries[0]`.
    first_seq: u64,
    entries: Vec<LogEntry>,
    /// Message id of each entry, parallel to `entries`.
    entry_ids: Vec<String>,
    seen_ids: HashMap<String, u64>,
}

impl State {
    fn last_seq(&self) -> u64 {
        self.first_seq + self.entries.len() as u64 - 1
    }
}

/// An in-memory event log. Clones share the same log.
#[derive(Debug, Clone)]
pub struct MemoryLog {
    name: Arc<str>,
    state: Arc<Mutex<State>>,
    appended: Arc<Notify>,
}

impl MemoryLog {
    /// An empty log called `name`.
    pub fn new(name: &str) -> Self {
        Self {
            name: name.into(),
            state: Arc::new(Mutex::new(State {
                first_seq: 1,
                ..State::default()
            })),
            appended: Arc::new(Notify::new()),
        }
    }

    fn lock(&self) -> MutexGuard<'_, State> {
        // A panic while holding the lock cannot leave State half-updated (every
        // update is a single push or drain), so a poisoned lock is still usable.
        self.state
            .lock()
            .unwrap_or_else(|poisoned| poisoned.into_inner())
    }

    /// Drops every entry up to and including `seq`, as a purge after a snapshot does.
    pub fn purge_through(&self, seq: u64) {
        let mut state = self.lock();
        let drop = seq.saturating_add(1).saturating_sub(state.first_seq);
        let drop = usize::try_from(drop)
            .unwrap_or(usize::MAX)
            .min(state.entries.len());
        state.entries.drain(..drop);
        state.entry_ids.drain(..drop);
        state.first_seq += drop as u64;
    }

    /// Replaces the payload stored at `seq` (to test corrupted messages).
    pub fn overwrite(&self, seq: u64, payload: Bytes) {
        let mut state = self.lock();
        let Some(index) = seq.checked_sub(state.first_seq) else {
            return;
        };
        if let Some(entry) = usize::try_from(index)
            .ok()
            .and_then(|index| state.entries.get_mut(index))
        {
            entry.payload = payload;
        }
    }

    fn store(&self, append: Append) -> Result<AppendAck, LogError> {
        let mut state = self.lock();
        let last = state.last_seq();
        // Like JetStream: the fence is checked before the message id; a fenced retry
        // whose first copy sits right after the fence is reported as a duplicate.
        if let Some(expected) = append.expected_last_seq {
            if expected != last {
                let next = expected
                    .checked_add(1)
                    .and_then(|seq| seq.checked_sub(state.first_seq))
                    .and_then(|index| usize::try_from(index).ok());
                if let Some(id) = next.and_then(|index| state.entry_ids.get(index)) {
                    if *id == append.msg_id {
                        return Ok(AppendAck {
                            seq: expected + 1,
                            duplicate: true,
                        });
                    }
                }
                return Err(LogError::new(
                    &*self.name,
                    LogErrorKind::Fenced { expected },
                ));
            }
        }
        if let Some(&seq) = state.seen_ids.get(&append.msg_id) {
            return Ok(AppendAck {
                seq,
                duplicate: true,
            });
        }
        let seq = last + 1;
        let unix_ms = SystemTime::now()
            .duration_since(UNIX_EPOCH)
            .map_or(0, |d| u64::try_from(d.as_millis()).unwrap_or(u64::MAX));
        state.entries.push(LogEntry {
            seq,
            unix_ms,
            payload: append.payload,
        });
        state.entry_ids.push(append.msg_id.clone());
        state.seen_ids.insert(append.msg_id, seq);
        drop(state);
        self.appended.notify_waiters();
        Ok(AppendAck {
            seq,
            duplicate: false,
        })
    }

    fn batch_from(&self, next: u64, end: Option<u64>, max: usize) -> Vec<LogEntry> {
        let state = self.lock();
        let start = next.saturating_sub(state.first_seq);
        let start = usize::try_from(start).unwrap_or(usize::MAX);
        state
            .entries
            .iter()
            .skip(start)
            .take_while(|entry| end.is_none_or(|end| entry.seq <= end))
            .take(max)
            .cloned()
            .collect()
    }
}

impl EventLog for MemoryLog {
    type PendingAck = Ready<Result<AppendAck, LogError>>;

    async fn send(&self, append: Append) -> Result<Self::PendingAck, LogError> {
        Ok(ready(self.store(append)))
    }

    async fn bounds(&self) -> Result<LogBounds, LogError> {
        let state = self.lock();
        Ok(LogBounds {
            first_seq: state.first_seq,
            last_seq: state.last_seq(),
        })
    }

    async fn first_seq_since(&self, unix_ms: u64) -> Result<u64, LogError> {
        let state = self.lock();
        let index = state
            .entries
            .partition_point(|entry| entry.unix_ms < unix_ms);
        Ok(state.first_seq + index as u64)
    }

    async fn read(&self, options: ReadOptions) -> Result<EntryStream, LogError> {
        let bounds = self.bounds().await?;
        check_not_truncated(&self.name, &options, bounds)?;
        let end = read_end(&options, bounds);
        let log = self.clone();
        let batch = options.batch_messages.max(1);
        let stream = futures::stream::unfold(
            (log, options.from_seq.max(1)),
            move |(log, next)| async move {
                loop {
                    if end.is_some_and(|end| next > end) {
                        return None;
                    }
                    // Register for wake-ups before looking, so no append is missed.
                    let appended = log.appended.clone();
                    let notified = appended.notified();
                    let entries = log.batch_from(next, end, batch);
                    if let Some(last) = entries.last() {
                        let after = last.seq + 1;
                        let items: Vec<Result<LogEntry, LogError>> =
                            entries.into_iter().map(Ok).collect();
                        return Some((futures::stream::iter(items), (log, after)));
                    }
                    notified.await;
                }
            },
        );
        Ok(gap_checked(
            self.name.to_string(),
            options.from_seq,
            Box::pin(futures::StreamExt::flatten(stream)),
        ))
    }
}
