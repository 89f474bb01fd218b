//! The key index's tests; the source writer is checked against single inserts
//! and removes.

use proptest::prelude::*;

use super::*;

/// One step: a source and its operations, `(insert?, hash)`.
fn runs() -> impl Strategy<Value = Vec<(usize, Vec<(bool, u64)>)>> {
    // Few hashes, so keys are shared, dropped and their ids reused; sources
    // on both sides of the overflow bit.
    let op = (prop::bool::weighted(0.7), 0..48u64);
    let source = prop_oneof![0..4usize, 30..34usize];
    prop::collection::vec((source, prop::collection::vec(op, 0..24)), 0..24)
}

proptest! {
    #[test]
    fn a_writer_does_what_single_inserts_and_removes_do(runs in runs()) {
        let (mut single, mut written) = (KeyIndex::new(), KeyIndex::new());
        for (source, ops) in &runs {
            let mut writer = written.writer(*source);
            for &(insert, hash) in ops {
                let (expected, found) = if insert {
                    (single.insert(*source, hash), writer.insert(hash))
                } else {
                    (single.remove(*source, hash), writer.remove(hash))
                };
                prop_assert_eq!(expected, found, "source {} hash {}", source, hash);
            }
        }
        prop_assert_eq!(single.len(), written.len());
        prop_assert_eq!(single.parts().0, written.parts().0);
        prop_assert_eq!(single.parts().1, written.parts().1);
        prop_assert_eq!(single.parts().3, written.parts().3);
        for hash in 0..48 {
            let holders: Vec<usize> = written.holders(hash).iter().collect();
            prop_assert_eq!(single.holders(hash).iter().collect::<Vec<_>>(), holders);
        }
    }
}

#[test]
fn a_writer_appends_new_ids_and_inserts_older_ones() {
    let mut index = KeyIndex::new();
    // Ids 0..100 go to source 1; source 0 then gets some of them (older
    // than its largest id) and new ones, in one writer.
    for hash in 0..100 {
        index.insert(1, hash);
    }
    index.insert(0, 50);
    let mut writer = index.writer(0);
    for hash in [10, 200, 201, 20, 202] {
        assert!(writer.insert(hash));
    }
    assert!(!writer.insert(200));
    drop(writer);
    let ids: Vec<u32> = index.source_ids(0).unwrap().iter().collect();
    assert_eq!(ids, vec![10, 20, 50, 100, 101, 102]);
    assert_eq!(index.source_len(0), 6);
}

#[test]
fn shrinking_a_reserved_index_keeps_every_key() {
    let mut index = KeyIndex::new();
    index.reserve(50_000);
    let hash = |k: u64| k.wrapping_mul(0x9e37_79b9_7f4a_7c15);
    for k in 0..20_000 {
        assert!(index.insert((k % 3) as usize, hash(k)));
    }
    // Freed ids (a hole in the ids) are left out of the rebuilt table.
    for k in (0..20_000).step_by(5) {
        assert!(index.remove((k % 3) as usize, hash(k)));
    }
    let before = index.memory_bytes();
    index.shrink_to_fit();
    assert!(index.memory_bytes() < before / 2);
    assert_eq!(index.len(), 16_000);
    for k in 0..20_000 {
        let held: Vec<usize> = index.holders(hash(k)).iter().collect();
        let expected = if k % 5 == 0 {
            vec![]
        } else {
            vec![(k % 3) as usize]
        };
        assert_eq!(held, expected, "key {k}");
    }
    // The freed ids are still reused after the rebuild.
    let ids = index.parts().0.len();
    assert!(index.insert(0, hash(0)));
    assert_eq!(index.parts().0.len(), ids);
}

#[test]
fn tracks_holders_and_frees_ids() {
    let mut index = KeyIndex::new();
    assert!(index.insert(0, 10));
    assert!(!index.insert(0, 10));
    assert!(index.insert(3, 10));
    assert_eq!(index.holders(10).iter().collect::<Vec<_>>(), vec![0, 3]);
    assert_eq!(index.len(), 1);
    assert!(index.remove(0, 10));
    assert!(!index.remove(0, 10));
    assert_eq!(index.holders(10).iter().collect::<Vec<_>>(), vec![3]);
    assert!(index.remove(3, 10));
    assert!(index.holders(10).is_empty());
    assert!(index.is_empty());
    // The freed id is reused.
    assert!(index.insert(1, 11));
    assert_eq!(index.parts().0.len(), 1);
}

#[test]
fn differences_between_sources_are_set_algebra() {
    let mut index = KeyIndex::new();
    for hash in 0..10 {
        index.insert(0, hash);
    }
    for hash in 5..15 {
        index.insert(1, hash);
    }
    let missing: Vec<u64> = index
        .missing_from(0, 1)
        .iter()
        .filter_map(|id| index.hash_of(id))
        .collect();
    assert_eq!(missing, vec![0, 1, 2, 3, 4]);
    assert_eq!(index.missing_from(1, 0).len(), 5);
    assert_eq!(index.missing_from(0, 7).len(), 10);
}

#[test]
fn sources_past_the_mask_use_bitmaps() {
    let mut index = KeyIndex::new();
    index.insert(40, 7);
    index.insert(33, 7);
    index.insert(2, 7);
    assert_eq!(index.holders(7).iter().collect::<Vec<_>>(), vec![2, 33, 40]);
    index.remove(40, 7);
    assert!(index.holders(7).contains(33));
    index.remove(33, 7);
    assert_eq!(index.holders(7).iter().collect::<Vec<_>>(), vec![2]);
    index.clear_source(2);
    assert!(index.is_empty());
}

#[test]
fn clearing_a_source_keeps_the_others() {
    let mut index = KeyIndex::new();
    for hash in 0..100 {
        index.insert(0, hash);
        if hash % 2 == 0 {
            index.insert(1, hash);
        }
    }
    index.clear_source(0);
    assert_eq!(index.len(), 50);
    assert_eq!(index.source_len(0), 0);
    assert_eq!(index.source_len(1), 50);
    let (hashes, masks, free, bitmaps) = index.parts();
    let rebuilt = KeyIndex::from_parts(
        hashes.to_vec(),
        masks.to_vec(),
        free.to_vec(),
        bitmaps.to_vec(),
    )
    .unwrap();
    assert_eq!(rebuilt.len(), 50);
    assert!(rebuilt.holders(4).contains(1));
    assert!(rebuilt.holders(5).is_empty());
}
