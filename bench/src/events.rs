//! The `events` workload: encode/decode events/s against plain rmp-serde of the same
//! structs, and append/replay events/s through the event log against raw JetStream
//! publish/replay of the same message bytes, all in the same run.

use std::future::IntoFuture as _;
use std::sync::Arc;
use std::time::Instant;

use async_nats::jetstream;
use bytes::Bytes;
use futures::stream::FuturesOrdered;
use futures::StreamExt as _;
use hkvm_events::codec::{decode_message, Header, MessageBuilder};
use hkvm_events::key_ops::decode_key_ops;
use hkvm_events::subject::{event_subject, stream_name};
use hkvm_events::{
    ClusterId, KvEvent, Limits, Placement, ProducerId, PutCommitted, SegmentId, SubclusterId,
};
use hkvm_log::commit::{CommitConfig, GroupCommitter};
use hkvm_log::stream::{ensure_stream, StreamSettings};
use hkvm_log::{EventLog, JetStreamLog, ReadOptions};

use super::alloc::allocations;
use super::report::{BenchResult, Printer};
use super::BenchNats;

const WORKLOAD: &str = "events";
const EVENTS_PER_MESSAGE: usize = 1024;

/// Puts shaped like vLLM/SGLang block keys: ~40-byte keys, two replicas.
fn sample_puts(count: usize) -> Vec<PutCommitted> {
    let segments = [
        SegmentId::new("node-07-seg-0"),
        SegmentId::new("node-12-seg-0"),
    ];
    let [Ok(a), Ok(b)] = segments else {
        unreachable!("constant segment names are valid")
    };
    (0..count)
        .map(|i| {
            PutCommitted::new(
                format!("model-7b/tp0/block/{i:020}"),
                256 * 1024,
                i as u64 ^ 0x9e37_79b9_7f4a_7c15,
                vec![
                    Placement {
                        segment: a.clone(),
                        offset: (i as u64) << 18,
                    },
                    Placement {
                        segment: b.clone(),
                        offset: (i as u64) << 18,
                    },
                ],
            )
        })
        .collect()
}

fn per_second(count: usize, started: Instant) -> f64 {
    count as f64 / started.elapsed().as_secs_f64().max(1e-9)
}

fn header() -> anyhow::Result<Header> {
    Ok(Header {
        producer: ProducerId::new("bench")?,
        epoch: 1,
        unix_ms: 0,
    })
}

/// Encodes `puts` into messages of [`EVENTS_PER_MESSAGE`] events.
fn encode_all(events: &[KvEvent]) -> anyhow::Result<Vec<Vec<u8>>> {
    let header = header()?;
    let mut messages = Vec::new();
    for chunk in events.chunks(EVENTS_PER_MESSAGE) {
        let mut builder = MessageBuilder::new(&header, Vec::with_capacity(128 * 1024))?;
        for event in chunk {
            builder.push(event)?;
        }
        messages.push(builder.finish());
    }
    Ok(messages)
}

