//! Coalescing calls: a real client serving many dummies sends their concurrent
//! metadata calls to the sub-master as one batched request at a time. A call waits
//! while the previous batch is in flight, so under load batches grow and requests
//! shrink. With a window, a batch also waits (at most that long) until as many
//! callers have come as were in the previous batch: the callers a batch answered
//! come back with their next calls a moment later, and the wait keeps them
//! together instead of sending the first of them alone. A lone caller never waits,
//! so an idle client adds no latency at all.

use std::future::Future;
use std::sync::Arc;
use std::time::Duration;

use tokio::sync::{mpsc, oneshot};

use crate::error::ClientError;

/// The default [`CoalesceConfig::window`]: a fraction of a sub-master round trip
/// (hundreds of microseconds), so the added latency stays well inside it.
pub const DEFAULT_WINDOW: Duration = Duration::from_micros(50);

/// How calls are coalesced.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct CoalesceConfig {
    /// How long a batch may wait for more calls after the first arrived, while
    /// fewer callers have come than were in the previous batch (zero: send at once
    /// whatever queued while the previous batch was in flight).
    pub window: Duration,
    /// Most items in one batch.
    pub max_items: usize,
}

impl Default for CoalesceConfig {
    fn default() -> Self {
        Self {
            window: DEFAULT_WINDOW,
            max_items: hkvm_events::rpc::submaster::MAX_BATCH_ITEMS,
        }
    }
}

/// The outcome a coalesced call receives: its own items' results, or the batch's
/// failure (shared by every call in the batch).
type Outcome<R> = Result<Vec<R>, Arc<ClientError>>;

struct Waiting<I, R> {
    items: Vec<I>,
    reply: oneshot::Sender<Outcome<R>>,
}

/// One operation's queue of calls and the task that sends them in batches.
pub struct Coalescer<I, R> {
    queue: mpsc::UnboundedSender<Waiting<I, R>>,
    task: tokio::task::JoinHandle<()>,
}

impl<I, R> std::fmt::Debug for Coalescer<I, R> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Coalescer").finish_non_exhaustive()
    }
}

impl<I, R> Drop for Coalescer<I, R> {
    fn drop(&mut self) {
        self.task.abort();
    }
}

impl<I: Send + 'static, R: Send + 'static> Coalescer<I, R> {
    /// A coalescer sending batches with `send` (one batched RPC), on the current
    /// Tokio runtime.
    pub fn start<F, Fut>(config: CoalesceConfig, send: F) -> Self
    where
        F: Fn(Vec<I>) -> Fut + Send + 'static,
        Fut: Future<Output = Result<Vec<R>, ClientError>> + Send,
    {
        let (queue, mut calls) = mpsc::unbounded_channel::<Waiting<I, R>>();
        let task = tokio::spawn(async move {
            // Callers in the previous batch: how many to wait for, within the window.
            let mut expected = 1;
            while let Some(first) = calls.recv().await {
                let mut batch = vec![first];
                let mut count = batch[0].items.len();
                let deadline = tokio::time::Instant::now() + config.window;
                while count < config.max_items {
                    // Whatever queued meanwhile joins at once; then, while fewer
                    // callers came than last time, the window's wait for more.
                    let next = match calls.try_recv() {
                        Ok(next) => Some(next),
                        Err(_) if config.window.is_zero() || batch.len() >= expected => None,
                        Err(_) => tokio::time::timeout_at(deadline, calls.recv())
                            .await
                            .ok()
                            .flatten(),
                    };
                    let Some(next) = next else { break };
                    count += next.items.len();
                    batch.push(next);
                }
                expected = batch.len();
                let mut sizes = Vec::with_capacity(batch.len());
                let mut items = Vec::with_capacity(count);
                let mut replies = Vec::with_capacity(batch.len());
                for waiting in batch {
                    sizes.push(waiting.items.len());
                    items.extend(waiting.items);
                    replies.push(waiting.reply);
                }
                match send(items).await {
                    Ok(results) if results.len() == count => {
                        let mut results = results.into_iter();
                        for (size, reply) in sizes.into_iter().zip(replies) {
                            let _ = reply.send(Ok(results.by_ref().take(size).collect()));
                        }
                    }
                    Ok(results) => {
                        let error = Arc::new(ClientError::Mismatch {
                            asked: count,
                            answered: results.len(),
                        });
                        for reply in replies {
                            let _ = reply.send(Err(Arc::clone(&error)));
                        }
                    }
                    Err(error) => {
                        let error = Arc::new(error);
                        for reply in replies {
                            let _ = reply.send(Err(Arc::clone(&error)));
                        }
                    }
                }
            }
        });
        Self { queue, task }
    }

    /// Queues `items` and waits for their results.
    ///
    /// # Errors
    /// The batch's failure ([`ClientError::Batch`] around it), or
    /// [`ClientError::Batch`] around a stopped coalescer.
    pub async fn call(&self, op: &'static str, items: Vec<I>) -> Result<Vec<R>, ClientError> {
        let (reply, result) = oneshot::channel();
        if self.queue.send(Waiting { items, reply }).is_err() {
            return Err(ClientError::Stopped { op });
        }
        match result.await {
            Ok(Ok(results)) => Ok(results),
            Ok(Err(source)) => Err(ClientError::Batch { op, source }),
            Err(_) => Err(ClientError::Stopped { op }),
        }
    }
}

#[cfg(test)]
mod tests {
    use std::sync::atomic::{AtomicUsize, Ordering};

    use super::*;

    #[tokio::test]
    async fn concurrent_calls_share_batches_and_get_their_own_results() {
        let requests = Arc::new(AtomicUsize::new(0));
        let counted = Arc::clone(&requests);
        let coalescer = Arc::new(Coalescer::start(
            CoalesceConfig::default(),
            move |items: Vec<u32>| {
                counted.fetch_add(1, Ordering::SeqCst);
                async move {
                    // A round trip, during which later calls queue up.
                    tokio::time::sleep(Duration::from_millis(5)).await;
                    Ok(items.into_iter().map(|i| i * 10).collect())
                }
            },
        ));
        let calls: Vec<_> = (0..64u32)
            .map(|n| {
                let coalescer = Arc::clone(&coalescer);
                tokio::spawn(async move { coalescer.call("test", vec![n, n + 1000]).await })
            })
            .collect();
        for (n, call) in calls.into_iter().enumerate() {
            let n = n as u32;
            assert_eq!(call.await.unwrap().unwrap(), vec![n * 10, (n + 1000) * 10]);
        }
        let sent = requests.load(Ordering::SeqCst);
        assert!(
            sent < 64 / 4,
            "64 concurrent calls went out as {sent} requests"
        );
    }

    #[tokio::test]
    async fn a_failed_batch_fails_every_call_in_it() {
        let coalescer = Coalescer::start(CoalesceConfig::default(), |_items: Vec<u32>| async {
            Err::<Vec<u32>, _>(ClientError::Timeout { op: "x", ms: 1 })
        });
        let error = coalescer.call("test", vec![1]).await.unwrap_err();
        assert_eq!(
            error.kind(),
            crate::ClientErrorKind::Timeout,
            "the kind is the batch's"
        );
        let short = Coalescer::start(CoalesceConfig::default(), |_items: Vec<u32>| async {
            Ok(vec![1u32])
        });
        assert!(
            short.call("test", vec![1, 2]).await.is_err(),
            "a short answer is an error"
        );
    }
}
