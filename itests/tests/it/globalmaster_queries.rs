//! Cluster-wide queries against a real nats-server: routing across sub-clusters,
//! labels, prefix_hit, eviction and removal, new sub-clusters, the proxy, bad input.

use std::collections::BTreeMap;
use std::time::Duration;

use tokio::task::JoinHandle;

use futures::StreamExt as _;
use hkvm_events::rpc::global::{
    BatchIsExist, BatchIsExistHashed, BatchIsExistReply, GlobalOp, GlobalStatusReply, LabelFilter,
    LabelMode, Locate, LocateReply, PrefixHit, PrefixHitReply, ProxyGetReplicaList,
    ProxyGetReplicaListReply, MAX_BATCH_KEYS,
};
use hkvm_events::rpc::submaster::{
    GetReplicaList, GetReplicaListReply, ItemError, ItemResult, Op, ReplicaList,
};
use hkvm_events::rpc::{decode, encode, RpcErrorCode, RpcReply};
use hkvm_events::subject::{global_rpc_subject, submaster_rpc_subject};
use hkvm_events::SubclusterId;

use crate::fixture::{evicted, keys, put, removed, wait_applied, Fixture};

fn assert_invalid_request(error: &hkvm_client::ClientError) {
    assert_eq!(
        error.rpc_code(),
        Some(&RpcErrorCode::InvalidRequest),
        "{error}"
    );
}

fn names(reply: &BatchIsExistReply, index: usize) -> Vec<String> {
    reply
        .holders_of(index)
        .into_iter()
        .map(ToString::to_string)
        .collect()
}

#[tokio::test]
async fn keys_are_found_in_every_subcluster_that_holds_them() {
    let fixture = Fixture::new("t").await;
    let a = fixture.subcluster("sc-a", &[("pool", "prefill")]).await;
    let b = fixture.subcluster("sc-b", &[("pool", "decode")]).await;
    a.commit(vec![put("shared"), put("only-a")]).await;
    b.commit(vec![put("shared"), put("only-b")]).await;
    let master = fixture.start("g1").await;
    let global = fixture.global();

    let reply: BatchIsExistReply = global
        .call(
            GlobalOp::BatchIsExist,
            &BatchIsExist {
                keys: keys(&["shared", "only-a", "only-b", "nowhere"]),
                labels: None,
            },
        )
        .await
        .unwrap();
    assert_eq!(names(&reply, 0), vec!["sc-a", "sc-b"]);
    assert_eq!(names(&reply, 1), vec!["sc-a"]);
    assert_eq!(names(&reply, 2), vec!["sc-b"]);
    assert!(names(&reply, 3).is_empty());
    // The client sends the keys as hashes: the same answer.
    let hashed = global
        .batch_is_exist(&["shared", "only-a", "only-b", "nowhere"], None)
        .await
        .unwrap()
        .into_result()
        .unwrap();
    assert_eq!(
        (&hashed.subclusters, &hashed.counts, &hashed.holders),
        (&reply.subclusters, &reply.counts, &reply.holders)
    );
    assert_eq!(reply.staleness.replica, "g1");
    assert!(reply
        .staleness
        .sources
        .iter()
        .all(|s| s.applied_seq == 1 && s.lag_events == 0));

    let located: LocateReply = global
        .call(
            GlobalOp::Locate,
            &Locate {
                keys: keys(&["only-b", "nowhere"]),
                labels: None,
            },
        )
        .await
        .unwrap();
    let owner = &located.owners[0][0];
    assert_eq!(owner.subcluster.as_str(), "sc-b");
    assert_eq!(owner.rpc_prefix, "hkvm.t.sc-b.rpc");
    assert_eq!(owner.submaster.as_ref().unwrap().as_str(), "sm-sc-b");
    assert!(owner.alive);
    assert!(located.owners[1].is_empty());

    let status = crate::fixture::status(&global).await;
    assert_eq!(status.keys, 3);
    assert!(!status.replaying);
    assert_eq!(status.sources.len(), 2);
    drop(master);
}

