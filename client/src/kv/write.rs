//! The write side of [`KvClient`]: puts (placed in a space lease and committed
//! with one request, or reserved, written to every replica and committed;
//! revoke or remove on failure, start again when a reservation or a lease
//! vanished, place again on other nodes when a replica write failed), and
//! reserve/complete for callers that fetch the value after reserving.

use futures::future::join_all;
use hkvm_events::rpc::submaster::{
    ItemError, ItemResult, PutCommitItem, PutEndItem, PutId, PutStartItem, ReplicaLocation,
};
use hkvm_events::{value_checksum, value_checksum_parts};
use hkvm_transfer::WriteOp;

use super::space::Carved;
use super::{KvClient, KvError, PutOptions, WireGrant};
use crate::error::ClientError;

/// How often a put is started again: when its reservation vanished before its
/// commit, or when a write to one of its replicas failed (placed then on other
/// nodes: see [`super::unreachable`]).
const PUT_RESTARTS: usize = 2;

/// Whether an attempt's outcome calls for another attempt.
fn worth_again(result: &Result<(), KvError>) -> bool {
    matches!(
        result,
        Err(KvError::Write { .. }
            | KvError::Item {
                error: ItemError::NoPendingPut,
                ..
            })
    )
}

/// A fresh id for one attempt of a put: random and nonzero, so that its
/// `put_start` and `put_end` can be sent again and the sub-master tells this put's
/// commit from any other.
fn new_put_id() -> PutId {
    rand::random::<PutId>().max(1)
}

/// A put whose space is reserved but whose value is not written yet (see
/// [`KvClient::reserve`]).
#[derive(Debug)]
#[must_use = "complete or abandon a reservation; otherwise it only times out"]
pub struct PendingPut {
    key: String,
    size: u64,
    replicas: Vec<ReplicaLocation>,
    put_id: PutId,
}

impl PendingPut {
    /// The key.
    pub fn key(&self) -> &str {
        &self.key
    }
}

impl KvClient {
    /// Stores one value with `replicas` copies.
    ///
    /// # Errors
    /// [`KvError`]; a failed put is revoked and leaves nothing visible.
    pub async fn put(&self, key: &str, value: &[u8], replicas: u32) -> Result<(), KvError> {
        let mut results = self.put_many(&[(key, value)], replicas).await?;
        results.pop().unwrap_or(Ok(()))
    }

