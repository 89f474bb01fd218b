//! Pure tests of commands and `apply`, without NATS: every event a leader decides is
//! also folded by a standby, which must end with the same durable state.

use hkvm_events::rpc::submaster::{
    Exist, GetReplicaList, ItemError, ItemResult, Mixed, MountSegment, PingReply, PutEnd,
    PutEndItem, PutRevoke, PutStart, PutStartItem, Remount, Remove, RemoveAll, RemoveMatching,
    UnmountSegment, MAX_AVOIDED_NODES, MAX_KEY_PATTERN_LEN,
};
use hkvm_events::rpc::RpcErrorCode;
use hkvm_events::{KvEvent, NodeId, SegmentId};

use super::*;
use crate::liveness::{collect_pings, LiveNodes};

struct Harness {
    leader: State,
    /// The leader's pings, as its RPC front records them.
    nodes: LiveNodes,
    standby: State,
    log: Vec<KvEvent>,
    now: u64,
    policy: Policy,
}

impl Harness {
    fn new() -> Self {
        Self {
            leader: State::new(),
            nodes: LiveNodes::new(),
            standby: State::new(),
            log: Vec::new(),
            now: 1_000,
            policy: Policy::default(),
        }
    }

    fn commit(&mut self, events: Vec<KvEvent>) {
        for event in &events {
            self.leader.apply(event);
            self.standby.apply(event);
        }
        self.nodes.sync(&self.leader, &events);
        self.log.extend(events);
    }

    fn run(&mut self, request: Request) -> Result<Reply, RpcError> {
        let serving = ServingInfo {
            producer: "sm-test".into(),
            epoch: 1,
        };
        let outcome = handle(&mut self.leader, request, self.now, &self.policy, &serving)?;
        self.commit(outcome.events);
        Ok(outcome.reply)
    }

    /// A ping from `node`, answered as the leader's RPC front answers it.
    fn ping(&mut self, node: &str) -> PingReply {
        self.nodes.ping_at(&NodeId::new(node).unwrap(), self.now)
    }

    fn tick(&mut self) {
        collect_pings(&mut self.leader, self.nodes.take_pings());
        let events = maintain(&mut self.leader, self.now, &self.policy);
        self.commit(events);
    }

    fn mount(&mut self, node: &str, segment: &str, size: u64) {
        let reply = self.run(Request::Mount(MountSegment {
            node: NodeId::new(node).unwrap(),
            segment: SegmentId::new(segment).unwrap(),
            size,
            endpoint: format!("{node}:7000"),
            rdma: None,
        }));
        assert_eq!(reply, Ok(Reply::Done));
    }

    fn put_start(
        &mut self,
        key: &str,
        size: u64,
        replicas: u32,
    ) -> ItemResult<Vec<hkvm_events::rpc::submaster::ReplicaLocation>> {
        let item = start_item(key, size, replicas);
        match self.run(Request::PutStart(PutStart { items: vec![item] })) {
            Ok(Reply::PutStart(mut results)) => results.remove(0),
            other => panic!("{other:?}"),
        }
    }

    fn put(&mut self, key: &str, size: u64, replicas: u32) {
        assert!(matches!(
            self.put_start(key, size, replicas),
            ItemResult::Ok(_)
        ));
        let reply = self.run(Request::PutEnd(PutEnd {
            items: vec![PutEndItem {
                key: key.into(),
                checksum: 42,
                put_id: 0,
            }],
        }));
        assert_eq!(reply, Ok(Reply::PutEnd(vec![ItemResult::Ok(())])));
    }

    fn exists(&mut self, keys: &[&str]) -> Vec<bool> {
        match self.run(Request::Exist(Exist {
            keys: keys.iter().map(|k| (*k).to_owned()).collect(),
        })) {
            Ok(Reply::Exist(flags)) => flags,
            other => panic!("{other:?}"),
        }
    }

    fn assert_standby_agrees(&self) {
        assert!(
            self.leader.same_durable_state(&self.standby),
            "standby diverged"
        );
    }
}

/// A put_start item of `size` bytes and `replicas` replicas, without options.
fn start_item(key: &str, size: u64, replicas: u32) -> PutStartItem {
    PutStartItem {
        key: key.into(),
        size,
        replicas,
        preferred_segment: None,
        hard_pin: false,
        put_id: 0,
        avoid_nodes: Vec::new(),
    }
}

