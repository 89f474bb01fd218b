//! Restoring a state while its snapshot is decoded: the decoding thread turns
//! each record into an object and hands batches of them to an inserting
//! thread, which builds the state ([`BulkRestore`]). The two halves (parsing
//! and allocating; hashing into a table larger than any cache) take about as
//! long each, so on two cores the restore takes the longer of them instead of
//! their sum. Without a second thread the objects are inserted in line.

use std::sync::mpsc::{self, Receiver, Sender, SyncSender};
use std::sync::Arc;
use std::thread::JoinHandle;

use hkvm_events::snapshot::{ObjectView, SnapshotHeader, SnapshotVisitor};
use hkvm_events::{KvEvent, PutFlags, SegmentMounted};

use crate::state::{BulkRestore, Object, Replica, Replicas, Slot, State};

/// Objects per batch handed to the inserting thread.
const BATCH: usize = 4096;
/// Batches decoded ahead of the inserting thread (bounds the memory in flight).
const BATCHES_AHEAD: usize = 4;

type Batch = Vec<(Arc<str>, Object)>;

/// Builds a state while a snapshot is decoded ([`SnapshotVisitor`]): the
/// segments through [`State::apply`] when the header arrives, then the objects
/// in bulk ([`BulkRestore`]) as they are decoded, with no list of records in
/// between. [`Restorer::finish`] returns the state.
#[derive(Debug)]
pub struct Restorer {
    /// Segment index in the snapshot -> slot (a name listed twice shares one).
    slots: Vec<Slot>,
    batch_size: usize,
    batch: Batch,
    sink: Sink,
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
    thread: JoinHandle<State>,
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
            batch_size: batch_size.max(1),
            batch: Vec::new(),
            sink: Sink::Idle,
        }
    }

    /// The restored state, stamped with what the snapshot covers.
    pub fn finish(mut self, header: &SnapshotHeader) -> State {
        self.flush();
        let mut state = match std::mem::take(&mut self.sink) {
            Sink::Idle => State::new(),
            Sink::Inline(restore) => restore.finish(),
            Sink::Thread(inserter) => {
                drop(inserter.batches);
                match inserter.thread.join() {
                    Ok(state) => state,
                    // A bug in the fold: the same failure as had it run in line.
                    Err(panic) => std::panic::resume_unwind(panic),
                }
            }
        };
        state.applied_seq = header.covers_seq;
        state.max_epoch = header.max_epoch;
        state
    }

    /// Hands the current batch to the sink.
    fn flush(&mut self) {
        if self.batch.is_empty() {
            return;
        }
        match &mut self.sink {
            Sink::Idle => self.batch.clear(),
            Sink::Inline(restore) => {
                for (key, object) in self.batch.drain(..) {
                    restore.push(key, object);
                }
            }
            Sink::Thread(inserter) => {
                let next = inserter
                    .emptied
                    .try_recv()
                    .unwrap_or_else(|_| Vec::with_capacity(self.batch_size));
                let full = std::mem::replace(&mut self.batch, next);
                // A send fails only when the thread ended, which `finish` reports.
                let _ = inserter.batches.send(full);
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

/// The inserting thread: every batch into the restore, then the state.
fn insert_all(
    started: &Receiver<Box<BulkRestore>>,
    incoming: &Receiver<Batch>,
    give_back: &Sender<Batch>,
) -> State {
    let Ok(mut restore) = started.recv() else {
        return State::new();
    };
    for mut batch in incoming {
        for (key, object) in batch.drain(..) {
            restore.push(key, object);
        }
        let _ = give_back.send(batch);
    }
    restore.finish()
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
        let restore = Box::new(BulkRestore::new(state, objects));
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
        self.batch.push((
            Arc::from(object.key),
            Object {
                size: object.size,
                checksum: object.checksum,
                replicas,
                flags: PutFlags(object.flags),
                order: 0,
                lease_until_ms: 0,
                put_id: object.put_id,
            },
        ));
        if self.batch.len() >= self.batch_size {
            self.flush();
        }
    }
}
