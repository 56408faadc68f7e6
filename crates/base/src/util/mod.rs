//! Small self-contained helpers.

pub mod base64;
pub mod crc32c;
pub mod hex;
pub mod hmac;
pub mod id_hash;
pub mod percentile;
pub mod prefetch;
pub mod ratelimit;
pub mod regex;
pub mod sha256;
pub mod size;
pub mod small_list;
pub mod stream_copy;
pub mod switch;
pub mod sync;

pub use percentile::percentile;
pub use small_list::SmallList;