fn three_nodes() -> Harness {
    let mut h = Harness::new();
    h.mount("n1", "s1", 1 << 20);
    h.mount("n2", "s2", 1 << 20);
    h.mount("n3", "s3", 1 << 20);
    h
}

#[test]
fn a_put_is_invisible_until_ended_and_then_everywhere() {
    let mut h = three_nodes();
    let ItemResult::Ok(placements) = h.put_start("k", 1000, 2) else {
        panic!()
    };
    assert_eq!(placements.len(), 2);
    assert_ne!(
        placements[0].node, placements[1].node,
        "replicas on distinct nodes"
    );
    assert_eq!(h.exists(&["k"]), vec![false]);
    h.run(Request::PutEnd(PutEnd {
        items: vec![PutEndItem {
            key: "k".into(),
            checksum: 7,
            put_id: 0,
        }],
    }))
    .unwrap();
    assert_eq!(h.exists(&["k", "other"]), vec![true, false]);
    let object = h.standby.object("k").unwrap();
    assert_eq!((object.size, object.checksum), (1000, 7));
    h.assert_standby_agrees();
}

#[test]
fn put_errors_are_per_item() {
    let mut h = three_nodes();
    h.put("dup", 10, 1);
    assert_eq!(
        h.put_start("dup", 10, 1),
        ItemResult::Err(ItemError::AlreadyExists)
    );
    assert!(matches!(
        h.put_start("k", 10, 4),
        ItemResult::Err(ItemError::NoSpace { replicas: 4, .. })
    ));
    assert!(matches!(
        h.put_start("k", 0, 1),
        ItemResult::Err(ItemError::Invalid(_))
    ));
    assert!(matches!(
        h.put_start(&"x".repeat(5000), 10, 1),
        ItemResult::Err(ItemError::Invalid(_))
    ));
    assert!(matches!(
        h.put_start("big", 2 << 20, 1),
        ItemResult::Err(ItemError::NoSpace { .. })
    ));
    let reply = h.run(Request::PutEnd(PutEnd {
        items: vec![PutEndItem {
            key: "never-started".into(),
            checksum: 1,
            put_id: 0,
        }],
    }));
    assert_eq!(
        reply,
        Ok(Reply::PutEnd(vec![ItemResult::Err(
            ItemError::NoPendingPut
        )]))
    );
    let too_many = (0..5000)
        .map(|i| start_item(&format!("k{i}"), 1, 1))
        .collect();
    assert!(h
        .run(Request::PutStart(PutStart { items: too_many }))
        .is_err());
}

#[test]
fn revoke_and_timeout_free_the_space() {
    let mut h = three_nodes();
    let (_, free_before) = h.leader.usage();
    assert!(matches!(h.put_start("r", 4096, 3), ItemResult::Ok(_)));
    assert!(h.leader.usage().1 > free_before);
    let reply = h.run(Request::PutRevoke(PutRevoke {
        keys: vec!["r".into(), "r".into()],
    }));
    assert_eq!(
        reply,
        Ok(Reply::PutRevoke(vec![
            ItemResult::Ok(()),
            ItemResult::Err(ItemError::NoPendingPut)
        ]))
    );
    assert_eq!(h.leader.usage().1, free_before);

    assert!(matches!(h.put_start("t", 4096, 1), ItemResult::Ok(_)));
    h.now += h.policy.put_timeout_ms;
    // Keep the nodes alive while the clock moves.
    for node in ["n1", "n2", "n3"] {
        h.ping(node);
    }
    h.tick();
    assert!(h.leader.pending.is_empty());
    assert_eq!(h.leader.usage().1, free_before);
    assert!(
        h.log.iter().all(|e| !matches!(e, KvEvent::PutCommitted(_))),
        "nothing was committed"
    );
}

