//! The event log contract run against the in-memory twin (JetStream runs the same
//! contract in `hkvm-itests`), plus group commit.
#![allow(clippy::unwrap_used)]

#[path = "support/log_contract.rs"]
mod log_contract;

use hkvm_events::{KvEvent, Limits, ProducerId};
use hkvm_log::commit::{CommitConfig, CommitError, GroupCommitter};
use hkvm_log::{EventLog, LogErrorKind, MemoryLog, ReadOptions};

use log_contract::{
    a_follower_sees_later_appends, append, appends_are_fenced_and_deduplicated,
    many_callers_share_messages, put, read_all, reads_start_anywhere_and_stop_where_asked,
};

#[tokio::test]
async fn memory_log_keeps_the_contract() {
    appends_are_fenced_and_deduplicated(MemoryLog::new("a")).await;
    reads_start_anywhere_and_stop_where_asked(MemoryLog::new("b")).await;
    a_follower_sees_later_appends(MemoryLog::new("c")).await;
}

// ---- truncation --------------------------------------------------------------------

#[tokio::test]
async fn a_purged_start_is_reported_as_truncated() {
    let memory = MemoryLog::new("m");
    for i in 0..5u64 {
        memory
            .append(append(Some(i), &format!("t-{i}"), "x"))
            .await
            .unwrap();
    }
    memory.purge_through(3);
    let err = memory.read(ReadOptions::from(2)).await.err().unwrap();
    assert_eq!(
        err.kind(),
        &LogErrorKind::Truncated {
            requested: 2,
            first_seq: 4
        }
    );
    assert_eq!(read_all(&memory, ReadOptions::from(4)).await.len(), 2);
}

// ---- group commit ------------------------------------------------------------------

#[tokio::test]
async fn group_commit_packs_concurrent_callers_into_few_messages() {
    many_callers_share_messages(MemoryLog::new("gc")).await;
}

#[tokio::test]
async fn a_fenced_committer_fails_and_stays_stopped() {
    let log = MemoryLog::new("fence");
    // Another writer got there first.
    log.append(append(Some(0), "other", "x")).await.unwrap();
    let committer = GroupCommitter::spawn(
        log.clone(),
        ProducerId::new("deposed").unwrap(),
        1,
        0,
        CommitConfig::default(),
    );
    let err = committer.commit(vec![put("a")]).await.unwrap_err();
    assert!(
        matches!(&err, CommitError::Log(e) if matches!(e.kind(), LogErrorKind::Fenced { expected: 0 })),
        "{err}"
    );
    let later = committer.commit(vec![put("b")]).await.unwrap_err();
    assert!(matches!(later, CommitError::Stopped(_)), "{later}");
    assert_eq!(
        log.bounds().await.unwrap().last_seq,
        1,
        "nothing was appended"
    );
}

#[tokio::test]
async fn invalid_or_oversized_submissions_are_rejected_alone() {
    let log = MemoryLog::new("bad");
    let committer = GroupCommitter::spawn(
        log.clone(),
        ProducerId::new("sm").unwrap(),
        1,
        0,
        CommitConfig {
            limits: Limits {
                max_message_bytes: 4096,
                max_key_len: 64,
                ..Limits::default()
            },
            ..CommitConfig::default()
        },
    );
    let too_long = committer
        .commit(vec![put(&"k".repeat(65))])
        .await
        .unwrap_err();
    assert!(matches!(too_long, CommitError::Rejected(_)), "{too_long}");
    let many: Vec<KvEvent> = (0..100).map(|i| put(&format!("key-{i:040}"))).collect();
    let too_big = committer.commit(many).await.unwrap_err();
    assert!(
        too_big.to_string().contains("larger than the limit"),
        "{too_big}"
    );
    // The committer is still healthy.
    let ok = committer.commit(vec![put("fine")]).await.unwrap();
    assert_eq!(ok.seq, 1);
}

