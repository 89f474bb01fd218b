//! What the inter-DC master replicates, where to, and how fast: key filters, the
//! labels of the sub-masters allowed on each side, the bandwidth cap, and the
//! rules that skip blocks (too old, about to be evicted at the source, evicted on
//! purpose at the target). Read from TOML; every field has a default.

use std::collections::BTreeMap;
use std::path::Path;
use std::time::Duration;

use serde::{Deserialize, Serialize};

use crate::error::InterDcError;

/// The replication policy.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct Policy {
    /// Replicate only keys starting with one of these prefixes (empty: every key).
    pub include_prefixes: Vec<String>,
    /// Never replicate keys starting with one of these prefixes.
    pub exclude_prefixes: Vec<String>,
    /// Replicate only blocks of at most this many bytes (0: no limit).
    pub max_block_bytes: u64,
    /// Hard partition of the source side: only sub-masters carrying all these
    /// labels are followed and copied from (empty: all).
    pub source_labels: BTreeMap<String, String>,
    /// Hard partition of the target side: copies are placed only in sub-clusters
    /// whose sub-masters carry all these labels (empty: all). Presence anywhere in
    /// the target pool still counts as "the target has it".
    pub target_labels: BTreeMap<String, String>,
    /// Soft partition of the target side: among allowed sub-clusters, those
    /// carrying all these labels are tried first.
    pub prefer_target_labels: BTreeMap<String, String>,
    /// Replicas of each copy in the target pool.
    pub target_replicas: u32,
    /// The WAN bandwidth cap, bytes per second on the wire (recovery shards and
    /// packet headers included).
    pub rate_bytes_per_sec: u64,
    /// Copies in flight at once (the cap is shared between them).
    pub lanes: usize,
    /// Skip blocks committed at the source longer ago than this (0: never): the
    /// source evicts oldest first, so old blocks are the next to go.
    pub max_age_secs: u64,
    /// When a source sub-cluster is fuller than this fraction of its capacity it is
    /// about to evict: its blocks older than `pressure_min_age_secs` are skipped.
    pub source_pressure: f64,
    /// See `source_pressure`.
    pub pressure_min_age_secs: u64,
    /// Copy again a block that the target held and then evicted or removed
    /// (default: no — the target evicted it on purpose).
    pub recopy_evicted: bool,
    /// Attempts per block before it is given up for this run (transient failures:
    /// an unreachable node, a full target, a lost WAN copy).
    pub max_attempts: u32,
}

impl Default for Policy {
    fn default() -> Self {
        Self {
            include_prefixes: Vec::new(),
            exclude_prefixes: Vec::new(),
            max_block_bytes: 0,
            source_labels: BTreeMap::new(),
            target_labels: BTreeMap::new(),
            prefer_target_labels: BTreeMap::new(),
            target_replicas: 1,
            rate_bytes_per_sec: 50_000_000,
            lanes: 16,
            max_age_secs: 0,
            source_pressure: 0.95,
            pressure_min_age_secs: 60,
            recopy_evicted: false,
            max_attempts: 5,
        }
    }
}

/// Why a block is not replicated (a policy decision, not a failure).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize)]
pub enum SkipReason {
    /// The key does not pass the prefix filters.
    Filtered,
    /// Larger than `max_block_bytes`.
    TooLarge,
    /// Older than `max_age_secs`.
    TooOld,
    /// Its source sub-cluster is under eviction pressure and the block is old.
    SourceAboutToEvict,
    /// The target held it and evicted or removed it.
    EvictedAtTarget,
}

impl SkipReason {
    /// A short name (metrics label, status).
    pub fn name(self) -> &'static str {
        match self {
            Self::Filtered => "filtered",
            Self::TooLarge => "too_large",
            Self::TooOld => "too_old",
            Self::SourceAboutToEvict => "source_about_to_evict",
            Self::EvictedAtTarget => "evicted_at_target",
        }
    }
}

impl Policy {
    /// Reads a policy from a TOML file.
    ///
    /// # Errors
    /// [`InterDcError::Policy`] when the file cannot be read or is invalid.
    pub fn from_file(path: &Path) -> Result<Self, InterDcError> {
        let text = std::fs::read_to_string(path).map_err(|e| InterDcError::PolicyFile {
            path: path.display().to_string(),
            source: e.into(),
        })?;
        let policy: Self = toml::from_str(&text).map_err(|e| InterDcError::PolicyFile {
            path: path.display().to_string(),
            source: e.into(),
        })?;
        policy.validate()?;
        Ok(policy)
    }

