//! The event log: an append-only sequence of messages with fenced, idempotent
//! appends and bounded, ordered reads. [`MemoryLog`] is its in-memory twin for pure
//! tests; [`JetStreamLog`] is the real one over a JetStream stream.

mod error;
mod jetstream;
mod linger;
mod memory;
mod pull;

use std::future::Future;
use std::time::Duration;

use bytes::Bytes;
use futures::stream::BoxStream;

pub use error::{LogError, LogErrorKind};
pub use jetstream::{JetStreamLog, StreamStats};
pub use memory::MemoryLog;

/// One append request.
#[derive(Debug, Clone)]
pub struct Append {
    /// The stream sequence the writer believes is last (0 for an empty stream);
    /// the append fails with [`LogErrorKind::Fenced`] if another message got there
    /// first. `None` appends unconditionally (tests and tools only).
    pub expected_last_seq: Option<u64>,
    /// The idempotency id (`Nats-Msg-Id`): a retry with the same id is stored once.
    pub msg_id: String,
    /// The encoded message.
    pub payload: Bytes,
}

/// What the log said about a stored append.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct AppendAck {
    /// The message's stream sequence.
    pub seq: u64,
    /// Whether the message id was seen before (the earlier copy's sequence is given).
    pub duplicate: bool,
}

/// One stored message.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct LogEntry {
    /// Its stream sequence (1-based, gap-free unless the log was purged).
    pub seq: u64,
    /// When it was stored, Unix milliseconds.
    pub unix_ms: u64,
    /// The encoded message.
    pub payload: Bytes,
}

/// The first and last sequence of a log (`first > last` when it is empty).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct LogBounds {
    /// The oldest stored sequence (grows when the log is purged up to a snapshot).
    pub first_seq: u64,
    /// The newest stored sequence (0 when nothing was ever appended).
    pub last_seq: u64,
}

/// Where and how far to read.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct ReadOptions {
    /// The first sequence wanted. Reading fails with [`LogErrorKind::Truncated`] if
    /// the log no longer holds it (purged); clamp with [`EventLog::bounds`] to read
    /// whatever is left.
    pub from_seq: u64,
    /// The last sequence wanted (inclusive). Without it a read ends at the last
    /// sequence present when it started, unless `follow` is set.
    pub until_seq: Option<u64>,
    /// Keep waiting for new messages instead of ending.
    pub follow: bool,
    /// Most messages per batch of the in-memory log. A JetStream read is bounded
    /// by `batch_bytes` alone: a pull request that could also end on its message
    /// count would leave the reader unsure what the server still holds.
    pub batch_messages: usize,
    /// Most bytes in flight per batch: the backpressure bound (a JetStream read
    /// raises it to the server's `max_payload` plus 16 KiB when smaller, so that
    /// any message fits a batch, and keeps at most about one and a half batches
    /// asked for).
    pub batch_bytes: usize,
    /// A following read that has caught up waits this long after a new message
    /// before fetching what came after it, so that a trickle of appends arrives
    /// in bursts (one delivery per burst, not per message). Zero fetches each
    /// message as soon as it is stored. Ignored by the in-memory log.
    pub linger: Duration,
}

impl Default for ReadOptions {
    fn default() -> Self {
        Self {
            from_seq: 1,
            until_seq: None,
            follow: false,
            batch_messages: 1024,
            batch_bytes: 16 << 20,
            linger: Duration::ZERO,
        }
    }
}

impl ReadOptions {
    /// Reads from `seq` to the current end.
    pub fn from(seq: u64) -> Self {
        Self {
            from_seq: seq,
            ..Self::default()
        }
    }
}

/// The stream of entries a read yields. It ends after the last wanted entry, or
/// with one error (a gap, a vanished stream, a lost connection).
pub type EntryStream = BoxStream<'static, Result<LogEntry, LogError>>;

/// An append-only, sequence-numbered log of encoded messages.
pub trait EventLog: Send + Sync + 'static {
    /// Resolves when the log acknowledged a sent append.
    type PendingAck: Future<Output = Result<AppendAck, LogError>> + Send + 'static;

    /// Sends an append without waiting for its acknowledgement, so appends can be
    /// pipelined; they are stored in the order they were sent.
    ///
    /// # Errors
    /// [`LogError`] when the append could not be sent.
    fn send(
        &self,
        append: Append,
    ) -> impl Future<Output = Result<Self::PendingAck, LogError>> + Send;

    /// Sends an append and waits until it is stored.
    ///
    /// # Errors
    /// [`LogErrorKind::Fenced`] when `expected_last_seq` is stale, or any send error.
    fn append(&self, append: Append) -> impl Future<Output = Result<AppendAck, LogError>> + Send {
        async move { self.send(append).await?.await }
    }

    /// The first and last stored sequence.
    ///
    /// # Errors
    /// [`LogErrorKind::StreamNotFound`] when the log vanished, or a transport error.
    fn bounds(&self) -> impl Future<Output = Result<LogBounds, LogError>> + Send;

    /// The first sequence stored at or after `unix_ms` (`last_seq + 1` when none is).
    ///
    /// # Errors
    /// [`LogErrorKind::StreamNotFound`] when the log vanished, or a transport error.
    fn first_seq_since(&self, unix_ms: u64) -> impl Future<Output = Result<u64, LogError>> + Send;

    /// Reads entries in sequence order, a bounded batch at a time: a slow reader
    /// slows the reads instead of buffering without bound.
    ///
    /// # Errors
    /// [`LogErrorKind::Truncated`] when `from_seq` was purged, or a transport error.
    fn read(
        &self,
        options: ReadOptions,
    ) -> impl Future<Output = Result<EntryStream, LogError>> + Send;
}

/// The sequence a read without `until_seq` or `follow` stops at.
pub(crate) fn read_end(options: &ReadOptions, bounds: LogBounds) -> Option<u64> {
    match (options.until_seq, options.follow) {
        (Some(until), _) => Some(until),
        (None, true) => None,
        (None, false) => Some(bounds.last_seq),
    }
}

/// Checks that `from_seq` is still in the log (a purge moves `first_seq` past it).
pub(crate) fn check_not_truncated(
    log: &str,
    options: &ReadOptions,
    bounds: LogBounds,
) -> Result<(), LogError> {
    if options.from_seq < bounds.first_seq && bounds.first_seq > 1 {
        return Err(LogError::new(
            log,
            LogErrorKind::Truncated {
                requested: options.from_seq,
                first_seq: bounds.first_seq,
            },
        ));
    }
    Ok(())
}

/// Wraps a read so that a jump in sequences ends it with [`LogErrorKind::Gap`]
/// instead of silently skipping history, and nothing follows an error.
pub(crate) fn gap_checked(log: String, from_seq: u64, entries: EntryStream) -> EntryStream {
    use futures::StreamExt as _;
    let start = (entries, from_seq.max(1), false);
    Box::pin(futures::stream::unfold(
        start,
        move |(mut entries, expected, failed)| {
            let log = log.clone();
            async move {
                if failed {
                    return None;
                }
                match entries.next().await? {
                    Ok(entry) if entry.seq == expected => {
                        Some((Ok(entry), (entries, expected + 1, false)))
                    }
                    Ok(entry) => {
                        let gap = LogErrorKind::Gap {
                            expected,
                            found: entry.seq,
                        };
                        Some((Err(LogError::new(log, gap)), (entries, expected, true)))
                    }
                    Err(error) => Some((Err(error), (entries, expected, true))),
                }
            }
        },
    ))
}
