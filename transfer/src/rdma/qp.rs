//! Bringing an RC queue pair from RESET to ready-to-send with the peer's
//! [`QpInfo`], and the local half of that info (port LID, GID, a random starting
//! packet sequence number).

use rand::Rng as _;
use rdma_sys::{ibv_qp_attr, ibv_qp_attr_mask as mask, ibv_qp_state};

use super::access::Access;

use super::exchange::{QpInfo, RemoteRegion, MAX_24BIT};
use super::ffi::{Context, Qp};
use crate::error::TransferError;

/// What a queue pair needs to know about the local port.
#[derive(Debug, Clone, Copy)]
pub(crate) struct PortInfo {
    pub(crate) port: u8,
    pub(crate) gid_index: u8,
    pub(crate) lid: u16,
    pub(crate) gid: [u8; 16],
    pub(crate) mtu: u32,
    pub(crate) max_message: u32,
}

impl PortInfo {
    pub(crate) fn query(context: &Context, port: u8, gid_index: u8) -> Result<Self, TransferError> {
        let attr = context.query_port(port)?;
        if attr.state != rdma_sys::ibv_port_state::IBV_PORT_ACTIVE {
            return Err(TransferError::NoDevice(format!(
                "port {port} is not active (state {})",
                attr.state
            )));
        }
        Ok(Self {
            port,
            gid_index,
            lid: attr.lid,
            gid: context.query_gid(port, gid_index)?,
            mtu: attr.active_mtu,
            max_message: attr.max_msg_sz,
        })
    }
}

/// The info this side sends for `qp`, advertising `regions`.
pub(crate) fn local_info(qp: &Qp, port: &PortInfo, regions: Vec<RemoteRegion>) -> QpInfo {
    QpInfo {
        qp_num: qp.qp_num(),
        lid: port.lid,
        gid: port.gid,
        psn: rand::thread_rng().gen_range(0..=MAX_24BIT),
        regions,
    }
}

fn zeroed_attr() -> ibv_qp_attr {
    // SAFETY: `ibv_qp_attr` is a plain C struct for which all-zero is valid.
    unsafe { std::mem::zeroed() }
}

/// RESET → INIT → RTR → RTS, connected to `remote`; `access` says whether the
/// peer may read and write this end's served memory through it.
pub(crate) fn connect(
    qp: &Qp,
    port: &PortInfo,
    local: &QpInfo,
    remote: &QpInfo,
    access: Access,
) -> Result<(), TransferError> {
    let mut attr = zeroed_attr();
    attr.qp_state = ibv_qp_state::IBV_QPS_INIT;
    attr.pkey_index = 0;
    attr.port_num = port.port;
    attr.qp_access_flags = access.verbs_flags();
    qp.modify(
        &mut attr,
        (mask::IBV_QP_STATE
            | mask::IBV_QP_PKEY_INDEX
            | mask::IBV_QP_PORT
            | mask::IBV_QP_ACCESS_FLAGS)
            .0,
    )?;

    let mut attr = zeroed_attr();
    attr.qp_state = ibv_qp_state::IBV_QPS_RTR;
    attr.path_mtu = port.mtu;
    attr.dest_qp_num = remote.qp_num;
    attr.rq_psn = remote.psn;
    attr.max_dest_rd_atomic = 16;
    attr.min_rnr_timer = 12;
    attr.ah_attr.dlid = remote.lid;
    attr.ah_attr.port_num = port.port;
    if remote.gid != [0u8; 16] {
        // RoCE (and routed InfiniBand) address by GID.
        attr.ah_attr.is_global = 1;
        attr.ah_attr.grh.dgid.raw = remote.gid;
        attr.ah_attr.grh.sgid_index = port.gid_index;
        attr.ah_attr.grh.hop_limit = 64;
    }
    qp.modify(
        &mut attr,
        (mask::IBV_QP_STATE
            | mask::IBV_QP_AV
            | mask::IBV_QP_PATH_MTU
            | mask::IBV_QP_DEST_QPN
            | mask::IBV_QP_RQ_PSN
            | mask::IBV_QP_MAX_DEST_RD_ATOMIC
            | mask::IBV_QP_MIN_RNR_TIMER)
            .0,
    )?;

    let mut attr = zeroed_attr();
    attr.qp_state = ibv_qp_state::IBV_QPS_RTS;
    attr.timeout = 14;
    attr.retry_cnt = 7;
    attr.rnr_retry = 7;
    attr.sq_psn = local.psn;
    attr.max_rd_atomic = 16;
    qp.modify(
        &mut attr,
        (mask::IBV_QP_STATE
            | mask::IBV_QP_TIMEOUT
            | mask::IBV_QP_RETRY_CNT
            | mask::IBV_QP_RNR_RETRY
            | mask::IBV_QP_SQ_PSN
            | mask::IBV_QP_MAX_QP_RD_ATOMIC)
            .0,
    )
}
