//! `hkvm local`: the main job of a fresh checkout. Starts nats-server (JetStream, temp
//! store dir) as a child process and every HKVM service on top of it — by default two
//! sub-clusters, each with a leader and a hot-standby sub-master and two nodes, a
//! global master, and a small demo workload that puts KV blocks and reads them back
//! across sub-clusters — prints where everything is, and stops it all cleanly on
//! Ctrl-C or SIGTERM.

use std::collections::BTreeMap;
use std::net::SocketAddr;
use std::time::Duration;

use anyhow::Context as _;
use hkvm_client::{KvClient, NodeConfig, NodeHandle, SubmasterClient};
use hkvm_events::{ClusterId, NodeId, ProducerId, SubclusterId};
use hkvm_globalmaster::{GlobalMaster, GlobalMasterConfig};
use hkvm_log::permissions;
use hkvm_natsd::{port_is_free, ClientPort, Durability, NatsServer, ServerOptions, ToolsDir};
use hkvm_submaster::{SubmasterConfig, SubmasterHandle};
use hkvm_transfer::TcpTransport;

/// Options of `hkvm local`.
#[derive(Debug, clap::Args)]
pub struct LocalArgs {
    /// Cluster name used in subjects and stream names.
    #[arg(long, default_value = "local")]
    pub cluster: ClusterId,
    /// Number of sub-clusters (each gets a leader and a standby sub-master).
    #[arg(long, default_value_t = 2)]
    pub subclusters: usize,
    /// NATS client port; 4222 (the CLI's default) when free, else an ephemeral one.
    #[arg(long, default_value_t = 4222)]
    pub port: u16,
    /// First port of the sub-masters' Prometheus endpoints (0: none).
    #[arg(long, default_value_t = 9400)]
    pub metrics_base_port: u16,
    /// Segment size of each demo node, in MiB.
    #[arg(long, default_value_t = 64)]
    pub node_mib: u64,
    /// Do not run the demo workload.
    #[arg(long)]
    pub no_demo: bool,
    /// Stop by itself after this long (e.g. `30s`); runs until Ctrl-C when absent.
    #[arg(long, value_parser = humantime::parse_duration)]
    pub run_for: Option<Duration>,
    /// The power-loss-safe profile: nats-server fsyncs every JetStream write
    /// before acknowledging it (`sync_interval: always`). Without it, an OS
    /// crash or power loss can take back up to 2 minutes of acknowledged puts.
    #[arg(long)]
    pub durable: bool,
    /// Run NATS with one user per role and random passwords (docs/security.md):
    /// every service logs in as its role, as a secured deployment does. The
    /// printed URLs carry the client's and the node's credentials; the recorded
    /// one (read by `hkvm` commands) the operator's.
    #[arg(long)]
    pub secure: bool,
}

/// How the services of `hkvm local` log in to its nats-server.
struct Logins {
    url: String,
    /// Each user's password (none: NATS runs without users).
    passwords: Option<BTreeMap<String, String>>,
}

impl Logins {
    /// Random passwords for every user of `cluster`'s generated config, with a
    /// user of its own for each of the demo's nodes.
    fn secured(cluster: &ClusterId, subclusters: &[String]) -> anyhow::Result<(Self, String)> {
        let names: Vec<&str> = subclusters.iter().map(String::as_str).collect();
        let node_ids: Vec<(String, &str)> = subclusters
            .iter()
            .enumerate()
            .flat_map(|(index, subcluster)| {
                (0..NODES_PER_SUBCLUSTER).map(move |n| (demo_node(index, n), subcluster.as_str()))
            })
            .collect();
        let listed: Vec<permissions::ListedNode<'_>> = node_ids
            .iter()
            .map(|(node, subcluster)| permissions::ListedNode { node, subcluster })
            .collect();
        let mut passwords = BTreeMap::new();
        let deployment = permissions::Deployment {
            cluster: cluster.as_str(),
            subclusters: &names,
            nodes: &listed,
            ..permissions::Deployment::default()
        };
        let conf = permissions::nats_conf(&deployment, |user| {
            passwords
                .entry(user.to_owned())
                .or_insert_with(crate::nats_conf::random_password)
                .clone()
        })?;
        Ok((
            Self {
                url: String::new(),
                passwords: Some(passwords),
            },
            conf,
        ))
    }

    /// The URL `user` connects with.
    fn url_of(&self, user: &str) -> String {
        match self.passwords.as_ref().and_then(|p| p.get(user)) {
            Some(password) => {
                self.url
                    .replacen("nats://", &format!("nats://{user}:{password}@"), 1)
            }
            None => self.url.clone(),
        }
    }

    /// A connection as `user`, named `name`.
    async fn connect(&self, user: &str, name: &str) -> anyhow::Result<async_nats::Client> {
        hkvm_client::connect::connect(&self.url_of(user), name)
            .await
            .with_context(|| format!("connecting to NATS as {user}"))
    }
}

