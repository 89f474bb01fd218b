//! One KV client per sub-cluster of a pool, made on first use and shared by every
//! copy (the gateway reads through them, the master writes through them).

use std::collections::HashMap;
use std::sync::{Arc, Mutex};

use hkvm_client::{KvClient, SubmasterClient};
use hkvm_events::{ClusterId, SubclusterId};
use hkvm_transfer::TcpTransport;

/// KV clients of one pool's sub-clusters.
pub(crate) struct PoolClients {
    nats: async_nats::Client,
    cluster: ClusterId,
    transport: Arc<TcpTransport>,
    clients: Mutex<HashMap<SubclusterId, KvClient>>,
}

impl PoolClients {
    /// Clients of `cluster`'s sub-clusters over `nats`, moving bytes over TCP.
    pub fn new(nats: async_nats::Client, cluster: ClusterId) -> Self {
        Self {
            nats,
            cluster,
            transport: Arc::new(TcpTransport::default()),
            clients: Mutex::default(),
        }
    }

    /// The client of `subcluster`.
    pub fn get(&self, subcluster: &SubclusterId) -> KvClient {
        let mut clients = self
            .clients
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner);
        clients
            .entry(subcluster.clone())
            .or_insert_with(|| {
                let metadata = SubmasterClient::new(
                    self.nats.clone(),
                    self.cluster.clone(),
                    subcluster.clone(),
                );
                KvClient::new(metadata, Arc::clone(&self.transport) as _)
            })
            .clone()
    }
}
