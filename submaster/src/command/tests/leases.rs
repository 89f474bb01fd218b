//! Space leases: granted whole, carved by commits, the rest freed when they end;
//! a standby that folds only the commits ends with the same durable state.

use hkvm_events::rpc::submaster::{
    GetReplicaList, ItemError, ItemResult, LeaseReturn, LeaseSpace, Mixed, PutCommit,
    PutCommitItem, PutEndItem, Remove, SpaceLease, UnmountSegment, MAX_AVOIDED_NODES,
};
use hkvm_events::{KvEvent, NodeId, SegmentId};

use super::{three_nodes, Harness};
use crate::command::{Reply, Request};

const LEASE: u64 = 64 * 1024;

impl Harness {
    fn lease(&mut self, len: u64, replicas: u32) -> ItemResult<SpaceLease> {
        match self.run(Request::LeaseSpace(LeaseSpace {
            len,
            replicas,
            preferred_segment: None,
            avoid_nodes: Vec::new(),
        })) {
            Ok(Reply::LeaseSpace(granted)) => granted,
            other => panic!("{other:?}"),
        }
    }

    fn granted(&mut self, len: u64, replicas: u32) -> SpaceLease {
        match self.lease(len, replicas) {
            ItemResult::Ok(lease) => lease,
            other => panic!("{other:?}"),
        }
    }

    fn commit_into(&mut self, items: Vec<PutCommitItem>) -> Vec<ItemResult<()>> {
        match self.run(Request::PutCommit(PutCommit { items })) {
            Ok(Reply::PutCommit(results)) => results,
            other => panic!("{other:?}"),
        }
    }

    fn used(&self) -> u64 {
        self.leader.usage().1
    }
}

fn item(key: &str, lease: u64, offset: u64, size: u64, put_id: u64) -> PutCommitItem {
    PutCommitItem {
        key: key.into(),
        size,
        checksum: 5,
        lease,
        offset,
        hard_pin: false,
        put_id,
    }
}

fn commits(h: &Harness) -> usize {
    h.log
        .iter()
        .filter(|e| matches!(e, KvEvent::PutCommitted(_)))
        .count()
}

#[test]
fn objects_committed_into_a_lease_sit_at_its_offsets_on_every_range() {
    let mut h = three_nodes();
    let lease = h.granted(LEASE, 2);
    assert_eq!((lease.len, lease.ranges.len()), (LEASE, 2));
    assert_ne!(lease.ranges[0].node, lease.ranges[1].node);
    assert_eq!(h.used(), 2 * LEASE);

    let results = h.commit_into(vec![
        item("a", lease.id, 0, 1000, 11),
        item("b", lease.id, 4096, 4096, 12),
    ]);
    assert_eq!(results, vec![ItemResult::Ok(()), ItemResult::Ok(())]);
    assert_eq!(commits(&h), 2);
    assert!(
        h.leader.pending.is_empty(),
        "a commit leaves nothing pending"
    );
    let located = match h.run(Request::GetReplicaList(GetReplicaList {
        keys: vec!["b".into()],
        lease: false,
    })) {
        Ok(Reply::GetReplicaList(mut found)) => found.remove(0).into_result().unwrap(),
        other => panic!("{other:?}"),
    };
    let offsets: Vec<(SegmentId, u64)> = located
        .replicas
        .iter()
        .map(|r| (r.segment.clone(), r.offset))
        .collect();
    let expected: Vec<(SegmentId, u64)> = lease
        .ranges
        .iter()
        .map(|r| (r.segment.clone(), r.offset + 4096))
        .collect();
    assert_eq!(offsets, expected);
    assert_eq!(h.used(), 2 * LEASE, "the objects stay inside the lease");

    // The same commits sent again: done already, nothing appended twice.
    let again = h.commit_into(vec![item("b", lease.id, 4096, 4096, 12)]);
    assert_eq!(again, vec![ItemResult::Ok(())]);
    assert_eq!(commits(&h), 2);

    // Returning the lease frees what no commit took; the objects stay.
    assert_eq!(
        h.run(Request::LeaseReturn(LeaseReturn { lease: lease.id })),
        Ok(Reply::Done)
    );
    assert_eq!(h.used(), 2 * (1024 + 4096));
    assert!(h.leader.leases.is_empty());
    h.assert_standby_agrees();
    assert_eq!(h.exists(&["a", "b"]), vec![true, true]);
}

