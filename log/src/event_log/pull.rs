//! Reads of a JetStream pull consumer with exact request accounting.
//!
//! A pull consumer delivers only against pull requests, each a budget of messages
//! and bytes; the server serves its open requests in turn and ends one when its
//! budget is spent (silently), when it expires, or when the next message does not
//! fit (a `409` status carrying what was left). A reader must know how much budget
//! it still has at the server, so that it asks again before running dry and never
//! waits on a request the server no longer holds.
//!
//! The books count bytes only. A request asks for as many messages as bytes, so
//! its message count can never run out before its bytes do (every message is at
//! least one byte), and the bytes the server charges a message (subject, reply,
//! headers, payload) are exactly what the client reads as its length: a request
//! that ends silently ends with nothing left, and the sum of what the open
//! requests still allow is known exactly whichever request each message was
//! charged to. (Books of messages *and* bytes cannot be kept: a request that runs
//! out of one silently takes what it had left of the other with it.)
//!
//! [`PullBudget`] is that bookkeeping, pure and unit-tested against a model of the
//! server. [`PullReader`] books a request as soon as the client took it, before
//! reading any answer and on the task that reads the answers, so no answer can be
//! counted against a request not yet booked. (async-nats 0.51's message stream
//! books a request only when its sending task reports back; a request the server
//! answered in full before that report stays booked forever, and the read waits
//! with no request at the server: the stall seen in global-master replays of large
//! messages.) Should the books still drift from the server's (a server restart
//! that drops its requests without a word), two missed idle heartbeats mean the
//! server holds no request: the reader forgets its books and asks again once, and
//! only a second silent spell ends the read with an error.

use std::time::Duration;

use async_nats::jetstream;
use async_nats::{Client, StatusCode, Subject, Subscriber};
use bytes::Bytes;
use futures::StreamExt as _;
use tokio::time::Instant;

use super::linger::{Lingering, Request};
use super::{LogEntry, LogError};

/// The API prefix of every JetStream context HKVM opens (no JetStream domain).
const API_PREFIX: &str = "$JS.API";

/// How long the server holds one pull request before ending it with a `408`; the
/// reader then asks again.
const REQUEST_EXPIRY: Duration = Duration::from_secs(30);

/// What a request's byte budget holds beyond the server's `max_payload`, for a
/// message's subject and headers: every message the server accepts fits one
/// request, however small a budget the caller asked for.
const BUDGET_HEADROOM: usize = 16 << 10;

/// Silent spells (two idle heartbeats without a message) a read survives by asking
/// again; the next one ends it with an error.
const SILENT_SPELLS_TOLERATED: u32 = 1;

/// The bytes a reader has asked for and not yet received: the sum of what its open
/// pull requests still allow. A new request is due when half of it is spent, so at
/// most about one and a half requests are open at a time.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct PullBudget {
    request_bytes: usize,
    open_bytes: usize,
}

impl PullBudget {
    /// Books nothing yet; each request asks for `request_bytes`.
    pub(crate) fn new(request_bytes: usize) -> Self {
        Self {
            request_bytes: request_bytes.max(1),
            open_bytes: 0,
        }
    }

    /// The message count each request asks for: as many as its bytes, so that
    /// only its bytes ever end it.
    pub(crate) fn request_messages(&self) -> usize {
        self.request_bytes
    }

    /// Whether to send another request before waiting for answers.
    pub(crate) fn wants_request(&self) -> bool {
        self.open_bytes <= self.request_bytes / 2
    }

    /// Books one request's budget (before the request is sent).
    pub(crate) fn book(&mut self) {
        self.open_bytes += self.request_bytes;
    }

    /// One message of `length` bytes arrived against the open requests.
    pub(crate) fn delivered(&mut self, length: usize) {
        self.open_bytes = self.open_bytes.saturating_sub(length);
    }

    /// The server ended one request with `left_bytes` of its budget unspent, or,
    /// when it did not say how much, ended every request it held.
    pub(crate) fn ended(&mut self, left_bytes: Option<usize>) {
        match left_bytes {
            Some(left) => self.open_bytes = self.open_bytes.saturating_sub(left),
            None => self.forget(),
        }
    }

    /// Forgets every open request: the server holds none (asking again when it
    /// still held one only makes a request larger, never loses a message).
    pub(crate) fn forget(&mut self) {
        self.open_bytes = 0;
    }

    /// Whether any booked bytes are still unreceived.
    pub(crate) fn has_open(&self) -> bool {
        self.open_bytes > 0
    }

    /// The bytes booked and not yet received.
    #[cfg(test)]
    fn open(&self) -> usize {
        self.open_bytes
    }
}

/// What one message on the reader's inbox means.
#[derive(Debug, PartialEq, Eq)]
pub(crate) enum Delivery {
    /// A stored message.
    Message,
    /// The server still holds a request and has nothing to send.
    Heartbeat,
    /// The server ended a request (expired, next message too large, leadership
    /// change, shutdown), with the bytes it had left when it said so.
    Ended(Option<usize>),
    /// The read cannot go on: the consumer was deleted, a request broke the
    /// consumer's limits, the next message is larger than a whole request's byte
    /// budget (asking again would only be refused again), JetStream did not
    /// answer, or an unknown status came.
    Fatal(String),
}

