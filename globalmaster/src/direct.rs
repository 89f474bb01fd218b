//! The replica's direct front: clients' queries on a TCP port of its own
//! ([`hkvm_direct::server`]), so that a query and its answer cross no NATS
//! broker. Every query is answered exactly as on the NATS front (the same
//! functions, the same `Busy` while replaying, the same payload limit); the
//! proxied `get_replica_list` runs on a task of its own there too. Clients find
//! the port in the replica's status, asked over NATS of whichever replica the
//! queue group picks, so they spread over the replicas.

use std::sync::Arc;

use hkvm_direct::server::advertised;
use hkvm_direct::{DirectReply, DirectServer, DirectService};
use hkvm_events::rpc::direct::{DirectHello, DirectWelcome};
use hkvm_events::rpc::global::GlobalOp;
use hkvm_events::rpc::{RpcError, RpcErrorCode};
use tokio::net::TcpListener;
use tokio::time::Instant;

use crate::rpc::{local_reply, proxied_reply};
use crate::state::Shared;
use crate::{GlobalMasterError, GlobalMasterErrorKind};

/// Binds the direct front the configuration asks for and serves it until the
/// returned server is dropped; records its endpoint for the status RPC. `None`
/// when direct queries are off (or the address to listen on is unknown).
///
/// # Errors
/// When the listener cannot be bound.
pub(crate) async fn start(
    shared: &Arc<Shared>,
    client: &async_nats::Client,
) -> Result<Option<DirectServer>, GlobalMasterError> {
    let config = &shared.config.direct;
    let Some(addr) = config.listen_addr(&client.server_info().client_ip) else {
        return Ok(None);
    };
    let failed = |what: String| {
        move |e: std::io::Error| GlobalMasterError::caused(GlobalMasterErrorKind::Nats, what, e)
    };
    let listener = TcpListener::bind(addr)
        .await
        .map_err(failed(format!("binding the direct front on {addr}")))?;
    let service = Arc::new(ReplicaService {
        shared: Arc::clone(shared),
        client: client.clone(),
    });
    let server = DirectServer::serve(listener, service)
        .map_err(failed("reading the direct address".into()))?;
    let endpoint = advertised(config.advertise.as_deref(), server.local_addr());
    tracing::info!(bound = %server.local_addr(), %endpoint, "taking direct queries");
    let _ = shared
        .direct_endpoint
        .set((endpoint, server.ticket().clone()));
    Ok(Some(server))
}

/// A replica's direct service.
struct ReplicaService {
    shared: Arc<Shared>,
    client: async_nats::Client,
}

impl DirectService for ReplicaService {
    fn welcome(&self, hello: &DirectHello) -> Result<DirectWelcome, RpcError> {
        if hello.cluster != self.shared.config.cluster || hello.subcluster.is_some() {
            return Err(RpcError::invalid(format!(
                "this endpoint is a global-master replica of {}",
                self.shared.config.cluster
            )));
        }
        if self.shared.is_replaying() {
            // Not linked while it replays: the queue group reaches a replica
            // that serves.
            return Err(RpcError::new(
                RpcErrorCode::Busy {
                    retry_after_ms: self.shared.config.busy_retry_ms,
                },
                "replaying the event streams",
            ));
        }
        Ok(DirectWelcome {
            server: self.shared.config.replica.clone(),
            epoch: 0,
        })
    }

    fn request(&self, op: &str, body: &[u8], reply: DirectReply, received: Instant) {
        let parsed = GlobalOp::from_name(op);
        if let Some(answer) = local_reply(&self.shared, &self.client, parsed, op, body, received) {
            reply.send(answer);
            return;
        }
        let (shared, client, body) = (Arc::clone(&self.shared), self.client.clone(), body.to_vec());
        tokio::spawn(async move {
            reply.send(proxied_reply(&shared, &client, &body, received).await);
        });
    }

    fn connections(&self, delta: i64) {
        self.shared.metrics.direct_connections.inc_by(delta);
    }
}
