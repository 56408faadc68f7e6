//! Opened HCA ports, queue-pair set-up and memory registration on every NIC.

use crate::util::sync::UnpoisonedRw;
use std::os::fd::AsRawFd;
use std::sync::Arc;

use super::context::RdmaContext;
use super::verbs::{
    CompletionQueue, Context, DeviceList, MemoryRegion, ProtectionDomain, QueuePair, RcPath,
};
use super::{unavailable, ACCESS, MAX_WR, PARALLEL_REG_BYTES};
use crate::error::{Code, Error, Result};
use crate::ffi::ibverbs::{self as ibv, Verbs};
use crate::registry::Region;
use crate::transport::RegionKeys;

/// One opened HCA port.
pub(super) struct Nic {
    pub(super) name: String,
    pub(super) ctx: Arc<Context>,
    pub(super) pd: Arc<ProtectionDomain>,
    pub(super) port: u8,
    pub(super) gid_index: u8,
    pub(super) lid: u16,
    pub(super) gid: ibv::ibv_gid,
    pub(super) mtu: u32,
    /// CQ shared by the QPs created for peers' handshakes (they never post).
    pub(super) passive_cq: Arc<CompletionQueue>,
}

/// A buffer registered on every NIC.
pub(super) struct RegionMrs {
    pub(super) len: u64,
    pub(super) location: String,
    pub(super) mrs: Vec<MemoryRegion>,
}

pub(super) fn open_nics(verbs: &'static Verbs, wanted: &[String]) -> Result<Vec<Nic>> {
    let list = DeviceList::new(verbs).map_err(|e| {
        unavailable(format!(
            "{} loaded but found no RDMA devices (ibv_get_device_list: {e}; \
             no InfiniBand/RoCE NIC or kernel driver)",
            verbs.library
        ))
    })?;
    let names = list.names();
    let chosen: Vec<usize> = if wanted.is_empty() {
        (0..names.len()).collect()
    } else {
        wanted
            .iter()
            .map(|w| {
                names.iter().position(|n| n == w).ok_or_else(|| {
                    unavailable(format!(
                        "RDMA device {w} not found (present: [{}])",
                        names.join(", ")
                    ))
                })
            })
            .collect::<Result<_>>()?
    };
    if chosen.is_empty() {
        return Err(unavailable(format!(
            "{} loaded but found no RDMA devices (no InfiniBand/RoCE NIC or driver)",
            verbs.library
        )));
    }
    let mut nics: Vec<Nic> = Vec::new();
    for i in chosen {
        match open_nic(&list, i) {
            Ok(n) => nics.push(n),
            Err(e) if wanted.is_empty() => log::warn!("rdma: skipping {}: {e}", names[i]),
            Err(e) => return Err(e),
        }
    }
    if nics.is_empty() {
        return Err(unavailable("no RDMA device could be opened"));
    }
    Ok(nics)
}

/// Opens device `index` of `list` with its port 1, GID 0, a PD and the passive CQ.
fn open_nic(list: &DeviceList, index: usize) -> Result<Nic> {
    let name = &list.names()[index];
    let ctx = list
        .open(index)
        .map_err(|e| unavailable(format!("ibv_open_device({name}): {e}")))?;
    let port = 1u8;
    let attr = ctx
        .query_port(port)
        .map_err(|rc| unavailable(format!("ibv_query_port({name}): error {rc}")))?;
    let gid_index = 0u8;
    let gid = ctx
        .query_gid(port, gid_index)
        .map_err(|rc| unavailable(format!("ibv_query_gid({name}): error {rc}")))?;
    let pd = ProtectionDomain::new(&ctx)
        .map_err(|e| unavailable(format!("ibv_alloc_pd({name}): {e}")))?;
    let passive_cq = CompletionQueue::new(&ctx, 16, None)
        .map_err(|e| unavailable(format!("ibv_create_cq({name}): {e}")))?;
    Ok(Nic {
        name: name.clone(),
        ctx,
        pd,
        port,
        gid_index,
        lid: attr.lid,
        gid,
        mtu: attr.active_mtu.clamp(ibv::IBV_MTU_1024, ibv::IBV_MTU_4096),
        passive_cq,
    })
}

impl Nic {
    /// A fresh RC QP on this NIC whose completions go to `cq`.
    pub(super) fn create_qp(&self, cq: &Arc<CompletionQueue>) -> Result<QueuePair> {
        QueuePair::new_rc(&self.pd, cq, MAX_WR, false)
            .map_err(|e| verbs_error(format!("ibv_create_qp on {}", self.name), e))
    }

    /// Moves a fresh QP through INIT → RTR → RTS towards `remote_qpn` at `gid`/`lid`.
    pub(super) fn connect(
        &self,
        qp: &QueuePair,
        remote_qpn: u32,
        gid: ibv::ibv_gid,
        lid: u16,
    ) -> Result<()> {
        let path = RcPath {
            port: self.port,
            gid_index: self.gid_index,
            mtu: self.mtu,
            remote_qpn,
            remote_gid: gid,
            remote_lid: lid,
        };
        qp.connect(ACCESS, &path)
            .map_err(|e| verbs_error(format!("connecting a QP on {}", self.name), e))
    }

