//! The sub-master's side of snapshots: its [`State`] to and from the snapshot
//! format of [`hkvm_events::snapshot`] (kept by [`hkvm_log::SnapshotStore`]). A restore
//! builds the state while the snapshot is decoded ([`Restorer`]): segments through
//! [`State::apply`], objects in bulk; the result equals the fold of the same events.

use hkvm_events::snapshot::{
    encode_from, ObjectRecord, ObjectView, SegmentRecord, SnapshotFile, SnapshotHeader,
    SnapshotSource,
};
use hkvm_log::pace::CpuShare;
use hkvm_log::SnapshotStore;
use std::cell::RefCell;
use std::collections::HashMap;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;

use crate::error::{SubmasterError, SubmasterErrorKind};
use crate::state::{Object, Slot, State};

mod restorer;
mod writer;

pub use restorer::Restorer;
pub(crate) use writer::store_bytes_verify;
pub use writer::{encode_at_low_priority, on_writer_thread, store_verified, WRITER_NICE};

/// The snapshot of the durable part of `state`, objects oldest first, as records
/// of its own (a copy that outlives `state`).
pub fn to_file(state: &State) -> SnapshotFile {
    let never = AtomicBool::new(false);
    let source = StateSource::new(state, CpuShare::unlimited(), &never)
        .expect("an encoding that is never abandoned completes");
    let mut file = SnapshotFile::new(state.applied_seq, state.max_epoch);
    file.segments = source.header.segments.clone();
    file.objects.reserve_exact(source.ordered.len());
    source.each(|key, object, replicas| {
        file.objects.push(ObjectRecord {
            key: Arc::clone(key),
            size: object.size,
            checksum: object.checksum,
            replicas: replicas.to_vec(),
            flags: object.flags.0,
            put_id: object.put_id,
        });
        true
    });
    file
}

/// Encodes the durable part of `state` as snapshot bytes covering
/// `state.applied_seq`, straight from the state: no records in between.
///
/// # Errors
/// Only if serialization fails.
pub fn encode(state: &State) -> Result<Vec<u8>, SubmasterError> {
    encode_paced(state, CpuShare::unlimited(), &AtomicBool::new(false))
}

/// As [`encode`], at the pace of `pace` (it rests between slices of work:
/// ordering the objects and encoding each), stopping early once `abandon` is
/// set.
///
/// # Errors
/// [`SubmasterErrorKind::Snapshot`] when abandoned, or if serialization fails.
pub fn encode_paced(
    state: &State,
    pace: CpuShare,
    abandon: &AtomicBool,
) -> Result<Vec<u8>, SubmasterError> {
    let abandoned = || SubmasterError::new(SubmasterErrorKind::Snapshot, "snapshot abandoned");
    let source = StateSource::new(state, pace, abandon).ok_or_else(abandoned)?;
    let encoded = encode_from(&source.header, &source);
    if abandon.load(Ordering::Relaxed) {
        return Err(abandoned());
    }
    Ok(encoded?)
}

/// A state as a snapshot's source: its segments numbered in slot order, and
/// small references to its objects sorted oldest first (sorting the objects
/// themselves moved fat values; keys are shared, never copied). Work is
/// counted on `pace` as it goes.
struct StateSource<'a> {
    header: SnapshotHeader,
    /// Each slot's index among the header's segments.
    index_of: HashMap<Slot, u32>,
    ordered: Vec<Ordered<'a>>,
    /// Total key bytes, for the encoder's buffer size.
    key_bytes: usize,
    pace: RefCell<CpuShare>,
    /// Stops the encoding early once set.
    abandon: &'a AtomicBool,
}

/// An object with its order and key, as a snapshot lists it.
type Ordered<'a> = (u64, &'a Arc<str>, &'a Object);

/// Objects per bucket of [`oldest_first`]'s sort, on average: each bucket is
/// sorted in tens of microseconds, between which the pace may rest.
const OBJECTS_PER_BUCKET: usize = 1024;

