//! The Mooncake master's read-only HTTP routes, served beside `/metrics` on a
//! sub-master's metrics port (and over the whole cluster on a global master's), so that engines and operators that poll a Mooncake
//! master find the same answers here: SGLang's `check_server` waits for a
//! non-empty `/get_all_segments` at `master_metrics_port` (9003 by default).
//!
//! | route | answer |
//! |---|---|
//! | `/health` | JSON: `status`, `role` (this instance), `service_ready` (the leader answered), `leader_address`, `view_version` |
//! | `/get_all_segments` | text: one mounted segment name per line (empty while none is mounted) |
//! | `/query_segment?segment=S` | text: the segment, its used and its capacity bytes; 500 when unknown, as on Mooncake |
//! | `/get_segments_detail` | JSON: every segment with its HKVM id, node, endpoint, protocol and usage (`base_address` is 0: HKVM places by offset) |
//! | `/query_key?key=K` | JSON: `success` and the key's replicas (`size_`, `buffer_address_` = offset in the segment, `protocol_`, `transport_endpoint_`, `segment_id`); 404 with `error_code` -704 when absent |
//! | `/batch_query_keys?keys=A,B` | JSON: `success` and per key `ok`, `error`, `values` (the disk fields null: HKVM has no disk tier) |
//!
//! A segment's Mooncake name is its node's transfer endpoint `host:port`, as a
//! Mooncake client's `get_hostname()` gives it and as `preferred_segment` takes
//! it; `/query_segment` also takes HKVM's segment id.
//!
//! The field names, codes and statuses are those of Mooncake's master (checked
//! beside the real one by the Python suite); unlike it, `/query_key` decodes a
//! percent-encoded key.
//!
//! Every answer comes from the sub-cluster's leader, asked over NATS as any
//! client asks it (a standby's routes answer too); a look at a key takes no read
//! lease. Without a leader the data routes answer 503. The global master serves
//! the same routes over the whole cluster ([`Scope::Registered`]): it asks every
//! registered sub-cluster's leader and merges their answers.

use std::sync::Arc;
use std::time::Duration;

use async_nats::Client;
use futures::future::join_all;
use hkvm_events::rpc::submaster::{
    GetReplicaList, GetReplicaListReply, ItemError, ItemResult, Op, ReplicaList, SegmentStatus,
    Status, StatusReply,
};
use hkvm_events::rpc::{self, RpcReply};
use hkvm_events::subject::submaster_rpc_subject;
use hkvm_events::{ClusterId, SubclusterId};
use hkvm_telemetry::{HttpAnswer, HttpAnswerFuture, HttpRoutes};
use serde::de::DeserializeOwned;
use serde::Serialize;
use serde_json::{json, Value};

/// The sub-clusters a set of routes answers for.
#[derive(Clone)]
pub enum Scope {
    /// One sub-cluster (a sub-master's own).
    One(SubclusterId),
    /// Those the function names when asked (the global master's registry).
    Registered(Arc<dyn Fn() -> Vec<SubclusterId> + Send + Sync>),
}

impl Scope {
    fn subclusters(&self) -> Vec<SubclusterId> {
        match self {
            Self::One(subcluster) => vec![subcluster.clone()],
            Self::Registered(list) => list(),
        }
    }
}

/// What `/health` says of the instance serving the routes: its role (e.g.
/// `leader`, `standby`, `recovering`).
pub type RoleOf = Arc<dyn Fn() -> &'static str + Send + Sync>;

/// How long a route waits for the leader.
const ASK_TIMEOUT: Duration = Duration::from_secs(3);
/// Most keys one `/batch_query_keys` looks up.
const MAX_QUERY_KEYS: usize = 4096;
const JSON: &str = "application/json; charset=utf-8";
const TEXT: &str = "text/plain; version=0.0.4";

/// The Mooncake master's read-only routes over a [`Scope`] of sub-clusters.
pub struct MooncakeAdmin {
    client: Client,
    cluster: ClusterId,
    scope: Scope,
    role: RoleOf,
}

impl MooncakeAdmin {
    /// Routes answering from the leaders of the sub-clusters in `scope`, saying
    /// `role()` of the serving instance.
    pub fn new(client: Client, cluster: ClusterId, scope: Scope, role: RoleOf) -> Self {
        Self {
            client,
            cluster,
            scope,
            role,
        }
    }

