//! Keeping the leader lease: a task renews it every third of its TTL, and tells
//! the leader whether the lease is held, unconfirmed (the lease bucket does not
//! answer) or lost (another instance holds it).

use std::time::Duration;

use tokio::sync::watch;
use tokio::time::{interval, MissedTickBehavior};

use crate::election::{LeaderLease, LeaseHolder};

/// What the leader knows of its lease.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) enum LeaseState {
    /// Renewed within the last two thirds of its TTL: the lease is ours.
    Held,
    /// Not renewed for two thirds of a TTL because the lease bucket does not answer (its
    /// JetStream leader is being re-elected, or this process is cut off). A
    /// standby may have taken over, so nothing is served — above all no
    /// `put_start`, whose reservations only a current leader may hand out — but
    /// the state is kept: once the lease is renewed or taken again, a fenced
    /// empty append proves that nobody led meanwhile, and serving resumes.
    Unconfirmed,
    /// Another instance holds the lease: step down.
    Lost,
}

/// Renews the leader lease every `period` in its own task.
pub(super) struct Renewer {
    task: tokio::task::JoinHandle<u64>,
    stop: watch::Sender<bool>,
    /// The lease as last renewed (or not).
    pub(super) state: watch::Receiver<LeaseState>,
}

impl Renewer {
    pub(super) fn spawn(
        lease: LeaderLease,
        holder: LeaseHolder,
        mut revision: u64,
        period: Duration,
    ) -> Self {
        let (stop, mut stopped) = watch::channel(false);
        let (state_tx, state) = watch::channel(LeaseState::Held);
        let task = tokio::spawn(async move {
            let mut tick = interval(period);
            tick.set_missed_tick_behavior(MissedTickBehavior::Delay);
            let mut last_renewed = tokio::time::Instant::now();
            // Unconfirmed two periods (two thirds of the TTL) after the last
            // renewal, whether or not a renewal is still waiting for its answer:
            // a standby takes over only after a whole TTL without one, so this
            // leader stops serving first, even when its requests hang (a network
            // cut) and their answers would come only after it healed.
            let unconfirm = |state_tx: &watch::Sender<LeaseState>, why: &dyn std::fmt::Display| {
                let changed = state_tx.send_if_modified(|state| {
                    std::mem::replace(state, LeaseState::Unconfirmed) != LeaseState::Unconfirmed
                });
                if changed {
                    tracing::warn!(%why, "lease not renewed in time: serving nothing until it is");
                }
            };
            loop {
                tokio::select! {
                    _ = stopped.changed() => return revision,
                    _ = tick.tick() => {}
                }
                // A renewal counts from when it was sent: the bucket stored it
                // no earlier, and a standby's TTL starts no earlier either.
                let sent_at = tokio::time::Instant::now();
                let renewal = lease.renew(&holder, revision);
                tokio::pin!(renewal);
                let result = loop {
                    let unconfirm_at = last_renewed + period * 2;
                    let held = *state_tx.borrow() == LeaseState::Held;
                    tokio::select! {
                        result = &mut renewal => break result,
                        () = tokio::time::sleep_until(unconfirm_at), if held => {
                            unconfirm(&state_tx, &"the renewal is still unanswered");
                        }
                    }
                };
                match result {
                    Ok(Some(renewed)) => {
                        revision = renewed;
                        last_renewed = sent_at;
                        state_tx.send_if_modified(|state| {
                            std::mem::replace(state, LeaseState::Held) != LeaseState::Held
                        });
                    }
                    Ok(None) => {
                        let _ = state_tx.send(LeaseState::Lost);
                        return revision;
                    }
                    Err(error) if last_renewed.elapsed() < period * 2 => {
                        tracing::warn!(%error, "lease renewal failed; retrying");
                    }
                    Err(error) => unconfirm(&state_tx, &error),
                }
            }
        });
        Self { task, stop, state }
    }

    /// Stops renewing; returns the last revision held.
    pub(super) async fn stop(mut self) -> u64 {
        let _ = self.stop.send(true);
        (&mut self.task).await.unwrap_or_default()
    }
}

impl Drop for Renewer {
    fn drop(&mut self) {
        let _ = self.stop.send(true);
    }
}
