//! `NativeStore`: one set-up [`Backend`] (the embedded store, or a dummy client
//! of a real client) and the Tokio runtime that drives it, with the list-in,
//! list-out methods the Python layer calls. Each method checks its arguments'
//! shape, calls the backend with the GIL released and places the results at
//! their keys' positions. Results are Mooncake codes (0 or negative), sizes, or
//! Python objects; nothing here raises after setup.

use hkvm_client::store::{check_host_range, BufferRegistry};
use pyo3::prelude::*;
use pyo3::types::{PyByteArray, PyBytes};

use crate::backend::{spread, Backend, Fill, Placement, Sink, Wait};
use crate::dummy::{self, Dummy};
use crate::embedded::{self, Embedded};
use crate::error::{setup_failed, setup_refused, HkvmError, INTERNAL, INVALID, OVERFLOW};
use crate::zero_copy::{select, Part};
use hkvm_client::spin::{Call, Spinning};

/// How Python passes a put's placement: replicas, preferred segment
/// (`host:port`), hard pin.
type PyPlacement = (u32, Option<String>, bool);

impl From<PyPlacement> for Placement {
    fn from((replicas, preferred_segment, hard_pin): PyPlacement) -> Self {
        Self {
            replicas,
            preferred_segment,
            hard_pin,
        }
    }
}

/// A multi-threaded runtime of `workers` threads named `name`.
fn runtime(workers: usize, name: &str) -> PyResult<tokio::runtime::Runtime> {
    tokio::runtime::Builder::new_multi_thread()
        .worker_threads(workers)
        .thread_name(name)
        .enable_all()
        .build()
        .map_err(|e| setup_refused(INTERNAL, e.to_string()))
}

/// A set-up store (see `hkvm.store.MooncakeDistributedStore`): `NativeStore(...)`
/// for `setup`, `NativeStore.dummy(...)` for `setup_dummy`.
#[pyclass(frozen, module = "hkvm._native")]
pub struct NativeStore {
    runtime: Option<tokio::runtime::Runtime>,
    backend: Box<dyn Backend>,
    /// Memory the caller registered for zero-copy calls.
    buffers: BufferRegistry,
    /// The staging bound of copying calls.
    local_buffer_size: u64,
    /// How calls wait for their answers.
    spinning: Spinning,
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
    fn with(
        runtime: tokio::runtime::Runtime,
        backend: Box<dyn Backend>,
        local_buffer_size: u64,
    ) -> Self {
        Self {
            runtime: Some(runtime),
            backend,
            buffers: BufferRegistry::default(),
            local_buffer_size,
            spinning: Spinning::from_env(),
        }
    }

    /// Waits on the store's runtime for a `call` of the caller holding the GIL
    /// as `py`.
    fn wait<'a, 'py>(&'a self, py: Python<'py>, call: Call) -> Wait<'a, 'py> {
        match &self.runtime {
            Some(runtime) => Wait::new(py, runtime).spinning(&self.spinning, call),
            None => unreachable!("the runtime lives as long as the store"),
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
        let runtime = runtime(2, "hkvm-store")?;
        let address = Wait::new(py, &runtime)
            .on(embedded::address(master_server_addr, &local_hostname))
            .map_err(|e| setup_failed(&e))?;
        let config = embedded::config(
            local_hostname,
            address,
            global_segment_size,
            local_buffer_size,
            protocol,
            rdma_devices,
        )
        .map_err(|e| setup_failed(&e))?;
        let store = Wait::new(py, &runtime)
            .on(Embedded::open(config))
            .map_err(|e| setup_failed(&e))?;
        Ok(Self::with(runtime, Box::new(store), local_buffer_size))
    }

    /// Connects to the real client serving `server_address` (`host:port`; the
    /// port names its socket) with a shared region of `mem_pool_size` +
    /// `local_buffer_size` bytes.
    ///
    /// # Errors
    /// `HkvmError((code, message))` when the address is bad or no real client
    /// answers.
    #[staticmethod]
    fn dummy(
        py: Python<'_>,
        mem_pool_size: u64,
        local_buffer_size: u64,
        server_address: &str,
    ) -> PyResult<Self> {
        let port = dummy::socket_port(server_address).ok_or_else(|| {
            setup_refused(
                INVALID,
                format!("server_address {server_address:?} has no port (host:port)"),
            )
        })?;
        let runtime = runtime(1, "hkvm-dummy")?;
        let client = Wait::new(py, &runtime)
            .on(Dummy::connect(port, mem_pool_size, local_buffer_size))
            .map_err(|e| setup_failed(&e))?;
        Ok(Self::with(runtime, Box::new(client), local_buffer_size))
    }

    /// This process's transfer endpoint (`host:port`); a dummy's is its real
    /// client's.
    fn hostname(&self, py: Python<'_>) -> String {
        self.backend.hostname(self.wait(py, Call::Other))
    }

    /// The staging bound of copying calls.
    fn local_buffer_size(&self) -> u64 {
        self.local_buffer_size
    }

    /// Unmounts this process's segment and stops its node (a dummy has neither).
    fn close(&self, py: Python<'_>) {
        self.backend.close(self.wait(py, Call::Other));
    }

    /// 0 healthy, 1 closed, 2 sub-master (or real client) unreachable.
    fn health(&self, py: Python<'_>) -> i32 {
        self.backend.health(self.wait(py, Call::Other))
    }

    /// Puts values given as bytes parts (one list of parts per key). With
    /// `staged`, a value larger than the staging buffer is refused.
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
        if !items.is_empty() {
            let results =
                self.backend
                    .put(self.wait(py, Call::Put), &items, Placement::from(placement));
            spread(results, &indexes, &mut codes);
        }
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
        placement: PyPlacement,
    ) -> Vec<i32> {
        let selected = select(keys.len(), &ptrs, &sizes, |ptr, size| {
            Part::registered(&self.buffers, ptr, size)
        });
        let Some(selected) = selected else {
            return vec![INVALID; keys.len()];
        };
        let mut codes = vec![0; keys.len()];
        for &index in &selected.refused {
            codes[index] = INVALID;
        }
        if selected.indexes.is_empty() {
            return codes;
        }
        let served: Vec<&str> = selected.indexes.iter().map(|&i| keys[i].as_str()).collect();
        let results = self.backend.put_from(
            self.wait(py, Call::Put),
            &served,
            &selected.parts,
            Placement::from(placement),
        );
        spread(results, &selected.indexes, &mut codes);
        codes
    }

