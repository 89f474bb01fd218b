//! Validated identifiers: cluster, sub-cluster, producer, node and segment names.
//! Every one matches `[A-Za-z0-9_-]{1,64}`, so it is safe inside NATS subjects,
//! stream names, bucket names and message ids.

use std::fmt;

use serde::{Deserialize, Serialize};

/// The longest identifier accepted.
pub const MAX_ID_LEN: usize = 64;

/// Why a string is not a valid identifier.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum IdError {
    /// The string is empty.
    #[error("{what} is empty")]
    Empty {
        /// Which identifier.
        what: &'static str,
    },
    /// The string is longer than [`MAX_ID_LEN`].
    #[error("{what} is {len} bytes long, more than {MAX_ID_LEN}")]
    TooLong {
        /// Which identifier.
        what: &'static str,
        /// Its length.
        len: usize,
    },
    /// The string holds a character outside `[A-Za-z0-9_-]`.
    #[error("{what} {value:?} has {bad:?} at byte {at}; only [A-Za-z0-9_-] is allowed")]
    BadChar {
        /// Which identifier.
        what: &'static str,
        /// The offending value (truncated to the limit).
        value: String,
        /// The offending character.
        bad: char,
        /// Its byte offset.
        at: usize,
    },
    /// The name is reserved for HKVM's own subjects (e.g. `global`).
    #[error("{what} {value:?} is reserved")]
    Reserved {
        /// Which identifier.
        what: &'static str,
        /// The reserved value.
        value: String,
    },
}

/// Whether `bytes` match `[A-Za-z0-9_-]{1,64}`: what [`validate_id`] accepts,
/// checked byte by byte (such bytes are ASCII, hence UTF-8).
pub(crate) fn is_valid_id(bytes: &[u8]) -> bool {
    !bytes.is_empty()
        && bytes.len() <= MAX_ID_LEN
        // One table load per byte and no early exit: ids are short, and this
        // runs for every placement the projector folds.
        && bytes
            .iter()
            .fold(true, |valid, &b| valid & ID_BYTE[usize::from(b)])
}

/// Which bytes an identifier may hold: `[A-Za-z0-9_-]`.
const ID_BYTE: [bool; 256] = {
    let mut table = [false; 256];
    let mut byte = 0;
    while byte < 256 {
        let b = byte as u8;
        table[byte] = b.is_ascii_alphanumeric() || b == b'_' || b == b'-';
        byte += 1;
    }
    table
};

/// Checks `value` against `[A-Za-z0-9_-]{1,64}`.
///
/// # Errors
/// The first rule the value breaks.
pub fn validate_id(what: &'static str, value: &str) -> Result<(), IdError> {
    if is_valid_id(value.as_bytes()) {
        return Ok(());
    }
    if value.is_empty() {
        return Err(IdError::Empty { what });
    }
    if value.len() > MAX_ID_LEN {
        return Err(IdError::TooLong {
            what,
            len: value.len(),
        });
    }
    if let Some((at, bad)) = value
        .char_indices()
        .find(|(_, c)| !(c.is_ascii_alphanumeric() || *c == '_' || *c == '-'))
    {
        return Err(IdError::BadChar {
            what,
            value: value.to_owned(),
            bad,
            at,
        });
    }
    Ok(())
}

macro_rules! define_id {
    ($(#[$doc:meta])* $name:ident, $what:literal $(, reserved = [$($reserved:literal),*])?) => {
        $(#[$doc])*
        #[derive(Clone, PartialEq, Eq, Hash, PartialOrd, Ord, Deserialize)]
        #[serde(try_from = "String")]
        pub struct $name(String);

        // Serialized by reference: `serde(into)` would clone the string every time.
        impl Serialize for $name {
            fn serialize<S: serde::Serializer>(&self, serializer: S) -> Result<S::Ok, S::Error> {
                serializer.serialize_str(&self.0)
            }
        }

        impl $name {
            /// Validates and wraps `value`.
            ///
            /// # Errors
            /// [`IdError`] when `value` is not `[A-Za-z0-9_-]{1,64}` or is reserved.
            pub fn new(value: impl Into<String>) -> Result<Self, IdError> {
                let value = value.into();
                validate_id($what, &value)?;
                $($(
                    if value == $reserved {
                        return Err(IdError::Reserved { what: $what, value });
                    }
                )*)?
                Ok(Self(value))
            }

            /// The identifier as a string.
            pub fn as_str(&self) -> &str {
                &self.0
            }
        }

        impl TryFrom<String> for $name {
            type Error = IdError;
            fn try_from(value: String) -> Result<Self, IdError> {
                Self::new(value)
            }
        }

        impl std::str::FromStr for $name {
            type Err = IdError;
            fn from_str(value: &str) -> Result<Self, IdError> {
                Self::new(value)
            }
        }

        impl From<$name> for String {
            fn from(id: $name) -> String {
                id.0
            }
        }

        impl AsRef<str> for $name {
            fn as_ref(&self) -> &str {
                &self.0
            }
        }

        impl fmt::Display for $name {
            fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
                f.write_str(&self.0)
            }
        }

        impl fmt::Debug for $name {
            fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
                write!(f, "{}({:?})", stringify!($name), self.0)
            }
        }
    };
}

define_id!(
    /// The name of an HKVM cluster (one pool): the second token of every subject.
    ClusterId,
    "cluster id"
);
define_id!(
    /// The name of a sub-cluster. `global` is reserved for the global master's subjects.
    SubclusterId,
    "sub-cluster id",
    reserved = ["global"]
);
define_id!(
    /// Who appended a message: a sub-master instance (leader or standby that won).
    ProducerId,
    "producer id"
);
define_id!(
    /// A node ("real client") that owns memory segments.
    NodeId,
    "node id"
);
define_id!(
    /// A memory segment mounted by a node.
    SegmentId,
    "segment id"
);

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn accepts_the_allowed_alphabet_up_to_64_bytes() {
        assert!(ClusterId::new("prod-A_1").is_ok());
        assert!(ClusterId::new("x".repeat(64)).is_ok());
    }

    #[test]
    fn rejects_empty_long_and_bad_characters_with_the_reason() {
        assert_eq!(NodeId::new(""), Err(IdError::Empty { what: "node id" }));
        assert!(matches!(
            NodeId::new("x".repeat(65)),
            Err(IdError::TooLong { len: 65, .. })
        ));
        for bad in ["a.b", "a*", "a>", "a b", "ü", "a/b"] {
            let err = SegmentId::new(bad).unwrap_err();
            assert!(matches!(err, IdError::BadChar { .. }), "{bad}: {err}");
        }
    }

    #[test]
    fn global_is_not_a_subcluster_name() {
        assert!(matches!(
            SubclusterId::new("global"),
            Err(IdError::Reserved { .. })
        ));
        assert!(ClusterId::new("global").is_ok());
    }

    #[test]
    fn deserializing_validates() {
        let bytes = rmp_serde::to_vec(&"a.b").unwrap();
        assert!(rmp_serde::from_slice::<NodeId>(&bytes).is_err());
        let bytes = rmp_serde::to_vec(&"node-1").unwrap();
        assert_eq!(
            rmp_serde::from_slice::<NodeId>(&bytes).unwrap().as_str(),
            "node-1"
        );
    }
}
