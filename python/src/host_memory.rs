//! Host memory an inference engine allocates before it knows its store
//! (`MooncakeHostMemAllocator`, SGLang's host KV pool in standalone mode): each
//! allocation is its own memfd mapping, so a dummy client can later share it with
//! its real client (`register_buffer`) and move values in it with no copy. On a
//! full store it is ordinary memory.

use std::collections::BTreeMap;
use std::sync::{Arc, Mutex};

use hkvm_client::dummy::SharedRegion;
use hkvm_client::store::ErrorCode;
use pyo3::exceptions::PyMemoryError;
use pyo3::prelude::*;

/// The live allocations, by base address.
static ALLOCATIONS: Mutex<BTreeMap<usize, Arc<SharedRegion>>> = Mutex::new(BTreeMap::new());

fn allocations() -> std::sync::MutexGuard<'static, BTreeMap<usize, Arc<SharedRegion>>> {
    ALLOCATIONS.lock().unwrap_or_else(|p| p.into_inner())
}

/// The allocation holding all of `[ptr, ptr + size)`, if any.
pub fn containing(ptr: usize, size: usize) -> Option<Arc<SharedRegion>> {
    let end = ptr.checked_add(size)?;
    let allocations = allocations();
    let (&base, region) = allocations.range(..=ptr).next_back()?;
    (end <= base + region.len() as usize).then(|| Arc::clone(region))
}

/// Allocates `size` bytes of shareable host memory; returns its address.
///
/// # Errors
/// `MemoryError` when the memory cannot be created or mapped.
#[pyfunction]
pub fn host_alloc(size: u64) -> PyResult<usize> {
    if size == 0 {
        return Err(PyMemoryError::new_err(
            "cannot allocate 0 bytes of host memory",
        ));
    }
    let region = SharedRegion::create("hkvm-host", size).map_err(|error| {
        PyMemoryError::new_err(format!("allocating {size} bytes of host memory: {error}"))
    })?;
    let base = region.base();
    allocations().insert(base, Arc::new(region));
    Ok(base)
}

/// Frees an address from [`host_alloc`]: 0, or -600 for any other address. A
/// dummy that registered the memory keeps it mapped until it unregisters it.
#[pyfunction]
pub fn host_free(ptr: usize) -> i32 {
    match allocations().remove(&ptr) {
        Some(_) => 0,
        None => ErrorCode::InvalidParams.value(),
    }
}
