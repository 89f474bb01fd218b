//! Bounds on everything a message may carry, checked when encoding and decoding so
//! that bad or hostile input is rejected with a reason instead of exhausting memory.

use crate::event::{key_hash, KvEvent};

/// Configurable bounds. Defaults suit production; tests shrink them.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Limits {
    /// Longest key in bytes (default 4 KiB).
    pub max_key_len: usize,
    /// Most events in one message.
    pub max_events_per_message: usize,
    /// Most keys in one `Evicted` or `Removed` event.
    pub max_keys_per_event: usize,
    /// Most replicas of one object.
    pub max_replicas: usize,
    /// Largest object in bytes.
    pub max_object_size: u64,
    /// Largest segment in bytes.
    pub max_segment_size: u64,
    /// Longest endpoint or object name in bytes.
    pub max_name_len: usize,
    /// Largest encoded message in bytes (below NATS `max_payload`, 1 MiB by default).
    pub max_message_bytes: usize,
}

impl Default for Limits {
    fn default() -> Self {
        Self {
            max_key_len: 4096,
            max_events_per_message: 65_536,
            max_keys_per_event: 65_536,
            max_replicas: 16,
            max_object_size: 1 << 40,
            max_segment_size: 1 << 50,
            max_name_len: 256,
            max_message_bytes: 1 << 20,
        }
    }
}

/// Why an event breaks the [`Limits`] or is inconsistent.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum ValidationError {
    /// A key is empty.
    #[error("empty key")]
    EmptyKey,
    /// A key is longer than allowed.
    #[error("key of {len} bytes is longer than the limit of {max}")]
    KeyTooLong {
        /// Its length.
        len: usize,
        /// The limit.
        max: usize,
    },
    /// The carried key hash is not xxh3-64 of the key.
    #[error("key hash {carried:#018x} does not match the key {key:?}")]
    KeyHashMismatch {
        /// The key (truncated to 64 bytes).
        key: String,
        /// The hash the event carried.
        carried: u64,
    },
    /// A put without any placement.
    #[error("put of {key:?} has no placement")]
    NoPlacement {
        /// The key (truncated to 64 bytes).
        key: String,
    },
    /// More placements than allowed.
    #[error("{count} replicas, more than the limit of {max}")]
    TooManyReplicas {
        /// How many.
        count: usize,
        /// The limit.
        max: usize,
    },
    /// More keys in one event than allowed.
    #[error("{count} keys in one event, more than the limit of {max}")]
    TooManyKeys {
        /// How many.
        count: usize,
        /// The limit.
        max: usize,
    },
    /// A size beyond its limit.
    #[error("{what} of {size} bytes is larger than the limit of {max}")]
    TooLarge {
        /// What was too large.
        what: &'static str,
        /// Its size.
        size: u64,
        /// The limit.
        max: u64,
    },
}

fn short(key: &str) -> String {
    key.chars().take(64).collect()
}

impl Limits {
    /// Checks one key against the length bounds.
    ///
    /// # Errors
    /// [`ValidationError::EmptyKey`] or [`ValidationError::KeyTooLong`].
    pub fn check_key(&self, key: &str) -> Result<(), ValidationError> {
        if key.is_empty() {
            return Err(ValidationError::EmptyKey);
        }
        if key.len() > self.max_key_len {
            return Err(ValidationError::KeyTooLong {
                len: key.len(),
                max: self.max_key_len,
            });
        }
        Ok(())
    }

    fn check_size(what: &'static str, size: u64, max: u64) -> Result<(), ValidationError> {
        if size > max {
            return Err(ValidationError::TooLarge { what, size, max });
        }
        Ok(())
    }

    fn check_name(&self, what: &'static str, name: &str) -> Result<(), ValidationError> {
        Self::check_size(what, name.len() as u64, self.max_name_len as u64)
    }

    pub(crate) fn check_keys<K: AsRef<str>>(&self, keys: &[K]) -> Result<(), ValidationError> {
        if keys.len() > self.max_keys_per_event {
            return Err(ValidationError::TooManyKeys {
                count: keys.len(),
                max: self.max_keys_per_event,
            });
        }
        keys.iter().try_for_each(|key| self.check_key(key.as_ref()))
    }

    /// Checks a committed put's key, carried key hash, replica count and size.
    pub(crate) fn check_put(
        &self,
        key: &str,
        carried_hash: u64,
        placements: usize,
        size: u64,
    ) -> Result<(), ValidationError> {
        self.check_key(key)?;
        if carried_hash != key_hash(key) {
            return Err(ValidationError::KeyHashMismatch {
                key: short(key),
                carried: carried_hash,
            });
        }
        if placements == 0 {
            return Err(ValidationError::NoPlacement { key: short(key) });
        }
        if placements > self.max_replicas {
            return Err(ValidationError::TooManyReplicas {
                count: placements,
                max: self.max_replicas,
            });
        }
        Self::check_size("object", size, self.max_object_size)
    }

    /// Checks one event against these limits and its own consistency (key hash).
    ///
    /// # Errors
    /// The first [`ValidationError`] found.
    pub fn check_event(&self, event: &KvEvent) -> Result<(), ValidationError> {
        match event {
            KvEvent::SegmentMounted(mounted) => {
                Self::check_size("segment", mounted.size, self.max_segment_size)?;
                self.check_name("endpoint", &mounted.endpoint)?;
                match &mounted.rdma {
                    Some(rdma) => {
                        self.check_name("RDMA device", &rdma.device)?;
                        self.check_name("RDMA exchange endpoint", &rdma.exchange)
                    }
                    None => Ok(()),
                }
            }
            KvEvent::SegmentUnmounted(_) | KvEvent::NodeLost(_) => Ok(()),
            KvEvent::PutCommitted(put) => {
                self.check_put(&put.key, put.key_hash, put.placements.len(), put.size)
            }
            KvEvent::Evicted(evicted) => self.check_keys(&evicted.keys),
            KvEvent::Removed(removed) => self.check_keys(&removed.keys),
            KvEvent::Snapshot(snapshot) => {
                self.check_name("snapshot object name", &snapshot.object)
            }
        }
    }
}
