//! Resent requests: a `put_start` or `put_end` sent again (after a lost reply
//! or a failover) is answered as the first was and changes nothing more; the
//! put ids that tell them apart survive a snapshot.

use hkvm_events::rpc::submaster::{
    ItemError, ItemResult, PutEnd, PutEndItem, PutStart, PutStartItem,
};

use super::{three_nodes, Harness};
use crate::command::{Reply, Request};

fn start_with_id(key: &str, put_id: u64) -> PutStartItem {
    PutStartItem {
        key: key.into(),
        size: 1000,
        replicas: 2,
        preferred_segment: None,
        hard_pin: false,
        put_id,
        avoid_nodes: Vec::new(),
    }
}

fn end_with_id(key: &str, put_id: u64) -> PutEndItem {
    PutEndItem {
        key: key.into(),
        checksum: 9,
        put_id,
    }
}

impl Harness {
    fn start_ids(
        &mut self,
        items: Vec<PutStartItem>,
    ) -> Vec<ItemResult<Vec<hkvm_events::rpc::submaster::ReplicaLocation>>> {
        match self.run(Request::PutStart(PutStart { items })) {
            Ok(Reply::PutStart(results)) => results,
            other => panic!("{other:?}"),
        }
    }

    fn end_ids(&mut self, items: Vec<PutEndItem>) -> (Vec<ItemResult<()>>, usize) {
        let before = self.log.len();
        match self.run(Request::PutEnd(PutEnd { items })) {
            Ok(Reply::PutEnd(results)) => (results, self.log.len() - before),
            other => panic!("{other:?}"),
        }
    }
}

#[test]
fn a_put_end_sent_again_answers_committed_and_commits_once() {
    let mut h = three_nodes();
    assert!(matches!(
        h.start_ids(vec![start_with_id("k", 7)])[0],
        ItemResult::Ok(_)
    ));
    let (first, events) = h.end_ids(vec![end_with_id("k", 7)]);
    assert_eq!((first, events), (vec![ItemResult::Ok(())], 1));
    // The reply was lost; the client sends the same commit again.
    let (again, events) = h.end_ids(vec![end_with_id("k", 7)]);
    assert_eq!(
        (again, events),
        (vec![ItemResult::Ok(())], 0),
        "answered committed, and no second commit"
    );
    h.assert_standby_agrees();
}

#[test]
fn a_new_leader_tells_a_committed_put_from_one_whose_reservation_it_lost() {
    let mut h = three_nodes();
    h.start_ids(vec![start_with_id("done", 1), start_with_id("lost", 2)]);
    h.end_ids(vec![end_with_id("done", 1)]);
    // The standby takes over: it holds what the stream holds, no reservation.
    let mut takeover = Harness::new();
    takeover.commit(h.log.clone());
    let (answers, events) = takeover.end_ids(vec![end_with_id("done", 1), end_with_id("lost", 2)]);
    assert_eq!(
        (answers, events),
        (
            vec![ItemResult::Ok(()), ItemResult::Err(ItemError::NoPendingPut)],
            0
        ),
        "committed before the change: committed; never committed: absent for good"
    );
}

#[test]
fn a_put_end_never_commits_another_puts_reservation_or_claims_its_commit() {
    let mut h = three_nodes();
    h.start_ids(vec![start_with_id("k", 1)]);
    // A put whose reservation was lost (id 2) must not commit put 1's space.
    let (answers, events) = h.end_ids(vec![end_with_id("k", 2)]);
    assert_eq!(
        (answers, events),
        (vec![ItemResult::Err(ItemError::NoPendingPut)], 0)
    );
    h.end_ids(vec![end_with_id("k", 1)]);
    // Nor is put 2 told that put 1's commit is its own.
    let (answers, _) = h.end_ids(vec![end_with_id("k", 2)]);
    assert_eq!(answers, vec![ItemResult::Err(ItemError::NoPendingPut)]);
}

#[test]
fn a_put_start_sent_again_gets_the_same_reservation() {
    let mut h = three_nodes();
    let ItemResult::Ok(first) = h.start_ids(vec![start_with_id("k", 5)]).remove(0) else {
        panic!()
    };
    let free = h
        .leader
        .segments()
        .map(|(_, s)| s.allocator.free_bytes())
        .sum::<u64>();
    let ItemResult::Ok(again) = h.start_ids(vec![start_with_id("k", 5)]).remove(0) else {
        panic!("the same put's start sent again is not refused")
    };
    assert_eq!(first, again, "the same reservation");
    let free_after = h
        .leader
        .segments()
        .map(|(_, s)| s.allocator.free_bytes())
        .sum::<u64>();
    assert_eq!(free, free_after, "no second reservation");
    assert_eq!(
        h.start_ids(vec![start_with_id("k", 6)]),
        vec![ItemResult::Err(ItemError::AlreadyExists)],
        "another put of the key is refused"
    );
}

#[test]
fn a_snapshot_keeps_the_put_ids_a_resent_put_end_needs() {
    let mut h = three_nodes();
    h.start_ids(vec![start_with_id("k", 77)]);
    h.end_ids(vec![end_with_id("k", 77)]);
    let restored = crate::snapshot::decode(&crate::snapshot::encode(&h.leader).unwrap()).unwrap();
    assert_eq!(restored.object("k").map(|o| o.put_id), Some(77));
}
