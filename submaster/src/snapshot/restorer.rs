//! Restoring a state while its snapshot is decoded: the decoding thread turns
//! each record into an object, hashes its key, records the ranges its replicas
//! use ([`UsedRanges`]) and hands batches of objects to an inserting thread, which
//! builds the object table ([`BulkRestore`]), each batch in the order of its
//! keys' home buckets. In commit order every insert
//! lands somewhere else in a table larger than any cache or TLB reach; in
//! home-bucket order a batch sweeps the table once. On two cores the restore
//! takes the longer of the two halves instead of their sum; at the end the
//! decoding thread builds each segment's allocator while the inserting thread
//! finishes. Without a second thread the objects are inserted in line.

use std::hash::BuildHasher as _;
use std::sync::mpsc::{self, Receiver, Sender, SyncSender};
use std::sync::Arc;
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use hkvm_events::snapshot::{ObjectView, SnapshotHeader, SnapshotVisitor};
use hkvm_events::{KvEvent, PutFlags, SegmentMounted};

use crate::keyhash::KeyHashBuilder;
use crate::state::{
    BulkRestore, Decoded, Object, Replica, Replicas, Slot, State, UsedRanges, MAX_BATCH,
};

/// Objects per batch handed to the inserting thread. A batch is inserted in
/// the order of its keys' home buckets: the larger it is, the
/// closer its inserts land to each other (at 10 M objects, a batch of 2^18 puts
/// consecutive inserts about 64 buckets, under 7 KB, apart). About 30 MB each.
const BATCH: usize = 1 << 18;
/// Objects admitted before the range lists are sized for the whole snapshot
/// ([`UsedRanges::reserve_like_so_far`]): enough to see how replicas spread
/// over the segments.
const RESERVE_AFTER: u64 = 1 << 16;
/// Batches decoded ahead of the inserting thread (bounds the memory in flight).
const BATCHES_AHEAD: usize = 2;

/// Decoded objects, each taken (left `None`) as it is inserted.
type Batch = Vec<Option<Decoded>>;

/// Builds a state while a snapshot is decoded ([`SnapshotVisitor`]): the
/// segments through [`State::apply`] when the header arrives, then the objects
/// in bulk ([`BulkRestore`]) as they are decoded, with no list of records in
/// between. [`Restorer::finish`] returns the state.
#[derive(Debug)]
pub struct Restorer {
    /// Segment index in the snapshot -> slot (a name listed twice shares one).
    slots: Vec<Slot>,
    /// The ranges of the objects decoded so far (none before the header).
    ranges: Option<UsedRanges>,
    /// The commit order of the next object: its place in the snapshot.
    next_order: u64,
    batch_size: usize,
    batch: Batch,
    sink: Sink,
    /// How long the decoding thread waited for the inserting thread.
    waited: Duration,
    /// How many objects the snapshot announced (a hint).
    announced: usize,
    /// The object table's hasher: keys are hashed here, on the decoding thread.
    hasher: KeyHashBuilder,
}

/// Where decoded objects go.
#[derive(Debug, Default)]
enum Sink {
    /// Before the header.
    #[default]
    Idle,
    /// Inserted in line (no second thread).
    Inline(Box<BulkRestore>),
    /// Handed to the inserting thread.
    Thread(Inserter),
}

/// The inserting thread and its channels.
#[derive(Debug)]
struct Inserter {
    batches: SyncSender<Batch>,
    /// Emptied batches coming back, so their memory is reused.
    emptied: Receiver<Batch>,
    thread: JoinHandle<BulkRestore>,
}

impl Default for Restorer {
    fn default() -> Self {
        Self::with_batch(BATCH)
    }
}

impl Restorer {
    /// A restorer handing objects over `batch_size` at a time.
    pub(super) fn with_batch(batch_size: usize) -> Self {
        Self {
            slots: Vec::new(),
            ranges: None,
            next_order: 0,
            batch_size: batch_size.clamp(1, MAX_BATCH),
            batch: Vec::new(),
            sink: Sink::Idle,
            waited: Duration::ZERO,
            announced: 0,
            hasher: KeyHashBuilder::default(),
        }
    }

    /// The restored state, stamped with what the snapshot covers. The
    /// allocators are built here while the inserting thread finishes its last
    /// batches.
    pub fn finish(mut self, header: &SnapshotHeader) -> State {
        self.flush();
        let (inline, inserting) = match std::mem::take(&mut self.sink) {
            Sink::Idle => (None, None),
            Sink::Inline(restore) => (Some(*restore), None),
            // Closing the channel lets the thread end after the last batch.
            Sink::Thread(Inserter {
                batches, thread, ..
            }) => {
                drop(batches);
                (None, Some(thread))
            }
        };
        let started = Instant::now();
        let allocators = self.ranges.take().map(UsedRanges::into_allocators);
        let allocators_ms = started.elapsed().as_millis() as u64;
        let restore = match inserting {
            None => inline,
            Some(thread) => match thread.join() {
                Ok(restore) => Some(restore),
                // A bug in the fold: the same failure as had it run in line.
                Err(panic) => std::panic::resume_unwind(panic),
            },
        };
        let mut state = match (restore, allocators) {
            (Some(restore), Some(allocators)) => restore.finish(allocators),
            _ => State::new(),
        };
        tracing::debug!(
            waited_for_inserts_ms = self.waited.as_millis() as u64,
            allocators_ms,
            "snapshot objects handed over"
        );
        state.applied_seq = header.covers_seq;
        state.max_epoch = header.max_epoch;
        state
    }

