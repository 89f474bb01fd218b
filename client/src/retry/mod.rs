//! The one retry policy every request/reply call of every client goes through
//! (sub-master calls, global-master calls, the global master's proxy): it retries
//! what is safe to retry — `Busy` (after the server's `retry_after`), `NotLeader`,
//! no responder while a standby takes over or a replica starts, and a timeout when
//! the request may be resent — with exponential back-off and full jitter, until a
//! deadline. So a failover under load costs clients latency, not errors, and never
//! turns into a retry storm.

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::Duration;

use async_nats::RequestErrorKind;
use hkvm_events::rpc::{self, RpcErrorCode, RpcReply};
use hkvm_log::connection::ConnectionEpoch;
use rand::Rng as _;
use serde::de::DeserializeOwned;
use serde::Serialize;
use tokio::sync::watch;
use tokio::time::Instant;

use crate::direct::DirectRoute;

mod direct;

use crate::error::{ClientError, RetryCause};
use crate::leader_watch::LeaderWatch;
use direct::DirectEnd;

/// Timeouts and back-off of a caller. Fill what you need and take the rest from
/// `Default`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct RetryPolicy {
    /// How long one request waits for its reply.
    pub request_timeout: Duration,
    /// How long a call keeps retrying before it reports the last reason.
    pub retry_deadline: Duration,
    /// The first back-off without a server hint; it doubles up to `max_backoff`.
    pub min_backoff: Duration,
    /// The longest back-off.
    pub max_backoff: Duration,
    /// After nobody answered for this long, a call asks whether the service
    /// exists at all ([`Presence`]); when it does not, the call fails at once
    /// instead of retrying until the deadline.
    pub presence_check_after: Duration,
    /// When a new leader announces itself, waiting calls retry after a random
    /// delay up to this long, so that its clients do not all arrive at once.
    pub wake_spread: Duration,
}

/// Whether the service behind a subject exists, as far as the caller can tell.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Presence {
    /// It exists (or existed): a responder is worth waiting for.
    Present,
    /// It does not exist; why, and what to check.
    Absent(String),
    /// The caller cannot tell: keep waiting.
    Unknown,
}

impl Default for RetryPolicy {
    fn default() -> Self {
        Self {
            request_timeout: Duration::from_secs(2),
            retry_deadline: Duration::from_secs(30),
            min_backoff: Duration::from_millis(20),
            max_backoff: Duration::from_secs(1),
            presence_check_after: Duration::from_secs(1),
            wake_spread: Duration::from_millis(20),
        }
    }
}

impl RetryPolicy {
    /// The delay before the next attempt: the server's hint when it gave one,
    /// otherwise the current exponential back-off; plus up to half of it again as
    /// random jitter, which spreads thousands of retrying clients.
    pub fn delay(&self, backoff: Duration, cause: &RetryCause) -> Duration {
        let base = match cause {
            RetryCause::Busy { retry_after_ms } => Duration::from_millis(*retry_after_ms),
            _ => backoff,
        };
        let half_ms = u64::try_from(base.as_millis() / 2).unwrap_or(u64::MAX);
        let jitter = rand::thread_rng().gen_range(0..=half_ms.saturating_add(1));
        base + Duration::from_millis(jitter)
    }

    /// The back-off after `backoff`: doubled, capped at `max_backoff`.
    pub fn next_backoff(&self, backoff: Duration) -> Duration {
        (backoff * 2).min(self.max_backoff)
    }
}

/// Counters of what a caller went through (for tests, benchmarks and logs).
#[derive(Debug, Default)]
pub struct ClientStats {
    /// `Busy` answers that were retried.
    pub busy: AtomicU64,
    /// Retries because no server answered (takeover in progress) or `NotLeader`.
    pub leader_waits: AtomicU64,
    /// Resendable requests retried after a timeout.
    pub timeouts: AtomicU64,
    /// Requests sent (every attempt).
    pub requests: AtomicU64,
    /// Waits for a leader cut short by a new leader's announcement.
    pub leader_wakeups: AtomicU64,
    /// Resendable requests sent again at once because their answer was lost with
    /// a replaced connection (this client's, or the leader's: it announces itself
    /// again after reconnecting).
    pub answers_lost: AtomicU64,
}

impl ClientStats {
    fn count(&self, cause: &RetryCause) {
        let counter = match cause {
            RetryCause::Busy { .. } => &self.busy,
            RetryCause::NotLeader | RetryCause::NoResponders { .. } => &self.leader_waits,
            RetryCause::TimedOut => &self.timeouts,
            RetryCause::AnswerLost => &self.answers_lost,
        };
        counter.fetch_add(1, Ordering::Relaxed);
    }
}

