//! The NATS RPC front: one queue-group subscription per operation subject,
//! decoding requests into [`Request`]s for the state machine through the
//! [`Gate`] it shares with the direct front. Pings the gate answers itself, from
//! [`LiveNodes`]. It never queues without bound: while the leader recovers, or when
//! the state machine's queue is full, requests get `Busy { retry_after }` at once.
//!
//! Each operation is served on the subject of its [`Audience`]: a node's mounts
//! on its own `rpc.node.<node>` subject (a request naming another node is
//! refused), the mass removals on `rpc.admin`; on the plain subject those are
//! answered `Forbidden`. The NATS permissions decide who may publish where.

use std::sync::Arc;

use async_nats::{Client, Subject};
use futures::StreamExt as _;
use hkvm_events::rpc::submaster::{Audience, Op, Ping};
use hkvm_events::rpc::{self, RpcError, RpcErrorCode, RpcReply};
use hkvm_events::subject::{
    submaster_admin_subject, submaster_node_subject, submaster_rpc_subject,
};
use tokio::sync::{mpsc, oneshot, watch};
use tokio::task::JoinHandle;
use tokio::time::Instant;

use super::Context;
use crate::command::{Reply, Request};
use crate::error::{SubmasterError, SubmasterErrorKind};
use crate::liveness::LiveNodes;
use crate::metrics::SubmasterMetrics;
use hkvm_direct::DirectReply;

/// The queue group every sub-master instance of a sub-cluster joins.
pub const QUEUE_GROUP: &str = "hkvm-submaster";

/// Where a reply goes: the requester's NATS inbox, or its direct connection.
#[derive(Debug)]
pub(crate) enum ReplyTo {
    /// A NATS reply subject.
    Nats(Subject),
    /// A request on a direct connection.
    Direct(DirectReply),
    /// A step of a request the server runs in several commands
    /// ([`super::removal`]).
    Internal(oneshot::Sender<Vec<u8>>),
}

/// The subject a request came on, which says who may have sent it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Route<'a> {
    /// The plain subject, or a direct connection: any client.
    Plain,
    /// The admin subject.
    Admin,
    /// The subject of this node.
    Node(&'a str),
}

/// Who asked, and when: what a reply needs.
#[derive(Debug)]
pub(crate) struct Requester {
    pub(crate) op: Op,
    pub(crate) reply_to: ReplyTo,
    pub(crate) received: Instant,
}

/// A request on its way to the state machine.
#[derive(Debug)]
pub(crate) struct Job {
    pub(crate) requester: Requester,
    pub(crate) request: Request,
}

/// What both fronts do with a request before the state machine sees it: refuse
/// it while the leader recovers or its queue is full, answer pings and
/// malformed requests at once, queue the rest. Cheap to clone.
#[derive(Clone)]
pub(crate) struct Gate {
    client: Client,
    jobs: mpsc::Sender<Job>,
    live: Arc<LiveNodes>,
    ready: watch::Receiver<bool>,
    metrics: SubmasterMetrics,
    retry_after_ms: u64,
}

impl Gate {
    /// A gate queueing into `jobs`, answering pings from `live`, refusing with
    /// `Busy` until `ready`.
    pub(crate) fn new(
        ctx: &Context,
        jobs: mpsc::Sender<Job>,
        live: Arc<LiveNodes>,
        ready: watch::Receiver<bool>,
    ) -> Self {
        Self {
            client: ctx.client.clone(),
            jobs,
            live,
            ready,
            metrics: ctx.metrics.clone(),
            retry_after_ms: u64::try_from(ctx.config.busy_retry_after.as_millis())
                .unwrap_or(u64::MAX),
        }
    }

    /// Whether the leader serves now (not recovering, its lease confirmed).
    pub(crate) fn is_ready(&self) -> bool {
        *self.ready.borrow()
    }