/// The objects of `state`, oldest first (by their order), and their key
/// bytes: a counting sort into about one bucket per [`OBJECTS_PER_BUCKET`]
/// objects by order (two passes over the table: the range of orders, then the
/// counts), the objects placed by bucket in a third, then each bucket sorted on
/// its own. Every step is small enough for `pace` to rest between, where one
/// sort of millions ran for seconds without a break; the result is the same.
/// `None` once `abandon` is set (looked at between steps).
fn oldest_first<'a>(
    state: &'a State,
    pace: &mut CpuShare,
    abandon: &AtomicBool,
) -> Option<(Vec<Ordered<'a>>, usize)> {
    let go_on = || (!abandon.load(Ordering::Relaxed)).then_some(());
    let (mut low, mut high, mut key_bytes, mut count) = (u64::MAX, 0, 0, 0usize);
    for (key, object) in state.objects_shared() {
        (low, high) = (low.min(object.order), high.max(object.order));
        key_bytes += key.len();
        count += 1;
        pace.tick();
    }
    go_on()?;
    let Some((first_key, first_object)) = state.objects_shared().next() else {
        return Some((Vec::new(), 0));
    };
    let buckets = (count / OBJECTS_PER_BUCKET).max(1);
    let span = u128::from(high - low) + 1;
    let bucket = |order: u64| (u128::from(order - low) * buckets as u128 / span) as usize;
    let mut next = vec![0usize; buckets + 1];
    for (_, object) in state.objects_shared() {
        next[bucket(object.order) + 1] += 1;
        pace.tick();
    }
    go_on()?;
    for at in 1..next.len() {
        next[at] += next[at - 1];
    }
    let starts = next.clone();
    let mut ordered = vec![(0, first_key, first_object); count];
    for (key, object) in state.objects_shared() {
        let place = &mut next[bucket(object.order)];
        ordered[*place] = (object.order, key, object);
        *place += 1;
        pace.tick();
    }
    for range in starts.windows(2) {
        go_on()?;
        let objects = &mut ordered[range[0]..range[1]];
        objects.sort_unstable_by_key(|(order, _, _)| *order);
        pace.ticks(u32::try_from(objects.len()).unwrap_or(u32::MAX));
    }
    Some((ordered, key_bytes))
}

impl<'a> StateSource<'a> {
    /// `None` when abandoned while ordering the objects.
    fn new(state: &'a State, mut pace: CpuShare, abandon: &'a AtomicBool) -> Option<Self> {
        let mut index_of = HashMap::new();
        let mut segments = Vec::new();
        for (slot, segment) in state.segments() {
            index_of.insert(slot, segments.len() as u32);
            segments.push(SegmentRecord {
                node: segment.node.clone(),
                segment: segment.id.clone(),
                size: segment.allocator.size(),
                endpoint: segment.endpoint.clone(),
                rdma: segment.rdma.clone(),
            });
        }
        let (ordered, key_bytes) = oldest_first(state, &mut pace, abandon)?;
        Some(Self {
            header: SnapshotHeader {
                version: hkvm_events::snapshot::SNAPSHOT_VERSION,
                covers_seq: state.applied_seq,
                max_epoch: state.max_epoch,
                segments,
            },
            index_of,
            ordered,
            key_bytes,
            pace: RefCell::new(pace),
            abandon,
        })
    }

    /// Hands `each` every object oldest first, with its replicas as (segment
    /// index, offset), until it returns `false`.
    fn each(&self, mut each: impl FnMut(&'a Arc<str>, &'a Object, &[(u32, u64)]) -> bool) {
        let mut replicas = Vec::new();
        for (_, key, object) in &self.ordered {
            replicas.clear();
            replicas.extend(
                object
                    .replicas
                    .iter()
                    .filter_map(|r| Some((*self.index_of.get(&r.slot)?, r.offset))),
            );
            if !each(key, object, &replicas) {
                return;
            }
        }
    }
}

impl SnapshotSource for StateSource<'_> {
    fn object_count(&self) -> usize {
        self.ordered.len()
    }

    fn encoded_len_hint(&self) -> usize {
        // Per object: its five field names and values, about 40 bytes, and 12
        // per replica; two replicas counted.
        self.key_bytes + self.ordered.len() * (48 + 2 * 12)
    }

    fn for_each_object(&self, each: &mut dyn FnMut(ObjectView<'_>) -> bool) {
        let mut pace = self.pace.borrow_mut();
        self.each(|key, object, replicas| {
            pace.tick();
            if self.abandon.load(Ordering::Relaxed) {
                return false;
            }
            each(ObjectView {
                key,
                size: object.size,
                checksum: object.checksum,
                replicas,
                flags: object.flags.0,
                put_id: object.put_id,
            })
        });
    }
}
/// Decodes and verifies snapshot bytes into a state.
///
/// # Errors
/// A checksum mismatch, an unknown version, or a malformed body.
pub fn decode(bytes: &[u8]) -> Result<State, SubmasterError> {
    let mut restorer = Restorer::default();
    let header = SnapshotFile::decode_with(bytes, &mut restorer)?;
    Ok(restorer.finish(&header))
}

