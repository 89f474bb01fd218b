//! A sub-master leader change as its clients see it: a `put_end` sent again by
//! its put id learns committed or absent, and a client waiting out the failover
//! retries the moment the new leader announces itself.

use std::sync::atomic::Ordering;
use std::time::Duration;

use hkvm_client::{RetryPolicy, SubmasterClient};
use hkvm_events::rpc::submaster::{ItemError, ItemResult, PutEndItem};

use crate::fixture::Fixture;
use crate::submaster_server::{client, config, mount, start_item, SC};

/// Sends put_start for `key` under `put_id` and checks it reserved space.
async fn start_with_id(client: &SubmasterClient, key: &str, put_id: u64) {
    let mut item = start_item(key, 4096, 2);
    item.put_id = put_id;
    let started = client.put_start(vec![item]).await.unwrap();
    assert!(matches!(started[0], ItemResult::Ok(_)), "{started:?}");
}

fn end_with_id(key: &str, put_id: u64) -> PutEndItem {
    PutEndItem {
        key: key.into(),
        checksum: 1,
        put_id,
    }
}

#[tokio::test]
async fn a_put_end_sent_again_across_a_leader_change_learns_committed_or_absent() {
    let fixture = Fixture::new("t").await;
    let leader = fixture.spawn_submaster(config(&fixture, "sm-a")).await;
    let client = client(&fixture).await;
    for node in ["n1", "n2", "n3"] {
        mount(&client, node, 64 << 20).await;
    }
    // "done" commits (its reply, say, is lost); "lost" is reserved, never committed.
    start_with_id(&client, "done", 11).await;
    start_with_id(&client, "lost", 22).await;
    let ended = client.put_end(vec![end_with_id("done", 11)]).await.unwrap();
    assert_eq!(ended, vec![ItemResult::Ok(())]);
    let readers = fixture.readers(SC).await;
    let standby = fixture.spawn_submaster(config(&fixture, "sm-b")).await;
    fixture.wait_new_reader_at_end(SC, &readers).await;
    leader.abort();

    // Both commits sent again, to whichever leader answers: a definite answer each.
    let again = client
        .put_end(vec![end_with_id("done", 11), end_with_id("lost", 22)])
        .await
        .unwrap();
    assert_eq!(
        again,
        vec![ItemResult::Ok(()), ItemResult::Err(ItemError::NoPendingPut)],
        "committed before the change: committed; reserved only: absent"
    );
    assert_eq!(client.status().await.unwrap().producer, "sm-b");
    // Another put's id is never told that this commit is its own.
    let other = client.put_end(vec![end_with_id("done", 99)]).await.unwrap();
    assert_eq!(other, vec![ItemResult::Err(ItemError::NoPendingPut)]);
    assert_eq!(
        client
            .exist(vec!["done".into(), "lost".into()])
            .await
            .unwrap(),
        vec![true, false]
    );
    let commits = fixture.commits(SC).await;
    assert_eq!(commits.get("done"), Some(&1), "committed exactly once");
    standby.shutdown().await.unwrap();
}

#[tokio::test]
async fn a_client_waiting_out_a_failover_retries_when_the_new_leader_announces_itself() {
    let fixture = Fixture::new("t").await;
    let leader = fixture.spawn_submaster(config(&fixture, "sm-a")).await;
    // Back-off so long that only the announcement can end the wait in time.
    let client = fixture
        .submaster_client(
            SC,
            RetryPolicy {
                min_backoff: Duration::from_secs(20),
                max_backoff: Duration::from_secs(20),
                retry_deadline: Duration::from_secs(60),
                ..RetryPolicy::default()
            },
        )
        .await;
    mount(&client, "n1", 64 << 20).await;
    let readers = fixture.readers(SC).await;
    let standby = fixture.spawn_submaster(config(&fixture, "sm-b")).await;
    fixture.wait_new_reader_at_end(SC, &readers).await;
    // Woken by the announcement: in a wait before a retry, or in the wait for
    // the answer to a request nobody had taken.
    let woken = || {
        client.stats().leader_wakeups.load(Ordering::Relaxed)
            + client.stats().answers_lost.load(Ordering::Relaxed)
    };
    let woken_before = woken();
    leader.abort();
    let killed = std::time::Instant::now();
    // The lease outlives the leader by up to its TTL: this call starts waiting.
    let status = client.status().await.unwrap();
    println!(
        "served {} ms after the leader died; {:?}",
        killed.elapsed().as_millis(),
        client.stats()
    );
    assert_eq!(status.producer, "sm-b");
    assert_eq!(
        woken() - woken_before,
        1,
        "the wait ended with the announcement, not the 20 s back-off"
    );
    standby.shutdown().await.unwrap();
}