    /// Asks the leader of `subcluster` `op` with `request`.
    async fn ask<Req: Serialize, Rep: DeserializeOwned>(
        &self,
        subcluster: &SubclusterId,
        op: Op,
        request: &Req,
    ) -> Result<Rep, String> {
        let subject = submaster_rpc_subject(&self.cluster, subcluster, op.name());
        let body = rpc::encode(request).map_err(|e| e.to_string())?;
        let reply = tokio::time::timeout(ASK_TIMEOUT, self.client.request(subject, body.into()))
            .await
            .map_err(|_| "the sub-master leader did not answer in time".to_owned())?
            .map_err(|e| format!("the sub-master leader did not answer: {e}"))?;
        match rpc::decode::<RpcReply<Rep>>(&reply.payload).map_err(|e| e.to_string())? {
            RpcReply::Ok(answer) => Ok(answer),
            RpcReply::Err(error) => Err(error.to_string()),
        }
    }

    /// The status of every sub-cluster in scope that answered (with its segment
    /// list); an error only when none did.
    async fn statuses(&self) -> Result<Vec<StatusReply>, String> {
        let subclusters = self.scope.subclusters();
        let asked = subclusters
            .iter()
            .map(|subcluster| self.ask(subcluster, Op::Status, &Status { segments: true }));
        let mut answered = Vec::with_capacity(subclusters.len());
        let mut last_error = "no sub-cluster is registered".to_owned();
        for (subcluster, result) in subclusters.iter().zip(join_all(asked).await) {
            match result {
                Ok(status) => answered.push(status),
                Err(error) => {
                    tracing::debug!(%subcluster, %error, "a sub-master did not answer an admin route");
                    last_error = format!("{subcluster}: {error}");
                }
            }
        }
        if answered.is_empty() {
            return Err(last_error);
        }
        Ok(answered)
    }

    /// Every mounted segment of the sub-clusters that answered.
    async fn segments(&self) -> Result<Vec<SegmentStatus>, String> {
        Ok(self
            .statuses()
            .await?
            .into_iter()
            .flat_map(|status| status.segment_list)
            .collect())
    }

    /// Per key its replicas: a key found in any sub-cluster in scope is found;
    /// an error only when no sub-cluster answered.
    async fn replicas(&self, keys: Vec<String>) -> Result<GetReplicaListReply, String> {
        let subclusters = self.scope.subclusters();
        let request = GetReplicaList { keys, lease: false };
        let asked = subclusters.iter().map(|subcluster| {
            self.ask::<_, GetReplicaListReply>(subcluster, Op::GetReplicaList, &request)
        });
        let mut merged: Option<GetReplicaListReply> = None;
        let mut last_error = "no sub-cluster is registered".to_owned();
        for result in join_all(asked).await {
            match result {
                Ok(reply) if reply.len() == request.keys.len() => match &mut merged {
                    None => merged = Some(reply),
                    Some(merged) => {
                        for (kept, other) in merged.iter_mut().zip(reply) {
                            if matches!(kept, ItemResult::Err(_))
                                && matches!(other, ItemResult::Ok(_))
                            {
                                *kept = other;
                            }
                        }
                    }
                },
                Ok(_) => last_error = "a sub-master answered another number of keys".to_owned(),
                Err(error) => last_error = error,
            }
        }
        merged.ok_or(last_error)
    }

    async fn health(&self) -> HttpAnswer {
        let statuses = self.statuses().await.ok();
        // One sub-cluster: its leader's id and epoch, as Mooncake gives its own.
        let leader = match (&self.scope, &statuses) {
            (Scope::One(_), Some(statuses)) => statuses.first(),
            _ => None,
        };
        let role = (self.role)();
        let body = json!({
            "status": "ok",
            "role": role,
            "ha_state": if role == "leader" { "serving" } else { role },
            "service_ready": statuses.is_some(),
            "leader_address": leader.map(|s| s.producer.clone()),
            "view_version": leader.map(|s| s.epoch),
        });
        HttpAnswer::ok(JSON, body.to_string())
    }

    async fn all_segments(&self) -> HttpAnswer {
        match self.segments().await {
            Ok(segments) => {
                let mut names: Vec<&str> = Vec::new();
                for segment in &segments {
                    if !names.contains(&segment.endpoint.as_str()) {
                        names.push(&segment.endpoint);
                    }
                }
                HttpAnswer::ok(TEXT, names.iter().map(|name| format!("{name}\n")).collect())
            }
            Err(error) => unavailable(&error),
        }
    }

