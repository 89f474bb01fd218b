//! The query logic over a projection and the registry, without I/O: which sources
//! a label filter allows and how it ranks them, `batch_is_exist`, `prefix_hit`,
//! `locate`, and routing for the proxied `get_replica_list`.

use std::collections::BTreeMap;

use hkvm_events::rpc::global::{
    BatchIsExistReply, LabelFilter, LabelMode, Owner, PrefixLength, Staleness, MAX_BATCH_KEYS,
    MAX_PREFIX_KEYS,
};
use hkvm_events::rpc::RpcError;
use hkvm_events::{key_hash, Limits, SubclusterId};
use hkvm_log::registry::Registered;
use hkvm_projector::index::OVERFLOW_BIT;
use hkvm_projector::Projection;

/// How one source looks to a query.
#[derive(Debug, Clone)]
pub struct SourceView {
    /// Its sub-cluster (none for an unnamed slot).
    pub subcluster: Option<SubclusterId>,
    /// Whether the filter lets it answer.
    pub allowed: bool,
    /// Whether its labels match the filter (ranked first under soft labels).
    pub preferred: bool,
}

/// The views of every source under `filter`.
pub fn views(
    projection: &Projection,
    registry: &BTreeMap<SubclusterId, Registered>,
    filter: Option<&LabelFilter>,
) -> Vec<SourceView> {
    projection
        .sources()
        .iter()
        .map(|state| {
            let labels = state
                .subcluster
                .as_ref()
                .and_then(|sc| registry.get(sc))
                .map(|r| &r.info.labels);
            let matches = match (filter, labels) {
                (None, _) => true,
                (Some(filter), Some(labels)) => filter.matches(labels),
                (Some(filter), None) => filter.labels.is_empty(),
            };
            let hard = filter.is_some_and(|f| f.mode == LabelMode::Hard);
            SourceView {
                subcluster: state.subcluster.clone(),
                allowed: state.subcluster.is_some() && (matches || !hard),
                preferred: matches,
            }
        })
        .collect()
}

/// Checks a batch of keys against the limits.
///
/// # Errors
/// `InvalidRequest` naming the first problem.
pub fn check_keys(keys: &[impl AsRef<str>], max: usize) -> Result<(), RpcError> {
    if keys.len() > max {
        return Err(RpcError::invalid(format!(
            "{} keys, more than the limit of {max}",
            keys.len()
        )));
    }
    let limits = Limits::default();
    for (index, key) in keys.iter().enumerate() {
        limits
            .check_key(key.as_ref())
            .map_err(|e| RpcError::invalid(format!("key {index}: {e}")))?;
    }
    Ok(())
}

/// The allowed holders of `hash`, preferred sources first (stable by index).
pub fn ranked_holders(projection: &Projection, views: &[SourceView], hash: u64) -> Vec<usize> {
    let holders = projection.index().holders(hash);
    if holders.is_empty() {
        return Vec::new();
    }
    let mut out: Vec<usize> = holders
        .iter()
        .filter(|&s| views.get(s).is_some_and(|v| v.allowed))
        .collect();
    if out.len() > 1 {
        out.sort_by_key(|&s| !views[s].preferred);
    }
    out
}

/// `batch_is_exist`: per key, the sources holding it.
///
/// # Errors
/// `InvalidRequest` for too many keys or a bad key.
pub fn batch_is_exist(
    projection: &Projection,
    views: &[SourceView],
    keys: &[impl AsRef<str>],
    staleness: Staleness,
) -> Result<BatchIsExistReply, RpcError> {
    check_keys(keys, MAX_BATCH_KEYS)?;
    let hashes: Vec<u64> = keys.iter().map(|key| key_hash(key.as_ref())).collect();
    batch_is_exist_hashed(projection, views, &hashes, staleness)
}