fn codec(puts: &[PutCommitted], printer: &mut Printer) -> anyhow::Result<Vec<Vec<u8>>> {
    let events: Vec<KvEvent> = puts.iter().cloned().map(KvEvent::PutCommitted).collect();
    let count = events.len();

    let allocs_before = allocations();
    let started = Instant::now();
    let messages = encode_all(&events)?;
    let encode_rate = per_second(count, started);
    let encode_allocs = (allocations() - allocs_before) as f64 / count as f64;

    let started = Instant::now();
    let mut plain = Vec::new();
    for chunk in puts.chunks(EVENTS_PER_MESSAGE) {
        plain.push(rmp_serde::to_vec_named(chunk)?);
    }
    let plain_encode_rate = per_second(count, started);

    let limits = Limits::default();
    let allocs_before = allocations();
    let started = Instant::now();
    let mut decoded = 0usize;
    for message in &messages {
        let message = decode_message(message, &limits)?;
        for event in message.events {
            event?;
            decoded += 1;
        }
    }
    let decode_rate = per_second(decoded, started);
    let decode_allocs = (allocations() - allocs_before) as f64 / decoded as f64;

    // The projector's decoder: keys borrowed, one allocation per message.
    let allocs_before = allocations();
    let started = Instant::now();
    let mut key_ops = 0usize;
    for (seq, message) in messages.iter().enumerate() {
        key_ops += decode_key_ops(seq as u64 + 1, 0, message, &limits)?.events;
    }
    let key_ops_rate = per_second(key_ops, started);
    let key_ops_allocs = (allocations() - allocs_before) as f64 / key_ops as f64;
    anyhow::ensure!(
        key_ops == decoded,
        "the key-op decoder read {key_ops} of {decoded} events"
    );

    let started = Instant::now();
    let mut plain_decoded = 0usize;
    for bytes in &plain {
        let chunk: Vec<PutCommitted> = rmp_serde::from_slice(bytes)?;
        plain_decoded += chunk.len();
    }
    let plain_decode_rate = per_second(plain_decoded, started);

    let bytes: usize = messages.iter().map(Vec::len).sum();
    let baseline = "rmp-serde Vec<PutCommitted>, same events";
    for result in [
        BenchResult::new(
            WORKLOAD,
            "encode (envelope, 1024/msg)",
            encode_rate,
            "events/s",
            baseline,
            plain_encode_rate,
        ),
        BenchResult::new(
            WORKLOAD,
            "decode + validate",
            decode_rate,
            "events/s",
            baseline,
            plain_decode_rate,
        ),
        BenchResult::new(
            WORKLOAD,
            "decode + validate into key operations (the projector's decoder)",
            key_ops_rate,
            "events/s",
            "decode + validate (above)",
            decode_rate,
        ),
        BenchResult::new(
            WORKLOAD,
            "key-operation decode allocations per event",
            key_ops_allocs,
            "allocs",
            "decode allocations per event (below)",
            decode_allocs,
        ),
        BenchResult::new(
            WORKLOAD,
            "encode allocations per event",
            encode_allocs,
            "allocs",
            "none",
            0.0,
        ),
        BenchResult::new(
            WORKLOAD,
            "decode allocations per event",
            decode_allocs,
            "allocs",
            "none",
            0.0,
        ),
        BenchResult::new(
            WORKLOAD,
            "encoded size per put event",
            bytes as f64 / count as f64,
            "bytes",
            "none",
            0.0,
        ),
    ] {
        printer.print(&result);
    }
    Ok(messages)
}

async fn fresh_log(js: &jetstream::Context, name: &str) -> anyhow::Result<JetStreamLog> {
    let cluster = ClusterId::new("bench")?;
    let sc = SubclusterId::new(name)?;
    let _ = js.delete_stream(stream_name(&cluster, &sc)).await;
    ensure_stream(js, &cluster, &sc, &StreamSettings::default()).await?;
    Ok(JetStreamLog::new(
        js.clone(),
        stream_name(&cluster, &sc),
        event_subject(&cluster, &sc),
    ))
}

/// Appends through the group committer with `callers` concurrent tasks, each
/// committing `per_commit` events at a time. Returns events/s.
async fn append_through_committer(
    log: &JetStreamLog,
    events: &Arc<Vec<KvEvent>>,
    callers: usize,
    per_commit: usize,
) -> anyhow::Result<f64> {
    let committer = GroupCommitter::spawn(
        log.clone(),
        ProducerId::new("bench")?,
        1,
        log.bounds().await?.last_seq,
        CommitConfig::default(),
    );
    let started = Instant::now();
    let tasks: Vec<_> = (0..callers)
        .map(|caller| {
            let committer = committer.clone();
            let events = Arc::clone(events);
            tokio::spawn(async move {
                let mine: Vec<&KvEvent> = events.iter().skip(caller).step_by(callers).collect();
                for batch in mine.chunks(per_commit) {
                    committer
                        .commit(batch.iter().map(|e| (*e).clone()).collect())
                        .await?;
                }
                anyhow::Ok(())
            })
        })
        .collect();
    for task in tasks {
        task.await??;
    }
    Ok(per_second(events.len(), started))
}

