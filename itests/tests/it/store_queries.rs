//! What a store asks the global master: nothing about a key its own sub-master
//! does not hold while the registry names no other sub-cluster, and the global
//! master again once another sub-cluster registers.

use std::time::Duration;

use futures::StreamExt as _;
use hkvm_client::store::{Store, StoreAddress, StoreConfig};
use hkvm_events::subject::global_rpc_subject;

use crate::fixture::{put, Fixture};

/// Key queries (`batch_is_exist` in any form, `locate`) that reached the
/// global master since the last count: read up to a marker published after
/// them.
async fn key_queries(fixture: &Fixture, seen: &mut async_nats::Subscriber) -> Vec<String> {
    let marker = global_rpc_subject(&fixture.cluster, "test-marker");
    fixture
        .client
        .publish(marker.clone(), "".into())
        .await
        .unwrap();
    fixture.client.flush().await.unwrap();
    let mut requests = Vec::new();
    loop {
        let message = tokio::time::timeout(Duration::from_secs(10), seen.next())
            .await
            .expect("the marker came back")
            .expect("the subscription is open");
        if message.subject.as_str() == marker {
            return requests;
        }
        let subject = message.subject.to_string();
        if subject.contains("batch_is_exist") || subject.ends_with(".locate") {
            requests.push(subject);
        }
    }
}

#[tokio::test]
async fn a_store_alone_in_its_cluster_answers_absent_keys_without_the_global_master() {
    let fixture = Fixture::new("solo").await;
    let _master = fixture
        .spawn_submaster(fixture.submaster_config("sc-a", "sm-a"))
        .await;
    let _global = fixture.start("g1").await;
    // Every request to the global master, as the NATS server routes it.
    let mut seen = fixture
        .client
        .subscribe(global_rpc_subject(&fixture.cluster, "*"))
        .await
        .unwrap();
    let address: StoreAddress = format!("{}/{}/sc-a", fixture.url(), fixture.cluster)
        .parse()
        .unwrap();
    let store = Store::open(StoreConfig::new(address, "127.0.0.1"))
        .await
        .unwrap();
    crate::fixture::poll_until(
        "the store to read the registry: sc-a alone",
        Duration::from_secs(20),
        || async { (!store.other_subclusters_possible()).then_some(()) },
    )
    .await;
    key_queries(&fixture, &mut seen).await;

    let absent = vec!["absent-1".to_owned(), "absent-2".to_owned()];
    assert_eq!(store.exist(&absent).await.unwrap(), vec![false, false]);
    let removed = store.remove(&absent, false).await.unwrap();
    assert!(removed.iter().all(Result::is_err), "{removed:?}");
    assert_eq!(
        key_queries(&fixture, &mut seen).await,
        Vec::<String>::new(),
        "a store alone asked the global master"
    );

    // Another sub-cluster, with a key of its own: the store asks again.
    let other = fixture.subcluster("sc-b", &[]).await;
    other.commit(vec![put("elsewhere")]).await;
    crate::fixture::poll_until("the store to see sc-b", Duration::from_secs(20), || async {
        store.other_subclusters_possible().then_some(())
    })
    .await;
    let elsewhere = vec!["elsewhere".to_owned()];
    crate::fixture::poll_until(
        "the global master to answer for sc-b's key",
        Duration::from_secs(20),
        || async { (store.exist(&elsewhere).await.unwrap() == [true]).then_some(()) },
    )
    .await;
    let asked = key_queries(&fixture, &mut seen).await;
    assert!(!asked.is_empty(), "the store did not ask the global master");
    store.close().await;
}