/// `batch_is_exist_hashed`: per key hash, the sources holding its key.
///
/// # Errors
/// `InvalidRequest` for more than [`MAX_BATCH_KEYS`] hashes.
pub fn batch_is_exist_hashed(
    projection: &Projection,
    views: &[SourceView],
    hashes: &[u64],
    staleness: Staleness,
) -> Result<BatchIsExistReply, RpcError> {
    if hashes.len() > MAX_BATCH_KEYS {
        return Err(RpcError::invalid(format!(
            "{} keys, more than the limit of {MAX_BATCH_KEYS}",
            hashes.len()
        )));
    }
    // The reply names only the sources allowed to answer; `slot` maps a source
    // index to its position in that list.
    let mut subclusters = Vec::new();
    let mut slot = vec![None; views.len()];
    for (source, view) in views.iter().enumerate() {
        if let (true, Some(subcluster)) = (view.allowed, &view.subcluster) {
            slot[source] = u16::try_from(subclusters.len()).ok();
            subclusters.push(subcluster.clone());
        }
    }
    // The same for the sources below the overflow bit, as bit sets, so that a
    // key none of the others holds is answered from its mask alone.
    let (mut preferred_low, mut other_low) = (0u32, 0u32);
    for (source, view) in views.iter().enumerate().take(OVERFLOW_BIT) {
        if slot[source].is_some() {
            if view.preferred {
                preferred_low |= 1 << source;
            } else {
                other_low |= 1 << source;
            }
        }
    }
    let mut counts = Vec::with_capacity(hashes.len());
    let mut flat = Vec::with_capacity(hashes.len());
    let mut found = Vec::with_capacity(hashes.len());
    projection.index().holders_many(hashes, &mut found);
    for holders in found {
        let before = flat.len();
        match holders.low_mask() {
            Some(0) => {}
            Some(mask) => {
                // Preferred sources first, each group in source order.
                for mut bits in [mask & preferred_low, mask & other_low] {
                    while bits != 0 {
                        let source = bits.trailing_zeros() as usize;
                        bits &= bits - 1;
                        flat.extend(slot[source]);
                    }
                }
            }
            None => {
                for preferred in [true, false] {
                    flat.extend(
                        holders
                            .iter()
                            .filter(|&s| views.get(s).is_some_and(|v| v.preferred == preferred))
                            .filter_map(|s| slot.get(s).copied().flatten()),
                    );
                }
            }
        }
        counts.push(u16::try_from(flat.len() - before).unwrap_or(u16::MAX));
    }
    Ok(BatchIsExistReply {
        subclusters,
        counts: counts.into(),
        holders: flat.into(),
        staleness,
    })
}

/// `prefix_hit`: per allowed source, how many leading keys it holds; sources with
/// none are left out; longest first, preferred first among equals.
///
/// # Errors
/// `InvalidRequest` for more than [`MAX_PREFIX_KEYS`] keys or a bad key.
pub fn prefix_hit(
    projection: &Projection,
    views: &[SourceView],
    keys: &[String],
) -> Result<Vec<PrefixLength>, RpcError> {
    check_keys(keys, MAX_PREFIX_KEYS)?;
    let mut hits = vec![0u32; views.len()];
    let mut open: Vec<usize> = (0..views.len()).filter(|&s| views[s].allowed).collect();
    for key in keys {
        if open.is_empty() {
            break;
        }
        let holders = projection.index().holders(key_hash(key));
        open.retain(|&s| {
            let held = holders.contains(s);
            if held {
                hits[s] += 1;
            }
            held
        });
    }
    let mut prefixes: Vec<(usize, u32)> = hits
        .iter()
        .enumerate()
        .filter(|&(_, &h)| h > 0)
        .map(|(s, &h)| (s, h))
        .collect();
    prefixes.sort_by_key(|&(s, h)| (!views[s].preferred, std::cmp::Reverse(h), s));
    Ok(prefixes
        .into_iter()
        .filter_map(|(s, hits)| {
            Some(PrefixLength {
                subcluster: views[s].subcluster.clone()?,
                hits,
            })
        })
        .collect())
}

/// The owner record of a source, from the registry.
pub fn owner(
    cluster: &hkvm_events::ClusterId,
    subcluster: &SubclusterId,
    registry: &BTreeMap<SubclusterId, Registered>,
) -> Owner {
    match registry.get(subcluster) {
        Some(registered) => Owner {
            subcluster: subcluster.clone(),
            submaster: Some(registered.info.id.clone()),
            rpc_prefix: registered.info.rpc_prefix.clone(),
            labels: registered.info.labels.clone(),
            alive: registered.alive,
        },
        None => Owner {
            subcluster: subcluster.clone(),
            submaster: None,
            rpc_prefix: format!("hkvm.{cluster}.{subcluster}.rpc"),
            labels: BTreeMap::new(),
            alive: false,
        },
    }
}

