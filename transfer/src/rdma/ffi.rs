//! The only unsafe verbs code: owning wrappers over the libibverbs objects this
//! backend uses (device list, context, protection domain, memory region, completion
//! queue, RC queue pair), each destroyed exactly once on drop, children holding an
//! `Arc` of their parent so that destruction runs in the order verbs requires.

use super::access::Access;
use std::ffi::CStr;
use std::sync::Arc;

use rdma_sys::{
    ___ibv_query_port, ibv_alloc_pd, ibv_close_device, ibv_context, ibv_cq, ibv_create_cq,
    ibv_create_qp, ibv_dealloc_pd, ibv_dereg_mr, ibv_destroy_cq, ibv_destroy_qp, ibv_device,
    ibv_free_device_list, ibv_get_device_list, ibv_get_device_name, ibv_modify_qp, ibv_mr,
    ibv_open_device, ibv_pd, ibv_poll_cq, ibv_port_attr, ibv_post_send, ibv_qp, ibv_qp_attr,
    ibv_qp_init_attr, ibv_qp_type, ibv_query_gid, ibv_reg_mr, ibv_send_wr, ibv_wc,
};

use super::completion::Completion;
use super::staging::{MemoryKeys, Registrar};
use super::status::call_error;
use crate::error::TransferError;
use crate::region::Segment;

fn errno() -> i32 {
    std::io::Error::last_os_error()
        .raw_os_error()
        .unwrap_or(libc::EIO)
}

/// Verbs calls return 0 or an errno (some return -1 and set `errno`).
fn check(call: &'static str, rc: i32) -> Result<(), TransferError> {
    match rc {
        0 => Ok(()),
        -1 => Err(call_error(call, errno())),
        rc => Err(call_error(call, rc.abs())),
    }
}

/// The RDMA devices of this host.
pub(crate) struct DeviceList {
    list: *mut *mut ibv_device,
    len: usize,
}

impl DeviceList {
    /// Lists the devices; a host without any (or without kernel support) is
    /// `NoDevice`.
    pub(crate) fn new() -> Result<Self, TransferError> {
        let mut len = 0i32;
        // SAFETY: `len` is a valid out pointer; the returned array is owned by us
        // until `ibv_free_device_list` (in `Drop`).
        let list = unsafe { ibv_get_device_list(&mut len) };
        if list.is_null() {
            return Err(TransferError::NoDevice(format!(
                "ibv_get_device_list: {}",
                std::io::Error::from_raw_os_error(errno())
            )));
        }
        Ok(Self {
            list,
            len: usize::try_from(len).unwrap_or(0),
        })
    }

    fn device(&self, index: usize) -> *mut ibv_device {
        // SAFETY: `index < self.len`, the array holds `len` valid device pointers.
        unsafe { *self.list.add(index) }
    }

    /// The devices' names.
    pub(crate) fn names(&self) -> Vec<String> {
        (0..self.len)
            .map(|index| {
                // SAFETY: a listed device has a NUL-terminated name that lives as long
                // as the list.
                unsafe { CStr::from_ptr(ibv_get_device_name(self.device(index))) }
                    .to_string_lossy()
                    .into_owned()
            })
            .collect()
    }

    /// Opens the named device, or the first one; with the name of the one opened.
    ///
    /// # Errors
    /// [`TransferError::NoRdmaDevice`] naming what was asked for and what this host
    /// has, when it has no such device.
    pub(crate) fn open(&self, name: Option<&str>) -> Result<(Arc<Context>, String), TransferError> {
        let names = self.names();
        let found = match name {
            None => (!names.is_empty()).then_some(0),
            Some(wanted) => names.iter().position(|n| n == wanted),
        };
        let Some(index) = found else {
            return Err(TransferError::NoRdmaDevice {
                wanted: name.map(str::to_owned),
                found: names,
                detail: None,
            });
        };
        // SAFETY: the device pointer comes from the live list.
        let context = unsafe { ibv_open_device(self.device(index)) };
        if context.is_null() {
            return Err(call_error("ibv_open_device", errno()));
        }
        Ok((Arc::new(Context(context)), names[index].clone()))
    }
}

