//! The embedded backend (`setup`): a [`Store`] in this process, which talks to
//! the sub-master itself and, with a segment size, runs this process's node.
//! Zero-copy calls move values straight between the caller's registered memory
//! and the transport.

use hkvm_client::store::choose::LabeledAddress;
use hkvm_client::store::{
    segment_for, BufferRegistry, Store, StoreAddress, StoreConfig, StoreError,
};
use hkvm_client::{Protocol, PutOptions};
use hkvm_events::rpc::dummy::ReplicaDesc;
use pyo3::PyResult;

use crate::backend::{Backend, Batch, Placement, Sink, Wait};
use crate::error::{code_of, INVALID, OVERFLOW};
use crate::zero_copy::Part;

/// The configuration of a store from `setup`'s arguments.
///
/// # Errors
/// An unknown protocol.
pub fn config(
    local_hostname: String,
    address: StoreAddress,
    global_segment_size: u64,
    local_buffer_size: u64,
    protocol: &str,
    rdma_devices: &str,
) -> Result<StoreConfig, StoreError> {
    let protocol = Protocol::parse(protocol, rdma_devices)
        .map_err(|e| StoreError::InvalidParams(e.to_string()))?;
    let mut config = StoreConfig::new(address, local_hostname);
    config.global_segment_size = global_segment_size;
    config.local_buffer_size = local_buffer_size;
    config.protocol = protocol;
    Ok(config)
}

/// The sub-cluster address `master_server_addr` names, or (for
/// `nats://…/<cluster>/*?k=v`) the one its labels choose for the node on
/// `local_hostname`'s host.
///
/// # Errors
/// An address that parses in neither form, or a choice that cannot be made.
pub async fn address(
    master_server_addr: &str,
    local_hostname: &str,
) -> Result<StoreAddress, StoreError> {
    let named = master_server_addr.parse::<StoreAddress>();
    let Err(not_named) = named else {
        return named.map_err(StoreError::Address);
    };
    match master_server_addr.parse::<LabeledAddress>() {
        Ok(labeled) => {
            let host = match local_hostname.rsplit_once(':') {
                Some((host, port)) if port.parse::<u16>().is_ok() => host,
                _ => local_hostname,
            };
            labeled.resolve(host).await
        }
        Err(_) => Err(StoreError::Address(not_named)),
    }
}

/// A set-up store in this process.
pub struct Embedded {
    store: Store,
}

impl Embedded {
    /// Connects to the sub-cluster `config` names, checks its sub-master answers
    /// and, with a segment size, starts this process's node.
    ///
    /// # Errors
    /// When any of that fails.
    pub async fn open(config: StoreConfig) -> Result<Self, StoreError> {
        Ok(Self {
            store: Store::open(config).await?,
        })
    }
}

/// Put options from a placement: at least one replica, and a preferred segment
/// only when it names one.
fn options(placement: &Placement) -> PutOptions {
    PutOptions {
        replicas: placement.replicas.max(1),
        preferred_segment: placement
            .preferred_segment
            .as_deref()
            .filter(|s| !s.is_empty())
            .and_then(segment_for),
        hard_pin: placement.hard_pin,
    }
}

impl Backend for Embedded {
    fn hostname(&self, _wait: Wait<'_, '_>) -> String {
        self.store.hostname().to_owned()
    }

    fn close(&self, wait: Wait<'_, '_>) {
        wait.on(self.store.close());
    }

    fn health(&self, wait: Wait<'_, '_>) -> i32 {
        wait.on(self.store.health()) as i32
    }

    fn put(
        &self,
        wait: Wait<'_, '_>,
        items: &[(&str, &[&[u8]])],
        placement: Placement,
    ) -> Batch<i32> {
        match wait.on(self.store.put(items, &options(&placement))) {
            Ok(results) => Ok(results
                .into_iter()
                .map(|result| result.map_or_else(|e| code_of(&e), |()| 0))
                .collect()),
            Err(error) => Err(code_of(&error)),
        }
    }

    fn put_from(
        &self,
        wait: Wait<'_, '_>,
        keys: &[&str],
        parts: &[Vec<Part>],
        placement: Placement,
    ) -> Batch<i32> {
        // Every key's slices in one vector, so that a call allocates twice and
        // not once per key.
        let slices: Vec<&[u8]> = parts
            .iter()
            .flatten()
            // SAFETY: a part lies inside memory the caller registered and
            // promised to keep valid until it unregisters it; the bytes are only
            // read, during this call.
            .map(|part| unsafe { std::slice::from_raw_parts(part.ptr() as *const u8, part.size()) })
            .collect();
        let mut items = Vec::with_capacity(keys.len());
        let mut rest = slices.as_slice();
        for (&key, parts) in keys.iter().zip(parts) {
            let (value, tail) = rest.split_at(parts.len());
            items.push((key, value));
            rest = tail;
        }
        self.put(wait, &items, placement)
    }

