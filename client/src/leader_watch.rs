//! Learning that a sub-cluster has a new leader the moment it serves, instead of
//! backing off blindly through a failover. A sub-master that starts leading
//! announces itself on its sub-cluster's leader subject
//! ([`hkvm_events::subject::leader_subject`]); a client waiting out a failover
//! (no responder, `NotLeader`, `Busy`) wakes on that announcement and retries at
//! once. It is a plain NATS subscription, one per client and sub-cluster, made
//! by the client's first call: no JetStream consumer per client, so ten thousand
//! clients cost the NATS server one interest each.

use std::sync::Arc;

use futures::StreamExt as _;
use tokio::sync::{watch, OnceCell};

use crate::direct::DirectRoute;

/// The announcements of one sub-cluster's leaders, subscribed on first use.
/// Shared by the clones of a client.
#[derive(Debug)]
pub struct LeaderWatch {
    nats: async_nats::Client,
    subject: String,
    announcements: OnceCell<watch::Receiver<u64>>,
    /// The direct route to the leader, told of every announcement (none: every
    /// request goes over NATS).
    direct: Option<Arc<DirectRoute>>,
}

impl LeaderWatch {
    /// A watch of `subject`; nothing is subscribed until the first call.
    pub fn new(nats: async_nats::Client, subject: String) -> Self {
        Self {
            nats,
            subject,
            announcements: OnceCell::new(),
            direct: None,
        }
    }

    /// This watch with a direct route to the announced leaders.
    pub fn with_direct(self, direct: Arc<DirectRoute>) -> Self {
        Self {
            direct: Some(direct),
            ..self
        }
    }

    /// The direct route to the leader, if requests may go direct.
    pub fn direct(&self) -> Option<&Arc<DirectRoute>> {
        self.direct.as_ref()
    }

    /// A receiver whose value changes with every announcement, once the server
    /// has the subscription; `None` when it could not subscribe (the caller then
    /// just backs off, and the next call tries again).
    pub async fn announcements(&self) -> Option<watch::Receiver<u64>> {
        self.announcements
            .get_or_try_init(|| self.subscribe())
            .await
            .ok()
            .cloned()
    }

    async fn subscribe(&self) -> Result<watch::Receiver<u64>, SubscribeFailed> {
        let mut subscription = self
            .nats
            .subscribe(self.subject.clone())
            .await
            .map_err(|_| SubscribeFailed)?;
        // Flushed: every announcement from now on reaches this subscription.
        self.nats.flush().await.map_err(|_| SubscribeFailed)?;
        let (sender, receiver) = watch::channel(0u64);
        let direct = self.direct.clone();
        tokio::spawn(async move {
            loop {
                tokio::select! {
                    message = subscription.next() => {
                        let Some(message) = message else {
                            break;
                        };
                        if let Some(direct) = &direct {
                            direct.announced(&message.payload);
                        }
                        sender.send_modify(|count| *count += 1);
                    }
                    // The watch (and every call using it) is gone.
                    () = sender.closed() => break,
                }
            }
        });
        Ok(receiver)
    }
}

/// The subscription could not be made (the connection is down): no wake-ups
/// this time.
#[derive(Debug)]
struct SubscribeFailed;