/// `locate`: per key, its owners in rank order.
///
/// # Errors
/// `InvalidRequest` for too many keys or a bad key.
pub fn locate(
    cluster: &hkvm_events::ClusterId,
    projection: &Projection,
    views: &[SourceView],
    registry: &BTreeMap<SubclusterId, Registered>,
    keys: &[String],
) -> Result<Vec<Vec<Owner>>, RpcError> {
    check_keys(keys, MAX_BATCH_KEYS)?;
    Ok(keys
        .iter()
        .map(|key| {
            ranked_holders(projection, views, key_hash(key))
                .into_iter()
                .filter_map(|s| views[s].subcluster.as_ref())
                .map(|sc| owner(cluster, sc, registry))
                .collect()
        })
        .collect())
}

/// Routing of a proxied `get_replica_list`: per key, the sub-cluster to ask (the
/// best-ranked holder whose sub-master is alive, else the best-ranked holder).
///
/// # Errors
/// `InvalidRequest` for too many keys or a bad key.
pub fn route(
    projection: &Projection,
    views: &[SourceView],
    registry: &BTreeMap<SubclusterId, Registered>,
    keys: &[String],
) -> Result<Vec<Option<SubclusterId>>, RpcError> {
    check_keys(keys, MAX_BATCH_KEYS)?;
    Ok(keys
        .iter()
        .map(|key| {
            let ranked: Vec<&SubclusterId> = ranked_holders(projection, views, key_hash(key))
                .into_iter()
                .filter_map(|s| views[s].subcluster.as_ref())
                .collect();
            ranked
                .iter()
                .find(|sc| registry.get(**sc).is_some_and(|r| r.alive))
                .or(ranked.first())
                .map(|sc| (*sc).clone())
        })
        .collect())
}

#[cfg(test)]
mod tests {
    use std::collections::BTreeMap;

    use hkvm_events::registry::SubmasterInfo;
    use hkvm_events::rpc::global::{LabelFilter, LabelMode};
    use hkvm_events::{
        ClusterId, KvEvent, Placement, ProducerId, PutCommitted, SegmentId, SubclusterId,
    };
    use hkvm_log::registry::Registered;
    use hkvm_projector::Projection;

    use super::*;

    fn sc(name: &str) -> SubclusterId {
        SubclusterId::new(name).unwrap()
    }

    fn put(key: &str) -> KvEvent {
        KvEvent::PutCommitted(PutCommitted::new(
            key,
            1,
            0,
            vec![Placement {
                segment: SegmentId::new("g").unwrap(),
                offset: 0,
            }],
        ))
    }

    fn registered(name: &str, pool: &str, alive: bool) -> (SubclusterId, Registered) {
        let info = SubmasterInfo {
            id: ProducerId::new(format!("sm-{name}")).unwrap(),
            cluster: ClusterId::new("c").unwrap(),
            subcluster: sc(name),
            rpc_prefix: format!("hkvm.c.{name}.rpc"),
            labels: BTreeMap::from([("pool".to_owned(), pool.to_owned())]),
            capacity_bytes: 0,
            used_bytes: 0,
            objects: 0,
            epoch: 1,
            stream: String::new(),
            last_seq: 0,
            unix_ms: 0,
        };
        (
            sc(name),
            Registered {
                info,
                alive,
                age_ms: 0,
            },
        )
    }

    /// a (pool x, alive), b (pool y, alive), c (pool y, dead), d (unregistered).
    fn fixture() -> (Projection, BTreeMap<SubclusterId, Registered>) {
        let mut projection = Projection::new();
        let sources: Vec<usize> = ["a", "b", "c", "d"]
            .iter()
            .map(|name| projection.source_index(&sc(name), "s"))
            .collect();
        for key in ["k0", "k1", "k2"] {
            projection.apply(sources[0], &put(key));
        }
        for key in ["k0", "k1"] {
            projection.apply(sources[1], &put(key));
        }
        projection.apply(sources[2], &put("k0"));
        projection.apply(sources[3], &put("k0"));
        let registry = BTreeMap::from([
            registered("a", "x", true),
            registered("b", "y", true),
            registered("c", "y", false),
        ]);
        (projection, registry)
    }

    fn filter(mode: LabelMode) -> LabelFilter {
        LabelFilter {
            labels: BTreeMap::from([("pool".to_owned(), "y".to_owned())]),
            mode,
        }
    }

    fn names(list: Vec<&SubclusterId>) -> Vec<&str> {
        list.into_iter().map(SubclusterId::as_str).collect()
    }

