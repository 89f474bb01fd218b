//! The data path: `put` = put_start → parallel writes to every placement → put_end
//! with the value's xxh3-64 (revoke on failure); `get` = get_replica_list → read the
//! nearest replica → verify the checksum, trying the next replica on a mismatch or a
//! vanished node, and failing with a typed integrity error rather than ever
//! returning wrong bytes. A key that is not in the local sub-cluster is looked up
//! through the global master, which forwards to the owning sub-master.

use std::sync::Arc;

use bytes::Bytes;
use futures::future::join_all;
use hkvm_events::rpc::global::{GlobalOp, ProxyGetReplicaList, ProxyGetReplicaListReply};
use hkvm_events::rpc::submaster::{
    ItemError, ItemResult, PutEndItem, PutStartItem, ReplicaList, ReplicaLocation,
};
use hkvm_events::rpc::RpcReply;
use hkvm_events::{value_checksum, value_checksum_parts, SegmentId, SubclusterId};
use hkvm_transfer::{ReadInto, ReadOp, TransferError, Transport, WriteOp};

use crate::error::{ClientError, ClientErrorKind};
use crate::global::GlobalClient;
use crate::submaster::SubmasterClient;

/// Why a put or get failed.
#[derive(Debug, thiserror::Error)]
pub enum KvError {
    /// The metadata call failed.
    #[error(transparent)]
    Metadata(#[from] ClientError),
    /// The sub-master refused this item.
    #[error("{key}: {error}")]
    Item {
        /// The key.
        key: String,
        /// The sub-master's reason.
        error: ItemError,
    },
    /// Writing a replica failed (the put was revoked).
    #[error("{key}: writing a replica failed")]
    Write {
        /// The key.
        key: String,
        /// The transfer error.
        #[source]
        source: TransferError,
    },
    /// The value handed to [`KvClient::complete`] has another size than the
    /// reservation (the put was revoked).
    #[error("{key}: value of {len} bytes for a reservation of {reserved} bytes")]
    SizeMismatch {
        /// The key.
        key: String,
        /// The value's length.
        len: u64,
        /// The reserved size.
        reserved: u64,
    },
    /// The caller's buffers cannot hold the value.
    #[error("{key}: value of {size} bytes does not fit buffers of {capacity} bytes")]
    BufferTooSmall {
        /// The key.
        key: String,
        /// The value's size.
        size: u64,
        /// The buffers' total length.
        capacity: u64,
    },
    /// No replica returned bytes matching the recorded checksum.
    #[error("{key}: no intact replica ({tried} tried): {last}")]
    Integrity {
        /// The key.
        key: String,
        /// Replicas tried.
        tried: usize,
        /// What went wrong with the last one.
        last: String,
    },
    /// The key exists nowhere in the cluster.
    #[error("{key}: not found")]
    NotFound {
        /// The key.
        key: String,
    },
}

/// The kind of a [`KvError`], for matching.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum KvErrorKind {
    /// A metadata call failed; the inner kind says how.
    Metadata(ClientErrorKind),
    /// The sub-master refused the item.
    Item,
    /// A replica write failed.
    Write,
    /// The value does not fit its reservation.
    SizeMismatch,
    /// The caller's buffers are too small.
    BufferTooSmall,
    /// No replica held intact bytes.
    Integrity,
    /// The key exists nowhere the client can see.
    NotFound,
}

impl KvError {
    /// The kind.
    pub fn kind(&self) -> KvErrorKind {
        match self {
            Self::Metadata(error) => KvErrorKind::Metadata(error.kind()),
            Self::Item { .. } => KvErrorKind::Item,
            Self::Write { .. } => KvErrorKind::Write,
            Self::SizeMismatch { .. } => KvErrorKind::SizeMismatch,
            Self::BufferTooSmall { .. } => KvErrorKind::BufferTooSmall,
            Self::Integrity { .. } => KvErrorKind::Integrity,
            Self::NotFound { .. } => KvErrorKind::NotFound,
        }
    }
}

/// Where a value was read from.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Fetched {
    /// The value (verified against its checksum).
    pub value: Bytes,
    /// The sub-cluster that holds it.
    pub subcluster: SubclusterId,
    /// The replica it came from.
    pub replica: ReplicaLocation,
}

