//! The query server: queue-group subscriptions on `hkvm.<cluster>.global.rpc.*`
//! shared by every replica, one per core; each request is decoded and answered
//! from the projection by its subscription's task, or forwarded on a task of its
//! own (`get_replica_list`). A replica still replaying answers `Busy`; a malformed
//! body gets `InvalidRequest`, never a panic.

use std::collections::BTreeMap;
use std::sync::Arc;
use std::time::Duration;

use async_nats::Message;
use futures::StreamExt as _;
use hkvm_client::{ClientError, RetryPolicy, RpcCaller, SubmasterClient};
use hkvm_events::rpc::global::{
    BatchIsExistHashed, BatchIsExistReply, GlobalOp, GlobalStatusReply, LabelFilter, Locate,
    LocateReply, PrefixHit, PrefixHitReply, ProxyGetReplicaList, ProxyGetReplicaListReply,
    MAX_BATCH_KEYS,
};
use hkvm_events::rpc::submaster::{GetReplicaListReply, ItemError, ItemResult};
use hkvm_events::rpc::{decode, encode, RpcError, RpcErrorCode, RpcReply};
use hkvm_events::subject::global_rpc_subject;
use hkvm_events::{key_hash, SubclusterId};
use serde::Serialize;

use crate::metrics::op_label;
use crate::query;
use crate::state::Shared;
use crate::GlobalMasterError;

/// The queue group every replica joins.
pub const QUEUE_GROUP: &str = "hkvm-global";

/// Most query subscriptions a replica opens.
pub const MAX_SUBSCRIPTIONS: usize = 8;

/// Subscribes and serves until the task is aborted: one queue subscription per
/// core (at most [`MAX_SUBSCRIPTIONS`]), each with its own task, so that
/// lookups run on every core. A request the projection answers alone is answered
/// in line by its subscription's task (no task spawned, no wake-up of another
/// thread); a proxied `get_replica_list`, which waits on a sub-master, gets a
/// task of its own.
pub(crate) async fn serve(
    shared: Arc<Shared>,
    client: async_nats::Client,
) -> Result<tokio::task::JoinHandle<()>, GlobalMasterError> {
    let subject = global_rpc_subject(&shared.config.cluster, "*");
    let count = std::thread::available_parallelism()
        .map_or(1, std::num::NonZero::get)
        .clamp(1, MAX_SUBSCRIPTIONS);
    let mut subscriptions = Vec::with_capacity(count);
    for _ in 0..count {
        subscriptions.push(
            client
                .queue_subscribe(subject.clone(), QUEUE_GROUP.to_owned())
                .await
                .map_err(GlobalMasterError::nats("subscribing to queries"))?,
        );
    }
    Ok(tokio::spawn(async move {
        let mut loops = tokio::task::JoinSet::new();
        for requests in subscriptions {
            loops.spawn(serve_subscription(
                Arc::clone(&shared),
                client.clone(),
                requests,
            ));
        }
        // Aborting this task drops the set, which aborts every loop.
        while loops.join_next().await.is_some() {}
    }))
}

/// Answers the requests of one subscription until it ends.
async fn serve_subscription(
    shared: Arc<Shared>,
    client: async_nats::Client,
    mut requests: async_nats::Subscriber,
) {
    while let Some(message) = requests.next().await {
        let op = GlobalOp::from_name(op_name(&message));
        if op == Some(GlobalOp::GetReplicaList) {
            let shared = Arc::clone(&shared);
            let client = client.clone();
            tokio::spawn(async move { handle(&shared, &client, message, op).await });
        } else {
            handle(&shared, &client, message, op).await;
        }
    }
}

/// The operation token of a request's subject (its last token).
fn op_name(message: &Message) -> &str {
    message.subject.rsplit('.').next().unwrap_or_default()
}

fn reply_bytes<T: Serialize>(reply: Result<T, RpcError>) -> Vec<u8> {
    encode(&RpcReply::from(reply)).unwrap_or_default()
}

/// A `batch_is_exist` reply in the older wire form, counts and holders as
/// integer arrays, which clients from before packed replies decode.
fn array_reply_bytes(reply: &Result<BatchIsExistReply, RpcError>) -> Vec<u8> {
    reply_bytes(
        reply
            .as_ref()
            .map(BatchIsExistReply::as_arrays)
            .map_err(Clone::clone),
    )
}

