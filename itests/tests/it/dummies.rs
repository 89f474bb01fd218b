//! A real client serving dummy clients, in this process against a real
//! sub-master: the dummies' concurrent metadata calls reach the sub-master as a
//! few batched requests (counted), and their values move through shared memory
//! byte-exact.

use std::sync::atomic::Ordering;
use std::sync::Arc;
use std::time::Duration;

use hkvm_client::coalesce::CoalesceConfig;
use hkvm_client::dummy::{DummyClient, DummyServer};
use hkvm_client::store::{Store, StoreAddress, StoreConfig};
use hkvm_events::rpc::dummy::{DummyReply, DummyRequest, Placement, Span};

use crate::fixture::{Pool, PoolSpec};

const DUMMIES: usize = 16;

fn address(pool: &Pool) -> StoreAddress {
    format!("{}/{}/sc-0", pool.fixture.url(), pool.fixture.cluster)
        .parse()
        .unwrap()
}

/// A store of sc-0: the real client (with a node) when coalescing, else a
/// client only (no node, so no pings in its request count).
async fn store(pool: &Pool, coalesce: Option<CoalesceConfig>) -> Store {
    let mut config = StoreConfig::new(address(pool), "127.0.0.1");
    config.global_segment_size = if coalesce.is_some() { 32 << 20 } else { 0 };
    config.coalesce = coalesce;
    Store::open(config).await.unwrap()
}

