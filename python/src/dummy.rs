//! The dummy backend (`setup_dummy`): a [`DummyClient`] of the real client on
//! this host, which talks to the masters for it. Values move through the memory
//! it shares with the real client: zero-copy calls name buffers the caller
//! allocated from the shared pool (`alloc_from_mem_pool`) or from
//! `MooncakeHostMemAllocator` (shared with the real client when registered);
//! copying calls stage values in its staging area.

use std::sync::{Arc, Mutex};

use hkvm_client::dummy::{DummyClient, DummyError, SharedRegion};
use hkvm_client::store::BufferRegistry;
use hkvm_events::rpc::dummy::{
    DummyReply, DummyRequest, Placement as WirePlacement, ReplicaDesc, Span,
};
use pyo3::PyResult;

use crate::backend::{spread, Backend, Batch, Placement, Sink, Wait};
use crate::error::{code_of, INTERNAL, INVALID, OVERFLOW};
use crate::host_memory;
use crate::zero_copy::Part;

/// The port in `server_address` (`host:port`), which names the real client's
/// socket.
pub fn socket_port(server_address: &str) -> Option<u16> {
    server_address
        .rsplit_once(':')
        .map_or(server_address, |(_, port)| port)
        .parse()
        .ok()
}

/// A dummy client and the host memory it shares with its real client.
pub struct Dummy {
    client: DummyClient,
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

impl Dummy {
    /// Connects to the real client serving `port` with a shared region of
    /// `pool_bytes` (the caller's pool) + `staging_bytes` (copying calls).
    ///
    /// # Errors
    /// When the region cannot be made or no real client answers.
    pub async fn connect(
        port: u16,
        pool_bytes: u64,
        staging_bytes: u64,
    ) -> Result<Self, DummyError> {
        Ok(Self {
            client: DummyClient::connect(port, pool_bytes, staging_bytes).await?,
            shared: Mutex::new(Vec::new()),
        })
    }

    fn call(&self, wait: Wait<'_, '_>, request: &DummyRequest) -> Result<DummyReply, i32> {
        wait.on(self.client.call(request)).map_err(|e| code_of(&e))
    }

    /// The span of a registered part when it lies in the shared pool or in
    /// shared host memory.
    fn span(&self, part: Part) -> Option<Span> {
        let (ptr, size) = (part.ptr(), part.size());
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

    /// Each key's parts as spans: the indexes of the keys whose parts all map,
    /// and their spans; `refuse` gets the index of every other key.
    fn spans(
        &self,
        parts: &[Vec<Part>],
        mut refuse: impl FnMut(usize),
    ) -> (Vec<usize>, Vec<Vec<Span>>) {
        let mut wanted = Vec::with_capacity(parts.len());
        let mut spans = Vec::with_capacity(parts.len());
        for (index, parts) in parts.iter().enumerate() {
            match parts.iter().map(|&part| self.span(part)).collect() {
                Some(value) => {
                    wanted.push(index);
                    spans.push(value);
                }
                None => refuse(index),
            }
        }
        (wanted, spans)
    }

    /// Shares the host allocation holding `[ptr, ptr + size)` with the real
    /// client, unless it is shared already: whether the range is now shared.
    fn share_host(&self, wait: Wait<'_, '_>, ptr: usize, size: usize) -> Result<bool, i32> {
        if lock(&self.shared)
            .iter()
            .any(|shared| shared.span(ptr, size).is_some())
        {
            return Ok(true);
        }
        let Some(memory) = host_memory::containing(ptr, size) else {
            return Ok(false);
        };
        let region = wait
            .on(self.client.share(memory.fd(), memory.len()))
            .map_err(|error| {
                tracing::error!(%error, "sharing host memory with the real client");
                code_of(&error)
            })?;
        lock(&self.shared).push(SharedHost { region, memory });
        Ok(true)
    }

    /// Has the real client put each key's value from its spans of shared memory.
    fn put_spans(
        &self,
        wait: Wait<'_, '_>,
        keys: Vec<String>,
        spans: Vec<Vec<Span>>,
        placement: Placement,
    ) -> Batch<i32> {
        let count = keys.len();
        let request = DummyRequest::Put {
            keys,
            spans,
            placement: WirePlacement {
                replicas: placement.replicas,
                preferred_segment: placement.preferred_segment,
                hard_pin: placement.hard_pin,
            },
        };
        codes(self.call(wait, &request), count)
    }
}

impl Backend for Dummy {
    fn hostname(&self, wait: Wait<'_, '_>) -> String {
        wait.on(self.client.hostname()).unwrap_or_default()
    }

