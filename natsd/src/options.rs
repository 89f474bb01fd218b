//! How a server is started, and the config file written from that.

use std::fmt::Write as _;
use std::path::Path;
use std::time::Duration;

use crate::ToolsDir;

/// How to start a server. Fill what you need and take the rest from `Default`.
#[derive(Debug, Clone)]
pub struct ServerOptions {
    /// `server_name`, also used in logs and errors.
    pub name: String,
    /// Enable JetStream (file storage in the server's temp dir).
    pub jetstream: bool,
    /// When JetStream's stored messages reach the disk.
    pub durability: Durability,
    /// Raw config text appended to the generated config (accounts, users, limits).
    pub extra_config: String,
    /// How long to wait for `/healthz` to answer 200.
    pub ready_timeout: Duration,
    /// Which client port to listen on.
    pub client_port: ClientPort,
    /// Cluster membership, for a node of a cluster.
    pub routes: Option<Routes>,
    /// Which checkout's provisioned binary to prefer over `PATH`.
    pub tools_dir: ToolsDir,
}

impl Default for ServerOptions {
    fn default() -> Self {
        Self {
            name: "hkvm-nats".to_owned(),
            jetstream: true,
            durability: Durability::default(),
            extra_config: String::new(),
            ready_timeout: Duration::from_secs(30),
            client_port: ClientPort::Ephemeral,
            routes: None,
            tools_dir: ToolsDir::default(),
        }
    }
}

/// When JetStream makes what it stored safe from power loss.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub enum Durability {
    /// nats-server's default: messages are written to the store's files at
    /// once and fsynced every 2 minutes. An acknowledged write survives a crash
    /// of any process, but an OS crash or a power loss of the node (of every
    /// node at once, for replicated streams) can take back up to 2 minutes of
    /// acknowledged writes.
    #[default]
    Default,
    /// `sync_interval: always`: JetStream fsyncs every write before it
    /// acknowledges it, so an acknowledged write survives power loss.
    Durable,
}

impl Durability {
    /// The `jetstream` block's line for this profile, if it needs one.
    pub fn jetstream_setting(self) -> Option<&'static str> {
        match self {
            Self::Default => None,
            Self::Durable => Some("sync_interval: always"),
        }
    }
}

/// The client port a server listens on (always on 127.0.0.1).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub enum ClientPort {
    /// A free port picked at start.
    #[default]
    Ephemeral,
    /// This port; the start fails when it is taken.
    Fixed(u16),
    /// This port when it is free, an ephemeral one otherwise (0 means ephemeral).
    Preferred(u16),
}

/// Cluster membership of one node: its route port and its peers' route ports.
#[derive(Debug, Clone)]
pub struct Routes {
    /// The cluster's name.
    pub cluster_name: String,
    /// This node's route port.
    pub route_port: u16,
    /// Every other node's route port.
    pub peer_route_ports: Vec<u16>,
}

/// The config file of a server named and set up by `options`, listening on the
/// given ports, with its JetStream store (when enabled) at `store_dir`.
pub(crate) fn render(
    options: &ServerOptions,
    client_port: u16,
    monitor_port: u16,
    store_dir: &Path,
) -> String {
    let mut config = String::new();
    // Writing into a String cannot fail.
    let _ = writeln!(config, "server_name: \"{}\"", options.name);
    let _ = writeln!(config, "listen: \"127.0.0.1:{client_port}\"");
    let _ = writeln!(config, "http: \"127.0.0.1:{monitor_port}\"");
    if options.jetstream {
        let _ = writeln!(config, "jetstream {{");
        let _ = writeln!(config, "  store_dir: \"{}\"", store_dir.display());
        if let Some(setting) = options.durability.jetstream_setting() {
            let _ = writeln!(config, "  {setting}");
        }
        let _ = writeln!(config, "}}");
    }
    if let Some(routes) = &options.routes {
        let peers: Vec<String> = routes
            .peer_route_ports
            .iter()
            .map(|port| format!("\"nats-route://127.0.0.1:{port}\""))
            .collect();
        let _ = writeln!(
            config,
            "cluster {{\n  name: \"{}\"\n  listen: \"127.0.0.1:{}\"\n  routes: [{}]\n}}",
            routes.cluster_name,
            routes.route_port,
            peers.join(", ")
        );
    }
    config.push_str(&options.extra_config);
    config.push('\n');
    config
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_config_has_jetstream_in_the_store_dir() {
        let options = ServerOptions {
            name: "hkvm-local".to_owned(),
            ..ServerOptions::default()
        };
        let config = render(&options, 4222, 8222, Path::new("/tmp/x/jetstream"));
        assert!(config.contains("server_name: \"hkvm-local\""));
        assert!(config.contains("listen: \"127.0.0.1:4222\""));
        assert!(config.contains("http: \"127.0.0.1:8222\""));
        assert!(config.contains("store_dir: \"/tmp/x/jetstream\""));
        assert!(!config.contains("cluster"));
        assert!(!config.contains("sync_interval"));
    }

    #[test]
    fn the_durable_profile_fsyncs_every_write() {
        let options = ServerOptions {
            durability: Durability::Durable,
            ..ServerOptions::default()
        };
        let config = render(&options, 4222, 8222, Path::new("/tmp/x/jetstream"));
        let jetstream = config
            .split("jetstream {")
            .nth(1)
            .and_then(|rest| rest.split('}').next())
            .unwrap_or_default();
        assert!(jetstream.contains("sync_interval: always"), "{config}");
    }

    #[test]
    fn a_cluster_node_routes_to_its_peers_and_extra_config_comes_last() {
        let options = ServerOptions {
            jetstream: false,
            extra_config: "max_payload: 4096".to_owned(),
            routes: Some(Routes {
                cluster_name: "trio".to_owned(),
                route_port: 6001,
                peer_route_ports: vec![6002, 6003],
            }),
            ..ServerOptions::default()
        };
        let config = render(&options, 4222, 8222, Path::new("/unused"));
        assert!(!config.contains("jetstream"));
        assert!(config.contains("name: \"trio\"\n  listen: \"127.0.0.1:6001\""));
        assert!(config.contains(
            "routes: [\"nats-route://127.0.0.1:6002\", \"nats-route://127.0.0.1:6003\"]"
        ));
        assert!(config.ends_with("max_payload: 4096\n"));
    }
}
