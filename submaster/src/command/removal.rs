//! Removing every object, or every object whose key matches a pattern, a slice
//! of the object table at a time ([`RemoveSlice`]): the server runs one slice
//! per command, so requests queued meanwhile are served between two slices
//! instead of waiting for a scan of the whole table.

use std::sync::Arc;

use hkvm_events::rpc::submaster::{RemoveAll, RemoveAllReply, RemoveMatching, MAX_KEY_PATTERN_LEN};
use hkvm_events::rpc::RpcError;
use hkvm_events::tenant::{self, check_tenant};
use hkvm_events::{KvEvent, Removed};
use serde::{Deserialize, Serialize};

use super::objects::is_leased;
use super::{chunked, Outcome, Reply};
use crate::state::State;

/// Which keys a mass removal takes.
#[derive(Debug, Clone)]
pub enum KeyMatcher {
    /// Every key.
    All,
    /// Keys the pattern matches.
    Pattern(regex::Regex),
    /// Keys of a tenant whose name within the tenant the pattern matches.
    TenantPattern {
        /// The tenant (`"default"`: keys of no other tenant).
        tenant: String,
        /// The pattern, matched against the key the tenant calls it by.
        pattern: regex::Regex,
    },
}

impl KeyMatcher {
    /// The matcher of a `remove_matching` request.
    ///
    /// # Errors
    /// `InvalidRequest` for a pattern that is too long or does not compile, or
    /// an invalid tenant.
    pub fn of_matching(matching: &RemoveMatching) -> Result<Self, RpcError> {
        if matching.pattern.len() > MAX_KEY_PATTERN_LEN {
            return Err(RpcError::invalid(format!(
                "key pattern of {} bytes exceeds {MAX_KEY_PATTERN_LEN}",
                matching.pattern.len()
            )));
        }
        let pattern = regex::RegexBuilder::new(&matching.pattern)
            // Bounds the compiled automaton: a hostile pattern is refused, not
            // compiled into gigabytes.
            .size_limit(1 << 20)
            .build()
            .map_err(|e| RpcError::invalid(format!("key pattern: {e}")))?;
        Ok(match &matching.tenant {
            Some(tenant) => {
                check_tenant(tenant)
                    .map_err(|e| RpcError::invalid(format!("tenant {tenant:?}: {e}")))?;
                Self::TenantPattern {
                    tenant: tenant.clone(),
                    pattern,
                }
            }
            None => Self::Pattern(pattern),
        })
    }

    /// Whether the removal takes `key`.
    pub fn wants(&self, key: &str) -> bool {
        match self {
            Self::All => true,
            Self::Pattern(pattern) => pattern.is_match(key),
            Self::TenantPattern { tenant, pattern } => {
                tenant::key_of(tenant, key).is_some_and(|key| pattern.is_match(key))
            }
        }
    }
}

/// One step of a mass removal: the objects of one slice of the table
/// ([`State::objects_in_slice`]) that the matcher wants.
#[derive(Debug, Clone)]
pub struct RemoveSlice {
    /// Which keys.
    pub matcher: Arc<KeyMatcher>,
    /// Remove leased objects too.
    pub force: bool,
    /// The slice.
    pub slice: usize,
}

impl RemoveSlice {
    /// The first slice of `remove_all`.
    pub fn of_all(remove_all: &RemoveAll) -> Self {
        Self {
            matcher: Arc::new(KeyMatcher::All),
            force: remove_all.force,
            slice: 0,
        }
    }

    /// The first slice of `remove_matching`.
    ///
    /// # Errors
    /// As [`KeyMatcher::of_matching`].
    pub fn of_matching(matching: &RemoveMatching) -> Result<Self, RpcError> {
        Ok(Self {
            matcher: Arc::new(KeyMatcher::of_matching(matching)?),
            force: matching.force,
            slice: 0,
        })
    }
}

/// What one slice removed, and the slice to take next (none: the scan is done).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub struct RemovedSlice {
    /// Objects removed in this slice.
    pub removed: u64,
    /// The next slice, if any is left.
    pub next: Option<usize>,
}

/// The keys of one slice the request wants (leased ones only with `force`),
/// and the next slice.
fn slice_keys(state: &State, step: &RemoveSlice, now_ms: u64) -> (Vec<String>, Option<usize>) {
    let keys = state
        .objects_in_slice(step.slice)
        .filter(|(key, _)| step.matcher.wants(key))
        .filter(|(_, object)| step.force || !is_leased(state, object.lease_until_ms, now_ms))
        .map(|(key, _)| key.to_owned())
        .collect();
    let next = Some(step.slice + 1).filter(|&next| next < state.object_slices());
    (keys, next)
}

/// Removes the objects of one slice the request wants.
pub(super) fn remove_slice(state: &State, step: &RemoveSlice, now_ms: u64) -> Outcome {
    let (keys, next) = slice_keys(state, step, now_ms);
    Outcome {
        reply: Reply::RemovedSlice(RemovedSlice {
            removed: keys.len() as u64,
            next,
        }),
        events: chunked(keys, |keys| KvEvent::Removed(Removed { keys })),
    }
}

/// The whole removal in one command (every slice in turn): what a caller of
/// [`super::handle`] gets for `remove_all` and `remove_matching`. The server
/// instead runs [`remove_slice`] once per command.
pub(super) fn remove_whole(state: &State, mut step: RemoveSlice, now_ms: u64) -> Outcome {
    let mut keys = Vec::new();
    loop {
        let (slice, next) = slice_keys(state, &step, now_ms);
        keys.extend(slice);
        match next {
            Some(next) => step.slice = next,
            None => break,
        }
    }
    Outcome {
        reply: Reply::RemoveAll(RemoveAllReply {
            removed: keys.len() as u64,
        }),
        events: chunked(keys, |keys| KvEvent::Removed(Removed { keys })),
    }
}
