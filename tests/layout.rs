//! Layout check: every hand-written struct in `ffi/ibverbs.rs` and `ffi/fabric.rs` against
//! bindings bindgen generates from the system headers (rdma-core's `infiniband/verbs.h`,
//! libfabric's `rdma/*.h`): size, alignment, and each declared field's offset and size.
//! The field lists are checked for completeness at compile time (an exhaustive pattern),
//! so a field added to a mirror without being listed here does not build (rustc then says
//! "pattern requires `..` due to inaccessible fields").
//!
//! Needs libclang, libibverbs-dev and libfabric-dev:
//! `cargo test --features layout-check --test layout`.
#![cfg(feature = "layout-check")]

use std::mem::{align_of, offset_of, size_of};

use mooncake::ffi::fabric as fo;
use mooncake::ffi::ibverbs as vo;

#[allow(
    non_camel_case_types,
    non_snake_case,
    non_upper_case_globals,
    dead_code,
    unsafe_op_in_unsafe_fn,
    clippy::all
)]
mod vs {
    include!(concat!(env!("OUT_DIR"), "/verbs_sys.rs"));
}

#[allow(
    non_camel_case_types,
    non_snake_case,
    non_upper_case_globals,
    dead_code,
    unsafe_op_in_unsafe_fn,
    clippy::all
)]
mod fs {
    include!(concat!(env!("OUT_DIR"), "/fabric_sys.rs"));
}

/// Size of the field a projection closure points at (the closure is never called).
fn field_size<T, F>(_: fn(*const T) -> *const F) -> usize {
    size_of::<F>()
}

/// `check!(bad, ours::T => sys::U, [field, field = sys_field.sub, field = _])`: compares
/// size and alignment, then each of our fields with the header's field of the same name
/// (or the one after `=`; `_` for padding with no counterpart, which must still lie
/// inside the struct). Mismatches are pushed onto `bad`.
macro_rules! check {
    ($bad:ident, $ours:path => $sys:path, [$($f:ident $(= $($g:tt).+)?),* $(,)?]) => {{
        // Compile-time completeness: every field of ours is listed.
        let _ = |v: &$ours| {
            let $ours { $($f: _),* } = v;
        };
        let name = stringify!($ours);
        let (so, ss) = (size_of::<$ours>(), size_of::<$sys>());
        if so != ss {
            $bad.push(format!("{name}: size {so}, header {ss}"));
        }
        let (ao, as_) = (align_of::<$ours>(), align_of::<$sys>());
        if ao != as_ {
            $bad.push(format!("{name}: align {ao}, header {as_}"));
        }
        $(
            let off = offset_of!($ours, $f);
            let len = field_size(|p: *const $ours| unsafe { &raw const (*p).$f });
            check!(@field $bad, name, $f, off, len, $sys, $($($g).+)?);
        )*
    }};
    (@field $bad:ident, $name:ident, $f:ident, $off:ident, $len:ident, $sys:path, _) => {
        if $off + $len > size_of::<$sys>() {
            $bad.push(format!(
                "{}.{}: padding at {}..{} runs past the header's size {}",
                $name, stringify!($f), $off, $off + $len, size_of::<$sys>()
            ));
        }
    };
    (@field $bad:ident, $name:ident, $f:ident, $off:ident, $len:ident, $sys:path, $($g:ident).+) => {
        let hoff = offset_of!($sys, $($g).+);
        let hlen = field_size(|p: *const $sys| unsafe { &raw const (*p).$($g).+ });
        if ($off, $len) != (hoff, hlen) {
            $bad.push(format!(
                "{}.{} (header {}): offset {} size {}, header offset {} size {}",
                $name, stringify!($f), stringify!($($g).+), $off, $len, hoff, hlen
            ));
        }
    };
    (@field $bad:ident, $name:ident, $f:ident, $off:ident, $len:ident, $sys:path,) => {
        check!(@field $bad, $name, $f, $off, $len, $sys, $f);
    };
}