    /// Reads values as bytes: per key the bytes, or an int code when it failed
    /// (missing, larger than the staging buffer, unreadable).
    fn get(&self, py: Python<'_>, keys: Vec<String>) -> PyResult<Vec<Py<PyAny>>> {
        let mut sink = Bytes {
            py,
            values: keys.iter().map(|_| None).collect(),
        };
        let codes = self.backend.read(
            self.wait(py, Call::Get),
            &keys,
            self.local_buffer_size,
            &mut sink,
        )?;
        sink.values
            .into_iter()
            .zip(codes)
            .map(|(value, code)| match value {
                Some(value) => Ok(value),
                None => Ok(code.into_pyobject(py)?.into_any().unbind()),
            })
            .collect()
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
            Part::registered(&self.buffers, ptr, size)
        });
        let Some(selected) = selected else {
            return vec![i64::from(INVALID); keys.len()];
        };
        let mut results = vec![0i64; keys.len()];
        for &index in &selected.refused {
            results[index] = i64::from(INVALID);
        }
        if selected.indexes.is_empty() {
            return results;
        }
        let served: Vec<&str> = selected.indexes.iter().map(|&i| keys[i].as_str()).collect();
        let read = self
            .backend
            .get_into(self.wait(py, Call::Get), &served, &selected.parts);
        spread(read, &selected.indexes, &mut results);
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
        let mut sink = Buffers {
            factory,
            values: keys.iter().map(|_| py.None()).collect(),
        };
        self.backend.read(
            self.wait(py, Call::Get),
            &keys,
            self.local_buffer_size,
            &mut sink,
        )?;
        Ok(sink.values)
    }

    /// Whether keys exist anywhere: 1 or 0 each, or -1 each when the check failed.
    fn exist(&self, py: Python<'_>, keys: Vec<String>) -> Vec<i32> {
        self.backend
            .exist(self.wait(py, Call::Query), &keys)
            .unwrap_or_else(|_| vec![-1; keys.len()])
    }

    /// Everything a query does but the request: takes a list of keys, releases
    /// the GIL, runs an already finished future the way calls wait (polled on this
    /// thread, spinning allowed) and returns one 0 per key. `hkvm bench python`
    /// times it against the plain function `noop` to show what the binding adds
    /// per call.
    fn idle_call(&self, py: Python<'_>, keys: Vec<String>) -> Vec<i32> {
        self.wait(py, Call::Query).on(async { vec![0; keys.len()] })
    }

    /// Copies byte ranges of values into registered memory (Mooncake's
    /// `get_into_ranges`): per key its ranges as (destination pointer, offset in
    /// the value, length). Each value is read whole and verified against its
    /// checksum before any range is copied. Per key, per range, the bytes copied
    /// or a negative code (`INVALID` for a destination outside registered memory
    /// or a range beyond the value; the read's code for a missing or unreadable
    /// key).
    fn get_into_ranges(
        &self,
        py: Python<'_>,
        keys: Vec<String>,
        ranges: Vec<Vec<(usize, u64, usize)>>,
    ) -> PyResult<Vec<Vec<i64>>> {
        if keys.len() != ranges.len() {
            return Ok(ranges
                .iter()
                .map(|r| vec![i64::from(INVALID); r.len()])
                .collect());
        }
        let mut sink = Ranges {
            targets: ranges
                .iter()
                .map(|key_ranges| {
                    key_ranges
                        .iter()
                        .map(|&(ptr, offset, len)| {
                            Part::registered(&self.buffers, ptr, len)
                                .filter(|_| len > 0)
                                .map(|part| (part, offset))
                        })
                        .collect()
                })
                .collect(),
            // An empty range copies nothing and succeeds, as on Mooncake.
            copied: ranges
                .iter()
                .map(|r| {
                    r.iter()
                        .map(|&(_, _, len)| if len == 0 { 0 } else { i64::from(INVALID) })
                        .collect()
                })
                .collect(),
        };
        // Only keys with a range to copy are read.
        let wanted: Vec<usize> = (0..keys.len())
            .filter(|&i| sink.targets[i].iter().any(Option::is_some))
            .collect();
        if wanted.is_empty() {
            return Ok(sink.copied);
        }
        let read_keys: Vec<String> = wanted.iter().map(|&i| keys[i].clone()).collect();
        let mut positioned = Positioned {
            sink: &mut sink,
            indexes: &wanted,
        };
        let codes = self.backend.read(
            self.wait(py, Call::Get),
            &read_keys,
            u64::MAX,
            &mut positioned,
        )?;
        for (&index, code) in wanted.iter().zip(codes) {
            if code != 0 {
                for (copied, target) in sink.copied[index].iter_mut().zip(&sink.targets[index]) {
                    if target.is_some() {
                        *copied = i64::from(code);
                    }
                }
            }
        }
        Ok(sink.copied)
    }

    /// Where each key's replicas are: per key a list of (size, offset in the
    /// segment, transfer endpoint), or a negative code.
    fn replicas(&self, py: Python<'_>, keys: Vec<String>) -> PyResult<Vec<Py<PyAny>>> {
        let found = self
            .backend
            .replicas(self.wait(py, Call::Query), &keys)
            .unwrap_or_else(|code| vec![Err(code); keys.len()]);
        found
            .into_iter()
            .map(|result| match result {
                Ok(replicas) => Ok(replicas
                    .into_iter()
                    .map(|r| (r.size, r.offset, r.endpoint))
                    .collect::<Vec<_>>()
                    .into_pyobject(py)?
                    .into_any()
                    .unbind()),
                Err(code) => Ok(code.into_pyobject(py)?.into_any().unbind()),
            })
            .collect()
    }

    /// Per key its value's size, or a negative code.
    fn size(&self, py: Python<'_>, keys: Vec<String>) -> Vec<i64> {
        self.backend
            .size(self.wait(py, Call::Query), &keys)
            .unwrap_or_else(|code| vec![i64::from(code); keys.len()])
    }

    /// Removes keys wherever they are: per key 0 or a negative code.
    fn remove(&self, py: Python<'_>, keys: Vec<String>, force: bool) -> Vec<i32> {
        let count = keys.len();
        self.backend
            .remove(self.wait(py, Call::Other), keys, force)
            .unwrap_or_else(|code| vec![code; count])
    }

    /// Removes every object (or those whose key matches `pattern`) in the cluster;
    /// with a `tenant`, only that tenant's keys, matched as the tenant names them:
    /// how many, or a negative code.
    #[pyo3(signature = (pattern, tenant, force))]
    fn remove_all(
        &self,
        py: Python<'_>,
        pattern: Option<String>,
        tenant: Option<String>,
        force: bool,
    ) -> i64 {
        self.backend
            .remove_all(self.wait(py, Call::Other), pattern, tenant, force)
    }

    /// Registers `[ptr, ptr + size)` for zero-copy calls: 0, or -600 for a null,
    /// empty or overlapping range (on a dummy also for memory outside its shared
    /// pool and `MooncakeHostMemAllocator` memory), or the code of a failure to
    /// share it.
    fn register_buffer(&self, py: Python<'_>, ptr: usize, size: usize) -> i32 {
        // A GPU tensor's data_ptr() (vLLM registers its KV cache) would be
        // dereferenced on the CPU by every later call: refuse it here.
        if let Err(error) = check_host_range(ptr, size) {
            tracing::error!(
                ptr = format_args!("{ptr:#x}"),
                size,
                %error,
                "register_buffer refused: HKVM moves host memory only (a GPU device pointer? register host or pinned memory)"
            );
            return INVALID;
        }
        if self.buffers.register(ptr, size).is_err() {
            return INVALID;
        }
        match self.backend.attach(self.wait(py, Call::Other), ptr, size) {
            Ok(()) => 0,
            Err(code) => {
                self.buffers.unregister(ptr);
                code
            }
        }
    }

    /// Forgets a registration: 0, or -600 when `ptr` starts none.
    fn unregister_buffer(&self, py: Python<'_>, ptr: usize) -> i32 {
        if !self.buffers.unregister(ptr) {
            return INVALID;
        }
        self.backend
            .detach(self.wait(py, Call::Other), &self.buffers, ptr);
        0
    }

    /// Whether zero-copy memory must come from `alloc_from_mem_pool` (a dummy's
    /// pool shared with its real client) rather than from the caller.
    fn has_mem_pool(&self) -> bool {
        self.backend.has_mem_pool()
    }

    /// An address of `size` bytes in the shared pool, or 0 when it is full (or
    /// there is none).
    fn alloc_from_mem_pool(&self, size: u64) -> usize {
        self.backend.pool_alloc(size)
    }

    /// Gives an address from `alloc_from_mem_pool` back: 0 or -600.
    fn free_to_mem_pool(&self, ptr: usize) -> i32 {
        if self.backend.pool_free(ptr) {
            0
        } else {
            INVALID
        }
    }
}