#[test]
fn leases_block_removal_unless_forced() {
    let mut h = three_nodes();
    h.put("leased", 10, 1);
    h.put("free", 10, 1);
    h.run(Request::GetReplicaList(GetReplicaList {
        keys: vec!["leased".into()],
        lease: true,
    }))
    .unwrap();
    // A look without a lease (`hkvm stat`) keeps nothing from removal.
    let look = h.run(Request::GetReplicaList(GetReplicaList {
        keys: vec!["free".into()],
        lease: false,
    }));
    assert!(
        matches!(&look, Ok(Reply::GetReplicaList(items)) if matches!(&items[0], ItemResult::Ok(list) if list.lease_ms == 0)),
        "{look:?}"
    );
    let reply = h.run(Request::Remove(Remove {
        keys: vec!["leased".into(), "free".into(), "missing".into()],
        force: false,
    }));
    assert_eq!(
        reply,
        Ok(Reply::Remove(vec![
            ItemResult::Err(ItemError::Leased),
            ItemResult::Ok(()),
            ItemResult::Err(ItemError::NotFound)
        ]))
    );
    h.now += h.policy.lease_ttl_ms;
    h.run(Request::Remove(Remove {
        keys: vec!["leased".into()],
        force: false,
    }))
    .unwrap();
    assert_eq!(h.exists(&["leased", "free"]), vec![false, false]);
    h.assert_standby_agrees();
}

#[test]
fn remove_all_respects_leases_and_force() {
    let mut h = three_nodes();
    for i in 0..10 {
        h.put(&format!("k{i}"), 100, 2);
    }
    h.run(Request::GetReplicaList(GetReplicaList {
        keys: vec!["k3".into()],
        lease: true,
    }))
    .unwrap();
    assert!(matches!(
        h.run(Request::RemoveAll(RemoveAll { force: false })),
        Ok(Reply::RemoveAll(r)) if r.removed == 9
    ));
    assert_eq!(h.leader.object_count(), 1);
    assert!(matches!(
        h.run(Request::RemoveAll(RemoveAll { force: true })),
        Ok(Reply::RemoveAll(r)) if r.removed == 1
    ));
    assert_eq!(h.leader.usage().1, 0, "all space is free again");
    h.assert_standby_agrees();
}

#[test]
fn a_removal_a_slice_at_a_time_takes_every_object_that_stays_throughout() {
    let mut h = Harness::new();
    h.mount("n1", "s1", 1 << 30);
    // More objects than one slice holds.
    let objects = 20_000;
    for i in 0..objects {
        h.put(&format!("k{i}"), 1, 1);
    }
    assert!(h.leader.object_slices() > 1);
    let mut step = RemoveSlice::of_all(&RemoveAll { force: false });
    let (mut slices, mut removed) = (0, 0);
    loop {
        let Ok(Reply::RemovedSlice(slice)) = h.run(Request::RemoveSlice(step.clone())) else {
            panic!("a slice answers with what it removed")
        };
        slices += 1;
        removed += slice.removed;
        if slices == 1 {
            // Requests run between two slices: this put lands in an entry of
            // the slice already scanned, so the removal does not take it.
            h.put("late", 1, 1);
        }
        match slice.next {
            Some(next) => step.slice = next,
            None => break,
        }
    }
    assert_eq!(slices, h.leader.object_slices());
    assert_eq!(removed, objects);
    assert_eq!(h.leader.object_count(), 1);
    assert_eq!(
        h.exists(&["late", "k0", "k19999"]),
        vec![true, false, false]
    );
    h.assert_standby_agrees();
}

#[test]
fn remove_all_with_a_pattern_removes_only_matching_keys() {
    let mut h = three_nodes();
    for key in ["model-a/1", "model-a/2", "model-b/1", "other"] {
        h.put(key, 100, 1);
    }
    let by_pattern = |pattern: &str| {
        Request::RemoveMatching(RemoveMatching {
            pattern: pattern.to_owned(),
            force: false,
            tenant: None,
        })
    };
    assert!(matches!(
        h.run(by_pattern("^model-a/")),
        Ok(Reply::RemoveAll(r)) if r.removed == 2
    ));
    assert_eq!(h.leader.object_count(), 2);
    assert!(matches!(
        h.run(by_pattern("b/[0-9]+$")),
        Ok(Reply::RemoveAll(r)) if r.removed == 1
    ));
    let invalid = h.run(by_pattern("(unclosed")).unwrap_err();
    assert_eq!(invalid.code, RpcErrorCode::InvalidRequest);
    let huge = h
        .run(by_pattern(&"a".repeat(MAX_KEY_PATTERN_LEN + 1)))
        .unwrap_err();
    assert_eq!(huge.code, RpcErrorCode::InvalidRequest);
    assert_eq!(
        h.leader.object_count(),
        1,
        "refused patterns remove nothing"
    );
    h.assert_standby_agrees();
}

