//! `NativeStore`: one set-up [`Store`] and the Tokio runtime that drives it, with
//! list-in, list-out methods the Python layer calls. Results are Mooncake codes
//! (0 or negative), sizes, or Python objects; nothing here raises after setup.

use std::future::Future;

use hkvm_client::store::{
    segment_for, BufferRegistry, ErrorCode, Store, StoreAddress, StoreConfig, StoreError,
};
use hkvm_client::{Protocol, PutOptions};
use pyo3::prelude::*;
use pyo3::types::{PyByteArray, PyBytes};

use crate::zero_copy::select;
use crate::HkvmError;

/// The message of an error with its causes, outermost first.
fn describe(error: &dyn std::error::Error) -> String {
    let mut text = error.to_string();
    let mut source = error.source();
    while let Some(cause) = source {
        text.push_str(": ");
        text.push_str(&cause.to_string());
        source = cause.source();
    }
    text
}

fn code_of(error: &StoreError) -> i32 {
    let code = error.code().value();
    tracing::debug!(code, error = describe(error), "store call failed");
    code
}

const INVALID: i32 = ErrorCode::InvalidParams as i32;

/// How Python passes a put's placement: replicas, preferred segment
/// (`host:port`), hard pin.
type Placement = (u32, Option<String>, bool);
const OVERFLOW: i32 = ErrorCode::BufferOverflow as i32;

/// A set-up store (see `hkvm.store.MooncakeDistributedStore`).
#[pyclass(frozen, module = "hkvm._native")]
pub struct NativeStore {
    runtime: Option<tokio::runtime::Runtime>,
    store: Store,
    buffers: BufferRegistry,
    local_buffer_size: u64,
}

impl Drop for NativeStore {
    fn drop(&mut self) {
        // Dropped by the garbage collector: never wait for the runtime's tasks
        // there.
        if let Some(runtime) = self.runtime.take() {
            runtime.shutdown_background();
        }
    }
}

impl NativeStore {
    /// Runs `future` on the store's runtime with the GIL released.
    fn wait<F>(&self, py: Python<'_>, future: F) -> F::Output
    where
        F: Future + Send,
        F::Output: Send,
    {
        match &self.runtime {
            Some(runtime) => py.detach(|| runtime.block_on(future)),
            None => unreachable!("the runtime lives as long as the store"),
        }
    }

    /// Placement options from Python's `(replicas, preferred segment, hard pin)`.
    fn options(placement: &Placement) -> PutOptions {
        let (replicas, preferred_segment, hard_pin) = placement;
        PutOptions {
            replicas: (*replicas).max(1),
            preferred_segment: preferred_segment
                .as_deref()
                .filter(|s| !s.is_empty())
                .and_then(segment_for),
            hard_pin: *hard_pin,
        }
    }

    /// Puts `items` (key, parts) and spreads the results over `codes` at
    /// `indexes`.
    fn put_items(
        &self,
        py: Python<'_>,
        items: &[(&str, &[&[u8]])],
        indexes: &[usize],
        options: &PutOptions,
        codes: &mut [i32],
    ) {
        if items.is_empty() {
            return;
        }
        match self.wait(py, self.store.put(items, options)) {
            Ok(results) => {
                for (&index, result) in indexes.iter().zip(results) {
                    codes[index] = result.map_or_else(|e| code_of(&e), |()| 0);
                }
            }
            Err(error) => {
                let code = code_of(&error);
                for &index in indexes {
                    codes[index] = code;
                }
            }
        }
    }
}

#[pymethods]
impl NativeStore {
    /// Connects to `master_server_addr` (`nats://h:4222/<cluster>/<subcluster>`),
    /// checks its sub-master answers and, with a segment size, starts this
    /// process's node.
    ///
    /// # Errors
    /// `HkvmError((code, message))` when anything fails.
    #[new]
    #[pyo3(signature = (local_hostname, master_server_addr, global_segment_size, local_buffer_size, protocol = "tcp", rdma_devices = ""))]
    fn new(
        py: Python<'_>,
        local_hostname: String,
        master_server_addr: &str,
        global_segment_size: u64,
        local_buffer_size: u64,
        protocol: &str,
        rdma_devices: &str,
    ) -> PyResult<Self> {
        let fail = |error: StoreError| HkvmError::new_err((error.code().value(), describe(&error)));
        let address: StoreAddress = master_server_addr
            .parse()
            .map_err(|e| fail(StoreError::Address(e)))?;
        let protocol = Protocol::parse(protocol, rdma_devices)
            .map_err(|e| fail(StoreError::InvalidParams(e.to_string())))?;
        let runtime = tokio::runtime::Builder::new_multi_thread()
            .worker_threads(2)
            .thread_name("hkvm-store")
            .enable_all()
            .build()
            .map_err(|e| HkvmError::new_err((ErrorCode::InternalError.value(), e.to_string())))?;
        let mut config = StoreConfig::new(address, local_hostname);
        config.global_segment_size = global_segment_size;
        config.local_buffer_size = local_buffer_size;
        config.protocol = protocol;
        let store = py
            .detach(|| runtime.block_on(Store::open(config)))
            .map_err(fail)?;
        Ok(Self {
            runtime: Some(runtime),
            store,
            buffers: BufferRegistry::default(),
            local_buffer_size,
        })
    }

