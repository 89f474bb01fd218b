//! Cluster-wide key queries through the global master: `hkvm locate KEY...` (which
//! sub-masters hold each key, with their RPC subjects) and [`exist_global`], the body
//! of `hkvm exist --global KEY...`.

use hkvm_client::GlobalClient;
use hkvm_events::rpc::global::{
    BatchIsExist, BatchIsExistReply, GlobalOp, LabelFilter, Locate, LocateReply, Staleness,
};

use crate::globalmaster::{label_filter, parse_label};
use crate::target::Target;

/// Options of `hkvm locate`.
#[derive(Debug, clap::Args)]
pub struct LocateArgs {
    #[command(flatten)]
    pub target: Target,
    /// Rank (or with `--hard-labels`, restrict) answers by these labels, `k=v,k=v`.
    #[arg(long, value_delimiter = ',', value_parser = parse_label)]
    pub labels: Vec<(String, String)>,
    /// Never answer across labels.
    #[arg(long)]
    pub hard_labels: bool,
    /// Keys to locate.
    #[arg(required = true)]
    pub keys: Vec<String>,
}

fn print_staleness(staleness: &Staleness) {
    for source in &staleness.sources {
        eprintln!(
            "# {} applied {} of {} (lag {} events, {} ms) by {}",
            source.subcluster,
            source.applied_seq,
            source.last_seq,
            source.lag_events,
            source.lag_ms,
            staleness.replica
        );
    }
}

/// Prints `key<TAB>subcluster<TAB>submaster<TAB>rpc prefix<TAB>alive` per owner, or
/// `key<TAB>-` for a key held nowhere; the staleness goes to stderr.
///
/// # Errors
/// When no global master answers.
pub async fn run(args: LocateArgs) -> anyhow::Result<()> {
    let labels = label_filter(&args.labels, args.hard_labels);
    let global = GlobalClient::new(args.target.connect().await?, args.target.cluster.clone());
    let reply: LocateReply = global
        .call(
            GlobalOp::Locate,
            &Locate {
                keys: args.keys.clone(),
                labels,
            },
        )
        .await?;
    for (key, owners) in args.keys.iter().zip(&reply.owners) {
        if owners.is_empty() {
            println!("{key}\t-");
        }
        for owner in owners {
            println!(
                "{key}\t{}\t{}\t{}\t{}",
                owner.subcluster,
                owner.submaster.as_ref().map_or("-", |id| id.as_str()),
                owner.rpc_prefix,
                if owner.alive { "alive" } else { "dead" }
            );
        }
    }
    print_staleness(&reply.staleness);
    Ok(())
}

/// `hkvm exist --global KEY...`: asks the global master which sub-clusters hold
/// each key and prints `key<TAB>sc-a,sc-b` (or `key<TAB>no`); fails when a key is
/// held nowhere.
///
/// # Errors
/// When no global master answers, or some key exists nowhere.
pub async fn exist_global(
    target: &Target,
    keys: Vec<String>,
    labels: Option<LabelFilter>,
) -> anyhow::Result<()> {
    let global = GlobalClient::new(target.connect().await?, target.cluster.clone());
    let reply: BatchIsExistReply = global
        .call(
            GlobalOp::BatchIsExist,
            &BatchIsExist {
                keys: keys.clone(),
                labels,
            },
        )
        .await?;
    let mut missing = false;
    for (index, key) in keys.iter().enumerate() {
        let holders: Vec<String> = reply
            .holders_of(index)
            .into_iter()
            .map(ToString::to_string)
            .collect();
        if holders.is_empty() {
            missing = true;
            println!("{key}\tno");
        } else {
            println!("{key}\t{}", holders.join(","));
        }
    }
    print_staleness(&reply.staleness);
    if missing {
        anyhow::bail!("some keys exist nowhere");
    }
    Ok(())
}
