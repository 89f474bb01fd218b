//! Group commit: many concurrent callers submit events; one task packs whatever is
//! queued into one message (bounded by events and bytes), appends it fenced on the
//! expected last sequence, keeps several appends in flight, and tells every caller
//! when its events are durable. Per-message overhead dominates JetStream appends, so
//! sharing messages is what makes durable puts fast.
//!
//! An append that failed without an answer from the stream — nobody leads it
//! while JetStream elects a new stream leader after a NATS node died, or its
//! acknowledgement timed out — is sent again, with every append after it, in
//! order, with the same message ids and fences (so one already stored is not
//! stored twice), for up to `retry_for`. Any other failure (a fencing conflict
//! above all: another writer appended) stops the committer for good: every later
//! submission fails with the same error, and the owner must re-read the log
//! before writing again.

use std::collections::VecDeque;
use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};

use bytes::Bytes;
use futures::stream::FuturesOrdered;
use futures::StreamExt as _;
use tokio::sync::{mpsc, oneshot, watch};

use crate::event_log::{Append, AppendAck, EventLog, LogError, LogErrorKind};
use hkvm_events::codec::{Header, MessageBuilder};
use hkvm_events::error::EncodeError;
use hkvm_events::event::KvEvent;
use hkvm_events::id::ProducerId;
use hkvm_events::limits::Limits;
use hkvm_events::subject::message_id;

/// Tuning of a [`GroupCommitter`].
#[derive(Debug, Clone, Copy)]
pub struct CommitConfig {
    /// Most events packed into one message.
    pub max_events_per_message: usize,
    /// Appends sent but not yet acknowledged.
    pub max_in_flight: usize,
    /// Submissions queued before `commit` waits (backpressure on callers).
    pub queue_depth: usize,
    /// Validation bounds; `max_message_bytes` bounds each message.
    pub limits: Limits,
    /// How long appends that got no answer from the stream are sent again before
    /// the committer gives up (a JetStream stream-leader election takes seconds).
    pub retry_for: Duration,
    /// How long an append waits for its acknowledgement before it counts as
    /// unanswered and is sent again (same message id: never stored twice). Short,
    /// so that writes resume soon after a stream-leader election ends rather than
    /// after the client library's 5 s publish timeout.
    pub ack_timeout: Duration,
}

/// The pause before appends are sent again.
const RESEND_PAUSE: Duration = Duration::from_millis(100);

impl Default for CommitConfig {
    fn default() -> Self {
        Self {
            max_events_per_message: 4096,
            max_in_flight: 8,
            queue_depth: 8192,
            limits: Limits::default(),
            retry_for: Duration::from_secs(10),
            ack_timeout: Duration::from_secs(2),
        }
    }
}

/// Where a submission's events landed.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Committed {
    /// The stream sequence of the message holding them.
    pub seq: u64,
    /// The index of the submission's first event inside that message.
    pub first_index: usize,
    /// How many events the submission had.
    pub count: usize,
    /// When the message was handed to the log (its last send, if sent again).
    pub sent: Instant,
    /// When the log's acknowledgement reached the commit task.
    pub acknowledged: Instant,
}

