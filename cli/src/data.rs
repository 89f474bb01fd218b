//! The data commands: `hkvm node` (serve a segment), `hkvm put` and `hkvm get`.

use std::io::{Read as _, Write as _};
use std::net::SocketAddr;
use std::path::PathBuf;
use std::sync::Arc;

use anyhow::Context as _;
use hkvm_client::coalesce::CoalesceConfig;
use hkvm_client::dummy::{DummyServer, DummyServerConfig, PeerAccess};
use hkvm_client::store::{Store, StoreAddress, StoreConfig};
use hkvm_client::{
    KvClient, NodeConfig, NodeHandle, Protocol, RdmaSettings, SubmasterClient, Transports,
};
use hkvm_events::NodeId;
use hkvm_transfer::TcpTransport;

use crate::meta::SubclusterTarget;

/// Parses sizes like `64MiB`, `1GiB`, `4096`.
pub fn parse_size(text: &str) -> Result<u64, String> {
    let text = text.trim();
    let split = text
        .find(|c: char| !c.is_ascii_digit())
        .unwrap_or(text.len());
    let (digits, unit) = text.split_at(split);
    let number: u64 = digits
        .parse()
        .map_err(|_| format!("{text:?} is not a size"))?;
    let scale: u64 = match unit.trim().to_ascii_lowercase().as_str() {
        "" | "b" => 1,
        "k" | "kb" | "kib" => 1 << 10,
        "m" | "mb" | "mib" => 1 << 20,
        "g" | "gb" | "gib" => 1 << 30,
        other => return Err(format!("unknown size unit {other:?}")),
    };
    number
        .checked_mul(scale)
        .ok_or_else(|| format!("{text:?} is too large"))
}

/// How KV bytes move: `--protocol tcp|rdma` and the RDMA device options.
#[derive(Debug, Clone, clap::Args)]
pub struct TransportArgs {
    /// `tcp`, or `rdma`: serve (a node) and move (a client) bytes over RDMA where
    /// both ends have it, TCP otherwise. Fails at once on a host without the RDMA
    /// device asked for, or in a build without the `rdma` feature.
    #[arg(long, default_value = "tcp", value_parser = ["tcp", "rdma"])]
    pub protocol: String,
    /// With `--protocol rdma`: the devices to try, comma-separated (e.g.
    /// `mlx5_0,mlx5_1`); the first that opens is used. Default: the host's first.
    #[arg(long, default_value = "")]
    pub rdma_devices: String,
    /// With `--protocol rdma`: the port's GID index (RoCE v2 usually needs the
    /// index of an IPv4-mapped GID; `show_gids` lists them).
    #[arg(long, default_value_t = 0)]
    pub rdma_gid_index: u8,
    /// With `--protocol rdma`: the device port (1-based).
    #[arg(long, default_value_t = 1)]
    pub rdma_port: u8,
}

impl TransportArgs {
    /// The protocol these options ask for.
    pub fn protocol(&self) -> Protocol {
        match self.protocol.as_str() {
            "rdma" => Protocol::Rdma(RdmaSettings {
                devices: self
                    .rdma_devices
                    .split(',')
                    .map(str::trim)
                    .filter(|d| !d.is_empty())
                    .map(str::to_owned)
                    .collect(),
                port: self.rdma_port,
                gid_index: self.rdma_gid_index,
            }),
            _ => Protocol::Tcp,
        }
    }
}

/// Options of `hkvm node`.
#[derive(Debug, clap::Args)]
pub struct NodeArgs {
    #[command(flatten)]
    pub at: SubclusterTarget,
    /// This node's id (default: `node-<pid>`).
    #[arg(long)]
    pub id: Option<NodeId>,
    /// Size of the memory segment to contribute (e.g. `1GiB`).
    #[arg(long, value_parser = parse_size)]
    pub segment_size: u64,
    /// Where to serve transfers.
    #[arg(long, default_value = "127.0.0.1:0")]
    pub listen: SocketAddr,
    /// The address peers should use (default: the listen address).
    #[arg(long)]
    pub advertise: Option<String>,
    #[command(flatten)]
    pub transport: TransportArgs,
    /// Serve dummy clients (inference processes on this host calling
    /// `setup_dummy(..., "localhost:<port>")`) on the abstract Unix socket
    /// `hkvm-node-<port>`: this node is then their real client.
    #[arg(long)]
    pub dummy_port: Option<u16>,
    /// With --dummy-port: also serve dummies run by these users (numeric uids,
    /// repeatable or comma-separated); this process's own user is always served,
    /// every other refused.
    #[arg(long, value_delimiter = ',')]
    pub dummy_allow_uid: Vec<u32>,
    /// With --dummy-port: how long (µs) a batch of the dummies' metadata calls may
    /// wait for more, while fewer have come than were in the previous batch (0:
    /// send what queued while the previous batch was in flight). A lone caller
    /// never waits.
    #[arg(long, default_value_t = hkvm_client::coalesce::DEFAULT_WINDOW.as_micros() as u64)]
    pub coalesce_window_us: u64,
}

