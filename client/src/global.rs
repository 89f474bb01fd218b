//! Calling the global master: typed requests through the shared [`RpcCaller`] retry
//! policy (queries are read-only, so a request lost with a replica that stopped is
//! simply asked again), for the CLI, benchmarks, tests and [`crate::KvClient`].

use hkvm_events::rpc::global::{
    BatchIsExist, BatchIsExistHashed, BatchIsExistReply, GlobalOp, LabelFilter,
};
use hkvm_events::rpc::{RpcErrorCode, RpcReply};
use hkvm_events::subject::global_rpc_subject;
use hkvm_events::ClusterId;
use serde::de::DeserializeOwned;
use serde::Serialize;

use std::sync::Arc;

use crate::direct::DirectRoute;
use crate::error::ClientError;
use crate::retry::{Resend, RetryPolicy, RpcCaller};

/// A handle for global-master requests of one cluster: on a direct link to a
/// replica when one is up ([`crate::direct`]), over NATS otherwise. Cheap to
/// clone; clones share the link.
#[derive(Debug, Clone)]
pub struct GlobalClient {
    caller: RpcCaller,
    cluster: ClusterId,
    direct: Option<Arc<DirectRoute>>,
}

impl GlobalClient {
    /// A handle over `nats` for `cluster` with the default retry policy.
    pub fn new(nats: async_nats::Client, cluster: ClusterId) -> Self {
        Self::with_policy(nats, cluster, RetryPolicy::default())
    }

    /// A handle with an explicit retry policy (a zero `retry_deadline` asks once).
    pub fn with_policy(nats: async_nats::Client, cluster: ClusterId, policy: RetryPolicy) -> Self {
        Self::with_caller(RpcCaller::new(nats, policy), cluster)
    }

    /// A handle sharing `caller` (its connection, policy and stats).
    pub fn with_caller(caller: RpcCaller, cluster: ClusterId) -> Self {
        let direct = Some(Arc::new(DirectRoute::global(
            caller.nats().clone(),
            cluster.clone(),
        )));
        Self {
            caller,
            cluster,
            direct,
        }
    }

    /// This handle with every request over NATS, none on a direct link.
    pub fn without_direct(self) -> Self {
        Self {
            direct: None,
            ..self
        }
    }

    /// Requests this handle (and its clones) sent on direct links.
    pub fn direct_requests(&self) -> u64 {
        self.direct.as_deref().map_or(0, DirectRoute::sent)
    }

    /// The endpoint of the replica this handle has a direct link to, if one is
    /// up.
    pub fn direct_link(&self) -> Option<String> {
        self.direct
            .as_deref()
            .and_then(DirectRoute::linked)
            .map(|(endpoint, _)| endpoint)
    }

    /// The caller (connection, retry policy, stats) this handle uses.
    pub fn caller(&self) -> &RpcCaller {
        &self.caller
    }

    /// Sends `request` once and returns the reply as sent (which may be `Busy`).
    ///
    /// # Errors
    /// [`ClientError`] when NATS fails, nobody answers in time, or the reply does
    /// not decode.
    pub async fn call_once<Req: Serialize, Rep: DeserializeOwned>(
        &self,
        op: GlobalOp,
        request: &Req,
    ) -> Result<RpcReply<Rep>, ClientError> {
        let subject = global_rpc_subject(&self.cluster, op.name());
        self.caller
            .call_once_via(op.name(), subject, request, self.direct.as_ref())
            .await
    }

    /// Which sub-clusters hold each of `keys`, asked once (the reply may be
    /// `Busy`). The keys go as their 64-bit hashes and the answer comes back
    /// packed (`batch_is_exist_packed`). A replica too old to know that
    /// operation refuses it as invalid; the hashes are then asked again with
    /// the older reply form (`batch_is_exist_hashed`), and a replica older still
    /// is asked with the keys as strings (`batch_is_exist`). Every form gives
    /// the same answer.
    ///
    /// # Errors
    /// As [`GlobalClient::call_once`].
    pub async fn batch_is_exist(
        &self,
        keys: &[impl AsRef<str>],
        labels: Option<LabelFilter>,
    ) -> Result<RpcReply<BatchIsExistReply>, ClientError> {
        let hashed = BatchIsExistHashed::of_keys(keys, labels);
        let mut reply = self
            .call_once(GlobalOp::BatchIsExistPacked, &hashed)
            .await?;
        if matches!(&reply, RpcReply::Err(error) if error.code == RpcErrorCode::InvalidRequest) {
            reply = self
                .call_once(GlobalOp::BatchIsExistHashed, &hashed)
                .await?;
        }
        match reply {
            RpcReply::Err(error) if error.code == RpcErrorCode::InvalidRequest => {
                let request = BatchIsExist {
                    keys: keys.iter().map(|key| key.as_ref().to_owned()).collect(),
                    labels: hashed.labels,
                };
                self.call_once(GlobalOp::BatchIsExist, &request).await
            }
            reply => Ok(reply),
        }
    }

    /// Sends `request`, retrying `Busy`, no responders (no replica up yet) and
    /// unanswered attempts until the policy's deadline.
    ///
    /// # Errors
    /// [`ClientError`]; its [`kind`](ClientError::kind) tells a refusal from an
    /// unavailable global master.
    pub async fn call<Req: Serialize, Rep: DeserializeOwned>(
        &self,
        op: GlobalOp,
        request: &Req,
    ) -> Result<Rep, ClientError> {
        let subject = global_rpc_subject(&self.cluster, op.name());
        self.caller
            .call_via(
                op.name(),
                subject,
                request,
                Resend::Safe,
                self.direct.as_ref(),
            )
            .await
    }
}
