//! Signed HTTP writes. Reads (GET, HEAD) stay open so `curl` and dashboards keep
//! working; any other method must carry
//!
//! ```text
//! X-Mooncake-Auth: v2 ts=<unix seconds> nonce=<32 hex digits> server=<id> mac=<64 hex digits>
//! mac = HMAC-SHA256(secret, CONTEXT | server | method | path | query pairs | ts | nonce | SHA-256(body))
//! ```
//!
//! (each field length-prefixed; path and query as decoded by the server). A request
//! is refused with 401 when the header is missing or wrong, when it names another
//! server, when `ts` is more than [`REPLAY_WINDOW`] from the server's clock, or when
//! its nonce was seen within the window (a replay).
//!
//! `server` is the identity the server publishes in [`SERVER_HEADER`] on every
//! answer: random, drawn when it starts. So a signed write replayed to another server
//! with the same secret fails, and so does one replayed to the same server after it
//! restarted (its nonces of before are forgotten, but so is the identity they were
//! signed for). An identity rather than the server's address, because a server
//! reached under several names (loopback, a LAN address, DNS) cannot tell which one a
//! client signed; and no state has to outlive a restart. Our own HTTP client adds the
//! header when it has a secret: it learns the identity from any answer, and when a
//! write is refused under an identity it did not sign for (first contact, a restart)
//! it signs again for the one given and resends once.

use crate::util::sync::Unpoisoned;
use std::collections::HashMap;
use std::sync::{Arc, Mutex};
use std::time::{Duration, SystemTime, UNIX_EPOCH};

use super::{Handler, Request, Response};
use crate::auth::ClusterSecret;
use crate::util::hmac::{self, HmacSha256};
use crate::util::{hex, sha256};

/// The request header carrying the proof.
pub const HEADER: &str = "X-Mooncake-Auth";
/// The response header carrying the server's identity, which proofs must name.
pub const SERVER_HEADER: &str = "X-Mooncake-Server";
/// How far a signed request's time may be from the server's, either way.
pub const REPLAY_WINDOW: Duration = Duration::from_secs(60);
/// Nonces remembered at most; past this, signed writes are refused until old ones
/// leave the window (a bound on what a flood of valid writes can cost).
const MAX_SEEN: usize = 1 << 16;
const NONCE_LEN: usize = 16;
const CONTEXT: &[u8] = b"mooncake http auth v2\0";

/// Whether `method` changes state and so needs a proof.
pub fn is_write(method: &str) -> bool {
    !matches!(method, "GET" | "HEAD")
}

fn now_secs() -> u64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map_or(0, |d| d.as_secs())
}

#[allow(clippy::too_many_arguments)] // each is one field of the proof
fn mac(
    secret: &ClusterSecret,
    server: &str,
    method: &str,
    path: &str,
    query: &[(String, String)],
    ts: u64,
    nonce: &[u8],
    body: &[u8],
) -> [u8; 32] {
    let mut m = HmacSha256::new(secret.key());
    let mut field = |bytes: &[u8]| {
        m.update(&(bytes.len() as u64).to_le_bytes());
        m.update(bytes);
    };
    field(CONTEXT);
    field(server.as_bytes());
    field(method.as_bytes());
    field(path.as_bytes());
    field(&(query.len() as u64).to_le_bytes());
    for (k, v) in query {
        field(k.as_bytes());
        field(v.as_bytes());
    }
    field(&ts.to_le_bytes());
    field(nonce);
    field(&sha256::digest(body));
    m.finish()
}

/// The `X-Mooncake-Auth` value for a request to the server whose identity is
/// `server` (empty when not known yet: the server refuses it and says its identity),
/// path and query decoded as the server will see them, with a fresh nonce and the
/// current time.
pub fn sign(
    secret: &ClusterSecret,
    server: &str,
    method: &str,
    path: &str,
    query: &[(String, String)],
    body: &[u8],
) -> std::io::Result<String> {
    let mut nonce = [0u8; NONCE_LEN];
    crate::auth::fill_random(&mut nonce)?;
    let ts = now_secs();
    let tag = mac(secret, server, method, path, query, ts, &nonce, body);
    Ok(format!(
        "v2 ts={ts} nonce={} server={server} mac={}",
        hex::encode(&nonce),
        hex::encode(&tag)
    ))
}

