//! The reader-positions value format: who reads a sub-cluster's stream (the key
//! part naming its kind) and the position it recorded (the value), in the
//! cluster's positions bucket (`hkvm-log` reads and writes the bucket).

use serde::{Deserialize, Serialize};

/// Who reads a stream.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum ReaderKind {
    /// A global-master replica (its position is that of its newest checkpoint).
    GlobalMaster,
    /// An inter-DC master following the stream.
    InterDc,
    /// A sub-master's hot standby (it writes the snapshots while it stands by).
    Standby,
    /// Anything else (a test, a tool).
    Other,
}

impl ReaderKind {
    /// The key part naming the kind.
    pub fn as_str(self) -> &'static str {
        match self {
            Self::GlobalMaster => "global",
            Self::InterDc => "interdc",
            Self::Standby => "standby",
            Self::Other => "other",
        }
    }

    /// The kind a key part names ([`Self::Other`] for any it does not know).
    pub fn parse(value: &str) -> Self {
        match value {
            "global" => Self::GlobalMaster,
            "interdc" => Self::InterDc,
            "standby" => Self::Standby,
            _ => Self::Other,
        }
    }
}

/// One reader's recorded position (MessagePack, named fields).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub struct ReaderPosition {
    /// The last stream sequence the reader no longer needs to read again: every
    /// message up to it may be purged as far as this reader is concerned.
    #[serde(rename = "q")]
    pub seq: u64,
    /// When it was recorded, Unix milliseconds.
    #[serde(rename = "t")]
    pub unix_ms: u64,
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn positions_decode_what_they_encode() {
        let value = ReaderPosition {
            seq: 42,
            unix_ms: 7,
        };
        let bytes = rmp_serde::to_vec_named(&value).unwrap();
        assert_eq!(
            rmp_serde::from_slice::<ReaderPosition>(&bytes).unwrap(),
            value
        );
        assert!(rmp_serde::from_slice::<ReaderPosition>(b"\xc1").is_err());
    }
}
