//! The data commands: `hkvm node` (serve a segment), `hkvm put` and `hkvm get`.

use std::io::{Read as _, Write as _};
use std::net::SocketAddr;
use std::path::PathBuf;
use std::sync::Arc;

use anyhow::Context as _;
use hkvm_client::coalesce::CoalesceConfig;
use hkvm_client::dummy::DummyServer;
use hkvm_client::store::{Store, StoreAddress, StoreConfig};
use hkvm_client::{KvClient, NodeConfig, NodeHandle, SubmasterClient};
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
    /// Serve dummy clients (inference processes on this host calling
    /// `setup_dummy(..., "localhost:<port>")`) on the abstract Unix socket
    /// `hkvm-node-<port>`: this node is then their real client.
    #[arg(long)]
    pub dummy_port: Option<u16>,
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
    let metadata = args.at.client().await?;
    let node = NodeHandle::start(config, metadata).await?;
    println!(
        "node serving {} bytes at {}",
        args.segment_size,
        node.endpoint()
    );
    crate::signals::terminated().await;
    node.shutdown().await.context("unmounting")?;
    Ok(())
}

/// Runs a node that is also the real client of this host's dummy clients.
async fn real_client(args: NodeArgs, port: u16) -> anyhow::Result<()> {
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
    config.coalesce = Some(CoalesceConfig {
        window: std::time::Duration::from_micros(args.coalesce_window_us),
        ..CoalesceConfig::default()
    });
    let store = Arc::new(Store::open(config).await.context("starting the node")?);
    let server = DummyServer::start(Arc::clone(&store), port)
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
    /// The key.
    pub key: String,
    /// Write the value here (default: stdout).
    #[arg(short, long)]
    pub output: Option<PathBuf>,
}

async fn kv(at: &SubclusterTarget) -> anyhow::Result<KvClient> {
    let metadata: SubmasterClient = at.client().await?;
    Ok(KvClient::new(metadata, Arc::new(TcpTransport::default())))
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
    kv(&args.at)
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
    let fetched = kv(&args.at).await?.get(&args.key).await?;
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