/// Classifies a message that arrived on the inbox of a reader whose requests ask
/// for `request_bytes` each.
pub(crate) fn classify(message: &async_nats::Message, request_bytes: usize) -> Delivery {
    let status = message.status.unwrap_or(StatusCode::OK);
    match status {
        StatusCode::OK => return Delivery::Message,
        StatusCode::IDLE_HEARTBEAT => return Delivery::Heartbeat,
        _ => {}
    }
    let description = message
        .description
        .as_deref()
        .unwrap_or_default()
        .to_ascii_lowercase();
    match status {
        // `404 No Messages` answers only requests that do not wait (a lingering
        // read's drains) when nothing is stored past the consumer.
        StatusCode::NOT_FOUND => Delivery::Ended(unspent_bytes(message)),
        StatusCode::TIMEOUT => Delivery::Ended(unspent_bytes(message)),
        StatusCode::REQUEST_TERMINATED
            if description == "consumer deleted"
                || description == "consumer is push based"
                || description.starts_with("exceeded max") =>
        {
            Delivery::Fatal(format!("pull request refused: {description}"))
        }
        StatusCode::REQUEST_TERMINATED => match unspent_bytes(message) {
            Some(left)
                if description == "message size exceeds maxbytes" && left >= request_bytes =>
            {
                Delivery::Fatal(format!(
                    "the next message is larger than a read's byte budget ({request_bytes} B)"
                ))
            }
            left => Delivery::Ended(left),
        },
        StatusCode::NO_RESPONDERS => {
            Delivery::Fatal("no responders: JetStream did not answer the pull request".into())
        }
        other => Delivery::Fatal(format!("unexpected status {other} {description}")),
    }
}

/// The bytes an ended request had left, from its `Nats-Pending-Bytes` header;
/// `None` when the headers do not say (or say it unreadably), which
/// [`PullBudget::ended`] takes as "every request".
fn unspent_bytes(message: &async_nats::Message) -> Option<usize> {
    let headers = message.headers.as_ref()?;
    headers
        .get("Nats-Pending-Bytes")?
        .as_str()
        .trim()
        .parse::<usize>()
        .ok()
}

/// The body of one pull request.
#[derive(serde::Serialize)]
struct PullRequest {
    batch: usize,
    /// Bytes (0: no byte limit).
    #[serde(skip_serializing_if = "is_zero_usize")]
    max_bytes: usize,
    /// Nanoseconds (0: none).
    #[serde(skip_serializing_if = "is_zero")]
    expires: u64,
    /// Nanoseconds (0: none).
    #[serde(skip_serializing_if = "is_zero")]
    idle_heartbeat: u64,
    /// Answer at once with what is stored instead of waiting for more.
    #[serde(skip_serializing_if = "std::ops::Not::not")]
    no_wait: bool,
}

impl PullRequest {
    fn encoded(&self, log: &str) -> Result<Bytes, LogError> {
        serde_json::to_vec(self)
            .map(Bytes::from)
            .map_err(|e| LogError::other(log, e))
    }
}

fn is_zero(value: &u64) -> bool {
    *value == 0
}

fn is_zero_usize(value: &usize) -> bool {
    *value == 0
}

/// The bodies of a lingering read's requests ([`super::linger`]).
struct LingerRequests {
    pacing: Lingering,
    drain: Bytes,
    wake: Bytes,
}

/// Reads one pull consumer's messages as [`LogEntry`]s, asking for more as the
/// budget runs down.
pub(crate) struct PullReader {
    log: String,
    client: Client,
    context: jetstream::Context,
    subject: Subject,
    inbox: Subject,
    subscriber: Subscriber,
    request: Bytes,
    budget: PullBudget,
    heartbeat: Duration,
    silent_spells: u32,
    lingering: Option<LingerRequests>,
}

