//! Opened HCA ports, queue-pair set-up and memory registration on every NIC.

use std::ffi::c_int;
use std::os::fd::AsRawFd;
use std::sync::atomic::AtomicU64;

use super::shared::Shared;
use super::{unavailable, ACCESS, MAX_WR, PARALLEL_REG_BYTES};
use crate::error::{Code, Error, Result};
use crate::ffi::ibverbs::{self as ibv, Verbs};
use crate::memory::Region;
use crate::transport::RegionKeys;

/// One opened HCA port.
pub(super) struct Nic {
    pub(super) name: String,
    pub(super) ctx: *mut ibv::ibv_context,
    pub(super) pd: *mut ibv::ibv_pd,
    pub(super) port: u8,
    pub(super) gid_index: u8,
    pub(super) lid: u16,
    pub(super) gid: ibv::ibv_gid,
    pub(super) mtu: u32,
    /// CQ shared by the QPs created for peers' handshakes (they never post).
    pub(super) passive_cq: *mut ibv::ibv_cq,
    pub(super) bytes: AtomicU64,
}

/// A buffer registered on every NIC.
pub(super) struct RegionMrs {
    pub(super) len: u64,
    pub(super) location: String,
    pub(super) mrs: Vec<*mut ibv::ibv_mr>,
}

// SAFETY: verbs objects may be used from any thread; the raw pointers are owned by
// `Shared` and freed only in its Drop.
unsafe impl Send for Nic {}
unsafe impl Sync for Nic {}

pub(super) fn open_nics(verbs: &'static Verbs, wanted: &[String]) -> Result<Vec<Nic>> {
    let mut count: c_int = 0;
    // SAFETY: verbs calls in their documented order; every object made here is either
    // returned inside a Nic or released before an error returns.
    unsafe {
        let list = (verbs.get_device_list)(&mut count);
        if list.is_null() {
            return Err(unavailable(format!(
                "{} loaded but found no RDMA devices (ibv_get_device_list: {}; \
                 no InfiniBand/RoCE NIC or kernel driver)",
                verbs.library,
                std::io::Error::last_os_error()
            )));
        }
        let mut found: Vec<(String, *mut ibv::ibv_device)> = (0..count.max(0) as usize)
            .map(|i| {
                let d = *list.add(i);
                (ibv::device_name(verbs, d), d)
            })
            .collect();
        let result = (|| {
            if !wanted.is_empty() {
                let mut ordered = Vec::new();
                for w in wanted {
                    match found.iter().find(|(n, _)| n == w) {
                        Some(x) => ordered.push(x.clone()),
                        None => {
                            return Err(unavailable(format!(
                                "RDMA device {w} not found (present: [{}])",
                                found
                                    .iter()
                                    .map(|x| x.0.as_str())
                                    .collect::<Vec<_>>()
                                    .join(", ")
                            )))
                        }
                    }
                }
                found = ordered;
            }
            if found.is_empty() {
                return Err(unavailable(format!(
                    "{} loaded but found no RDMA devices (no InfiniBand/RoCE NIC or driver)",
                    verbs.library
                )));
            }
            let mut nics: Vec<Nic> = Vec::new();
            for (name, dev) in &found {
                match open_nic(verbs, name, *dev) {
                    Ok(n) => nics.push(n),
                    Err(e) if wanted.is_empty() => log::warn!("rdma: skipping {name}: {e}"),
                    Err(e) => {
                        close_nics(verbs, nics);
                        return Err(e);
                    }
                }
            }
            if nics.is_empty() {
                return Err(unavailable("no RDMA device could be opened"));
            }
            Ok(nics)
        })();
        (verbs.free_device_list)(list);
        result
    }
}

unsafe fn close_nics(verbs: &Verbs, nics: Vec<Nic>) {
    for n in nics {
        (verbs.destroy_cq)(n.passive_cq);
        (verbs.dealloc_pd)(n.pd);
        (verbs.close_device)(n.ctx);
    }
}

unsafe fn open_nic(verbs: &Verbs, name: &str, dev: *mut ibv::ibv_device) -> Result<Nic> {
    let os = || std::io::Error::last_os_error();
    let ctx = (verbs.open_device)(dev);
    if ctx.is_null() {
        return Err(unavailable(format!("ibv_open_device({name}): {}", os())));
    }
    let port = 1u8;
    let attr = match verbs.query_port(ctx, port) {
        Ok(a) => a,
        Err(rc) => {
            (verbs.close_device)(ctx);
            return Err(unavailable(format!("ibv_query_port({name}): error {rc}")));
        }
    };
    let gid_index = 0u8;
    let mut gid = ibv::ibv_gid::default();
    if (verbs.query_gid)(ctx, port, c_int::from(gid_index), &mut gid) != 0 {
        (verbs.close_device)(ctx);
        return Err(unavailable(format!("ibv_query_gid({name})")));
    }
    let pd = (verbs.alloc_pd)(ctx);
    if pd.is_null() {
        let e = os();
        (verbs.close_device)(ctx);
        return Err(unavailable(format!("ibv_alloc_pd({name}): {e}")));
    }
    let cq = (verbs.create_cq)(ctx, 16, std::ptr::null_mut(), std::ptr::null_mut(), 0);
    if cq.is_null() {
        let e = os();
        (verbs.dealloc_pd)(pd);
        (verbs.close_device)(ctx);
        return Err(unavailable(format!("ibv_create_cq({name}): {e}")));
    }
    Ok(Nic {
        name: name.to_owned(),
        ctx,
        pd,
        port,
        gid_index,
        lid: attr.lid,
        gid,
        mtu: attr.active_mtu.clamp(ibv::IBV_MTU_1024, ibv::IBV_MTU_4096),
        passive_cq: cq,
        bytes: AtomicU64::new(0),
    })
}