fn report(header: &str, bad: Vec<String>) {
    assert!(
        bad.is_empty(),
        "{} mismatch(es) against {header}:\n  {}",
        bad.len(),
        bad.join("\n  ")
    );
}

#[test]
fn ibverbs_matches_verbs_h() {
    let mut bad = Vec::new();
    check!(bad, vo::ibv_gid => vs::ibv_gid, [raw]);
    check!(bad, vo::_ibv_device_ops => vs::_ibv_device_ops, [_dummy1, _dummy2]);
    check!(bad, vo::ibv_device => vs::ibv_device, [
        _ops, node_type, transport_type, name, dev_name, dev_path, ibdev_path,
    ]);
    check!(bad, vo::ibv_context_ops => vs::ibv_context_ops, [
        _compat_query_device, _compat_query_port, _compat_alloc_pd, _compat_dealloc_pd,
        _compat_reg_mr, _compat_rereg_mr, _compat_dereg_mr, alloc_mw, bind_mw, dealloc_mw,
        _compat_create_cq, poll_cq, req_notify_cq, _compat_cq_event, _compat_resize_cq,
        _compat_destroy_cq, _compat_create_srq, _compat_modify_srq, _compat_query_srq,
        _compat_destroy_srq, post_srq_recv, _compat_create_qp, _compat_query_qp,
        _compat_modify_qp, _compat_destroy_qp, post_send, post_recv, _compat_create_ah,
        _compat_destroy_ah, _compat_attach_mcast, _compat_detach_mcast, _compat_async_event,
    ]);
    check!(bad, vo::ibv_context => vs::ibv_context, [
        device, ops, cmd_fd, async_fd, num_comp_vectors, mutex, abi_compat,
    ]);
    check!(bad, vo::ibv_pd => vs::ibv_pd, [context, handle]);
    check!(bad, vo::ibv_mr => vs::ibv_mr, [context, pd, addr, length, handle, lkey, rkey]);
    check!(bad, vo::ibv_comp_channel => vs::ibv_comp_channel, [context, fd, refcnt]);
    check!(bad, vo::ibv_cq => vs::ibv_cq, [
        context, channel, cq_context, handle, cqe, mutex, cond, comp_events_completed,
        async_events_completed,
    ]);
    check!(bad, vo::ibv_qp => vs::ibv_qp, [
        context, qp_context, pd, send_cq, recv_cq, srq, handle, qp_num, state, qp_type, mutex,
        cond, events_completed,
    ]);
    check!(bad, vo::ibv_qp_cap => vs::ibv_qp_cap, [
        max_send_wr, max_recv_wr, max_send_sge, max_recv_sge, max_inline_data,
    ]);
    check!(bad, vo::ibv_qp_init_attr => vs::ibv_qp_init_attr, [
        qp_context, send_cq, recv_cq, srq, cap, qp_type, sq_sig_all,
    ]);
    check!(bad, vo::ibv_global_route => vs::ibv_global_route, [
        dgid, flow_label, sgid_index, hop_limit, traffic_class,
    ]);
    check!(bad, vo::ibv_ah_attr => vs::ibv_ah_attr, [
        grh, dlid, sl, src_path_bits, static_rate, is_global, port_num,
    ]);
    check!(bad, vo::ibv_qp_attr => vs::ibv_qp_attr, [
        qp_state, cur_qp_state, path_mtu, path_mig_state, qkey, rq_psn, sq_psn, dest_qp_num,
        qp_access_flags, cap, ah_attr, alt_ah_attr, pkey_index, alt_pkey_index,
        en_sqd_async_notify, sq_draining, max_rd_atomic, max_dest_rd_atomic, min_rnr_timer,
        port_num, timeout, retry_cnt, rnr_retry, alt_port_num, alt_timeout, rate_limit,
    ]);
    check!(bad, vo::ibv_sge => vs::ibv_sge, [addr, length, lkey]);
    // Our `wr.rdma` arm stands for the whole `wr` union (padded to its largest arm).
    check!(bad, vo::ibv_send_wr_rdma => vs::ibv_send_wr__bindgen_ty_2, [
        remote_addr = rdma.remote_addr,
        rkey = rdma.rkey,
        _union_tail = _,
    ]);
    check!(bad, vo::ibv_send_wr => vs::ibv_send_wr, [
        wr_id, next, sg_list, num_sge, opcode, send_flags,
        imm_data = __bindgen_anon_1.imm_data,
        rdma = wr,
        remote_srqn = qp_type.xrc.remote_srqn,
        _bind_mw = __bindgen_anon_2,
    ]);
    check!(bad, vo::ibv_recv_wr => vs::ibv_recv_wr, [wr_id, next, sg_list, num_sge]);
    check!(bad, vo::ibv_wc => vs::ibv_wc, [
        wr_id, status, opcode, vendor_err, byte_len,
        imm_data = __bindgen_anon_1.imm_data,
        qp_num, src_qp, wc_flags, pkey_index, slid, sl, dlid_path_bits,
    ]);
    check!(bad, vo::ibv_port_attr => vs::ibv_port_attr, [
        state, max_mtu, active_mtu, gid_tbl_len, port_cap_flags, max_msg_sz, bad_pkey_cntr,
        qkey_viol_cntr, pkey_tbl_len, lid, sm_lid, lmc, max_vl_num, sm_sl, subnet_timeout,
        init_type_reply, active_width, active_speed, phys_state, link_layer, flags,
        port_cap_flags2,
    ]);
    report("infiniband/verbs.h", bad);
}

