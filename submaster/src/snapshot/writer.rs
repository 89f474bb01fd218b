//! Writing a snapshot without taking the CPU from serving: encoding the state,
//! storing it and reading it back to verify it run on threads of
//! their own (the store on a runtime of its own), at a lower CPU priority than
//! the process's other threads. A large snapshot (a 10 M-object one is about 860 MB and
//! seconds of hashing and encoding) then slows down when the machine is busy
//! instead of slowing down the requests beside it.

use std::future::Future;
use std::sync::atomic::AtomicBool;

use hkvm_log::SnapshotStore;

use hkvm_log::pace::CpuShare;

use super::encode_paced;
use crate::error::SubmasterError;
use crate::state::State;
use crate::SubmasterErrorKind::Snapshot;

/// How much lower than the process's other threads the writer runs (a nice
/// increment: at 10 the scheduler gives it about a tenth of a contended core).
pub const WRITER_NICE: i32 = 10;

/// Stores the snapshot `bytes` (covering `covers_seq`) and reads them back to
/// verify them, on a low-priority thread ([`WRITER_NICE`]); returns the
/// object's name and checksum once it is safe to rely on.
///
/// # Errors
/// When the thread cannot be started, the object store fails, or the stored
/// object does not read back intact.
pub async fn store_verified(
    store: &SnapshotStore,
    bytes: Vec<u8>,
    covers_seq: u64,
) -> Result<(String, u64), SubmasterError> {
    let store = store.clone();
    on_writer_thread(move || async move { store_bytes_verify(&store, bytes, covers_seq).await })
        .await
}

/// Encodes the durable part of `state` ([`encode_paced`]: covering
/// `state.applied_seq`) on a thread at [`WRITER_NICE`] working at `cpu_share`
/// of a core ([`CpuShare`]), the caller waiting: a hot standby pauses its fold
/// for it either way, and its CPU then goes to whoever serves first. Without a
/// thread it runs on the caller's. It stops early once `abandon` is set (a
/// standby whose leader is gone has better things to do).
///
/// # Errors
/// When abandoned, or if serialization fails.
pub fn encode_at_low_priority(
    state: &State,
    cpu_share: f64,
    abandon: &AtomicBool,
) -> Result<Vec<u8>, SubmasterError> {
    std::thread::scope(|scope| {
        let encoded = std::thread::Builder::new()
            .name("hkvm-snapshot-encode".into())
            .spawn_scoped(scope, || {
                lower_priority();
                encode_paced(state, CpuShare::new(cpu_share), abandon)
            });
        match encoded.map(|thread| thread.join()) {
            Ok(Ok(bytes)) => bytes,
            Ok(Err(panic)) => std::panic::resume_unwind(panic),
            Err(error) => {
                tracing::debug!(%error, "encoding the snapshot at normal priority");
                encode_paced(state, CpuShare::new(cpu_share), abandon)
            }
        }
    })
}

/// Runs the job `work` builds on a thread of its own, with a current-thread
/// runtime of its own, at [`WRITER_NICE`], and returns its result. Dropping
/// the returned future abandons the job: it stops at its next await.
///
/// # Errors
/// When the thread or its runtime cannot be started, or the job's own error.
pub async fn on_writer_thread<T, F, Fut>(work: F) -> Result<T, SubmasterError>
where
    T: Send + 'static,
    F: FnOnce() -> Fut + Send + 'static,
    Fut: Future<Output = Result<T, SubmasterError>>,
{
    let (done, result) = tokio::sync::oneshot::channel();
    // Dropped with this future (a leader that stops abandons its snapshot): the
    // writer then stops at its next wait on the object store.
    let (_abandon, abandoned) = tokio::sync::oneshot::channel::<()>();
    std::thread::Builder::new()
        .name("hkvm-snapshot".into())
        .spawn(move || {
            lower_priority();
            let runtime = match tokio::runtime::Builder::new_current_thread()
                .enable_all()
                .build()
            {
                Ok(runtime) => runtime,
                Err(error) => {
                    let _ = done.send(Err(SubmasterError::caused(
                        Snapshot,
                        "snapshot writer runtime",
                        error,
                    )));
                    return;
                }
            };
            runtime.block_on(async move {
                tokio::select! {
                    finished = work() => {
                        let _ = done.send(finished);
                    }
                    _ = abandoned => tracing::debug!("snapshot abandoned"),
                }
            });
        })
        .map_err(|e| SubmasterError::caused(Snapshot, "snapshot writer thread", e))?;
    result
        .await
        .map_err(|_| SubmasterError::new(Snapshot, "the snapshot writer ended without a result"))?
}

