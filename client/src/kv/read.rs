//! The read side of [`KvClient`]: locating values (the local sub-master, then the
//! global master for the rest, in one request), and reading them, verified
//! against their checksum, into new buffers or straight into the caller's.

use futures::future::join_all;
use hkvm_events::rpc::global::{GlobalOp, ProxyGetReplicaList, ProxyGetReplicaListReply};
use hkvm_events::rpc::submaster::{ItemError, ItemResult, ReplicaList, ReplicaLocation};
use hkvm_events::rpc::RpcReply;
use hkvm_events::{value_checksum, value_checksum_parts, SubclusterId};
use hkvm_transfer::{ReadInto, ReadOp};

use super::{Fetched, KvClient, KvError, Located, WireGrant};
use crate::error::ClientError;
use crate::global::GlobalClient;

impl KvClient {
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

    /// Reads one value from this client's sub-cluster only (never through the
    /// global master), verified against its checksum: for a caller that asks one
    /// sub-cluster on purpose, such as the inter-DC gateway.
    ///
    /// # Errors
    /// [`KvError::NotFound`] when this sub-cluster does not hold it,
    /// [`KvError::Integrity`], or a metadata failure.
    pub async fn get_here(&self, key: &str) -> Result<Fetched, KvError> {
        let mut lists = self.metadata.get_replica_list(vec![key.to_owned()]).await?;
        match lists.pop() {
            Some(ItemResult::Ok(list)) => {
                self.read_verified(key, self.metadata.subcluster().clone(), list)
                    .await
            }
            Some(ItemResult::Err(ItemError::NotFound)) | None => Err(KvError::NotFound {
                key: key.to_owned(),
            }),
            Some(ItemResult::Err(error)) => Err(KvError::Item {
                key: key.to_owned(),
                error,
            }),
        }
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
            let wanted: Vec<String> = elsewhere.iter().map(|&i| keys[i].to_owned()).collect();
            match self.locate_elsewhere(wanted).await {
                Ok(found) => {
                    for (index, found) in elsewhere.into_iter().zip(found) {
                        if let Some(found) = found {
                            located[index] = Ok(found);
                        }
                    }
                }
                // Not found here, and nobody could say about elsewhere.
                Err(error) => {
                    let source = std::sync::Arc::new(error);
                    for index in elsewhere {
                        located[index] = Err(KvError::Unresolved {
                            key: keys[index].to_owned(),
                            source: std::sync::Arc::clone(&source),
                        });
                    }
                }
            }
        }
        Ok(located)
    }

    /// Asks the global master which sub-clusters hold `keys` and where (it asks
    /// their owners); `None` for a key held nowhere it can see.
    ///
    /// # Errors
    /// When the global master does not answer, or answers Busy or an error: one
    /// attempt, because the caller is on its miss path and an engine treats a
    /// failed read as a miss anyway; but it is told, not given "not found".
    async fn locate_elsewhere(
        &self,
        keys: Vec<String>,
    ) -> Result<Vec<Option<Located>>, ClientError> {
        let count = keys.len();
        // Read your writes: a key put anywhere and acknowledged before this ask
        // is never answered "held nowhere" (the global master catches up first).
        let request = ProxyGetReplicaList {
            keys,
            labels: None,
            sync: true,
        };
        let global = GlobalClient::with_caller(
            self.metadata.caller().clone(),
            self.metadata.cluster().clone(),
        );
        let op = GlobalOp::GetReplicaList.name();
        let reply: ProxyGetReplicaListReply = match global
            .call_once::<_, ProxyGetReplicaListReply>(GlobalOp::GetReplicaList, &request)
            .await?
        {
            RpcReply::Ok(reply) if reply.items.len() == count => reply,
            RpcReply::Ok(reply) => {
                return Err(ClientError::Mismatch {
                    asked: count,
                    answered: reply.items.len(),
                })
            }
            RpcReply::Err(source) => return Err(ClientError::Rpc { op, source }),
        };
        Ok(reply
            .from
            .into_iter()
            .chain(std::iter::repeat(None))
            .zip(reply.items)
            .map(|(from, item)| match (from, item) {
                (Some(subcluster), ItemResult::Ok(list)) => Some(Located { subcluster, list }),
                _ => None,
            })
            .collect())
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
                let grant = WireGrant::of(replica);
                let mut ops = carve(parts, list.size, replica, grant.as_slice());
                if ops.is_empty() {
                    Ok(())
                } else {
                    let route = self.transports.route(replica);
                    route
                        .transport
                        .read_batch_into(route.endpoint, &mut ops)
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
            let grant = WireGrant::of(replica);
            let op = [ReadOp {
                region: replica.segment.as_str(),
                offset: replica.offset,
                len: list.size,
                grant: grant.as_slice(),
            }];
            let route = self.transports.route(replica);
            match route.transport.read_batch(route.endpoint, &op).await {
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

/// The reads that fill `parts` in order with the first `size` bytes of `replica`.
fn carve<'b>(
    parts: &'b mut [&mut [u8]],
    size: u64,
    replica: &'b ReplicaLocation,
    grant: &'b [u8],
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
                grant,
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