    pub(super) fn port_active(&self) -> bool {
        matches!(self.ctx.query_port(self.port), Ok(a) if a.state == ibv::IBV_PORT_ACTIVE)
    }
}

/// Registers `region` on every NIC (in parallel for large ones) and records its MRs.
pub(super) fn register(s: &RdmaContext, region: &Region) -> Result<RegionKeys> {
    let dma_buf = gpudirect_dma_buf(s, region);
    // The NIC enforces what peers may do (`Access`): no remote write to a read-only
    // buffer, no remote access at all to a local one.
    let mut access = ibv::IBV_ACCESS_LOCAL_WRITE;
    if region.access.allows_peer(false) {
        access |= ibv::IBV_ACCESS_REMOTE_READ;
    }
    if region.access.allows_peer(true) {
        access |= ACCESS;
    }
    let reg = |nic: &Nic| -> Result<MemoryRegion> {
        let (mr, call) = match &dma_buf {
            Some(buf) => {
                // SAFETY: the descriptor exports the allocation holding the region; the
                // NIC maps `len` bytes from `offset` and addresses them at `iova` (the
                // region's own address); the engine keeps the allocation until it
                // unregisters the region, which drops this MR first.
                let mr = unsafe {
                    MemoryRegion::register_dmabuf(
                        &nic.pd,
                        buf.offset,
                        region.len as usize,
                        region.addr,
                        buf.fd.as_raw_fd(),
                        access,
                    )
                };
                (mr, "ibv_reg_dmabuf_mr")
            }
            None => {
                // SAFETY: the engine keeps the range mapped until it unregisters the
                // region, which drops this MR first.
                let mr = unsafe {
                    MemoryRegion::register(
                        &nic.pd,
                        region.addr as *mut _,
                        region.len as usize,
                        access,
                    )
                };
                (mr, "ibv_reg_mr")
            }
        };
        mr.map_err(|e| {
            let hint = if region.device.is_host() || dma_buf.is_some() {
                ""
            } else {
                " (device memory: GPUDirect RDMA needs a dma-buf capable driver, or \
                 nvidia-peermem / amdgpu peer memory; use protocol tcp otherwise)"
            };
            let what = format!(
                "{call}({:#x}, {} bytes, {}) on {}",
                region.addr, region.len, region.location, nic.name
            );
            let err = verbs_error(what, e);
            if hint.is_empty() {
                err
            } else {
                let context = format!("{}{hint}", err.context());
                Error::new(err.code(), context)
            }
        })
    };
    let results: Vec<Result<MemoryRegion>> = if region.len >= PARALLEL_REG_BYTES && s.nics.len() > 1
    {
        std::thread::scope(|scope| {
            let handles: Vec<_> = s.nics.iter().map(|n| scope.spawn(move || reg(n))).collect();
            handles
                .into_iter()
                .map(|h| {
                    h.join().unwrap_or_else(|_| {
                        Err(Error::new(Code::Internal, "registration thread panicked"))
                    })
                })
                .collect()
        })
    } else {
        s.nics.iter().map(reg).collect()
    };
    // On a failure the MRs made on the other NICs are dropped, and so deregistered.
    let mrs = results.into_iter().collect::<Result<Vec<_>>>()?;
    let keys = RegionKeys {
        lkey: mrs.iter().map(MemoryRegion::lkey).collect(),
        rkey: mrs.iter().map(MemoryRegion::rkey).collect(),
        ipc: None,
    };
    let old = s.regions.write_locked().insert(
        region.addr,
        RegionMrs {
            len: region.len,
            location: region.location.clone(),
            mrs,
        },
    );
    // A registration it replaces is deregistered here, outside the lock.
    drop(old);
    Ok(keys)
}

/// For device memory, a dma-buf of it when both the GPU driver and libibverbs can
/// register one (GPUDirect RDMA through the kernel's dma-buf support); `None` means
/// plain `ibv_reg_mr`, which reaches device memory only through a peer-memory module.
fn gpudirect_dma_buf(s: &RdmaContext, region: &Region) -> Option<crate::device::DmaBuf> {
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

/// Deregisters `region` on every NIC (dropping its MRs; once they are, no peer can use
/// their rkeys).
pub(super) fn unregister(s: &RdmaContext, region: &Region) {
    let old = s.regions.write_locked().remove(&region.addr);
    drop(old);
}

/// A verbs call's failure (`what` names it and its object): `NoAvailableHandle` when
/// the provider or the kernel ran out of memory (`ENOMEM`), else `BackendUnavailable`.
pub(super) fn verbs_error(what: impl std::fmt::Display, e: std::io::Error) -> Error {
    let code = if e.kind() == std::io::ErrorKind::OutOfMemory {
        Code::NoAvailableHandle
    } else {
        Code::BackendUnavailable
    };
    Error::new(code, format!("{what}: {e}"))
}
