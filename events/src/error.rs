//! Errors of encoding and decoding messages and events.

use crate::event::EventKind;
use crate::limits::ValidationError;

/// Why a message could not be encoded.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum EncodeError {
    /// An event breaks the limits.
    #[error("event {index} is invalid: {source}")]
    Invalid {
        /// Its position in the batch.
        index: usize,
        /// What is wrong.
        source: ValidationError,
    },
    /// Too many events for one message.
    #[error("{count} events in one message, more than the limit of {max}")]
    TooManyEvents {
        /// How many.
        count: usize,
        /// The limit.
        max: usize,
    },
    /// The encoded message is larger than allowed.
    #[error("encoded message of {size} bytes is larger than the limit of {max}")]
    MessageTooLarge {
        /// Its size.
        size: usize,
        /// The limit.
        max: usize,
    },
    /// The serializer failed (should not happen for these types).
    #[error("serializing: {0}")]
    Serialize(String),
}

/// Why a whole message could not be decoded.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum DecodeError {
    /// The bytes are truncated or not the envelope's MessagePack structure.
    #[error("not an HKVM event message: {0}")]
    Framing(String),
    /// Written by a newer, incompatible version.
    #[error("envelope version {found} is not readable by this build (reads up to {supported})")]
    UnknownVersion {
        /// The version found.
        found: u16,
        /// The newest version this build reads.
        supported: u16,
    },
    /// The header is malformed.
    #[error("bad envelope header: {0}")]
    Header(String),
    /// The message announces more events than allowed.
    #[error("message announces {count} events, more than the limit of {max}")]
    TooManyEvents {
        /// How many.
        count: usize,
        /// The limit.
        max: usize,
    },
}

/// Why one event inside a message could not be decoded.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("event {index}: {kind}")]
pub struct EventError {
    /// The event's position in its message.
    pub index: usize,
    /// What went wrong.
    pub kind: EventErrorKind,
}

impl EventError {
    /// Whether the following events of the message can still be decoded. Unknown
    /// kinds and bad bodies are skippable (bodies are length-prefixed); a broken frame
    /// is not.
    pub fn is_skippable(&self) -> bool {
        !matches!(self.kind, EventErrorKind::Framing(_))
    }
}

/// The reason of an [`EventError`].
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum EventErrorKind {
    /// A kind code this build does not know (written by a newer producer).
    #[error("unknown event kind {0}")]
    UnknownKind(u16),
    /// The body of a known kind does not decode.
    #[error("malformed {kind} body: {reason}")]
    Body {
        /// The event kind.
        kind: EventKind,
        /// The decoder's complaint.
        reason: String,
    },
    /// The body decoded but breaks the limits.
    #[error("invalid {kind}: {source}")]
    Invalid {
        /// The event kind.
        kind: EventKind,
        /// What is wrong.
        source: ValidationError,
    },
    /// The event frame itself is broken (truncated message).
    #[error("broken event frame: {0}")]
    Framing(String),
}
