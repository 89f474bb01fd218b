//! Where each reader of a sub-cluster's stream has got to, so that the stream can
//! be purged up to a point every reader has passed. Readers (global-master
//! replicas, inter-DC masters, tools) record their positions in one JetStream KV
//! bucket per cluster (`hkvm_<cluster>_positions`), keyed
//! `<subcluster>.<reader kind>.<reader name>`; the sub-master leader reads them
//! before it purges, and `hkvm status` shows them.
//!
//! A position is a promise only while it is fresh: a reader that stopped recording
//! (gone for good, or down for longer than the purger's reader TTL) no longer holds
//! history back. It seeds from the newest snapshot when it comes back, as every
//! reader behind the purge point does.

use std::time::Duration;

use async_nats::jetstream::{self, kv};
use futures::StreamExt as _;

use crate::registry::now_unix_ms;
use hkvm_events::id::{ClusterId, SubclusterId};
pub use hkvm_events::positions::{ReaderKind, ReaderPosition};
use hkvm_events::subject::Bucket;

/// How long an entry stays in the bucket after its last record: far longer than
/// any reader TTL, so that the bucket itself forgets readers gone for good.
pub const ENTRY_MAX_AGE: Duration = Duration::from_secs(24 * 3600);

/// A position as listed, with whose it is.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ListedPosition {
    /// The reader's kind.
    pub kind: ReaderKind,
    /// The reader's name (a replica name, an inter-DC master's name).
    pub reader: String,
    /// What it recorded.
    pub position: ReaderPosition,
}

impl ListedPosition {
    /// How old the record is at `now_ms`.
    pub fn age_ms(&self, now_ms: u64) -> u64 {
        now_ms.saturating_sub(self.position.unix_ms)
    }
}

/// What went wrong with the positions bucket.
#[derive(Debug, thiserror::Error)]
pub enum PositionsError {
    /// The KV store failed or NATS is unreachable.
    #[error("reader positions ({what}): {source}")]
    Transport {
        /// What was being done.
        what: &'static str,
        /// The cause.
        #[source]
        source: Box<dyn std::error::Error + Send + Sync>,
    },
}

impl PositionsError {
    fn transport(
        what: &'static str,
        source: impl std::error::Error + Send + Sync + 'static,
    ) -> Self {
        Self::Transport {
            what,
            source: Box::new(source),
        }
    }
}

/// The highest sequence a stream may be purged through: what the newest verified
/// snapshot covers, but no further than any reader whose position is fresher than
/// `reader_ttl` at `now_ms`.
pub fn purge_point(
    snapshot_covers: u64,
    positions: &[ListedPosition],
    now_ms: u64,
    reader_ttl: Duration,
) -> u64 {
    let ttl_ms = u64::try_from(reader_ttl.as_millis()).unwrap_or(u64::MAX);
    positions
        .iter()
        .filter(|listed| listed.age_ms(now_ms) <= ttl_ms)
        .map(|listed| listed.position.seq)
        .fold(snapshot_covers, u64::min)
}

/// A reader name as a KV key token: `[A-Za-z0-9_-]`, anything else becomes `_`.
fn key_token(name: &str) -> String {
    name.chars()
        .map(|c| {
            if c.is_ascii_alphanumeric() || c == '_' || c == '-' {
                c
            } else {
                '_'
            }
        })
        .collect()
}

/// The reader positions bucket of one cluster.
#[derive(Clone)]
pub struct Positions {
    store: kv::Store,
}

impl std::fmt::Debug for Positions {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Positions").finish_non_exhaustive()
    }
}

impl Positions {
    /// Opens (creating if needed, with `replicas` copies) the positions bucket of
    /// `cluster`.
    ///
    /// # Errors
    /// [`PositionsError::Transport`] when JetStream refuses.
    pub async fn open(
        js: &jetstream::Context,
        cluster: &ClusterId,
        replicas: usize,
    ) -> Result<Self, PositionsError> {
        let bucket = Bucket::Positions.name(cluster);
        let config = kv::Config {
            bucket,
            description: format!("HKVM stream reader positions of cluster {cluster}"),
            history: 1,
            max_age: ENTRY_MAX_AGE,
            storage: jetstream::stream::StorageType::File,
            num_replicas: replicas.max(1),
            ..Default::default()
        };
        let store = crate::buckets::open_or_create(js, config)
            .await
            .map_err(|e| PositionsError::transport("creating the bucket", e))?;
        Ok(Self { store })
    }

    /// [`Positions::open`] (one replica if it must be created) for a reader that
    /// runs without it: `None`, with a warning naming `who`, when the bucket
    /// cannot be opened. Purges then do not wait for that reader, which seeds from
    /// a snapshot when it is left behind.
    pub async fn open_for_reader(
        js: &jetstream::Context,
        cluster: &ClusterId,
        who: &str,
    ) -> Option<Self> {
        match Self::open(js, cluster, 1).await {
            Ok(positions) => Some(positions),
            Err(error) => {
                tracing::warn!(%cluster, %error, who, "no reader positions: purges will not wait for this reader");
                None
            }
        }
    }

