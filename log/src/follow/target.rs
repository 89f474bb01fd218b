//! What a [`Follower`](super::Follower) folds into: the projection of the global
//! master, the diff of the inter-DC master, or a test's model.

use hkvm_events::codec::{decode_stored, Decoded, UndecodableMessage};
use hkvm_events::key_ops::{decode_key_ops, KeyOps};
use hkvm_events::limits::Limits;
use hkvm_events::snapshot::SnapshotFile;

/// A form a stored message decodes into for a [`FoldTarget`].
pub trait StoredMessage: Send + Sized + 'static {
    /// Decodes the message stored at `seq`.
    ///
    /// # Errors
    /// [`UndecodableMessage`] when it does not decode.
    fn decode(
        seq: u64,
        unix_ms: u64,
        payload: &[u8],
        limits: &Limits,
    ) -> Result<Self, UndecodableMessage>;
}

/// Every event, owned ([`decode_stored`]).
impl StoredMessage for Decoded {
    fn decode(
        seq: u64,
        unix_ms: u64,
        payload: &[u8],
        limits: &Limits,
    ) -> Result<Self, UndecodableMessage> {
        decode_stored(seq, unix_ms, payload, limits)
    }
}

/// Key operations, keys borrowed while decoding ([`decode_key_ops`]).
impl StoredMessage for KeyOps {
    fn decode(
        seq: u64,
        unix_ms: u64,
        payload: &[u8],
        limits: &Limits,
    ) -> Result<Self, UndecodableMessage> {
        decode_key_ops(seq, unix_ms, payload, limits)
    }
}

/// Why a follower forgot what it had folded and re-reads the stream.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum ResyncReason {
    /// The stream vanished after something was folded from it.
    StreamDeleted,
    /// The stream is shorter than the position, or was re-created (new identity).
    StreamReset,
    /// The stream was purged past the position.
    PurgedPastPosition,
    /// A read started at a sequence that was purged meanwhile.
    Purged,
    /// Sequences jumped while reading, or a message came out of order.
    SequenceGap,
    /// A message did not decode (re-read once before it is skipped).
    Undecodable,
}

impl ResyncReason {
    /// A short label for logs and metrics.
    pub fn as_str(self) -> &'static str {
        match self {
            Self::StreamDeleted => "stream deleted",
            Self::StreamReset => "stream reset",
            Self::PurgedPastPosition => "stream purged past the position",
            Self::Purged => "stream purged",
            Self::SequenceGap => "sequence gap",
            Self::Undecodable => "undecodable message",
        }
    }
}

/// A decoded message did not follow the target's position.
#[derive(Debug, Clone, Copy, PartialEq, Eq, thiserror::Error)]
#[error("out of order: expected sequence {expected}, got {found}")]
pub struct OutOfOrder {
    /// The next sequence expected.
    pub expected: u64,
    /// The sequence that arrived.
    pub found: u64,
}

/// The content a target is seeded with when the stream's early history was
/// purged.
#[derive(Debug, Clone, Copy)]
pub struct Seed<'a> {
    /// The sub-master's newest verified snapshot, covering at least every
    /// sequence before the stream's first one.
    pub snapshot: &'a SnapshotFile,
    /// When the first message left in the stream was stored (the snapshot's
    /// objects are at least that old), if it could be read.
    pub first_unix_ms: Option<u64>,
}

/// A fold of one stream. The follower calls it from one task; implementations
/// lock whatever state they share with readers.
pub trait FoldTarget: Send + 'static {
    /// A stored message as this target folds it: [`Decoded`] (every event, owned),
    /// or a lighter form such as [`KeyOps`]. The follower decodes it on its own
    /// task, outside whatever lock [`FoldTarget::apply`] takes.
    type Message: StoredMessage;

    /// The last stream sequence folded (0 when nothing was).
    fn applied_seq(&self) -> u64;

    /// The stream identity recorded with the folded content (0 when none); a
    /// restored checkpoint carries it, so a stream re-created while the reader was
    /// down is noticed.
    fn stream_epoch(&self) -> u64 {
        0
    }

    /// Records the stream identity the folded content belongs to.
    fn set_stream_epoch(&mut self, _epoch: u64) {}

    /// Forgets everything folded from the stream (position 0), before it is read
    /// again from its start.
    fn reset(&mut self, reason: ResyncReason);

    /// Replaces what is known of the stream with a snapshot's content; the position
    /// becomes the snapshot's covered sequence.
    fn seed(&mut self, seed: Seed<'_>);

    /// Folds consecutive decoded messages, in order. Messages at or below the
    /// position are ignored.
    ///
    /// # Errors
    /// [`OutOfOrder`] when a message skips ahead of the next expected sequence
    /// (the follower resynchronizes).
    fn apply(&mut self, messages: Vec<Self::Message>) -> Result<(), OutOfOrder>;

    /// Moves the position past a message that cannot be decoded even after a
    /// re-read, without folding anything.
    fn skip(&mut self, seq: u64, unix_ms: u64);

    /// The stream's last sequence as last seen (for lag reporting).
    fn observe_last_seq(&mut self, _last_seq: u64) {}

    /// The position reached the stream's end as seen when the read started.
    fn caught_up(&mut self) {}
}
