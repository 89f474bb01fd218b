//! `hkvm loadgen` (`hkvm-bench loadgen`): a load generator that runs next to the nodes (inside the cluster
//! network), drives puts, gets and `batch_is_exist` through the client library for a
//! while, and prints one JSON line per result on stdout (or into `--output`), so that a test can assert on
//! data: which puts were acknowledged (with the value's checksum), which failed or
//! were revoked on purpose, what reads returned, how often the sub-master was busy.
//!
//! Values are a pure function of their key ([`value_for`]), so a verifier needs only
//! the list of keys to check that every byte came back.

use std::path::PathBuf;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};

use anyhow::Context as _;
use hkvm_client::{ClientErrorKind, GlobalClient, KvClient, KvError, RetryPolicy, SubmasterClient};
use hkvm_events::rpc::global::{BatchIsExist, BatchIsExistReply, GlobalOp};
use hkvm_events::rpc::submaster::{ItemResult, PutStartItem};
use hkvm_events::value_checksum;
use hkvm_transfer::TcpTransport;
use serde_json::json;

use crate::target::SubclusterTarget;

mod lines;

use lines::ResultLines;

/// What the load generator does.
#[derive(Debug, Clone, Copy, PartialEq, Eq, clap::ValueEnum)]
pub enum Mode {
    /// Concurrent writers put keys `<prefix>-<writer>-<n>`; every tenth one is
    /// started and then revoked on purpose. One `ack`, `failed`, `uncertain` (a
    /// timeout: it may have been committed) or `revoked` line per key, then a
    /// `summary` line.
    Put,
    /// Reads every key of `--keys-file` and compares it with [`value_for`]; one
    /// `verify` line with the keys missing or wrong, and checks that no key of
    /// `--absent-file` exists.
    Verify,
    /// Concurrent `batch_is_exist` queries of the keys of `--keys-file` against the
    /// global master; every key must be reported held. One `query` summary line.
    Query,
}

/// Options of `hkvm loadgen`.
#[derive(Debug, clap::Args)]
pub struct LoadgenArgs {
    #[command(flatten)]
    pub at: SubclusterTarget,
    /// What to do.
    #[arg(long, value_enum, default_value_t = Mode::Put)]
    pub mode: Mode,
    /// Concurrent clients.
    #[arg(long, default_value_t = 8)]
    pub clients: usize,
    /// How long to run (`put` and `query`).
    #[arg(long, value_parser = humantime::parse_duration, default_value = "5s")]
    pub duration: Duration,
    /// Value size in bytes.
    #[arg(long, default_value_t = 4096)]
    pub value_size: usize,
    /// Replicas per put.
    #[arg(long, default_value_t = 2)]
    pub replicas: u32,
    /// Key prefix of the puts.
    #[arg(long, default_value = "lg")]
    pub prefix: String,
    /// Keys to verify or query, one a line.
    #[arg(long)]
    pub keys_file: Option<PathBuf>,
    /// Keys that must not exist (`verify`), one a line.
    #[arg(long)]
    pub absent_file: Option<PathBuf>,
    /// Instead of `--keys-file`: a NATS subject that answers a request with the
    /// keys, one a line (a test serves its key lists this way).
    #[arg(long, conflicts_with = "keys_file")]
    pub keys_subject: Option<String>,
    /// Instead of `--absent-file`: a NATS subject answering with the absent keys.
    #[arg(long, conflicts_with = "absent_file")]
    pub absent_subject: Option<String>,
    /// How long one client call keeps retrying `Busy` or a missing leader.
    #[arg(long, value_parser = humantime::parse_duration, default_value = "30s")]
    pub retry_deadline: Duration,
    /// How long one request waits for its reply before it is retried or fails.
    #[arg(long, value_parser = humantime::parse_duration, default_value = "2s")]
    pub request_timeout: Duration,
    /// Write the result lines to this file instead of stdout (each line whole, in
    /// one write, before the run goes on).
    #[arg(long)]
    pub output: Option<PathBuf>,
}

/// The value stored under `key`: `size` bytes from a generator seeded by the key's
/// xxh3-64, so that any reader can recompute it.
pub fn value_for(key: &str, size: usize) -> Vec<u8> {
    let mut state = value_checksum(key.as_bytes()) | 1;
    (0..size)
        .map(|_| {
            // xorshift64: cheap, deterministic, and not constant across positions.
            state ^= state << 13;
            state ^= state >> 7;
            state ^= state << 17;
            state.to_le_bytes()[0]
        })
        .collect()
}

fn now_ms() -> u128 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map_or(0, |d| d.as_millis())
}

