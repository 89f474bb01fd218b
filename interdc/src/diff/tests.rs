//! Unit and property tests of the pure diff.

use hkvm_events::{Evicted, Placement, PutCommitted, PutFlags, Removed, SegmentId};
use proptest::prelude::*;

use super::*;

fn put(key: &str, size: u64) -> KvEvent {
    KvEvent::PutCommitted(PutCommitted {
        key: key.to_owned(),
        key_hash: key_hash(key),
        size,
        checksum: size * 7,
        placements: vec![Placement {
            segment: SegmentId::new("seg").unwrap(),
            offset: 0,
        }],
        flags: PutFlags::default(),
        put_id: 0,
    })
}

fn evicted(key: &str) -> KvEvent {
    KvEvent::Evicted(Evicted {
        keys: vec![key.to_owned()],
    })
}

fn removed(key: &str) -> KvEvent {
    KvEvent::Removed(Removed {
        keys: vec![key.to_owned()],
    })
}

fn sc(name: &str) -> SubclusterId {
    SubclusterId::new(name).unwrap()
}

fn keys(backlog: &Backlog) -> Vec<&str> {
    backlog.next.iter().map(|c| c.block.key.as_str()).collect()
}

fn sorted(backlog: &Backlog) -> Vec<&str> {
    let mut keys = keys(backlog);
    keys.sort_unstable();
    keys
}

#[test]
fn backlog_is_source_minus_target_newest_first() {
    let mut diff = Diff::new();
    let a = diff.slot(Side::Source, &sc("a"));
    let b = diff.slot(Side::Source, &sc("b"));
    let t = diff.slot(Side::Target, &sc("a"));
    assert_ne!(a, t, "the same sub-cluster name on both sides is two slots");
    diff.apply(a, 100, &put("k1", 10));
    diff.apply(b, 200, &put("k2", 20));
    diff.apply(a, 300, &put("k3", 30));
    diff.apply(t, 400, &put("k2", 20));
    diff.apply(t, 400, &put("only-target", 5));
    let backlog = diff.backlog(&Policy::default(), 1000, 10);
    assert_eq!(keys(&backlog), ["k3", "k1"]);
    assert_eq!((backlog.keys, backlog.bytes), (2, 40));
    assert_eq!(backlog.next[0].subcluster, sc("a"));
    assert_eq!(keys(&diff.backlog(&Policy::default(), 1000, 1)), ["k3"]);
}

#[test]
fn a_block_evicted_at_the_source_leaves_the_backlog() {
    let mut diff = Diff::new();
    let a = diff.slot(Side::Source, &sc("a"));
    let b = diff.slot(Side::Source, &sc("b"));
    diff.slot(Side::Target, &sc("x"));
    diff.apply(a, 1, &put("k", 1));
    diff.apply(b, 1, &put("k", 1));
    diff.apply(a, 2, &evicted("k"));
    assert_eq!(
        keys(&diff.backlog(&Policy::default(), 10, 10)),
        ["k"],
        "b still has it"
    );
    assert_eq!(
        diff.backlog(&Policy::default(), 10, 10).next[0].subcluster,
        sc("b")
    );
    diff.apply(b, 3, &removed("k"));
    assert!(diff.backlog(&Policy::default(), 10, 10).next.is_empty());
    assert!(diff.source_block("k").is_none());
}

#[test]
fn blocks_evicted_at_the_target_are_not_copied_again_unless_asked() {
    let mut diff = Diff::new();
    let s = diff.slot(Side::Source, &sc("s"));
    let t = diff.slot(Side::Target, &sc("t"));
    diff.apply(s, 1, &put("k", 1));
    diff.apply(t, 2, &put("k", 1));
    diff.apply(t, 3, &evicted("k"));
    let backlog = diff.backlog(&Policy::default(), 10, 10);
    assert!(backlog.next.is_empty());
    assert_eq!(backlog.skipped.get("evicted_at_target"), Some(&1));
    let recopy = Policy {
        recopy_evicted: true,
        ..Policy::default()
    };
    assert_eq!(keys(&diff.backlog(&recopy, 10, 10)), ["k"]);
}

#[test]
fn copied_in_flight_and_given_up_blocks_are_not_offered() {
    let mut diff = Diff::new();
    let s = diff.slot(Side::Source, &sc("s"));
    diff.slot(Side::Target, &sc("t"));
    for key in ["a", "b", "c", "d"] {
        diff.apply(s, 1, &put(key, 1));
    }
    diff.mark_copied(key_hash("a"));
    diff.mark_in_flight(key_hash("b"));
    assert_eq!(diff.mark_failed(key_hash("c"), 2, 20), (1, false));
    assert_eq!(
        keys(&diff.backlog(&Policy::default(), 10, 10)),
        ["d"],
        "c waits"
    );
    assert_eq!(
        sorted(&diff.backlog(&Policy::default(), 20, 10)),
        ["c", "d"]
    );
    assert_eq!(diff.mark_failed(key_hash("c"), 2, 30), (2, true));
    let backlog = diff.backlog(&Policy::default(), 10, 10);
    assert_eq!(keys(&backlog), ["d"]);
    assert_eq!(backlog.in_flight, 1);
    diff.mark_settled(key_hash("b"), 15);
    assert_eq!(
        diff.backlog(&Policy::default(), 10, 10).keys,
        2,
        "b waits, d ready"
    );
    assert_eq!(
        sorted(&diff.backlog(&Policy::default(), 15, 10)),
        ["b", "d"]
    );
    assert_eq!(diff.given_up_count(), 1);
}

