//! Writing a snapshot without taking the CPU from serving: encoding it,
//! storing it and reading it back to verify it run on a thread of their own,
//! with a runtime of their own, at a lower CPU priority than the process's
//! other threads. A large snapshot (a 10 M-object one is about 860 MB and
//! seconds of hashing and encoding) then slows down when the machine is busy
//! instead of slowing down the requests beside it.

use hkvm_events::snapshot::{SnapshotFile, SnapshotStore};

use crate::error::SubmasterError;
use crate::SubmasterErrorKind::Snapshot;

/// How much lower than the process's other threads the writer runs (a nice
/// increment: at 10 the scheduler gives it about a tenth of a contended core).
pub const WRITER_NICE: i32 = 10;

/// Encodes `file`, stores it as covering `covers_seq` and reads it back to
/// verify it, on a low-priority thread ([`WRITER_NICE`]); returns the object's
/// name and checksum once it is safe to rely on.
///
/// # Errors
/// When the thread cannot be started, encoding fails, the object store fails,
/// or the stored object does not read back intact.
pub async fn store_verified(
    store: &SnapshotStore,
    file: SnapshotFile,
    covers_seq: u64,
) -> Result<(String, u64), SubmasterError> {
    let (done, result) = tokio::sync::oneshot::channel();
    // Dropped with this future (a leader that stops abandons its snapshot): the
    // writer then stops at its next wait on the object store.
    let (_abandon, abandoned) = tokio::sync::oneshot::channel::<()>();
    let store = store.clone();
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
                    written = encode_store_verify(&store, file, covers_seq) => {
                        let _ = done.send(written);
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

async fn encode_store_verify(
    store: &SnapshotStore,
    mut file: SnapshotFile,
    covers_seq: u64,
) -> Result<(String, u64), SubmasterError> {
    file.covers_seq = covers_seq;
    let bytes = file.encode()?;
    drop(file);
    let (name, checksum) = store.save_encoded(covers_seq, bytes).await?;
    store.verify(&name, checksum).await?;
    Ok((name, checksum))
}

/// Lowers the calling thread's CPU priority by [`WRITER_NICE`] (on Linux a
/// thread's nice value is its own). A refusal is logged; the snapshot is then
/// written at normal priority.
fn lower_priority() {
    #[cfg(target_os = "linux")]
    {
        // SAFETY: gettid and setpriority take no pointers; setpriority on this
        // thread's id changes only this thread's nice value.
        let refused = unsafe {
            let tid = libc::gettid();
            let current = libc::getpriority(libc::PRIO_PROCESS, tid as libc::id_t);
            libc::setpriority(
                libc::PRIO_PROCESS,
                tid as libc::id_t,
                current.saturating_add(WRITER_NICE),
            ) != 0
        };
        if refused {
            tracing::debug!(
                error = %std::io::Error::last_os_error(),
                "the snapshot writer runs at normal priority"
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

    #[test]
    fn the_writer_thread_runs_at_a_lower_priority_than_the_rest() {
        let caller = own_nice();
        let (before, after) = std::thread::spawn(|| {
            let before = own_nice();
            lower_priority();
            (before, own_nice())
        })
        .join()
        .unwrap_or_else(|_| unreachable!("the thread does not panic"));
        assert_eq!(after, (before + WRITER_NICE).min(19));
        assert_eq!(
            own_nice(),
            caller,
            "only the writer's own thread is lowered"
        );
    }
}