/// Read values as new `bytes` objects, filled in place.
struct Bytes<'py> {
    py: Python<'py>,
    values: Vec<Option<Py<PyAny>>>,
}

impl Sink for Bytes<'_> {
    fn value(&mut self, index: usize, size: u64, fill: &mut Fill<'_>) -> PyResult<i32> {
        let size = usize::try_from(size).unwrap_or(usize::MAX);
        let mut failed = 0;
        let bytes = PyBytes::new_with(self.py, size, |buffer| {
            fill(buffer).map_err(|code| {
                failed = code;
                HkvmError::new_err(code)
            })
        });
        if let Ok(bytes) = bytes {
            self.values[index] = Some(bytes.into_any().unbind());
        }
        Ok(failed)
    }
}

/// Ranges of read values copied into registered memory
/// ([`NativeStore::get_into_ranges`]).
struct Ranges {
    /// Per key, per range: where it goes and its offset in the value, or `None`
    /// for a destination outside registered memory.
    targets: Vec<Vec<Option<(Part, u64)>>>,
    /// Per key, per range: bytes copied or a negative code.
    copied: Vec<Vec<i64>>,
}

impl Sink for Ranges {
    fn value(&mut self, index: usize, size: u64, fill: &mut Fill<'_>) -> PyResult<i32> {
        let Ok(len) = usize::try_from(size) else {
            return Ok(OVERFLOW);
        };
        let mut value = vec![0u8; len];
        if let Err(code) = fill(&mut value) {
            return Ok(code);
        }
        for (target, copied) in self.targets[index].iter().zip(&mut self.copied[index]) {
            let Some((part, offset)) = target else {
                continue;
            };
            let range = usize::try_from(*offset)
                .ok()
                .and_then(|start| Some(start..start.checked_add(part.size())?))
                .filter(|range| range.end <= value.len());
            *copied = match range {
                Some(range) => {
                    // SAFETY: the part lies inside memory the caller registered
                    // and promised to keep valid, and not to touch while this
                    // call writes it.
                    let destination = unsafe {
                        std::slice::from_raw_parts_mut(part.ptr() as *mut u8, part.size())
                    };
                    destination.copy_from_slice(&value[range]);
                    i64::try_from(part.size()).unwrap_or(i64::MAX)
                }
                None => i64::from(INVALID),
            };
        }
        Ok(0)
    }
}