/// Stores the snapshot `bytes` as covering `covers_seq` and reads them back;
/// returns the object's name and checksum.
///
/// # Errors
/// When the object store fails, or the object does not read back intact.
pub(crate) async fn store_bytes_verify(
    store: &SnapshotStore,
    bytes: Vec<u8>,
    covers_seq: u64,
) -> Result<(String, u64), SubmasterError> {
    let (name, checksum) = store.save_encoded(covers_seq, bytes).await?;
    store.verify(&name, checksum).await?;
    Ok((name, checksum))
}

/// Lowers the calling thread's CPU priority (on Linux a thread's scheduling
/// policy and nice value are its own): the `SCHED_IDLE` policy, under which the
/// scheduler switches to any other thread that wakes up at once instead of
/// letting this one finish its time slice first, and a nice value
/// [`WRITER_NICE`] higher, which is what is left where the policy is refused. A
/// refusal is logged; the snapshot is then written at normal priority.
fn lower_priority() {
    #[cfg(target_os = "linux")]
    {
        // SAFETY: gettid, getpriority and setpriority take no pointers;
        // sched_setscheduler reads one valid, initialized sched_param. Both
        // change only the calling thread (id 0 and its own tid).
        let (idle_refused, nice_refused) = unsafe {
            let tid = libc::gettid();
            let current = libc::getpriority(libc::PRIO_PROCESS, tid as libc::id_t);
            let nice_refused = libc::setpriority(
                libc::PRIO_PROCESS,
                tid as libc::id_t,
                current.saturating_add(WRITER_NICE),
            ) != 0;
            let param = libc::sched_param { sched_priority: 0 };
            let idle_refused = libc::sched_setscheduler(0, libc::SCHED_IDLE, &param) != 0;
            (idle_refused, nice_refused)
        };
        if idle_refused || nice_refused {
            tracing::debug!(
                idle_refused,
                nice_refused,
                error = %std::io::Error::last_os_error(),
                "the snapshot writer's priority was not lowered all the way"
            );
        }
    }
}

#[cfg(all(test, target_os = "linux"))]
mod tests {
    use super::*;

    fn own_nice() -> i32 {
        // SAFETY: no pointers; reads this thread's nice value.
        unsafe { libc::getpriority(libc::PRIO_PROCESS, libc::gettid() as libc::id_t) }
    }

    fn own_policy() -> i32 {
        // SAFETY: no pointers; reads the calling thread's policy.
        unsafe { libc::sched_getscheduler(0) }
    }

    #[test]
    fn the_writer_thread_runs_at_a_lower_priority_than_the_rest() {
        let (caller_nice, caller_policy) = (own_nice(), own_policy());
        let (before, after, policy) = std::thread::spawn(|| {
            let before = own_nice();
            lower_priority();
            (before, own_nice(), own_policy())
        })
        .join()
        .unwrap_or_else(|_| unreachable!("the thread does not panic"));
        assert_eq!(after, (before + WRITER_NICE).min(19));
        assert_eq!(policy, libc::SCHED_IDLE);
        assert_eq!(
            (own_nice(), own_policy()),
            (caller_nice, caller_policy),
            "only the writer's own thread is lowered"
        );
    }

    #[test]
    fn the_encoding_runs_on_a_lowered_thread_and_leaves_the_caller_alone() {
        let mut state = State::new();
        state.applied_seq = 7;
        let (nice, policy) = (own_nice(), own_policy());
        let bytes =
            encode_at_low_priority(&state, 0.5, &AtomicBool::new(false)).unwrap_or_default();
        let decoded = hkvm_events::snapshot::SnapshotFile::decode(&bytes);
        assert_eq!(decoded.map(|file| file.covers_seq).ok(), Some(7));
        assert_eq!((own_nice(), own_policy()), (nice, policy));
    }
}
