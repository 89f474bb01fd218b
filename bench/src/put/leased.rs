//! Puts into space leases, metadata only: each client holds a lease and commits
//! one object at a time into it with a single `put_commit`.

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use hkvm_client::SubmasterClient;
use hkvm_events::rpc::submaster::{ItemResult, LeaseId, LeaseSpace, PutCommitItem};

use super::item;

/// Bytes each leased bench client asks for per lease and segment (the client
/// library's default; the sub-master may grant fewer).
const LEASE_LEN: u64 = hkvm_client::DEFAULT_LEASE_LEN;

/// Runs `clients` tasks for `duration`, each holding a space lease and putting
/// one object at a time with a single `put_commit` into it (a new lease when one
/// is used up, the old one returned in the background, as the client library
/// does). Every put's latency includes the lease request it had to wait for.
pub(super) async fn run_leased_clients(
    client: &SubmasterClient,
    clients: usize,
    duration: Duration,
    tag: &str,
) -> anyhow::Result<(f64, Vec<Duration>)> {
    let done = Arc::new(AtomicU64::new(0));
    let deadline = Instant::now() + duration;
    let started = Instant::now();
    let size = item(String::new()).size;
    let tasks: Vec<_> = (0..clients)
        .map(|c| {
            let (client, done, tag) = (client.clone(), Arc::clone(&done), tag.to_owned());
            tokio::spawn(async move {
                let mut latencies = Vec::new();
                // The lease held: its id, the bytes granted, the next offset.
                let mut lease: Option<(LeaseId, u64, u64)> = None;
                let mut round = 0u64;
                while Instant::now() < deadline {
                    let put_started = Instant::now();
                    let (id, len, offset) = match lease {
                        Some((id, len, cursor)) if cursor + size <= len => (id, len, cursor),
                        held => {
                            if let Some((old, _, _)) = held {
                                let client = client.clone();
                                tokio::spawn(async move { client.lease_return(old).await });
                            }
                            let granted = client
                                .lease_space(LeaseSpace {
                                    len: LEASE_LEN,
                                    replicas: 2,
                                    preferred_segment: None,
                                    avoid_nodes: Vec::new(),
                                })
                                .await?
                                .into_result()?;
                            anyhow::ensure!(granted.len >= size, "a lease too small: {granted:?}");
                            (granted.id, granted.len, 0)
                        }
                    };
                    lease = Some((id, len, offset + size));
                    round += 1;
                    let answers = client
                        .put_commit(vec![PutCommitItem {
                            key: format!("{tag}/{c}/{round}"),
                            size,
                            checksum: 7,
                            lease: id,
                            offset,
                            hard_pin: false,
                            put_id: round,
                        }])
                        .await?;
                    latencies.push(put_started.elapsed());
                    anyhow::ensure!(
                        matches!(answers.first(), Some(ItemResult::Ok(()))),
                        "a commit into a lease failed: {answers:?}"
                    );
                    done.fetch_add(1, Ordering::Relaxed);
                }
                anyhow::Ok(latencies)
            })
        })
        .collect();
    let mut latencies = Vec::new();
    for task in tasks {
        latencies.extend(task.await??);
    }
    latencies.sort_unstable();
    let rate = done.load(Ordering::Relaxed) as f64 / started.elapsed().as_secs_f64();
    Ok((rate, latencies))
}
