//! The store surface the Python class drives, as a [`Backend`] trait with two
//! implementations: the embedded store (`crate::embedded`) and a dummy client of
//! a real client's store (`crate::dummy`). A backend takes arguments already
//! checked and converted and answers with Mooncake codes; checking the
//! arguments' shape, placing results at their keys' positions and making Python
//! objects are the class's (`crate::native`), written once for both.

use std::future::Future;

use hkvm_client::store::BufferRegistry;
use hkvm_events::rpc::dummy::ReplicaDesc;
use pyo3::prelude::*;

use crate::zero_copy::Part;
use hkvm_client::spin::{self, Call, Spinning};

/// Per item a result, or the code of a failure of the whole call.
pub type Batch<T> = Result<Vec<T>, i32>;

/// Where a put's first replica goes and how it is kept.
#[derive(Debug, Clone)]
pub struct Placement {
    /// Copies on distinct nodes, as the caller asked (0 is taken as 1).
    pub replicas: u32,
    /// The first replica's preferred segment (`host:port`), if any.
    pub preferred_segment: Option<String>,
    /// Never evict.
    pub hard_pin: bool,
}

/// Runs a backend's futures on the runtime the class owns, with the GIL
/// released: other Python threads run while a call waits on the network or
/// copies. A call's wait spins first as its store's [`Spinning`] allows
/// (`hkvm_client::spin`); set-up calls just sleep.
#[derive(Clone, Copy)]
pub struct Wait<'a, 'py> {
    py: Python<'py>,
    runtime: &'a tokio::runtime::Runtime,
    spinning: Option<(&'a Spinning, Call)>,
}

impl<'a, 'py> Wait<'a, 'py> {
    /// Waits on `runtime` for a caller holding the GIL as `py`, sleeping at once.
    pub fn new(py: Python<'py>, runtime: &'a tokio::runtime::Runtime) -> Self {
        Self {
            py,
            runtime,
            spinning: None,
        }
    }

    /// The same wait for a `call`, spinning first as `spinning` allows.
    pub fn spinning(self, spinning: &'a Spinning, call: Call) -> Self {
        Self {
            spinning: Some((spinning, call)),
            ..self
        }
    }

    /// Runs `future` to completion with the GIL released.
    pub fn on<F>(self, future: F) -> F::Output
    where
        F: Future + Send,
        F::Output: Send,
    {
        let runtime = self.runtime;
        match self.spinning {
            Some((spinning, call)) => self
                .py
                .detach(move || spin::run(runtime, spinning, call, future)),
            None => self.py.detach(move || runtime.block_on(future)),
        }
    }
}

/// The fill of one value's memory: `Ok` once it holds the value, else a code.
pub type Fill<'f> = dyn FnMut(&mut [u8]) -> Result<(), i32> + 'f;

/// Where a copying read puts values: it makes one Python object per value and
/// lets the backend fill that object's memory.
pub trait Sink {
    /// Makes the object for the key at `index`, `size` bytes long, and has `fill`
    /// write the value into it: 0, or the code of a failed fill.
    ///
    /// # Errors
    /// When Python fails to make the object; the read stops there.
    fn value(&mut self, index: usize, size: u64, fill: &mut Fill<'_>) -> PyResult<i32>;
}

/// A store the Python class can drive: every Mooncake call it serves, in the
/// terms both backends share. Nothing here raises: a failure is a code, and a
/// [`Batch`] has one result per item, in order.
pub trait Backend: Send + Sync {
    /// This process's transfer endpoint, `host:port`.
    fn hostname(&self, wait: Wait<'_, '_>) -> String;

    /// Stops what this backend runs for the cluster (its node, if any).
    fn close(&self, wait: Wait<'_, '_>);

    /// 0 healthy, 1 closed, 2 when the sub-master (or the real client) does not
    /// answer.
    fn health(&self, wait: Wait<'_, '_>) -> i32;

