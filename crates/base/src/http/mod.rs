//! A minimal HTTP/1.1 server and client for small JSON/text bodies.
//!
//! This is an internal building block (metadata REST, admin/metrics endpoints),
//! not a general web stack. The `server` runs on `crate::net::ConnServer` (one
//! accept thread plus one thread per connection), supports keep-alive,
//! `Content-Length` and chunked request bodies, and enforces limits on the request
//! head ([`MAX_REQUEST_HEAD`]) and body ([`MAX_REQUEST_BODY`]). The `client` keeps
//! one persistent connection, reconnects once when a reused connection turns out to
//! be dead, and understands `Content-Length`, chunked and read-to-EOF responses up
//! to [`MAX_RESPONSE_BODY`]. Both read and write messages through `wire`.

#![forbid(unsafe_code)]

mod client;
#[doc(hidden)]
pub mod fuzzing;
mod server;
pub mod signed;
mod wire;

use std::time::Duration;

pub use client::{BodyStream, HttpClient};
pub use server::{Handler, HttpServer};
pub use wire::{percent_decode, percent_encode, reason_phrase, Request, Response};

/// Largest accepted request head (request line plus headers), in bytes.
pub const MAX_REQUEST_HEAD: usize = 16 * 1024;
/// Largest accepted request body, in bytes.
pub const MAX_REQUEST_BODY: usize = 16 * 1024 * 1024;
/// Largest response body the client accepts, in bytes.
pub const MAX_RESPONSE_BODY: usize = 64 * 1024 * 1024;
/// A server connection idle (or stalled mid-request) this long is closed.
pub const SERVER_IDLE_TIMEOUT: Duration = Duration::from_secs(30);
/// Client connect timeout.
pub const CLIENT_CONNECT_TIMEOUT: Duration = Duration::from_secs(5);
/// Client read/write timeout.
pub const CLIENT_IO_TIMEOUT: Duration = Duration::from_secs(10);