#[test]
fn a_tenants_removal_reaches_its_own_keys_only() {
    use hkvm_events::tenant::key_prefix;
    let mut h = three_nodes();
    let (a, b) = (key_prefix("a"), key_prefix("b"));
    for key in [
        "page-1".to_owned(),
        "page-2".to_owned(),
        format!("{a}page-1"),
        format!("{a}page-2"),
        format!("{a}other"),
        format!("{b}page-1"),
    ] {
        h.put(&key, 100, 1);
    }
    let removing = |pattern: &str, tenant: &str| {
        Request::RemoveMatching(RemoveMatching {
            pattern: pattern.to_owned(),
            force: false,
            tenant: Some(tenant.to_owned()),
        })
    };
    // The pattern sees the key as the tenant names it: `^page` anchors there.
    assert!(matches!(
        h.run(removing("^page-", "a")),
        Ok(Reply::RemoveAll(r)) if r.removed == 2
    ));
    assert!(h.leader.object(&format!("{a}other")).is_some());
    assert!(h.leader.object(&format!("{b}page-1")).is_some());
    assert!(h.leader.object("page-1").is_some());
    // The default tenant's remove_all leaves every other tenant's keys.
    assert!(matches!(
        h.run(removing("", "default")),
        Ok(Reply::RemoveAll(r)) if r.removed == 2
    ));
    assert_eq!(h.leader.object_count(), 2);
    let refused = h.run(removing("", "_reserved")).unwrap_err();
    assert_eq!(refused.code, RpcErrorCode::InvalidRequest);
    assert!(matches!(
        h.run(removing("", "b")),
        Ok(Reply::RemoveAll(r)) if r.removed == 1
    ));
    h.assert_standby_agrees();
}

#[test]
fn a_tenant_past_its_quota_is_refused_and_no_other_tenant_is() {
    use hkvm_events::tenant::key_prefix;
    let mut h = three_nodes();
    h.policy.tenant_quotas = std::sync::Arc::new([("a".to_owned(), 250)].into());
    let (a, b) = (key_prefix("a"), key_prefix("b"));
    h.put(&format!("{a}1"), 100, 2);
    h.put(&format!("{a}2"), 100, 1);
    assert_eq!(
        h.leader.tenant_bytes("a"),
        200,
        "each object once, whatever its replicas"
    );
    assert_eq!(
        h.put_start(&format!("{a}3"), 100, 1),
        ItemResult::Err(ItemError::QuotaExceeded {
            quota: 250,
            held: 200
        })
    );
    // Other tenants and the default one have no quota here.
    h.put(&format!("{b}1"), 500, 1);
    h.put("plain", 500, 1);
    // Puts of one request count together.
    h.run(Request::Remove(Remove {
        keys: vec![format!("{a}1"), format!("{a}2")],
        force: true,
    }))
    .unwrap();
    assert_eq!(h.leader.tenant_bytes("a"), 0);
    let items = (0..3)
        .map(|i| start_item(&format!("{a}batch-{i}"), 100, 1))
        .collect();
    let Ok(Reply::PutStart(results)) = h.run(Request::PutStart(PutStart { items })) else {
        panic!()
    };
    assert!(matches!(results[0], ItemResult::Ok(_)) && matches!(results[1], ItemResult::Ok(_)));
    assert_eq!(
        results[2],
        ItemResult::Err(ItemError::QuotaExceeded {
            quota: 250,
            held: 200
        })
    );
    assert_eq!(
        h.standby.tenant_bytes("b"),
        500,
        "a standby counts the same"
    );
}

#[test]
fn eviction_is_oldest_first_and_spares_pinned_and_leased() {
    let mut h = Harness::new();
    h.mount("n1", "s1", 64 * 1024);
    h.policy.evict_ratio = 0.25;
    let pinned = PutStartItem {
        key: "pinned".into(),
        size: 4096,
        replicas: 1,
        preferred_segment: None,
        hard_pin: true,
        put_id: 0,
        avoid_nodes: Vec::new(),
    };
    h.run(Request::PutStart(PutStart {
        items: vec![pinned],
    }))
    .unwrap();
    h.run(Request::PutEnd(PutEnd {
        items: vec![PutEndItem {
            key: "pinned".into(),
            checksum: 1,
            put_id: 0,
        }],
    }))
    .unwrap();
    for i in 0..14 {
        h.put(&format!("k{i:02}"), 4096, 1);
    }
    h.run(Request::GetReplicaList(GetReplicaList {
        keys: vec!["k00".into()],
        lease: true,
    }))
    .unwrap();
    h.tick();
    let evicted: Vec<String> = h
        .log
        .iter()
        .filter_map(|e| match e {
            KvEvent::Evicted(e) => Some(e.keys.clone()),
            _ => None,
        })
        .flatten()
        .collect();
    // 15 objects * 0.25 -> 4 evicted, oldest first, skipping pinned and leased k00.
    assert_eq!(evicted, vec!["k01", "k02", "k03", "k04"]);
    assert!(h.leader.object("pinned").is_some());
    h.assert_standby_agrees();
}