    /// Records that `reader` (of `kind`) no longer needs `subcluster`'s stream up
    /// to `seq`.
    ///
    /// # Errors
    /// [`PositionsError::Transport`] when the write fails.
    pub async fn record(
        &self,
        subcluster: &SubclusterId,
        kind: ReaderKind,
        reader: &str,
        seq: u64,
    ) -> Result<(), PositionsError> {
        let key = format!("{subcluster}.{}.{}", kind.as_str(), key_token(reader));
        let value = ReaderPosition {
            seq,
            unix_ms: now_unix_ms(),
        };
        let bytes = rmp_serde::to_vec_named(&value)
            .map_err(|e| PositionsError::transport("encoding a position", e))?;
        self.store
            .put(key, bytes.into())
            .await
            .map_err(|e| PositionsError::transport("recording a position", e))?;
        Ok(())
    }

    /// Forgets `reader`'s position in `subcluster`'s stream (a reader that stops
    /// for good).
    ///
    /// # Errors
    /// [`PositionsError::Transport`] when the delete fails.
    pub async fn forget(
        &self,
        subcluster: &SubclusterId,
        kind: ReaderKind,
        reader: &str,
    ) -> Result<(), PositionsError> {
        let key = format!("{subcluster}.{}.{}", kind.as_str(), key_token(reader));
        self.store
            .purge(key)
            .await
            .map_err(|e| PositionsError::transport("forgetting a position", e))
    }

    /// Every position recorded for `subcluster`'s stream, fresh or not. Entries that
    /// do not decode are skipped with a warning: a foreign writer must not stop the
    /// purge for good, and a reader that is wrongly ignored only seeds later.
    ///
    /// The keys come from the stream's own per-subject state, not from a consumer
    /// over the bucket: a consumer can come back empty while a key is being
    /// written, and a purge must never take "no answer" for "no reader".
    ///
    /// # Errors
    /// [`PositionsError::Transport`] when the bucket cannot be read.
    pub async fn list(
        &self,
        subcluster: &SubclusterId,
    ) -> Result<Vec<ListedPosition>, PositionsError> {
        let prefix = format!("{}{subcluster}.", self.store.prefix);
        let mut subjects = self
            .store
            .stream
            .info_with_subjects(format!("{prefix}>"))
            .await
            .map_err(|e| PositionsError::transport("listing positions", e))?;
        let mut keys = Vec::new();
        while let Some(subject) = subjects.next().await {
            let (subject, _) =
                subject.map_err(|e| PositionsError::transport("listing positions", e))?;
            if let Some(rest) = subject.strip_prefix(&prefix) {
                keys.push(rest.to_owned());
            }
        }
        let mut listed = Vec::new();
        for rest in keys {
            let Some((kind, reader)) = rest.split_once('.') else {
                continue;
            };
            let key = format!("{subcluster}.{rest}");
            let entry = self
                .store
                .get(&key)
                .await
                .map_err(|e| PositionsError::transport("reading a position", e))?;
            // A forgotten reader leaves a purge marker and no value.
            let Some(bytes) = entry else { continue };
            match rmp_serde::from_slice::<ReaderPosition>(&bytes) {
                Ok(position) => listed.push(ListedPosition {
                    kind: ReaderKind::parse(kind),
                    reader: reader.to_owned(),
                    position,
                }),
                Err(error) => tracing::warn!(key, %error, "skipping a malformed reader position"),
            }
        }
        listed.sort_by(|a, b| a.reader.cmp(&b.reader));
        Ok(listed)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn at(seq: u64, unix_ms: u64) -> ListedPosition {
        ListedPosition {
            kind: ReaderKind::GlobalMaster,
            reader: format!("r{seq}"),
            position: ReaderPosition { seq, unix_ms },
        }
    }

    #[test]
    fn the_purge_point_is_the_snapshot_when_no_reader_is_behind_it() {
        let ttl = Duration::from_secs(60);
        assert_eq!(purge_point(100, &[], 1_000_000, ttl), 100);
        assert_eq!(purge_point(100, &[at(150, 1_000_000)], 1_000_000, ttl), 100);
    }

    #[test]
    fn a_fresh_reader_behind_the_snapshot_holds_the_purge_back() {
        let ttl = Duration::from_secs(60);
        let now = 1_000_000;
        let readers = [at(150, now), at(40, now - 59_000), at(70, now)];
        assert_eq!(purge_point(100, &readers, now, ttl), 40);
    }

    #[test]
    fn a_stale_reader_does_not_hold_the_purge_back() {
        let ttl = Duration::from_secs(60);
        let now = 1_000_000;
        assert_eq!(purge_point(100, &[at(10, now - 61_000)], now, ttl), 100);
        // A clock ahead of ours counts as fresh.
        assert_eq!(purge_point(100, &[at(10, now + 5_000)], now, ttl), 10);
    }

    #[test]
    fn reader_names_become_key_tokens() {
        assert_eq!(key_token("global-12"), "global-12");
        assert_eq!(key_token("g 1.x/y"), "g_1_x_y");
    }
}
