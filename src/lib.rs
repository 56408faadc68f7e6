//! Mooncake in Rust: a transfer engine and KV-cache store data plane.
//!
//! Layering (arrows point one way): `ffi` → `transport` → `engine` → `capi`.
//! `json`, `http`, `wire` and `metadata` are shared building blocks.

#[path = "../ffi/mod.rs"]
pub mod ffi;

pub mod error;
pub mod http;
pub mod json;
pub mod metadata;

pub use error::{Code, Error, Result};