#[tokio::test]
async fn hard_labels_never_cross_and_soft_labels_rank_first() {
    let fixture = Fixture::new("t").await;
    let a = fixture.subcluster("sc-a", &[("pool", "prefill")]).await;
    let b = fixture.subcluster("sc-b", &[("pool", "decode")]).await;
    a.commit(vec![put("k"), put("a-only")]).await;
    b.commit(vec![put("k")]).await;
    let _master = fixture.start("g1").await;
    let global = fixture.global();
    let ask = |mode| BatchIsExist {
        keys: keys(&["k", "a-only"]),
        labels: Some(LabelFilter {
            labels: BTreeMap::from([("pool".to_owned(), "decode".to_owned())]),
            mode,
        }),
    };
    let hard: BatchIsExistReply = global
        .call(GlobalOp::BatchIsExist, &ask(LabelMode::Hard))
        .await
        .unwrap();
    assert_eq!(names(&hard, 0), vec!["sc-b"]);
    assert!(names(&hard, 1).is_empty());
    let soft: BatchIsExistReply = global
        .call(GlobalOp::BatchIsExist, &ask(LabelMode::Soft))
        .await
        .unwrap();
    assert_eq!(names(&soft, 0), vec!["sc-b", "sc-a"]);
    assert_eq!(names(&soft, 1), vec!["sc-a"]);
    // Labels apply the same to keys sent as hashes.
    for (mode, expected) in [(LabelMode::Hard, &hard), (LabelMode::Soft, &soft)] {
        let hashed = global
            .batch_is_exist(&["k", "a-only"], ask(mode).labels)
            .await
            .unwrap()
            .into_result()
            .unwrap();
        assert_eq!(names(&hashed, 0), names(expected, 0), "{mode:?}");
        assert_eq!(names(&hashed, 1), names(expected, 1), "{mode:?}");
    }
}

/// A replica of an older build: it answers the `batch_is_exist` operations it
/// `knows` in the older reply form (integer arrays) and refuses any other as an
/// unknown operation, as such a replica does. Returns the operations asked, in
/// order, once one of them was answered.
async fn older_replica(fixture: &Fixture, knows: &'static [GlobalOp]) -> JoinHandle<Vec<String>> {
    let mut requests = fixture
        .client
        .subscribe(global_rpc_subject(&fixture.cluster, "*"))
        .await
        .unwrap();
    fixture.client.flush().await.unwrap();
    let client = fixture.client.clone();
    tokio::spawn(async move {
        let mut asked = Vec::new();
        while let Some(request) = requests.next().await {
            let op = request.subject.rsplit('.').next().unwrap().to_owned();
            if op == GlobalOp::Status.name() {
                // A client looking for a direct endpoint: an older replica's
                // status names none.
                let status = encode(&RpcReply::Ok(GlobalStatusReply::default())).unwrap();
                client
                    .publish(request.reply.unwrap(), status.into())
                    .await
                    .unwrap();
                continue;
            }
            asked.push(op.clone());
            let known = knows.iter().any(|known| known.name() == op);
            let reply = if known {
                let keys = if op == GlobalOp::BatchIsExist.name() {
                    decode::<BatchIsExist>(&request.payload).unwrap().keys.len()
                } else {
                    decode::<BatchIsExistHashed>(&request.payload)
                        .unwrap()
                        .hashes
                        .len()
                };
                let reply = BatchIsExistReply {
                    subclusters: vec![SubclusterId::new("sc-old").unwrap()],
                    counts: vec![1; keys].into(),
                    holders: vec![0; keys].into(),
                    ..BatchIsExistReply::default()
                };
                encode(&RpcReply::Ok(reply.as_arrays()))
            } else {
                encode(&RpcReply::<()>::Err(hkvm_events::rpc::RpcError::invalid(
                    format!("unknown operation {op}"),
                )))
            };
            client
                .publish(request.reply.unwrap(), reply.unwrap().into())
                .await
                .unwrap();
            if known {
                return asked;
            }
        }
        asked
    })
}

/// Replicas that predate packed replies, or hashed keys too, refuse the newer
/// operations as unknown; the client asks again in the form they know and
/// decodes their older replies.
#[tokio::test]
async fn the_client_falls_back_to_what_an_older_replica_knows() {
    for (knows, expected) in [
        (
            &[GlobalOp::BatchIsExist, GlobalOp::BatchIsExistHashed][..],
            &["batch_is_exist_packed", "batch_is_exist_hashed"][..],
        ),
        (
            &[GlobalOp::BatchIsExist][..],
            &[
                "batch_is_exist_packed",
                "batch_is_exist_hashed",
                "batch_is_exist",
            ][..],
        ),
    ] {
        let fixture = Fixture::new("t").await;
        let replica = older_replica(&fixture, knows).await;
        let reply = fixture
            .global()
            .batch_is_exist(&["a", "b"], None)
            .await
            .unwrap()
            .into_result()
            .unwrap();
        assert_eq!(reply.counts, vec![1, 1]);
        assert_eq!(reply.holders_of(1)[0].as_str(), "sc-old");
        assert_eq!(replica.await.unwrap(), expected);
    }
}

