//! How a following read that has caught up lets new messages gather before it
//! fetches them.
//!
//! A pull request left open at the server sends each message the moment it is
//! stored: under a trickle of appends (one client putting one object at a time)
//! the server makes one delivery, one flush and one wake of the reader per
//! message, and on a small machine that work competes with the appends
//! themselves. A lingering read keeps no such request open while messages flow:
//!
//! 1. *Drain*: a request that does not wait (`no_wait`) takes what is stored, up
//!    to the read's byte budget, in one burst. The server ends it with `404` (it
//!    had nothing) or `408` (it ran out), or silently (the budget was spent: more
//!    may wait, so drain again).
//! 2. *Wake*: once drained, a request for one message waits (with idle
//!    heartbeats) for the next append, which arrives as soon as it is stored.
//! 3. The reader then waits out the linger before draining again, so what was
//!    appended meanwhile comes in one burst.
//!
//! A reader is thus at most one linger behind the stream while it is busy, and not
//! at all after a quiet spell. Only one request is ever open, so the byte books of
//! [`super::pull::PullBudget`] stay exact: a request that ends is the one that was
//! open. [`Lingering`] is that bookkeeping, pure and unit-tested.

use std::time::Duration;

use tokio::time::Instant;

/// The kinds of pull request a lingering read sends.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Request {
    /// Takes what is stored now, up to the budget, without waiting.
    Drain,
    /// Waits for one message.
    Wake,
}

/// What a lingering read sends next, and what it has open.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct Lingering {
    linger: Duration,
    open: Option<Request>,
    next: Request,
    drain_after: Option<Instant>,
}

impl Lingering {
    /// A read that drains first (it starts behind, or does not know) and waits
    /// `linger` after each wake.
    pub(crate) fn new(linger: Duration) -> Self {
        Self {
            linger,
            open: None,
            next: Request::Drain,
            drain_after: None,
        }
    }

    /// The request to send now, and the instant before which it must not be sent;
    /// `None` while a request is open.
    pub(crate) fn due(&self) -> Option<(Request, Option<Instant>)> {
        match self.open {
            Some(_) => None,
            None => Some((self.next, self.drain_after)),
        }
    }

    /// The request [`Self::due`] named was sent.
    pub(crate) fn sent(&mut self, request: Request) {
        self.open = Some(request);
        self.drain_after = None;
    }

    /// A message arrived; `budget_spent` says whether the open request's bytes ran
    /// out with it. Returns whether the request is over (the caller then forgets
    /// whatever the books still held for it).
    pub(crate) fn message(&mut self, budget_spent: bool, now: Instant) -> bool {
        match self.open {
            Some(Request::Wake) => {
                self.open = None;
                self.next = Request::Drain;
                self.drain_after = Some(now + self.linger);
                true
            }
            Some(Request::Drain) if budget_spent => {
                self.open = None;
                self.next = Request::Drain;
                true
            }
            _ => false,
        }
    }

    /// The server ended the open request; `at_end` when it said it had no more
    /// messages (`404 No Messages`, or `408` for a request that does not wait).
    pub(crate) fn ended(&mut self, at_end: bool) {
        let caught_up = match self.open {
            Some(Request::Drain) => at_end,
            // A wake expired or was cut short: still nothing new, wait again.
            Some(Request::Wake) => true,
            None => false,
        };
        self.open = None;
        self.next = if caught_up {
            Request::Wake
        } else {
            Request::Drain
        };
    }

    /// The server holds no request of this read (silence): start over with a drain.
    pub(crate) fn forget(&mut self) {
        self.open = None;
        self.next = Request::Drain;
        self.drain_after = None;
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const LINGER: Duration = Duration::from_millis(5);

    #[test]
    fn a_read_drains_first_then_waits_for_the_next_message() {
        let mut read = Lingering::new(LINGER);
        assert_eq!(read.due(), Some((Request::Drain, None)));
        read.sent(Request::Drain);
        assert_eq!(read.due(), None, "one request open at a time");
        assert!(!read.message(false, Instant::now()));
        read.ended(true);
        assert_eq!(read.due(), Some((Request::Wake, None)));
    }

    #[test]
    fn after_a_wake_the_next_drain_waits_out_the_linger() {
        let mut read = Lingering::new(LINGER);
        read.sent(Request::Drain);
        read.ended(true);
        read.sent(Request::Wake);
        let now = Instant::now();
        assert!(read.message(false, now), "a wake asks for one message");
        assert_eq!(read.due(), Some((Request::Drain, Some(now + LINGER))));
        read.sent(Request::Drain);
        read.ended(true);
        assert_eq!(read.due(), Some((Request::Wake, None)));
    }

    #[test]
    fn a_drain_whose_budget_ran_out_drains_again_at_once() {
        let mut read = Lingering::new(LINGER);
        read.sent(Request::Drain);
        assert!(!read.message(false, Instant::now()));
        assert!(read.message(true, Instant::now()));
        assert_eq!(read.due(), Some((Request::Drain, None)));
    }

    #[test]
    fn a_drain_cut_short_drains_again_and_an_expired_wake_waits_again() {
        let mut read = Lingering::new(LINGER);
        read.sent(Request::Drain);
        read.ended(false); // e.g. 409 Leadership Change
        assert_eq!(read.due(), Some((Request::Drain, None)));
        read.sent(Request::Drain);
        read.ended(true);
        read.sent(Request::Wake);
        read.ended(true); // 408 after the wake's expiry
        assert_eq!(read.due(), Some((Request::Wake, None)));
        read.sent(Request::Wake);
        read.ended(false);
        assert_eq!(read.due(), Some((Request::Wake, None)));
    }

    #[test]
    fn silence_starts_over_with_a_drain() {
        let mut read = Lingering::new(LINGER);
        read.sent(Request::Drain);
        read.ended(true);
        read.sent(Request::Wake);
        read.forget();
        assert_eq!(read.due(), Some((Request::Drain, None)));
    }
}