#[test]
fn policy_filters_are_counted() {
    let mut diff = Diff::new();
    let s = diff.slot(Side::Source, &sc("s"));
    diff.slot(Side::Target, &sc("t"));
    diff.apply(s, 1_000, &put("keep/1", 1));
    diff.apply(s, 1_000, &put("drop/1", 1));
    diff.apply(s, 1_000, &put("keep/big", 1000));
    diff.set_fill(s, 0.99);
    let policy = Policy {
        include_prefixes: vec!["keep/".into()],
        max_block_bytes: 100,
        ..Policy::default()
    };
    let backlog = diff.backlog(&policy, 2_000, 10);
    assert_eq!(
        keys(&backlog),
        ["keep/1"],
        "young blocks pass even under pressure"
    );
    assert_eq!(backlog.skipped.get("filtered"), Some(&1));
    assert_eq!(backlog.skipped.get("too_large"), Some(&1));
    let later = diff.backlog(&policy, 1_000 + 61_000, 10);
    assert_eq!(later.skipped.get("source_about_to_evict"), Some(&1));
}

#[test]
fn messages_fold_in_order_and_gaps_are_refused() {
    let mut diff = Diff::new();
    let s = diff.slot(Side::Source, &sc("s"));
    let message = |seq: u64, events: Vec<KvEvent>| Decoded {
        seq,
        unix_ms: seq * 10,
        events,
        skipped: 0,
    };
    diff.apply_decoded(s, &message(1, vec![put("a", 1)]))
        .unwrap();
    diff.apply_decoded(s, &message(1, vec![put("b", 1)]))
        .unwrap();
    assert!(!diff.source_has("b"), "a replayed message is ignored");
    let gap = diff.apply_decoded(s, &message(3, vec![put("c", 1)]));
    assert_eq!(gap.unwrap_err().expected, 2);
    diff.reset_slot(s);
    assert!(!diff.source_has("a"));
    assert_eq!(diff.slots()[s].applied_seq, 0);
}

#[test]
fn a_slot_seeded_from_a_snapshot_reads_on_after_it() {
    let mut diff = Diff::new();
    let s = diff.slot(Side::Source, &sc("s"));
    let t = diff.slot(Side::Target, &sc("t"));
    let block = |key: &str| {
        (
            key_hash(key),
            SourceBlock {
                key: key.to_owned(),
                size: 3,
                checksum: 9,
                committed_unix_ms: 5,
            },
        )
    };
    diff.apply(s, 1, &put("gone-after-seed", 1));
    diff.seed_slot(s, 40, 5, [block("a"), block("b")]);
    diff.seed_slot(t, 7, 5, [block("b")]);
    assert!(
        !diff.source_has("gone-after-seed"),
        "seeding replaces the slot"
    );
    assert_eq!(diff.slots()[s].applied_seq, 40);
    assert_eq!(keys(&diff.backlog(&Policy::default(), 10, 10)), ["a"]);
    let next = Decoded {
        seq: 41,
        unix_ms: 6,
        events: vec![removed("a")],
        skipped: 0,
    };
    diff.apply_decoded(s, &next).unwrap();
    assert!(diff.backlog(&Policy::default(), 10, 10).next.is_empty());
}

#[derive(Debug, Clone)]
enum Op {
    Put(bool, u8),
    Evict(bool, u8),
}

fn op() -> impl Strategy<Value = Op> {
    prop_oneof![
        (any::<bool>(), 0u8..16).prop_map(|(s, k)| Op::Put(s, k)),
        (any::<bool>(), 0u8..16).prop_map(|(s, k)| Op::Evict(s, k)),
    ]
}

proptest! {
    /// The backlog is exactly the keys the source holds and the target never
    /// held (a model of sets folded by hand), whatever the interleaving.
    #[test]
    fn backlog_matches_a_set_model(ops in proptest::collection::vec(op(), 0..200)) {
        let mut diff = Diff::new();
        let s = diff.slot(Side::Source, &sc("s"));
        let t = diff.slot(Side::Target, &sc("t"));
        let mut source = std::collections::BTreeSet::new();
        let mut target = std::collections::BTreeSet::new();
        let mut evicted_at_target = std::collections::BTreeSet::new();
        for (i, op) in ops.iter().enumerate() {
            match op {
                Op::Put(true, k) => { diff.apply(s, i as u64, &put(&format!("k{k}"), 1)); source.insert(*k); }
                Op::Put(false, k) => {
                    diff.apply(t, i as u64, &put(&format!("k{k}"), 1));
                    target.insert(*k);
                    evicted_at_target.remove(k);
                }
                Op::Evict(true, k) => { diff.apply(s, i as u64, &evicted(&format!("k{k}"))); source.remove(k); }
                Op::Evict(false, k) => {
                    diff.apply(t, i as u64, &evicted(&format!("k{k}")));
                    if target.remove(k) { evicted_at_target.insert(*k); }
                }
            }
        }
        let mut expected: Vec<String> = source
            .iter()
            .filter(|k| !target.contains(k) && !evicted_at_target.contains(k))
            .map(|k| format!("k{k}"))
            .collect();
        expected.sort();
        let backlog = diff.backlog(&Policy::default(), 1 << 40, usize::MAX);
        let mut got: Vec<String> = backlog.next.iter().map(|c| c.block.key.clone()).collect();
        got.sort();
        prop_assert_eq!(got, expected);
        prop_assert_eq!(backlog.keys as usize, backlog.next.len());
    }
}
