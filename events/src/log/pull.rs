//! Reads of a JetStream pull consumer with exact request accounting.
//!
//! A pull consumer delivers only against pull requests, each a budget of messages
//! and bytes; the server holds a request until its budget is spent, it expires, or
//! the next message does not fit (a `409` status carrying what was left). A reader
//! must know how much budget it still has at the server, so that it asks again
//! before running dry and never waits on a request the server no longer holds.
//!
//! [`PullBudget`] is that bookkeeping, pure and unit-tested. [`PullReader`] books a
//! request *before* publishing it, on the task that reads the answers, so no answer
//! can be counted against a request not yet booked. (async-nats 0.51's message
//! stream books a request only when its sending task reports back; a request the
//! server answered in full before that report stays booked forever, and the read
//! waits with no request at the server: the stall seen in global-master replays of
//! large messages.) Should the books still drift from the server's, two missed idle
//! heartbeats mean the server holds no request: the reader forgets its books and
//! asks again once, and only a second silent spell ends the read with an error.

use std::time::Duration;

use async_nats::jetstream;
use async_nats::{Client, StatusCode, Subject, Subscriber};
use bytes::Bytes;
use futures::StreamExt as _;

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

/// The budget a reader has asked for and not yet received: the sum of what its
/// open pull requests still allow. A new request is due when either half of it is
/// spent, so at most about one and a half requests are open at a time.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct PullBudget {
    batch_messages: usize,
    batch_bytes: usize,
    messages: usize,
    bytes: usize,
}

impl PullBudget {
    /// Books nothing yet; each request asks for `batch_messages` and `batch_bytes`.
    pub(crate) fn new(batch_messages: usize, batch_bytes: usize) -> Self {
        Self {
            batch_messages: batch_messages.max(1),
            batch_bytes: batch_bytes.max(1),
            messages: 0,
            bytes: 0,
        }
    }

    /// Whether to send another request before waiting for answers.
    pub(crate) fn wants_request(&self) -> bool {
        self.messages <= self.batch_messages / 2 || self.bytes <= self.batch_bytes / 2
    }

    /// Books one request's budget (before the request is sent).
    pub(crate) fn book(&mut self) {
        self.messages += self.batch_messages;
        self.bytes += self.batch_bytes;
    }

    /// One message of `length` bytes arrived against the open requests.
    pub(crate) fn delivered(&mut self, length: usize) {
        self.messages = self.messages.saturating_sub(1);
        self.bytes = self.bytes.saturating_sub(length);
    }

    /// The server ended one request with `left` of its budget unspent, or, when it
    /// did not say how much, ended every request it held.
    pub(crate) fn ended(&mut self, left: Option<Unspent>) {
        match left {
            Some(left) => {
                self.messages = self.messages.saturating_sub(left.messages);
                self.bytes = self.bytes.saturating_sub(left.bytes);
            }
            None => self.forget(),
        }
    }

    /// Forgets every open request: the server holds none (asking again when it
    /// still held one only makes a request larger, never loses a message).
    pub(crate) fn forget(&mut self) {
        self.messages = 0;
        self.bytes = 0;
    }

    /// The messages and bytes booked and not yet received.
    #[cfg(test)]
    fn open(&self) -> (usize, usize) {
        (self.messages, self.bytes)
    }
}

/// What an ended request had left, from its `Nats-Pending-*` headers.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct Unspent {
    messages: usize,
    bytes: usize,
}

/// What one message on the reader's inbox means.
#[derive(Debug, PartialEq, Eq)]
pub(crate) enum Delivery {
    /// A stored message.
    Message,
    /// The server still holds a request and has nothing to send.
    Heartbeat,
    /// The server ended a request (expired, next message too large, leadership
    /// change, shutdown), with what it had left when it said so.
    Ended(Option<Unspent>),
    /// The read cannot go on: the consumer was deleted, a request broke the
    /// consumer's limits, the next message is larger than a whole request's byte
    /// budget (asking again would only be refused again), JetStream did not
    /// answer, or an unknown status came.
    Fatal(String),
}