/// A put whose space is reserved but whose value is not written yet (see
/// [`KvClient::reserve`]).
#[derive(Debug)]
#[must_use = "complete or abandon a reservation; otherwise it only times out"]
pub struct PendingPut {
    key: String,
    size: u64,
    replicas: Vec<ReplicaLocation>,
}

impl PendingPut {
    /// The key.
    pub fn key(&self) -> &str {
        &self.key
    }
}

/// A KV client of one sub-cluster (with cluster-wide reads through the global
/// master). Cheap to clone.
#[derive(Clone)]
pub struct KvClient {
    metadata: SubmasterClient,
    transport: Arc<dyn Transport>,
    /// This process's own node endpoint, read first when it holds a replica.
    local_endpoint: Option<String>,
}

impl std::fmt::Debug for KvClient {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("KvClient")
            .field("subcluster", self.metadata.subcluster())
            .field("backend", &self.transport.backend())
            .finish()
    }
}

impl KvClient {
    /// A client over `metadata` moving bytes with `transport`.
    pub fn new(metadata: SubmasterClient, transport: Arc<dyn Transport>) -> Self {
        Self {
            metadata,
            transport,
            local_endpoint: None,
        }
    }

    /// Prefer replicas on this endpoint (the caller's own node) when reading.
    pub fn with_local_endpoint(mut self, endpoint: impl Into<String>) -> Self {
        self.local_endpoint = Some(endpoint.into());
        self
    }

    /// The metadata client.
    pub fn metadata(&self) -> &SubmasterClient {
        &self.metadata
    }

    /// Stores one value with `replicas` copies.
    ///
    /// # Errors
    /// [`KvError`]; a failed put is revoked and leaves nothing visible.
    pub async fn put(&self, key: &str, value: &[u8], replicas: u32) -> Result<(), KvError> {
        let mut results = self.put_many(&[(key, value)], replicas).await?;
        results.pop().unwrap_or(Ok(()))
    }

    /// Stores many values: one put_start, all writes in parallel, one put_end.
    /// Returns one result per item, in order.
    ///
    /// # Errors
    /// [`KvError::Metadata`] when the sub-master is unreachable as a whole.
    pub async fn put_many(
        &self,
        items: &[(&str, &[u8])],
        replicas: u32,
    ) -> Result<Vec<Result<(), KvError>>, KvError> {
        let scattered: Vec<(&str, [&[u8]; 1])> =
            items.iter().map(|(key, value)| (*key, [*value])).collect();
        let items: Vec<(&str, &[&[u8]])> = scattered
            .iter()
            .map(|(key, parts)| (*key, parts.as_slice()))
            .collect();
        self.put_scattered(&items, &PutOptions::replicas(replicas))
            .await
    }

    /// Stores many values, each the concatenation of its parts (buffers scattered
    /// in the caller's memory, written without being gathered first): one
    /// put_start, all writes in parallel, one put_end. Returns one result per item,
    /// in order.
    ///
    /// # Errors
    /// [`KvError::Metadata`] when the sub-master is unreachable as a whole.
    pub async fn put_scattered(
        &self,
        items: &[(&str, &[&[u8]])],
        options: &PutOptions,
    ) -> Result<Vec<Result<(), KvError>>, KvError> {
        let mut results = self.put_scattered_once(items, options).await?;
        // A put whose reservation vanished before its commit (a leader change
        // clears reservations) is started again, so the caller never sees "no
        // pending put" for a put it made once.
        for _ in 0..PUT_RESTARTS {
            let lost: Vec<usize> = results
                .iter()
                .enumerate()
                .filter(|(_, r)| {
                    matches!(
                        r,
                        Err(KvError::Item {
                            error: ItemError::NoPendingPut,
                            ..
                        })
                    )
                })
                .map(|(i, _)| i)
                .collect();
            if lost.is_empty() {
                break;
            }
            tracing::info!(
                puts = lost.len(),
                "reservations lost before their commit: putting again"
            );
            let again: Vec<(&str, &[&[u8]])> = lost.iter().map(|&i| items[i]).collect();
            let retried = self.put_scattered_once(&again, options).await?;
            for (index, result) in lost.into_iter().zip(retried) {
                results[index] = result;
            }
        }
        Ok(results)
    }

