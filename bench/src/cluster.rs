//! A synthetic cluster for the global-master benchmarks: `subclusters` event
//! streams holding `keys` put events between them (key `i` in sub-cluster
//! `i % subclusters`, every tenth key also in the next one), published as
//! pre-encoded 1024-event messages with a window of outstanding acks, plus
//! registry entries for their sub-masters.

use std::collections::BTreeMap;
use std::future::IntoFuture as _;
use std::time::Duration;

use async_nats::jetstream;
use bytes::Bytes;
use futures::stream::FuturesOrdered;
use futures::StreamExt as _;
use hkvm_events::codec::{Header, MessageBuilder};
use hkvm_events::registry::SubmasterInfo;
use hkvm_events::subject::{bucket_name, event_subject, stream_name};
use hkvm_events::{
    ClusterId, KvEvent, Placement, ProducerId, PutCommitted, SegmentId, SubclusterId,
};
use hkvm_log::registry::{ensure_registry_bucket, register};
use hkvm_log::stream::{ensure_stream, StreamSettings};

/// Events per published message.
const EVENTS_PER_MESSAGE: usize = 1024;
/// Acks outstanding while publishing.
const WINDOW: usize = 16;

/// The benchmark cluster.
pub struct BenchCluster {
    /// The cluster name.
    pub cluster: ClusterId,
    /// The sub-clusters, in index order.
    pub subclusters: Vec<SubclusterId>,
    /// Distinct keys.
    pub keys: usize,
    /// Put events written (keys plus second copies).
    pub events: usize,
    /// Messages written.
    pub messages: usize,
}

/// The `i`-th key.
pub fn key(i: usize) -> String {
    format!("model-7b/tp0/block/{i:020}")
}

/// The sub-clusters holding key `i`.
fn holders(i: usize, subclusters: usize) -> impl Iterator<Item = usize> {
    let first = i % subclusters;
    let second = (i % 10 == 0 && subclusters > 1).then_some((first + 1) % subclusters);
    std::iter::once(first).chain(second)
}

async fn publish_all(
    js: &jetstream::Context,
    subject: &str,
    payloads: impl Iterator<Item = anyhow::Result<Vec<u8>>>,
) -> anyhow::Result<usize> {
    let mut pending = FuturesOrdered::new();
    let mut count = 0;
    for payload in payloads {
        if pending.len() >= WINDOW {
            if let Some(ack) = pending.next().await {
                let _: jetstream::publish::PublishAck = ack?;
            }
        }
        pending.push_back(
            js.publish(subject.to_owned(), Bytes::from(payload?))
                .await?
                .into_future(),
        );
        count += 1;
    }
    while let Some(ack) = pending.next().await {
        ack?;
    }
    Ok(count)
}

impl BenchCluster {
    /// Creates fresh streams for `cluster` and fills them.
    ///
    /// # Errors
    /// When NATS fails.
    pub async fn build(
        js: &jetstream::Context,
        cluster: &str,
        subclusters: usize,
        keys: usize,
    ) -> anyhow::Result<Self> {
        let cluster = ClusterId::new(cluster)?;
        let ids: Vec<SubclusterId> = (0..subclusters)
            .map(|i| SubclusterId::new(format!("sc-{i}")))
            .collect::<Result<_, _>>()?;
        for purpose in ["checkpoints", "blooms"] {
            let _ = js.delete_object_store(bucket_name(&cluster, purpose)).await;
        }
        let header = Header {
            producer: ProducerId::new("bench")?,
            epoch: 1,
            unix_ms: 0,
        };
        let segment = SegmentId::new("node-0-seg-0")?;
        let store = ensure_registry_bucket(js, &cluster, Duration::from_secs(600)).await?;
        let (mut events, mut messages) = (0, 0);
        for (index, id) in ids.iter().enumerate() {
            let _ = js.delete_stream(stream_name(&cluster, id)).await;
            ensure_stream(js, &cluster, id, &StreamSettings::default()).await?;
            let mine: Vec<usize> = (0..keys)
                .filter(|&i| holders(i, subclusters).any(|s| s == index))
                .collect();
            events += mine.len();
            let payloads = mine.chunks(EVENTS_PER_MESSAGE).map(|chunk| {
                let mut builder = MessageBuilder::new(&header, Vec::with_capacity(96 * 1024))?;
                for &i in chunk {
                    builder.push(&KvEvent::PutCommitted(PutCommitted::new(
                        key(i),
                        256 * 1024,
                        i as u64,
                        vec![Placement {
                            segment: segment.clone(),
                            offset: (i as u64) << 18,
                        }],
                    )))?;
                }
                Ok(builder.finish())
            });
            messages += publish_all(js, &event_subject(&cluster, id), payloads).await?;
            register(
                &store,
                &SubmasterInfo {
                    id: ProducerId::new(format!("bench-{id}"))?,
                    cluster: cluster.clone(),
                    subcluster: id.clone(),
                    rpc_prefix: format!("hkvm.{cluster}.{id}.rpc"),
                    labels: BTreeMap::from([("zone".to_owned(), format!("z{}", index % 2))]),
                    capacity_bytes: 1 << 40,
                    used_bytes: 0,
                    objects: mine.len() as u64,
                    epoch: 1,
                    stream: stream_name(&cluster, id),
                    last_seq: 0,
                    unix_ms: 0,
                },
            )
            .await?;
        }
        Ok(Self {
            cluster,
            subclusters: ids,
            keys,
            events,
            messages,
        })
    }

    /// A global-master configuration for this cluster without periodic writes.
    pub fn config(&self, replica: &str, restore: bool) -> hkvm_globalmaster::GlobalMasterConfig {
        hkvm_globalmaster::GlobalMasterConfig {
            cluster: self.cluster.clone(),
            replica: replica.to_owned(),
            registry_ttl_ms: 600_000,
            checkpoint_interval_ms: 0,
            bloom_interval_ms: 0,
            restore_checkpoint: restore,
            ..hkvm_globalmaster::GlobalMasterConfig::default()
        }
    }
}
