//! Runtime-loaded native libraries (RDMA verbs, libfabric, GPU drivers). Nothing here
//! links against them: each is opened with `dlopen` when first needed, so a machine
//! without them still builds and runs, and says which backend is missing and why.

pub mod acl;
pub mod cuda;
pub mod fabric;
pub mod hip;
pub mod ibverbs;
pub mod loader;