    proptest::proptest! {
        /// The batch answer (from masks, or source by source past the overflow
        /// bit) lists each key's holders as the one-key ranking does.
        #[test]
        fn batch_answers_rank_holders_as_one_key_lookups_do(
            held in proptest::collection::vec(proptest::collection::vec(0usize..40, 0..6), 1..24),
            rules in proptest::collection::vec((proptest::bool::ANY, proptest::bool::ANY), 40),
        ) {
            let mut projection = Projection::new();
            let names: Vec<SubclusterId> = (0..40).map(|s| sc(&format!("s{s:02}"))).collect();
            for name in &names {
                projection.source_index(name, "s");
            }
            let keys: Vec<String> = (0..held.len()).map(|k| format!("key-{k}")).collect();
            for (key, sources) in keys.iter().zip(&held) {
                for &source in sources {
                    projection.apply(source, &put(key));
                }
            }
            let views: Vec<SourceView> = names
                .iter()
                .zip(&rules)
                .map(|(name, &(allowed, preferred))| SourceView {
                    subcluster: Some(name.clone()),
                    allowed,
                    preferred,
                })
                .collect();
            let reply = batch_is_exist(&projection, &views, &keys, Staleness::default()).unwrap();
            for (index, key) in keys.iter().enumerate() {
                let expected: Vec<&SubclusterId> = ranked_holders(&projection, &views, key_hash(key))
                    .into_iter()
                    .map(|s| &names[s])
                    .collect();
                proptest::prop_assert_eq!(reply.holders_of(index), expected);
            }
        }
    }

    #[test]
    fn soft_labels_rank_and_hard_labels_restrict() {
        let (projection, registry) = fixture();
        let keys = ["k0", "k2", "none"];
        let soft = views(&projection, &registry, Some(&filter(LabelMode::Soft)));
        let reply = batch_is_exist(&projection, &soft, &keys, Staleness::default()).unwrap();
        assert_eq!(names(reply.holders_of(0)), vec!["b", "c", "a", "d"]);
        assert_eq!(names(reply.holders_of(1)), vec!["a"]);
        assert!(reply.holders_of(2).is_empty());
        let hard = views(&projection, &registry, Some(&filter(LabelMode::Hard)));
        let reply = batch_is_exist(&projection, &hard, &keys, Staleness::default()).unwrap();
        assert_eq!(names(reply.holders_of(0)), vec!["b", "c"]);
        assert!(reply.holders_of(1).is_empty());
        assert_eq!(reply.subclusters.len(), 2);
    }

    #[test]
    fn prefixes_stop_at_the_first_miss_and_rank_longest_first() {
        let (projection, registry) = fixture();
        let all = views(&projection, &registry, None);
        let keys = ["k0", "k1", "k2", "k3"].map(String::from);
        let prefixes: Vec<(String, u32)> = prefix_hit(&projection, &all, &keys)
            .unwrap()
            .into_iter()
            .map(|p| (p.subcluster.to_string(), p.hits))
            .collect();
        assert_eq!(
            prefixes,
            vec![
                ("a".into(), 3),
                ("b".into(), 2),
                ("c".into(), 1),
                ("d".into(), 1)
            ]
        );
        let soft = views(&projection, &registry, Some(&filter(LabelMode::Soft)));
        let first = &prefix_hit(&projection, &soft, &keys).unwrap()[0];
        assert_eq!((first.subcluster.as_str(), first.hits), ("b", 2));
        let too_many: Vec<String> = (0..=MAX_PREFIX_KEYS).map(|i| format!("k{i}")).collect();
        assert!(prefix_hit(&projection, &soft, &too_many).is_err());
    }

    #[test]
    fn routing_prefers_a_live_owner_and_locate_says_who_is_dead() {
        let (projection, registry) = fixture();
        let soft = views(&projection, &registry, Some(&filter(LabelMode::Soft)));
        let keys = ["k0", "k2", "none"].map(String::from);
        let routes = route(&projection, &soft, &registry, &keys).unwrap();
        assert_eq!(routes, vec![Some(sc("b")), Some(sc("a")), None]);
        let cluster = ClusterId::new("c").unwrap();
        let owners = locate(&cluster, &projection, &soft, &registry, &keys).unwrap();
        let k0: Vec<(&str, bool)> = owners[0]
            .iter()
            .map(|o| (o.subcluster.as_str(), o.alive))
            .collect();
        assert_eq!(
            k0,
            vec![("b", true), ("c", false), ("a", true), ("d", false)]
        );
        assert_eq!(owners[0][3].rpc_prefix, "hkvm.c.d.rpc");
        assert!(owners[2].is_empty());
        assert!(check_keys(&[String::new()], 10).is_err());
    }
}