/// Runs a node until Ctrl-C or SIGTERM, then unmounts.
///
/// # Errors
/// When the segment cannot be served or mounted.
pub async fn node(args: NodeArgs) -> anyhow::Result<()> {
    if let Some(port) = args.dummy_port {
        return real_client(args, port).await;
    }
    let id = match args.id {
        Some(id) => id,
        None => NodeId::new(format!("node-{}", std::process::id()))?,
    };
    let mut config = NodeConfig::new(id, args.segment_size)?;
    config.listen = args.listen;
    config.advertise = args.advertise;
    config.protocol = args.transport.protocol();
    if let Protocol::Rdma(settings) = &config.protocol {
        hkvm_client::transports::check_rdma(settings)?;
    }
    let metadata = args.at.client().await?;
    let node = NodeHandle::start(config, metadata).await?;
    match node.rdma_endpoint() {
        Some(rdma) => println!(
            "node serving {} bytes at {} and over RDMA at {rdma}",
            args.segment_size,
            node.endpoint()
        ),
        None => println!(
            "node serving {} bytes at {}",
            args.segment_size,
            node.endpoint()
        ),
    }
    crate::signals::terminated().await;
    node.shutdown().await.context("unmounting")?;
    Ok(())
}

/// Runs a node that is also the real client of this host's dummy clients.
async fn real_client(args: NodeArgs, port: u16) -> anyhow::Result<()> {
    if let Protocol::Rdma(settings) = args.transport.protocol() {
        hkvm_client::transports::check_rdma(&settings)?;
    }
    let address = StoreAddress {
        servers: args.at.target.url(),
        cluster: args.at.target.cluster.clone(),
        subcluster: args.at.subcluster.clone(),
    };
    let host = args
        .advertise
        .clone()
        .unwrap_or_else(|| args.listen.ip().to_string());
    let mut config = StoreConfig::new(address, host);
    config.global_segment_size = args.segment_size;
    config.listen = Some(args.listen);
    config.node_id = args.id.clone();
    config.protocol = args.transport.protocol();
    config.coalesce = Some(CoalesceConfig {
        window: std::time::Duration::from_micros(args.coalesce_window_us),
        ..CoalesceConfig::default()
    });
    let store = Arc::new(Store::open(config).await.context("starting the node")?);
    let access = DummyServerConfig {
        access: PeerAccess::with_uids(args.dummy_allow_uid.iter().copied()),
        ..DummyServerConfig::default()
    };
    let server = DummyServer::start_with(Arc::clone(&store), port, access)
        .with_context(|| format!("serving dummy clients on port {port}"))?;
    println!(
        "node serving {} bytes at {}; real client of dummies on {}",
        args.segment_size,
        store.hostname(),
        server.name()
    );
    crate::signals::terminated().await;
    drop(server);
    store.close().await;
    Ok(())
}

/// Options of `hkvm put`.
#[derive(Debug, clap::Args)]
pub struct PutArgs {
    #[command(flatten)]
    pub at: SubclusterTarget,
    /// Replicas on distinct nodes.
    #[arg(long, default_value_t = 1)]
    pub replicas: u32,
    #[command(flatten)]
    pub transport: TransportArgs,
    /// The key.
    pub key: String,
    /// The file holding the value, or `-` for stdin.
    pub file: PathBuf,
}

/// Options of `hkvm get`.
#[derive(Debug, clap::Args)]
pub struct GetArgs {
    #[command(flatten)]
    pub at: SubclusterTarget,
    #[command(flatten)]
    pub transport: TransportArgs,
    /// The key.
    pub key: String,
    /// Write the value here (default: stdout).
    #[arg(short, long)]
    pub output: Option<PathBuf>,
}

async fn kv(at: &SubclusterTarget, transport: &TransportArgs) -> anyhow::Result<KvClient> {
    let mut transports = Transports::single(Arc::new(TcpTransport::default()));
    if let Protocol::Rdma(settings) = transport.protocol() {
        let rdma = hkvm_client::transports::open_rdma(&settings)?;
        transports = transports.with_rdma(rdma);
    }
    let metadata: SubmasterClient = at.client().await?;
    Ok(KvClient::with_transports(metadata, transports))
}

/// Stores a file (or stdin) under a key.
///
/// # Errors
/// When reading the input or the put fails.
pub async fn put(args: PutArgs) -> anyhow::Result<()> {
    let value = if args.file.as_os_str() == "-" {
        let mut bytes = Vec::new();
        std::io::stdin().read_to_end(&mut bytes)?;
        bytes
    } else {
        std::fs::read(&args.file).with_context(|| format!("reading {}", args.file.display()))?
    };
    kv(&args.at, &args.transport)
        .await?
        .put(&args.key, &value, args.replicas)
        .await?;
    eprintln!(
        "stored {} bytes under {:?} ({} replicas)",
        value.len(),
        args.key,
        args.replicas
    );
    Ok(())
}

/// Reads a key's value (checksum-verified) to stdout or a file.
///
/// # Errors
/// When the key is missing, no replica is intact, or writing fails.
pub async fn get(args: GetArgs) -> anyhow::Result<()> {
    let fetched = kv(&args.at, &args.transport).await?.get(&args.key).await?;
    match &args.output {
        Some(path) => std::fs::write(path, &fetched.value)
            .with_context(|| format!("writing {}", path.display()))?,
        None => std::io::stdout().write_all(&fetched.value)?,
    }
    eprintln!(
        "read {} bytes of {:?} from {} ({}/{})",
        fetched.value.len(),
        args.key,
        fetched.subcluster,
        fetched.replica.node,
        fetched.replica.segment
    );
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::parse_size;

    #[test]
    fn sizes_parse_with_units() {
        assert_eq!(parse_size("4096"), Ok(4096));
        assert_eq!(parse_size("64MiB"), Ok(64 << 20));
        assert_eq!(parse_size("1g"), Ok(1 << 30));
        assert!(parse_size("12 parsecs").is_err());
        assert!(parse_size("99999999999999GiB").is_err());
    }
}