/// Sends one `Exist` from every dummy at once; the sub-master requests it took.
async fn concurrent_exists(dummies: &[Arc<DummyClient>], requests: impl Fn() -> u64) -> u64 {
    let before = requests();
    let calls = dummies.iter().enumerate().map(|(n, dummy)| {
        let dummy = Arc::clone(dummy);
        tokio::spawn(async move {
            let keys = vec![format!("present-{n}-a"), format!("present-{n}-b")];
            dummy.call(&DummyRequest::Exist { keys }).await.unwrap()
        })
    });
    for reply in futures::future::join_all(calls).await {
        assert_eq!(reply.unwrap(), DummyReply::Exist(vec![1, 1]));
    }
    requests() - before
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_real_client_coalesces_its_dummies_metadata_calls() {
    let pool = Pool::start(
        PoolSpec::new("dummies")
            .subcluster("sc-0", &[])
            .nodes(2, 16 << 20),
    )
    .await;
    let coalesce = CoalesceConfig {
        window: Duration::from_millis(20),
        ..CoalesceConfig::default()
    };
    let real = Arc::new(store(&pool, Some(coalesce)).await);
    // Keys the local sub-master holds: existence is answered there alone (a
    // missing key would also be asked of the global master).
    let keys: Vec<String> = (0..DUMMIES)
        .flat_map(|n| [format!("present-{n}-a"), format!("present-{n}-b")])
        .collect();
    let items: Vec<(&str, [&[u8]; 1])> = keys.iter().map(|k| (k.as_str(), [&b"v"[..]])).collect();
    let items: Vec<(&str, &[&[u8]])> = items.iter().map(|(k, v)| (*k, &v[..])).collect();
    for result in real
        .put(&items, &hkvm_client::PutOptions::default())
        .await
        .unwrap()
    {
        result.unwrap();
    }
    let port = 20_000 + (std::process::id() % 20_000) as u16;
    let server = DummyServer::start(Arc::clone(&real), port).unwrap();
    let mut dummies = Vec::new();
    for _ in 0..DUMMIES {
        dummies.push(Arc::new(
            DummyClient::connect(port, 1 << 20, 1 << 20).await.unwrap(),
        ));
    }
    let coalesced = concurrent_exists(&dummies, || {
        real.kv()
            .metadata()
            .stats()
            .requests
            .load(Ordering::Relaxed)
    })
    .await;
    // The same calls from independent clients: one request each.
    let mut independent = Vec::new();
    for _ in 0..DUMMIES {
        independent.push(store(&pool, None).await);
    }
    let before: u64 = independent
        .iter()
        .map(|s| s.kv().metadata().stats().requests.load(Ordering::Relaxed))
        .sum();
    let calls = independent.iter().enumerate().map(|(n, s)| async move {
        let exists = s
            .exist(&[format!("present-{n}-a"), format!("present-{n}-b")])
            .await
            .unwrap();
        assert_eq!(exists, [true, true]);
    });
    futures::future::join_all(calls).await;
    let after: u64 = independent
        .iter()
        .map(|s| s.kv().metadata().stats().requests.load(Ordering::Relaxed))
        .sum();
    assert_eq!(
        after - before,
        DUMMIES as u64,
        "independent clients ask once each"
    );
    assert!(
        coalesced * 4 <= DUMMIES as u64,
        "{DUMMIES} dummies' calls took {coalesced} sub-master requests"
    );
    assert!(server.stats().requests.load(Ordering::Relaxed) >= DUMMIES as u64);
    for s in independent {
        s.close().await;
    }
    real.close().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn dummies_move_values_through_shared_memory() {
    let pool = Pool::start(
        PoolSpec::new("dummies-data")
            .subcluster("sc-0", &[])
            .nodes(2, 16 << 20)
            .global("g-dummies"),
    )
    .await;
    let real = Arc::new(store(&pool, Some(CoalesceConfig::default())).await);
    let port = 20_000 + ((std::process::id() + 7) % 20_000) as u16;
    let _server = DummyServer::start(Arc::clone(&real), port).unwrap();
    let writer = DummyClient::connect(port, 1 << 20, 0).await.unwrap();
    let reader = DummyClient::connect(port, 1 << 20, 0).await.unwrap();
    let value: Vec<u8> = (0..100_000u32).map(|i| (i % 251) as u8).collect();
    let src = writer.pool_alloc(value.len() as u64).unwrap();
    // SAFETY: a range this test allocated and alone uses.
    unsafe { writer.region().slice_mut(src, value.len() as u64) }
        .unwrap()
        .copy_from_slice(&value);
    let len = value.len() as u64;
    let put = writer
        .call(&DummyRequest::Put {
            keys: vec!["shared".into()],
            spans: vec![vec![Span::in_pool(src, len)]],
            placement: Placement {
                replicas: 1,
                ..Placement::default()
            },
        })
        .await
        .unwrap();
    assert_eq!(put, DummyReply::Codes(vec![0]));
    let dst = reader.pool_alloc(len).unwrap();
    let spare = reader.pool_alloc(1).unwrap();
    let got = reader
        .call(&DummyRequest::GetInto {
            keys: vec!["shared".into(), "absent".into()],
            spans: vec![vec![Span::in_pool(dst, len)], vec![Span::in_pool(spare, 1)]],
        })
        .await
        .unwrap();
    assert_eq!(got, DummyReply::Sizes(vec![len as i64, -704]));
    // A destination that overlaps an earlier key's is refused (two writers of
    // the same bytes), the earlier key still served.
    let clashing = reader
        .call(&DummyRequest::GetInto {
            keys: vec!["shared".into(), "shared".into()],
            spans: vec![
                vec![Span::in_pool(dst, len)],
                vec![Span::in_pool(dst + 10, 1)],
            ],
        })
        .await
        .unwrap();
    assert_eq!(clashing, DummyReply::Sizes(vec![len as i64, -600]));
    // SAFETY: the real client finished writing (its reply arrived).
    assert_eq!(
        unsafe { reader.region().slice(dst, len) }.unwrap(),
        value.as_slice()
    );
    // A span outside the region is refused per key, not served.
    let outside = reader
        .call(&DummyRequest::GetInto {
            keys: vec!["shared".into()],
            spans: vec![vec![Span::in_pool(reader.region().len() - 10, 100)]],
        })
        .await
        .unwrap();
    assert_eq!(outside, DummyReply::Sizes(vec![-600]));
    real.close().await;
}