/// Answers one request of operation `op` (`None`: an unknown operation).
async fn handle(
    shared: &Shared,
    client: &async_nats::Client,
    message: Message,
    op: Option<GlobalOp>,
) {
    let Some(reply_to) = message.reply.clone() else {
        return;
    };
    let arrived = tokio::time::Instant::now();
    let name = op_name(&message);
    let body = match local_reply(shared, client, op, name, &message.payload, arrived) {
        Some(body) => body,
        None => proxied_reply(shared, client, &message.payload, arrived).await,
    };
    if let Err(error) = client.publish(reply_to, body.into()).await {
        tracing::debug!(%error, "replying");
    }
}

/// The reply to a request of operation `op` (subject token `name`) that the
/// projection answers alone, fitted to the NATS payload limit and timed; `None`
/// for a proxied `get_replica_list` ([`proxied_reply`]). Both fronts answer
/// through it.
pub(crate) fn local_reply(
    shared: &Shared,
    client: &async_nats::Client,
    op: Option<GlobalOp>,
    name: &str,
    payload: &[u8],
    arrived: tokio::time::Instant,
) -> Option<Vec<u8>> {
    let body = answer_locally(shared, op, name, payload)?;
    Some(finish(shared, client, op, body, arrived))
}

/// The reply to a `get_replica_list`, asked of the owning sub-masters, fitted
/// and timed as [`local_reply`]'s.
pub(crate) async fn proxied_reply(
    shared: &Shared,
    client: &async_nats::Client,
    payload: &[u8],
    arrived: tokio::time::Instant,
) -> Vec<u8> {
    let body = reply_bytes(proxy(shared, client, payload, arrived).await);
    finish(
        shared,
        client,
        Some(GlobalOp::GetReplicaList),
        body,
        arrived,
    )
}

/// `body` fitted to the payload limit, with the request's time recorded.
fn finish(
    shared: &Shared,
    client: &async_nats::Client,
    op: Option<GlobalOp>,
    body: Vec<u8>,
    arrived: tokio::time::Instant,
) -> Vec<u8> {
    let body = hkvm_events::rpc::fit_reply(body, client.server_info().max_payload);
    shared
        .metrics
        .query_seconds
        .get_or_create(&op_label(op.map_or("unknown", GlobalOp::name)))
        .observe(arrived.elapsed().as_secs_f64());
    body
}

/// The encoded reply to operation `op` (subject token `name`), when the
/// projection answers it alone; `None` for the proxied `get_replica_list`, which
/// asks a sub-master.
fn answer_locally(
    shared: &Shared,
    op: Option<GlobalOp>,
    name: &str,
    payload: &[u8],
) -> Option<Vec<u8>> {
    let body = match op {
        None => reply_bytes::<()>(Err(RpcError::invalid(format!("unknown operation {name}")))),
        Some(op) if op != GlobalOp::Status && shared.is_replaying() => {
            let label = op_label(op.name());
            shared.metrics.busy.get_or_create(&label).inc();
            reply_bytes::<()>(Err(RpcError::busy(
                shared.config.busy_retry_ms,
                "replaying the event streams",
            )))
        }
        Some(GlobalOp::BatchIsExist) => array_reply_bytes(&batch_is_exist(shared, payload)),
        Some(GlobalOp::BatchIsExistHashed) => {
            array_reply_bytes(&batch_is_exist_hashed(shared, payload))
        }
        Some(GlobalOp::BatchIsExistPacked) => reply_bytes(batch_is_exist_hashed(shared, payload)),
        Some(GlobalOp::PrefixHit) => reply_bytes(prefix_hit(shared, payload)),
        Some(GlobalOp::Locate) => reply_bytes(locate(shared, payload)),
        Some(GlobalOp::Status) => reply_bytes(Ok::<_, RpcError>(status(shared))),
        Some(GlobalOp::GetReplicaList) => return None,
    };
    Some(body)
}

/// A `BatchIsExist` request decoded without copying its keys.
#[derive(serde::Deserialize)]
struct BatchIsExistRef<'a> {
    #[serde(borrow)]
    keys: Vec<&'a str>,
    #[serde(default)]
    labels: Option<LabelFilter>,
}

/// Decodes a request that borrows from `bytes`, with the limits of [`decode`].
fn decode_borrowed<'a, T: serde::Deserialize<'a>>(bytes: &'a [u8]) -> Result<T, RpcError> {
    if bytes.len() > hkvm_events::rpc::MAX_RPC_BYTES {
        return Err(RpcError::invalid(format!(
            "body of {} bytes exceeds {}",
            bytes.len(),
            hkvm_events::rpc::MAX_RPC_BYTES
        )));
    }
    rmp_serde::from_slice(bytes).map_err(|e| RpcError::invalid(format!("malformed body: {e}")))
}

fn filter<'a>(shared: &'a Shared, asked: &'a Option<LabelFilter>) -> Option<&'a LabelFilter> {
    asked.as_ref().or(shared.config.default_labels.as_ref())
}