    /// This process's endpoint (`host:port`).
    fn hostname(&self) -> String {
        self.store.hostname().to_owned()
    }

    /// The staging bound of copying calls.
    fn local_buffer_size(&self) -> u64 {
        self.local_buffer_size
    }

    /// Unmounts this process's segment and stops its node.
    fn close(&self, py: Python<'_>) {
        self.wait(py, self.store.close());
    }

    /// 0 healthy, 1 closed, 2 sub-master unreachable.
    fn health(&self, py: Python<'_>) -> i32 {
        self.wait(py, self.store.health()) as i32
    }

    /// Puts values given as bytes parts (one list of parts per key). With
    /// `staged`, a value larger than the staging buffer is refused.
    fn put(
        &self,
        py: Python<'_>,
        keys: Vec<String>,
        values: Vec<Vec<Bound<'_, PyBytes>>>,
        placement: Placement,
        staged: bool,
    ) -> Vec<i32> {
        if keys.len() != values.len() {
            return vec![INVALID; keys.len()];
        }
        let slices: Vec<Vec<&[u8]>> = values
            .iter()
            .map(|parts| parts.iter().map(|part| part.as_bytes()).collect())
            .collect();
        let mut codes = vec![0; keys.len()];
        let mut items = Vec::with_capacity(keys.len());
        let mut indexes = Vec::with_capacity(keys.len());
        for (index, (key, parts)) in keys.iter().zip(&slices).enumerate() {
            let size: u64 = parts.iter().map(|p| p.len() as u64).sum();
            if staged && size > self.local_buffer_size {
                codes[index] = OVERFLOW;
            } else {
                items.push((key.as_str(), parts.as_slice()));
                indexes.push(index);
            }
        }
        let options = Self::options(&placement);
        self.put_items(py, &items, &indexes, &options, &mut codes);
        codes
    }

    /// Puts values read from registered memory: per key a list of (pointer, size)
    /// parts, concatenated in order.
    fn put_from(
        &self,
        py: Python<'_>,
        keys: Vec<String>,
        ptrs: Vec<Vec<usize>>,
        sizes: Vec<Vec<usize>>,
        placement: Placement,
    ) -> Vec<i32> {
        let selected = select(keys.len(), &ptrs, &sizes, |ptr, size| {
            // SAFETY: every range lies inside memory the caller registered and
            // promised to keep valid until it unregisters it; the bytes are only
            // read, during this call.
            self.buffers
                .contains(ptr, size)
                .then(|| unsafe { std::slice::from_raw_parts(ptr as *const u8, size) })
        });
        let Some(selected) = selected else {
            return vec![INVALID; keys.len()];
        };
        let mut codes = vec![0; keys.len()];
        for &index in &selected.refused {
            codes[index] = INVALID;
        }
        let items: Vec<(&str, &[&[u8]])> = selected
            .indexes
            .iter()
            .zip(&selected.parts)
            .map(|(&index, parts)| (keys[index].as_str(), parts.as_slice()))
            .collect();
        let options = Self::options(&placement);
        self.put_items(py, &items, &selected.indexes, &options, &mut codes);
        codes
    }