/// Keys from a file, or from the reply to a request on a NATS subject.
async fn read_keys(
    nats: &async_nats::Client,
    path: Option<&PathBuf>,
    subject: Option<&String>,
) -> anyhow::Result<Vec<String>> {
    let text = match (path, subject) {
        (Some(path), _) => {
            std::fs::read_to_string(path).with_context(|| format!("reading {}", path.display()))?
        }
        (None, Some(subject)) => {
            let reply = tokio::time::timeout(
                Duration::from_secs(10),
                nats.request(subject.clone(), bytes::Bytes::new()),
            )
            .await
            .with_context(|| format!("no keys on {subject}"))??;
            String::from_utf8_lossy(&reply.payload).into_owned()
        }
        (None, None) => return Ok(Vec::new()),
    };
    Ok(text
        .lines()
        .map(str::trim)
        .filter(|l| !l.is_empty())
        .map(str::to_owned)
        .collect())
}

/// Runs the load generator.
///
/// # Errors
/// When NATS is unreachable or a key file cannot be read.
pub async fn run(args: LoadgenArgs) -> anyhow::Result<()> {
    let lines = ResultLines::open(args.output.as_deref())?;
    let nats = args.at.target.connect().await?;
    let metadata = SubmasterClient::with_policy(
        nats.clone(),
        args.at.target.cluster.clone(),
        args.at.subcluster.clone(),
        RetryPolicy {
            retry_deadline: args.retry_deadline,
            request_timeout: args.request_timeout,
            ..RetryPolicy::default()
        },
    );
    let kv = KvClient::new(metadata.clone(), Arc::new(TcpTransport::default()));
    let keys = read_keys(&nats, args.keys_file.as_ref(), args.keys_subject.as_ref()).await?;
    match args.mode {
        Mode::Put => put(&args, kv, &lines).await?,
        Mode::Verify => {
            let absent = read_keys(
                &nats,
                args.absent_file.as_ref(),
                args.absent_subject.as_ref(),
            )
            .await?;
            verify(keys, absent, kv, &lines).await?;
        }
        Mode::Query => {
            let global = GlobalClient::new(nats, args.at.target.cluster.clone());
            query(&args, keys, global, &lines).await?;
        }
    }
    lines.finish()
}

/// What one writer saw.
#[derive(Default)]
struct WriterTally {
    acked: u64,
    failed: u64,
    uncertain: u64,
    revoked: u64,
    latencies_us: Vec<u64>,
}

async fn put(args: &LoadgenArgs, kv: KvClient, lines: &ResultLines) -> anyhow::Result<()> {
    let stop = Arc::new(AtomicBool::new(false));
    let writers: Vec<_> = (0..args.clients)
        .map(|writer| {
            let (kv, stop, lines) = (kv.clone(), stop.clone(), lines.clone());
            let (prefix, size, replicas) = (args.prefix.clone(), args.value_size, args.replicas);
            tokio::spawn(async move {
                let mut tally = WriterTally::default();
                let mut n = 0u64;
                while !stop.load(Ordering::Relaxed) {
                    let key = format!("{prefix}-{writer}-{n}");
                    n += 1;
                    if n % 10 == 0 {
                        if revoke_one(&kv, &key, size as u64, replicas).await {
                            tally.revoked += 1;
                            lines.line(&json!({"type": "revoked", "key": key, "t": now_ms()}));
                        }
                        continue;
                    }
                    let value = value_for(&key, size);
                    let started = Instant::now();
                    match kv.put(&key, &value, replicas).await {
                        Ok(()) => {
                            tally.acked += 1;
                            let micros = u64::try_from(started.elapsed().as_micros());
                            tally.latencies_us.push(micros.unwrap_or(u64::MAX));
                            lines.line(&json!({
                                "type": "ack", "key": key,
                                "checksum": value_checksum(&value), "t": now_ms(),
                            }));
                        }
                        Err(error) => {
                            // A timeout leaves the outcome unknown (the commit may
                            // have happened); every other error is a definite failure.
                            let kind = if is_uncertain(&error) {
                                tally.uncertain += 1;
                                "uncertain"
                            } else {
                                tally.failed += 1;
                                "failed"
                            };
                            lines.line(&json!({
                                "type": kind, "key": key, "error": error.to_string(), "t": now_ms(),
                            }));
                        }
                    }
                }
                tally
            })
        })
        .collect();
    tokio::time::sleep(args.duration).await;
    stop.store(true, Ordering::Relaxed);
    let mut total = WriterTally::default();
    for writer in writers {
        let tally = writer.await.context("a writer panicked")?;
        total.acked += tally.acked;
        total.failed += tally.failed;
        total.uncertain += tally.uncertain;
        total.revoked += tally.revoked;
        total.latencies_us.extend(tally.latencies_us);
    }
    total.latencies_us.sort_unstable();
    let percentile = |p: usize| {
        total
            .latencies_us
            .get(total.latencies_us.len().saturating_sub(1) * p / 100)
            .copied()
            .unwrap_or(0)
    };
    let stats = kv.metadata().stats();
    lines.line(&json!({
        "type": "summary", "acked": total.acked, "failed": total.failed,
        "uncertain": total.uncertain,
        "revoked": total.revoked, "p50_us": percentile(50), "p99_us": percentile(99),
        "max_us": percentile(100), "busy": stats.busy.load(Ordering::Relaxed),
        "leader_waits": stats.leader_waits.load(Ordering::Relaxed),
        "timeouts": stats.timeouts.load(Ordering::Relaxed),
    }));
    Ok(())
}