fn batch_is_exist(shared: &Shared, body: &[u8]) -> Result<BatchIsExistReply, RpcError> {
    let request: BatchIsExistRef<'_> = decode_borrowed(body)?;
    query::check_keys(&request.keys, MAX_BATCH_KEYS)?;
    let hashes: Vec<u64> = request.keys.iter().map(|key| key_hash(key)).collect();
    holders_of_hashes(shared, &request.labels, &hashes)
}

fn batch_is_exist_hashed(shared: &Shared, body: &[u8]) -> Result<BatchIsExistReply, RpcError> {
    let request: BatchIsExistHashed = decode(body)?;
    holders_of_hashes(shared, &request.labels, &request.hashes)
}

/// The `batch_is_exist` answer for keys already hashed (outside the lock).
fn holders_of_hashes(
    shared: &Shared,
    labels: &Option<LabelFilter>,
    hashes: &[u64],
) -> Result<hkvm_events::rpc::global::BatchIsExistReply, RpcError> {
    let projection = shared.read();
    let views = query::views(&projection, &shared.registry(), filter(shared, labels));
    let staleness = shared.staleness(&projection);
    query::batch_is_exist_hashed(&projection, &views, hashes, staleness)
}

fn prefix_hit(shared: &Shared, body: &[u8]) -> Result<PrefixHitReply, RpcError> {
    let request: PrefixHit = decode(body)?;
    let projection = shared.read();
    let views = query::views(
        &projection,
        &shared.registry(),
        filter(shared, &request.labels),
    );
    Ok(PrefixHitReply {
        prefixes: query::prefix_hit(&projection, &views, &request.keys)?,
        staleness: shared.staleness(&projection),
    })
}

fn locate(shared: &Shared, body: &[u8]) -> Result<LocateReply, RpcError> {
    let request: Locate = decode(body)?;
    let projection = shared.read();
    let registry = shared.registry();
    let views = query::views(&projection, &registry, filter(shared, &request.labels));
    Ok(LocateReply {
        owners: query::locate(
            &shared.config.cluster,
            &projection,
            &views,
            &registry,
            &request.keys,
        )?,
        staleness: shared.staleness(&projection),
    })
}

/// The replica's state, as the status RPC reports it.
pub(crate) fn status(shared: &Shared) -> GlobalStatusReply {
    let projection = shared.read();
    GlobalStatusReply {
        replica: shared.config.replica.clone(),
        replaying: shared.is_replaying(),
        keys: projection.index().len() as u64,
        bytes_per_key: projection.bytes_per_key(),
        sources: shared.source_statuses(&projection),
        direct: shared
            .direct_endpoint
            .get()
            .map(|(endpoint, _)| endpoint.clone()),
        direct_ticket: shared
            .direct_endpoint
            .get()
            .map(|(_, ticket)| ticket.clone()),
    }
}

/// Forwards each key to its owning sub-master (one request per sub-cluster) and
/// puts the answers back in request order. A key held nowhere is `NotFound`
/// without asking anyone (after catching up with the streams, for a `sync`
/// request); a sub-master that fails or does not answer fails the whole request
/// (the caller retries).
async fn proxy(
    shared: &Shared,
    client: &async_nats::Client,
    body: &[u8],
    arrived: tokio::time::Instant,
) -> Result<ProxyGetReplicaListReply, RpcError> {
    let request: ProxyGetReplicaList = decode(body)?;
    let route = || {
        let projection = shared.read();
        let registry = shared.registry();
        let views = query::views(&projection, &registry, filter(shared, &request.labels));
        let routes = query::route(&projection, &views, &registry, &request.keys)?;
        Ok::<_, RpcError>((routes, shared.staleness(&projection)))
    };
    let (mut routes, mut staleness) = route()?;
    if request.sync && routes.iter().any(Option::is_none) {
        // "Held nowhere" only once every write acknowledged before the request
        // is applied here.
        let js = async_nats::jetstream::new(client.clone());
        crate::sync::wait_current(shared, &js, arrived).await?;
        shared.metrics.sync_waits.inc();
        (routes, staleness) = route()?;
    }
    let mut groups: BTreeMap<SubclusterId, Vec<usize>> = BTreeMap::new();
    for (index, route) in routes.iter().enumerate() {
        if let Some(subcluster) = route {
            groups.entry(subcluster.clone()).or_default().push(index);
        }
    }
    let mut items: GetReplicaListReply = (0..request.keys.len())
        .map(|_| ItemResult::Err(ItemError::NotFound))
        .collect();
    // The proxy asks through the client library's retry policy, bounded by the
    // proxy timeout: a sub-master in a takeover is waited for, briefly.
    let timeout = Duration::from_millis(shared.config.proxy_timeout_ms.max(1));
    let caller = RpcCaller::new(
        client.clone(),
        RetryPolicy {
            request_timeout: timeout,
            retry_deadline: timeout,
            ..RetryPolicy::default()
        },
    );
    let retry_ms = shared.config.busy_retry_ms;
    let asks = groups.into_iter().map(|(subcluster, indexes)| {
        let keys: Vec<String> = indexes.iter().map(|&i| request.keys[i].clone()).collect();
        let submaster = SubmasterClient::with_caller(
            caller.clone(),
            shared.config.cluster.clone(),
            subcluster.clone(),
        )
        .without_leader_watch();
        async move {
            let reply = submaster
                .get_replica_list(keys)
                .await
                .map_err(|error| proxy_failure(retry_ms, &subcluster, error))?;
            if reply.len() != indexes.len() {
                return Err(RpcError::new(
                    RpcErrorCode::Internal,
                    format!("sub-cluster {subcluster} answered {} items", reply.len()),
                ));
            }
            Ok::<_, RpcError>((indexes, reply))
        }
    });
    for answer in futures::future::join_all(asks).await {
        let (indexes, reply) = answer?;
        for (index, item) in indexes.into_iter().zip(reply) {
            items[index] = item;
        }
    }
    let from = routes
        .into_iter()
        .zip(&items)
        .map(|(route, item)| match item {
            ItemResult::Ok(_) => route,
            ItemResult::Err(_) => None,
        })
        .collect();
    Ok(ProxyGetReplicaListReply {
        from,
        items,
        staleness,
    })
}

