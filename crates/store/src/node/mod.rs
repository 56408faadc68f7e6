//! The store as a node sees it: what a client lending memory to the pool owes the
//! master (`duties`), the catalog of its segment it keeps for a master that lost its
//! state (`catalog`), and its disk tier (`disk`).

pub mod catalog;
pub mod disk;
mod duties;

pub use duties::DrainReport;