/// Classifies a message that arrived on the reader's inbox of a reader whose
/// requests ask for `batch_bytes` each.
pub(crate) fn classify(message: &async_nats::Message, batch_bytes: usize) -> Delivery {
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
        // `404 No Messages` answers only requests that do not wait; none are sent.
        StatusCode::NOT_FOUND => Delivery::Ended(unspent(message)),
        StatusCode::TIMEOUT => Delivery::Ended(unspent(message)),
        StatusCode::REQUEST_TERMINATED
            if description == "consumer deleted"
                || description == "consumer is push based"
                || description.starts_with("exceeded max") =>
        {
            Delivery::Fatal(format!("pull request refused: {description}"))
        }
        StatusCode::REQUEST_TERMINATED => match unspent(message) {
            Some(left)
                if description == "message size exceeds maxbytes" && left.bytes >= batch_bytes =>
            {
                Delivery::Fatal(format!(
                    "the next message is larger than a read's byte budget ({batch_bytes} B)"
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

/// The budget an ended request had left; `None` when the headers do not say
/// (or say it unreadably), which [`PullBudget::ended`] takes as "every request".
fn unspent(message: &async_nats::Message) -> Option<Unspent> {
    let headers = message.headers.as_ref()?;
    let number = |name: &str| headers.get(name)?.as_str().trim().parse::<usize>().ok();
    Some(Unspent {
        messages: number("Nats-Pending-Messages")?,
        bytes: number("Nats-Pending-Bytes")?,
    })
}

/// The body of one pull request.
#[derive(serde::Serialize)]
struct PullRequest {
    batch: usize,
    max_bytes: usize,
    /// Nanoseconds.
    expires: u64,
    /// Nanoseconds.
    idle_heartbeat: u64,
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
}

impl PullReader {
    /// A reader of consumer `consumer` on stream `log`, asking for batches of
    /// `batch_messages` and `batch_bytes` (raised to what the largest message the
    /// server accepts needs) with idle heartbeats every `heartbeat`.
    ///
    /// # Errors
    /// A transport error when the inbox cannot be subscribed.
    pub(crate) async fn open(
        context: jetstream::Context,
        log: &str,
        consumer: &str,
        batch_messages: usize,
        batch_bytes: usize,
        heartbeat: Duration,
    ) -> Result<Self, LogError> {
        let client = context.client();
        let inbox = Subject::from(client.new_inbox());
        let subscriber = client
            .subscribe(inbox.clone())
            .await
            .map_err(|e| LogError::other(log, e))?;
        let largest = client.server_info().max_payload + BUDGET_HEADROOM;
        let budget = PullBudget::new(batch_messages, batch_bytes.max(largest));
        let request = PullRequest {
            batch: budget.batch_messages,
            max_bytes: budget.batch_bytes,
            expires: nanos(REQUEST_EXPIRY),
            idle_heartbeat: nanos(heartbeat),
        };
        let request = serde_json::to_vec(&request).map_err(|e| LogError::other(log, e))?;
        Ok(Self {
            log: log.to_owned(),
            subject: Subject::from(format!("{API_PREFIX}.CONSUMER.MSG.NEXT.{log}.{consumer}")),
            client,
            context,
            inbox,
            subscriber,
            request: Bytes::from(request),
            budget,
            heartbeat,
            silent_spells: 0,
        })
    }

    /// The next stored message, or the error that ends the read.
    pub(crate) async fn next_entry(&mut self) -> Result<LogEntry, LogError> {
        loop {
            if self.budget.wants_request() {
                self.budget.book();
                self.client
                    .publish_with_reply(
                        self.subject.clone(),
                        self.inbox.clone(),
                        self.request.clone(),
                    )
                    .await
                    .map_err(|e| LogError::other(&self.log, e))?;
            }
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
                    continue;
                }
            };
            self.silent_spells = 0;
            match classify(&message, self.budget.batch_bytes) {
                Delivery::Message => {
                    self.budget.delivered(message.length);
                    return self.entry(message);
                }
                Delivery::Heartbeat => {}
                Delivery::Ended(left) => self.budget.ended(left),
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
mod tests {
    use async_nats::header::HeaderMap;
    use proptest::prelude::*;

    use super::*;

    fn status(code: u16, description: &str, pending: Option<(&str, &str)>) -> async_nats::Message {
        let headers = pending.map(|(messages, bytes)| {
            let mut headers = HeaderMap::new();
            headers.insert("Nats-Pending-Messages", messages);
            headers.insert("Nats-Pending-Bytes", bytes);
            headers
        });
        async_nats::Message {
            subject: Subject::from("_INBOX.x"),
            reply: None,
            payload: Bytes::new(),
            headers,
            status: Some(StatusCode::from_u16(code).expect("a status code")),
            description: Some(description.to_owned()),
            length: 0,
        }
    }

    #[test]
    fn a_request_is_due_at_first_and_again_when_half_is_spent() {
        let mut budget = PullBudget::new(10, 1000);
        assert!(budget.wants_request());
        budget.book();
        assert!(!budget.wants_request());
        for _ in 0..4 {
            budget.delivered(10);
            assert!(!budget.wants_request());
        }
        budget.delivered(10);
        assert!(budget.wants_request(), "half of the messages spent");
        let mut by_bytes = PullBudget::new(10, 1000);
        by_bytes.book();
        by_bytes.delivered(500);
        assert!(by_bytes.wants_request(), "half of the bytes spent");
    }

    #[test]
    fn a_request_answered_in_full_leaves_nothing_booked() {
        // One large message fills the byte budget; the server then ends the
        // request, saying what it had left. Booked first, nothing stays open.
        let mut budget = PullBudget::new(100, 1 << 20);
        budget.book();
        budget.delivered(640 << 10);
        budget.ended(Some(Unspent {
            messages: 99,
            bytes: (1 << 20) - (640 << 10),
        }));
        assert_eq!(budget.open(), (0, 0));
        assert!(budget.wants_request());
    }

    #[test]
    fn an_end_that_does_not_say_what_was_left_forgets_every_request() {
        let mut budget = PullBudget::new(100, 1000);
        budget.book();
        budget.book();
        budget.ended(None);
        assert_eq!(budget.open(), (0, 0));
    }

    #[test]
    fn statuses_are_classified() {
        assert_eq!(
            classify(&status(100, "Idle Heartbeat", None), 1000),
            Delivery::Heartbeat
        );
        assert_eq!(
            classify(&status(408, "Request Timeout", Some(("7", "700"))), 1000),
            Delivery::Ended(Some(Unspent {
                messages: 7,
                bytes: 700
            }))
        );
        assert_eq!(
            classify(
                &status(409, "Message Size Exceeds MaxBytes", Some(("99", "12"))),
                1000
            ),
            Delivery::Ended(Some(Unspent {
                messages: 99,
                bytes: 12
            }))
        );
        assert_eq!(
            classify(&status(409, "Leadership Change", None), 1000),
            Delivery::Ended(None)
        );
        assert_eq!(
            classify(&status(409, "Server Shutdown", Some(("x", "1"))), 1000),
            Delivery::Ended(None),
            "unreadable headers end every request"
        );
        for fatal in [
            "Consumer Deleted",
            "Consumer is push based",
            "Exceeded MaxWaiting",
        ] {
            assert!(
                matches!(
                    classify(&status(409, fatal, None), 1000),
                    Delivery::Fatal(_)
                ),
                "{fatal}"
            );
        }
        assert!(
            matches!(
                classify(
                    &status(409, "Message Size Exceeds MaxBytes", Some(("100", "1000"))),
                    1000
                ),
                Delivery::Fatal(_)
            ),
            "a message no request can hold"
        );
        assert!(matches!(
            classify(&status(503, "", None), 1000),
            Delivery::Fatal(_)
        ));
        assert!(matches!(
            classify(&status(500, "?", None), 1000),
            Delivery::Fatal(_)
        ));
    }

    /// One step of a server answering a reader's requests.
    #[derive(Debug, Clone)]
    enum Answer {
        Message(usize),
        EndOne,
        EndAll,
    }

    proptest! {
        /// Whatever the server answers, as long as it answers only requests the
        /// reader booked, the books never claim more than the server holds: when the
        /// server holds no request, the reader asks for one.
        #[test]
        fn the_books_never_claim_a_request_the_server_does_not_hold(
            batch in 1usize..50,
            batch_bytes in 1usize..5000,
            answers in proptest::collection::vec(
                prop_oneof![
                    (1usize..3000).prop_map(Answer::Message),
                    Just(Answer::EndOne),
                    Just(Answer::EndAll),
                ],
                0..200,
            ),
        ) {
            // The server's open requests, oldest first: (messages, bytes) left.
            let mut server: std::collections::VecDeque<(usize, usize)> = Default::default();
            let mut budget = PullBudget::new(batch, batch_bytes);
            for answer in answers {
                if budget.wants_request() {
                    budget.book();
                    server.push_back((batch, batch_bytes));
                }
                match answer {
                    Answer::Message(length) => {
                        // A message larger than a whole request is a fatal error.
                        let length = length.min(batch_bytes);
                        let Some(front) = server.front_mut() else { continue };
                        if length > front.1 {
                            // Does not fit what is left: the server ends the request.
                            let (messages, bytes) = server.pop_front().expect("front");
                            budget.ended(Some(Unspent { messages, bytes }));
                            continue;
                        }
                        front.0 -= 1;
                        front.1 = front.1.saturating_sub(length);
                        budget.delivered(length);
                        if front.0 == 0 || front.1 == 0 {
                            server.pop_front();
                        }
                    }
                    Answer::EndOne => {
                        if let Some((messages, bytes)) = server.pop_front() {
                            budget.ended(Some(Unspent { messages, bytes }));
                        }
                    }
                    Answer::EndAll => {
                        server.clear();
                        budget.ended(None);
                    }
                }
                let held: usize = server.iter().map(|request| request.0).sum();
                prop_assert!(!server.is_empty() || budget.wants_request(),
                    "no request at the server, yet none is due: books {:?}, held {held}", budget.open());
            }
        }
    }
}
