//! Cluster authentication, off unless a cluster secret is configured.
//!
//! With a secret (`MC_CLUSTER_SECRET`, the `cluster_secret` config key, or
//! `--cluster-secret-file`), every TCP connection to an engine's data or handshake
//! port and to the master's RPC port opens with a mutual challenge-response
//! ([`challenge`]) before any other byte is read, and every HTTP write (PUT, POST,
//! DELETE) to the metadata or admin server carries a signed header ([`http`]); reads
//! over HTTP stay open, so `curl` keeps working. Without a secret no byte on any
//! wire changes, so Mooncake 0.3 peers interoperate as before.
//!
//! What it is not: encryption. Bytes after the handshake travel in the clear, and an
//! attacker on the path between two authenticated peers can still read or splice a
//! connection; it keeps out peers that do not know the secret.

pub mod challenge;
mod connect;

use std::fmt;
use std::io::Read;
use std::sync::Arc;

pub use crate::sys::fill_random;
pub use connect::{connect, guard};

use crate::error::{Code, Error, Result};

/// The environment variable a secret is taken from when no configuration names one.
pub const SECRET_ENV: &str = "MC_CLUSTER_SECRET";
/// Largest secret file read, in bytes.
pub const MAX_SECRET_FILE: u64 = 4096;

/// The secret every member of a cluster shares. Its bytes never appear in logs or
/// `Debug` output.
#[derive(Clone)]
pub struct ClusterSecret(Arc<[u8]>);

impl fmt::Debug for ClusterSecret {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str("ClusterSecret(..)")
    }
}

/// Compared in constant time, like a MAC.
impl PartialEq for ClusterSecret {
    fn eq(&self, other: &ClusterSecret) -> bool {
        crate::util::hmac::equal(&self.0, &other.0)
    }
}

impl Eq for ClusterSecret {}

impl ClusterSecret {
    /// A secret from its bytes; an empty or whitespace-only one is refused (taking it
    /// for "no secret" would turn authentication off by mistake).
    pub fn new(bytes: &[u8]) -> Result<ClusterSecret> {
        if bytes.iter().all(u8::is_ascii_whitespace) {
            return Err(Error::invalid(
                "the cluster secret is empty or only whitespace",
            ));
        }
        if bytes.len() < 16 {
            log::warn!("the cluster secret is shorter than 16 bytes: easy to guess");
        }
        Ok(ClusterSecret(bytes.into()))
    }

    /// The secret in `MC_CLUSTER_SECRET`: `None` when it is unset; an error when it
    /// is set but empty or whitespace-only (servers and engines refuse to start then).
    pub fn from_env() -> Result<Option<ClusterSecret>> {
        let Some(value) = std::env::var_os(SECRET_ENV) else {
            return Ok(None);
        };
        ClusterSecret::new(std::os::unix::ffi::OsStrExt::as_bytes(value.as_os_str()))
            .map(Some)
            .map_err(|e| {
                e.prefixed(format!(
                    "{SECRET_ENV} is set but unusable (unset it to run without authentication)"
                ))
            })
    }

    /// The default secret of a configuration: `MC_CLUSTER_SECRET`'s. A blank one
    /// gives `None` here and is refused where servers and engines start
    /// ([`check_env`]).
    pub fn env_default() -> Option<ClusterSecret> {
        ClusterSecret::from_env().unwrap_or(None)
    }

    /// The secret held in a file (one trailing newline is not part of it).
    pub fn from_file(path: &str) -> Result<ClusterSecret> {
        ClusterSecret::from_file_named(path, "cluster secret")
    }

    /// A secret of another name (`what`, for errors) held in a file the same way: the
    /// master's owner key is one.
    pub fn from_file_named(path: &str, what: &str) -> Result<ClusterSecret> {
        let fail =
            |e: std::io::Error| Error::new(Code::FileReadFail, format!("{what} {path}: {e}"));
        let mut bytes = Vec::new();
        std::fs::File::open(path)
            .and_then(|f| f.take(MAX_SECRET_FILE + 1).read_to_end(&mut bytes))
            .map_err(fail)?;
        if bytes.len() as u64 > MAX_SECRET_FILE {
            return Err(Error::invalid(format!(
                "{what} {path}: longer than {MAX_SECRET_FILE} bytes"
            )));
        }
        let trimmed = bytes
            .strip_suffix(b"\r\n")
            .or_else(|| bytes.strip_suffix(b"\n"))
            .unwrap_or(&bytes);
        ClusterSecret::new(trimmed).map_err(|e| e.prefixed(format!("{what} {path}")))
    }

    /// The secret's bytes, for keys derived from it (the master's owner tickets).
    pub fn key(&self) -> &[u8] {
        &self.0
    }
}

/// Refuses to start with `MC_CLUSTER_SECRET` set but blank, which would otherwise
/// run the cluster without authentication (fail-open).
pub fn check_env() -> Result<()> {
    ClusterSecret::from_env().map(drop)
}

/// Logs a refused peer, rate-limited (a flood of bad peers must not flood the log):
/// one call site for every refusal, so they share one limit.
pub(crate) fn log_refusal(what: &str, peer: &str, why: &str) {
    crate::warn_limited!("{what}: refused {peer}: {why}");
}