    /// Puts values given as parts in memory, concatenated in order: per item 0
    /// or a negative code.
    fn put(
        &self,
        wait: Wait<'_, '_>,
        items: &[(&str, &[&[u8]])],
        placement: Placement,
    ) -> Batch<i32>;

    /// Puts values read from registered memory (per key its parts): per key 0 or
    /// a negative code.
    fn put_from(
        &self,
        wait: Wait<'_, '_>,
        keys: &[&str],
        parts: &[Vec<Part>],
        placement: Placement,
    ) -> Batch<i32>;

    /// Reads each value no larger than `limit` (the staging bound of copying
    /// calls) into the object `sink` makes for it: per key 0, or the code that
    /// kept its object from being made or filled (`BUFFER_OVERFLOW` above
    /// `limit`).
    ///
    /// # Errors
    /// The Python error of a [`Sink`] that failed to make an object.
    fn read(
        &self,
        wait: Wait<'_, '_>,
        keys: &[String],
        limit: u64,
        sink: &mut dyn Sink,
    ) -> PyResult<Vec<i32>>;

    /// Where each key's replicas are: per key its descriptors or a negative code.
    fn replicas(&self, wait: Wait<'_, '_>, keys: &[String])
        -> Batch<Result<Vec<ReplicaDesc>, i32>>;

    /// Reads values into registered memory, each filling its key's parts in
    /// order: per key the value's size or a negative code.
    fn get_into(&self, wait: Wait<'_, '_>, keys: &[&str], parts: &[Vec<Part>]) -> Batch<i64>;

    /// Whether each key exists anywhere in the cluster: 1 or 0.
    fn exist(&self, wait: Wait<'_, '_>, keys: &[String]) -> Batch<i32>;

    /// Per key its value's size or a negative code.
    fn size(&self, wait: Wait<'_, '_>, keys: &[String]) -> Batch<i64>;

    /// Removes keys wherever they are (leased ones only with `force`): per key 0
    /// or a negative code.
    fn remove(&self, wait: Wait<'_, '_>, keys: Vec<String>, force: bool) -> Batch<i32>;

    /// Removes every object (or those whose key matches `pattern`; with a
    /// `tenant`, only that tenant's): how many, or a negative code.
    fn remove_all(
        &self,
        wait: Wait<'_, '_>,
        pattern: Option<String>,
        tenant: Option<String>,
        force: bool,
    ) -> i64;

    /// Prepares `[ptr, ptr + size)`, just registered, for zero-copy calls; the
    /// caller keeps it valid until it unregisters it. On `Err(code)` the caller
    /// unregisters it again and returns the code.
    fn attach(&self, wait: Wait<'_, '_>, ptr: usize, size: usize) -> Result<(), i32>;

    /// Undoes [`Backend::attach`] for the registration at `ptr`, which `buffers`
    /// no longer holds.
    fn detach(&self, wait: Wait<'_, '_>, buffers: &BufferRegistry, ptr: usize);

    /// Whether zero-copy memory comes from a pool shared with a real client
    /// (`alloc_from_mem_pool`); without one, the caller's own memory serves.
    fn has_mem_pool(&self) -> bool {
        false
    }

    /// An address of `size` bytes in that pool: 0 when it is full, or there is
    /// none.
    fn pool_alloc(&self, size: u64) -> usize {
        let _ = size;
        0
    }

    /// Gives an address from [`Backend::pool_alloc`] back: whether it was one.
    fn pool_free(&self, ptr: usize) -> bool {
        let _ = ptr;
        false
    }
}

/// Places a batch's results (or the code of its whole failure) into `out` at
/// `indexes`, one per item in order.
pub fn spread<T: Copy + From<i32>>(batch: Batch<T>, indexes: &[usize], out: &mut [T]) {
    match batch {
        Ok(results) => {
            for (&index, result) in indexes.iter().zip(results) {
                out[index] = result;
            }
        }
        Err(code) => {
            for &index in indexes {
                out[index] = T::from(code);
            }
        }
    }
}
