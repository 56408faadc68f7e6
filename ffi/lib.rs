//! Runtime-loaded native libraries (RDMA verbs, libfabric, GPU drivers). Nothing here
//! links against them: each is opened with `dlopen` when first needed, so a machine
//! without them still builds and runs, and says which backend is missing and why.
//!
//! This layer depends on nothing above it: its failures are [`error::Error`], which the
//! crate's error converts from.

pub mod acl;
pub mod cpython;
pub mod cuda;
pub mod error;
pub mod fabric;
pub mod hip;
pub mod ibverbs;
pub mod loader;
mod table;