    /// Checks the values make sense.
    ///
    /// # Errors
    /// [`InterDcError::Policy`] naming the bad field.
    pub fn validate(&self) -> Result<(), InterDcError> {
        if self.rate_bytes_per_sec == 0 {
            return Err(InterDcError::Policy(
                "rate_bytes_per_sec must be > 0".into(),
            ));
        }
        if self.lanes == 0 || self.lanes > 256 {
            return Err(InterDcError::Policy("lanes must be in 1..=256".into()));
        }
        if self.target_replicas == 0 {
            return Err(InterDcError::Policy("target_replicas must be > 0".into()));
        }
        if !(0.0..=1.0).contains(&self.source_pressure) {
            return Err(InterDcError::Policy(
                "source_pressure must be a fraction in 0..=1".into(),
            ));
        }
        if self.max_attempts == 0 {
            return Err(InterDcError::Policy("max_attempts must be > 0".into()));
        }
        Ok(())
    }

    /// Whether the key passes the prefix filters.
    pub fn key_allowed(&self, key: &str) -> bool {
        let included = self.include_prefixes.is_empty()
            || self.include_prefixes.iter().any(|p| key.starts_with(p));
        included && !self.exclude_prefixes.iter().any(|p| key.starts_with(p))
    }

    /// Why a source block should not be copied now, if it should not.
    /// `age` is how long ago it was committed; `source_fill` the used fraction of
    /// the sub-cluster holding it.
    pub fn skip(
        &self,
        key: &str,
        size: u64,
        age: Duration,
        source_fill: f64,
    ) -> Option<SkipReason> {
        if !self.key_allowed(key) {
            return Some(SkipReason::Filtered);
        }
        if self.max_block_bytes > 0 && size > self.max_block_bytes {
            return Some(SkipReason::TooLarge);
        }
        if self.max_age_secs > 0 && age > Duration::from_secs(self.max_age_secs) {
            return Some(SkipReason::TooOld);
        }
        if source_fill > self.source_pressure
            && age > Duration::from_secs(self.pressure_min_age_secs)
        {
            return Some(SkipReason::SourceAboutToEvict);
        }
        None
    }

    /// Whether labels satisfy a required set (every required pair present).
    pub fn labels_match(
        required: &BTreeMap<String, String>,
        labels: &BTreeMap<String, String>,
    ) -> bool {
        required.iter().all(|(k, v)| labels.get(k) == Some(v))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn prefixes_include_then_exclude() {
        let policy = Policy {
            include_prefixes: vec!["model-a/".into()],
            exclude_prefixes: vec!["model-a/tmp/".into()],
            ..Policy::default()
        };
        assert!(policy.key_allowed("model-a/block-1"));
        assert!(!policy.key_allowed("model-a/tmp/block-1"));
        assert!(!policy.key_allowed("model-b/block-1"));
        assert!(Policy::default().key_allowed("anything"));
    }

    #[test]
    fn skip_rules_in_order() {
        let policy = Policy {
            max_block_bytes: 100,
            max_age_secs: 3600,
            source_pressure: 0.9,
            pressure_min_age_secs: 60,
            ..Policy::default()
        };
        let young = Duration::from_secs(1);
        assert_eq!(policy.skip("k", 10, young, 0.5), None);
        assert_eq!(
            policy.skip("k", 101, young, 0.5),
            Some(SkipReason::TooLarge)
        );
        assert_eq!(
            policy.skip("k", 10, Duration::from_secs(7200), 0.5),
            Some(SkipReason::TooOld)
        );
        assert_eq!(
            policy.skip("k", 10, young, 0.99),
            None,
            "young blocks survive pressure"
        );
        assert_eq!(
            policy.skip("k", 10, Duration::from_secs(120), 0.99),
            Some(SkipReason::SourceAboutToEvict)
        );
    }

    #[test]
    fn toml_round_trip_and_validation() {
        let text = r#"
            include_prefixes = ["p/"]
            rate_bytes_per_sec = 1000000
            lanes = 2
            [target_labels]
            pool = "decode"
        "#;
        let policy: Policy = toml::from_str(text).unwrap();
        policy.validate().unwrap();
        assert_eq!(policy.lanes, 2);
        assert_eq!(
            policy.target_labels.get("pool").map(String::as_str),
            Some("decode")
        );
        assert!(toml::from_str::<Policy>("no_such_field = 1").is_err());
        let bad = Policy {
            lanes: 0,
            ..Policy::default()
        };
        assert!(matches!(bad.validate(), Err(InterDcError::Policy(_))));
    }

    #[test]
    fn label_matching() {
        let mut labels = BTreeMap::new();
        labels.insert("pool".to_owned(), "decode".to_owned());
        labels.insert("zone".to_owned(), "b".to_owned());
        let mut required = BTreeMap::new();
        assert!(Policy::labels_match(&required, &labels));
        required.insert("pool".to_owned(), "decode".to_owned());
        assert!(Policy::labels_match(&required, &labels));
        required.insert("zone".to_owned(), "a".to_owned());
        assert!(!Policy::labels_match(&required, &labels));
    }
}
