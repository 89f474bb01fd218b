//! `hkvm nats-conf`: the NATS users of a deployment (docs/security.md) as the
//! `nats.conf` fragment to give every NATS node, with a password per user: new
//! random ones, or those of the passwords file an earlier run wrote, so that
//! adding a node keeps every other user's password. The passwords file is
//! written so that only its owner may read it.

use std::collections::BTreeMap;
use std::io::Write as _;
use std::os::unix::fs::OpenOptionsExt as _;
use std::path::{Path, PathBuf};

use anyhow::Context as _;
use hkvm_log::permissions::{self, Deployment, ListedNode};

/// Options of `hkvm nats-conf`.
#[derive(Debug, clap::Args)]
pub struct NatsConfArgs {
    /// The cluster.
    #[arg(long)]
    pub cluster: String,
    /// Its sub-clusters (repeated, or comma-separated).
    #[arg(long = "subcluster", required = true, value_delimiter = ',')]
    pub subclusters: Vec<String>,
    /// A node with a user of its own (`node-<id>`), bound to its own segments:
    /// `<id>@<subcluster>` (repeated). Nodes not listed log in as the shared
    /// `node` user.
    #[arg(long = "node", value_parser = parse_node)]
    pub nodes: Vec<(String, String)>,
    /// Clusters whose inter-DC masters copy from this one (repeated, or
    /// comma-separated).
    #[arg(long, value_delimiter = ',')]
    pub copied_to: Vec<String>,
    /// Clusters this one's inter-DC masters copy from.
    #[arg(long, value_delimiter = ',')]
    pub copied_from: Vec<String>,
    /// The passwords file: the users it lists keep their passwords, the others
    /// get random ones, and it is written back with every user's (`<user>
    /// <password>` per line, readable by its owner only).
    #[arg(long)]
    pub passwords: PathBuf,
    /// Where to write the config (default: standard output).
    #[arg(long)]
    pub out: Option<PathBuf>,
}

/// `<id>@<subcluster>`.
fn parse_node(text: &str) -> Result<(String, String), String> {
    match text.split_once('@') {
        Some((node, subcluster)) if !node.is_empty() && !subcluster.is_empty() => {
            Ok((node.to_owned(), subcluster.to_owned()))
        }
        _ => Err(format!("{text:?} is not <node id>@<subcluster>")),
    }
}

/// 24 random letters and digits, from the operating system's generator.
pub(crate) fn random_password() -> String {
    use rand::Rng as _;
    const ALPHABET: &[u8] = b"abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ0123456789";
    let mut rng = rand::rngs::OsRng;
    (0..24)
        .map(|_| char::from(ALPHABET[rng.gen_range(0..ALPHABET.len())]))
        .collect()
}

/// The passwords of a passwords file (none when it does not exist).
fn read_passwords(path: &Path) -> anyhow::Result<BTreeMap<String, String>> {
    let text = match std::fs::read_to_string(path) {
        Ok(text) => text,
        Err(error) if error.kind() == std::io::ErrorKind::NotFound => return Ok(BTreeMap::new()),
        Err(error) => return Err(error).with_context(|| format!("reading {}", path.display())),
    };
    let mut passwords = BTreeMap::new();
    for (number, line) in text.lines().enumerate() {
        let line = line.trim();
        if line.is_empty() || line.starts_with('#') {
            continue;
        }
        let (user, password) = line
            .split_once(char::is_whitespace)
            .map(|(user, password)| (user, password.trim()))
            .filter(|(_, password)| !password.is_empty())
            .with_context(|| {
                format!(
                    "{} line {}: not `<user> <password>`",
                    path.display(),
                    number + 1
                )
            })?;
        passwords.insert(user.to_owned(), password.to_owned());
    }
    Ok(passwords)
}

/// Writes `passwords` to `path`, readable and writable by its owner only.
fn write_passwords(path: &Path, passwords: &BTreeMap<String, String>) -> anyhow::Result<()> {
    let mut text = String::from("# HKVM NATS users: <user> <password>; keep it secret.\n");
    for (user, password) in passwords {
        text.push_str(&format!("{user} {password}\n"));
    }
    let temporary = path.with_extension("tmp");
    let mut file = std::fs::OpenOptions::new()
        .write(true)
        .create(true)
        .truncate(true)
        .mode(0o600)
        .open(&temporary)
        .with_context(|| format!("writing {}", temporary.display()))?;
    file.write_all(text.as_bytes())?;
    file.sync_all()?;
    std::fs::rename(&temporary, path).with_context(|| format!("writing {}", path.display()))
}

/// Runs `hkvm nats-conf`.
///
/// # Errors
/// For an invalid name, or a file that cannot be read or written.
pub fn run(args: NatsConfArgs) -> anyhow::Result<()> {
    let mut passwords = read_passwords(&args.passwords)?;
    let subclusters: Vec<&str> = args.subclusters.iter().map(String::as_str).collect();
    let nodes: Vec<ListedNode<'_>> = args
        .nodes
        .iter()
        .map(|(node, subcluster)| ListedNode { node, subcluster })
        .collect();
    let copied_to: Vec<&str> = args.copied_to.iter().map(String::as_str).collect();
    let copied_from: Vec<&str> = args.copied_from.iter().map(String::as_str).collect();
    let deployment = Deployment {
        cluster: &args.cluster,
        subclusters: &subclusters,
        nodes: &nodes,
        copied_to: &copied_to,
        copied_from: &copied_from,
    };
    let mut users = Vec::new();
    let conf = permissions::nats_conf(&deployment, |user| {
        users.push(user.to_owned());
        passwords
            .entry(user.to_owned())
            .or_insert_with(random_password)
            .clone()
    })?;
    write_passwords(&args.passwords, &passwords)?;
    match &args.out {
        Some(out) => {
            std::fs::write(out, &conf).with_context(|| format!("writing {}", out.display()))?
        }
        None => print!("{conf}"),
    }
    eprintln!(
        "{} users; their passwords are in {} (processes log in with \
         --nats nats://<user>:<password>@host:4222)",
        users.len(),
        args.passwords.display()
    );
    Ok(())
}
