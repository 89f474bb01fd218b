//! `hkvm._native`: the Rust side of the `hkvm` Python package. It only converts
//! Python arguments to calls of a store backend (the embedded
//! [`hkvm_client::store::Store`], or a dummy client of a real client's store) and
//! results to Mooncake's integer codes; the Python-facing API (argument forms,
//! defaults, the `MooncakeDistributedStore` class) is in `hkvm/store.py`. Every
//! network wait and copy runs with the GIL released, on a Tokio runtime owned by
//! the store.

mod backend;
mod dummy;
mod embedded;
mod error;
mod host_memory;
mod native;
mod zero_copy;

use pyo3::prelude::*;

/// mimalloc for the extension's own allocations (Python objects keep
/// pymalloc): every call builds and drops per-key strings, request and reply
/// buffers on the caller's thread and the runtime's, where glibc's malloc and
/// free were a quarter of a 1000-key `batch_is_exist` and its large buffers
/// went back to the kernel (and faulted in again) on every call. The `hkvm`
/// binaries, the Rust client's other users, run on it too.
#[global_allocator]
static ALLOCATOR: mimalloc::MiMalloc = mimalloc::MiMalloc;

/// Starts `tracing` output on stderr, filtered by `HKVM_LOG` (e.g. `info`,
/// `hkvm_client=debug`); warnings only when it is unset. Only the first call acts.
#[pyfunction]
fn init_logging() {
    static ONCE: std::sync::Once = std::sync::Once::new();
    ONCE.call_once(|| {
        let filter = tracing_subscriber::EnvFilter::try_from_env("HKVM_LOG")
            .unwrap_or_else(|_| tracing_subscriber::EnvFilter::new("warn"));
        let _ = tracing_subscriber::fmt()
            .with_env_filter(filter)
            .with_writer(std::io::stderr)
            .try_init();
    });
}

/// Does nothing: the floor a call into the extension costs, against which
/// `hkvm bench python` measures what the store's own calls add
/// (`NativeStore.idle_call`).
#[pyfunction]
fn noop() {}

/// The extension module.
#[pymodule]
fn _native(m: &Bound<'_, PyModule>) -> PyResult<()> {
    m.add("HkvmError", m.py().get_type::<error::HkvmError>())?;
    m.add_function(wrap_pyfunction!(init_logging, m)?)?;
    m.add_function(wrap_pyfunction!(noop, m)?)?;
    m.add_class::<native::NativeStore>()?;
    m.add_function(wrap_pyfunction!(host_memory::host_alloc, m)?)?;
    m.add_function(wrap_pyfunction!(host_memory::host_free, m)?)?;
    Ok(())
}