/// A sink seen through a map from the read's positions to the request's.
struct Positioned<'a, S> {
    sink: &'a mut S,
    indexes: &'a [usize],
}

impl<S: Sink> Sink for Positioned<'_, S> {
    fn value(&mut self, index: usize, size: u64, fill: &mut Fill<'_>) -> PyResult<i32> {
        self.sink.value(self.indexes[index], size, fill)
    }
}

/// Read values in buffers a Python factory makes (`BufferHandle`); `None` for a
/// value that could not be read.
struct Buffers<'a, 'py> {
    factory: &'a Bound<'py, PyAny>,
    values: Vec<Py<PyAny>>,
}

impl Sink for Buffers<'_, '_> {
    fn value(&mut self, index: usize, size: u64, fill: &mut Fill<'_>) -> PyResult<i32> {
        let handle = self.factory.call1((size,))?;
        let array = handle.cast::<PyByteArray>()?;
        // SAFETY: the buffer was just created here and is not yet visible to any
        // other Python code, so nothing can resize or read it while it is filled
        // with the GIL released.
        let buffer = unsafe { array.as_bytes_mut() };
        Ok(match fill(buffer) {
            Ok(()) => {
                self.values[index] = handle.unbind();
                0
            }
            Err(code) => code,
        })
    }
}