    async fn put_scattered_once(
        &self,
        items: &[(&str, &[&[u8]])],
        options: &PutOptions,
    ) -> Result<Vec<Result<(), KvError>>, KvError> {
        if items.is_empty() {
            return Ok(Vec::new());
        }
        let starts = items
            .iter()
            .map(|(key, parts)| PutStartItem {
                key: (*key).to_owned(),
                size: parts.iter().map(|part| part.len() as u64).sum(),
                replicas: options.replicas,
                preferred_segment: options.preferred_segment.clone(),
                hard_pin: options.hard_pin,
            })
            .collect();
        let placements = self.metadata.put_start(starts).await?;
        let writes = items
            .iter()
            .zip(&placements)
            .map(|((key, parts), placement)| async move {
                match placement {
                    ItemResult::Err(error) => Err(KvError::Item {
                        key: (*key).to_owned(),
                        error: error.clone(),
                    }),
                    ItemResult::Ok(replicas) => self.write_replicas(key, parts, replicas).await,
                }
            });
        let written = join_all(writes).await;
        let mut ends = Vec::new();
        let mut revoke = Vec::new();
        for ((key, parts), result) in items.iter().zip(&written) {
            match result {
                Ok(()) => ends.push(PutEndItem {
                    key: (*key).to_owned(),
                    checksum: value_checksum_parts(parts),
                }),
                Err(KvError::Write { .. }) => revoke.push((*key).to_owned()),
                Err(_) => {}
            }
        }
        if !revoke.is_empty() {
            // Best effort: the reservation also times out on its own.
            let _ = self.metadata.put_revoke(revoke).await;
        }
        if ends.is_empty() {
            return Ok(written);
        }
        let ended_keys: Vec<String> = ends.iter().map(|e| e.key.clone()).collect();
        let ended = match self.metadata.put_end(ends).await {
            Ok(ended) => ended,
            Err(error) => {
                // The commit may or may not have happened: remove, so that a put that
                // returned an error never stays visible.
                let _ = self.metadata.remove(ended_keys, true).await;
                return Err(error.into());
            }
        };
        let mut ended = ended.into_iter();
        Ok(items
            .iter()
            .zip(written)
            .map(|((key, _), written)| {
                written?;
                match ended.next() {
                    Some(ItemResult::Ok(())) => Ok(()),
                    Some(ItemResult::Err(error)) => Err(KvError::Item {
                        key: (*key).to_owned(),
                        error,
                    }),
                    None => Err(KvError::Item {
                        key: (*key).to_owned(),
                        error: ItemError::NoPendingPut,
                    }),
                }
            })
            .collect())
    }

    /// Reserves space for a value of `size` bytes under `key` (put_start) without
    /// writing it yet: a caller that must fetch the value from far away learns
    /// first that the key is free and the space is there. Finish with
    /// [`KvClient::complete`] or [`KvClient::abandon`] before the sub-master's put
    /// timeout.
    ///
    /// # Errors
    /// [`KvError::Item`] (e.g. `AlreadyExists`, `NoSpace`) or a metadata failure.
    pub async fn reserve(
        &self,
        key: &str,
        size: u64,
        replicas: u32,
    ) -> Result<PendingPut, KvError> {
        let start = PutStartItem {
            key: key.to_owned(),
            size,
            replicas,
            preferred_segment: None,
            hard_pin: false,
        };
        let mut placed = self.metadata.put_start(vec![start]).await?;
        match placed.pop() {
            Some(ItemResult::Ok(replicas)) => Ok(PendingPut {
                key: key.to_owned(),
                size,
                replicas,
            }),
            Some(ItemResult::Err(error)) => Err(KvError::Item {
                key: key.to_owned(),
                error,
            }),
            None => Err(KvError::Item {
                key: key.to_owned(),
                error: ItemError::Invalid("put_start answered no item".into()),
            }),
        }
    }

