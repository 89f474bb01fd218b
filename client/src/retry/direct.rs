//! One attempt of a call on a direct link: its request sent on the link, and
//! how the attempt ends when no reply comes (never sent, lost, timed out, or
//! answered by a new leader's announcement).

use std::sync::atomic::Ordering;

use tokio::sync::watch;

use super::{Attempt, Resend, RpcCaller};
use crate::direct::{DirectLink, LinkFailure};
use crate::error::{ClientError, RetryCause};

/// How a direct attempt ended without a reply.
pub(super) enum DirectEnd<Rep> {
    /// The request never left: send it over NATS.
    NotSent,
    /// What the attempt came to.
    Ended(Attempt<Rep>),
}

impl RpcCaller {
    /// Sends `body` on `link` and waits for its reply, its timeout, or a new
    /// leader's announcement (for a resendable request: its answer will not
    /// come from a deposed leader).
    pub(super) async fn attempt_direct<Rep>(
        &self,
        op: &'static str,
        link: &DirectLink,
        body: &[u8],
        resend: Resend,
        announcements: Option<&mut watch::Receiver<u64>>,
    ) -> Result<Vec<u8>, DirectEnd<Rep>> {
        let timeout = self.policy.request_timeout;
        let timeout_ms = u64::try_from(timeout.as_millis()).unwrap_or(u64::MAX);
        self.stats.requests.fetch_add(1, Ordering::Relaxed);
        let announced = async {
            match announcements {
                Some(announced) if resend == Resend::Safe => {
                    if announced.changed().await.is_err() {
                        std::future::pending::<()>().await;
                    }
                }
                _ => std::future::pending().await,
            }
        };
        let timed_out = || match resend {
            Resend::Safe => DirectEnd::Ended(Attempt::Retry(RetryCause::TimedOut)),
            Resend::Unsafe => DirectEnd::Ended(Attempt::Done(Err(ClientError::Timeout {
                op,
                ms: timeout_ms,
            }))),
        };
        tokio::select! {
            answer = tokio::time::timeout(timeout, link.call(op, body)) => match answer {
                Ok(Ok(payload)) => Ok(payload),
                Ok(Err(LinkFailure::NotSent)) => Err(DirectEnd::NotSent),
                // The connection went down with the request on it: as a lost
                // answer when it may be sent again, else as a timeout (it may
                // have been served), without waiting for the timeout.
                Ok(Err(LinkFailure::Lost)) => Err(match resend {
                    Resend::Safe => DirectEnd::Ended(Attempt::Retry(RetryCause::AnswerLost)),
                    Resend::Unsafe => timed_out(),
                }),
                Err(_) => Err(timed_out()),
            },
            () = announced => Err(DirectEnd::Ended(Attempt::Retry(RetryCause::AnswerLost))),
        }
    }
}