#[test]
fn a_silent_node_is_lost_with_the_objects_only_it_held() {
    let mut h = three_nodes();
    h.put("both", 10, 3);
    h.put_start("only-n1", 10, 1);
    // Force the single replica onto n1 by preferring its segment.
    h.run(Request::PutRevoke(PutRevoke {
        keys: vec!["only-n1".into()],
    }))
    .unwrap();
    h.run(Request::PutStart(PutStart {
        items: vec![PutStartItem {
            key: "only-n1".into(),
            size: 10,
            replicas: 1,
            preferred_segment: Some(SegmentId::new("s1").unwrap()),
            hard_pin: false,
            put_id: 0,
            avoid_nodes: Vec::new(),
        }],
    }))
    .unwrap();
    h.run(Request::PutEnd(PutEnd {
        items: vec![PutEndItem {
            key: "only-n1".into(),
            checksum: 3,
            put_id: 0,
        }],
    }))
    .unwrap();

    h.now += h.policy.node_timeout_ms;
    for node in ["n2", "n3"] {
        h.ping(node);
    }
    h.tick();
    assert!(h
        .log
        .iter()
        .any(|e| matches!(e, KvEvent::NodeLost(l) if l.node.as_str() == "n1")));
    assert_eq!(h.exists(&["both", "only-n1"]), vec![true, false]);
    assert_eq!(h.leader.object("both").unwrap().replicas.len(), 2);
    // The lost node must remount before it counts again.
    assert!(h.ping("n1").need_remount);
    h.assert_standby_agrees();
}

#[test]
fn unmount_and_remount() {
    let mut h = three_nodes();
    h.put("k", 10, 3);
    h.run(Request::Unmount(UnmountSegment {
        node: NodeId::new("n2").unwrap(),
        segment: SegmentId::new("s2").unwrap(),
    }))
    .unwrap();
    assert_eq!(h.leader.object("k").unwrap().replicas.len(), 2);
    let wrong_owner = h.run(Request::Unmount(UnmountSegment {
        node: NodeId::new("n2").unwrap(),
        segment: SegmentId::new("s1").unwrap(),
    }));
    assert!(wrong_owner.is_err());
    // An identical remount records nothing; a moved endpoint is recorded.
    let before = h.log.len();
    let mount = MountSegment {
        node: NodeId::new("n1").unwrap(),
        segment: SegmentId::new("s1").unwrap(),
        size: 1 << 20,
        endpoint: "n1:7000".into(),
        rdma: None,
    };
    h.run(Request::Remount(Remount {
        node: mount.node.clone(),
        segments: vec![mount.clone()],
    }))
    .unwrap();
    assert_eq!(h.log.len(), before);
    let moved = MountSegment {
        endpoint: "n1:7001".into(),
        rdma: None,
        ..mount
    };
    h.run(Request::Remount(Remount {
        node: moved.node.clone(),
        segments: vec![moved],
    }))
    .unwrap();
    assert_eq!(h.log.len(), before + 1);
    assert_eq!(
        h.standby
            .segment(h.standby.slot_of(&SegmentId::new("s1").unwrap()).unwrap())
            .unwrap()
            .endpoint,
        "n1:7001"
    );
    h.assert_standby_agrees();
}

#[test]
fn the_allocator_is_rebuilt_from_events() {
    let mut h = three_nodes();
    for i in 0..50 {
        h.put(&format!("k{i}"), 1000 + i * 37, 2);
    }
    for i in (0..50).step_by(3) {
        h.run(Request::Remove(Remove {
            keys: vec![format!("k{i}")],
            force: true,
        }))
        .unwrap();
    }
    // A fresh standby folding the whole log gets identical free space per segment.
    let mut fresh = State::new();
    for event in &h.log {
        fresh.apply(event);
    }
    assert!(fresh.same_durable_state(&h.leader));
    // And a new object placed by the standby (after a takeover) cannot overlap.
    let mut takeover = Harness {
        leader: fresh,
        ..Harness::new()
    };
    for i in 0..20 {
        takeover.put(&format!("new{i}"), 2000, 2);
    }
    assert_eq!(
        takeover.leader.anomalies,
        crate::state::ApplyAnomalies::default()
    );
}

