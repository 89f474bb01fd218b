//! One simulated card of the engine model: the calls an engine makes per
//! request (prefill) or per offloaded page (decode), timed per kind.

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;

use hkvm_client::{GlobalClient, SubmasterClient};
use hkvm_events::rpc::submaster::{ItemResult, PutEndItem, PutStartItem};
use hkvm_events::rpc::RpcReply;
use tokio::time::Instant;

use super::super::Rng;
use super::EngineArgs;

/// Pages of a prefill request's prefetch `batch_is_exist` (SGLang's bound).
const PREFETCH_PAGES: usize = 128;
/// Of those, the pages the pool holds (the typical case's hits).
const PREFETCH_HITS: usize = 79;
/// New pages a prefill request writes back.
const NEW_PAGES: usize = 55;
/// Bytes of one page (MLA, 64 tokens, DeepSeek-V3's 61 layers).
const PAGE_BYTES: u64 = 4_500_000;

/// An engine-level call.
#[derive(Debug, Clone, Copy)]
pub(super) enum Call {
    Exist = 0,
    Get = 1,
    Put = 2,
}

pub(super) const CALLS: [(Call, &str); 3] = [
    (Call::Exist, "batch_is_exist"),
    (Call::Get, "get"),
    (Call::Put, "put"),
];

/// What the cards of a point did in the window.
#[derive(Debug, Default)]
pub(super) struct Record {
    /// Latency (µs) of each call, per kind.
    pub(super) latencies: [Vec<u32>; 3],
    /// Keys per kind.
    pub(super) keys: [u64; 3],
    pub(super) failures: u64,
}

impl Record {
    pub(super) fn add(&mut self, other: Record) {
        for (into, from) in self.latencies.iter_mut().zip(other.latencies) {
            into.extend(from);
        }
        for (into, from) in self.keys.iter_mut().zip(other.keys) {
            *into += from;
        }
        self.failures += other.failures;
    }

    pub(super) fn calls(&self) -> usize {
        self.latencies.iter().map(Vec::len).sum()
    }

    pub(super) fn all_keys(&self) -> u64 {
        self.keys.iter().sum()
    }
}

/// One card: what it is, and its handles.
pub(super) struct Card {
    pub(super) index: usize,
    pub(super) prefill: bool,
    pub(super) submaster: SubmasterClient,
    pub(super) global: GlobalClient,
    /// Global-master requests sent, over all cards.
    pub(super) global_requests: Arc<AtomicU64>,
}

impl Card {
    /// An engine `batch_is_exist`: the sub-master, then the global master for
    /// the keys it lacks. Whether it was answered.
    async fn exist(&self, keys: &[String]) -> bool {
        let Ok(local) = self.submaster.exist(keys.to_vec()).await else {
            return false;
        };
        let missing: Vec<&String> = keys
            .iter()
            .zip(local)
            .filter(|(_, present)| !present)
            .map(|(key, _)| key)
            .collect();
        if missing.is_empty() {
            return true;
        }
        self.global_requests.fetch_add(1, Ordering::Relaxed);
        matches!(
            self.global.batch_is_exist(&missing, None).await,
            Ok(RpcReply::Ok(_))
        )
    }

    async fn get(&self, keys: &[String]) -> bool {
        self.submaster.get_replica_list(keys.to_vec()).await.is_ok()
    }

    async fn put(&self, keys: &[String]) -> bool {
        let items = keys
            .iter()
            .map(|key| PutStartItem {
                key: key.clone(),
                size: PAGE_BYTES,
                replicas: 1,
                preferred_segment: None,
                hard_pin: false,
                put_id: 0,
                avoid_nodes: Vec::new(),
            })
            .collect();
        let Ok(started) = self.submaster.put_start(items).await else {
            return false;
        };
        let ends: Vec<PutEndItem> = keys
            .iter()
            .zip(started)
            .filter(|(_, started)| matches!(started, ItemResult::Ok(_)))
            .map(|(key, _)| PutEndItem {
                key: key.clone(),
                checksum: 7,
                put_id: 0,
            })
            .collect();
        ends.len() == keys.len() && self.submaster.put_end(ends).await.is_ok()
    }
}

/// Runs `card` until `end`, recording what starts at or after `measure_from`.
pub(super) async fn run_card(
    card: Card,
    args: EngineArgs,
    measure_from: Instant,
    end: Instant,
) -> Record {
    let mut rng = Rng::of_client(card.index);
    let mut record = Record::default();
    // Pages this card wrote, oldest first: later requests' prefix hits.
    let mut written: Vec<String> = Vec::new();
    let mut page = 0u64;
    let rate = if card.prefill {
        args.prefill_rate
    } else {
        args.decode_rate
    };
    let mut next = Instant::now() + rng.interval(rate);
    loop {
        if next >= end {
            return record;
        }
        tokio::time::sleep_until(next).await;
        next += rng.interval(rate);
        let measured = Instant::now() >= measure_from;
        let mut fresh = |count: usize| -> Vec<String> {
            (0..count)
                .map(|_| {
                    page += 1;
                    format!("card{}/p{page}", card.index)
                })
                .collect()
        };
        let mut timed = Vec::new();
        if card.prefill {
            let hits = PREFETCH_HITS.min(written.len());
            let start = if written.len() > hits {
                rng.next() as usize % (written.len() - hits + 1)
            } else {
                0
            };
            let mut prefetch: Vec<String> = written[start..start + hits].to_vec();
            prefetch.extend(fresh(PREFETCH_PAGES - hits));
            let new_pages = fresh(NEW_PAGES);
            let t = Instant::now();
            let ok = card.exist(&prefetch).await;
            timed.push((Call::Exist, prefetch.len(), t.elapsed(), ok));
            if hits > 0 {
                let t = Instant::now();
                let ok = card.get(&prefetch[..hits]).await;
                timed.push((Call::Get, hits, t.elapsed(), ok));
            }
            let t = Instant::now();
            let ok = card.exist(&new_pages).await;
            timed.push((Call::Exist, new_pages.len(), t.elapsed(), ok));
            let t = Instant::now();
            let ok = card.put(&new_pages).await;
            timed.push((Call::Put, new_pages.len(), t.elapsed(), ok));
            if ok {
                written.extend(new_pages);
            }
        } else {
            let new_page = fresh(1);
            let t = Instant::now();
            let ok = card.exist(&new_page).await;
            timed.push((Call::Exist, 1, t.elapsed(), ok));
            let t = Instant::now();
            let ok = card.put(&new_page).await;
            timed.push((Call::Put, 1, t.elapsed(), ok));
        }
        if !measured || Instant::now() >= end {
            continue;
        }
        for (call, keys, took, ok) in timed {
            if ok {
                let micros = took.as_micros().min(u128::from(u32::MAX)) as u32;
                record.latencies[call as usize].push(micros);
                record.keys[call as usize] += keys as u64;
            } else {
                record.failures += 1;
            }
        }
    }
}
