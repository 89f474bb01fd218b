//! `NativeDummy`: a dummy client (`setup_dummy`) with the same list-in, list-out
//! methods as `NativeStore`. Values move through the memory it shares with the
//! real client: zero-copy calls name buffers the caller allocated from the shared
//! pool (`alloc_from_mem_pool`) or from `MooncakeHostMemAllocator` (shared with
//! the real client when registered); copying calls stage values in its staging
//! area.

use std::future::Future;
use std::sync::{Arc, Mutex};

use hkvm_client::dummy::{DummyClient, DummyError, SharedRegion};
use hkvm_client::store::{BufferRegistry, ErrorCode};
use hkvm_events::rpc::dummy::{DummyReply, DummyRequest, Placement, Span};
use pyo3::prelude::*;
use pyo3::types::{PyByteArray, PyBytes};

use crate::host_memory;
use crate::zero_copy::select;
use crate::HkvmError;

const INVALID: i32 = ErrorCode::InvalidParams as i32;
const OVERFLOW: i32 = ErrorCode::BufferOverflow as i32;

fn code_of(error: &DummyError) -> i32 {
    tracing::debug!(%error, "dummy call failed");
    match error {
        DummyError::Refused(_) | DummyError::Region(_) => INVALID,
        DummyError::Unreachable { .. } | DummyError::Disconnected | DummyError::Frame(_) => {
            ErrorCode::RpcFail.value()
        }
    }
}

/// How Python passes a put's placement: replicas, preferred segment, hard pin.
type PyPlacement = (u32, Option<String>, bool);

/// A dummy client (see `hkvm.store.MooncakeDistributedStore.setup_dummy`).
#[pyclass(frozen, module = "hkvm._native")]
pub struct NativeDummy {
    runtime: Option<tokio::runtime::Runtime>,
    client: DummyClient,
    buffers: BufferRegistry,
    local_buffer_size: u64,
    /// Host memory shared with the real client, by its region number.
    shared: Mutex<Vec<SharedHost>>,
}

/// A host allocation this dummy shares with its real client.
struct SharedHost {
    region: u32,
    /// Kept mapped here while shared, even if the caller frees it meanwhile.
    memory: Arc<SharedRegion>,
}

impl SharedHost {
    /// The span of `[ptr, ptr + size)` when it lies in this memory.
    fn span(&self, ptr: usize, size: usize) -> Option<Span> {
        let offset = ptr.checked_sub(self.memory.base())? as u64;
        let span = Span {
            region: self.region,
            offset,
            len: size as u64,
        };
        span.fits(self.memory.len()).then_some(span)
    }
}

impl Drop for NativeDummy {
    fn drop(&mut self) {
        if let Some(runtime) = self.runtime.take() {
            runtime.shutdown_background();
        }
    }
}

/// Staging ranges handed back when dropped.
struct Staged<'a> {
    client: &'a DummyClient,
    offsets: Vec<u64>,
}

impl Drop for Staged<'_> {
    fn drop(&mut self) {
        for offset in self.offsets.drain(..) {
            self.client.staging_free(offset);
        }
    }
}