    /// Hands the current batch to the sink (which inserts it in the order of
    /// its keys' home buckets).
    fn flush(&mut self) {
        if self.batch.is_empty() {
            return;
        }
        match &mut self.sink {
            Sink::Idle => self.batch.clear(),
            Sink::Inline(restore) => restore.insert_batch(&mut self.batch),
            Sink::Thread(inserter) => {
                let next = inserter
                    .emptied
                    .try_recv()
                    .unwrap_or_else(|_| Vec::with_capacity(self.batch_size));
                let full = std::mem::replace(&mut self.batch, next);
                let started = Instant::now();
                // A send fails only when the thread ended, which `finish` reports.
                let _ = inserter.batches.send(full);
                self.waited += started.elapsed();
            }
        }
    }
}

/// Spawns the inserting thread over `restore`; `None` when no thread can be
/// started (the objects are then inserted in line).
fn spawn_inserter(restore: Box<BulkRestore>) -> Result<Inserter, Box<BulkRestore>> {
    let (batches, incoming) = mpsc::sync_channel::<Batch>(BATCHES_AHEAD);
    let (give_back, emptied) = mpsc::channel::<Batch>();
    // The restore moves into the thread only once it has started.
    let (start, started) = mpsc::channel::<Box<BulkRestore>>();
    let spawned = std::thread::Builder::new()
        .name("hkvm-restore".into())
        .spawn(move || insert_all(&started, &incoming, &give_back));
    match spawned {
        Ok(thread) => {
            if let Err(mpsc::SendError(restore)) = start.send(restore) {
                return Err(restore);
            }
            Ok(Inserter {
                batches,
                emptied,
                thread,
            })
        }
        Err(error) => {
            tracing::warn!(%error, "no thread for the restore; inserting in line");
            Err(restore)
        }
    }
}

/// The inserting thread: every batch into the restore, which it returns.
fn insert_all(
    started: &Receiver<Box<BulkRestore>>,
    incoming: &Receiver<Batch>,
    give_back: &Sender<Batch>,
) -> BulkRestore {
    let Ok(mut restore) = started.recv() else {
        return BulkRestore::new(State::new(), 0);
    };
    for mut batch in incoming {
        restore.insert_batch(&mut batch);
        let _ = give_back.send(batch);
    }
    *restore
}

impl SnapshotVisitor for Restorer {
    fn header(&mut self, header: &SnapshotHeader, objects: usize) {
        let mut state = State::new();
        for segment in &header.segments {
            state.apply(&KvEvent::SegmentMounted(SegmentMounted {
                node: segment.node.clone(),
                segment: segment.segment.clone(),
                size: segment.size,
                endpoint: segment.endpoint.clone(),
                rdma: segment.rdma.clone(),
            }));
        }
        self.slots = header
            .segments
            .iter()
            .map(|segment| state.slot_of(&segment.segment).unwrap_or(Slot::MAX))
            .collect();
        self.ranges = Some(UsedRanges::new(&state));
        self.announced = objects;
        let restore = Box::new(BulkRestore::new(state, objects));
        self.hasher = restore.hasher();
        self.batch = Vec::with_capacity(self.batch_size.min(objects.max(1)));
        // A small snapshot is not worth a thread.
        self.sink = if objects <= self.batch_size {
            Sink::Inline(restore)
        } else {
            match spawn_inserter(restore) {
                Ok(inserter) => Sink::Thread(inserter),
                Err(restore) => Sink::Inline(restore),
            }
        };
    }

    fn object(&mut self, object: ObjectView<'_>) {
        let slots = &self.slots;
        let replicas: Replicas = object
            .replicas
            .iter()
            .map(|&(index, offset)| Replica {
                slot: slots.get(index as usize).copied().unwrap_or(Slot::MAX),
                offset,
            })
            .collect();
        let mut restored = Object {
            size: object.size,
            checksum: object.checksum,
            replicas,
            flags: PutFlags(object.flags),
            order: self.next_order,
            lease_until_ms: 0,
            put_id: object.put_id,
        };
        let Some(ranges) = &mut self.ranges else {
            return;
        };
        if !ranges.admit(&mut restored) {
            return;
        }
        self.next_order += 1;
        if self.next_order == RESERVE_AFTER {
            ranges.reserve_like_so_far(RESERVE_AFTER as usize, self.announced);
        }
        let key: Arc<str> = Arc::from(object.key);
        self.batch.push(Some(Decoded {
            hash: self.hasher.hash_one(&*key),
            key,
            object: restored,
        }));
        if self.batch.len() >= self.batch_size {
            self.flush();
        }
    }
}
