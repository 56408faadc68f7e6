//! The verbs objects (`mooncake::transport::rdma::verbs`) on the emulator: key and
//! bounds checks, the QP state machine, completion channels, and release in order.

use mooncake::ffi::ibverbs as ibv;
use mooncake::transport::rdma::verbs::{
    self, CompChannel, CompletionQueue, Context, DeviceList, MemoryRegion, ProtectionDomain,
    QueuePair, RcPath,
};

use crate::emu::{emu, readable, serial, DEVICES};

const ACCESS: libc::c_int =
    ibv::IBV_ACCESS_LOCAL_WRITE | ibv::IBV_ACCESS_REMOTE_WRITE | ibv::IBV_ACCESS_REMOTE_READ;

/// The first two emulated devices, opened.
fn two_devices(v: &'static ibv::Verbs) -> (std::sync::Arc<Context>, std::sync::Arc<Context>) {
    let list = DeviceList::new(v).expect("the emulator lists its devices");
    assert_eq!(list.names(), DEVICES);
    (list.open(0).unwrap(), list.open(1).unwrap())
}

/// Where `peer` is, as `to_rtr` wants it, from a QP on `ctx`'s port 1.
fn path_to(ctx: &Context, peer: &QueuePair) -> RcPath {
    let peer_ctx = peer.pd().context();
    RcPath {
        port: 1,
        gid_index: 0,
        mtu: ibv::IBV_MTU_4096.min(ctx.query_port(1).unwrap().active_mtu),
        remote_qpn: peer.qp_num(),
        remote_gid: peer_ctx.query_gid(1, 0).unwrap(),
        remote_lid: peer_ctx.query_port(1).unwrap().lid,
    }
}

#[test]
fn verbs_layer_checks_keys_ranges_and_states() {
    let Some(emu) = emu() else { return };
    let _g = serial();
    let v = ibv::verbs().expect("emulator loads as libibverbs");
    assert_eq!(v.device_names(), DEVICES);
    let failures = verbs::release_failures();
    let entries = emu.fabric_entries(std::process::id());
    // Declared before the regions, so they outlive them.
    let mut a = vec![1u8; 4096];
    let mut b = vec![0u8; 4096];
    let (c0, c1) = two_devices(v);
    let p = c0.query_port(1).unwrap();
    assert_eq!((p.state, p.lid), (ibv::IBV_PORT_ACTIVE, 1));
    let (pd0, pd1) = (
        ProtectionDomain::new(&c0).unwrap(),
        ProtectionDomain::new(&c1).unwrap(),
    );
    // SAFETY: `a` and `b` stay allocated and untouched by anything else until the
    // regions are dropped below.
    let (ma, mb) = unsafe {
        (
            MemoryRegion::register(&pd0, a.as_mut_ptr().cast(), a.len(), ACCESS).unwrap(),
            MemoryRegion::register(&pd1, b.as_mut_ptr().cast(), b.len(), ACCESS).unwrap(),
        )
    };
    let cq0 = CompletionQueue::new(&c0, 16, None).unwrap();
    let cq1 = CompletionQueue::new(&c1, 16, None).unwrap();
    let q0 = QueuePair::new_rc(&pd0, &cq0, 16, false).unwrap();
    let q1 = QueuePair::new_rc(&pd1, &cq1, 16, false).unwrap();
    let post = |qp: &QueuePair, rkey: u32, raddr: u64, len: u32| {
        let mut sge = ibv::ibv_sge {
            addr: a.as_ptr() as u64,
            length: len,
            lkey: ma.lkey(),
        };
        let mut wr = ibv::ibv_send_wr {
            wr_id: 42,
            sg_list: &mut sge,
            num_sge: 1,
            opcode: ibv::IBV_WR_RDMA_WRITE,
            send_flags: ibv::IBV_SEND_SIGNALED,
            ..Default::default()
        };
        wr.rdma.remote_addr = raddr;
        wr.rdma.rkey = rkey;
        // SAFETY: one scatter entry inside `a`, which `ma` registers and keeps.
        unsafe { qp.post_send(&mut wr) }
    };
    // Posting on a QP that is not ready to send is refused.
    assert_eq!(
        post(&q0, mb.rkey(), b.as_ptr() as u64, 64),
        Err(libc::EINVAL)
    );
    assert_ne!(
        c0.query_gid(1, 0).unwrap(),
        c1.query_gid(1, 0).unwrap(),
        "a GID per device"
    );
    // Connect q0 <-> q1 through the library's state machine: RESET -> INIT -> RTR -> RTS.
    let connect_pair = || {
        for (ctx, qp, peer) in [(&c0, &q0, &q1), (&c1, &q1, &q0)] {
            qp.set_state(ibv::IBV_QPS_RESET).unwrap();
            // Skipping INIT is refused.
            assert!(qp.set_state(ibv::IBV_QPS_RTR).is_err());
            qp.connect(ACCESS, &path_to(ctx, peer)).unwrap();
        }
    };
    connect_pair();
    let poll = |cq: &CompletionQueue| {
        let mut wc = [ibv::ibv_wc::default(); 4];
        assert_eq!(cq.poll(&mut wc), Ok(1));
        wc[0]
    };
    // A good write.
    assert_eq!(post(&q0, mb.rkey(), b.as_ptr() as u64 + 100, 64), Ok(()));
    let wc = poll(&cq0);
    assert_eq!(
        (wc.wr_id, wc.status, wc.byte_len),
        (42, ibv::IBV_WC_SUCCESS, 64)
    );
    assert!(b[100..164].iter().all(|x| *x == 1) && b[164] == 0);
    // A wrong rkey, in the other direction: remote access error, q1 to ERR.
    let mut sge = ibv::ibv_sge {
        addr: b.as_ptr() as u64,
        length: 64,
        lkey: mb.lkey(),
    };
    let mut wr = ibv::ibv_send_wr {
        wr_id: 7,
        sg_list: &mut sge,
        num_sge: 1,
        opcode: ibv::IBV_WR_RDMA_READ,
        send_flags: ibv::IBV_SEND_SIGNALED,
        ..Default::default()
    };
    wr.rdma.remote_addr = a.as_ptr() as u64;
    wr.rdma.rkey = ma.rkey() ^ 0x5555;
    // SAFETY: one scatter entry inside `b`, which `mb` registers and keeps.
    assert_eq!(unsafe { q1.post_send(&mut wr) }, Ok(()));
    assert_eq!(poll(&cq1).status, ibv::IBV_WC_REM_ACCESS_ERR);
    // ERR -> RESET -> ... -> RTS brings the pair back.
    connect_pair();

    // Past the end of the remote MR: remote access error, QP to ERR.
    assert_eq!(post(&q0, mb.rkey(), b.as_ptr() as u64 + 4090, 64), Ok(()));
    let wc = poll(&cq0);
    assert_eq!(
        wc.status,
        ibv::IBV_WC_REM_ACCESS_ERR,
        "{}",
        ibv::wc_status_name(wc.status)
    );
    assert_eq!(b[4090], 0);
    // Later requests on the broken QP are flushed.
    assert_eq!(post(&q0, mb.rkey(), b.as_ptr() as u64, 64), Ok(()));
    assert_eq!(poll(&cq0).status, ibv::IBV_WC_WR_FLUSH_ERR);

    // Parents first: each object still goes after its children (the emulator refuses a
    // PD with MRs, a CQ with QPs, and counts the QPs and MRs on its fabric).
    drop((c0, c1, pd0, pd1, cq0, cq1));
    assert!(emu.fabric_entries(std::process::id()) > entries);
    drop((ma, mb, q0, q1));
    assert_eq!(emu.fabric_entries(std::process::id()), entries);
    assert_eq!(verbs::release_failures(), failures, "every object released");
    drop((a, b));

    let info = ibv::info();
    assert_eq!(info.devices.len(), 3, "{info:?}");
    assert!(info.devices[0].contains("emu0 port 1: active"), "{info:?}");
}