/// Whether a put error leaves its outcome unknown: a request timed out, so the
/// sub-master may have committed it (and the clean-up removal may have failed too).
fn is_uncertain(error: &KvError) -> bool {
    matches!(error, KvError::Metadata(e) if e.kind() == ClientErrorKind::Timeout)
}

/// Starts a put and revokes it (the key must never become visible); whether both
/// steps succeeded.
async fn revoke_one(kv: &KvClient, key: &str, size: u64, replicas: u32) -> bool {
    let start = PutStartItem {
        key: key.to_owned(),
        size,
        replicas,
        preferred_segment: None,
        hard_pin: false,
        put_id: 0,
        avoid_nodes: Vec::new(),
    };
    let started = kv.metadata().put_start(vec![start]).await;
    matches!(started.as_deref(), Ok([ItemResult::Ok(_)]))
        && kv.metadata().put_revoke(vec![key.to_owned()]).await.is_ok()
}

async fn verify(
    keys: Vec<String>,
    absent: Vec<String>,
    kv: KvClient,
    lines: &ResultLines,
) -> anyhow::Result<()> {
    let (mut ok, mut missing, mut corrupt, mut errors) = (0u64, Vec::new(), Vec::new(), Vec::new());
    for chunk in keys.chunks(256) {
        let refs: Vec<&str> = chunk.iter().map(String::as_str).collect();
        let fetched = kv.get_many(&refs).await?;
        for (key, result) in chunk.iter().zip(fetched) {
            match result {
                Ok(fetched) if fetched.value[..] == value_for(key, fetched.value.len())[..] => {
                    ok += 1;
                }
                Ok(_) => corrupt.push(key.clone()),
                // Not in the sub-cluster it was put into: missing, whether or not
                // a global master could say anything of the others.
                Err(KvError::NotFound { .. } | KvError::Unresolved { .. }) => {
                    missing.push(key.clone());
                }
                Err(error) => errors.push(format!("{key}: {error}")),
            }
        }
    }
    let mut appeared = Vec::new();
    for chunk in absent.chunks(1024) {
        let present = kv.metadata().exist(chunk.to_vec()).await?;
        appeared.extend(
            chunk
                .iter()
                .zip(present)
                .filter(|(_, p)| *p)
                .map(|(k, _)| k.clone()),
        );
    }
    lines.line(&json!({
        "type": "verify", "ok": ok, "missing": missing, "corrupt": corrupt,
        "errors": errors, "appeared": appeared,
    }));
    Ok(())
}

async fn query(
    args: &LoadgenArgs,
    keys: Vec<String>,
    global: GlobalClient,
    lines: &ResultLines,
) -> anyhow::Result<()> {
    let keys = Arc::new(keys);
    let stop = Arc::new(AtomicBool::new(false));
    let queriers: Vec<_> = (0..args.clients)
        .map(|_| {
            let (global, keys, stop) = (global.clone(), keys.clone(), stop.clone());
            tokio::spawn(async move {
                let (mut ok, mut failed, mut unheld, mut max_us) = (0u64, Vec::new(), 0u64, 0u64);
                while !stop.load(Ordering::Relaxed) {
                    let request = BatchIsExist {
                        keys: keys.to_vec(),
                        labels: None,
                    };
                    let started = Instant::now();
                    let reply: Result<BatchIsExistReply, _> =
                        global.call(GlobalOp::BatchIsExist, &request).await;
                    let micros = u64::try_from(started.elapsed().as_micros()).unwrap_or(u64::MAX);
                    max_us = max_us.max(micros);
                    match reply {
                        Ok(reply) => {
                            ok += 1;
                            unheld += reply.counts.iter().filter(|c| **c == 0).count() as u64;
                        }
                        Err(error) => failed.push(error.to_string()),
                    }
                }
                (ok, failed, unheld, max_us)
            })
        })
        .collect();
    tokio::time::sleep(args.duration).await;
    stop.store(true, Ordering::Relaxed);
    let (mut ok, mut failed, mut unheld, mut max_us) = (0u64, Vec::new(), 0u64, 0u64);
    for querier in queriers {
        let (o, f, u, m) = querier.await.context("a querier panicked")?;
        ok += o;
        failed.extend(f);
        unheld += u;
        max_us = max_us.max(m);
    }
    lines.line(
        &json!({"type": "query", "ok": ok, "failed": failed, "unheld": unheld, "max_us": max_us}),
    );
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::value_for;

    #[test]
    fn values_are_a_function_of_the_key() {
        assert_eq!(value_for("a", 64), value_for("a", 64));
        assert_ne!(value_for("a", 64), value_for("b", 64));
        assert_eq!(value_for("a", 10)[..], value_for("a", 64)[..10]);
        assert!(value_for("a", 64)
            .iter()
            .any(|b| *b != value_for("a", 64)[0]));
    }
}