impl Drop for DeviceList {
    fn drop(&mut self) {
        // SAFETY: the list came from `ibv_get_device_list` and is freed once; opened
        // contexts stay valid after the list is freed.
        unsafe { ibv_free_device_list(self.list) }
    }
}

/// Marks a wrapper of verbs object pointers as shareable between threads.
macro_rules! verbs_handle {
    ($name:ident) => {
        // SAFETY: libibverbs objects may be used from any thread (the library
        // serializes what needs it internally), and the wrapper only hands out
        // copies of plain fields or calls verbs functions.
        unsafe impl Send for $name {}
        // SAFETY: as above.
        unsafe impl Sync for $name {}
    };
}

/// An open device.
pub(crate) struct Context(*mut ibv_context);

verbs_handle!(Context);

impl Context {
    /// The attributes of a port.
    pub(crate) fn query_port(&self, port: u8) -> Result<ibv_port_attr, TransferError> {
        // SAFETY: a zeroed `ibv_port_attr` is a valid plain C struct to be filled in.
        let mut attr: ibv_port_attr = unsafe { std::mem::zeroed() };
        // SAFETY: the context is open and `attr` is a valid out pointer.
        check("ibv_query_port", unsafe {
            ___ibv_query_port(self.0, port, &mut attr)
        })?;
        Ok(attr)
    }

    /// A GID of a port.
    pub(crate) fn query_gid(&self, port: u8, index: u8) -> Result<[u8; 16], TransferError> {
        // SAFETY: a zeroed GID is a valid union value to be filled in.
        let mut gid: rdma_sys::ibv_gid = unsafe { std::mem::zeroed() };
        // SAFETY: the context is open and `gid` is a valid out pointer.
        check("ibv_query_gid", unsafe {
            ibv_query_gid(self.0, port, i32::from(index), &mut gid)
        })?;
        // SAFETY: every bit pattern of the union is a valid `[u8; 16]`.
        Ok(unsafe { gid.raw })
    }
}

impl Drop for Context {
    fn drop(&mut self) {
        // SAFETY: opened once, closed once, after every child (they hold an Arc).
        unsafe { ibv_close_device(self.0) };
    }
}

/// A protection domain.
pub(crate) struct Pd {
    pd: *mut ibv_pd,
    _context: Arc<Context>,
}

verbs_handle!(Pd);

impl Pd {
    pub(crate) fn new(context: &Arc<Context>) -> Result<Arc<Self>, TransferError> {
        // SAFETY: the context is open.
        let pd = unsafe { ibv_alloc_pd(context.0) };
        if pd.is_null() {
            return Err(call_error("ibv_alloc_pd", errno()));
        }
        Ok(Arc::new(Self {
            pd,
            _context: Arc::clone(context),
        }))
    }
}

impl Drop for Pd {
    fn drop(&mut self) {
        // SAFETY: allocated once, freed once, after its memory regions and queue pairs.
        unsafe { ibv_dealloc_pd(self.pd) };
    }
}

/// A registered memory region.
pub(crate) struct Mr {
    mr: *mut ibv_mr,
    _pd: Arc<Pd>,
}

verbs_handle!(Mr);

impl Mr {
    /// Registers `len` bytes at `addr` with `access` (remote reads and writes
    /// only for served memory).
    ///
    /// # Safety
    /// `addr..addr + len` must stay mapped for as long as the registration lives
    /// (callers keep the owning `Segment` alive next to it).
    pub(crate) unsafe fn register(
        pd: &Arc<Pd>,
        addr: *mut u8,
        len: usize,
        access: Access,
    ) -> Result<Self, TransferError> {
        // The flags are a few low bits: they fit an `int`.
        let flags = access.verbs_flags() as i32;
        // SAFETY: the protection domain is live; the range is mapped (caller's
        // contract).
        let mr = unsafe { ibv_reg_mr(pd.pd, addr.cast(), len, flags) };
        if mr.is_null() {
            return Err(call_error("ibv_reg_mr", errno()));
        }
        Ok(Self {
            mr,
            _pd: Arc::clone(pd),
        })
    }

