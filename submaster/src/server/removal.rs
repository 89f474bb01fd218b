//! Running `remove_all` and `remove_matching` a slice at a time: a task queues
//! one [`RemoveSlice`] command after the other into the state machine (waiting
//! for room in its queue, never answered `Busy`), so every request that arrives
//! meanwhile is served between two slices; each slice's removals are durable
//! before the next is queued. The requester gets one reply: the total removed,
//! or the first error with what was removed before it.

use async_nats::Client;
use hkvm_events::rpc::submaster::RemoveAllReply;
use hkvm_events::rpc::{self, RpcError, RpcErrorCode, RpcReply};
use tokio::sync::{mpsc, oneshot};
use tokio::time::Instant;

use super::rpc::{encode_error, send, Job, ReplyTo, Requester};
use crate::command::{RemoveSlice, RemovedSlice, Request};

/// The first slice of `request` when it is a mass removal (`None` for any
/// other request).
///
/// # Errors
/// `InvalidRequest` for a pattern that does not compile.
pub(crate) fn sliced(request: &Request) -> Result<Option<RemoveSlice>, RpcError> {
    match request {
        Request::RemoveAll(remove_all) => Ok(Some(RemoveSlice::of_all(remove_all))),
        Request::RemoveMatching(matching) => RemoveSlice::of_matching(matching).map(Some),
        _ => Ok(None),
    }
}

/// Runs the removal from `first` on, slice by slice, and replies to
/// `requester` when it is done.
pub(crate) fn spawn(
    jobs: mpsc::Sender<Job>,
    client: Client,
    requester: Requester,
    first: RemoveSlice,
) {
    tokio::spawn(async move {
        let body = match run(&jobs, &requester, first).await {
            Ok(removed) => rpc::encode(&RpcReply::Ok(RemoveAllReply { removed }))
                .unwrap_or_else(|error| encode_error(&error)),
            Err(error) => encode_error(&error),
        };
        tracing::info!(
            op = requester.op.name(),
            took_ms = requester.received.elapsed().as_millis() as u64,
            "mass removal done"
        );
        send(&client, requester.reply_to, body).await;
    });
}

/// Queues the slices one after the other; the objects removed in all.
async fn run(
    jobs: &mpsc::Sender<Job>,
    requester: &Requester,
    mut step: RemoveSlice,
) -> Result<u64, RpcError> {
    let mut removed = 0;
    loop {
        let (reply, answer) = oneshot::channel();
        let job = Job {
            requester: Requester {
                op: requester.op,
                reply_to: ReplyTo::Internal(reply),
                received: Instant::now(),
            },
            request: Request::RemoveSlice(step.clone()),
        };
        let stopped = |why: &str| {
            RpcError::new(
                RpcErrorCode::NotLeader,
                format!("{why} after removing {removed} objects; the rest stay"),
            )
        };
        jobs.send(job).await.map_err(|_| stopped("stepped down"))?;
        let body = answer.await.map_err(|_| stopped("stepped down"))?;
        let slice: RemovedSlice = rpc::decode::<RpcReply<RemovedSlice>>(&body)?
            .into_result()
            .map_err(|error| {
                RpcError::new(
                    error.code,
                    format!("{} ({})", stopped("stopped").message, error.message),
                )
            })?;
        removed += slice.removed;
        match slice.next {
            Some(next) => step.slice = next,
            None => return Ok(removed),
        }
    }
}