    /// Reads values as bytes: per key the bytes, or an int code when it failed
    /// (missing, larger than the staging buffer, unreadable).
    fn get(&self, py: Python<'_>, keys: Vec<String>) -> Vec<Py<PyAny>> {
        let refs: Vec<&str> = keys.iter().map(String::as_str).collect();
        let located = match self.wait(py, self.store.locate(&refs)) {
            Ok(located) => located,
            Err(error) => {
                let code = code_of(&error);
                return keys
                    .iter()
                    .map(|_| {
                        code.into_pyobject(py)
                            .map_or_else(|_| py.None(), |o| o.into_any().unbind())
                    })
                    .collect();
            }
        };
        let mut out = Vec::with_capacity(keys.len());
        for (key, located) in keys.iter().zip(located) {
            let result: Result<Py<PyAny>, i32> = match located {
                Err(error) => Err(code_of(&error)),
                Ok(located) if located.list.size > self.local_buffer_size => Err(OVERFLOW),
                Ok(located) => {
                    let size = usize::try_from(located.list.size).unwrap_or(usize::MAX);
                    let mut failed = 0;
                    // The value is read straight into the new bytes object, with the
                    // GIL released while it arrives.
                    let bytes = PyBytes::new_with(py, size, |buffer| {
                        let read =
                            self.wait(py, self.store.read_located(key, &located, &mut [buffer]));
                        read.map(|_| ()).map_err(|error| {
                            failed = code_of(&error);
                            HkvmError::new_err(failed)
                        })
                    });
                    bytes.map(|b| b.into_any().unbind()).map_err(|_| failed)
                }
            };
            out.push(result.unwrap_or_else(|code| {
                code.into_pyobject(py)
                    .map_or_else(|_| py.None(), |o| o.into_any().unbind())
            }));
        }
        out
    }

    /// Reads values into registered memory: per key a list of (pointer, size)
    /// parts filled in order. Per key the value's size, or a negative code.
    fn get_into(
        &self,
        py: Python<'_>,
        keys: Vec<String>,
        ptrs: Vec<Vec<usize>>,
        sizes: Vec<Vec<usize>>,
    ) -> Vec<i64> {
        let selected = select(keys.len(), &ptrs, &sizes, |ptr, size| {
            // SAFETY: every range lies inside memory the caller registered and
            // promised to keep valid and not to touch while this call writes it.
            self.buffers
                .contains(ptr, size)
                .then(|| unsafe { std::slice::from_raw_parts_mut(ptr as *mut u8, size) })
        });
        let Some(mut selected) = selected else {
            return vec![i64::from(INVALID); keys.len()];
        };
        let mut results = vec![0i64; keys.len()];
        for &index in &selected.refused {
            results[index] = i64::from(INVALID);
        }
        let mut items: Vec<(&str, &mut [&mut [u8]])> = selected
            .indexes
            .iter()
            .zip(selected.parts.iter_mut())
            .map(|(&index, buffers)| (keys[index].as_str(), buffers.as_mut_slice()))
            .collect();
        if items.is_empty() {
            return results;
        }
        match self.wait(py, self.store.get_into(&mut items)) {
            Ok(read) => {
                for (&index, result) in selected.indexes.iter().zip(read) {
                    results[index] = result.map_or_else(
                        |e| i64::from(code_of(&e)),
                        |size| i64::try_from(size).unwrap_or(i64::MAX),
                    );
                }
            }
            Err(error) => {
                let code = i64::from(code_of(&error));
                for &index in &selected.indexes {
                    results[index] = code;
                }
            }
        }
        results
    }