    fn read(
        &self,
        wait: Wait<'_, '_>,
        keys: &[String],
        limit: u64,
        sink: &mut dyn Sink,
    ) -> PyResult<Vec<i32>> {
        let refs: Vec<&str> = keys.iter().map(String::as_str).collect();
        let located = match wait.on(self.store.locate(&refs)) {
            Ok(located) => located,
            Err(error) => return Ok(vec![code_of(&error); keys.len()]),
        };
        let mut codes = vec![0; keys.len()];
        for (index, (key, located)) in keys.iter().zip(located).enumerate() {
            codes[index] = match located {
                Err(error) => code_of(&error),
                Ok(located) if located.list.size > limit => OVERFLOW,
                // The value is read straight into the object's memory, with the
                // GIL released while it arrives.
                Ok(located) => sink.value(index, located.list.size, &mut |buffer| {
                    wait.on(self.store.read_located(key, &located, &mut [buffer]))
                        .map(|_| ())
                        .map_err(|error| code_of(&error))
                })?,
            };
        }
        Ok(codes)
    }

    fn get_into(&self, wait: Wait<'_, '_>, keys: &[&str], parts: &[Vec<Part>]) -> Batch<i64> {
        let mut buffers: Vec<&mut [u8]> = parts
            .iter()
            .flatten()
            // SAFETY: a part lies inside memory the caller registered and
            // promised to keep valid, and not to touch while this call writes it.
            .map(|part| unsafe {
                std::slice::from_raw_parts_mut(part.ptr() as *mut u8, part.size())
            })
            .collect();
        let mut items: Vec<(&str, &mut [&mut [u8]])> = Vec::with_capacity(keys.len());
        let mut rest = buffers.as_mut_slice();
        for (&key, parts) in keys.iter().zip(parts) {
            let (value, tail) = std::mem::take(&mut rest).split_at_mut(parts.len());
            items.push((key, value));
            rest = tail;
        }
        match wait.on(self.store.get_into(&mut items)) {
            Ok(read) => Ok(read
                .into_iter()
                .map(|result| {
                    result.map_or_else(
                        |e| i64::from(code_of(&e)),
                        |size| i64::try_from(size).unwrap_or(i64::MAX),
                    )
                })
                .collect()),
            Err(error) => Err(code_of(&error)),
        }
    }

    fn exist(&self, wait: Wait<'_, '_>, keys: &[String]) -> Batch<i32> {
        match wait.on(self.store.exist(keys)) {
            Ok(exists) => Ok(exists.into_iter().map(i32::from).collect()),
            Err(error) => Err(code_of(&error)),
        }
    }

    fn size(&self, wait: Wait<'_, '_>, keys: &[String]) -> Batch<i64> {
        let refs: Vec<&str> = keys.iter().map(String::as_str).collect();
        match wait.on(self.store.locate(&refs)) {
            Ok(located) => Ok(located
                .into_iter()
                .map(|l| {
                    l.map_or_else(
                        |e| i64::from(code_of(&e)),
                        |l| i64::try_from(l.list.size).unwrap_or(i64::MAX),
                    )
                })
                .collect()),
            Err(error) => Err(code_of(&error)),
        }
    }

    fn replicas(
        &self,
        wait: Wait<'_, '_>,
        keys: &[String],
    ) -> Batch<Result<Vec<ReplicaDesc>, i32>> {
        let refs: Vec<&str> = keys.iter().map(String::as_str).collect();
        match wait.on(self.store.locate(&refs)) {
            Ok(located) => Ok(located
                .into_iter()
                .map(|l| l.map(|l| ReplicaDesc::of(&l.list)).map_err(|e| code_of(&e)))
                .collect()),
            Err(error) => Err(code_of(&error)),
        }
    }

    fn remove(&self, wait: Wait<'_, '_>, keys: Vec<String>, force: bool) -> Batch<i32> {
        match wait.on(self.store.remove(&keys, force)) {
            Ok(results) => Ok(results
                .into_iter()
                .map(|r| r.map_or_else(|e| code_of(&e), |()| 0))
                .collect()),
            Err(error) => Err(code_of(&error)),
        }
    }

    fn remove_all(
        &self,
        wait: Wait<'_, '_>,
        pattern: Option<String>,
        tenant: Option<String>,
        force: bool,
    ) -> i64 {
        match wait.on(self
            .store
            .remove_all(pattern.as_deref(), tenant.as_deref(), force))
        {
            Ok(removed) => i64::try_from(removed).unwrap_or(i64::MAX),
            Err(error) => i64::from(code_of(&error)),
        }
    }

    fn attach(&self, _wait: Wait<'_, '_>, ptr: usize, size: usize) -> Result<(), i32> {
        // SAFETY: the caller keeps registered memory alive until it unregisters it
        // (the contract of Mooncake's `register_buffer`).
        match unsafe { self.store.register_local(ptr as *mut u8, size) } {
            Ok(()) => Ok(()),
            Err(error) => {
                tracing::warn!(%error, "the transport refused the buffer");
                Err(INVALID)
            }
        }
    }

    fn detach(&self, _wait: Wait<'_, '_>, _buffers: &BufferRegistry, ptr: usize) {
        self.store.unregister_local(ptr as *mut u8);
    }
}