/// Whether a timed-out request may be sent again without changing its meaning.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Resend {
    /// Reads and idempotent operations: resend after a timeout.
    Safe,
    /// The request may have taken effect: a timeout is reported to the caller.
    Unsafe,
}

/// Why one request got no reply.
enum SendError {
    /// A failure of its own (transport, timeout).
    Failed(ClientError),
    /// Its answer will never come (see [`RetryCause::AnswerLost`]).
    AnswerLost,
}

/// What one attempt came to.
enum Attempt<Rep> {
    Done(Result<Rep, ClientError>),
    Retry(RetryCause),
}

/// NATS request/reply with a [`RetryPolicy`]. Cheap to clone; clones share stats.
#[derive(Debug, Clone)]
pub struct RpcCaller {
    nats: async_nats::Client,
    policy: RetryPolicy,
    stats: Arc<ClientStats>,
}

impl RpcCaller {
    /// This caller (its connection and stats) waiting up to `timeout` for each
    /// answer: for calls whose server side is long by nature.
    pub fn with_request_timeout(&self, timeout: Duration) -> Self {
        Self {
            policy: RetryPolicy {
                request_timeout: timeout,
                retry_deadline: self.policy.retry_deadline.max(timeout),
                ..self.policy
            },
            nats: self.nats.clone(),
            stats: Arc::clone(&self.stats),
        }
    }

    /// A caller over `nats` with `policy`.
    pub fn new(nats: async_nats::Client, policy: RetryPolicy) -> Self {
        Self {
            nats,
            policy,
            stats: Arc::new(ClientStats::default()),
        }
    }

    /// The policy.
    pub fn policy(&self) -> &RetryPolicy {
        &self.policy
    }

    /// What this caller (and its clones) went through so far.
    pub fn stats(&self) -> &ClientStats {
        &self.stats
    }

    /// The NATS connection.
    pub fn nats(&self) -> &async_nats::Client {
        &self.nats
    }

    /// Sends `request` on `subject` until it gets a definite answer or the policy's
    /// deadline passes.
    ///
    /// # Errors
    /// [`ClientError::Rpc`] for a refusal, [`ClientError::Unavailable`] with the
    /// last retry cause when the deadline passed, [`ClientError::Timeout`] for an
    /// unanswered request that is not safe to resend, [`ClientError::Transport`]
    /// and [`ClientError::Codec`] otherwise.
    pub async fn call<Req: Serialize, Rep: DeserializeOwned>(
        &self,
        op: &'static str,
        subject: String,
        request: &Req,
        resend: Resend,
    ) -> Result<Rep, ClientError> {
        self.call_via(op, subject, request, resend, None).await
    }

    /// As [`RpcCaller::call`], on a link of `direct` when it has one up for
    /// `op`, over NATS otherwise.
    ///
    /// # Errors
    /// As for [`RpcCaller::call`].
    pub async fn call_via<Req: Serialize, Rep: DeserializeOwned>(
        &self,
        op: &'static str,
        subject: String,
        request: &Req,
        resend: Resend,
        direct: Option<&Arc<DirectRoute>>,
    ) -> Result<Rep, ClientError> {
        self.call_routed(
            op,
            subject,
            request,
            resend,
            || async { Presence::Unknown },
            None,
            direct,
        )
        .await
    }

    /// As [`RpcCaller::call`], and when nobody has answered for the policy's
    /// `presence_check_after`, asks `presence` (once) whether the service exists:
    /// [`Presence::Absent`] ends the call with [`ClientError::NoService`], unless
    /// an attempt may have reached a server (it timed out or lost its answer),
    /// so that `NoService` always means the request was never delivered. With a
    /// `leader` watch, any wait before a retry ends early when a new leader
    /// announces itself.
    ///
    /// # Errors
    /// As for [`RpcCaller::call`], and [`ClientError::NoService`].
    pub async fn call_checked<Req, Rep, F, Fut>(
        &self,
        op: &'static str,
        subject: String,
        request: &Req,
        resend: Resend,
        presence: F,
        leader: Option<&LeaderWatch>,
    ) -> Result<Rep, ClientError>
    where
        Req: Serialize,
        Rep: DeserializeOwned,
        F: Fn() -> Fut,
        Fut: std::future::Future<Output = Presence>,
    {
        let direct = leader.and_then(LeaderWatch::direct);
        self.call_routed(op, subject, request, resend, presence, leader, direct)
            .await
    }