    /// Nothing to release beyond dropping the connection and region.
    fn close(&self, _wait: Wait<'_, '_>) {}

    fn health(&self, wait: Wait<'_, '_>) -> i32 {
        match self.call(wait, &DummyRequest::Health) {
            Ok(DummyReply::Health(health)) => health,
            _ => 2,
        }
    }

    /// Copies each value into a staging range, then has the real client put
    /// them from there.
    fn put(
        &self,
        wait: Wait<'_, '_>,
        items: &[(&str, &[&[u8]])],
        placement: Placement,
    ) -> Batch<i32> {
        let mut codes = vec![0; items.len()];
        let mut holding = Staged {
            client: &self.client,
            offsets: Vec::new(),
        };
        let mut wanted = Vec::new();
        let mut spans = Vec::new();
        for (index, (_, parts)) in items.iter().enumerate() {
            let size: u64 = parts.iter().map(|p| p.len() as u64).sum();
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
            for part in *parts {
                target[at..at + part.len()].copy_from_slice(part);
                at += part.len();
            }
            wanted.push(index);
            spans.push(vec![Span::in_pool(offset, size)]);
        }
        if !wanted.is_empty() {
            let keys = wanted.iter().map(|&i| items[i].0.to_owned()).collect();
            spread(
                self.put_spans(wait, keys, spans, placement),
                &wanted,
                &mut codes,
            );
        }
        Ok(codes)
    }

    fn put_from(
        &self,
        wait: Wait<'_, '_>,
        keys: &[&str],
        parts: &[Vec<Part>],
        placement: Placement,
    ) -> Batch<i32> {
        let mut codes = vec![0; keys.len()];
        let (wanted, spans) = self.spans(parts, |index| codes[index] = INVALID);
        if !wanted.is_empty() {
            let keys = wanted.iter().map(|&i| keys[i].to_owned()).collect();
            spread(
                self.put_spans(wait, keys, spans, placement),
                &wanted,
                &mut codes,
            );
        }
        Ok(codes)
    }

    /// Has the real client read each value (of known size) into a staging range,
    /// then copies it from there into its object.
    fn read(
        &self,
        wait: Wait<'_, '_>,
        keys: &[String],
        limit: u64,
        sink: &mut dyn Sink,
    ) -> PyResult<Vec<i32>> {
        let sizes = self
            .size(wait, keys)
            .unwrap_or_else(|code| vec![i64::from(code); keys.len()]);
        let mut codes = vec![0; keys.len()];
        let mut staged = Staged {
            client: &self.client,
            offsets: Vec::new(),
        };
        let mut wanted = Vec::new();
        let mut spans = Vec::new();
        for (index, size) in sizes.iter().enumerate() {
            let size = match u64::try_from(*size) {
                Ok(size) if size <= limit => size,
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
        match self.call(wait, &request) {
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
                    codes[index] = match bytes {
                        Some(bytes) => sink.value(index, bytes.len() as u64, &mut |buffer| {
                            buffer.copy_from_slice(bytes);
                            Ok(())
                        })?,
                        None => INVALID,
                    };
                }
            }
            // A reply of the wrong shape leaves no key's result known.
            Ok(_) => codes.iter_mut().for_each(|c| *c = INTERNAL),
            Err(code) => {
                for &index in &wanted {
                    codes[index] = code;
                }
            }
        }
        Ok(codes)
    }

    fn get_into(&self, wait: Wait<'_, '_>, keys: &[&str], parts: &[Vec<Part>]) -> Batch<i64> {
        let mut results = vec![0; keys.len()];
        let (wanted, spans) = self.spans(parts, |index| results[index] = i64::from(INVALID));
        if wanted.is_empty() {
            return Ok(results);
        }
        let request = DummyRequest::GetInto {
            keys: wanted.iter().map(|&i| keys[i].to_owned()).collect(),
            spans,
        };
        let read = match self.call(wait, &request) {
            Ok(DummyReply::Sizes(read)) if read.len() == wanted.len() => Ok(read),
            Ok(_) => Err(INTERNAL),
            Err(code) => Err(code),
        };
        spread(read, &wanted, &mut results);
        Ok(results)
    }