/// How many nodes the local cluster runs in each sub-cluster.
const NODES_PER_SUBCLUSTER: usize = 2;

/// The id of demo node `n` of sub-cluster `index`.
fn demo_node(index: usize, n: usize) -> String {
    format!("node-{index}-{n}")
}

/// Every two seconds: put a block into one sub-cluster and read it back through
/// another (cross-sub-cluster, through the global master), checking the bytes.
async fn demo(clients: Vec<KvClient>) {
    let mut round = 0u64;
    loop {
        tokio::time::sleep(Duration::from_secs(2)).await;
        let writer = &clients[(round % clients.len() as u64) as usize];
        let reader = &clients[((round + 1) % clients.len() as u64) as usize];
        let key = format!("demo/block-{round}");
        let value: Vec<u8> = (0..64 * 1024).map(|i| (i as u64 ^ round) as u8).collect();
        let outcome = match writer.put(&key, &value, 2).await {
            Err(error) => format!("put failed: {error}"),
            Ok(()) => match reader.get(&key).await {
                Ok(fetched) if fetched.value[..] == value[..] => format!(
                    "put into {} and read back byte-exact from {} via {}",
                    writer.metadata().subcluster(),
                    reader.metadata().subcluster(),
                    fetched.subcluster
                ),
                Ok(_) => "read back different bytes".to_owned(),
                Err(error) => format!("cross-sub-cluster get not yet possible ({error}); the global master may still be catching up"),
            },
        };
        tracing::info!(key, "demo: {outcome}");
        round += 1;
    }
}

