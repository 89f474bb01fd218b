//! Metadata commands against one sub-master: `hkvm exist`, `hkvm rm`, `hkvm stat`.

use hkvm_client::SubmasterClient;
use hkvm_events::rpc::submaster::ItemResult;
use hkvm_events::SubclusterId;

use crate::target::Target;

/// Options shared by the metadata commands.
#[derive(Debug, Clone, clap::Args)]
pub struct SubclusterTarget {
    #[command(flatten)]
    pub target: Target,
    /// The sub-cluster.
    #[arg(long, env = "HKVM_SUBCLUSTER")]
    pub subcluster: SubclusterId,
}

impl SubclusterTarget {
    /// A client of the sub-master.
    ///
    /// # Errors
    /// When NATS is unreachable.
    pub async fn client(&self) -> anyhow::Result<SubmasterClient> {
        let nats = self.target.connect().await?;
        Ok(SubmasterClient::new(
            nats,
            self.target.cluster.clone(),
            self.subcluster.clone(),
        ))
    }
}

/// Options of `hkvm exist`.
#[derive(Debug, clap::Args)]
pub struct ExistArgs {
    #[command(flatten)]
    pub target: Target,
    /// The sub-cluster to ask (its sub-master is authoritative).
    #[arg(long, env = "HKVM_SUBCLUSTER", required_unless_present = "global")]
    pub subcluster: Option<SubclusterId>,
    /// Ask the global master which sub-clusters hold each key instead.
    #[arg(long, conflicts_with = "subcluster")]
    pub global: bool,
    /// Keys to check.
    #[arg(required = true)]
    pub keys: Vec<String>,
}

/// Options of `hkvm rm`.
#[derive(Debug, clap::Args)]
pub struct RmArgs {
    #[command(flatten)]
    pub at: SubclusterTarget,
    /// Remove even leased objects.
    #[arg(long)]
    pub force: bool,
    /// Remove every object.
    #[arg(long, conflicts_with = "keys")]
    pub all: bool,
    /// Keys to remove.
    pub keys: Vec<String>,
}

/// Options of `hkvm stat`.
#[derive(Debug, clap::Args)]
pub struct StatArgs {
    #[command(flatten)]
    pub at: SubclusterTarget,
    /// Keys to describe (replicas, size, checksum); the sub-master summary without.
    pub keys: Vec<String>,
    /// Take a read lease on the keys, as a reader would (by default a look leases
    /// nothing, so it keeps nothing from eviction or removal).
    #[arg(long)]
    pub lease: bool,
}

/// Prints `key<TAB>yes|no` per key (or, with `--global`, the sub-clusters holding
/// each key); exits non-zero if any is missing.
///
/// # Errors
/// When the sub-master is unreachable.
pub async fn exist(args: ExistArgs) -> anyhow::Result<()> {
    let subcluster = match (args.global, args.subcluster) {
        (false, Some(subcluster)) => subcluster,
        _ => return crate::locate::exist_global(&args.target, args.keys, None).await,
    };
    let at = SubclusterTarget {
        target: args.target,
        subcluster,
    };
    let flags = at.client().await?.exist(args.keys.clone()).await?;
    for (key, present) in args.keys.iter().zip(&flags) {
        println!("{key}\t{}", if *present { "yes" } else { "no" });
    }
    if flags.iter().all(|present| *present) {
        Ok(())
    } else {
        anyhow::bail!("some keys do not exist")
    }
}

/// Removes keys (or all) and prints each outcome.
///
/// # Errors
/// When the sub-master is unreachable or refuses.
pub async fn rm(args: RmArgs) -> anyhow::Result<()> {
    let client = args.at.client().await?;
    if args.all {
        let reply = client.remove_all(args.force).await?;
        println!("removed {} objects", reply.removed);
        return Ok(());
    }
    anyhow::ensure!(!args.keys.is_empty(), "name keys to remove, or --all");
    let results = client.remove(args.keys.clone(), args.force).await?;
    let mut failed = 0;
    for (key, result) in args.keys.iter().zip(results) {
        match result {
            ItemResult::Ok(()) => println!("{key}\tremoved"),
            ItemResult::Err(error) => {
                failed += 1;
                println!("{key}\t{error}");
            }
        }
    }
    anyhow::ensure!(failed == 0, "{failed} keys were not removed");
    Ok(())
}

/// Prints the sub-master's summary, or each key's replicas.
///
/// # Errors
/// When the sub-master is unreachable.
pub async fn stat(args: StatArgs) -> anyhow::Result<()> {
    let client = args.at.client().await?;
    if args.keys.is_empty() {
        let s = client.status().await?;
        println!("leader      {} (epoch {})", s.producer, s.epoch);
        println!("applied_seq {}", s.applied_seq);
        println!(
            "objects     {} ({} pending puts)",
            s.objects, s.pending_puts
        );
        println!("leases      {} space leases", s.space_leases);
        println!("nodes       {} ({} segments)", s.nodes, s.segments);
        println!("usage       {} / {} bytes", s.used_bytes, s.capacity_bytes);
        return Ok(());
    }
    let lists = if args.lease {
        client.get_replica_list(args.keys.clone()).await?
    } else {
        client.peek_replica_list(args.keys.clone()).await?
    };
    for (key, result) in args.keys.iter().zip(lists) {
        match result {
            ItemResult::Ok(list) => {
                let replicas: Vec<String> = list
                    .replicas
                    .iter()
                    .map(|r| match &r.rdma {
                        None => format!("{}/{}@{}({})", r.node, r.segment, r.offset, r.endpoint),
                        Some(rdma) => format!(
                            "{}/{}@{}({}, rdma {})",
                            r.node, r.segment, r.offset, r.endpoint, rdma.exchange
                        ),
                    })
                    .collect();
                println!(
                    "{key}\tsize={} checksum={:016x} replicas={}",
                    list.size,
                    list.checksum,
                    replicas.join(",")
                );
            }
            ItemResult::Err(error) => println!("{key}\t{error}"),
        }
    }
    Ok(())
}