    /// Every call's loop: attempts (on a link of `direct` when one is up for
    /// `op`, over NATS otherwise) until a definite answer or the deadline.
    #[allow(clippy::too_many_arguments)]
    async fn call_routed<Req, Rep, F, Fut>(
        &self,
        op: &'static str,
        subject: String,
        request: &Req,
        resend: Resend,
        presence: F,
        leader: Option<&LeaderWatch>,
        direct: Option<&Arc<DirectRoute>>,
    ) -> Result<Rep, ClientError>
    where
        Req: Serialize,
        Rep: DeserializeOwned,
        F: Fn() -> Fut,
        Fut: std::future::Future<Output = Presence>,
    {
        let direct = direct.filter(|route| route.carries(op));
        let body: bytes::Bytes = rpc::encode(request)
            .map_err(|source| ClientError::Codec { op, source })?
            .into();
        let started = Instant::now();
        let mut backoff = self.policy.min_backoff;
        // Since when nobody has answered, and whether presence was asked.
        let mut silent_since: Option<Instant> = None;
        let mut checked = false;
        // Whether an attempt may have reached a server (no answer in time, or
        // one lost): then the call must not end as `NoService`, which says that
        // nothing was done.
        let mut maybe_delivered = false;
        // Leader announcements, subscribed before the first attempt so that one
        // made while a request was still waiting for its reply is not missed.
        let mut announcements = match leader {
            Some(watch) => watch.announcements().await,
            None => None,
        };
        loop {
            if let Some(announcements) = &mut announcements {
                // What was announced before this attempt cannot help after it.
                announcements.borrow_and_update();
            }
            let attempt = self
                .attempt(
                    op,
                    &subject,
                    body.clone(),
                    resend,
                    announcements.as_mut(),
                    direct,
                )
                .await;
            let cause = match attempt {
                Attempt::Done(result) => return result,
                Attempt::Retry(cause) => cause,
            };
            self.stats.count(&cause);
            maybe_delivered |= matches!(cause, RetryCause::TimedOut | RetryCause::AnswerLost);
            if matches!(cause, RetryCause::NoResponders { .. }) {
                let since = *silent_since.get_or_insert_with(Instant::now);
                if !checked
                    && !maybe_delivered
                    && since.elapsed() >= self.policy.presence_check_after
                {
                    checked = true;
                    if let Presence::Absent(why) = presence().await {
                        return Err(ClientError::NoService { op, subject, why });
                    }
                }
            } else {
                silent_since = None;
            }
            let delay = self.policy.delay(backoff, &cause);
            if started.elapsed() + delay > self.policy.retry_deadline {
                return Err(ClientError::Unavailable {
                    op,
                    ms: u64::try_from(started.elapsed().as_millis()).unwrap_or(u64::MAX),
                    cause,
                });
            }
            if matches!(cause, RetryCause::AnswerLost) {
                // Not refused: the answer went down with a replaced connection.
                // Send again at once, spread a little (a leader that reconnected
                // has all its clients' answers to make up).
                tracing::debug!(op, %cause, "sending again");
                self.spread().await;
                backoff = self.policy.min_backoff;
                continue;
            }
            tracing::debug!(op, %cause, delay_ms = delay.as_millis() as u64, "retrying");
            // Whatever the cause (a timeout too: a request sent to a dying
            // leader), a new leader serving is the moment to try again.
            let woken = match announcements.as_mut() {
                Some(announced) => tokio::select! {
                    () = tokio::time::sleep(delay) => false,
                    changed = announced.changed() => changed.is_ok(),
                },
                None => {
                    tokio::time::sleep(delay).await;
                    false
                }
            };
            if woken {
                // A new leader serves: retry now, spread a little so that its
                // waiting clients do not all arrive in the same instant.
                self.stats.leader_wakeups.fetch_add(1, Ordering::Relaxed);
                self.spread().await;
                backoff = self.policy.min_backoff;
            } else {
                backoff = self.policy.next_backoff(backoff);
            }
        }
    }

    /// A random pause up to the policy's `wake_spread`.
    async fn spread(&self) {
        let spread = rand::thread_rng().gen_range(Duration::ZERO..=self.policy.wake_spread);
        tokio::time::sleep(spread).await;
    }