    /// The local key.
    pub(crate) fn lkey(&self) -> u32 {
        // SAFETY: the registration is live.
        unsafe { (*self.mr).lkey }
    }

    /// The remote key.
    pub(crate) fn rkey(&self) -> u32 {
        // SAFETY: the registration is live.
        unsafe { (*self.mr).rkey }
    }
}

impl Drop for Mr {
    fn drop(&mut self) {
        // SAFETY: registered once, deregistered once.
        unsafe { ibv_dereg_mr(self.mr) };
    }
}

impl MemoryKeys for Mr {
    fn lkey(&self) -> u32 {
        Mr::lkey(self)
    }

    fn rkey(&self) -> u32 {
        Mr::rkey(self)
    }
}

/// The protection domain registers memory for [`Registered`](super::staging::Registered)
/// and the staging pool.
impl Registrar for Arc<Pd> {
    type Registration = Mr;

    unsafe fn register(&self, memory: &Arc<Segment>, access: Access) -> Result<Mr, TransferError> {
        // SAFETY: the caller keeps the mapping alive for as long as the `Mr`
        // (`Registrar::register`'s contract).
        unsafe { Mr::register(self, memory.base_ptr(), memory.len() as usize, access) }
    }
}

/// A completion queue.
pub(crate) struct Cq {
    cq: *mut ibv_cq,
    _context: Arc<Context>,
}

verbs_handle!(Cq);

impl Cq {
    pub(crate) fn new(context: &Arc<Context>, depth: i32) -> Result<Arc<Self>, TransferError> {
        // SAFETY: the context is open; no completion channel, no user context.
        let cq = unsafe {
            ibv_create_cq(
                context.0,
                depth,
                std::ptr::null_mut(),
                std::ptr::null_mut(),
                0,
            )
        };
        if cq.is_null() {
            return Err(call_error("ibv_create_cq", errno()));
        }
        Ok(Arc::new(Self {
            cq,
            _context: Arc::clone(context),
        }))
    }

    /// Polls up to `max` completions (never blocks).
    pub(crate) fn poll(&self, out: &mut Vec<Completion>, max: usize) -> Result<(), TransferError> {
        // SAFETY: a zeroed `ibv_wc` is a valid plain C struct to be filled in.
        let mut wcs: Vec<ibv_wc> = (0..max).map(|_| unsafe { std::mem::zeroed() }).collect();
        let max = i32::try_from(max).unwrap_or(i32::MAX);
        // SAFETY: the queue is live and `wcs` has room for `max` entries.
        let polled = unsafe { ibv_poll_cq(self.cq, max, wcs.as_mut_ptr()) };
        if polled < 0 {
            return Err(call_error("ibv_poll_cq", polled.abs()));
        }
        out.extend(wcs.iter().take(polled as usize).map(|wc| Completion {
            wr_id: wc.wr_id,
            status: wc.status,
            vendor_err: wc.vendor_err,
        }));
        Ok(())
    }
}

impl Drop for Cq {
    fn drop(&mut self) {
        // SAFETY: created once, destroyed once, after its queue pairs.
        unsafe { ibv_destroy_cq(self.cq) };
    }
}

/// A reliable-connected queue pair.
pub(crate) struct Qp {
    qp: *mut ibv_qp,
    _pd: Arc<Pd>,
    _cq: Arc<Cq>,
}

verbs_handle!(Qp);

/// One RDMA READ or WRITE to post: local staging range and remote range.
#[derive(Debug, Clone, Copy)]
pub(crate) struct PostRequest {
    pub(crate) wr_id: u64,
    pub(crate) opcode: u32,
    pub(crate) local_addr: u64,
    pub(crate) lkey: u32,
    pub(crate) len: u32,
    pub(crate) remote_addr: u64,
    pub(crate) rkey: u32,
    pub(crate) signaled: bool,
}