#[test]
fn fabric_matches_libfabric_headers() {
    let mut bad = Vec::new();
    check!(bad, fo::fi_tx_attr => fs::fi_tx_attr, [
        caps, mode, op_flags, msg_order, comp_order, inject_size, size, iov_limit,
        rma_iov_limit, tclass,
    ]);
    check!(bad, fo::fi_rx_attr => fs::fi_rx_attr, [
        caps, mode, op_flags, msg_order, comp_order, total_buffered_recv, size, iov_limit,
    ]);
    check!(bad, fo::fi_ep_attr => fs::fi_ep_attr, [
        type_, protocol, protocol_version, max_msg_size, msg_prefix_size, max_order_raw_size,
        max_order_war_size, max_order_waw_size, mem_tag_format, tx_ctx_cnt, rx_ctx_cnt,
        auth_key_size, auth_key,
    ]);
    check!(bad, fo::fi_domain_attr => fs::fi_domain_attr, [
        domain, name, threading, control_progress, data_progress, resource_mgmt, av_type,
        mr_mode, mr_key_size, cq_data_size, cq_cnt, ep_cnt, tx_ctx_cnt, rx_ctx_cnt,
        max_ep_tx_ctx, max_ep_rx_ctx, max_ep_stx_ctx, max_ep_srx_ctx, cntr_cnt, mr_iov_limit,
        caps, mode, auth_key, auth_key_size, max_err_data, mr_cnt, tclass,
    ]);
    check!(bad, fo::fi_fabric_attr => fs::fi_fabric_attr, [
        fabric, name, prov_name, prov_version, api_version,
    ]);
    check!(bad, fo::fi_info => fs::fi_info, [
        next, caps, mode, addr_format, src_addrlen, dest_addrlen, src_addr, dest_addr, handle,
        tx_attr, rx_attr, ep_attr, domain_attr, fabric_attr, nic,
    ]);
    check!(bad, fo::fid => fs::fid, [fclass, context, ops]);
    check!(bad, fo::fi_ops => fs::fi_ops, [
        size, close, bind, control, ops_open, tostr, ops_set,
    ]);
    check!(bad, fo::fi_ops_fabric => fs::fi_ops_fabric, [
        size, domain, passive_ep, eq_open, wait_open, trywait, domain2,
    ]);
    check!(bad, fo::fid_fabric => fs::fid_fabric, [fid, ops, api_version]);
    check!(bad, fo::fi_ops_domain => fs::fi_ops_domain, [
        size, av_open, cq_open, endpoint, scalable_ep, cntr_open, poll_open, stx_ctx, srx_ctx,
        query_atomic, query_collective, endpoint2,
    ]);
    check!(bad, fo::fi_ops_mr => fs::fi_ops_mr, [size, reg, regv, regattr]);
    check!(bad, fo::fid_domain => fs::fid_domain, [fid, ops, mr]);
    check!(bad, fo::fid_mr => fs::fid_mr, [fid, mem_desc, key]);
    check!(bad, fo::fi_mr_attr => fs::fi_mr_attr, [
        mr_iov, iov_count, access, offset, requested_key, context, auth_key_size, auth_key,
        iface, device,
    ]);
    check!(bad, fo::fi_av_attr => fs::fi_av_attr, [
        type_, rx_ctx_bits, count, ep_per_node, name, map_addr, flags,
    ]);
    check!(bad, fo::fi_ops_av => fs::fi_ops_av, [
        size, insert, insertsvc, insertsym, remove, lookup, straddr, av_set,
    ]);
    check!(bad, fo::fid_av => fs::fid_av, [fid, ops]);
    check!(bad, fo::fi_cq_attr => fs::fi_cq_attr, [
        size, flags, format, wait_obj, signaling_vector, wait_cond, wait_set,
    ]);
    check!(bad, fo::fi_cq_entry => fs::fi_cq_entry, [op_context]);
    check!(bad, fo::fi_cq_err_entry => fs::fi_cq_err_entry, [
        op_context, flags, len, buf, data, tag, olen, err, prov_errno, err_data, err_data_size,
    ]);
    check!(bad, fo::fi_ops_cq => fs::fi_ops_cq, [
        size, read, readfrom, readerr, sread, sreadfrom, signal, strerror,
    ]);
    check!(bad, fo::fid_cq => fs::fid_cq, [fid, ops]);
    check!(bad, fo::fi_ops_ep => fs::fi_ops_ep, [
        size, cancel, getopt, setopt, tx_ctx, rx_ctx, rx_size_left, tx_size_left,
    ]);
    check!(bad, fo::fi_ops_cm => fs::fi_ops_cm, [
        size, setname, getname, getpeer, connect, listen, accept, reject, shutdown, join,
    ]);
    check!(bad, fo::fi_ops_rma => fs::fi_ops_rma, [
        size, read, readv, readmsg, write, writev, writemsg, inject, writedata, injectdata,
    ]);
    check!(bad, fo::fid_ep => fs::fid_ep, [
        fid, ops, cm, msg, rma, tagged, atomic, collective,
    ]);
    check!(bad, fo::fi_context2 => fs::fi_context2, [internal]);
    check!(bad, fo::fi_rma_iov => fs::fi_rma_iov, [addr, len, key]);
    check!(bad, fo::fi_msg_rma => fs::fi_msg_rma, [
        msg_iov, desc, iov_count, addr, rma_iov, rma_iov_count, context, data,
    ]);
    check!(bad, fo::fi_cntr_attr => fs::fi_cntr_attr, [events, wait_obj, wait_set, flags]);
    check!(bad, fo::fi_ops_cntr => fs::fi_ops_cntr, [
        size, read, readerr, add, set, wait, adderr, seterr,
    ]);
    check!(bad, fo::fid_cntr => fs::fid_cntr, [fid, ops]);
    report("rdma/fabric.h and friends", bad);
}

/// The checker itself: a deliberately wrong pairing is reported, not passed.
#[test]
fn checker_reports_mismatches() {
    let mut bad = Vec::new();
    // Same size and alignment; `handle` (offset 8) is paired with `lkey` (offset 12).
    check!(bad, vo::ibv_pd => vs::ibv_sge, [context = addr, handle = lkey]);
    assert_eq!(bad.len(), 1, "{bad:?}");
    assert!(
        bad[0].contains("offset 8 size 4, header offset 12 size 4"),
        "{bad:?}"
    );
}