    async fn query_segment(&self, segment: &str) -> HttpAnswer {
        let segments = match self.segments().await {
            Ok(segments) => segments,
            Err(error) => return unavailable(&error),
        };
        let named: Vec<&SegmentStatus> = segments
            .iter()
            .filter(|s| s.endpoint == segment || s.id.as_str() == segment)
            .collect();
        if named.is_empty() {
            return segment_not_found();
        }
        let used: u64 = named.iter().map(|s| s.used_bytes).sum();
        let capacity: u64 = named.iter().map(|s| s.capacity_bytes).sum();
        HttpAnswer::ok(
            TEXT,
            format!("{segment}\nUsed(bytes): {used}\nCapacity(bytes) : {capacity}\n"),
        )
    }

    async fn segments_detail(&self) -> HttpAnswer {
        let segments = match self.segments().await {
            Ok(segments) => segments,
            Err(error) => return unavailable(&error),
        };
        let segments: Vec<Value> = segments
            .iter()
            .map(|s| {
                json!({
                    "segment_name": s.endpoint,
                    "segment_id": s.id.as_str(),
                    "client_id": s.node.as_str(),
                    "base_address": "0x0",
                    "size_bytes": s.capacity_bytes,
                    "size_human": format!("{} GiB", gib(s.capacity_bytes)),
                    "te_endpoint": s.endpoint,
                    "protocol": if s.rdma { "rdma" } else { "tcp" },
                    "status": "OK",
                    "allocator_used_bytes": s.used_bytes,
                    "allocator_capacity_bytes": s.capacity_bytes,
                    "allocator_usage_percent": percent(s.used_bytes, s.capacity_bytes),
                })
            })
            .collect();
        let body = json!({ "total_segments": segments.len(), "segments": segments });
        HttpAnswer::ok(JSON, body.to_string())
    }

    async fn query_key(&self, key: String) -> HttpAnswer {
        let reply = match self.replicas(vec![key]).await {
            Ok(reply) => reply,
            Err(error) => return unavailable(&error),
        };
        match reply.into_iter().next() {
            Some(ItemResult::Ok(list)) => HttpAnswer::ok(
                JSON,
                json!({ "success": true, "data": descriptors(&list) }).to_string(),
            ),
            Some(ItemResult::Err(error)) => key_refused(&error),
            None => unavailable("the leader answered no item"),
        }
    }

    async fn batch_query_keys(&self, keys: Vec<String>) -> HttpAnswer {
        if keys.is_empty() {
            return bad_request("No keys provided. Use ?keys=key1,key2,...");
        }
        if keys.len() > MAX_QUERY_KEYS {
            return bad_request(&format!("at most {MAX_QUERY_KEYS} keys per request"));
        }
        let reply = match self.replicas(keys.clone()).await {
            Ok(reply) => reply,
            Err(error) => return unavailable(&error),
        };
        let data: serde_json::Map<String, Value> = keys
            .into_iter()
            .zip(reply)
            .map(|(key, result)| {
                let (ok, error, values) = match result {
                    ItemResult::Ok(list) => (true, None, Some(descriptors(&list))),
                    ItemResult::Err(error) => (false, Some(mooncake_code(&error).1), None),
                };
                let item = json!({
                    "ok": ok,
                    "error": error,
                    "values": values,
                    "disk_values": null,
                    "local_disk_values": null,
                    "nof_values": null,
                });
                (key, item)
            })
            .collect();
        HttpAnswer::ok(JSON, json!({ "success": true, "data": data }).to_string())
    }

    async fn route(&self, path: &str, query: &str) -> Option<HttpAnswer> {
        Some(match path {
            "/health" => self.health().await,
            "/get_all_segments" => self.all_segments().await,
            "/get_segments_detail" => self.segments_detail().await,
            // Without a name these answer as Mooncake's do for an unknown one.
            "/query_segment" => match query_value(query, "segment") {
                Some(segment) => self.query_segment(&segment).await,
                None => segment_not_found(),
            },
            "/query_key" => match query_value(query, "key") {
                Some(key) => self.query_key(key).await,
                None => key_refused(&ItemError::NotFound),
            },
            "/batch_query_keys" => {
                let keys = query_value(query, "keys").unwrap_or_default();
                let keys = keys
                    .split(',')
                    .filter(|key| !key.is_empty())
                    .map(str::to_owned)
                    .collect();
                self.batch_query_keys(keys).await
            }
            _ => return None,
        })
    }
}

impl HttpRoutes for MooncakeAdmin {
    fn get<'a>(&'a self, path: &'a str, query: &'a str) -> HttpAnswerFuture<'a> {
        Box::pin(self.route(path, query))
    }
}

