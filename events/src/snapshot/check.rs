//! Checking a stored snapshot's bytes piece by piece, as they arrive from a store,
//! against the checksum its writer recorded and the one its first 8 bytes carry.

use super::SnapshotError;

/// Checks a stored snapshot's bytes as they arrive, in pieces of any size: the
/// xxh3-64 of all of them (what the writer computed) and of the body after the
/// first 8 bytes (what those 8 bytes carry). A 10 M-object snapshot is about
/// 860 MB; checking it this way never holds it whole.
pub struct StoredCheck {
    whole: xxhash_rust::xxh3::Xxh3,
    body: xxhash_rust::xxh3::Xxh3,
    carried: [u8; 8],
    len: usize,
}

impl Default for StoredCheck {
    fn default() -> Self {
        Self::new()
    }
}

impl StoredCheck {
    /// A check that has seen no bytes.
    pub fn new() -> Self {
        Self {
            whole: xxhash_rust::xxh3::Xxh3::new(),
            body: xxhash_rust::xxh3::Xxh3::new(),
            carried: [0; 8],
            len: 0,
        }
    }

    /// Takes the next `bytes`.
    pub fn update(&mut self, bytes: &[u8]) {
        self.whole.update(bytes);
        let (head, body) =
            bytes.split_at(self.carried.len().saturating_sub(self.len).min(bytes.len()));
        if !head.is_empty() {
            self.carried[self.len..self.len + head.len()].copy_from_slice(head);
        }
        self.body.update(body);
        self.len += bytes.len();
    }

    /// Whether the bytes seen hash to `checksum` and their body to the
    /// checksum they carry.
    ///
    /// # Errors
    /// [`SnapshotError::ChecksumMismatch`] or [`SnapshotError::Truncated`].
    pub fn finish(self, checksum: u64) -> Result<(), SnapshotError> {
        let computed = self.whole.digest();
        if computed != checksum {
            return Err(SnapshotError::ChecksumMismatch {
                stored: checksum,
                computed,
            });
        }
        if self.len < self.carried.len() {
            return Err(SnapshotError::Truncated { len: self.len });
        }
        let (stored, computed) = (u64::from_be_bytes(self.carried), self.body.digest());
        if stored != computed {
            return Err(SnapshotError::ChecksumMismatch { stored, computed });
        }
        Ok(())
    }
}

impl std::fmt::Debug for StoredCheck {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("StoredCheck")
            .field("len", &self.len)
            .finish()
    }
}
