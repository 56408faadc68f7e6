//! Build script: gives the C shared library its SONAME and, with the `layout-check`
//! feature, generates bindings from the system verbs and libfabric headers for
//! `tests/layout.rs` to check the hand-written ffi structs against. (The layers below
//! have their own: `ffi/build.rs` marks a static build, `crates/base/build.rs` the
//! compiler's AVX-512 support.)

fn main() {
    println!("cargo:rerun-if-changed=build.rs");
    println!("cargo:rerun-if-changed=c_include/mooncake.h");
    if std::env::var("CARGO_CFG_TARGET_OS").as_deref() == Ok("linux") {
        println!("cargo:rustc-cdylib-link-arg=-Wl,-soname,libmooncake.so.0");
    }
    #[cfg(feature = "layout-check")]
    layout_check::generate();
}

#[cfg(feature = "layout-check")]
mod layout_check {
    use std::path::PathBuf;

    /// The structs `ffi/ibverbs.rs` mirrors (anything they contain comes along).
    const VERBS_TYPES: &[&str] = &[
        "ibv_gid",
        "_ibv_device_ops",
        "ibv_device",
        "ibv_context_ops",
        "ibv_context",
        "ibv_pd",
        "ibv_mr",
        "ibv_comp_channel",
        "ibv_cq",
        "ibv_qp",
        "ibv_qp_cap",
        "ibv_qp_init_attr",
        "ibv_global_route",
        "ibv_ah_attr",
        "ibv_qp_attr",
        "ibv_sge",
        "ibv_send_wr",
        "ibv_recv_wr",
        "ibv_wc",
        "ibv_port_attr",
    ];

    /// The structs `ffi/fabric.rs` mirrors.
    const FABRIC_TYPES: &[&str] = &[
        "fi_tx_attr",
        "fi_rx_attr",
        "fi_ep_attr",
        "fi_domain_attr",
        "fi_fabric_attr",
        "fi_info",
        "fid",
        "fi_ops",
        "fi_ops_fabric",
        "fid_fabric",
        "fi_ops_domain",
        "fi_ops_mr",
        "fid_domain",
        "fid_mr",
        "fi_mr_attr",
        "fi_av_attr",
        "fi_ops_av",
        "fid_av",
        "fi_cq_attr",
        "fi_cq_entry",
        "fi_cq_err_entry",
        "fi_ops_cq",
        "fid_cq",
        "fi_ops_ep",
        "fi_ops_cm",
        "fi_ops_rma",
        "fid_ep",
        "fi_context2",
        "fi_rma_iov",
        "fi_msg_rma",
        "fi_cntr_attr",
        "fi_ops_cntr",
        "fid_cntr",
    ];

    const FABRIC_HEADERS: &[&str] = &[
        "rdma/fabric.h",
        "rdma/fi_domain.h",
        "rdma/fi_endpoint.h",
        "rdma/fi_rma.h",
        "rdma/fi_cm.h",
        "rdma/fi_eq.h",
    ];

    pub fn generate() {
        let out = PathBuf::from(std::env::var_os("OUT_DIR").expect("OUT_DIR is set by cargo"));
        bind(
            &["infiniband/verbs.h"],
            VERBS_TYPES,
            &out.join("verbs_sys.rs"),
            "libibverbs-dev",
        );
        bind(
            FABRIC_HEADERS,
            FABRIC_TYPES,
            &out.join("fabric_sys.rs"),
            "libfabric-dev",
        );
    }

    fn bind(headers: &[&str], types: &[&str], out: &std::path::Path, package: &str) {
        let source: String = headers
            .iter()
            .map(|h| format!("#include <{h}>\n"))
            .collect();
        let mut builder = bindgen::Builder::default()
            .header_contents("layout_check.h", &source)
            .layout_tests(false)
            .generate_comments(false)
            .parse_callbacks(Box::new(bindgen::CargoCallbacks::new()));
        for t in types {
            builder = builder.allowlist_type(format!("^{t}$"));
        }
        // Without libclang bindgen panics; say what to install, whichever way it fails.
        let generated =
            std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| builder.generate()));
        let bindings = match generated {
            Ok(Ok(b)) => b,
            Ok(Err(e)) => panic!(
                "layout-check: bindgen could not parse {headers:?} ({e}); \
                 install {package} (and libclang-dev), or build without the `layout-check` feature"
            ),
            Err(_) => panic!(
                "layout-check: bindgen failed (is libclang installed? `apt-get install libclang-dev`); \
                 build without the `layout-check` feature to skip the check"
            ),
        };
        bindings
            .write_to_file(out)
            .unwrap_or_else(|e| panic!("layout-check: writing {}: {e}", out.display()));
    }
}