/// Why a submission was not committed.
#[derive(Debug, Clone, thiserror::Error)]
pub enum CommitError {
    /// The submission itself is invalid or cannot fit in one message.
    #[error("rejected: {0}")]
    Rejected(#[from] EncodeError),
    /// The append of its message failed (e.g. fenced); nothing later is committed.
    #[error("append failed: {0}")]
    Log(#[from] LogError),
    /// The committer had stopped after an earlier failure.
    #[error("committer stopped after an earlier failure: {0}")]
    Stopped(LogError),
}

struct Submission {
    events: Vec<KvEvent>,
    reply: oneshot::Sender<Result<Committed, CommitError>>,
    /// Nothing submitted after it may share its message.
    ends_message: bool,
}

/// A reply owed to one submission of an in-flight message.
struct Waiter {
    reply: oneshot::Sender<Result<Committed, CommitError>>,
    first_index: usize,
    count: usize,
}

/// Handle to a running group-commit task; cheap to clone, one per writer.
#[derive(Debug, Clone)]
pub struct GroupCommitter {
    submissions: mpsc::Sender<Submission>,
    last_seq: watch::Receiver<u64>,
}

impl GroupCommitter {
    /// Starts the commit task over `log`. `last_seq` is the sequence the writer
    /// knows is last (the fence of its first append); `producer` and `epoch` go into
    /// every message header and message id.
    pub fn spawn<L: EventLog>(
        log: L,
        producer: ProducerId,
        epoch: u64,
        last_seq: u64,
        config: CommitConfig,
    ) -> Self {
        let (submissions, queue) = mpsc::channel(config.queue_depth.max(1));
        let (seq_tx, seq_rx) = watch::channel(last_seq);
        let task = CommitTask {
            log,
            header: Header {
                producer,
                epoch,
                unix_ms: 0,
            },
            config,
            next_expected: last_seq,
            counter: 0,
            carry: None,
            buffer: Vec::new(),
            durable_seq: seq_tx,
        };
        tokio::spawn(task.run(queue));
        Self {
            submissions,
            last_seq: seq_rx,
        }
    }

    /// Submits `events` and waits until they are durable in the log.
    ///
    /// # Errors
    /// [`CommitError`] when they were rejected or their append failed.
    pub async fn commit(&self, events: Vec<KvEvent>) -> Result<Committed, CommitError> {
        self.submit(events).await?.await
    }

    /// Queues `events` (waiting only for queue space) and returns a future that
    /// resolves when they are durable. Submissions enter the log in the order their
    /// `submit` calls completed, so a single caller that submits sequentially gets
    /// its events into the log in that order.
    ///
    /// # Errors
    /// [`CommitError::Stopped`] when the commit task has ended.
    pub async fn submit(&self, events: Vec<KvEvent>) -> Result<PendingCommit, CommitError> {
        self.queue(events, false).await
    }

    /// Submits a message boundary: no event, and nothing submitted after it
    /// shares a message with anything submitted before it. The future resolves
    /// with the sequence of the message holding everything submitted before it
    /// (an empty message when nothing was waiting), so a writer that applies its
    /// own submissions to a state in order can stamp a copy of that state, taken
    /// right after this call, with the exact stream position it covers.
    ///
    /// # Errors
    /// [`CommitError::Stopped`] when the commit task has ended.
    pub async fn submit_boundary(&self) -> Result<PendingCommit, CommitError> {
        self.queue(Vec::new(), true).await
    }

    async fn queue(
        &self,
        events: Vec<KvEvent>,
        ends_message: bool,
    ) -> Result<PendingCommit, CommitError> {
        let (reply, answer) = oneshot::channel();
        self.submissions
            .send(Submission {
                events,
                reply,
                ends_message,
            })
            .await
            .map_err(|_| task_ended())?;
        Ok(PendingCommit { answer })
    }

    /// The last sequence known durable, updated as acknowledgements arrive.
    pub fn durable_seq(&self) -> u64 {
        *self.last_seq.borrow()
    }
}

fn task_ended() -> CommitError {
    CommitError::Stopped(LogError::other("committer", "the commit task has ended"))
}

/// Resolves when a submitted batch is durable (or failed).
#[derive(Debug)]
pub struct PendingCommit {
    answer: oneshot::Receiver<Result<Committed, CommitError>>,
}

impl std::future::Future for PendingCommit {
    type Output = Result<Committed, CommitError>;

    fn poll(
        mut self: std::pin::Pin<&mut Self>,
        cx: &mut std::task::Context<'_>,
    ) -> std::task::Poll<Self::Output> {
        std::pin::Pin::new(&mut self.answer)
            .poll(cx)
            .map(|answer| answer.unwrap_or_else(|_| Err(task_ended())))
    }
}

type Ack = futures::future::BoxFuture<'static, Result<AppendAck, LogError>>;

/// An append sent and not acknowledged yet, kept so that it can be sent again.
struct Sent {
    append: Append,
    waiters: Vec<Waiter>,
    /// When it was last handed to the log.
    at: Instant,
}

/// Whether an append failed without a definite answer from the stream, so that
/// sending it again (same message id, same fence) is right.
fn unanswered(error: &LogError) -> bool {
    matches!(
        error.kind(),
        LogErrorKind::StreamNotFound
            | LogErrorKind::Timeout
            | LogErrorKind::ConnectionReplaced
            | LogErrorKind::Other(_)
    )
}

struct CommitTask<L> {
    log: L,
    header: Header,
    config: CommitConfig,
    /// The fence of the next append: the sequence the previous one will get.
    next_expected: u64,
    counter: u64,
    /// A submission that did not fit in the previous message.
    carry: Option<Submission>,
    buffer: Vec<u8>,
    durable_seq: watch::Sender<u64>,
}

fn now_ms() -> u64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map_or(0, |d| u64::try_from(d.as_millis()).unwrap_or(u64::MAX))
}

impl<L: EventLog> CommitTask<L> {
    async fn run(mut self, mut queue: mpsc::Receiver<Submission>) {
        // Sent appends, oldest first, and their acknowledgements in the same order.
        let mut sent: VecDeque<Sent> = VecDeque::new();
        let mut acks: FuturesOrdered<Ack> = FuturesOrdered::new();
        let mut failure: Option<LogError> = None;
        // Since when the oldest append goes unanswered (while sending it again).
        let mut unanswered_since: Option<tokio::time::Instant> = None;
        loop {
            let can_send = failure.is_none()
                && unanswered_since.is_none()
                && sent.len() < self.config.max_in_flight;
            tokio::select! {
                biased;
                Some(ack) = acks.next(), if !acks.is_empty() => {
                    let Some(head) = sent.pop_front() else { continue };
                    match ack {
                        Ok(ack) if failure.is_none() => {
                            if let Some(since) = unanswered_since.take() {
                                tracing::info!(
                                    unanswered_ms = since.elapsed().as_millis() as u64,
                                    "the event log answers again"
                                );
                            }
                            self.durable_seq.send_replace(ack.seq);
                            reply_committed(head, ack.seq);
                        }
                        // Acknowledged after an earlier failure: cannot happen with
                        // fencing, but never report success out of order.
                        Ok(_) => fail_all(head.waiters, failure.as_ref()),
                        Err(error)
                            if failure.is_none()
                                && unanswered(&error)
                                && unanswered_since
                                    .is_none_or(|since| since.elapsed() < self.config.retry_for) =>
                        {
                            if unanswered_since.is_none() {
                                tracing::warn!(%error, in_flight = sent.len() + 1, "append unanswered; sending it again");
                                unanswered_since = Some(tokio::time::Instant::now());
                            }
                            // Later appends were fenced on this one: all go again,
                            // in order (their pending answers are dropped).
                            sent.push_front(head);
                            tokio::time::sleep(RESEND_PAUSE).await;
                            acks = self.resend(&mut sent).await;
                        }
                        Err(error) => {
                            tracing::error!(%error, "append failed; the committer stops");
                            for waiter in head.waiters {
                                let _ = waiter.reply.send(Err(CommitError::Log(error.clone())));
                            }
                            failure.get_or_insert(error);
                        }
                    }
                }
                submission = next_submission(&mut self.carry, &mut queue), if can_send || failure.is_some() => {
                    let Some(first) = submission else { break };
                    if let Some(error) = &failure {
                        let _ = first.reply.send(Err(CommitError::Stopped(error.clone())));
                        continue;
                    }
                    if let Some((append, waiters)) = self.pack(first, &mut queue) {
                        let at = Instant::now();
                        acks.push_back(self.send(append.clone()).await);
                        sent.push_back(Sent { append, waiters, at });
                    }
                }
                else => break,
            }
        }
        // Drain: answer whatever is still in flight before the task ends.
        while let Some(ack) = acks.next().await {
            let Some(head) = sent.pop_front() else { break };
            match ack {
                Ok(ack) if failure.is_none() => reply_committed(head, ack.seq),
                _ => fail_all(head.waiters, failure.as_ref()),
            }
        }
    }