/// Publishes `payloads` with plain JetStream publishes, `window` acks outstanding.
async fn raw_publish(
    js: &jetstream::Context,
    subject: &str,
    payloads: &[Bytes],
    window: usize,
) -> anyhow::Result<f64> {
    let started = Instant::now();
    let mut pending = FuturesOrdered::new();
    for payload in payloads {
        if pending.len() >= window {
            if let Some(ack) = pending.next().await {
                let _: jetstream::publish::PublishAck = ack?;
            }
        }
        pending.push_back(
            js.publish(subject.to_owned(), payload.clone())
                .await?
                .into_future(),
        );
    }
    while let Some(ack) = pending.next().await {
        ack?;
    }
    Ok(started.elapsed().as_secs_f64())
}

async fn append_and_replay(
    nats: &BenchNats,
    puts: &[PutCommitted],
    printer: &mut Printer,
) -> anyhow::Result<()> {
    let js = jetstream::new(nats.connect().await?);
    let events: Arc<Vec<KvEvent>> =
        Arc::new(puts.iter().cloned().map(KvEvent::PutCommitted).collect());
    let count = events.len();

    let log = fresh_log(&js, "committed").await?;
    let single_rate = append_through_committer(&log, &events, 64, 1).await?;
    let batched = fresh_log(&js, "batched").await?;
    let batch_rate = append_through_committer(&batched, &events, 8, 256).await?;

    // The raw baseline publishes exactly the bytes the committer wrote.
    let mut payloads = Vec::new();
    let mut entries = log.read(ReadOptions::from(1)).await?;
    while let Some(entry) = entries.next().await {
        payloads.push(entry?.payload);
    }
    let raw = fresh_log(&js, "raw").await?;
    let raw_seconds = raw_publish(&js, raw.subject(), &payloads, 8).await?;
    let raw_rate = count as f64 / raw_seconds;
    let baseline = format!("raw JetStream publish, same {} msgs", payloads.len());
    printer.print(&BenchResult::new(
        WORKLOAD,
        "append, 64 callers x 1 event",
        single_rate,
        "events/s",
        &baseline,
        raw_rate,
    ));
    printer.print(&BenchResult::new(
        WORKLOAD,
        "append, 8 callers x 256-event batches",
        batch_rate,
        "events/s",
        &baseline,
        raw_rate,
    ));

    // Replay: the event log plus decoding, against a raw pull consumer (no decoding).
    let limits = Limits::default();
    let started = Instant::now();
    let mut replayed = 0usize;
    let mut entries = log.read(ReadOptions::from(1)).await?;
    while let Some(entry) = entries.next().await {
        let entry = entry?;
        for event in decode_message(&entry.payload, &limits)?.events {
            event?;
            replayed += 1;
        }
    }
    let replay_rate = per_second(replayed, started);

    let raw_seconds =
        super::raw::replay_seconds(&js, log.stream_name(), payloads.len() as u64, 1024).await?;
    let raw_replay_rate = count as f64 / raw_seconds.max(1e-9);
    printer.print(&BenchResult::new(
        WORKLOAD,
        "replay + decode",
        replay_rate,
        "events/s",
        "raw JetStream pull replay, same msgs",
        raw_replay_rate,
    ));
    Ok(())
}

/// Runs the workload.
///
/// # Errors
/// When NATS fails or a decode fails (which would be a bug).
pub async fn run(nats: &BenchNats, quick: bool, printer: &mut Printer) -> anyhow::Result<()> {
    let count = if quick { 50_000 } else { 1_000_000 };
    eprintln!("bench events: {count} put events");
    let puts = sample_puts(count);
    codec(&puts, printer)?;
    eprintln!("bench events: append and replay through JetStream");
    append_and_replay(nats, &puts, printer).await
}
