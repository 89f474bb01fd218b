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
mod tests {
    use std::collections::VecDeque;

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
        let mut budget = PullBudget::new(1000);
        assert!(budget.wants_request());
        budget.book();
        assert!(!budget.wants_request());
        for _ in 0..4 {
            budget.delivered(100);
            assert!(!budget.wants_request());
        }
        budget.delivered(100);
        assert!(budget.wants_request(), "half of the bytes spent");
        assert_eq!(
            budget.request_messages(),
            1000,
            "messages never end a request first"
        );
    }

    #[test]
    fn a_request_answered_in_full_leaves_nothing_booked() {
        // One large message, then the next does not fit: the server ends the
        // request, saying what it had left. Booked first, nothing stays open.
        let mut budget = PullBudget::new(1 << 20);
        budget.book();
        budget.delivered(640 << 10);
        budget.ended(Some((1 << 20) - (640 << 10)));
        assert_eq!(budget.open(), 0);
        assert!(budget.wants_request());
    }

    #[test]
    fn a_request_whose_bytes_run_out_exactly_leaves_nothing_booked() {
        // The server ends such a request without a word, whatever message count it
        // had left; only bytes are booked, so nothing is left over.
        let mut budget = PullBudget::new(2015);
        budget.book();
        budget.delivered(2015);
        assert_eq!(budget.open(), 0);
        assert!(budget.wants_request());
    }

    #[test]
    fn an_end_that_does_not_say_what_was_left_forgets_every_request() {
        let mut budget = PullBudget::new(1000);
        budget.book();
        budget.book();
        budget.ended(None);
        assert_eq!(budget.open(), 0);
    }

    #[test]
    fn statuses_are_classified() {
        assert_eq!(
            classify(&status(100, "Idle Heartbeat", None), 1000),
            Delivery::Heartbeat
        );
        assert_eq!(
            classify(&status(408, "Request Timeout", Some(("7", "700"))), 1000),
            Delivery::Ended(Some(700))
        );
        assert_eq!(
            classify(
                &status(409, "Message Size Exceeds MaxBytes", Some(("99", "12"))),
                1000
            ),
            Delivery::Ended(Some(12))
        );
        assert_eq!(
            classify(&status(409, "Batch Completed", Some(("0", "300"))), 1000),
            Delivery::Ended(Some(300))
        );
        assert_eq!(
            classify(&status(409, "Leadership Change", None), 1000),
            Delivery::Ended(None)
        );
        assert_eq!(
            classify(&status(409, "Server Shutdown", Some(("1", "x"))), 1000),
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

    /// One open pull request at the model server.
    #[derive(Debug, Clone, Copy)]
    struct OpenRequest {
        messages: usize,
        bytes: usize,
    }

    /// What the reader sees on its inbox.
    #[derive(Debug, Clone, Copy)]
    enum Seen {
        Message(usize),
        Ended(Option<usize>),
    }

    /// A pull consumer's open requests as nats-server keeps them: served in
    /// turn, each charged a message's whole size; a request whose bytes or
    /// messages run out ends after that message without a word (servers before
    /// 2.11 say nothing even when bytes are left), and one the next message does
    /// not fit ends with a `409` carrying what was left.
    #[derive(Debug, Default)]
    struct ServerModel {
        waiting: VecDeque<OpenRequest>,
    }

    impl ServerModel {
        fn held_bytes(&self) -> usize {
            self.waiting.iter().map(|request| request.bytes).sum()
        }

        /// Offers one stored message of `size` bytes to the open requests.
        fn offer(&mut self, size: usize) -> Vec<Seen> {
            let mut seen = Vec::new();
            while let Some(mut request) = self.waiting.pop_front() {
                if size > request.bytes {
                    seen.push(Seen::Ended(Some(request.bytes)));
                    continue;
                }
                request.bytes -= size;
                if request.bytes == 0 {
                    request.messages = 1;
                }
                request.messages -= 1;
                seen.push(Seen::Message(size));
                if request.messages > 0 {
                    self.waiting.push_back(request);
                }
                break;
            }
            seen
        }
    }

    /// One step of a server answering a reader's requests.
    #[derive(Debug, Clone)]
    enum Step {
        /// A stored message of this many bytes (at most a whole request).
        Message(usize),
        /// The request at this index (modulo those open) expires.
        Expire(usize),
        /// A leadership change ends every request without saying what was left.
        EndAll,
        /// A restarted server forgets every request without a word; the reader
        /// hears nothing for two heartbeats and forgets its books.
        LoseAll,
    }

    /// Plays `steps` between a reader booking `request_bytes` per request and the
    /// model server; an error says where the books first parted from the server.
    fn play(request_bytes: usize, steps: &[Step]) -> Result<(), String> {
        let mut server = ServerModel::default();
        let mut budget = PullBudget::new(request_bytes);
        for (index, step) in steps.iter().enumerate() {
            if budget.wants_request() {
                budget.book();
                server.waiting.push_back(OpenRequest {
                    messages: budget.request_messages(),
                    bytes: request_bytes,
                });
            }
            let seen = match *step {
                Step::Message(size) => server.offer(size.min(request_bytes)),
                Step::Expire(at) if !server.waiting.is_empty() => {
                    let at = at % server.waiting.len();
                    let request = server.waiting.remove(at).expect("in range");
                    vec![Seen::Ended(Some(request.bytes))]
                }
                Step::Expire(_) => Vec::new(),
                Step::EndAll => {
                    server.waiting.clear();
                    vec![Seen::Ended(None)]
                }
                Step::LoseAll => {
                    server.waiting.clear();
                    budget.forget();
                    Vec::new()
                }
            };
            for seen in seen {
                match seen {
                    Seen::Message(length) => budget.delivered(length),
                    Seen::Ended(left) => budget.ended(left),
                }
            }
            if budget.open() != server.held_bytes() {
                return Err(format!(
                    "after step {index}: books {} B, server {:?}",
                    budget.open(),
                    server.waiting
                ));
            }
            if server.waiting.is_empty() && !budget.wants_request() {
                return Err(format!(
                    "after step {index}: no request at the server, none due"
                ));
            }
        }
        Ok(())
    }

    proptest! {
        /// Whatever the server answers, the books hold exactly the bytes the
        /// server's open requests still allow, so a reader never waits on a
        /// request the server no longer holds.
        #[test]
        fn the_books_hold_exactly_what_the_server_holds(
            request_bytes in 1usize..5000,
            steps in proptest::collection::vec(
                prop_oneof![
                    6 => (1usize..5000).prop_map(Step::Message),
                    1 => any::<usize>().prop_map(Step::Expire),
                    1 => Just(Step::EndAll),
                    1 => Just(Step::LoseAll),
                ],
                0..300,
            ),
        ) {
            play(request_bytes, &steps).map_err(TestCaseError::fail)?;
        }
    }

    /// The counterexample books of messages as well as bytes failed on: a request
    /// whose bytes run out exactly, then one whose messages do.
    #[test]
    fn bytes_that_run_out_exactly_then_messages_that_do_keep_the_books_exact() {
        play(2015, &[2015, 1, 1, 2015].map(Step::Message)).unwrap();
    }
}
