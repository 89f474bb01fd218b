//! The simulated clients of the `scale` workload: a full client (a node that
//! pings and operates), a real client (a node that pings while its dummies
//! operate through its coalescing sub-master client) or a dummy; their schedule,
//! and how a point deploys them.

use std::sync::atomic::Ordering;
use std::time::Duration;

use hkvm_client::coalesce::CoalesceConfig;
use hkvm_client::{GlobalClient, SubmasterClient};
use hkvm_events::rpc::submaster::{ItemResult, MountSegment, Ping, PutEndItem, PutStartItem};
use hkvm_events::rpc::RpcReply;
use hkvm_events::{ClusterId, NodeId, SegmentId, SubclusterId};
use tokio::time::Instant;

use super::{Mix, Rng, Sweep};

/// Value size of every put.
const OBJECT_SIZE: u64 = 64 * 1024;
/// Keys per global `batch_is_exist`.
const EXIST_BATCH: usize = 64;

/// What one request was.
#[derive(Debug, Clone, Copy)]
pub(super) enum Kind {
    Ping = 0,
    Put = 1,
    Get = 2,
    Exist = 3,
}

/// Latencies (µs) per kind, and failures, of what one client did in the window.
#[derive(Debug, Default)]
pub(super) struct Record {
    pub(super) latencies: [Vec<u32>; 4],
    pub(super) failures: u64,
}

/// One simulated client's identity and handles: a full client (pings and
/// operations), a real client with dummies (pings only: its dummies operate) or a
/// dummy (operations only, through its real client's sub-master client).
pub(super) struct Client {
    index: usize,
    node: NodeId,
    submaster: SubmasterClient,
    global: GlobalClient,
    pings: bool,
    operates: bool,
}

impl Client {
    /// Whether this client is a node (it mounts a segment and pings).
    pub(super) fn is_node(&self) -> bool {
        self.pings
    }

    /// Mounts this node's one segment.
    pub(super) async fn mount(&self) -> anyhow::Result<()> {
        self.submaster
            .mount_segment(MountSegment {
                node: self.node.clone(),
                segment: SegmentId::new(format!("{}-seg", self.node))?,
                size: 1 << 34,
                endpoint: format!("10.{}.{}.1:7000", self.index / 256, self.index % 256),
                rdma: None,
            })
            .await?;
        Ok(())
    }

    async fn request(&self, kind: Kind, rng: &mut Rng, mine: &mut Vec<String>) -> bool {
        match kind {
            Kind::Ping => self
                .submaster
                .ping(Ping {
                    node: self.node.clone(),
                })
                .await
                .is_ok(),
            Kind::Put => {
                let key = format!("c{}/{}", self.index, mine.len());
                let item = PutStartItem {
                    key: key.clone(),
                    size: OBJECT_SIZE,
                    replicas: 2,
                    preferred_segment: None,
                    hard_pin: false,
                    put_id: 0,
                    avoid_nodes: Vec::new(),
                };
                let Ok(reply) = self.submaster.put_start(vec![item]).await else {
                    return false;
                };
                if !matches!(reply.first(), Some(ItemResult::Ok(_))) {
                    return false;
                }
                let end = PutEndItem {
                    key: key.clone(),
                    checksum: 7,
                    put_id: 0,
                };
                let ok = matches!(
                    self.submaster.put_end(vec![end]).await.as_deref(),
                    Ok([ItemResult::Ok(())])
                );
                mine.push(key);
                ok
            }
            Kind::Get => {
                let key = match mine.len() {
                    0 => format!("c{}/none", self.index),
                    n => mine[rng.next() as usize % n].clone(),
                };
                self.submaster.get_replica_list(vec![key]).await.is_ok()
            }
            Kind::Exist => {
                // Recent keys of this client and of others (hits and misses).
                let keys: Vec<String> = (0..EXIST_BATCH)
                    .map(|i| match (i % 2, mine.len()) {
                        (0, n) if n > 0 => mine[rng.next() as usize % n].clone(),
                        _ => format!("c{}/{}", rng.next() % 10_000, rng.next() % 8),
                    })
                    .collect();
                let reply = self.global.batch_is_exist(&keys, None).await;
                matches!(reply, Ok(RpcReply::Ok(_)))
            }
        }
    }
}