#[test]
fn a_commit_is_refused_per_item_for_what_the_lease_does_not_allow() {
    let mut h = three_nodes();
    let lease = h.granted(LEASE, 2);
    h.put("taken", 100, 1);
    let results = h.commit_into(vec![
        item("ok", lease.id, 0, 128, 1),
        item("overlap", lease.id, 64, 64, 2),
        item("past-end", lease.id, LEASE - 64, 65, 3),
        item("misaligned", lease.id, 100, 1, 4),
        item("taken", lease.id, 4096, 64, 5),
        item("nobody", lease.id.wrapping_add(7), 0, 64, 6),
        item("empty", lease.id, 8192, 0, 7),
        item("ok", lease.id, 12288, 64, 8),
    ]);
    let invalid = |r: &ItemResult<()>| matches!(r, ItemResult::Err(ItemError::Invalid(_)));
    assert_eq!(results[0], ItemResult::Ok(()));
    assert!(invalid(&results[1]), "{:?}", results[1]);
    assert!(invalid(&results[2]), "{:?}", results[2]);
    assert!(invalid(&results[3]), "{:?}", results[3]);
    assert_eq!(results[4], ItemResult::Err(ItemError::AlreadyExists));
    assert_eq!(results[5], ItemResult::Err(ItemError::NoLease));
    assert!(invalid(&results[6]), "{:?}", results[6]);
    assert!(invalid(&results[7]), "a key twice in one batch");
    assert_eq!(commits(&h), 2, "the put of 'taken' and 'ok' only");
    // The refused ranges are still the lease's: a later commit may take them.
    let later = h.commit_into(vec![item("later", lease.id, 4096, 64, 9)]);
    assert_eq!(later, vec![ItemResult::Ok(())]);
}

#[test]
fn a_lease_ends_by_time_and_gives_back_what_no_commit_took() {
    let mut h = three_nodes();
    let lease = h.granted(LEASE, 3);
    assert_eq!(
        h.commit_into(vec![item("kept", lease.id, 0, 64, 1)]),
        vec![ItemResult::Ok(())]
    );
    h.now += h.policy.space_lease_ttl_ms;
    assert_eq!(
        h.commit_into(vec![item("late", lease.id, 64, 64, 2)]),
        vec![ItemResult::Err(ItemError::NoLease)],
        "a lease at its end takes no commit, even before upkeep ran"
    );
    for node in ["n1", "n2", "n3"] {
        h.ping(node);
    }
    h.tick();
    assert!(h.leader.leases.is_empty());
    assert_eq!(h.used(), 3 * 64);
    h.assert_standby_agrees();
}

#[test]
fn removing_a_leased_object_and_ending_the_lease_free_each_range_once() {
    let mut h = three_nodes();
    let lease = h.granted(LEASE, 2);
    h.commit_into(vec![item("gone", lease.id, 1024, 2048, 1)]);
    h.run(Request::Remove(Remove {
        keys: vec!["gone".into()],
        force: true,
    }))
    .unwrap();
    assert_eq!(
        h.used(),
        2 * (LEASE - 2048),
        "the object's ranges are free, the lease holds the rest"
    );
    h.run(Request::LeaseReturn(LeaseReturn { lease: lease.id }))
        .unwrap();
    assert_eq!(h.used(), 0);
    // Returning it again (an answer lost) is fine.
    assert_eq!(
        h.run(Request::LeaseReturn(LeaseReturn { lease: lease.id })),
        Ok(Reply::Done)
    );
    h.assert_standby_agrees();
    // The whole segment is one free range again: a put of all of it fits.
    h.put("whole", 1 << 20, 1);
}

#[test]
fn unmounting_a_segment_ends_the_leases_on_it() {
    let mut h = three_nodes();
    let lease = h.granted(LEASE, 2);
    let gone = lease.ranges[0].segment.clone();
    let node = lease.ranges[0].node.clone();
    h.run(Request::Unmount(UnmountSegment {
        node: NodeId::new(node.as_str()).unwrap(),
        segment: gone,
    }))
    .unwrap();
    assert!(h.leader.leases.is_empty());
    assert_eq!(h.used(), 0, "the other range went back");
    assert_eq!(
        h.commit_into(vec![item("x", lease.id, 0, 64, 1)]),
        vec![ItemResult::Err(ItemError::NoLease)]
    );
    h.assert_standby_agrees();
}

#[test]
fn a_lease_needs_room_on_enough_nodes_and_a_sane_size() {
    let mut h = three_nodes();
    assert_eq!(
        h.lease(LEASE, 4),
        ItemResult::Err(ItemError::NoSpace {
            replicas: 4,
            size: LEASE
        })
    );
    assert_eq!(h.used(), 0, "a refused lease holds nothing");
    for (len, replicas) in [(0, 1), (h.policy.max_space_lease + 1, 1), (LEASE, 0)] {
        let refused = h.run(Request::LeaseSpace(LeaseSpace {
            len,
            replicas,
            preferred_segment: None,
            avoid_nodes: Vec::new(),
        }));
        assert!(refused.is_err(), "{len} x {replicas}: {refused:?}");
    }
}