impl NativeDummy {
    fn wait<F>(&self, py: Python<'_>, future: F) -> F::Output
    where
        F: Future + Send,
        F::Output: Send,
    {
        match &self.runtime {
            Some(runtime) => py.detach(|| runtime.block_on(future)),
            None => unreachable!("the runtime lives as long as the dummy"),
        }
    }

    fn call(&self, py: Python<'_>, request: &DummyRequest) -> Result<DummyReply, i32> {
        self.wait(py, self.client.call(request))
            .map_err(|e| code_of(&e))
    }

    /// The span of `[ptr, ptr + size)` when it lies in registered memory of the
    /// shared pool or of shared host memory.
    fn span(&self, ptr: usize, size: usize) -> Option<Span> {
        if !self.buffers.contains(ptr, size) {
            return None;
        }
        let in_pool = ptr
            .checked_sub(self.client.region().base())
            .map(|offset| Span::in_pool(offset as u64, size as u64))
            .filter(|span| span.fits(self.client.pool_bytes()));
        in_pool.or_else(|| {
            lock(&self.shared)
                .iter()
                .find_map(|shared| shared.span(ptr, size))
        })
    }

    /// Shares the host allocation holding `[ptr, ptr + size)` with the real
    /// client, unless it is shared already: whether the range is now shared.
    fn share_host(&self, py: Python<'_>, ptr: usize, size: usize) -> Result<bool, i32> {
        if lock(&self.shared)
            .iter()
            .any(|shared| shared.span(ptr, size).is_some())
        {
            return Ok(true);
        }
        let Some(memory) = host_memory::containing(ptr, size) else {
            return Ok(false);
        };
        let region = self
            .wait(py, self.client.share(memory.fd(), memory.len()))
            .map_err(|error| {
                tracing::error!(%error, "sharing host memory with the real client");
                code_of(&error)
            })?;
        lock(&self.shared).push(SharedHost { region, memory });
        Ok(true)
    }

    /// Sizes of `keys` (or codes).
    fn sizes(&self, py: Python<'_>, keys: &[String]) -> Vec<i64> {
        match self.call(
            py,
            &DummyRequest::Size {
                keys: keys.to_vec(),
            },
        ) {
            Ok(DummyReply::Sizes(sizes)) if sizes.len() == keys.len() => sizes,
            Ok(_) => vec![i64::from(ErrorCode::InternalError.value()); keys.len()],
            Err(code) => vec![i64::from(code); keys.len()],
        }
    }

    /// Reads each key (of known size) into staging and hands its bytes to `take`;
    /// per key the code when it failed.
    fn read_staged(
        &self,
        py: Python<'_>,
        keys: &[String],
        mut take: impl FnMut(usize, &[u8]) -> PyResult<()>,
    ) -> PyResult<Vec<i32>> {
        let sizes = self.sizes(py, keys);
        let mut codes = vec![0; keys.len()];
        let mut staged = Staged {
            client: &self.client,
            offsets: Vec::new(),
        };
        let mut wanted = Vec::new();
        let mut spans = Vec::new();
        for (index, size) in sizes.iter().enumerate() {
            let size = match u64::try_from(*size) {
                Ok(size) if size <= self.local_buffer_size => size,
                Ok(_) => {
                    codes[index] = OVERFLOW;
                    continue;
                }
                Err(_) => {
                    codes[index] = i32::try_from(*size).unwrap_or(INVALID);
                    continue;
                }
            };
            let Some(offset) = self.client.staging_alloc(size) else {
                codes[index] = OVERFLOW;
                continue;
            };
            staged.offsets.push(offset);
            wanted.push(index);
            spans.push(vec![Span::in_pool(offset, size)]);
        }
        if wanted.is_empty() {
            return Ok(codes);
        }
        let request = DummyRequest::GetInto {
            keys: wanted.iter().map(|&i| keys[i].clone()).collect(),
            spans: spans.clone(),
        };
        match self.call(py, &request) {
            Ok(DummyReply::Sizes(read)) if read.len() == wanted.len() => {
                for ((&index, span), result) in wanted.iter().zip(&spans).zip(read) {
                    if result < 0 {
                        codes[index] = i32::try_from(result).unwrap_or(INVALID);
                        continue;
                    }
                    // SAFETY: the real client finished writing this staging range
                    // (its reply arrived) and nobody else uses it until it is freed.
                    let bytes =
                        unsafe { self.client.region().slice(span[0].offset, result as u64) };
                    match bytes {
                        Some(bytes) => take(index, bytes)?,
                        None => codes[index] = INVALID,
                    }
                }
            }
            Ok(_) => codes
                .iter_mut()
                .for_each(|c| *c = ErrorCode::InternalError.value()),
            Err(code) => {
                for &index in &wanted {
                    codes[index] = code;
                }
            }
        }
        Ok(codes)
    }
}

#[pymethods]
impl NativeDummy {
    /// Connects to the real client serving `server_address` (`host:port`; the
    /// port names its socket) with a shared region of `mem_pool_size` +
    /// `local_buffer_size` bytes.
    ///
    /// # Errors
    /// `HkvmError((code, message))` when the address is bad or no real client
    /// answers.
    #[new]
    fn new(
        py: Python<'_>,
        mem_pool_size: u64,
        local_buffer_size: u64,
        server_address: &str,
    ) -> PyResult<Self> {
        let port = server_address
            .rsplit_once(':')
            .map_or(server_address, |(_, port)| port)
            .parse::<u16>()
            .map_err(|_| {
                HkvmError::new_err((
                    INVALID,
                    format!("server_address {server_address:?} has no port (host:port)"),
                ))
            })?;
        let runtime = tokio::runtime::Builder::new_multi_thread()
            .worker_threads(1)
            .thread_name("hkvm-dummy")
            .enable_all()
            .build()
            .map_err(|e| HkvmError::new_err((ErrorCode::InternalError.value(), e.to_string())))?;
        let client = py
            .detach(|| {
                runtime.block_on(DummyClient::connect(port, mem_pool_size, local_buffer_size))
            })
            .map_err(|e| {
                let mut message = e.to_string();
                if let Some(source) = std::error::Error::source(&e) {
                    message.push_str(&format!(": {source}"));
                }
                HkvmError::new_err((code_of(&e), message))
            })?;
        Ok(Self {
            runtime: Some(runtime),
            client,
            buffers: BufferRegistry::default(),
            local_buffer_size,
            shared: Mutex::new(Vec::new()),
        })
    }