impl PullReader {
    /// A reader of consumer `consumer` on stream `log`, asking for `batch_bytes`
    /// per request (raised to what the largest message the server accepts needs)
    /// with idle heartbeats every `heartbeat`. A non-zero `linger` makes it a
    /// lingering read ([`super::linger`]): once caught up, it lets new messages
    /// gather that long before fetching them.
    ///
    /// # Errors
    /// A transport error when the inbox cannot be subscribed.
    pub(crate) async fn open(
        context: jetstream::Context,
        log: &str,
        consumer: &str,
        batch_bytes: usize,
        heartbeat: Duration,
        linger: Duration,
    ) -> Result<Self, LogError> {
        let client = context.client();
        let inbox = Subject::from(client.new_inbox());
        let subscriber = client
            .subscribe(inbox.clone())
            .await
            .map_err(|e| LogError::other(log, e))?;
        let largest = client.server_info().max_payload + BUDGET_HEADROOM;
        let budget = PullBudget::new(batch_bytes.max(largest));
        let long = PullRequest {
            batch: budget.request_messages(),
            max_bytes: budget.request_bytes,
            expires: nanos(REQUEST_EXPIRY),
            idle_heartbeat: nanos(heartbeat),
            no_wait: false,
        };
        let lingering = if linger.is_zero() {
            None
        } else {
            let drain = PullRequest {
                expires: 0,
                idle_heartbeat: 0,
                no_wait: true,
                ..long
            };
            // No byte limit: one message ends it silently (with a byte limit
            // the server would follow the message with `409 Batch Completed`).
            let wake = PullRequest {
                batch: 1,
                max_bytes: 0,
                ..long
            };
            Some(LingerRequests {
                pacing: Lingering::new(linger),
                drain: drain.encoded(log)?,
                wake: wake.encoded(log)?,
            })
        };
        Ok(Self {
            log: log.to_owned(),
            subject: Subject::from(format!("{API_PREFIX}.CONSUMER.MSG.NEXT.{log}.{consumer}")),
            client,
            context,
            inbox,
            subscriber,
            request: long.encoded(log)?,
            budget,
            heartbeat,
            silent_spells: 0,
            lingering,
        })
    }

    /// Sends the request due now, if any: the next of a lingering read once its
    /// linger is over, or another long request when half the open budget is spent.
    /// A request is booked once the client took it (a publish future cancelled
    /// before that sent nothing) and before any answer is read (answers are read
    /// only on this task), so the books never wait on a request not sent.
    /// Cancel-safe: a linger cut short is waited out again on the next call.
    async fn ask(&mut self) -> Result<(), LogError> {
        let (body, lingering) = match &self.lingering {
            Some(lingering) => {
                let Some((request, after)) = lingering.pacing.due() else {
                    return Ok(());
                };
                if let Some(after) = after {
                    tokio::time::sleep_until(after).await;
                }
                let body = match request {
                    Request::Drain => lingering.drain.clone(),
                    Request::Wake => lingering.wake.clone(),
                };
                (body, Some(request))
            }
            None if self.budget.wants_request() => (self.request.clone(), None),
            None => return Ok(()),
        };
        self.client
            .publish_with_reply(self.subject.clone(), self.inbox.clone(), body)
            .await
            .map_err(|e| LogError::other(&self.log, e))?;
        self.budget.book();
        if let (Some(request), Some(lingering)) = (lingering, &mut self.lingering) {
            lingering.pacing.sent(request);
            tracing::trace!(log = %self.log, ?request, "pull request sent");
        }
        Ok(())
    }

    /// The next stored message, or the error that ends the read.
    pub(crate) async fn next_entry(&mut self) -> Result<LogEntry, LogError> {
        loop {
            self.ask().await?;
            let silence = self.heartbeat * 2;
            let message = match tokio::time::timeout(silence, self.subscriber.next()).await {
                Ok(Some(message)) => message,
                Ok(None) => return Err(LogError::other(&self.log, "the reader's inbox closed")),
                Err(_) => {
                    self.silent_spells += 1;
                    if self.silent_spells > SILENT_SPELLS_TOLERATED {
                        return Err(LogError::other(&self.log, "missed idle heartbeat"));
                    }
                    tracing::warn!(log = %self.log, ?silence, "no message or heartbeat: the server holds no request of this read; asking again");
                    self.budget.forget();
                    if let Some(lingering) = &mut self.lingering {
                        lingering.pacing.forget();
                    }
                    continue;
                }
            };
            self.silent_spells = 0;
            let at_end = matches!(
                message.status,
                Some(StatusCode::NOT_FOUND | StatusCode::TIMEOUT)
            );
            match classify(&message, self.budget.request_bytes) {
                Delivery::Message => {
                    self.budget.delivered(message.length);
                    if let Some(lingering) = &mut self.lingering {
                        let spent = !self.budget.has_open();
                        if lingering.pacing.message(spent, Instant::now()) {
                            self.budget.forget();
                        }
                    }
                    return self.entry(message);
                }
                Delivery::Heartbeat => {}
                Delivery::Ended(left) => {
                    self.budget.ended(left);
                    if let Some(lingering) = &mut self.lingering {
                        lingering.pacing.ended(at_end);
                        self.budget.forget();
                    }
                }
                Delivery::Fatal(reason) => return Err(LogError::other(&self.log, reason)),
            }
        }
    }

    fn entry(&self, message: async_nats::Message) -> Result<LogEntry, LogError> {
        let message = jetstream::Message {
            message,
            context: self.context.clone(),
        };
        let info = message.info().map_err(|e| LogError::other(&self.log, e))?;
        let nanos = info.published.unix_timestamp_nanos();
        Ok(LogEntry {
            seq: info.stream_sequence,
            unix_ms: u64::try_from(nanos / 1_000_000).unwrap_or_default(),
            payload: message.message.payload.clone(),
        })
    }
}

fn nanos(duration: Duration) -> u64 {
    u64::try_from(duration.as_nanos()).unwrap_or(u64::MAX)
}

#[cfg(test)]
mod tests;
