//! Mooncake in Rust: a transfer engine and KV-cache store data plane.
//!
//! Layering (arrows point one way): `ffi` → `transport` → `engine` → `capi`.
//! `json`, `http`, `wire`, `sys`, `net`, `registry` (registered buffers), `memfd`
//! (shareable mappings) and `metadata` are shared building blocks below them.

#[path = "../ffi/mod.rs"]
pub mod ffi;

pub mod auth;
pub mod capi;
pub mod collective;
pub mod device;
pub mod engine;
pub mod error;
pub mod etcd;
pub mod http;
pub mod json;
pub mod memfd;
pub mod metadata;
pub(crate) mod net;
pub mod redis;
pub mod registry;
pub mod store;
pub(crate) mod sys;
pub mod transport;
pub mod util;
pub mod wire;

pub use engine::{Engine, EngineConfig, Protocol, Request};
pub use error::{Code, Error, Result};
pub use net::{default_route_source, interface_ipv4, reachable_address, ServerLimits};
pub use transport::Op;
