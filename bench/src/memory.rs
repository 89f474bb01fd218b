//! The `memory` workload: bytes per object in a sub-master's state, counted by the
//! binary's byte-counting allocator while a state of 1 M objects (two replicas
//! each, block-shaped keys) is folded from events, against the design target of
//! 200 B; and the process RSS growth per object against that count (the
//! difference is the system allocator's own overhead); and the snapshot of that
//! state: its size, and encode/decode rates against the fold of the same events
//! (in-process, no I/O: the CPU part of a restore). Bytes per key in the global
//! index are reported by the `ingest` and `exist` workloads, not repeated here.

use hkvm_events::{KvEvent, NodeId, Placement, PutCommitted, SegmentId, SegmentMounted};
use std::time::Instant;

use hkvm_submaster::snapshot;
use hkvm_submaster::state::State;

use super::alloc::bytes_in_use;
use super::cluster::key;
use super::report::{BenchResult, Printer};

const WORKLOAD: &str = "memory";
/// The design target for one object in a sub-master (DESIGN.md §9).
const TARGET_BYTES_PER_OBJECT: f64 = 200.0;
/// Segments the objects are spread over (two replicas on distinct segments).
const SEGMENTS: usize = 16;
/// Value size of every object.
const OBJECT_SIZE: u64 = 256 * 1024;

/// Resident set size of this process in bytes, from `/proc/self/status`.
pub fn rss_bytes(pid: Option<u32>) -> Option<u64> {
    let path = match pid {
        Some(pid) => format!("/proc/{pid}/status"),
        None => "/proc/self/status".to_owned(),
    };
    let status = std::fs::read_to_string(path).ok()?;
    let line = status.lines().find(|line| line.starts_with("VmRSS:"))?;
    let kib: u64 = line.split_whitespace().nth(1)?.parse().ok()?;
    Some(kib * 1024)
}

/// Folds `objects` puts into a fresh state.
fn build_state(objects: usize) -> anyhow::Result<State> {
    let mut state = State::new();
    let segments: Vec<SegmentId> = (0..SEGMENTS)
        .map(|s| SegmentId::new(format!("node-{s:02}-seg-0")))
        .collect::<Result<_, _>>()?;
    for (s, segment) in segments.iter().enumerate() {
        state.apply(&KvEvent::SegmentMounted(SegmentMounted {
            node: NodeId::new(format!("node-{s:02}"))?,
            segment: segment.clone(),
            size: 1 << 42,
            endpoint: format!("10.0.0.{s}:7000"),
            rdma: None,
        }));
    }
    for i in 0..objects {
        let first = i % SEGMENTS;
        // Each segment fills from the start: this is its n-th object.
        let offset = (i / SEGMENTS) as u64 * OBJECT_SIZE;
        let placements = [first, (first + 1) % SEGMENTS]
            .into_iter()
            .map(|s| Placement {
                segment: segments[s].clone(),
                offset: offset * 2 + if s == first { 0 } else { OBJECT_SIZE },
            })
            .collect();
        state.apply(&KvEvent::PutCommitted(PutCommitted::new(
            key(i),
            OBJECT_SIZE,
            i as u64,
            placements,
        )));
    }
    anyhow::ensure!(
        state.object_count() == objects && state.anomalies == Default::default(),
        "the state did not take every object ({} of {objects}, {:?})",
        state.object_count(),
        state.anomalies
    );
    Ok(state)
}

/// Runs the workload.
///
/// # Errors
/// When the state rejects an object (which would be a bug).
pub fn run(quick: bool, printer: &mut Printer) -> anyhow::Result<()> {
    let objects = if quick { 100_000 } else { 1_000_000 };
    eprintln!("bench memory: folding {objects} objects into a sub-master state");
    let (heap_before, rss_before) = (bytes_in_use(), rss_bytes(None).unwrap_or(0));
    let started = Instant::now();
    let state = build_state(objects)?;
    let fold_rate = objects as f64 / started.elapsed().as_secs_f64();
    let heap = bytes_in_use().wrapping_sub(heap_before) as f64 / objects as f64;
    let rss = rss_bytes(None).unwrap_or(0).saturating_sub(rss_before) as f64 / objects as f64;
    let key_bytes = key(0).len() as f64;
    let started = Instant::now();
    let bytes = snapshot::encode(&state)?;
    let encode_rate = objects as f64 / started.elapsed().as_secs_f64();
    drop(state);
    let started = Instant::now();
    let restored = snapshot::decode(&bytes)?;
    let decode_rate = objects as f64 / started.elapsed().as_secs_f64();
    anyhow::ensure!(
        restored.object_count() == objects,
        "the snapshot lost objects"
    );
    drop(restored);
    for result in [
        BenchResult::new(
            WORKLOAD,
            format!("sub-master heap bytes per object ({objects} objects)"),
            heap,
            "bytes",
            "design target",
            TARGET_BYTES_PER_OBJECT,
        ),
        BenchResult::new(
            WORKLOAD,
            "sub-master RSS growth per object",
            rss,
            "bytes",
            "heap bytes per object (allocator count)",
            heap,
        ),
        BenchResult::new(
            WORKLOAD,
            "sub-master heap bytes per object",
            heap,
            "bytes",
            "key bytes alone",
            key_bytes,
        ),
        BenchResult::new(
            WORKLOAD,
            "snapshot bytes per object",
            bytes.len() as f64 / objects as f64,
            "bytes",
            "heap bytes per object",
            heap,
        ),
        BenchResult::new(
            WORKLOAD,
            "snapshot encode, in-process",
            encode_rate,
            "objects/s",
            "building and folding the same puts",
            fold_rate,
        ),
        BenchResult::new(
            WORKLOAD,
            "snapshot decode (restore), in-process",
            decode_rate,
            "objects/s",
            "building and folding the same puts",
            fold_rate,
        ),
    ] {
        printer.print(&result);
    }
    Ok(())
}