impl Qp {
    pub(crate) fn new(pd: &Arc<Pd>, cq: &Arc<Cq>, depth: u32) -> Result<Self, TransferError> {
        // SAFETY: a zeroed init attribute is valid; the fields that matter are set.
        let mut init: ibv_qp_init_attr = unsafe { std::mem::zeroed() };
        init.send_cq = cq.cq;
        init.recv_cq = cq.cq;
        init.qp_type = ibv_qp_type::IBV_QPT_RC;
        init.sq_sig_all = 0;
        init.cap.max_send_wr = depth;
        init.cap.max_recv_wr = 1;
        init.cap.max_send_sge = 1;
        init.cap.max_recv_sge = 1;
        // SAFETY: the protection domain and completion queue are live.
        let qp = unsafe { ibv_create_qp(pd.pd, &mut init) };
        if qp.is_null() {
            return Err(call_error("ibv_create_qp", errno()));
        }
        Ok(Self {
            qp,
            _pd: Arc::clone(pd),
            _cq: Arc::clone(cq),
        })
    }

    /// The queue pair number.
    pub(crate) fn qp_num(&self) -> u32 {
        // SAFETY: the queue pair is live.
        unsafe { (*self.qp).qp_num }
    }

    /// Applies a state transition.
    pub(crate) fn modify(&self, attr: &mut ibv_qp_attr, mask: u32) -> Result<(), TransferError> {
        // SAFETY: the queue pair is live and `attr` is a valid attribute struct.
        check("ibv_modify_qp", unsafe {
            ibv_modify_qp(self.qp, attr, mask as i32)
        })
    }

    /// Posts a chain of one-sided requests (each with one scatter/gather entry).
    pub(crate) fn post(&self, requests: &[PostRequest]) -> Result<(), TransferError> {
        if requests.is_empty() {
            return Ok(());
        }
        let mut sges: Vec<rdma_sys::ibv_sge> = requests
            .iter()
            .map(|r| rdma_sys::ibv_sge {
                addr: r.local_addr,
                length: r.len,
                lkey: r.lkey,
            })
            .collect();
        // SAFETY: a zeroed send work request is a valid plain C struct.
        let mut wrs: Vec<ibv_send_wr> = requests
            .iter()
            .map(|_| unsafe { std::mem::zeroed() })
            .collect();
        let sge_base = sges.as_mut_ptr();
        for (index, (wr, request)) in wrs.iter_mut().zip(requests).enumerate() {
            wr.wr_id = request.wr_id;
            // SAFETY: `index < sges.len()`; `sges` is not touched again until posted.
            wr.sg_list = unsafe { sge_base.add(index) };
            wr.num_sge = 1;
            wr.opcode = request.opcode;
            wr.send_flags = if request.signaled {
                rdma_sys::ibv_send_flags::IBV_SEND_SIGNALED.0
            } else {
                0
            };
            wr.wr.rdma = rdma_sys::rdma_t {
                remote_addr: request.remote_addr,
                rkey: request.rkey,
            };
        }
        // Link the chain through raw pointers taken after the last `&mut` use.
        let base = wrs.as_mut_ptr();
        for index in 1..wrs.len() {
            // SAFETY: both indices are inside the vector, which is neither moved nor
            // reallocated until the post below returns.
            unsafe { (*base.add(index - 1)).next = base.add(index) };
        }
        let mut bad: *mut ibv_send_wr = std::ptr::null_mut();
        // SAFETY: the chain and its scatter/gather entries live until the call
        // returns, which is all verbs needs (it copies them into the send queue).
        check("ibv_post_send", unsafe {
            ibv_post_send(self.qp, base, &mut bad)
        })
    }
}

impl Drop for Qp {
    fn drop(&mut self) {
        // SAFETY: created once, destroyed once, before its completion queue and
        // protection domain (it holds both).
        unsafe { ibv_destroy_qp(self.qp) };
    }
}
