//! A JetStream cluster of `nats-server` child processes on loopback, whose nodes can
//! be killed (SIGKILL) and restarted on the same ports and store dirs.

use std::time::Duration;

use hkvm_natsd::{free_port, NatsdError, Routes};

use crate::{NatsServer, ServerOptions, TestkitError};

/// A running NATS cluster (usually 3 nodes, so R3 streams keep a quorum when one
/// node is down).
#[derive(Debug)]
pub struct NatsCluster {
    nodes: Vec<NatsServer>,
}

impl NatsCluster {
    /// Starts an `size`-node JetStream cluster and waits until every node is healthy
    /// (JetStream current with the meta leader).
    ///
    /// # Errors
    /// As for [`NatsServer::start_with`], for any node.
    pub async fn start(size: usize) -> Result<Self, TestkitError> {
        Self::start_with(size, ServerOptions::default()).await
    }

    /// Like [`NatsCluster::start`], with `template` options for every node (the name
    /// gets a `-<index>` suffix).
    ///
    /// # Errors
    /// As for [`NatsServer::start_with`], for any node.
    pub async fn start_with(size: usize, template: ServerOptions) -> Result<Self, TestkitError> {
        let route_ports = (0..size)
            .map(|_| free_port())
            .collect::<Result<Vec<_>, _>>()?;
        let mut nodes = Vec::with_capacity(size);
        for (index, route_port) in route_ports.iter().enumerate() {
            let options = ServerOptions {
                name: format!("{}-{index}", template.name),
                // Cluster formation and meta-leader election take longer than one node.
                ready_timeout: template.ready_timeout.max(Duration::from_secs(30)),
                routes: Some(Routes {
                    cluster_name: template.name.clone(),
                    route_port: *route_port,
                    peer_route_ports: route_ports
                        .iter()
                        .copied()
                        .filter(|port| port != route_port)
                        .collect(),
                }),
                ..template.clone()
            };
            nodes.push(NatsServer::prepare(options)?);
        }
        // Every node must run before any can become healthy: health needs a quorum.
        for node in &mut nodes {
            node.spawn()?;
        }
        for node in &mut nodes {
            node.wait_ready().await?;
        }
        Ok(Self { nodes })
    }

    /// The number of nodes.
    pub fn len(&self) -> usize {
        self.nodes.len()
    }

    /// Whether the cluster has no nodes.
    pub fn is_empty(&self) -> bool {
        self.nodes.is_empty()
    }

    /// One node.
    ///
    /// # Errors
    /// [`TestkitError::NoSuchNode`] for an index outside the cluster.
    pub fn node(&mut self, index: usize) -> Result<&mut NatsServer, TestkitError> {
        self.nodes
            .get_mut(index)
            .ok_or(TestkitError::NoSuchNode(index))
    }

    /// A comma-separated list of every node's client URL, for clients that should
    /// fail over between nodes.
    pub fn urls(&self) -> String {
        self.nodes
            .iter()
            .map(NatsServer::url)
            .collect::<Vec<_>>()
            .join(",")
    }

    /// Kills one node with SIGKILL; its store dir stays for a restart.
    ///
    /// # Errors
    /// [`TestkitError::NoSuchNode`].
    pub fn kill(&mut self, index: usize) -> Result<(), TestkitError> {
        self.node(index)?.kill();
        Ok(())
    }

    /// Restarts one node on its ports and store dir and waits until it is healthy.
    ///
    /// # Errors
    /// [`TestkitError::NoSuchNode`] or a start failure.
    pub async fn restart(&mut self, index: usize) -> Result<(), TestkitError> {
        Ok(self.node(index)?.restart().await?)
    }

    /// Connects a client that knows every node's URL and fails over between them.
    ///
    /// # Errors
    /// [`TestkitError::Server`] with [`NatsdError::Connect`] when no node accepts.
    pub async fn connect(&self) -> Result<async_nats::Client, TestkitError> {
        let urls = self.urls();
        let addrs: Vec<async_nats::ServerAddr> = self
            .nodes
            .iter()
            .filter_map(|node| node.url().parse().ok())
            .collect();
        async_nats::connect(addrs)
            .await
            .map_err(|source| NatsdError::Connect { url: urls, source }.into())
    }
}
