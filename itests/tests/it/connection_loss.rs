//! A NATS server going away takes the answers to requests in flight with it: a
//! resendable request is sent again as soon as its connection is replaced, or as
//! soon as the leader announces itself (again), never after its whole request
//! timeout; and a sub-master whose own connection was replaced announces itself.

use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::Duration;

use futures::StreamExt as _;
use hkvm_client::{LeaderWatch, Resend, RetryPolicy, RpcCaller};
use hkvm_events::rpc::{self, RpcReply};
use hkvm_events::subject::leader_subject;
use hkvm_events::SubclusterId;

use crate::fixture::{wait_count, Fixture};

/// A request timeout no test waits out: a call that ends did not time out.
const NEVER: Duration = Duration::from_secs(600);

/// Answers every request on `subject` with its count, except the first, which
/// it swallows (its answer "went down with the connection"); returns how many
/// it received.
async fn swallow_the_first(nats: async_nats::Client, subject: &str) -> Arc<AtomicUsize> {
    let mut requests = nats.subscribe(subject.to_owned()).await.unwrap();
    nats.flush().await.unwrap();
    let received = Arc::new(AtomicUsize::new(0));
    let counter = Arc::clone(&received);
    tokio::spawn(async move {
        while let Some(request) = requests.next().await {
            let n = counter.fetch_add(1, Ordering::SeqCst) + 1;
            if let (Some(reply), true) = (request.reply, n > 1) {
                let body = rpc::encode(&RpcReply::<u32>::Ok(n as u32)).unwrap();
                nats.publish(reply, body.into()).await.unwrap();
            }
        }
    });
    received
}

fn caller(nats: async_nats::Client) -> RpcCaller {
    RpcCaller::new(
        nats,
        RetryPolicy {
            request_timeout: NEVER,
            retry_deadline: NEVER,
            ..RetryPolicy::default()
        },
    )
}

#[tokio::test]
async fn a_request_whose_connection_was_replaced_is_sent_again_at_once() {
    let fx = Fixture::new("connloss").await;
    let received = swallow_the_first(fx.connect().await, "test.connloss").await;
    let nats = hkvm_client::connect(&fx.url(), "test").await.unwrap();
    let caller = caller(nats.clone());
    let call = tokio::spawn({
        let caller = caller.clone();
        async move {
            caller
                .call::<_, u32>("probe", "test.connloss".into(), &1u8, Resend::Safe)
                .await
        }
    });
    wait_count("the first request", &received, 1).await;
    nats.force_reconnect().await.unwrap();
    assert_eq!(call.await.unwrap().unwrap(), 2);
    assert_eq!(caller.stats().answers_lost.load(Ordering::Relaxed), 1);
    assert_eq!(caller.stats().timeouts.load(Ordering::Relaxed), 0);
}

#[tokio::test]
async fn a_request_that_may_not_be_resent_waits_for_its_answer() {
    let fx = Fixture::new("connloss").await;
    let received = swallow_the_first(fx.connect().await, "test.connloss").await;
    let nats = hkvm_client::connect(&fx.url(), "test").await.unwrap();
    let caller = RpcCaller::new(
        nats.clone(),
        RetryPolicy {
            request_timeout: Duration::from_millis(300),
            ..RetryPolicy::default()
        },
    );
    let call = tokio::spawn({
        let caller = caller.clone();
        async move {
            caller
                .call::<_, u32>("probe", "test.connloss".into(), &1u8, Resend::Unsafe)
                .await
        }
    });
    wait_count("the first request", &received, 1).await;
    nats.force_reconnect().await.unwrap();
    let error = call.await.unwrap().unwrap_err();
    // Not sent again: it may have taken effect. Its own timeout reports it.
    assert!(
        matches!(error, hkvm_client::ClientError::Timeout { .. }),
        "{error}"
    );
    assert_eq!(received.load(Ordering::SeqCst), 1);
}

#[tokio::test]
async fn a_leader_announcement_sends_a_waiting_request_again() {
    let fx = Fixture::new("connloss").await;
    let received = swallow_the_first(fx.connect().await, "test.connloss").await;
    let nats = fx.connect().await;
    let subject = leader_subject(&fx.cluster, &SubclusterId::new("sc-0").unwrap());
    let watch = LeaderWatch::new(nats.clone(), subject.clone());
    let caller = caller(nats.clone());
    let call = tokio::spawn({
        let caller = caller.clone();
        async move {
            caller
                .call_checked::<_, u32, _, _>(
                    "probe",
                    "test.connloss".into(),
                    &1u8,
                    Resend::Safe,
                    || async { hkvm_client::Presence::Unknown },
                    Some(&watch),
                )
                .await
        }
    });
    wait_count("the first request", &received, 1).await;
    fx.client.publish(subject, "leader".into()).await.unwrap();
    assert_eq!(call.await.unwrap().unwrap(), 2);
    assert_eq!(caller.stats().answers_lost.load(Ordering::Relaxed), 1);
}

#[tokio::test]
async fn a_leader_whose_connection_was_replaced_announces_itself_again() {
    let fx = Fixture::new("connloss").await;
    fx.stream("sc-0").await;
    let subject = leader_subject(&fx.cluster, &SubclusterId::new("sc-0").unwrap());
    let watch = LeaderWatch::new(fx.connect().await, subject);
    let mut announcements = watch.announcements().await.unwrap();
    let submaster_nats = fx.connect().await;
    let handle = hkvm_submaster::SubmasterHandle::spawn(
        submaster_nats.clone(),
        fx.submaster_config("sc-0", "sm-a"),
    );
    // Leading: it announced itself once.
    announcements.changed().await.unwrap();
    announcements.borrow_and_update();
    submaster_nats.force_reconnect().await.unwrap();
    tokio::time::timeout(Duration::from_secs(30), announcements.changed())
        .await
        .expect("announced again after its connection was replaced")
        .unwrap();
    handle.shutdown().await.unwrap();
}