    /// Takes one request of `op` received on `route` at `received`: queues it
    /// for the state machine (`None`), or returns the answer to send `reply_to`
    /// now. A mass removal is run a slice per command by a task of its own,
    /// which replies when it is done.
    pub(crate) fn admit(
        &self,
        op: Op,
        route: Route<'_>,
        payload: &[u8],
        reply_to: ReplyTo,
        received: Instant,
    ) -> Option<(ReplyTo, Vec<u8>)> {
        let refuse = |error: RpcError, result: &'static str| {
            self.metrics
                .request(op.name(), result, received.elapsed().as_secs_f64());
            encode_error(&error)
        };
        if !*self.ready.borrow() {
            let body = refuse(
                RpcError::busy(self.retry_after_ms, "recovering the sub-cluster state"),
                "busy",
            );
            return Some((reply_to, body));
        }
        let request = match decode_request(op, payload) {
            Ok(Incoming::Request(request)) => request,
            Ok(Incoming::Ping(ping)) => {
                let body = match rpc::encode(&RpcReply::Ok(self.live.ping(&ping.node))) {
                    Ok(body) => {
                        self.metrics
                            .request(op.name(), "ok", received.elapsed().as_secs_f64());
                        body
                    }
                    Err(error) => refuse(error, "error"),
                };
                return Some((reply_to, body));
            }
            Err(error) => return Some((reply_to, refuse(error, "error"))),
        };
        if let Err(error) = check_route(op, route, &request) {
            return Some((reply_to, refuse(error, "forbidden")));
        }
        let request = match super::removal::sliced(&request) {
            Ok(Some(first)) => {
                let requester = Requester {
                    op,
                    reply_to,
                    received,
                };
                super::removal::spawn(self.jobs.clone(), self.client.clone(), requester, first);
                return None;
            }
            Ok(None) => request,
            Err(error) => return Some((reply_to, refuse(error, "error"))),
        };
        let job = Job {
            requester: Requester {
                op,
                reply_to,
                received,
            },
            request,
        };
        match self.jobs.try_send(job) {
            Ok(()) => None,
            Err(mpsc::error::TrySendError::Full(job)) => {
                let body = refuse(
                    RpcError::busy(self.retry_after_ms, "request queue full"),
                    "busy",
                );
                Some((job.requester.reply_to, body))
            }
            Err(mpsc::error::TrySendError::Closed(job)) => {
                let body = refuse(
                    RpcError::new(RpcErrorCode::NotLeader, "stepping down"),
                    "error",
                );
                Some((job.requester.reply_to, body))
            }
        }
    }
}

/// The running subscriptions; dropping it unsubscribes.
pub(crate) struct RpcFront {
    tasks: Vec<JoinHandle<()>>,
}

impl Drop for RpcFront {
    fn drop(&mut self) {
        for task in &self.tasks {
            task.abort();
        }
    }
}

/// A decoded request: one the front answers itself, or one for the state machine.
enum Incoming {
    Ping(Ping),
    Request(Request),
}

fn decode_request(op: Op, body: &[u8]) -> Result<Incoming, RpcError> {
    Ok(Incoming::Request(match op {
        Op::Ping => return Ok(Incoming::Ping(rpc::decode(body)?)),
        Op::MountSegment => Request::Mount(rpc::decode(body)?),
        Op::UnmountSegment => Request::Unmount(rpc::decode(body)?),
        Op::Remount => Request::Remount(rpc::decode(body)?),
        Op::PutStart => Request::PutStart(rpc::decode(body)?),
        Op::PutEnd => Request::PutEnd(rpc::decode(body)?),
        Op::PutRevoke => Request::PutRevoke(rpc::decode(body)?),
        Op::GetReplicaList => Request::GetReplicaList(rpc::decode(body)?),
        Op::Exist => Request::Exist(rpc::decode(body)?),
        Op::Remove => Request::Remove(rpc::decode(body)?),
        Op::RemoveAll => Request::RemoveAll(rpc::decode(body)?),
        Op::RemoveMatching => Request::RemoveMatching(rpc::decode(body)?),
        Op::Status => Request::Status(rpc::decode(body)?),
        Op::Mixed => Request::Mixed(rpc::decode(body)?),
        Op::LeaseSpace => Request::LeaseSpace(rpc::decode(body)?),
        Op::PutCommit => Request::PutCommit(rpc::decode(body)?),
        Op::LeaseReturn => Request::LeaseReturn(rpc::decode(body)?),
    }))
}

/// Whether a request of `op` may come on `route`: an operation of
/// [`Audience::Admin`] on the admin subject only, one of [`Audience::Node`] on
/// the subject of the node it names only.
///
/// # Errors
/// `Forbidden`, saying where the operation must be sent.
fn check_route(op: Op, route: Route<'_>, request: &Request) -> Result<(), RpcError> {
    let forbidden = |message: String| Err(RpcError::new(RpcErrorCode::Forbidden, message));
    match (op.audience(), route) {
        (Audience::Anyone, _) | (Audience::Admin, Route::Admin) => Ok(()),
        (Audience::Admin, _) => forbidden(format!(
            "{} needs the admin role: it is served on rpc.admin.{0} only",
            op.name()
        )),
        (Audience::Node, Route::Node(node)) => match request.node() {
            Some(named) if named.as_str() == node => Ok(()),
            named => forbidden(format!(
                "{} on the subject of node {node} names node {}: a node acts on its own \
                 segments only",
                op.name(),
                named.map_or("none", |named| named.as_str())
            )),
        },
        (Audience::Node, _) => forbidden(format!(
            "{} is a node's own operation: it is served on rpc.node.<node>.{0} only",
            op.name()
        )),
    }
}