/// The first value of `name` in a percent-encoded query string.
fn query_value(query: &str, name: &str) -> Option<String> {
    form_urlencoded::parse(query.as_bytes())
        .find(|(key, _)| key == name)
        .map(|(_, value)| value.into_owned())
}

/// A key's replicas as the Mooncake master describes a buffer; the offset in
/// the segment stands where Mooncake gives the buffer's address.
fn descriptors(list: &ReplicaList) -> Vec<Value> {
    list.replicas
        .iter()
        .map(|replica| {
            json!({
                "size_": list.size,
                "buffer_address_": replica.offset,
                "protocol_": if replica.rdma.is_some() { "rdma" } else { "tcp" },
                "transport_endpoint_": replica.endpoint,
                "segment_id": replica.segment.as_str(),
            })
        })
        .collect()
}

/// Mooncake's code and name for a refused item (the codes Python callers see;
/// see the client's `ErrorCode`).
fn mooncake_code(error: &ItemError) -> (i32, &'static str) {
    match error {
        ItemError::NotFound => (-704, "OBJECT_NOT_FOUND"),
        ItemError::Leased => (-706, "OBJECT_HAS_LEASE"),
        _ => (-1, "INTERNAL_ERROR"),
    }
}

/// A refused `/query_key`, as Mooncake's master answers it (404 and its code).
fn key_refused(error: &ItemError) -> HttpAnswer {
    let (code, name) = mooncake_code(error);
    HttpAnswer {
        status: 404,
        content_type: JSON,
        body: json!({ "success": false, "error_code": code, "error_message": name }).to_string(),
    }
}

/// An unknown `/query_segment`, as Mooncake's master answers it.
fn segment_not_found() -> HttpAnswer {
    HttpAnswer {
        status: 500,
        content_type: TEXT,
        body: "Failed to query segment".to_owned(),
    }
}

fn gib(bytes: u64) -> f64 {
    // Precision loss above 2^53 bytes is irrelevant for a display size.
    #[allow(clippy::cast_precision_loss)]
    let bytes = bytes as f64;
    bytes / f64::from(1u32 << 30)
}

fn percent(used: u64, capacity: u64) -> f64 {
    if capacity == 0 {
        return 0.0;
    }
    // Precision loss above 2^53 bytes is irrelevant for a percentage.
    #[allow(clippy::cast_precision_loss)]
    let ratio = used as f64 / capacity as f64;
    ratio * 100.0
}

fn unavailable(why: &str) -> HttpAnswer {
    tracing::debug!(why, "Mooncake admin route without a leader");
    HttpAnswer {
        status: 503,
        content_type: JSON,
        body: json!({ "success": false, "error": why }).to_string(),
    }
}

fn bad_request(why: &str) -> HttpAnswer {
    HttpAnswer {
        status: 400,
        content_type: JSON,
        body: json!({ "success": false, "error": why }).to_string(),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use hkvm_events::rpc::submaster::ReplicaLocation;
    use hkvm_events::{NodeId, SegmentId};

    #[test]
    fn query_values_are_percent_decoded_and_absent_names_are_none() {
        assert_eq!(
            query_value("key=a%2Fb%20c&x=1", "key").as_deref(),
            Some("a/b c")
        );
        assert_eq!(query_value("keys=a,b", "keys").as_deref(), Some("a,b"));
        assert_eq!(query_value("x=1", "key"), None);
        assert_eq!(query_value("", "key"), None);
    }

    #[test]
    fn a_replica_is_described_with_mooncakes_buffer_fields() {
        let list = ReplicaList {
            size: 4096,
            checksum: 1,
            replicas: vec![ReplicaLocation {
                grant: None,
                node: NodeId::new("n1").unwrap(),
                segment: SegmentId::new("host-12345").unwrap(),
                endpoint: "10.0.0.1:7000".into(),
                offset: 8192,
                rdma: None,
            }],
            lease_ms: 0,
        };
        assert_eq!(
            descriptors(&list),
            vec![json!({
                "size_": 4096,
                "buffer_address_": 8192,
                "protocol_": "tcp",
                "transport_endpoint_": "10.0.0.1:7000",
                "segment_id": "host-12345",
            })]
        );
    }

    #[test]
    fn refusals_carry_mooncakes_codes() {
        assert_eq!(
            mooncake_code(&ItemError::NotFound),
            (-704, "OBJECT_NOT_FOUND")
        );
        assert_eq!(
            mooncake_code(&ItemError::Leased),
            (-706, "OBJECT_HAS_LEASE")
        );
        assert_eq!(percent(1, 4), 25.0);
        assert_eq!(percent(1, 0), 0.0);
    }
}
