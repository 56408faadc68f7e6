//! The base layer of Mooncake in Rust: what every part above it shares and nothing
//! here depends on them. One error type ([`error`]), the few OS calls std lacks
//! ([`sys`], [`memfd`], [`memory_room`]), sockets and servers ([`net`], [`http`]), cluster
//! authentication ([`auth`]), the etcd and redis clients, JSON and small utilities.

/// The runtime-loaded bindings, named as the code below names them.
use mooncake_sys as ffi;

pub mod auth;
pub mod error;
pub mod etcd;
pub mod http;
pub mod json;
pub mod mailbox;
pub mod memfd;
pub mod memory_room;
pub mod net;
pub mod redis;
pub mod sys;
pub mod util;

pub use error::{Code, Error, Result};