#[test]
fn a_mixed_request_commits_into_leases_after_its_other_parts() {
    let mut h = three_nodes();
    let lease = h.granted(LEASE, 1);
    assert!(matches!(h.put_start("reserved", 100, 1), ItemResult::Ok(_)));
    let reply = h.run(Request::Mixed(Mixed {
        exist: vec!["leased".into()],
        put_end: vec![PutEndItem {
            key: "reserved".into(),
            checksum: 5,
            put_id: 0,
        }],
        put_commit: vec![
            item("leased", lease.id, 0, 1000, 21),
            // Its reservation is still pending when commits are decided.
            item("reserved", lease.id, 1024, 100, 22),
            item("elsewhere", lease.id + 1, 0, 100, 23),
        ],
        ..Mixed::default()
    }));
    let Ok(Reply::Mixed(reply)) = reply else {
        panic!("{reply:?}")
    };
    assert_eq!(reply.exist, vec![false], "reads see the state before");
    assert_eq!(reply.put_end, vec![ItemResult::Ok(())]);
    assert_eq!(
        reply.put_commit,
        vec![
            ItemResult::Ok(()),
            ItemResult::Err(ItemError::AlreadyExists),
            ItemResult::Err(ItemError::NoLease),
        ]
    );
    assert_eq!(commits(&h), 2, "one put_end and one commit into the lease");
    assert_eq!(h.exists(&["leased", "reserved"]), vec![true, true]);
    assert_eq!(
        h.run(Request::LeaseReturn(LeaseReturn { lease: lease.id })),
        Ok(Reply::Done)
    );
    h.assert_standby_agrees();
}

#[test]
fn a_lease_takes_at_most_a_sixteenth_of_the_smallest_segment() {
    let mut h = three_nodes();
    // 1 MiB segments: asking 2 MiB (more than a segment) is granted 64 KiB.
    let lease = h.granted(2 << 20, 2);
    assert_eq!(lease.len, (1 << 20) / 16);
    assert_eq!(h.used(), 2 * lease.len);
    let fits = h.commit_into(vec![item("a", lease.id, 0, lease.len, 1)]);
    assert_eq!(fits, vec![ItemResult::Ok(())]);
    let past = h.commit_into(vec![item("b", lease.id, lease.len, 64, 2)]);
    assert!(matches!(past[0], ItemResult::Err(ItemError::Invalid(_))));
    // A segment too small for even one aligned unit's share: no lease at all.
    h.mount("n4", "tiny", 1000);
    assert_eq!(
        h.lease(LEASE, 1),
        ItemResult::Err(ItemError::NoSpace {
            replicas: 1,
            size: LEASE
        })
    );
}

#[test]
fn a_lease_takes_no_range_on_an_avoided_node() {
    let mut h = three_nodes();
    for _ in 0..10 {
        let granted = h.run(Request::LeaseSpace(LeaseSpace {
            len: LEASE,
            replicas: 2,
            preferred_segment: None,
            avoid_nodes: vec![NodeId::new("n1").unwrap()],
        }));
        let Ok(Reply::LeaseSpace(ItemResult::Ok(lease))) = granted else {
            panic!("{granted:?}")
        };
        let mut nodes: Vec<&str> = lease.ranges.iter().map(|r| r.node.as_str()).collect();
        nodes.sort_unstable();
        assert_eq!(nodes, ["n2", "n3"]);
    }
    let refused = h.run(Request::LeaseSpace(LeaseSpace {
        len: LEASE,
        replicas: 1,
        preferred_segment: None,
        avoid_nodes: vec![NodeId::new("n1").unwrap(); MAX_AVOIDED_NODES + 1],
    }));
    assert!(refused.is_err(), "{refused:?}");
}

#[test]
fn a_commit_into_a_lease_counts_against_its_tenants_quota() {
    let mut h = three_nodes();
    h.policy.tenant_quotas = std::sync::Arc::new([("a".to_owned(), 5000)].into());
    let lease = h.granted(LEASE, 1);
    let a = hkvm_events::tenant::key_prefix("a");
    let results = h.commit_into(vec![
        item(&format!("{a}1"), lease.id, 0, 4096, 1),
        item(&format!("{a}2"), lease.id, 4096, 4096, 2),
        item("plain", lease.id, 8192, 4096, 3),
    ]);
    assert_eq!(results[0], ItemResult::Ok(()));
    assert_eq!(
        results[1],
        ItemResult::Err(ItemError::QuotaExceeded {
            quota: 5000,
            held: 4096
        })
    );
    assert_eq!(results[2], ItemResult::Ok(()));
    assert_eq!(h.leader.tenant_bytes("a"), 4096);
    assert_eq!(h.standby.tenant_bytes("a"), 4096);
}