/// Checks signed writes: proof, the server they name, time window and nonce reuse.
pub struct Verifier {
    secret: ClusterSecret,
    /// This server's identity, drawn at start.
    id: String,
    /// Nonces accepted within the window, with their request time.
    seen: Mutex<HashMap<[u8; NONCE_LEN], u64>>,
}

impl Verifier {
    /// A verifier for requests signed with `secret`.
    pub fn new(secret: ClusterSecret) -> Verifier {
        let draw = || format!("{:016x}", crate::sys::random_u64());
        Verifier {
            secret,
            id: draw() + &draw(),
            seen: Mutex::new(HashMap::new()),
        }
    }

    /// The identity proofs must name ([`SERVER_HEADER`]).
    pub fn id(&self) -> &str {
        &self.id
    }

    /// `Ok` for a read, or for a write with a valid, fresh proof; else why not.
    pub fn check(&self, req: &Request) -> Result<(), &'static str> {
        self.check_at(req, now_secs())
    }

    fn check_at(&self, req: &Request, now: u64) -> Result<(), &'static str> {
        if !is_write(&req.method) {
            return Ok(());
        }
        let value = req
            .headers
            .iter()
            .find(|(k, _)| k.eq_ignore_ascii_case(HEADER))
            .map(|(_, v)| v.as_str())
            .ok_or("this server requires the cluster secret for writes (X-Mooncake-Auth)")?;
        let (ts, nonce, server, tag) = parse(value).ok_or("malformed X-Mooncake-Auth header")?;
        let want = mac(
            &self.secret,
            &server,
            &req.method,
            &req.path,
            &req.query,
            ts,
            &nonce,
            &req.body,
        );
        if !hmac::equal(&tag, &want) {
            return Err("wrong proof of the cluster secret");
        }
        if server != self.id {
            return Err("signed for another server, or for this one before it restarted");
        }
        let window = REPLAY_WINDOW.as_secs();
        if ts.abs_diff(now) > window {
            return Err("signed request outside the replay window (clock skew?)");
        }
        let mut seen = self.seen.locked();
        if seen.len() >= MAX_SEEN {
            seen.retain(|_, t| t.abs_diff(now) <= window);
            if seen.len() >= MAX_SEEN {
                return Err("too many signed writes in the replay window; retry later");
            }
        }
        if seen.insert(nonce, ts).is_some() {
            return Err("replayed request (nonce already used)");
        }
        Ok(())
    }
}

fn parse(value: &str) -> Option<(u64, [u8; NONCE_LEN], String, Vec<u8>)> {
    let mut parts = value.split_ascii_whitespace();
    if parts.next()? != "v2" {
        return None;
    }
    let (mut ts, mut nonce, mut server, mut tag) = (None, None, None, None);
    for part in parts {
        match part.split_once('=')? {
            ("ts", v) => ts = v.parse().ok(),
            ("nonce", v) => nonce = hex::decode(v)?.try_into().ok(),
            ("server", v) => server = Some(v.to_owned()),
            ("mac", v) => tag = hex::decode(v),
            _ => return None,
        }
    }
    Some((ts?, nonce?, server?, tag?))
}