/// Encodes a typed reply as its `RpcReply::Ok`.
pub(crate) fn encode_reply(reply: Reply) -> Vec<u8> {
    let encoded = match reply {
        Reply::Done => rpc::encode(&RpcReply::Ok(())),
        Reply::PutStart(r) => rpc::encode(&RpcReply::Ok(r)),
        Reply::PutEnd(r) => rpc::encode(&RpcReply::Ok(r)),
        Reply::PutRevoke(r) => rpc::encode(&RpcReply::Ok(r)),
        Reply::GetReplicaList(r) => rpc::encode(&RpcReply::Ok(r)),
        Reply::Exist(r) => rpc::encode(&RpcReply::Ok(r)),
        Reply::Remove(r) => rpc::encode(&RpcReply::Ok(r)),
        Reply::RemoveAll(r) => rpc::encode(&RpcReply::Ok(r)),
        Reply::RemovedSlice(r) => rpc::encode(&RpcReply::Ok(r)),
        Reply::Status(r) => rpc::encode(&RpcReply::Ok(r)),
        Reply::Mixed(r) => rpc::encode(&RpcReply::Ok(r)),
        Reply::LeaseSpace(r) => rpc::encode(&RpcReply::Ok(r)),
        Reply::PutCommit(r) => rpc::encode(&RpcReply::Ok(r)),
    };
    encoded.unwrap_or_else(|error| encode_error(&error))
}

/// Encodes an error reply.
pub(crate) fn encode_error(error: &RpcError) -> Vec<u8> {
    // An error reply always encodes; fall back to an empty body only in theory.
    rpc::encode(&RpcReply::<()>::Err(error.clone())).unwrap_or_default()
}

/// Sends a reply (an error instead when it is over the NATS server's payload
/// limit: on a direct connection too, so that what a request may ask for does
/// not depend on the route it took); a vanished requester is not an error worth
/// more than a debug line.
pub(crate) async fn send(client: &Client, reply_to: ReplyTo, body: Vec<u8>) {
    let body = rpc::fit_reply(body, client.server_info().max_payload);
    match reply_to {
        ReplyTo::Nats(subject) => {
            if let Err(error) = client.publish(subject, body.into()).await {
                tracing::debug!(%error, "reply not sent");
            }
        }
        ReplyTo::Direct(reply) => reply.send(body),
        ReplyTo::Internal(reply) => {
            // The stepping task is gone only when its requester is.
            let _ = reply.send(body);
        }
    }
}

/// Subscribes to every operation subject of the sub-cluster in the queue group:
/// each operation on the subject of its audience, and the operations of a node
/// or of the admin on the plain subject too, to answer there that they are
/// served elsewhere.
///
/// # Errors
/// When a subscription fails.
pub(crate) async fn subscribe(ctx: &Context, gate: &Gate) -> Result<RpcFront, SubmasterError> {
    let (cluster, subcluster) = (&ctx.config.cluster, &ctx.config.subcluster);
    let mut tasks = Vec::new();
    for op in Op::ALL {
        let plain = submaster_rpc_subject(cluster, subcluster, op.name());
        match op.audience() {
            Audience::Anyone => {}
            Audience::Admin => {
                let subject = submaster_admin_subject(cluster, subcluster, op.name());
                tasks.push(serve(ctx, gate, op, subject, Served::Admin).await?);
            }
            Audience::Node => {
                let subject = submaster_node_subject(cluster, subcluster, "*", op.name());
                tasks.push(serve(ctx, gate, op, subject, Served::Node).await?);
            }
        }
        tasks.push(serve(ctx, gate, op, plain, Served::Plain).await?);
    }
    Ok(RpcFront { tasks })
}

/// Which of an operation's subjects a subscription serves.
#[derive(Debug, Clone, Copy)]
enum Served {
    Plain,
    Admin,
    /// Every node's (`rpc.node.*.<op>`).
    Node,
}

impl Served {
    /// The route of a request that came on `subject`: for a node's subject, the
    /// node is its next-to-last token (`...rpc.node.<node>.<op>`).
    fn route(self, subject: &str) -> Route<'_> {
        match self {
            Self::Plain => Route::Plain,
            Self::Admin => Route::Admin,
            Self::Node => Route::Node(subject.rsplit('.').nth(1).unwrap_or_default()),
        }
    }
}

/// Serves `op` on `subject` (its plain, admin, or every node's subject).
async fn serve(
    ctx: &Context,
    gate: &Gate,
    op: Op,
    subject: String,
    served: Served,
) -> Result<JoinHandle<()>, SubmasterError> {
    let client = &ctx.client;
    let mut subscription = client
        .queue_subscribe(subject.clone(), QUEUE_GROUP.to_owned())
        .await
        .map_err(|e| {
            SubmasterError::caused(SubmasterErrorKind::Rpc, format!("subscribing {subject}"), e)
        })?;
    let (client, gate) = (client.clone(), gate.clone());
    Ok(tokio::spawn(async move {
        while let Some(message) = subscription.next().await {
            let Some(reply_to) = message.reply else {
                continue;
            };
            let received = Instant::now();
            let route = served.route(&message.subject);
            if let Some((reply_to, body)) = gate.admit(
                op,
                route,
                &message.payload,
                ReplyTo::Nats(reply_to),
                received,
            ) {
                send(&client, reply_to, body).await;
            }
        }
    }))
}