    /// Stores many values: all writes in parallel, then one put_commit for those
    /// placed in a space lease and one put_start / put_end for the others.
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
        // pending put" for a put it made once; so is a put whose replica write
        // failed (its node is gone but still mounted, until the sub-master's node
        // timeout): revoked, it is placed again avoiding that node.
        for _ in 0..PUT_RESTARTS {
            let lost: Vec<usize> = results
                .iter()
                .enumerate()
                .filter(|(_, result)| worth_again(result))
                .map(|(i, _)| i)
                .collect();
            if lost.is_empty() {
                break;
            }
            tracing::info!(
                puts = lost.len(),
                "reservations lost before their commit, or replica writes failed: putting again"
            );
            let again: Vec<(&str, &[&[u8]])> = lost.iter().map(|&i| items[i]).collect();
            let retried = self.put_scattered_once(&again, options).await?;
            for (index, result) in lost.into_iter().zip(retried) {
                // Placed again after a failed write, a put the sub-master
                // refuses (no room left off the failed node, or the first
                // reservation still holding the key because its revoke did not
                // arrive) keeps the write failure as its answer: it says more.
                let first_failed_writing = matches!(results[index], Err(KvError::Write { .. }));
                let refused = matches!(result, Err(KvError::Item { .. })) && !worth_again(&result);
                if !(first_failed_writing && refused) {
                    results[index] = result;
                }
            }
        }
        Ok(results)
    }

    /// One attempt at `items`: those a space lease has room for are placed in it
    /// and committed with one `put_commit`; the others, and those whose lease the
    /// sub-master no longer holds, go through `put_start` / `put_end`.
    async fn put_scattered_once(
        &self,
        items: &[(&str, &[&[u8]])],
        options: &PutOptions,
    ) -> Result<Vec<Result<(), KvError>>, KvError> {
        let Some(pool) = &self.space else {
            return self.put_reserving(items, options).await;
        };
        let carved: Vec<Option<Carved>> = items
            .iter()
            .map(|(_, parts)| pool.carve(parts.iter().map(|p| p.len() as u64).sum(), options))
            .collect();
        if carved.iter().all(Option::is_none) {
            return self.put_reserving(items, options).await;
        }
        let mut results: Vec<Option<Result<(), KvError>>> = items.iter().map(|_| None).collect();
        let (leased, unplaced): (Vec<_>, Vec<_>) = carved
            .into_iter()
            .enumerate()
            .partition(|(_, carved)| carved.is_some());
        let leased: Vec<(usize, Carved)> = leased
            .into_iter()
            .filter_map(|(i, carved)| Some((i, carved?)))
            .collect();
        let mut reserve: Vec<usize> = unplaced.into_iter().map(|(i, _)| i).collect();
        for (index, result) in self.put_leased(items, &leased, options).await? {
            match result {
                Err(KvError::Item {
                    error: ItemError::NoLease,
                    ..
                }) => reserve.push(index),
                other => results[index] = Some(other),
            }
        }
        reserve.sort_unstable();
        let again: Vec<(&str, &[&[u8]])> = reserve.iter().map(|&i| items[i]).collect();
        for (index, result) in reserve
            .into_iter()
            .zip(self.put_reserving(&again, options).await?)
        {
            results[index] = Some(result);
        }
        Ok(results
            .into_iter()
            .zip(items)
            .map(|(result, (key, _))| {
                result.unwrap_or_else(|| {
                    Err(KvError::Item {
                        key: (*key).to_owned(),
                        error: ItemError::Invalid("put decided nothing".into()),
                    })
                })
            })
            .collect())
    }

    /// Writes the items carved out of leases and commits them; answers each
    /// item's index and result (`NoLease` when its lease is gone, so it is put
    /// again by reserving).
    async fn put_leased(
        &self,
        items: &[(&str, &[&[u8]])],
        leased: &[(usize, Carved)],
        options: &PutOptions,
    ) -> Result<Vec<(usize, Result<(), KvError>)>, KvError> {
        let writes = leased.iter().map(|(index, carved)| {
            let (key, parts) = items[*index];
            async move { self.write_replicas(key, parts, &carved.replicas).await }
        });
        let written = join_all(writes).await;
        let mut commits = Vec::new();
        let mut committed_at = Vec::new();
        let mut outcomes = Vec::with_capacity(leased.len());
        for ((index, carved), result) in leased.iter().zip(written) {
            let (key, parts) = items[*index];
            match result {
                Ok(()) => {
                    committed_at.push((*index, carved.lease));
                    commits.push(PutCommitItem {
                        key: key.to_owned(),
                        size: parts.iter().map(|p| p.len() as u64).sum(),
                        checksum: value_checksum_parts(parts),
                        lease: carved.lease,
                        offset: carved.offset,
                        hard_pin: options.hard_pin,
                        put_id: new_put_id(),
                    });
                }
                // The space stays the lease's and is freed when it ends; a lease
                // with a range on a node that failed a write carves no more.
                Err(error) => {
                    if let (KvError::Write { .. }, Some(pool)) = (&error, &self.space) {
                        pool.forget(carved.lease);
                    }
                    outcomes.push((*index, Err(error)));
                }
            }
        }
        if commits.is_empty() {
            return Ok(outcomes);
        }
        let keys: Vec<String> = commits.iter().map(|c| c.key.clone()).collect();
        let answers = match self.metadata.put_commit(commits).await {
            Ok(answers) => answers,
            // Never delivered: the leader does not serve `put_commit` (an older
            // build took over). Its leases are gone with it; put by reserving.
            Err(ClientError::NoService { why, .. }) => {
                tracing::info!(%why, "put_commit not served: putting without leases");
                vec![ItemResult::Err(ItemError::NoLease); keys.len()]
            }
            Err(error) => {
                // Sent again until answered, so the sub-master was unreachable
                // past the retry deadline: remove, so that a put that returned an
                // error never stays visible.
                let _ = self.metadata.remove(keys, true).await;
                return Err(error.into());
            }
        };
        for (((index, lease), key), answer) in committed_at.into_iter().zip(keys).zip(answers) {
            if answer == ItemResult::Err(ItemError::NoLease) {
                if let Some(pool) = &self.space {
                    pool.forget(lease);
                }
            }
            outcomes.push((
                index,
                answer
                    .into_result()
                    .map_err(|error| KvError::Item { key, error }),
            ));
        }
        Ok(outcomes)
    }

    /// One attempt at `items` through `put_start`, writes and `put_end`.
    async fn put_reserving(
        &self,
        items: &[(&str, &[&[u8]])],
        options: &PutOptions,
    ) -> Result<Vec<Result<(), KvError>>, KvError> {
        if items.is_empty() {
            return Ok(Vec::new());
        }
        let ids: Vec<PutId> = items.iter().map(|_| new_put_id()).collect();
        let avoid = self.unreachable.current();
        let starts = items
            .iter()
            .zip(&ids)
            .map(|((key, parts), &put_id)| PutStartItem {
                key: (*key).to_owned(),
                size: parts.iter().map(|part| part.len() as u64).sum(),
                replicas: options.replicas,
                preferred_segment: options.preferred_segment.clone(),
                hard_pin: options.hard_pin,
                put_id,
                avoid_nodes: avoid.clone(),
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
        for (((key, parts), result), &put_id) in items.iter().zip(&written).zip(&ids) {
            match result {
                Ok(()) => ends.push(PutEndItem {
                    key: (*key).to_owned(),
                    checksum: value_checksum_parts(parts),
                    put_id,
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
                // Commits carrying ids are sent again until they are answered, so
                // this is a sub-master unreachable past the retry deadline: the
                // commit may or may not have happened. Remove, so that a put that
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
        let put_id = new_put_id();
        let start = PutStartItem {
            key: key.to_owned(),
            size,
            replicas,
            preferred_segment: None,
            hard_pin: false,
            put_id,
            avoid_nodes: self.unreachable.current(),
        };
        let mut placed = self.metadata.put_start(vec![start]).await?;
        match placed.pop() {
            Some(ItemResult::Ok(replicas)) => Ok(PendingPut {
                key: key.to_owned(),
                size,
                replicas,
                put_id,
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
    /// the value's checksum). A failed write revokes the put and puts the value
    /// again on other nodes; a reservation lost before the commit (a leader
    /// change) is put again; a put_end whose outcome stays unknown removes the
    /// key, as [`KvClient::put`] does.
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
            let (key, replicas) = (pending.key.clone(), pending.replicas.len() as u32);
            self.abandon(pending).await;
            tracing::info!(key = %key, %error, "a replica write failed: putting on other nodes");
            let options = PutOptions::replicas(replicas);
            let mut results = self
                .put_scattered(&[(key.as_str(), &[value])], &options)
                .await?;
            return match results.pop() {
                // Refused (no room off the failed node, or the abandoned
                // reservation still holding the key): the write failure is the
                // answer, as in `put_scattered`.
                Some(Err(KvError::Item { .. })) => Err(error),
                other => other.unwrap_or(Ok(())),
            };
        }
        let end = PutEndItem {
            key: pending.key.clone(),
            checksum: value_checksum(value),
            put_id: pending.put_id,
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
            Some(ItemResult::Err(ItemError::NoPendingPut)) => {
                // The reservation vanished before its commit (a leader change
                // clears reservations) and the value is in hand: put it again,
                // as `put` does, rather than fail a put the caller made once.
                tracing::info!(key = %pending.key, "reservation lost before its commit: putting again");
                let options = PutOptions::replicas(pending.replicas.len() as u32);
                let mut results = self
                    .put_scattered(&[(pending.key.as_str(), &[value])], &options)
                    .await?;
                results.pop().unwrap_or(Ok(()))
            }
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
            let grant = WireGrant::of(replica);
            let mut offset = replica.offset;
            let ops: Vec<WriteOp<'_>> = parts
                .iter()
                .filter(|part| !part.is_empty())
                .map(|part| {
                    let op = WriteOp {
                        region: replica.segment.as_str(),
                        offset,
                        data: part,
                        grant: grant.as_slice(),
                    };
                    offset += part.len() as u64;
                    op
                })
                .collect();
            if ops.is_empty() {
                return Ok(());
            }
            let route = self.transports.route(replica);
            let written = route.transport.write_batch(route.endpoint, &ops).await;
            if written.is_err() {
                self.unreachable.note(&replica.node);
            }
            written
        });
        for result in join_all(writes).await {
            result.map_err(|source| KvError::Write {
                key: key.to_owned(),
                source,
            })?;
        }
        Ok(())
    }
}