    /// Sends `request` once, with the request timeout and no retry, and returns the
    /// reply as the server sent it (`Busy` included): for benchmarks that measure
    /// single round trips.
    ///
    /// # Errors
    /// As for [`RpcCaller::call`], without retries.
    pub async fn call_once<Req: Serialize, Rep: DeserializeOwned>(
        &self,
        op: &'static str,
        subject: String,
        request: &Req,
    ) -> Result<RpcReply<Rep>, ClientError> {
        self.call_once_via(op, subject, request, None).await
    }

    /// As [`RpcCaller::call_once`], on a link of `direct` when it has one up
    /// for `op`; a request whose link fails before it is answered goes over
    /// NATS (only read-only requests should be sent this way).
    ///
    /// # Errors
    /// As for [`RpcCaller::call_once`].
    pub async fn call_once_via<Req: Serialize, Rep: DeserializeOwned>(
        &self,
        op: &'static str,
        subject: String,
        request: &Req,
        direct: Option<&Arc<DirectRoute>>,
    ) -> Result<RpcReply<Rep>, ClientError> {
        let body = rpc::encode(request).map_err(|source| ClientError::Codec { op, source })?;
        let direct = direct.filter(|route| route.carries(op));
        if let Some((route, link)) = direct.and_then(|route| Some((route, route.link()?))) {
            self.stats.requests.fetch_add(1, Ordering::Relaxed);
            match tokio::time::timeout(self.policy.request_timeout, link.call(op, &body)).await {
                Ok(Ok(payload)) => {
                    return rpc::decode(&payload)
                        .map_err(|source| ClientError::Codec { op, source })
                }
                // Sent or not, a read-only request may go again over NATS.
                _ => route.discard(&link),
            }
        }
        let started = Instant::now();
        let epoch = ConnectionEpoch::of(&self.nats);
        let message = match self.send(op, subject, body.into(), epoch.replaced()).await {
            Ok(message) => message,
            Err(SendError::Failed(error)) => return Err(error),
            Err(SendError::AnswerLost) => {
                return Err(ClientError::Unavailable {
                    op,
                    ms: u64::try_from(started.elapsed().as_millis()).unwrap_or(u64::MAX),
                    cause: RetryCause::AnswerLost,
                })
            }
        };
        rpc::decode(&message.payload).map_err(|source| ClientError::Codec { op, source })
    }

    /// Sends one request and waits for its reply, its timeout, or `lost`: a sign
    /// that its answer will never come (reported as [`SendError::AnswerLost`]).
    async fn send(
        &self,
        op: &'static str,
        subject: String,
        body: bytes::Bytes,
        lost: impl std::future::Future<Output = ()>,
    ) -> Result<async_nats::Message, SendError> {
        let timeout = self.policy.request_timeout;
        self.stats.requests.fetch_add(1, Ordering::Relaxed);
        tokio::select! {
            answer = tokio::time::timeout(timeout, self.nats.request(subject, body)) => match answer {
                Ok(Ok(message)) => Ok(message),
                Ok(Err(source)) => Err(SendError::Failed(ClientError::Transport { op, source })),
                Err(_) => Err(SendError::Failed(ClientError::Timeout {
                    op,
                    ms: u64::try_from(timeout.as_millis()).unwrap_or(u64::MAX),
                })),
            },
            () = lost => Err(SendError::AnswerLost),
        }
    }

    /// One attempt: over the direct link when `direct` has one up, otherwise
    /// (or when the link was closed before the request left) over NATS.
    async fn attempt<Rep: DeserializeOwned>(
        &self,
        op: &'static str,
        subject: &str,
        body: bytes::Bytes,
        resend: Resend,
        announcements: Option<&mut watch::Receiver<u64>>,
        direct: Option<&Arc<DirectRoute>>,
    ) -> Attempt<Rep> {
        if let Some((route, link)) = direct.and_then(|route| Some((route, route.link()?))) {
            match self
                .attempt_direct(op, &link, &body, resend, announcements)
                .await
            {
                Ok(payload) => {
                    let attempt = Self::answer(op, &payload);
                    if matches!(attempt, Attempt::Retry(RetryCause::NotLeader)) {
                        // A leader stepping down: the next one is found anew.
                        route.discard(&link);
                    }
                    return attempt;
                }
                Err(DirectEnd::NotSent) => route.discard(&link),
                Err(DirectEnd::Ended(attempt)) => {
                    route.discard(&link);
                    return attempt;
                }
            }
            // Not sent: go over NATS at once, without waiting for a relink.
            return self.attempt_nats(op, subject, body, resend, None).await;
        }
        self.attempt_nats(op, subject, body, resend, announcements)
            .await
    }