/// Stores a snapshot of `state`; returns the object name and its checksum.
///
/// # Errors
/// When encoding or the object store fails.
pub async fn save(store: &SnapshotStore, state: &State) -> Result<(String, u64), SubmasterError> {
    Ok(store
        .save_encoded(state.applied_seq, encode(state)?)
        .await?)
}

/// Loads the newest snapshot that verifies, as a state; `None` when there is none.
///
/// # Errors
/// When the object store cannot be listed.
pub async fn load_newest(store: &SnapshotStore) -> Result<Option<State>, SubmasterError> {
    let Some((name, header, restorer)) = store.load_newest_with(Restorer::default).await? else {
        return Ok(None);
    };
    let started = std::time::Instant::now();
    // Building the allocators sorts every replica's range: not on a runtime worker.
    let state = tokio::task::spawn_blocking(move || restorer.finish(&header))
        .await
        .map_err(|e| {
            SubmasterError::caused(SubmasterErrorKind::Snapshot, "restoring a snapshot", e)
        })?;
    tracing::info!(
        name,
        objects = state.object_count(),
        finish_ms = started.elapsed().as_millis() as u64,
        "state rebuilt from the snapshot"
    );
    Ok(Some(state))
}

#[cfg(test)]
mod tests {
    use hkvm_events::{
        KvEvent, NodeId, Placement, PutCommitted, Removed, SegmentId, SegmentMounted,
        SegmentUnmounted,
    };
    use proptest::prelude::*;

    use super::*;

    /// One step of a generated history, as a leader would write it: puts never
    /// overlap (each takes fresh space), removes and unmounts come anywhere.
    #[derive(Debug, Clone)]
    enum Step {
        Put { key: u8, size: u16, replicas: u8 },
        Remove { key: u8 },
        Unmount { segment: u8 },
    }

    fn step() -> impl Strategy<Value = Step> {
        prop_oneof![
            6 => (0u8..40, 1u16..8192, 1u8..4).prop_map(|(key, size, replicas)| Step::Put { key, size, replicas }),
            2 => (0u8..40).prop_map(|key| Step::Remove { key }),
            1 => (0u8..3).prop_map(|segment| Step::Unmount { segment }),
        ]
    }

    fn events(steps: &[Step]) -> Vec<KvEvent> {
        let segment = |i: u8| SegmentId::new(format!("seg-{i}")).unwrap();
        let mut events: Vec<KvEvent> = (0..3u8)
            .map(|i| {
                KvEvent::SegmentMounted(SegmentMounted {
                    node: NodeId::new(format!("n{i}")).unwrap(),
                    segment: segment(i),
                    size: 1 << 30,
                    endpoint: format!("127.0.0.1:{}", 7000 + u16::from(i)),
                    // Segment 1's node serves RDMA too: its descriptor must
                    // survive the snapshot.
                    rdma: (i == 1).then(|| hkvm_events::RdmaEndpoint {
                        device: "mlx5_0".into(),
                        gid: [i; 16],
                        lid: 3,
                        exchange: "127.0.0.1:7101".into(),
                        rkey: 0x51,
                        addr: 0x7f00_0000_0000,
                        len: 1 << 30,
                    }),
                })
            })
            .collect();
        for (n, step) in steps.iter().enumerate() {
            events.push(match step {
                Step::Put {
                    key,
                    size,
                    replicas,
                } => {
                    let placements = (0..*replicas)
                        .map(|r| Placement {
                            segment: segment(r),
                            offset: n as u64 * 8192,
                        })
                        .collect();
                    let mut put = PutCommitted::new(
                        format!("k{key}"),
                        u64::from(*size),
                        n as u64,
                        placements,
                    );
                    put.put_id = n as u64 + 1;
                    KvEvent::PutCommitted(put)
                }
                Step::Remove { key } => KvEvent::Removed(Removed {
                    keys: vec![format!("k{key}")],
                }),
                Step::Unmount { segment: i } => KvEvent::SegmentUnmounted(SegmentUnmounted {
                    node: NodeId::new(format!("n{i}")).unwrap(),
                    segment: segment(*i),
                }),
            });
        }
        events
    }

    /// The keys from the oldest commit to the newest.
    fn oldest_first(state: &State) -> Vec<String> {
        let mut keys: Vec<(u64, String)> = state
            .objects()
            .map(|(key, object)| (object.order, key.to_owned()))
            .collect();
        keys.sort_unstable();
        keys.into_iter().map(|(_, key)| key).collect()
    }