    /// Writes `value` into a reserved put's replicas and commits it (put_end with
    /// the value's checksum). A failed write revokes the put; a put_end whose
    /// outcome is unknown removes the key, as [`KvClient::put`] does.
    ///
    /// # Errors
    /// [`KvError::Write`], [`KvError::SizeMismatch`],
    /// [`KvError::Item`] or a metadata failure.
    pub async fn complete(&self, pending: PendingPut, value: &[u8]) -> Result<(), KvError> {
        if value.len() as u64 != pending.size {
            let key = pending.key.clone();
            let reserved = pending.size;
            self.abandon(pending).await;
            return Err(KvError::SizeMismatch {
                key,
                len: value.len() as u64,
                reserved,
            });
        }
        if let Err(error) = self
            .write_replicas(&pending.key, &[value], &pending.replicas)
            .await
        {
            self.abandon(pending).await;
            return Err(error);
        }
        let end = PutEndItem {
            key: pending.key.clone(),
            checksum: value_checksum(value),
        };
        let mut ended = match self.metadata.put_end(vec![end]).await {
            Ok(ended) => ended,
            Err(error) => {
                let _ = self.metadata.remove(vec![pending.key], true).await;
                return Err(error.into());
            }
        };
        match ended.pop() {
            Some(ItemResult::Ok(())) => Ok(()),
            Some(ItemResult::Err(error)) => Err(KvError::Item {
                key: pending.key,
                error,
            }),
            None => Err(KvError::Item {
                key: pending.key,
                error: ItemError::NoPendingPut,
            }),
        }
    }

    /// Gives a reservation back (put_revoke, best effort: it also times out).
    pub async fn abandon(&self, pending: PendingPut) {
        let _ = self.metadata.put_revoke(vec![pending.key]).await;
    }

    /// Writes a value given as consecutive parts to every replica (each part at
    /// its offset in the replica, all parts of a replica in one batch).
    async fn write_replicas(
        &self,
        key: &str,
        parts: &[&[u8]],
        replicas: &[ReplicaLocation],
    ) -> Result<(), KvError> {
        let writes = replicas.iter().map(|replica| async move {
            let mut offset = replica.offset;
            let ops: Vec<WriteOp<'_>> = parts
                .iter()
                .filter(|part| !part.is_empty())
                .map(|part| {
                    let op = WriteOp {
                        region: replica.segment.as_str(),
                        offset,
                        data: part,
                    };
                    offset += part.len() as u64;
                    op
                })
                .collect();
            if ops.is_empty() {
                return Ok(());
            }
            self.transport.write_batch(&replica.endpoint, &ops).await
        });
        for result in join_all(writes).await {
            result.map_err(|source| KvError::Write {
                key: key.to_owned(),
                source,
            })?;
        }
        Ok(())
    }

    /// Reads one value, verified against its checksum; looks in other sub-clusters
    /// through the global master when the local one does not have it.
    ///
    /// # Errors
    /// [`KvError::NotFound`], [`KvError::Integrity`], or a metadata failure.
    pub async fn get(&self, key: &str) -> Result<Fetched, KvError> {
        let mut results = self.get_many(&[key]).await?;
        results.pop().unwrap_or_else(|| {
            Err(KvError::NotFound {
                key: key.to_owned(),
            })
        })
    }

    /// Where values are: per key its sub-cluster and replica list (granting a read
    /// lease), from the local sub-master, and for keys it does not hold from the
    /// global master (one request for all of them), which asks their owner.
    ///
    /// # Errors
    /// [`KvError::Metadata`] when the local sub-master is unreachable as a whole.
    pub async fn locate(&self, keys: &[&str]) -> Result<Vec<Result<Located, KvError>>, KvError> {
        if keys.is_empty() {
            return Ok(Vec::new());
        }
        let lists = self
            .metadata
            .get_replica_list(keys.iter().map(|k| (*k).to_owned()).collect())
            .await?;
        let local = self.metadata.subcluster();
        let mut located: Vec<Result<Located, KvError>> = Vec::with_capacity(keys.len());
        let mut elsewhere = Vec::new();
        for (index, (key, list)) in keys.iter().zip(lists).enumerate() {
            located.push(match list {
                ItemResult::Ok(list) => Ok(Located {
                    subcluster: local.clone(),
                    list,
                }),
                ItemResult::Err(ItemError::NotFound) => {
                    elsewhere.push(index);
                    Err(KvError::NotFound {
                        key: (*key).to_owned(),
                    })
                }
                ItemResult::Err(error) => Err(KvError::Item {
                    key: (*key).to_owned(),
                    error,
                }),
            });
        }
        if !elsewhere.is_empty() {
            let keys: Vec<String> = elsewhere.iter().map(|&i| keys[i].to_owned()).collect();
            for (index, found) in elsewhere.into_iter().zip(self.locate_elsewhere(keys).await) {
                if let Some(found) = found {
                    located[index] = Ok(found);
                }
            }
        }
        Ok(located)
    }

