//! The event log over one JetStream stream: appends with `Nats-Expected-Last-Sequence`
//! fencing and `Nats-Msg-Id` dedup, pipelined through JetStream's publish-ack
//! futures; reads through an ephemeral pull consumer fetching bounded batches
//! ([`super::pull`]).

use std::time::Duration;

use async_nats::jetstream::consumer::{pull, AckPolicy, DeliverPolicy};
use async_nats::jetstream::context::{PublishAckFuture, PublishErrorKind};
use async_nats::jetstream::message::PublishMessage;
use async_nats::jetstream::{self, stream};
use futures::future::BoxFuture;
use futures::FutureExt as _;

use super::pull::PullReader;
use super::{
    check_not_truncated, gap_checked, read_end, Append, AppendAck, EntryStream, EventLog,
    LogBounds, LogError, LogErrorKind, ReadOptions,
};
use crate::connection::ConnectionEpoch;

/// The idle heartbeat a read asks of the server while it holds one of the read's
/// pull requests and has nothing to send. Silence for two of them means the server
/// holds no request: the read asks again once, and ends with an error the second
/// time (a follower then reopens at its position). While idle it costs one small
/// message a second per read.
const READ_HEARTBEAT: Duration = Duration::from_secs(1);

/// What a stream holds ([`JetStreamLog::stats`]).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct StreamStats {
    /// Its first and last sequence.
    pub bounds: LogBounds,
    /// Messages stored.
    pub messages: u64,
    /// Bytes stored.
    pub bytes: u64,
}

/// An [`EventLog`] over the JetStream stream `stream` whose subject is `subject`.
#[derive(Debug, Clone)]
pub struct JetStreamLog {
    js: jetstream::Context,
    stream: String,
    subject: String,
}

impl JetStreamLog {
    /// A log over an existing stream (see [`crate::stream::ensure_stream`]).
    pub fn new(
        js: jetstream::Context,
        stream: impl Into<String>,
        subject: impl Into<String>,
    ) -> Self {
        Self {
            js,
            stream: stream.into(),
            subject: subject.into(),
        }
    }

    /// The stream name.
    pub fn stream_name(&self) -> &str {
        &self.stream
    }

    /// The subject appends go to.
    pub fn subject(&self) -> &str {
        &self.subject
    }

    /// The stream's bounds and its identity: its creation time (Unix ns), which
    /// changes when the stream is deleted and created again under the same name.
    ///
    /// # Errors
    /// [`LogErrorKind::StreamNotFound`] when the stream vanished, or a transport
    /// error.
    pub async fn bounds_and_epoch(&self) -> Result<(LogBounds, u64), LogError> {
        let info = self.info().await?;
        let epoch = u64::try_from(info.created.unix_timestamp_nanos()).unwrap_or_default();
        Ok((bounds_of(&info), epoch))
    }

    /// What the stream holds: its bounds, messages and bytes.
    ///
    /// # Errors
    /// [`LogErrorKind::StreamNotFound`] when the stream vanished, or a transport
    /// error.
    pub async fn stats(&self) -> Result<StreamStats, LogError> {
        let info = self.info().await?;
        Ok(StreamStats {
            bounds: bounds_of(&info),
            messages: info.state.messages,
            bytes: info.state.bytes,
        })
    }

    /// The stream's info, fresh from the server (looking the stream up asks the
    /// server for it: one round trip, not two).
    async fn info(&self) -> Result<stream::Info, LogError> {
        Ok(self.get_stream().await?.cached_info().clone())
    }

    /// Deletes every message up to and including `seq` (a purge up to a point
    /// every reader has passed); returns how many were deleted. Appends go on
    /// fenced on the same last sequence.
    ///
    /// # Errors
    /// [`LogErrorKind::StreamNotFound`] when the stream vanished, or a transport
    /// error.
    pub async fn purge_through(&self, seq: u64) -> Result<u64, LogError> {
        let stream = self.get_stream().await?;
        let purged = stream
            .purge()
            .sequence(seq.saturating_add(1))
            .await
            .map_err(|e| LogError::other(&self.stream, e))?;
        Ok(purged.purged)
    }

    async fn get_stream(&self) -> Result<stream::Stream, LogError> {
        use async_nats::jetstream::context::GetStreamErrorKind;
        use async_nats::jetstream::ErrorCode;
        self.js
            .get_stream(&self.stream)
            .await
            .map_err(|e| match e.kind() {
                GetStreamErrorKind::JetStream(inner)
                    if inner.error_code() == ErrorCode::STREAM_NOT_FOUND =>
                {
                    LogError::new(&self.stream, LogErrorKind::StreamNotFound)
                }
                _ => LogError::other(&self.stream, e),
            })
    }

    fn publish_error(
        &self,
        error: &async_nats::jetstream::context::PublishError,
        expected: Option<u64>,
    ) -> LogError {
        let kind = match error.kind() {
            PublishErrorKind::WrongLastSequence => LogErrorKind::Fenced {
                expected: expected.unwrap_or_default(),
            },
            PublishErrorKind::StreamNotFound => LogErrorKind::StreamNotFound,
            PublishErrorKind::TimedOut => LogErrorKind::Timeout,
            PublishErrorKind::MaxPayloadExceeded => LogErrorKind::TooLarge(error.to_string()),
            _ => LogErrorKind::Other(error.to_string()),
        };
        LogError::new(&self.stream, kind)
    }
}

