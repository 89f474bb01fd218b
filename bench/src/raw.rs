//! The raw JetStream baseline shared by the replay benchmarks: read a stream's
//! messages with a plain pull consumer, doing nothing with them.

use std::time::Instant;

use anyhow::Context as _;
use async_nats::jetstream::{self, consumer};
use futures::StreamExt as _;

/// Reads `messages` messages of `stream` from its start, `batch` per pull, and
/// returns the seconds it took.
///
/// # Errors
/// When the stream is missing or ends before `messages` were read.
pub async fn replay_seconds(
    js: &jetstream::Context,
    stream: &str,
    messages: u64,
    batch: usize,
) -> anyhow::Result<f64> {
    let started = Instant::now();
    let stream = js.get_stream(stream).await?;
    let consumer = stream
        .create_consumer(consumer::pull::Config {
            ack_policy: consumer::AckPolicy::None,
            memory_storage: true,
            ..Default::default()
        })
        .await?;
    let mut pulled = consumer
        .stream()
        .max_messages_per_batch(batch)
        .max_bytes_per_batch(16 << 20)
        .messages()
        .await?;
    for _ in 0..messages {
        let message = pulled.next().await.context("raw replay ended early")?;
        let _ = message?;
    }
    Ok(started.elapsed().as_secs_f64())
}