    /// Asks the global master which sub-clusters hold `keys` and where (it asks
    /// their owners); `None` for a key held nowhere it can see.
    async fn locate_elsewhere(&self, keys: Vec<String>) -> Vec<Option<Located>> {
        let count = keys.len();
        let request = ProxyGetReplicaList { keys, labels: None };
        let global = GlobalClient::with_caller(
            self.metadata.caller().clone(),
            self.metadata.cluster().clone(),
        );
        // One attempt: a global master that is absent or busy is reported as the keys
        // being nowhere we can see (the caller's miss path).
        let reply: ProxyGetReplicaListReply = match global
            .call_once::<_, ProxyGetReplicaListReply>(GlobalOp::GetReplicaList, &request)
            .await
        {
            Ok(RpcReply::Ok(reply)) if reply.items.len() == count => reply,
            _ => return (0..count).map(|_| None).collect(),
        };
        reply
            .from
            .into_iter()
            .chain(std::iter::repeat(None))
            .zip(reply.items)
            .map(|(from, item)| match (from, item) {
                (Some(subcluster), ItemResult::Ok(list)) => Some(Located { subcluster, list }),
                _ => None,
            })
            .collect()
    }

    /// Reads many values (each verified, each from the sub-cluster that holds it),
    /// in order.
    ///
    /// # Errors
    /// [`KvError::Metadata`] when the local sub-master is unreachable as a whole.
    pub async fn get_many(&self, keys: &[&str]) -> Result<Vec<Result<Fetched, KvError>>, KvError> {
        let located = self.locate(keys).await?;
        let reads = keys.iter().zip(located).map(|(key, located)| async move {
            let located = located?;
            self.read_verified(key, located.subcluster, located.list)
                .await
        });
        Ok(join_all(reads).await)
    }

    /// Reads one value straight into the caller's buffers (filled in order; their
    /// total length must hold the value), verified against its checksum. Returns
    /// the value's size.
    ///
    /// # Errors
    /// [`KvError::BufferTooSmall`], [`KvError::NotFound`], [`KvError::Integrity`],
    /// or a metadata failure.
    pub async fn get_into(&self, key: &str, parts: &mut [&mut [u8]]) -> Result<u64, KvError> {
        let mut items = [(key, parts)];
        let mut results = self.get_many_into(&mut items).await?;
        results.pop().unwrap_or_else(|| {
            Err(KvError::NotFound {
                key: key.to_owned(),
            })
        })
    }

    /// [`KvClient::get_into`] for many keys: one lookup, all reads in parallel.
    /// Returns one result per item, in order.
    ///
    /// # Errors
    /// [`KvError::Metadata`] when the local sub-master is unreachable as a whole.
    pub async fn get_many_into(
        &self,
        items: &mut [(&str, &mut [&mut [u8]])],
    ) -> Result<Vec<Result<u64, KvError>>, KvError> {
        let keys: Vec<&str> = items.iter().map(|(key, _)| *key).collect();
        let located = self.locate(&keys).await?;
        let reads = items
            .iter_mut()
            .zip(located)
            .map(|((key, parts), located)| async move {
                let located = located?;
                self.read_located_into(key, &located, parts).await
            });
        Ok(join_all(reads).await)
    }

    /// Reads a located value into `parts` (filled in order): replicas local first,
    /// until one matches the checksum. Returns the value's size.
    ///
    /// # Errors
    /// [`KvError::BufferTooSmall`] or [`KvError::Integrity`].
    pub async fn read_located_into(
        &self,
        key: &str,
        located: &Located,
        parts: &mut [&mut [u8]],
    ) -> Result<u64, KvError> {
        let list = &located.list;
        let capacity: u64 = parts.iter().map(|part| part.len() as u64).sum();
        if capacity < list.size {
            return Err(KvError::BufferTooSmall {
                key: key.to_owned(),
                size: list.size,
                capacity,
            });
        }
        let mut replicas: Vec<&ReplicaLocation> = list.replicas.iter().collect();
        if let Some(local) = &self.local_endpoint {
            replicas.sort_by_key(|r| r.endpoint != *local);
        }
        let mut last = "no replica listed".to_owned();
        for replica in &replicas {
            let read = {
                let mut ops = carve(parts, list.size, replica);
                if ops.is_empty() {
                    Ok(())
                } else {
                    self.transport
                        .read_batch_into(&replica.endpoint, &mut ops)
                        .await
                }
            };
            match read {
                Ok(()) => {
                    if checksum_of_prefix(parts, list.size) == list.checksum {
                        return Ok(list.size);
                    }
                    last = format!(
                        "checksum mismatch at {}@{}",
                        replica.segment, replica.offset
                    );
                    tracing::warn!(key, segment = %replica.segment, "replica failed its checksum; trying the next");
                }
                Err(error) => {
                    last = format!("{}: {error}", replica.endpoint);
                    tracing::warn!(key, endpoint = replica.endpoint, %error, "replica unreachable; trying the next");
                }
            }
        }
        Err(KvError::Integrity {
            key: key.to_owned(),
            tried: replicas.len(),
            last,
        })
    }