/// Wraps an HTTP handler: with a secret, writes without a valid proof get 401 and
/// never reach `handler` (reads always do), and every answer carries the server's
/// identity ([`SERVER_HEADER`]). Without a secret, `handler` as it is.
pub fn guard(secret: Option<ClusterSecret>, what: &'static str, handler: Handler) -> Handler {
    let Some(secret) = secret else {
        return handler;
    };
    let verifier = Verifier::new(secret);
    Arc::new(move |req: &Request| {
        let answer = match verifier.check(req) {
            Ok(()) => handler(req),
            Err(why) => {
                crate::auth::log_refusal(what, &format!("{} {}", req.method, req.path), why);
                Response::text(401, why)
            }
        };
        answer.with_header(SERVER_HEADER, verifier.id().to_owned())
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    fn secret(s: &str) -> ClusterSecret {
        ClusterSecret::new(s.as_bytes()).unwrap()
    }

    fn request(method: &str, key: &str, body: &[u8], auth: Option<String>) -> Request {
        Request {
            method: method.to_owned(),
            path: "/metadata".to_owned(),
            query: vec![("key".to_owned(), key.to_owned())],
            headers: auth.map(|v| (HEADER.to_owned(), v)).into_iter().collect(),
            body: body.to_vec(),
            peer: None,
        }
    }

    /// A request signed with `k` for the server `v` checks for.
    fn signed(k: &ClusterSecret, v: &Verifier, method: &str, key: &str, body: &[u8]) -> Request {
        let query = vec![("key".to_owned(), key.to_owned())];
        let auth = sign(k, v.id(), method, "/metadata", &query, body).unwrap();
        request(method, key, body, Some(auth))
    }

    #[test]
    fn reads_pass_and_writes_need_a_valid_fresh_proof() {
        let k = secret("http signing secret");
        let v = Verifier::new(k.clone());
        assert!(v.check(&request("GET", "a", b"", None)).is_ok());
        assert!(v.check(&request("HEAD", "a", b"", None)).is_ok());
        for m in ["PUT", "POST", "DELETE", "PATCH"] {
            assert!(v.check(&request(m, "a", b"x", None)).is_err(), "{m}");
        }
        let put = signed(&k, &v, "PUT", "a", b"value");
        assert!(v.check(&put).is_ok());
        assert_eq!(v.check(&put), Err("replayed request (nonce already used)"));
        // A proof from another secret, or for other content, fails.
        assert!(v
            .check(&signed(&secret("another secret"), &v, "PUT", "a", b"v"))
            .is_err());
        let mut tampered = signed(&k, &v, "PUT", "a", b"value");
        tampered.body = b"evil".to_vec();
        assert!(v.check(&tampered).is_err());
        let mut moved = signed(&k, &v, "PUT", "a", b"value");
        moved.query[0].1 = "b".to_owned();
        assert!(v.check(&moved).is_err());
        let mut method = signed(&k, &v, "PUT", "a", b"");
        method.method = "DELETE".to_owned();
        assert!(v.check(&method).is_err());
        assert!(v
            .check(&request("PUT", "a", b"", Some("v1 ts=1".into())))
            .is_err());
    }

    #[test]
    fn a_request_outside_the_window_is_refused() {
        let k = secret("http window secret");
        let v = Verifier::new(k.clone());
        let put = signed(&k, &v, "DELETE", "a", b"");
        let later = now_secs() + REPLAY_WINDOW.as_secs() + 5;
        assert!(v.check_at(&put, later).is_err());
        assert!(v.check_at(&put, now_secs()).is_ok());
    }

    #[test]
    fn a_proof_for_another_server_or_an_earlier_start_is_refused() {
        let k = secret("http identity secret");
        let first = Verifier::new(k.clone());
        // Another server with the same secret, or this one after a restart.
        let other = Verifier::new(k.clone());
        assert_ne!(first.id(), other.id());
        let put = signed(&k, &first, "PUT", "a", b"value");
        assert_eq!(
            other.check(&put),
            Err("signed for another server, or for this one before it restarted")
        );
        assert!(first.check(&put).is_ok());
        // Not knowing the server's identity yet is no way around it.
        let query = vec![("key".to_owned(), "a".to_owned())];
        let blind = sign(&k, "", "PUT", "/metadata", &query, b"v").unwrap();
        assert!(first
            .check(&request("PUT", "a", b"v", Some(blind)))
            .is_err());
    }
}
