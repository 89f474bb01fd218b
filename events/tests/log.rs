//! The event log contract run against the in-memory twin (JetStream runs the same
//! contract in `hkvm-itests`), plus group commit.
#![allow(clippy::unwrap_used)]

#[path = "support/log_contract.rs"]
mod log_contract;

use hkvm_events::commit::{CommitConfig, CommitError, GroupCommitter};
use hkvm_events::log::{EventLog, LogErrorKind, MemoryLog, ReadOptions};
use hkvm_events::{KvEvent, Limits, ProducerId};

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
