//! The transfer engine: registered memory ([`registry`]), device memory ([`device`]),
//! where segments are described ([`metadata`]), the byte layouts shared with Mooncake
//! peers ([`wire`]), the ways bytes move ([`transport`]) and the engine that batches
//! requests over them ([`engine`]). Built on `mooncake-base`; knows nothing of the
//! store or the collectives above it.

// The layers below, named as the code in this crate names them (`crate::util`, ...).
use mooncake_base::{auth, error, etcd, http, json, memfd, net, redis, sys, util, warn_limited};
use mooncake_base::{Code, Error, Result};
use mooncake_sys as ffi;

pub mod device;
pub mod engine;
pub mod metadata;
pub mod registry;
pub mod transport;
pub mod wire;

pub use engine::{Engine, EngineConfig, Protocol, Request};
pub use transport::Op;
