//! Small self-contained helpers.

pub mod crc32c;
pub mod hex;
pub mod percentile;
pub mod regex;

pub use percentile::percentile;
