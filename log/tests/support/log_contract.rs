//! The event log contract every implementation keeps (the in-memory twin here,
//! JetStream in `hkvm-itests`), as generic checks over [`EventLog`], and the group
//! commit check run against each.

use std::time::Duration;

use bytes::Bytes;
use futures::StreamExt as _;
use hkvm_events::{
    decode_message, KvEvent, Limits, Placement, ProducerId, PutCommitted, SegmentId,
};
use hkvm_log::commit::{CommitConfig, GroupCommitter};
use hkvm_log::{Append, EventLog, LogEntry, LogErrorKind, ReadOptions};

/// An append of `payload` as message `id`, fenced on `expected`.
pub fn append(expected: Option<u64>, id: &str, payload: &'static str) -> Append {
    Append {
        expected_last_seq: expected,
        msg_id: id.to_owned(),
        payload: Bytes::from_static(payload.as_bytes()),
    }
}

/// Every entry a bounded read returns (it must end by itself).
pub async fn read_all<L: EventLog>(log: &L, options: ReadOptions) -> Vec<LogEntry> {
    let stream = log.read(options).await.unwrap();
    tokio::time::timeout(
        Duration::from_secs(10),
        stream.map(Result::unwrap).collect(),
    )
    .await
    .expect("a bounded read ends by itself")
}

/// Appends are fenced on the expected last sequence and deduplicated by id.
pub async fn appends_are_fenced_and_deduplicated<L: EventLog>(log: L) {
    assert_eq!(log.bounds().await.unwrap().last_seq, 0);
    let first = log.append(append(Some(0), "m-1", "one")).await.unwrap();
    assert_eq!((first.seq, first.duplicate), (1, false));
    let second = log.append(append(Some(1), "m-2", "two")).await.unwrap();
    assert_eq!(second.seq, 2);

    // A writer that believes the log ends at 1 has been overtaken: fenced.
    let fenced = log
        .append(append(Some(1), "m-3", "stale"))
        .await
        .unwrap_err();
    assert_eq!(fenced.kind(), &LogErrorKind::Fenced { expected: 1 });

    // A retried append (same message id) is stored once and reports the first copy.
    let retried = log.append(append(Some(1), "m-2", "two")).await.unwrap();
    assert_eq!((retried.seq, retried.duplicate), (2, true));

    let entries = read_all(&log, ReadOptions::from(1)).await;
    let payloads: Vec<&[u8]> = entries.iter().map(|e| &e.payload[..]).collect();
    assert_eq!(payloads, vec![&b"one"[..], b"two"]);
    assert_eq!(log.bounds().await.unwrap().last_seq, 2);
}

/// Reads start at any sequence and stop where asked.
pub async fn reads_start_anywhere_and_stop_where_asked<L: EventLog>(log: L) {
    for i in 0..10u64 {
        log.append(append(Some(i), &format!("r-{i}"), "x"))
            .await
            .unwrap();
    }
    let tail = read_all(&log, ReadOptions::from(7)).await;
    assert_eq!(
        tail.iter().map(|e| e.seq).collect::<Vec<_>>(),
        vec![7, 8, 9, 10]
    );
    let middle = read_all(
        &log,
        ReadOptions {
            from_seq: 3,
            until_seq: Some(5),
            batch_messages: 2,
            ..ReadOptions::default()
        },
    )
    .await;
    assert_eq!(
        middle.iter().map(|e| e.seq).collect::<Vec<_>>(),
        vec![3, 4, 5]
    );
    assert!(read_all(&log, ReadOptions::from(11)).await.is_empty());
    assert!(tail.iter().all(|e| e.unix_ms > 1_600_000_000_000));
}

/// A following read sees appends made after it started.
pub async fn a_follower_sees_later_appends<L: EventLog + Clone>(log: L) {
    log.append(append(Some(0), "f-0", "before")).await.unwrap();
    let mut follow = log
        .read(ReadOptions {
            follow: true,
            ..ReadOptions::from(1)
        })
        .await
        .unwrap();
    assert_eq!(follow.next().await.unwrap().unwrap().seq, 1);
    let writer = log.clone();
    tokio::spawn(async move {
        tokio::time::sleep(Duration::from_millis(100)).await;
        writer
            .append(append(Some(1), "f-1", "after"))
            .await
            .unwrap();
    });
    let next = tokio::time::timeout(Duration::from_secs(10), follow.next())
        .await
        .unwrap()
        .unwrap()
        .unwrap();
    assert_eq!((next.seq, &next.payload[..]), (2, &b"after"[..]));
}

// ---- group commit ------------------------------------------------------------------

/// A `put` event of `key`.
pub fn put(key: &str) -> KvEvent {
    KvEvent::PutCommitted(PutCommitted::new(
        key,
        100,
        7,
        vec![Placement {
            segment: SegmentId::new("seg").unwrap(),
            offset: 0,
        }],
    ))
}

/// 200 concurrent callers of one group committer share few messages, and each
/// event is where its receipt says.
pub async fn many_callers_share_messages<L: EventLog + Clone>(log: L) {
    let committer = GroupCommitter::spawn(
        log.clone(),
        ProducerId::new("sm-test").unwrap(),
        1,
        0,
        CommitConfig::default(),
    );
    let callers: Vec<_> = (0..200)
        .map(|i| {
            let committer = committer.clone();
            tokio::spawn(async move { committer.commit(vec![put(&format!("k-{i}"))]).await })
        })
        .collect();
    let mut committed = Vec::new();
    for caller in callers {
        committed.push(caller.await.unwrap().unwrap());
    }
    let messages = read_all(&log, ReadOptions::from(1)).await;
    assert!(
        messages.len() < 200,
        "200 concurrent callers should share messages, got {}",
        messages.len()
    );
    // Every caller's event is exactly where its receipt says.
    let mut found = 0;
    for entry in &messages {
        let decoded = decode_message(&entry.payload, &Limits::default()).unwrap();
        assert_eq!(decoded.header.producer.as_str(), "sm-test");
        let events: Vec<KvEvent> = decoded.events.map(Result::unwrap).collect();
        for receipt in committed.iter().filter(|c| c.seq == entry.seq) {
            assert_eq!(receipt.count, 1);
            assert!(matches!(
                events[receipt.first_index],
                KvEvent::PutCommitted(_)
            ));
            found += 1;
        }
    }
    assert_eq!(found, 200);
    assert_eq!(committer.durable_seq(), messages.len() as u64);
}