/// Moves a fresh QP through INIT → RTR → RTS towards `remote_qpn` at `gid`/`lid`.
pub(super) unsafe fn connect_qp(
    verbs: &Verbs,
    nic: &Nic,
    qp: *mut ibv::ibv_qp,
    remote_qpn: u32,
    gid: ibv::ibv_gid,
    lid: u16,
) -> std::result::Result<(), String> {
    let mut a = ibv::ibv_qp_attr {
        qp_state: ibv::IBV_QPS_INIT,
        pkey_index: 0,
        port_num: nic.port,
        qp_access_flags: ACCESS as u32,
        ..Default::default()
    };
    let mask =
        ibv::IBV_QP_STATE | ibv::IBV_QP_PKEY_INDEX | ibv::IBV_QP_PORT | ibv::IBV_QP_ACCESS_FLAGS;
    let rc = (verbs.modify_qp)(qp, &mut a, mask);
    if rc != 0 {
        return Err(format!("modify QP to INIT: error {rc}"));
    }
    let mut a = ibv::ibv_qp_attr {
        qp_state: ibv::IBV_QPS_RTR,
        path_mtu: nic.mtu,
        dest_qp_num: remote_qpn,
        rq_psn: 0,
        max_dest_rd_atomic: 16,
        min_rnr_timer: 12,
        ..Default::default()
    };
    a.ah_attr.is_global = 1;
    a.ah_attr.grh.dgid = gid;
    a.ah_attr.grh.hop_limit = 16;
    a.ah_attr.grh.sgid_index = nic.gid_index;
    a.ah_attr.dlid = lid;
    a.ah_attr.port_num = nic.port;
    let mask = ibv::IBV_QP_STATE
        | ibv::IBV_QP_AV
        | ibv::IBV_QP_PATH_MTU
        | ibv::IBV_QP_DEST_QPN
        | ibv::IBV_QP_RQ_PSN
        | ibv::IBV_QP_MAX_DEST_RD_ATOMIC
        | ibv::IBV_QP_MIN_RNR_TIMER;
    let rc = (verbs.modify_qp)(qp, &mut a, mask);
    if rc != 0 {
        return Err(format!("modify QP to RTR: error {rc}"));
    }
    let mut a = ibv::ibv_qp_attr {
        qp_state: ibv::IBV_QPS_RTS,
        timeout: 14,
        retry_cnt: 7,
        rnr_retry: 7,
        sq_psn: 0,
        max_rd_atomic: 16,
        ..Default::default()
    };
    let mask = ibv::IBV_QP_STATE
        | ibv::IBV_QP_TIMEOUT
        | ibv::IBV_QP_RETRY_CNT
        | ibv::IBV_QP_RNR_RETRY
        | ibv::IBV_QP_SQ_PSN
        | ibv::IBV_QP_MAX_QP_RD_ATOMIC;
    let rc = (verbs.modify_qp)(qp, &mut a, mask);
    if rc != 0 {
        return Err(format!("modify QP to RTS: error {rc}"));
    }
    Ok(())
}

pub(super) unsafe fn create_qp(
    verbs: &Verbs,
    nic: &Nic,
    cq: *mut ibv::ibv_cq,
) -> std::result::Result<*mut ibv::ibv_qp, String> {
    let mut init = ibv::ibv_qp_init_attr {
        qp_context: std::ptr::null_mut(),
        send_cq: cq,
        recv_cq: cq,
        srq: std::ptr::null_mut(),
        cap: ibv::ibv_qp_cap {
            max_send_wr: MAX_WR,
            max_recv_wr: 1,
            max_send_sge: 1,
            max_recv_sge: 1,
            max_inline_data: 0,
        },
        qp_type: ibv::IBV_QPT_RC,
        sq_sig_all: 0,
    };
    let qp = (verbs.create_qp)(nic.pd, &mut init);
    if qp.is_null() {
        return Err(format!(
            "ibv_create_qp on {}: {}",
            nic.name,
            std::io::Error::last_os_error()
        ));
    }
    Ok(qp)
}

pub(super) fn port_active(shared: &Shared, nic: &Nic) -> bool {
    // SAFETY: the context is open for the transport's lifetime.
    matches!(unsafe { shared.verbs.query_port(nic.ctx, nic.port) }, Ok(a) if a.state == ibv::IBV_PORT_ACTIVE)
}