#[test]
fn a_mixed_request_decides_reads_then_reservations_then_commits() {
    let mut h = three_nodes();
    h.put("old", 10, 1);
    assert!(matches!(h.put_start("pending", 20, 1), ItemResult::Ok(_)));
    let start = |key: &str| start_item(key, 30, 1);
    let end = |key: &str| PutEndItem {
        key: key.into(),
        checksum: 9,
        put_id: 0,
    };
    let reply = h.run(Request::Mixed(Mixed {
        exist: vec!["old".into(), "pending".into()],
        get_replica_list: vec!["old".into(), "pending".into()],
        put_start: vec![start("new"), start("pending")],
        put_end: vec![end("pending"), end("never-started")],
        put_commit: vec![],
    }));
    let Ok(Reply::Mixed(reply)) = reply else {
        panic!("{reply:?}")
    };
    // Reads see the state before the request's commits.
    assert_eq!(reply.exist, vec![true, false]);
    assert!(matches!(&reply.get_replica_list[0], ItemResult::Ok(list) if list.size == 10));
    assert_eq!(
        reply.get_replica_list[1],
        ItemResult::Err(ItemError::NotFound)
    );
    // A key whose put is still pending is not reserved twice.
    assert!(matches!(reply.put_start[0], ItemResult::Ok(_)));
    assert_eq!(
        reply.put_start[1],
        ItemResult::Err(ItemError::AlreadyExists)
    );
    assert_eq!(
        reply.put_end,
        vec![ItemResult::Ok(()), ItemResult::Err(ItemError::NoPendingPut)]
    );
    assert_eq!(h.exists(&["pending", "new"]), vec![true, false]);
    assert_eq!(h.standby.object("pending").map(|o| o.size), Some(20));
    // With the one reservation left given back, the standby holds the same state.
    h.run(Request::PutRevoke(PutRevoke {
        keys: vec!["new".into()],
    }))
    .unwrap();
    h.assert_standby_agrees();
}

#[test]
fn a_mixed_request_is_bounded_by_its_items_in_all_parts() {
    let mut h = three_nodes();
    let keys: Vec<String> = (0..h.policy.max_batch / 2 + 1)
        .map(|i| format!("k{i}"))
        .collect();
    let reply = h.run(Request::Mixed(Mixed {
        exist: keys.clone(),
        get_replica_list: keys,
        ..Mixed::default()
    }));
    assert!(matches!(reply, Err(error) if error.code == RpcErrorCode::InvalidRequest));
}

#[test]
fn a_placement_leaves_out_the_nodes_it_is_asked_to_avoid() {
    let mut h = three_nodes();
    let avoid = vec![NodeId::new("n2").unwrap()];
    let start = |key: &str, replicas: u32, avoid: Vec<NodeId>| PutStartItem {
        key: key.into(),
        size: 1000,
        replicas,
        preferred_segment: Some(SegmentId::new("s2").unwrap()),
        hard_pin: false,
        put_id: 0,
        avoid_nodes: avoid,
    };
    let items = (0..20)
        .map(|i| start(&format!("k{i}"), 2, avoid.clone()))
        .chain([
            start("three", 3, avoid.clone()),
            start(
                "too-many",
                1,
                vec![NodeId::new("n1").unwrap(); MAX_AVOIDED_NODES + 1],
            ),
        ])
        .collect();
    let Ok(Reply::PutStart(results)) = h.run(Request::PutStart(PutStart { items })) else {
        panic!()
    };
    for result in &results[..20] {
        let ItemResult::Ok(placed) = result else {
            panic!("{result:?}")
        };
        assert_eq!(placed.len(), 2);
        // Not even the preferred segment, when it is on an avoided node.
        assert!(placed.iter().all(|r| r.node.as_str() != "n2"), "{placed:?}");
    }
    assert_eq!(
        results[20],
        ItemResult::Err(ItemError::NoSpace {
            replicas: 3,
            size: 1000
        }),
        "two nodes are left for three replicas"
    );
    assert!(matches!(
        results[21],
        ItemResult::Err(ItemError::Invalid(_))
    ));
}

mod leases;
mod resend;