// ---- appends the stream does not answer --------------------------------------------

/// What [`Unanswering`] does with a send it does not pass through.
#[derive(Clone, Copy, PartialEq)]
enum Silence {
    /// Not stored, no answer (as while JetStream elects a stream leader).
    Lost,
    /// Stored, but the acknowledgement never came.
    StoredUnacknowledged,
    /// Not stored, and the acknowledgement is waited for forever (as when the
    /// stream leader died with the append).
    Hanging,
}

/// A log whose first `silent` sends go unanswered, one way or the other.
#[derive(Clone)]
struct Unanswering {
    inner: MemoryLog,
    silent: std::sync::Arc<std::sync::atomic::AtomicUsize>,
    how: Silence,
}

impl Unanswering {
    fn new(name: &str, silent: usize, how: Silence) -> Self {
        Self {
            inner: MemoryLog::new(name),
            silent: std::sync::Arc::new(std::sync::atomic::AtomicUsize::new(silent)),
            how,
        }
    }
}

impl EventLog for Unanswering {
    type PendingAck =
        futures::future::BoxFuture<'static, Result<hkvm_log::AppendAck, hkvm_log::LogError>>;

    async fn send(&self, append: hkvm_log::Append) -> Result<Self::PendingAck, hkvm_log::LogError> {
        use std::sync::atomic::Ordering;
        let silent = self
            .silent
            .fetch_update(Ordering::SeqCst, Ordering::SeqCst, |n| n.checked_sub(1))
            .is_ok();
        if !silent {
            return Ok(Box::pin(self.inner.send(append).await?));
        }
        let kind = match self.how {
            Silence::Hanging => return Ok(Box::pin(futures::future::pending())),
            Silence::Lost => LogErrorKind::StreamNotFound,
            Silence::StoredUnacknowledged => {
                self.inner.append(append).await?;
                LogErrorKind::Timeout
            }
        };
        Ok(Box::pin(futures::future::ready(Err(
            hkvm_log::LogError::new("unanswering", kind),
        ))))
    }

    async fn bounds(&self) -> Result<hkvm_log::LogBounds, hkvm_log::LogError> {
        self.inner.bounds().await
    }

    async fn first_seq_since(&self, unix_ms: u64) -> Result<u64, hkvm_log::LogError> {
        self.inner.first_seq_since(unix_ms).await
    }

    async fn read(
        &self,
        options: ReadOptions,
    ) -> Result<hkvm_log::EntryStream, hkvm_log::LogError> {
        self.inner.read(options).await
    }
}

/// Every event key in `log`, in stream order.
async fn keys_in(log: &MemoryLog) -> Vec<String> {
    let mut keys = Vec::new();
    for entry in read_all(log, ReadOptions::from(1)).await {
        let message = hkvm_events::decode_message(&entry.payload, &Limits::default()).unwrap();
        for event in message.events {
            if let Ok(KvEvent::PutCommitted(put)) = event {
                keys.push(put.key);
            }
        }
    }
    keys
}

#[tokio::test]
async fn appends_unanswered_during_an_election_are_sent_again_in_order() {
    let log = Unanswering::new("election", 3, Silence::Lost);
    let committer = GroupCommitter::spawn(
        log.clone(),
        ProducerId::new("sm").unwrap(),
        1,
        0,
        CommitConfig {
            // One event per message: several appends are in flight when the
            // first goes unanswered.
            max_events_per_message: 1,
            ..CommitConfig::default()
        },
    );
    let mut pending = Vec::new();
    for i in 0..20 {
        pending.push(
            committer
                .submit(vec![put(&format!("k{i:02}"))])
                .await
                .unwrap(),
        );
    }
    let mut seqs = Vec::new();
    for commit in pending {
        seqs.push(commit.await.unwrap().seq);
    }
    assert_eq!(seqs, (1..=20).collect::<Vec<u64>>(), "in submission order");
    let expected: Vec<String> = (0..20).map(|i| format!("k{i:02}")).collect();
    assert_eq!(
        keys_in(&log.inner).await,
        expected,
        "each stored once, in order"
    );
}