    fn exist(&self, wait: Wait<'_, '_>, keys: &[String]) -> Batch<i32> {
        match self.call(
            wait,
            &DummyRequest::Exist {
                keys: keys.to_vec(),
            },
        ) {
            Ok(DummyReply::Exist(exists)) if exists.len() == keys.len() => Ok(exists),
            Ok(_) => Err(INTERNAL),
            Err(code) => Err(code),
        }
    }

    fn size(&self, wait: Wait<'_, '_>, keys: &[String]) -> Batch<i64> {
        match self.call(
            wait,
            &DummyRequest::Size {
                keys: keys.to_vec(),
            },
        ) {
            Ok(DummyReply::Sizes(sizes)) if sizes.len() == keys.len() => Ok(sizes),
            Ok(_) => Err(INTERNAL),
            Err(code) => Err(code),
        }
    }

    fn replicas(
        &self,
        wait: Wait<'_, '_>,
        keys: &[String],
    ) -> Batch<Result<Vec<ReplicaDesc>, i32>> {
        match self.call(
            wait,
            &DummyRequest::Replicas {
                keys: keys.to_vec(),
            },
        ) {
            Ok(DummyReply::Replicas(replicas)) if replicas.len() == keys.len() => Ok(replicas),
            Ok(_) => Err(INTERNAL),
            Err(code) => Err(code),
        }
    }

    fn remove(&self, wait: Wait<'_, '_>, keys: Vec<String>, force: bool) -> Batch<i32> {
        let count = keys.len();
        codes(
            self.call(wait, &DummyRequest::Remove { keys, force }),
            count,
        )
    }

    fn remove_all(
        &self,
        wait: Wait<'_, '_>,
        pattern: Option<String>,
        tenant: Option<String>,
        force: bool,
    ) -> i64 {
        let request = DummyRequest::RemoveAll {
            pattern,
            force,
            tenant,
        };
        match self.call(wait, &request) {
            Ok(DummyReply::Count(count)) => count,
            Ok(_) => i64::from(INTERNAL),
            Err(code) => i64::from(code),
        }
    }

    /// Accepts memory of the shared pool as it is, and shares host memory from
    /// `MooncakeHostMemAllocator` with the real client; any other memory is
    /// refused, since the real client could not reach it.
    fn attach(&self, wait: Wait<'_, '_>, ptr: usize, size: usize) -> Result<(), i32> {
        let base = self.client.region().base();
        let pool_end = base + self.client.pool_bytes() as usize;
        let in_pool = ptr >= base && ptr.checked_add(size).is_some_and(|end| end <= pool_end);
        if in_pool || self.share_host(wait, ptr, size)? {
            return Ok(());
        }
        tracing::error!(
            ptr,
            size,
            "a dummy client's buffer must lie in its shared pool \
             (alloc_from_mem_pool) or in MooncakeHostMemAllocator memory"
        );
        Err(INVALID)
    }

    /// Host memory is no longer shared once no registration lies in it.
    fn detach(&self, wait: Wait<'_, '_>, buffers: &BufferRegistry, _ptr: usize) {
        let unused: Vec<u32> = lock(&self.shared)
            .iter()
            .filter(|shared| !buffers.overlaps(shared.memory.base(), shared.memory.len() as usize))
            .map(|shared| shared.region)
            .collect();
        for region in unused {
            lock(&self.shared).retain(|shared| shared.region != region);
            if let Err(error) = wait.on(self.client.release(region)) {
                tracing::warn!(%error, region, "releasing shared host memory");
            }
        }
    }

    fn has_mem_pool(&self) -> bool {
        true
    }

    fn pool_alloc(&self, size: u64) -> usize {
        self.client
            .pool_alloc(size)
            .map_or(0, |offset| self.client.region().base() + offset as usize)
    }

    fn pool_free(&self, ptr: usize) -> bool {
        let offset = ptr.wrapping_sub(self.client.region().base()) as u64;
        self.client.pool_free(offset)
    }
}

/// Per-key codes from a reply to a request of `count` keys, or the code of the
/// whole request's failure (a refusal, a lost connection, a reply of the wrong
/// shape).
fn codes(reply: Result<DummyReply, i32>, count: usize) -> Batch<i32> {
    match reply {
        Ok(DummyReply::Codes(codes)) if codes.len() == count => Ok(codes),
        Ok(DummyReply::Refused { code, .. }) | Err(code) => Err(code),
        Ok(_) => Err(INTERNAL),
    }
}

fn lock<T>(mutex: &Mutex<T>) -> std::sync::MutexGuard<'_, T> {
    mutex.lock().unwrap_or_else(|p| p.into_inner())
}