    /// Sends `append`; a send that fails at once is an answer like any other, and
    /// so is no acknowledgement within `ack_timeout`.
    async fn send(&self, append: Append) -> Ack {
        let timeout = self.config.ack_timeout;
        match self.log.send(append).await {
            Ok(pending) => Box::pin(async move {
                tokio::time::timeout(timeout, pending)
                    .await
                    .unwrap_or_else(|_| Err(LogError::new("event log", LogErrorKind::Timeout)))
            }),
            Err(error) => Box::pin(futures::future::ready(Err(error))),
        }
    }

    /// Sends every unacknowledged append again, in order.
    async fn resend(&self, sent: &mut VecDeque<Sent>) -> FuturesOrdered<Ack> {
        let mut acks = FuturesOrdered::new();
        for entry in sent {
            entry.at = Instant::now();
            acks.push_back(self.send(entry.append.clone()).await);
        }
        acks
    }

    /// Packs `first` and whatever else is queued into one message, fenced on the
    /// sequence the previous one will get; `None` when every submission was
    /// rejected and there is nothing to send.
    fn pack(
        &mut self,
        first: Submission,
        queue: &mut mpsc::Receiver<Submission>,
    ) -> Option<(Append, Vec<Waiter>)> {
        self.header.unix_ms = now_ms();
        let buffer = std::mem::take(&mut self.buffer);
        let mut builder = match MessageBuilder::new(&self.header, buffer) {
            Ok(builder) => builder,
            Err(error) => {
                let _ = first.reply.send(Err(error.into()));
                return None;
            }
        };
        let mut waiters = Vec::new();
        let mut next = Some(first);
        while let Some(submission) = next.take() {
            let fits_count = builder.event_count() + submission.events.len()
                <= self.config.max_events_per_message;
            if !waiters.is_empty() && !fits_count {
                self.carry = Some(submission);
                break;
            }
            let ends_message = submission.ends_message;
            match self.add(&mut builder, &submission.events) {
                Ok(first_index) => waiters.push(Waiter {
                    reply: submission.reply,
                    first_index,
                    count: submission.events.len(),
                }),
                Err(error) if waiters.is_empty() => {
                    let _ = submission.reply.send(Err(error.into()));
                }
                // It did not fit beside the others: it goes first in the next message.
                Err(EncodeError::MessageTooLarge { .. }) => {
                    self.carry = Some(submission);
                    break;
                }
                Err(error) => {
                    let _ = submission.reply.send(Err(error.into()));
                }
            }
            if ends_message {
                break;
            }
            next = queue.try_recv().ok();
        }
        if waiters.is_empty() {
            self.buffer = builder.finish();
            return None;
        }
        let append = Append {
            expected_last_seq: Some(self.next_expected),
            msg_id: message_id(&self.header.producer, self.header.epoch, self.counter),
            payload: Bytes::from(builder.finish()),
        };
        self.counter += 1;
        self.next_expected += 1;
        Some((append, waiters))
    }