#[tokio::test]
async fn hashed_batches_past_the_limit_are_refused() {
    let fixture = Fixture::new("t").await;
    let _master = fixture.start("g1").await;
    let request = BatchIsExistHashed {
        hashes: vec![7; MAX_BATCH_KEYS + 1].into(),
        labels: None,
    };
    let error = fixture
        .global()
        .call::<_, BatchIsExistReply>(GlobalOp::BatchIsExistHashed, &request)
        .await
        .unwrap_err();
    assert_invalid_request(&error);
}

#[tokio::test]
async fn prefix_hit_counts_leading_keys_per_subcluster() {
    let fixture = Fixture::new("t").await;
    let a = fixture.subcluster("sc-a", &[]).await;
    let b = fixture.subcluster("sc-b", &[]).await;
    a.commit(vec![put("p0"), put("p1"), put("p2"), put("p4")])
        .await;
    b.commit(vec![put("p0")]).await;
    let _master = fixture.start("g1").await;
    let reply: PrefixHitReply = fixture
        .global()
        .call(
            GlobalOp::PrefixHit,
            &PrefixHit {
                keys: keys(&["p0", "p1", "p2", "p3", "p4"]),
                labels: None,
            },
        )
        .await
        .unwrap();
    let got: Vec<(String, u32)> = reply
        .prefixes
        .iter()
        .map(|p| (p.subcluster.to_string(), p.hits))
        .collect();
    assert_eq!(got, vec![("sc-a".into(), 3), ("sc-b".into(), 1)]);

    let too_many = PrefixHit {
        keys: (0..300).map(|i| format!("k{i}")).collect(),
        labels: None,
    };
    let error = fixture
        .global()
        .call::<_, PrefixHitReply>(GlobalOp::PrefixHit, &too_many)
        .await
        .unwrap_err();
    assert_invalid_request(&error);
}

#[tokio::test]
async fn evictions_removals_and_new_subclusters_show_up_while_serving() {
    let fixture = Fixture::new("t").await;
    let a = fixture.subcluster("sc-a", &[]).await;
    a.commit(vec![put("x"), put("y"), put("z")]).await;
    let master = fixture.start("g1").await;
    let global = fixture.global();

    let seq = a.commit(vec![evicted(&["x"])]).await;
    let seq = seq.max(a.commit(vec![removed(&["y"])]).await);
    wait_applied(&master, &a.id, seq).await;

    // A sub-cluster registered after the start is followed without a restart.
    let b = fixture.subcluster("sc-late", &[]).await;
    let late = b.commit(vec![put("x")]).await;
    wait_applied(&master, &b.id, late).await;

    let reply: BatchIsExistReply = global
        .call(
            GlobalOp::BatchIsExist,
            &BatchIsExist {
                keys: keys(&["x", "y", "z"]),
                labels: None,
            },
        )
        .await
        .unwrap();
    assert_eq!(names(&reply, 0), vec!["sc-late"]);
    assert!(names(&reply, 1).is_empty());
    assert_eq!(names(&reply, 2), vec!["sc-a"]);
}