    /// One attempt over NATS request/reply.
    async fn attempt_nats<Rep: DeserializeOwned>(
        &self,
        op: &'static str,
        subject: &str,
        body: bytes::Bytes,
        resend: Resend,
        announcements: Option<&mut watch::Receiver<u64>>,
    ) -> Attempt<Rep> {
        // The answer to a resendable request is lost when this client's
        // connection is replaced, or when the leader announces itself (again)
        // while it waits: a new leader, or the same one back on a new connection.
        let epoch = ConnectionEpoch::of(&self.nats);
        let lost = async {
            if resend == Resend::Unsafe {
                return std::future::pending().await;
            }
            match announcements {
                Some(announced) => tokio::select! {
                    () = epoch.replaced() => {}
                    changed = announced.changed() => {
                        if changed.is_err() {
                            std::future::pending::<()>().await;
                        }
                    }
                },
                None => epoch.replaced().await,
            }
        };
        let message = match self.send(op, subject.to_owned(), body, lost).await {
            Ok(message) => message,
            Err(SendError::AnswerLost) => return Attempt::Retry(RetryCause::AnswerLost),
            Err(SendError::Failed(ClientError::Transport { source, .. }))
                if source.kind() == RequestErrorKind::NoResponders =>
            {
                return Attempt::Retry(RetryCause::NoResponders {
                    subject: subject.to_owned(),
                })
            }
            Err(SendError::Failed(ClientError::Transport { source, .. }))
                if source.kind() == RequestErrorKind::TimedOut && resend == Resend::Safe =>
            {
                return Attempt::Retry(RetryCause::TimedOut)
            }
            Err(SendError::Failed(ClientError::Timeout { .. })) if resend == Resend::Safe => {
                return Attempt::Retry(RetryCause::TimedOut)
            }
            Err(SendError::Failed(error)) => return Attempt::Done(Err(error)),
        };
        Self::answer(op, &message.payload)
    }

    /// What a reply body comes to: a result, or a reason to retry.
    fn answer<Rep: DeserializeOwned>(op: &'static str, payload: &[u8]) -> Attempt<Rep> {
        let reply: RpcReply<Rep> = match rpc::decode(payload) {
            Ok(reply) => reply,
            Err(source) => return Attempt::Done(Err(ClientError::Codec { op, source })),
        };
        match reply {
            RpcReply::Ok(value) => Attempt::Done(Ok(value)),
            RpcReply::Err(error) => match error.code {
                RpcErrorCode::Busy { retry_after_ms } => {
                    Attempt::Retry(RetryCause::Busy { retry_after_ms })
                }
                RpcErrorCode::NotLeader => Attempt::Retry(RetryCause::NotLeader),
                _ => Attempt::Done(Err(ClientError::Rpc { op, source: error })),
            },
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_busy_hint_sets_the_delay_and_jitter_stays_within_half() {
        let policy = RetryPolicy::default();
        for _ in 0..200 {
            let delay = policy.delay(
                Duration::from_millis(20),
                &RetryCause::Busy {
                    retry_after_ms: 400,
                },
            );
            assert!(delay >= Duration::from_millis(400), "{delay:?}");
            assert!(delay <= Duration::from_millis(601), "{delay:?}");
        }
    }

    #[test]
    fn without_a_hint_the_backoff_doubles_up_to_the_cap() {
        let policy = RetryPolicy {
            min_backoff: Duration::from_millis(20),
            max_backoff: Duration::from_millis(100),
            ..RetryPolicy::default()
        };
        let mut backoff = policy.min_backoff;
        let mut seen = Vec::new();
        for _ in 0..5 {
            seen.push(backoff.as_millis());
            backoff = policy.next_backoff(backoff);
        }
        assert_eq!(seen, [20, 40, 80, 100, 100]);
        let delay = policy.delay(Duration::from_millis(80), &RetryCause::NotLeader);
        assert!(delay >= Duration::from_millis(80) && delay <= Duration::from_millis(121));
    }

    #[test]
    fn jitter_spreads_retries() {
        let policy = RetryPolicy::default();
        let delays: std::collections::BTreeSet<_> = (0..50)
            .map(|_| policy.delay(Duration::from_millis(200), &RetryCause::TimedOut))
            .collect();
        assert!(
            delays.len() > 5,
            "jitter produced {} distinct delays",
            delays.len()
        );
    }
}