    /// Reads replicas (local first) until one matches the checksum.
    async fn read_verified(
        &self,
        key: &str,
        subcluster: SubclusterId,
        list: ReplicaList,
    ) -> Result<Fetched, KvError> {
        let mut replicas = list.replicas;
        if let Some(local) = &self.local_endpoint {
            replicas.sort_by_key(|r| r.endpoint != *local);
        }
        let mut last = "no replica listed".to_owned();
        for replica in &replicas {
            let op = [ReadOp {
                region: replica.segment.as_str(),
                offset: replica.offset,
                len: list.size,
            }];
            match self.transport.read_batch(&replica.endpoint, &op).await {
                Ok(mut values) => match values.pop() {
                    Some(value) if value_checksum(&value) == list.checksum => {
                        return Ok(Fetched {
                            value,
                            subcluster,
                            replica: replica.clone(),
                        })
                    }
                    Some(_) => {
                        last = format!(
                            "checksum mismatch at {}@{}",
                            replica.segment, replica.offset
                        );
                        tracing::warn!(key, segment = %replica.segment, "replica failed its checksum; trying the next");
                    }
                    None => last = "empty read".to_owned(),
                },
                Err(error) => {
                    last = format!("{}: {error}", replica.endpoint);
                    tracing::warn!(key, endpoint = replica.endpoint, %error, "replica unreachable; trying the next");
                }
            }
        }
        Err(KvError::Integrity {
            key: key.to_owned(),
            tried: replicas.len(),
            last,
        })
    }
}

/// How often a put whose reservation vanished before its commit is started again.
const PUT_RESTARTS: usize = 2;

/// A value's place: the sub-cluster that holds it and its replicas.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Located {
    /// The sub-cluster.
    pub subcluster: SubclusterId,
    /// Size, checksum and replicas.
    pub list: ReplicaList,
}

/// How a put is placed.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct PutOptions {
    /// Replicas, on distinct nodes.
    pub replicas: u32,
    /// Put the first replica on this segment when it has room.
    pub preferred_segment: Option<SegmentId>,
    /// Never evict the object (it can still be removed).
    pub hard_pin: bool,
}

impl Default for PutOptions {
    fn default() -> Self {
        Self::replicas(1)
    }
}

impl PutOptions {
    /// `replicas` copies, no preference, no pin.
    pub fn replicas(replicas: u32) -> Self {
        Self {
            replicas,
            preferred_segment: None,
            hard_pin: false,
        }
    }
}

/// The reads that fill `parts` in order with the first `size` bytes of `replica`.
fn carve<'b>(
    parts: &'b mut [&mut [u8]],
    size: u64,
    replica: &'b ReplicaLocation,
) -> Vec<ReadInto<'b>> {
    let mut ops = Vec::new();
    let mut remaining = size;
    let mut offset = replica.offset;
    for part in parts.iter_mut() {
        if remaining == 0 {
            break;
        }
        let len = remaining.min(part.len() as u64);
        let (head, _) = part.split_at_mut(usize::try_from(len).unwrap_or(usize::MAX));
        if !head.is_empty() {
            ops.push(ReadInto {
                region: replica.segment.as_str(),
                offset,
                buf: head,
            });
        }
        offset += len;
        remaining -= len;
    }
    ops
}

/// The value checksum of the first `size` bytes spread over `parts`.
fn checksum_of_prefix(parts: &[&mut [u8]], size: u64) -> u64 {
    let mut remaining = size;
    let mut taken: Vec<&[u8]> = Vec::with_capacity(parts.len());
    for part in parts {
        if remaining == 0 {
            break;
        }
        let len = usize::try_from(remaining.min(part.len() as u64)).unwrap_or(usize::MAX);
        taken.push(&part[..len]);
        remaining -= len as u64;
    }
    value_checksum_parts(&taken)
}