struct MrPtr(*mut ibv::ibv_mr);
// SAFETY: an MR handle may be used from any thread.
unsafe impl Send for MrPtr {}

/// Registers `region` on every NIC (in parallel for large ones) and records its MRs.
pub(super) fn register(s: &Shared, region: &Region) -> Result<RegionKeys> {
    let v = s.verbs;
    let dma_buf = gpudirect_dma_buf(s, region);
    let reg = |nic: &Nic| -> std::result::Result<MrPtr, String> {
        let (mr, call) = match (&dma_buf, v.reg_dmabuf_mr) {
            (Some(buf), Some(reg_dmabuf_mr)) => {
                // SAFETY: the descriptor exports the allocation holding the region;
                // the NIC maps `len` bytes from `offset` and addresses them at `iova`
                // (the region's own address), as the engine registered them.
                let mr = unsafe {
                    reg_dmabuf_mr(
                        nic.pd,
                        buf.offset,
                        region.len as usize,
                        region.addr,
                        buf.fd.as_raw_fd(),
                        ACCESS,
                    )
                };
                (mr, "ibv_reg_dmabuf_mr")
            }
            // SAFETY: the engine guarantees the range stays valid until unregister.
            _ => (
                unsafe { (v.reg_mr)(nic.pd, region.addr as *mut _, region.len as usize, ACCESS) },
                "ibv_reg_mr",
            ),
        };
        if mr.is_null() {
            let hint = if region.device.is_host() || dma_buf.is_some() {
                ""
            } else {
                " (device memory: GPUDirect RDMA needs a dma-buf capable driver, or \
                 nvidia-peermem / amdgpu peer memory; use protocol tcp otherwise)"
            };
            Err(format!(
                "{call}({:#x}, {} bytes, {}) on {}: {}{hint}",
                region.addr,
                region.len,
                region.location,
                nic.name,
                std::io::Error::last_os_error()
            ))
        } else {
            Ok(MrPtr(mr))
        }
    };
    let results: Vec<std::result::Result<MrPtr, String>> =
        if region.len >= PARALLEL_REG_BYTES && s.nics.len() > 1 {
            std::thread::scope(|scope| {
                let handles: Vec<_> = s.nics.iter().map(|n| scope.spawn(move || reg(n))).collect();
                handles
                    .into_iter()
                    .map(|h| {
                        h.join()
                            .unwrap_or_else(|_| Err("registration thread panicked".into()))
                    })
                    .collect()
            })
        } else {
            s.nics.iter().map(reg).collect()
        };
    if let Some(Err(e)) = results.iter().find(|r| r.is_err()) {
        let e = e.clone();
        for mr in results.into_iter().flatten() {
            // SAFETY: registered just above, not published.
            unsafe { (v.dereg_mr)(mr.0) };
        }
        return Err(Error::new(Code::BackendUnavailable, e));
    }
    let mrs: Vec<*mut ibv::ibv_mr> = results.into_iter().flatten().map(|m| m.0).collect();
    // SAFETY: live MRs.
    let keys = unsafe {
        RegionKeys {
            lkey: mrs.iter().map(|m| (**m).lkey).collect(),
            rkey: mrs.iter().map(|m| (**m).rkey).collect(),
            ipc: None,
        }
    };
    let old = s.regions.write().unwrap_or_else(|e| e.into_inner()).insert(
        region.addr,
        RegionMrs {
            len: region.len,
            location: region.location.clone(),
            mrs,
        },
    );
    if let Some(old) = old {
        for mr in old.mrs {
            // SAFETY: replaced in the table, so no longer reachable.
            unsafe { (v.dereg_mr)(mr) };
        }
    }
    Ok(keys)
}

/// For device memory, a dma-buf of it when both the GPU driver and libibverbs can
/// register one (GPUDirect RDMA through the kernel's dma-buf support); `None` means
/// plain `ibv_reg_mr`, which reaches device memory only through a peer-memory module.
fn gpudirect_dma_buf(s: &Shared, region: &Region) -> Option<crate::device::DmaBuf> {
    if region.device.is_host() || s.verbs.reg_dmabuf_mr.is_none() {
        return None;
    }
    match crate::device::dma_buf(region.device, region.addr, region.len) {
        Ok(buf) => Some(buf),
        Err(e) => {
            log::info!(
                "rdma: no dma-buf for {:#x} ({}), trying ibv_reg_mr: {e}",
                region.addr,
                region.location
            );
            None
        }
    }
}

/// Deregisters `region` on every NIC.
pub(super) fn unregister(s: &Shared, region: &Region) {
    let old = s
        .regions
        .write()
        .unwrap_or_else(|e| e.into_inner())
        .remove(&region.addr);
    for mr in old.map(|r| r.mrs).unwrap_or_default() {
        // SAFETY: removed from the table; once deregistered no peer can use its rkey.
        let rc = unsafe { (s.verbs.dereg_mr)(mr) };
        if rc != 0 {
            log::warn!("rdma: ibv_dereg_mr({:#x}): error {rc}", region.addr);
        }
    }
}
