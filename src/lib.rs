//! Mooncake in Rust: a transfer engine and KV-cache store data plane.
//!
//! The layers are crates, so arrows point one way: `mooncake-sys` (`ffi/`, the
//! runtime-loaded native libraries) → `mooncake-base` (errors, OS calls, sockets,
//! HTTP, auth, etcd, redis) → `mooncake-engine` (registered memory, metadata,
//! transports, the engine) → `mooncake-store` and `mooncake-collective` → this crate:
//! the C ABI ([`capi`]) and the `mooncake` command. Each layer is re-exported here
//! under the module name it had before the split.

pub use mooncake_base::{auth, error, etcd, http, json, memfd, redis, util};
pub use mooncake_collective as collective;
pub use mooncake_engine::{device, engine, metadata, registry, transport, wire};
pub use mooncake_store as store;
pub use mooncake_sys as ffi;

// Below the public surface: the C ABI's own use of them.
use mooncake_base::{net, warn_limited};

pub mod capi;

pub use engine::{Engine, EngineConfig, Protocol, Request};
pub use error::{Code, Error, Result};
pub use net::{default_route_source, interface_ipv4, reachable_address, ServerLimits};
pub use transport::Op;
