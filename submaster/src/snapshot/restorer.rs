//! Restoring a state while its snapshot is decoded: the decoding thread turns
//! each record into an object, records the ranges its replicas use
//! ([`UsedRanges`]) and hands batches of objects to an inserting thread, which
//! puts each batch in the order of its keys' home buckets ([`HomeOrder`]) and
//! builds the object table ([`BulkRestore`]). In commit order every insert
//! lands somewhere else in a table larger than any cache or TLB reach; in
//! home-bucket order a batch sweeps the table once. On two cores the restore
//! takes the longer of the two halves instead of their sum; at the end the
//! decoding thread builds each segment's allocator while the inserting thread
//! finishes. Without a second thread the objects are inserted in line.

use std::sync::mpsc::{self, Receiver, Sender, SyncSender};
use std::sync::Arc;
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use hkvm_events::snapshot::{ObjectView, SnapshotHeader, SnapshotVisitor};
use hkvm_events::{KvEvent, PutFlags, SegmentMounted};

use crate::state::{BulkRestore, HomeBuckets, Object, Replica, Replicas, Slot, State, UsedRanges};

/// Objects per batch handed to the inserting thread. A batch is inserted in
/// the order of its keys' home buckets ([`HomeBuckets`]): the larger it is, the
/// closer its inserts land to each other (at 10 M objects, a batch of 2^18 puts
/// consecutive inserts about 64 buckets, under 7 KB, apart). About 30 MB each.
const BATCH: usize = 1 << 18;
/// Batches decoded ahead of the inserting thread (bounds the memory in flight).
const BATCHES_AHEAD: usize = 2;
/// Bits of a batch position in an insertion sort key (below the home bucket).
const POSITION_BITS: u32 = 24;

type Batch = Vec<(Arc<str>, Object)>;

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
}

/// Where decoded objects go.
#[derive(Debug, Default)]
enum Sink {
    /// Before the header.
    #[default]
    Idle,
    /// Inserted in line (no second thread).
    Inline(Box<BulkRestore>, HomeOrder),
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
            batch_size: batch_size.clamp(1, 1 << POSITION_BITS),
            batch: Vec::new(),
            sink: Sink::Idle,
            waited: Duration::ZERO,
        }
    }

    /// The restored state, stamped with what the snapshot covers. The
    /// allocators are built here while the inserting thread finishes its last
    /// batches.
    pub fn finish(mut self, header: &SnapshotHeader) -> State {
        self.flush();
        let (inline, inserting) = match std::mem::take(&mut self.sink) {
            Sink::Idle => (None, None),
            Sink::Inline(restore, _) => (Some(*restore), None),
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
            Sink::Inline(restore, order) => {
                order.arrange(&mut self.batch);
                for (key, object) in self.batch.drain(..) {
                    restore.insert(key, object);
                }
            }
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

/// Puts batches in the order of their keys' home buckets in the table being
/// built; records of one key keep their order (the later, newer one wins).
#[derive(Debug)]
struct HomeOrder {
    homes: HomeBuckets,
    /// A batch's sort keys: home bucket, then position (kept to reuse memory).
    sort_keys: Vec<u64>,
    /// A batch while it is put in order (kept to reuse its memory).
    taken: Vec<Option<(Arc<str>, Object)>>,
}

impl HomeOrder {
    fn new(homes: HomeBuckets) -> Self {
        Self {
            homes,
            sort_keys: Vec::new(),
            taken: Vec::new(),
        }
    }

    /// Puts `batch` (at most 2^[`POSITION_BITS`] objects) in home-bucket order.
    fn arrange(&mut self, batch: &mut Batch) {
        let homes = self.homes;
        self.sort_keys.clear();
        self.sort_keys.extend(
            batch
                .iter()
                .enumerate()
                .map(|(position, (key, _))| homes.of(key) << POSITION_BITS | position as u64),
        );
        self.sort_keys.sort_unstable();
        let taken = &mut self.taken;
        taken.clear();
        taken.extend(batch.drain(..).map(Some));
        let position_mask = (1u64 << POSITION_BITS) - 1;
        batch.extend(
            self.sort_keys
                .iter()
                .filter_map(|sort_key| taken[(sort_key & position_mask) as usize].take()),
        );
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
    let mut order = HomeOrder::new(restore.homes());
    for mut batch in incoming {
        order.arrange(&mut batch);
        for (key, object) in batch.drain(..) {
            restore.insert(key, object);
        }
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
        let restore = Box::new(BulkRestore::new(state, objects));
        self.batch = Vec::with_capacity(self.batch_size.min(objects.max(1)));
        // A small snapshot is not worth a thread.
        let inline = |restore: Box<BulkRestore>| {
            let order = HomeOrder::new(restore.homes());
            Sink::Inline(restore, order)
        };
        self.sink = if objects <= self.batch_size {
            inline(restore)
        } else {
            match spawn_inserter(restore) {
                Ok(inserter) => Sink::Thread(inserter),
                Err(restore) => inline(restore),
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
        self.batch.push((Arc::from(object.key), restored));
        if self.batch.len() >= self.batch_size {
            self.flush();
        }
    }
}