impl JetStreamLog {
    /// JetStream checks the expected sequence before the message id, so a retried
    /// append whose first copy was stored comes back fenced. It is our own copy, not
    /// another writer's, when the message right after the fence carries our id.
    async fn earlier_copy(&self, seq: u64, msg_id: &str) -> Option<AppendAck> {
        let stream = self.get_stream().await.ok()?;
        let stored = stream.get_raw_message(seq).await.ok()?;
        let stored_id = stored.headers.get(async_nats::header::NATS_MESSAGE_ID)?;
        (stored_id.as_str() == msg_id).then_some(AppendAck {
            seq,
            duplicate: true,
        })
    }
}

fn bounds_of(info: &stream::Info) -> LogBounds {
    LogBounds {
        first_seq: info.state.first_sequence,
        last_seq: info.state.last_sequence,
    }
}

impl EventLog for JetStreamLog {
    type PendingAck = BoxFuture<'static, Result<AppendAck, LogError>>;

    async fn send(&self, append: Append) -> Result<Self::PendingAck, LogError> {
        let mut message = PublishMessage::build()
            .payload(append.payload)
            .message_id(&append.msg_id);
        if let Some(expected) = append.expected_last_seq {
            message = message.expected_last_sequence(expected);
        }
        let expected = append.expected_last_seq;
        // Taken before the send: a reconnection during it may have lost it too.
        let epoch = ConnectionEpoch::of(&self.js.client());
        let pending: PublishAckFuture = self
            .js
            .send_publish(self.subject.clone(), message)
            .await
            .map_err(|e| self.publish_error(&e, expected))?;
        let log = self.clone();
        let msg_id = append.msg_id;
        Ok(async move {
            let answer = tokio::select! {
                answer = pending => answer,
                () = epoch.replaced() => {
                    return Err(LogError::new(&log.stream, LogErrorKind::ConnectionReplaced));
                }
            };
            match answer {
                Ok(ack) => Ok(AppendAck {
                    seq: ack.sequence,
                    duplicate: ack.duplicate,
                }),
                Err(error) => {
                    let error = log.publish_error(&error, expected);
                    match (error.kind(), expected) {
                        (LogErrorKind::Fenced { .. }, Some(expected)) => {
                            log.earlier_copy(expected + 1, &msg_id).await.ok_or(error)
                        }
                        _ => Err(error),
                    }
                }
            }
        }
        .boxed())
    }

    async fn bounds(&self) -> Result<LogBounds, LogError> {
        Ok(bounds_of(&self.info().await?))
    }

    async fn first_seq_since(&self, unix_ms: u64) -> Result<u64, LogError> {
        // Binary search over stored times: streams are gap-free past their first
        // sequence (single deletes are denied), so every probe hits a message.
        let stream = self.get_stream().await?;
        let bounds = self.bounds().await?;
        let (mut low, mut high) = (bounds.first_seq.max(1), bounds.last_seq + 1);
        while low < high {
            let middle = low + (high - low) / 2;
            let message = stream
                .get_raw_message(middle)
                .await
                .map_err(|e| LogError::other(&self.stream, e))?;
            let stored_ms =
                u64::try_from(message.time.unix_timestamp_nanos() / 1_000_000).unwrap_or_default();
            if stored_ms < unix_ms {
                low = middle + 1;
            } else {
                high = middle;
            }
        }
        Ok(low)
    }

    async fn read(&self, options: ReadOptions) -> Result<EntryStream, LogError> {
        let stream = self.get_stream().await?;
        let bounds = self.bounds().await?;
        check_not_truncated(&self.stream, &options, bounds)?;
        let end = read_end(&options, bounds);
        let from = options.from_seq.max(1);
        if end.is_some_and(|end| from > end) {
            return Ok(Box::pin(futures::stream::empty()));
        }
        let consumer = stream
            .create_consumer(pull::Config {
                deliver_policy: DeliverPolicy::ByStartSequence {
                    start_sequence: from,
                },
                ack_policy: AckPolicy::None,
                memory_storage: true,
                inactive_threshold: Duration::from_secs(60),
                description: Some("hkvm event log reader".to_owned()),
                ..Default::default()
            })
            .await
            .map_err(|e| LogError::other(&self.stream, e))?;
        let consumer_name = consumer.cached_info().name.clone();
        let reader = PullReader::open(
            self.js.clone(),
            &self.stream,
            &consumer_name,
            options.batch_bytes,
            READ_HEARTBEAT,
            if options.follow {
                options.linger
            } else {
                Duration::ZERO
            },
        )
        .await?;
        // Stop right after the last wanted entry instead of waiting for one more.
        let entries =
            futures::stream::unfold((reader, false), move |(mut reader, done)| async move {
                if done {
                    return None;
                }
                let entry = reader.next_entry().await;
                let last = match &entry {
                    Ok(entry) => end.is_some_and(|end| entry.seq >= end),
                    Err(_) => true,
                };
                Some((entry, (reader, last)))
            });
        Ok(gap_checked(self.stream.clone(), from, Box::pin(entries)))
    }
}