#[tokio::test]
async fn an_append_stored_but_unacknowledged_is_not_stored_twice() {
    let log = Unanswering::new("lost-ack", 1, Silence::StoredUnacknowledged);
    let committer = GroupCommitter::spawn(
        log.clone(),
        ProducerId::new("sm").unwrap(),
        1,
        0,
        CommitConfig::default(),
    );
    let committed = committer.commit(vec![put("once")]).await.unwrap();
    assert_eq!(committed.seq, 1);
    committer.commit(vec![put("next")]).await.unwrap();
    assert_eq!(
        keys_in(&log.inner).await,
        vec!["once".to_owned(), "next".to_owned()]
    );
}

#[tokio::test]
async fn a_stream_that_never_answers_again_stops_the_committer() {
    let log = Unanswering::new("gone", usize::MAX, Silence::Lost);
    let committer = GroupCommitter::spawn(
        log,
        ProducerId::new("sm").unwrap(),
        1,
        0,
        CommitConfig {
            retry_for: std::time::Duration::from_millis(300),
            ..CommitConfig::default()
        },
    );
    let error = committer.commit(vec![put("k")]).await.unwrap_err();
    assert!(
        matches!(&error, CommitError::Log(e) if e.kind() == &LogErrorKind::StreamNotFound),
        "{error}"
    );
    assert!(matches!(
        committer.commit(vec![put("later")]).await,
        Err(CommitError::Stopped(_))
    ));
}

#[tokio::test]
async fn an_append_waiting_past_its_ack_timeout_is_sent_again() {
    let log = Unanswering::new("hanging", 1, Silence::Hanging);
    let committer = GroupCommitter::spawn(
        log.clone(),
        ProducerId::new("sm").unwrap(),
        1,
        0,
        CommitConfig {
            ack_timeout: std::time::Duration::from_millis(50),
            ..CommitConfig::default()
        },
    );
    let started = std::time::Instant::now();
    let committed = committer.commit(vec![put("k")]).await.unwrap();
    assert_eq!(committed.seq, 1);
    assert_eq!(keys_in(&log.inner).await, vec!["k".to_owned()]);
    // Its times are those of the send that was answered: the second one, made
    // only after the first had waited out its acknowledgement timeout.
    assert!(committed.sent >= started + std::time::Duration::from_millis(50));
    assert!(committed.acknowledged >= committed.sent);
}

#[tokio::test]
async fn nothing_submitted_after_a_boundary_shares_a_message_with_what_came_before() {
    let log = MemoryLog::new("boundary");
    let committer = GroupCommitter::spawn(
        log.clone(),
        ProducerId::new("sm").unwrap(),
        1,
        0,
        CommitConfig::default(),
    );
    // All queued before the commit task runs (this runtime has one thread and
    // nothing here yields), so without the boundary they would share a message.
    let a = committer.submit(vec![put("a")]).await.unwrap();
    let b = committer.submit(vec![put("b")]).await.unwrap();
    let boundary = committer.submit_boundary().await.unwrap();
    let c = committer.submit(vec![put("c")]).await.unwrap();
    let d = committer.submit(vec![put("d")]).await.unwrap();
    let (a, b, boundary, c, d) = (
        a.await.unwrap(),
        b.await.unwrap(),
        boundary.await.unwrap(),
        c.await.unwrap(),
        d.await.unwrap(),
    );
    assert_eq!((a.seq, b.seq, boundary.seq), (1, 1, 1));
    assert_eq!(boundary.count, 0);
    assert_eq!((c.seq, d.seq), (2, 2), "the rest still share one message");
    // Alone, a boundary is an empty message of its own.
    let alone = committer.submit_boundary().await.unwrap().await.unwrap();
    assert_eq!(alone.seq, 3);
}