    proptest! {
        /// Folding every event equals restoring a snapshot of a prefix and
        /// folding the rest: the bulk restore is the same fold, whether the
        /// objects are inserted in line or by the inserting thread in batches
        /// of any size.
        #[test]
        fn a_snapshot_plus_the_tail_equals_the_whole_fold(
            steps in proptest::collection::vec(step(), 0..120),
            cut in 0usize..130,
            batch in prop_oneof![1usize..9, Just(usize::MAX)],
        ) {
            let events = events(&steps);
            let cut = cut.min(events.len());
            let mut whole = State::new();
            for (seq, event) in events.iter().enumerate() {
                whole.apply_message(seq as u64 + 1, 1, [event]);
            }
            let mut prefix = State::new();
            for (seq, event) in events[..cut].iter().enumerate() {
                prefix.apply_message(seq as u64 + 1, 1, [event]);
            }
            let bytes = encode(&prefix).unwrap();
            // Straight from the state or through a copy: the same bytes.
            prop_assert_eq!(&bytes, &to_file(&prefix).encode().unwrap());
            let mut restorer = Restorer::with_batch(batch);
            let header = SnapshotFile::decode_with(&bytes, &mut restorer).unwrap();
            let mut restored = restorer.finish(&header);
            prop_assert!(restored.same_durable_state(&prefix));
            prop_assert_eq!(oldest_first(&restored), oldest_first(&prefix));
            for (seq, event) in events.iter().enumerate().skip(cut) {
                restored.apply_message(seq as u64 + 1, 1, [event]);
            }
            prop_assert!(restored.same_durable_state(&whole));
            // Eviction goes oldest first: the commit order survives the restore.
            prop_assert_eq!(oldest_first(&restored), oldest_first(&whole));
        }
    }

    /// Thousands of objects (several buckets of the ordering sort), with
    /// removes leaving gaps and puts again taking late orders: a paced
    /// encoding is the unpaced one, and both list the objects oldest first.
    #[test]
    fn a_paced_encoding_lists_many_objects_oldest_first() {
        let mut events = events(&[]);
        let put = |name: String, n: u64| {
            let placement = Placement {
                segment: SegmentId::new("seg-0").unwrap(),
                offset: n * 4096,
            };
            KvEvent::PutCommitted(PutCommitted::new(name, 64, n, vec![placement]))
        };
        let mut n = 0;
        for i in 0..6_000u64 {
            n += 1;
            events.push(put(format!("obj-{i}"), n));
        }
        events.push(KvEvent::Removed(Removed {
            keys: (0..6_000).step_by(5).map(|i| format!("obj-{i}")).collect(),
        }));
        for i in (0..6_000u64).step_by(3) {
            n += 1;
            events.push(put(format!("obj-{i}"), n));
        }
        let mut state = State::new();
        for (seq, event) in events.iter().enumerate() {
            state.apply_message(seq as u64 + 1, 1, [event]);
        }
        assert!(
            state.object_count() > 4 * OBJECTS_PER_BUCKET,
            "{}",
            state.object_count()
        );
        let bytes = encode(&state).unwrap();
        let never = AtomicBool::new(false);
        assert_eq!(
            encode_paced(&state, CpuShare::new(0.2), &never).unwrap(),
            bytes
        );
        let listed: Vec<String> = SnapshotFile::decode(&bytes)
            .unwrap()
            .objects
            .iter()
            .map(|object| object.key.to_string())
            .collect();
        assert_eq!(listed, oldest_first(&state));
        // The late puts come last, in their order.
        assert_eq!(listed.last().map(String::as_str), Some("obj-5997"));
        // Abandoned before or during: an error, never a shorter snapshot.
        let abandoned = AtomicBool::new(true);
        let error = encode_paced(&state, CpuShare::unlimited(), &abandoned).unwrap_err();
        assert_eq!(error.kind(), SubmasterErrorKind::Snapshot);
        let abandon = AtomicBool::new(false);
        std::thread::scope(|scope| {
            let encoding = scope.spawn(|| encode_paced(&state, CpuShare::new(0.01), &abandon));
            std::thread::sleep(std::time::Duration::from_millis(20));
            abandon.store(true, Ordering::Relaxed);
            let started = std::time::Instant::now();
            assert!(encoding.join().unwrap().is_err());
            // At 1% of a core a whole encoding takes seconds; it stops at
            // its next look at the flag.
            assert!(started.elapsed() < std::time::Duration::from_secs(2));
        });
    }
}