    /// Adds one submission's events, rolling back if any is invalid or the message
    /// would grow past the byte limit. Returns the index of its first event.
    fn add(&self, builder: &mut MessageBuilder, events: &[KvEvent]) -> Result<usize, EncodeError> {
        let limits = &self.config.limits;
        if events.len() > self.config.max_events_per_message {
            return Err(EncodeError::TooManyEvents {
                count: events.len(),
                max: self.config.max_events_per_message,
            });
        }
        let mark = builder.mark();
        let first_index = builder.event_count();
        for (index, event) in events.iter().enumerate() {
            let pushed = limits
                .check_event(event)
                .map_err(|source| EncodeError::Invalid { index, source })
                .and_then(|()| builder.push(event));
            if let Err(error) = pushed {
                builder.rollback(mark);
                return Err(error);
            }
        }
        if builder.len_bytes() > limits.max_message_bytes {
            let size = builder.len_bytes() - mark.0;
            builder.rollback(mark);
            return Err(EncodeError::MessageTooLarge {
                size,
                max: limits.max_message_bytes,
            });
        }
        Ok(first_index)
    }
}

async fn next_submission(
    carry: &mut Option<Submission>,
    queue: &mut mpsc::Receiver<Submission>,
) -> Option<Submission> {
    match carry.take() {
        Some(submission) => Some(submission),
        None => queue.recv().await,
    }
}

fn reply_committed(sent: Sent, seq: u64) {
    let acknowledged = Instant::now();
    for waiter in sent.waiters {
        let _ = waiter.reply.send(Ok(Committed {
            seq,
            first_index: waiter.first_index,
            count: waiter.count,
            sent: sent.at,
            acknowledged,
        }));
    }
}

fn fail_all(waiters: Vec<Waiter>, failure: Option<&LogError>) {
    let error = failure
        .cloned()
        .unwrap_or_else(|| LogError::other("committer", "stopped"));
    for waiter in waiters {
        let _ = waiter.reply.send(Err(CommitError::Stopped(error.clone())));
    }
}