    /// The real client's endpoint.
    fn hostname(&self, py: Python<'_>) -> String {
        self.wait(py, self.client.hostname()).unwrap_or_default()
    }

    /// The staging bound of copying calls.
    fn local_buffer_size(&self) -> u64 {
        self.local_buffer_size
    }

    /// Nothing to release beyond dropping the connection and region.
    fn close(&self, _py: Python<'_>) {}

    /// 0 healthy, 2 when the real client or its sub-master does not answer.
    fn health(&self, py: Python<'_>) -> i32 {
        match self.call(py, &DummyRequest::Health) {
            Ok(DummyReply::Health(health)) => health,
            _ => 2,
        }
    }

    /// Puts values given as bytes parts, staged through the shared region.
    fn put(
        &self,
        py: Python<'_>,
        keys: Vec<String>,
        values: Vec<Vec<Bound<'_, PyBytes>>>,
        placement: PyPlacement,
        staged: bool,
    ) -> Vec<i32> {
        if keys.len() != values.len() {
            return vec![INVALID; keys.len()];
        }
        let mut codes = vec![0; keys.len()];
        let mut holding = Staged {
            client: &self.client,
            offsets: Vec::new(),
        };
        let mut wanted = Vec::new();
        let mut spans = Vec::new();
        for (index, parts) in values.iter().enumerate() {
            let size: u64 = parts.iter().map(|p| p.as_bytes().len() as u64).sum();
            if staged && size > self.local_buffer_size {
                codes[index] = OVERFLOW;
                continue;
            }
            let Some(offset) = self.client.staging_alloc(size) else {
                codes[index] = OVERFLOW;
                continue;
            };
            holding.offsets.push(offset);
            // SAFETY: a staging range just allocated for this call alone.
            let Some(target) = (unsafe { self.client.region().slice_mut(offset, size) }) else {
                codes[index] = INVALID;
                continue;
            };
            let mut at = 0;
            for part in parts {
                let bytes = part.as_bytes();
                target[at..at + bytes.len()].copy_from_slice(bytes);
                at += bytes.len();
            }
            wanted.push(index);
            spans.push(vec![Span::in_pool(offset, size)]);
        }
        if wanted.is_empty() {
            return codes;
        }
        let request = DummyRequest::Put {
            keys: wanted.iter().map(|&i| keys[i].clone()).collect(),
            spans,
            placement: Placement {
                replicas: placement.0,
                preferred_segment: placement.1,
                hard_pin: placement.2,
            },
        };
        spread(self.call(py, &request), &wanted, &mut codes);
        codes
    }

    /// Puts values from registered memory of the shared pool.
    fn put_from(
        &self,
        py: Python<'_>,
        keys: Vec<String>,
        ptrs: Vec<Vec<usize>>,
        sizes: Vec<Vec<usize>>,
        placement: PyPlacement,
    ) -> Vec<i32> {
        let Some(selected) = select(keys.len(), &ptrs, &sizes, |ptr, size| self.span(ptr, size))
        else {
            return vec![INVALID; keys.len()];
        };
        let mut codes = vec![0; keys.len()];
        for &index in &selected.refused {
            codes[index] = INVALID;
        }
        if selected.indexes.is_empty() {
            return codes;
        }
        let request = DummyRequest::Put {
            keys: selected.indexes.iter().map(|&i| keys[i].clone()).collect(),
            spans: selected.parts,
            placement: Placement {
                replicas: placement.0,
                preferred_segment: placement.1,
                hard_pin: placement.2,
            },
        };
        spread(self.call(py, &request), &selected.indexes, &mut codes);
        codes
    }

    /// Reads values as bytes (or int codes).
    fn get(&self, py: Python<'_>, keys: Vec<String>) -> PyResult<Vec<Py<PyAny>>> {
        let mut out: Vec<Option<Py<PyAny>>> = keys.iter().map(|_| None).collect();
        let codes = self.read_staged(py, &keys, |index, bytes| {
            out[index] = Some(PyBytes::new(py, bytes).into_any().unbind());
            Ok(())
        })?;
        out.into_iter()
            .zip(codes)
            .map(|(value, code)| match value {
                Some(value) => Ok(value),
                None => Ok(code.into_pyobject(py)?.into_any().unbind()),
            })
            .collect()
    }

    /// Reads values into registered memory of the shared pool.
    fn get_into(
        &self,
        py: Python<'_>,
        keys: Vec<String>,
        ptrs: Vec<Vec<usize>>,
        sizes: Vec<Vec<usize>>,
    ) -> Vec<i64> {
        let Some(selected) = select(keys.len(), &ptrs, &sizes, |ptr, size| self.span(ptr, size))
        else {
            return vec![i64::from(INVALID); keys.len()];
        };
        let mut results = vec![0i64; keys.len()];
        for &index in &selected.refused {
            results[index] = i64::from(INVALID);
        }
        if selected.indexes.is_empty() {
            return results;
        }
        let wanted = selected.indexes;
        let request = DummyRequest::GetInto {
            keys: wanted.iter().map(|&i| keys[i].clone()).collect(),
            spans: selected.parts,
        };
        let reply = match self.call(py, &request) {
            Ok(DummyReply::Sizes(read)) if read.len() == wanted.len() => Ok(read),
            Ok(_) => Err(ErrorCode::InternalError.value()),
            Err(code) => Err(code),
        };
        for (position, &index) in wanted.iter().enumerate() {
            results[index] = match &reply {
                Ok(read) => read[position],
                Err(code) => i64::from(*code),
            };
        }
        results
    }

    /// Reads values into buffers made by `factory(size)`, or `None`.
    fn get_buffer(
        &self,
        py: Python<'_>,
        keys: Vec<String>,
        factory: &Bound<'_, PyAny>,
    ) -> PyResult<Vec<Py<PyAny>>> {
        let mut out: Vec<Py<PyAny>> = keys.iter().map(|_| py.None()).collect();
        self.read_staged(py, &keys, |index, bytes| {
            let handle = factory.call1((bytes.len(),))?;
            let array = handle.cast::<PyByteArray>()?;
            // SAFETY: the buffer was just created and is not yet shared.
            unsafe { array.as_bytes_mut() }.copy_from_slice(bytes);
            out[index] = handle.unbind();
            Ok(())
        })?;
        Ok(out)
    }

    /// Whether keys exist anywhere: 1, 0, or -1 each.
    fn exist(&self, py: Python<'_>, keys: Vec<String>) -> Vec<i32> {
        match self.call(py, &DummyRequest::Exist { keys: keys.clone() }) {
            Ok(DummyReply::Exist(exists)) if exists.len() == keys.len() => exists,
            _ => vec![-1; keys.len()],
        }
    }

    /// Per key its size or a negative code.
    fn size(&self, py: Python<'_>, keys: Vec<String>) -> Vec<i64> {
        self.sizes(py, &keys)
    }

    /// Removes keys: per key 0 or a negative code.
    fn remove(&self, py: Python<'_>, keys: Vec<String>, force: bool) -> Vec<i32> {
        let mut codes = vec![0; keys.len()];
        let all: Vec<usize> = (0..keys.len()).collect();
        spread(
            self.call(py, &DummyRequest::Remove { keys, force }),
            &all,
            &mut codes,
        );
        codes
    }

    /// Removes every object (or those matching `pattern`): a count or a code.
    #[pyo3(signature = (pattern, force))]
    fn remove_all(&self, py: Python<'_>, pattern: Option<String>, force: bool) -> i64 {
        match self.call(py, &DummyRequest::RemoveAll { pattern, force }) {
            Ok(DummyReply::Count(count)) => count,
            Ok(_) => i64::from(ErrorCode::InternalError.value()),
            Err(code) => i64::from(code),
        }
    }

    /// Registers memory for zero-copy calls: 0, or -600 unless it lies in the
    /// shared pool (`alloc_from_mem_pool`) or in host memory from
    /// `MooncakeHostMemAllocator` (shared with the real client here).
    fn register_buffer(&self, py: Python<'_>, ptr: usize, size: usize) -> i32 {
        let base = self.client.region().base();
        let pool_end = base + self.client.pool_bytes() as usize;
        let in_pool = ptr >= base && ptr.checked_add(size).is_some_and(|end| end <= pool_end);
        if !in_pool {
            match self.share_host(py, ptr, size) {
                Ok(true) => {}
                Ok(false) => {
                    tracing::error!(
                        ptr,
                        size,
                        "a dummy client's buffer must lie in its shared pool \
                         (alloc_from_mem_pool) or in MooncakeHostMemAllocator memory"
                    );
                    return INVALID;
                }
                Err(code) => return code,
            }
        }
        match self.buffers.register(ptr, size) {
            Ok(()) => 0,
            Err(_) => INVALID,
        }
    }

    /// Forgets a registration: 0 or -600. Host memory is no longer shared once
    /// no registration lies in it.
    fn unregister_buffer(&self, py: Python<'_>, ptr: usize) -> i32 {
        if !self.buffers.unregister(ptr) {
            return INVALID;
        }
        let unused: Vec<u32> = lock(&self.shared)
            .iter()
            .filter(|shared| {
                !self
                    .buffers
                    .overlaps(shared.memory.base(), shared.memory.len() as usize)
            })
            .map(|shared| shared.region)
            .collect();
        for region in unused {
            lock(&self.shared).retain(|shared| shared.region != region);
            if let Err(error) = self.wait(py, self.client.release(region)) {
                tracing::warn!(%error, region, "releasing shared host memory");
            }
        }
        0
    }

    /// An address of `size` bytes in the shared pool, or 0 when it is full.
    fn alloc_from_mem_pool(&self, size: u64) -> usize {
        self.client
            .pool_alloc(size)
            .map_or(0, |offset| self.client.region().base() + offset as usize)
    }

    /// Gives an address from `alloc_from_mem_pool` back: 0 or -600.
    fn free_to_mem_pool(&self, ptr: usize) -> i32 {
        let offset = ptr.wrapping_sub(self.client.region().base()) as u64;
        if self.client.pool_free(offset) {
            0
        } else {
            INVALID
        }
    }
}

fn lock<T>(mutex: &Mutex<T>) -> std::sync::MutexGuard<'_, T> {
    mutex.lock().unwrap_or_else(|p| p.into_inner())
}

/// Spreads a per-key reply (or a whole-request failure) over `codes` at `indexes`.
fn spread(reply: Result<DummyReply, i32>, indexes: &[usize], codes: &mut [i32]) {
    match reply {
        Ok(DummyReply::Codes(results)) if results.len() == indexes.len() => {
            for (&index, code) in indexes.iter().zip(results) {
                codes[index] = code;
            }
        }
        Ok(DummyReply::Refused { code, .. }) | Err(code) => {
            for &index in indexes {
                codes[index] = code;
            }
        }
        Ok(_) => {
            for &index in indexes {
                codes[index] = ErrorCode::InternalError.value();
            }
        }
    }
}