/// The schedule every client follows.
#[derive(Clone, Copy)]
pub(super) struct Schedule {
    pub(super) start: Instant,
    pub(super) measure_from: Instant,
    pub(super) end: Instant,
    pub(super) op_period: Duration,
    pub(super) mix: Mix,
}

pub(super) async fn run_client(client: Client, schedule: Schedule) -> Record {
    let mut rng = Rng::of_client(client.index);
    let mut record = Record::default();
    let mut mine = Vec::new();
    let second = Duration::from_secs(1);
    let never = schedule.end + second;
    let mut next_ping = if client.pings {
        schedule.start + second.mul_f64(rng.unit())
    } else {
        never
    };
    let mut next_op = if client.operates {
        schedule.start + schedule.op_period.mul_f64(rng.unit())
    } else {
        never
    };
    loop {
        let (due, kind) = if next_ping <= next_op {
            (next_ping, Kind::Ping)
        } else {
            let roll = (rng.next() % 100) as u32;
            let kind = match roll {
                r if r < schedule.mix.put => Kind::Put,
                r if r < schedule.mix.put + schedule.mix.get => Kind::Get,
                _ => Kind::Exist,
            };
            (next_op, kind)
        };
        if due >= schedule.end {
            return record;
        }
        tokio::time::sleep_until(due).await;
        match kind {
            Kind::Ping => next_ping += second,
            _ => next_op += schedule.op_period,
        }
        let started = Instant::now();
        let ok = client.request(kind, &mut rng, &mut mine).await;
        if started >= schedule.measure_from && started < schedule.end {
            if ok {
                let micros = started.elapsed().as_micros().min(u128::from(u32::MAX)) as u32;
                record.latencies[kind as usize].push(micros);
            } else {
                record.failures += 1;
            }
        }
    }
}

/// How the simulated clients are deployed.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) enum Deployment {
    /// Every client is a full client: its own node, pings and sub-master calls.
    Full,
    /// Clients are dummies, this many behind each real client.
    Dummies(usize),
}

/// The simulated clients of a point, and the distinct sub-master clients whose
/// request counts add up to what reached the sub-masters.
pub(super) fn deploy(
    deployment: Deployment,
    sweep: &Sweep,
    cluster: &ClusterId,
    ids: &[SubclusterId],
    connections: &[async_nats::Client],
) -> anyhow::Result<(Vec<Client>, Vec<SubmasterClient>)> {
    let connection = |index: usize| connections[index % connections.len()].clone();
    let submaster = |index: usize| {
        SubmasterClient::new(
            connection(index),
            cluster.clone(),
            ids[index % ids.len()].clone(),
        )
    };
    let mut clients = Vec::new();
    let mut callers = Vec::new();
    match deployment {
        Deployment::Full => {
            for index in 0..sweep.clients {
                let client = submaster(index);
                callers.push(client.clone());
                clients.push(Client {
                    index,
                    node: NodeId::new(format!("c-{index}"))?,
                    submaster: client,
                    global: GlobalClient::new(connection(index), cluster.clone()),
                    pings: true,
                    operates: true,
                });
            }
        }
        Deployment::Dummies(per_real) => {
            let reals = sweep.clients.div_ceil(per_real);
            for real in 0..reals {
                let node = NodeId::new(format!("r-{real}"))?;
                let coalesced = submaster(real).coalesced(CoalesceConfig::default());
                callers.push(coalesced.clone());
                clients.push(Client {
                    index: real,
                    node: node.clone(),
                    submaster: coalesced.clone(),
                    global: GlobalClient::new(connection(real), cluster.clone()),
                    pings: true,
                    operates: false,
                });
                for index in real * per_real..((real + 1) * per_real).min(sweep.clients) {
                    clients.push(Client {
                        index,
                        node: node.clone(),
                        submaster: coalesced.clone(),
                        global: GlobalClient::new(connection(index), cluster.clone()),
                        pings: false,
                        operates: true,
                    });
                }
            }
        }
    }
    Ok((clients, callers))
}

/// Requests sent so far by `callers`.
pub(super) fn requests_sent(callers: &[SubmasterClient]) -> u64 {
    callers
        .iter()
        .map(|caller| caller.stats().requests.load(Ordering::Relaxed))
        .sum()
}