    /// Reads values into new buffers made by `factory(size)` (a `bytearray`
    /// subclass): per key the buffer, or `None`.
    fn get_buffer(
        &self,
        py: Python<'_>,
        keys: Vec<String>,
        factory: &Bound<'_, PyAny>,
    ) -> PyResult<Vec<Py<PyAny>>> {
        let refs: Vec<&str> = keys.iter().map(String::as_str).collect();
        let Ok(located) = self.wait(py, self.store.locate(&refs)) else {
            return Ok(keys.iter().map(|_| py.None()).collect());
        };
        let mut out = Vec::with_capacity(keys.len());
        for (key, located) in keys.iter().zip(located) {
            let Ok(located) = located else {
                out.push(py.None());
                continue;
            };
            if located.list.size > self.local_buffer_size {
                out.push(py.None());
                continue;
            }
            let handle = factory.call1((located.list.size,))?;
            let array = handle.cast::<PyByteArray>()?;
            // SAFETY: the buffer was just created here and is not yet visible to
            // any other Python code, so nothing can resize or read it while it is
            // filled with the GIL released.
            let buffer = unsafe { array.as_bytes_mut() };
            let read = self.wait(py, self.store.read_located(key, &located, &mut [buffer]));
            out.push(match read {
                Ok(_) => handle.unbind(),
                Err(error) => {
                    code_of(&error);
                    py.None()
                }
            });
        }
        Ok(out)
    }

    /// Whether keys exist anywhere: 1 or 0 each, or -1 each when the check failed.
    fn exist(&self, py: Python<'_>, keys: Vec<String>) -> Vec<i32> {
        match self.wait(py, self.store.exist(&keys)) {
            Ok(exists) => exists.into_iter().map(i32::from).collect(),
            Err(error) => {
                code_of(&error);
                vec![-1; keys.len()]
            }
        }
    }

    /// Per key its value's size, or a negative code.
    fn size(&self, py: Python<'_>, keys: Vec<String>) -> Vec<i64> {
        let refs: Vec<&str> = keys.iter().map(String::as_str).collect();
        match self.wait(py, self.store.locate(&refs)) {
            Ok(located) => located
                .into_iter()
                .map(|l| {
                    l.map_or_else(
                        |e| i64::from(code_of(&e)),
                        |l| i64::try_from(l.list.size).unwrap_or(i64::MAX),
                    )
                })
                .collect(),
            Err(error) => vec![i64::from(code_of(&error)); keys.len()],
        }
    }

    /// Removes keys wherever they are: per key 0 or a negative code.
    fn remove(&self, py: Python<'_>, keys: Vec<String>, force: bool) -> Vec<i32> {
        match self.wait(py, self.store.remove(&keys, force)) {
            Ok(results) => results
                .into_iter()
                .map(|r| r.map_or_else(|e| code_of(&e), |()| 0))
                .collect(),
            Err(error) => vec![code_of(&error); keys.len()],
        }
    }

    /// Removes every object (or those whose key matches `pattern`) in the cluster:
    /// how many, or a negative code.
    #[pyo3(signature = (pattern, force))]
    fn remove_all(&self, py: Python<'_>, pattern: Option<String>, force: bool) -> i64 {
        match self.wait(py, self.store.remove_all(pattern.as_deref(), force)) {
            Ok(removed) => i64::try_from(removed).unwrap_or(i64::MAX),
            Err(error) => i64::from(code_of(&error)),
        }
    }

    /// Registers `[ptr, ptr + size)` for zero-copy calls: 0, or -600 for a null,
    /// empty or overlapping range.
    fn register_buffer(&self, ptr: usize, size: usize) -> i32 {
        if self.buffers.register(ptr, size).is_err() {
            return INVALID;
        }
        // SAFETY: the caller keeps registered memory alive until it unregisters it
        // (the contract of Mooncake's `register_buffer`).
        match unsafe { self.store.register_local(ptr as *mut u8, size) } {
            Ok(()) => 0,
            Err(error) => {
                tracing::warn!(%error, "the transport refused the buffer");
                self.buffers.unregister(ptr);
                INVALID
            }
        }
    }

    /// Forgets a registration: 0, or -600 when `ptr` starts none.
    fn unregister_buffer(&self, ptr: usize) -> i32 {
        if self.buffers.unregister(ptr) {
            self.store.unregister_local(ptr as *mut u8);
            0
        } else {
            INVALID
        }
    }
}