/// Completion channels on the emulator: an armed CQ's next completion makes the
/// channel's descriptor readable and queues one event, which reads without blocking
/// and must be acknowledged before the CQ can go (which the CQ's drop does).
#[test]
fn completion_channel_reports_armed_cqs() {
    let Some(_) = emu() else { return };
    let _g = serial();
    let v = ibv::verbs().expect("emulator loads as libibverbs");
    let failures = verbs::release_failures();
    let (c0, c1) = two_devices(v);
    let ch = CompChannel::new(&c0).unwrap();
    ch.set_nonblocking().unwrap();
    let fd = ch.fd();
    // A channel serves the CQs of its own device only.
    assert!(CompletionQueue::new(&c1, 16, Some(&ch)).is_err());
    let cq = CompletionQueue::new(&c0, 16, Some(&ch)).unwrap();
    // SAFETY: a live CQ; reads the channel pointer it was created with.
    assert_eq!(unsafe { (*cq.as_ptr()).channel }, ch.as_ptr());
    // Nothing queued: not readable, and reading fails at once instead of blocking.
    assert!(!readable(fd, 0));
    let err = cq.read_event().unwrap_err();
    assert_eq!(err.raw_os_error(), Some(libc::EAGAIN), "{err}");
    // Completions come cheaply from a QP in the error state: each post is flushed.
    let pd = ProtectionDomain::new(&c0).unwrap();
    let qp = QueuePair::new_rc(&pd, &cq, 16, true).unwrap();
    qp.set_state(ibv::IBV_QPS_ERR).unwrap();
    let flushed = || {
        let mut wr = ibv::ibv_send_wr {
            wr_id: 5,
            opcode: ibv::IBV_WR_RDMA_WRITE,
            ..Default::default()
        };
        // SAFETY: no scatter entries, so no memory is touched; the QP flushes it.
        assert_eq!(unsafe { qp.post_send(&mut wr) }, Ok(()));
    };
    let mut wc = [ibv::ibv_wc::default(); 4];
    // Not armed: a completion raises no event.
    flushed();
    assert!(!readable(fd, 0));
    assert_eq!(cq.poll(&mut wc), Ok(1));
    assert_eq!(wc[0].status, ibv::IBV_WC_WR_FLUSH_ERR);
    // Armed: the next completion does, once.
    cq.arm().unwrap();
    assert!(!readable(fd, 0));
    flushed();
    assert!(readable(fd, 0));
    assert!(cq.read_event().unwrap(), "the event is this CQ's");
    assert!(!readable(fd, 0));
    flushed();
    assert!(!readable(fd, 0), "one event per arm");
    assert_eq!(cq.poll(&mut wc), Ok(2));
    drop(qp);
    // An event read but not acknowledged keeps the CQ, and so the channel, alive: the
    // emulator refuses to destroy them (real libibverbs would wait forever).
    // SAFETY: refused calls: the emulator keeps both objects, still owned by `cq`/`ch`.
    unsafe {
        assert_eq!((v.destroy_cq)(cq.as_ptr()), libc::EBUSY);
        assert_eq!((v.destroy_comp_channel)(ch.as_ptr()), libc::EBUSY);
    }
    // Dropping the CQ acknowledges its event before destroying it, then the channel.
    drop((ch, pd, c0, c1, cq));
    assert_eq!(verbs::release_failures(), failures, "every object released");
}