/// What the proxy answers when a sub-master call failed: the sub-master's own
/// refusal as it is, `Busy` when it was unavailable (the caller retries).
fn proxy_failure(retry_ms: u64, subcluster: &SubclusterId, error: ClientError) -> RpcError {
    match error {
        ClientError::Rpc { source, .. } => source,
        error => RpcError::busy(
            retry_ms,
            format!("sub-master of {subcluster} did not answer: {error}"),
        ),
    }
}

#[cfg(test)]
mod tests {
    use hkvm_events::rpc::global::{BatchIsExist, GlobalStatus};
    use hkvm_projector::Projection;

    use super::*;
    use crate::GlobalMasterConfig;

    fn ask<Rep: serde::de::DeserializeOwned>(
        shared: &Shared,
        op: GlobalOp,
        request: &impl Serialize,
    ) -> RpcReply<Rep> {
        let body = encode(request).unwrap();
        let reply = answer_locally(shared, Some(op), op.name(), &body).unwrap();
        decode(&reply).unwrap()
    }

    #[test]
    fn a_replaying_replica_answers_busy_except_status() {
        let config = GlobalMasterConfig {
            busy_retry_ms: 321,
            ..GlobalMasterConfig::default()
        };
        let shared = Shared::new(config, Projection::new());
        assert!(shared.is_replaying());
        let request = BatchIsExist {
            keys: vec!["k".into()],
            labels: None,
        };
        let busy: RpcReply<hkvm_events::rpc::global::BatchIsExistReply> =
            ask(&shared, GlobalOp::BatchIsExist, &request);
        let RpcReply::Err(error) = busy else {
            panic!("a replaying replica answered {busy:?}");
        };
        assert_eq!(
            error.code,
            RpcErrorCode::Busy {
                retry_after_ms: 321
            }
        );
        let status: RpcReply<GlobalStatusReply> = ask(&shared, GlobalOp::Status, &GlobalStatus {});
        assert!(matches!(status, RpcReply::Ok(status) if status.replaying));
    }

    #[test]
    fn an_unknown_operation_is_an_invalid_request() {
        let shared = Shared::new(GlobalMasterConfig::default(), Projection::new());
        let reply = answer_locally(&shared, None, "no_such_op", b"").unwrap();
        let reply: RpcReply<()> = decode(&reply).unwrap();
        assert!(
            matches!(&reply, RpcReply::Err(e) if e.code == RpcErrorCode::InvalidRequest),
            "{reply:?}"
        );
        // While replaying, even the proxied call is answered here: Busy.
        let proxied = answer_locally(
            &shared,
            Some(GlobalOp::GetReplicaList),
            GlobalOp::GetReplicaList.name(),
            b"",
        )
        .unwrap();
        let proxied: RpcReply<()> = decode(&proxied).unwrap();
        assert!(
            matches!(&proxied, RpcReply::Err(e) if matches!(e.code, RpcErrorCode::Busy { .. })),
            "{proxied:?}"
        );
    }
}
