//! The distributed KV-cache store: a master holding object metadata and one slab
//! allocator per mounted segment, and clients that lend memory and move bytes peer to
//! peer with the transfer engine.
//!
//! Built on `mooncake-engine` and `mooncake-base`; the C ABI, CLI and Python package
//! sit above it.

// The layers below, named as the code in this crate names them (`crate::engine`, ...).
use mooncake_base::{auth, error, etcd, http, json, mailbox, net, sys, util, warn_limited};
use mooncake_engine::{engine, metadata, transport};

pub mod allocator;
pub mod client;
pub mod codec;
pub mod disk;
pub mod ha;
pub mod master;
pub mod node;
pub mod protocol;
mod replica_cache;
pub mod rpc;
pub mod segment_reach;
pub mod server;
mod slot_index;

pub use client::{default_metadata, metadata_of_master, Client, ClientConfig};
pub use master::{Master, MasterConfig};
pub use node::DrainReport;
pub use protocol::ReplicateConfig;
pub use server::{MasterServer, ServerConfig};