/// Runs the local cluster until Ctrl-C, SIGTERM or `--run-for`.
///
/// # Errors
/// When nats-server cannot be found or started, or a service fails to start.
pub async fn run(args: LocalArgs) -> anyhow::Result<()> {
    // The nats-server next to this binary's checkout, not the one it was built in: an
    // installed `hkvm` runs the nats-server of the machine it runs on.
    let subclusters: Vec<String> = (0..args.subclusters).map(|i| format!("sc-{i}")).collect();
    let (mut logins, users) = if args.secure {
        Logins::secured(&args.cluster, &subclusters)?
    } else {
        (
            Logins {
                url: String::new(),
                passwords: None,
            },
            String::new(),
        )
    };
    let mut nats = NatsServer::start_with(ServerOptions {
        name: format!("hkvm-{}", args.cluster),
        extra_config: users,
        client_port: ClientPort::Preferred(args.port),
        tools_dir: ToolsDir::AboveExecutable,
        durability: if args.durable {
            Durability::Durable
        } else {
            Durability::Default
        },
        ..ServerOptions::default()
    })
    .await
    .context("starting the embedded nats-server")?;
    tracing::info!(url = %nats.url(), store = %nats.store_dir().display(), durable = args.durable, secure = args.secure, "nats-server with JetStream is up");
    logins.url = nats.url();

    let mut services = Vec::new();
    let mut metrics = Vec::new();
    for index in 0..args.subclusters {
        let subcluster = SubclusterId::new(format!("sc-{index}"))?;
        for role in ["a", "b"] {
            let producer = ProducerId::new(format!("sm-{index}{role}"))?;
            let mut config =
                SubmasterConfig::new(args.cluster.clone(), subcluster.clone(), producer);
            config
                .labels
                .insert("pool".into(), format!("pool-{}", index % 2));
            if args.metrics_base_port != 0 {
                let port = args.metrics_base_port + services.len() as u16;
                if port_is_free(port) {
                    config.metrics_addr = Some(SocketAddr::from(([127, 0, 0, 1], port)));
                    metrics.push(format!(
                        "{}{role}: http://127.0.0.1:{port}/metrics",
                        config.subcluster
                    ));
                }
            }
            let user = permissions::submaster_user(subcluster.as_str());
            let client = logins.connect(&user, &format!("hkvm local {user}")).await?;
            services.push(SubmasterHandle::spawn(client, config));
            // Let the first instance of each sub-cluster take the lease.
            tokio::time::sleep(Duration::from_millis(200)).await;
        }
    }

    // Two nodes per sub-cluster, each contributing a segment; secured, each
    // logs in as its own user, which may mount only its own segments.
    let mut nodes = Vec::new();
    let mut kv_clients = Vec::new();
    for index in 0..args.subclusters {
        let subcluster = SubclusterId::new(format!("sc-{index}"))?;
        for n in 0..NODES_PER_SUBCLUSTER {
            let node = NodeId::new(demo_node(index, n))?;
            let user = if args.secure {
                permissions::node_user(node.as_str())
            } else {
                permissions::NODE_USER.to_owned()
            };
            let metadata = SubmasterClient::new(
                logins.connect(&user, &format!("hkvm local {node}")).await?,
                args.cluster.clone(),
                subcluster.clone(),
            );
            let config = NodeConfig::new(node, args.node_mib << 20)?;
            nodes.push(
                NodeHandle::start(config, metadata)
                    .await
                    .context("starting a demo node")?,
            );
        }
        // The demo's clients log in as clients: they get grants, never the key.
        let demo_metadata = SubmasterClient::new(
            logins
                .connect(permissions::CLIENT_USER, "hkvm local demo")
                .await?,
            args.cluster.clone(),
            subcluster,
        );
        kv_clients.push(KvClient::new(
            demo_metadata,
            std::sync::Arc::new(TcpTransport::default()),
        ));
    }

    let global_metrics = (args.metrics_base_port != 0)
        .then(|| args.metrics_base_port + services.len() as u16)
        .filter(|port| port_is_free(*port));
    let global = GlobalMaster::start(
        GlobalMasterConfig {
            cluster: args.cluster.clone(),
            replica: "global-local".into(),
            metrics_addr: global_metrics.map(|port| SocketAddr::from(([127, 0, 0, 1], port))),
            ..GlobalMasterConfig::default()
        },
        logins
            .connect(permissions::GLOBAL_USER, "hkvm local global master")
            .await?,
    )
    .await
    .context("starting the global master")?;
    if let Some(port) = global_metrics {
        metrics.push(format!("global: http://127.0.0.1:{port}/metrics"));
    }

    let record =
        hkvm_client::local_record::write(&args.cluster, &logins.url_of(permissions::ADMIN_USER));
    println!("HKVM local cluster '{}' is running.", args.cluster);
    println!(
        "  NATS:          {}   (monitoring http://127.0.0.1:{}/)",
        nats.url(),
        nats.monitor_port()
    );
    if args.secure {
        println!(
            "  secure:        one NATS user per role (docs/security.md); services log in as theirs"
        );
        println!(
            "                 clients: {}",
            logins.url_of(permissions::CLIENT_USER)
        );
        println!(
            "                 nodes:   {}   (the shared node user: it may act for any node)",
            logins.url_of(permissions::NODE_USER)
        );
        println!(
            "                 engines that empty the pool (remove_all): {}",
            logins.url_of(permissions::POOL_ADMIN_USER)
        );
    }
    match &record {
        Ok(path) => println!(
            "                 recorded in {}: hkvm commands of cluster '{}' use it without --nats",
            path.display(),
            args.cluster
        ),
        Err(error) => {
            tracing::warn!(%error, "could not record the NATS URL");
            println!(
                "                 pass --nats {} to hkvm commands",
                logins.url_of(permissions::ADMIN_USER)
            );
        }
    }
    println!(
        "  durability:    {}",
        if args.durable {
            "durable: every JetStream write is fsynced before a put is acknowledged (survives power loss)"
        } else {
            "default: JetStream fsyncs every 2 minutes; an OS crash or power loss can lose up to 2 minutes of acknowledged puts (--durable for the power-loss-safe profile)"
        }
    );
    println!(
        "  sub-masters:   {} sub-clusters (sc-0..), each a leader + a hot standby",
        args.subclusters
    );
    println!(
        "  nodes:         {} ({} MiB segments)",
        nodes.len(),
        args.node_mib
    );
    println!("  global master: 1 replica");
    for line in &metrics {
        println!("  metrics:       {line}");
    }
    if args.metrics_base_port != 0 {
        println!(
            "                 a sub-master's metrics port also answers the Mooncake master's routes: /health, /get_all_segments, /query_key?key=K (SGLang's master_metrics_port)"
        );
    }
    println!("Try:");
    println!("  hkvm status");
    println!("  hkvm stat   --subcluster sc-0");
    println!("  echo hello | hkvm put --subcluster sc-0 my-key -   &&   hkvm get --subcluster sc-1 my-key");
    println!("  hkvm replay --follow");
    println!("Press Ctrl-C to stop.");
    let demo = (!args.no_demo && kv_clients.len() >= 2).then(|| tokio::spawn(demo(kv_clients)));

    match args.run_for {
        Some(limit) => {
            tokio::select! {
                () = crate::signals::terminated() => {}
                () = tokio::time::sleep(limit) => {}
            }
        }
        None => crate::signals::terminated().await,
    }
    tracing::info!("stopping the local cluster");
    if let Some(demo) = demo {
        demo.abort();
    }
    global.shutdown();
    for node in nodes {
        if let Err(error) = node.shutdown().await {
            tracing::warn!(%error, "a node did not unmount cleanly");
        }
    }
    for service in services {
        if let Err(error) = service.shutdown().await {
            tracing::warn!(%error, "a sub-master stopped with an error");
        }
    }
    hkvm_client::local_record::remove(&args.cluster);
    nats.stop();
    println!("Stopped.");
    Ok(())
}