#[tokio::test]
async fn get_replica_list_is_forwarded_to_the_owning_submaster() {
    let fixture = Fixture::new("t").await;
    let a = fixture.subcluster("sc-a", &[]).await;
    let b = fixture.subcluster("sc-b", &[]).await;
    a.commit(vec![put("in-a"), put("stale")]).await;
    b.commit(vec![put("in-b")]).await;
    let _master = fixture.start("g1").await;

    // Stand-ins answering on the sub-masters' RPC subjects: they know only the
    // keys listed, so "stale" (projected in sc-a) comes back as a clean miss.
    for (subcluster, known) in [("sc-a", "in-a"), ("sc-b", "in-b")] {
        let subject = submaster_rpc_subject(
            &fixture.cluster,
            &SubclusterId::new(subcluster).unwrap(),
            Op::GetReplicaList.name(),
        );
        let mut requests = fixture.client.subscribe(subject).await.unwrap();
        let client = fixture.client.clone();
        tokio::spawn(async move {
            while let Some(message) = requests.next().await {
                let request: GetReplicaList = decode(&message.payload).unwrap();
                let items: GetReplicaListReply = request
                    .keys
                    .iter()
                    .map(|key| {
                        if key == known {
                            ItemResult::Ok(ReplicaList {
                                size: 64,
                                checksum: 7,
                                replicas: Vec::new(),
                                lease_ms: 1000,
                            })
                        } else {
                            ItemResult::Err(ItemError::NotFound)
                        }
                    })
                    .collect();
                let body = encode(&RpcReply::Ok(items)).unwrap();
                client
                    .publish(message.reply.unwrap(), body.into())
                    .await
                    .unwrap();
            }
        });
    }
    fixture.client.flush().await.unwrap();

    let reply: ProxyGetReplicaListReply = fixture
        .global()
        .call(
            GlobalOp::GetReplicaList,
            &ProxyGetReplicaList {
                keys: keys(&["in-b", "stale", "in-a", "nowhere"]),
                labels: None,
                sync: false,
            },
        )
        .await
        .unwrap();
    let from: Vec<Option<String>> = reply
        .from
        .iter()
        .map(|sc| sc.as_ref().map(ToString::to_string))
        .collect();
    assert_eq!(
        from,
        vec![Some("sc-b".into()), None, Some("sc-a".into()), None]
    );
    assert!(matches!(
        reply.items[0],
        ItemResult::Ok(ReplicaList { size: 64, .. })
    ));
    assert_eq!(reply.items[1], ItemResult::Err(ItemError::NotFound));
    assert_eq!(reply.items[3], ItemResult::Err(ItemError::NotFound));
}

#[tokio::test]
async fn malformed_requests_get_invalid_request() {
    let fixture = Fixture::new("t").await;
    let _master = fixture.start("g1").await;
    for op in [
        GlobalOp::BatchIsExist,
        GlobalOp::BatchIsExistHashed,
        GlobalOp::Locate,
        GlobalOp::PrefixHit,
    ] {
        let answer = fixture
            .client
            .request(
                global_rpc_subject(&fixture.cluster, op.name()),
                b"\xc1\x00garbage".to_vec().into(),
            )
            .await
            .unwrap();
        let reply: RpcReply<()> = decode(&answer.payload).unwrap();
        let error = reply.into_result().unwrap_err();
        assert_eq!(error.code, RpcErrorCode::InvalidRequest, "{op:?}");
    }
    let answer = fixture
        .client
        .request(
            global_rpc_subject(&fixture.cluster, "no_such_op"),
            Vec::new().into(),
        )
        .await
        .unwrap();
    let reply: RpcReply<()> = decode(&answer.payload).unwrap();
    assert_eq!(
        reply.into_result().unwrap_err().code,
        RpcErrorCode::InvalidRequest
    );
    let empty_key = BatchIsExist {
        keys: vec![String::new()],
        labels: None,
    };
    let error = fixture
        .global()
        .call::<_, BatchIsExistReply>(GlobalOp::BatchIsExist, &empty_key)
        .await
        .unwrap_err();
    assert_invalid_request(&error);
}

#[tokio::test]
async fn metrics_are_served_over_http() {
    let fixture = Fixture::new("t").await;
    let a = fixture.subcluster("sc-a", &[]).await;
    a.commit(vec![put("k")]).await;
    let mut config = fixture.config("g1");
    config.metrics_addr = Some("127.0.0.1:0".parse().unwrap());
    let master = fixture.start_with(config).await;
    let _: BatchIsExistReply = fixture
        .global()
        .call(
            GlobalOp::BatchIsExist,
            &BatchIsExist {
                keys: keys(&["k"]),
                labels: None,
            },
        )
        .await
        .unwrap();
    let addr = master.metrics_addr().unwrap();
    let body = tokio::time::timeout(Duration::from_secs(10), async move {
        use tokio::io::{AsyncReadExt as _, AsyncWriteExt as _};
        let mut socket = tokio::net::TcpStream::connect(addr).await.unwrap();
        socket
            .write_all(b"GET /metrics HTTP/1.1\r\nhost: x\r\n\r\n")
            .await
            .unwrap();
        let mut body = String::new();
        socket.read_to_string(&mut body).await.unwrap();
        body
    })
    .await
    .unwrap();
    assert!(body.starts_with("HTTP/1.1 200"), "{body}");
    assert!(body.contains("hkvm_global_events_applied_total"), "{body}");
    assert!(body.contains("hkvm_global_query_seconds"), "{body}");
}
