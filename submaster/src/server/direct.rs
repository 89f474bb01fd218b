//! The leader's direct front: its clients' hot operations on a TCP port of its
//! own ([`hkvm_direct::server`]), so that a request and its reply cross no NATS
//! broker. Every request goes through the same [`Gate`] as on the NATS front:
//! the same recovery, queue and ping rules, the same state machine, the same
//! durability. The front lives exactly as long as the leadership: when the
//! leader steps down, the listener closes and every connection is no longer
//! read; clients go back to NATS until they reach the next leader.

use std::sync::Arc;

use hkvm_direct::server::advertised;
use hkvm_direct::{DirectReply, DirectServer, DirectService};
use hkvm_events::rpc::direct::{is_direct_op, DirectHello, DirectTicket, DirectWelcome};
use hkvm_events::rpc::submaster::Op;
use hkvm_events::rpc::{RpcError, RpcErrorCode};
use hkvm_events::{ClusterId, SubclusterId};
use tokio::net::TcpListener;
use tokio::time::Instant;

use super::rpc::{encode_error, Gate, ReplyTo, Route};
use super::Context;
use crate::error::{SubmasterError, SubmasterErrorKind};
use crate::metrics::SubmasterMetrics;

/// The running direct front; dropping it closes it.
pub(crate) struct DirectFront {
    /// `host:port` clients are told to connect to.
    pub(crate) endpoint: String,
    /// What they show to connect: published with the endpoint, over NATS only.
    pub(crate) ticket: DirectTicket,
    _server: DirectServer,
}

impl DirectFront {
    /// Binds the listener the configuration asks for and serves it as the
    /// leader `welcome` names: `None` when direct requests are off (or the
    /// address to listen on is unknown).
    ///
    /// # Errors
    /// When the listener cannot be bound.
    pub(crate) async fn start(
        ctx: &Context,
        gate: Gate,
        welcome: DirectWelcome,
    ) -> Result<Option<Self>, SubmasterError> {
        let seen_by_nats = ctx.client.server_info().client_ip;
        let Some(addr) = ctx.config.direct.listen_addr(&seen_by_nats) else {
            return Ok(None);
        };
        let failed = |what: String| {
            move |e: std::io::Error| SubmasterError::caused(SubmasterErrorKind::Rpc, what, e)
        };
        let listener = TcpListener::bind(addr)
            .await
            .map_err(failed(format!("binding the direct front on {addr}")))?;
        let service = Arc::new(LeaderService {
            gate,
            client: ctx.client.clone(),
            metrics: ctx.metrics.clone(),
            cluster: ctx.config.cluster.clone(),
            subcluster: ctx.config.subcluster.clone(),
            welcome,
        });
        let server = DirectServer::serve(listener, service)
            .map_err(failed("reading the direct address".into()))?;
        let endpoint = advertised(ctx.config.direct.advertise.as_deref(), server.local_addr());
        tracing::info!(bound = %server.local_addr(), %endpoint, "taking direct requests");
        Ok(Some(Self {
            endpoint,
            ticket: server.ticket().clone(),
            _server: server,
        }))
    }
}

/// A leader's direct service.
struct LeaderService {
    gate: Gate,
    client: async_nats::Client,
    metrics: SubmasterMetrics,
    cluster: ClusterId,
    subcluster: SubclusterId,
    welcome: DirectWelcome,
}

impl LeaderService {
    /// Why this leader must not answer direct requests now, if it must not. Its
    /// clients then drop the link and ask over NATS, which reaches whoever
    /// leads: a leader whose lease is unconfirmed, or whose NATS connection is
    /// down, may already be replaced, and must neither answer reads from a state
    /// a new leader has moved past nor keep its nodes' pings away from the new
    /// leader. (Over NATS such a leader answers `Busy`: there the new leader is
    /// reached too.)
    fn not_serving(&self) -> Option<&'static str> {
        if !self.gate.is_ready() {
            Some("this leader's lease is unconfirmed; ask over NATS")
        } else if self.client.connection_state() != async_nats::connection::State::Connected {
            Some("this leader lost its NATS connection; ask over NATS")
        } else {
            None
        }
    }
}

impl DirectService for LeaderService {
    fn welcome(&self, hello: &DirectHello) -> Result<DirectWelcome, RpcError> {
        if hello.cluster != self.cluster || hello.subcluster.as_ref() != Some(&self.subcluster) {
            let asked = hello
                .subcluster
                .as_ref()
                .map_or("the global master", SubclusterId::as_str);
            return Err(RpcError::invalid(format!(
                "this endpoint serves {}/{}, not {}/{asked}",
                self.cluster, self.subcluster, hello.cluster
            )));
        }
        if let Some(why) = self.not_serving() {
            return Err(RpcError::new(RpcErrorCode::NotLeader, why));
        }
        Ok(self.welcome.clone())
    }

    fn request(&self, op: &str, body: &[u8], reply: DirectReply, received: Instant) {
        let op = match Op::from_name(op) {
            Some(op) if is_direct_op(op) => op,
            _ => {
                let error = RpcError::invalid(format!(
                    "{op:?} is not an operation of direct connections; send it over NATS"
                ));
                reply.send(encode_error(&error));
                return;
            }
        };
        if let Some(why) = self.not_serving() {
            reply.send(encode_error(&RpcError::new(RpcErrorCode::NotLeader, why)));
            return;
        }
        if let Some((ReplyTo::Direct(reply), body)) =
            self.gate
                .admit(op, Route::Plain, body, ReplyTo::Direct(reply), received)
        {
            reply.send(body);
        }
    }

    fn connections(&self, delta: i64) {
        self.metrics.direct_connections.inc_by(delta);
    }
}
