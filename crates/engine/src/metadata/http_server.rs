//! Mooncake's HTTP metadata server: an in-memory key-value store behind the REST
//! interface of `docs/wire.md` ("Metadata service"). Embeddable in any
//! process; the CLI wraps it as `mooncake metadata-server --port P`.
//!
//! - `GET /metadata?key=K` → 200 with the stored value, or 404 `metadata not found`
//! - `PUT /metadata?key=K` (or `POST`) with the value as body → 200; a key
//!   containing `rpc_meta` that already holds a different value → 400 (port clash)
//! - `DELETE /metadata?key=K` → 200, or 404 when absent
//! - missing/empty `key` → 400; `GET /health` → 200 `OK`; other paths → 404;
//!   other methods → 405.
//! - a put over the store's bounds ([`MetadataLimits`]: value size, keys, total
//!   bytes, and the share one peer address may hold) → 413, storing nothing.

use crate::util::sync::UnpoisonedRw;
use std::net::{IpAddr, Ipv4Addr, Ipv6Addr, SocketAddr};
use std::sync::{Arc, RwLock};

use super::quota::{BoundedMap, MetadataLimits};
use crate::auth::ClusterSecret;
use crate::error::{Error, Result};
use crate::http::{HttpServer, Request, Response};

/// The REST path under which values live.
pub const METADATA_PATH: &str = "/metadata";

type Store = RwLock<BoundedMap>;

/// A running metadata server. Dropping it shuts it down.
pub struct MetadataServer {
    server: HttpServer,
    store: Arc<Store>,
}

impl MetadataServer {
    /// Starts serving on `bind` (port 0 picks a free port), open to every writer.
    pub fn start(bind: SocketAddr) -> Result<MetadataServer> {
        MetadataServer::start_with_secret(bind, None)
    }

    /// As [`start`](Self::start); with a secret, PUT, POST and DELETE must be signed
    /// with it (`crate::http::signed`) or get 401, while GET stays open.
    pub fn start_with_secret(
        bind: SocketAddr,
        secret: Option<ClusterSecret>,
    ) -> Result<MetadataServer> {
        let limits = MetadataLimits::from_env();
        let store: Arc<Store> = Arc::new(RwLock::new(BoundedMap::new(limits)));
        let handler_store = store.clone();
        let handler = Arc::new(move |req: &Request| handle(&handler_store, req));
        let server = HttpServer::bind(
            bind,
            crate::http::signed::guard(secret, "metadata http", handler),
        )
        .map_err(|e| Error::io(format!("start metadata server on {bind}"), e))?;
        log::info!("metadata server listening on {}", server.local_addr());
        Ok(MetadataServer { server, store })
    }

    /// The bound address (with the real port when started on port 0).
    pub fn local_addr(&self) -> SocketAddr {
        self.server.local_addr()
    }

    /// `http://<ip>:<port>/metadata`, usable as a connection string. When bound to
    /// an unspecified address (0.0.0.0 / ::) the loopback address is used.
    pub fn url(&self) -> String {
        let addr = self.local_addr();
        let ip = match addr.ip() {
            IpAddr::V4(ip) if ip.is_unspecified() => IpAddr::V4(Ipv4Addr::LOCALHOST),
            IpAddr::V6(ip) if ip.is_unspecified() => IpAddr::V6(Ipv6Addr::LOCALHOST),
            ip => ip,
        };
        format!("http://{}{METADATA_PATH}", SocketAddr::new(ip, addr.port()))
    }

    /// Replaces the store's bounds (the defaults come from [`MetadataLimits::from_env`]).
    pub fn set_limits(&self, limits: MetadataLimits) {
        let mut map = self.store.write_locked();
        map.set_limits(limits);
    }

    /// Number of stored keys.
    pub fn len(&self) -> usize {
        self.store.read_locked().len()
    }

    /// Whether no key is stored.
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// Stops the server and joins its threads. Idempotent.
    pub fn shutdown(&mut self) {
        self.server.shutdown();
    }
}

fn handle(store: &Store, req: &Request) -> Response {
    let resp = route(store, req);
    log::debug!(
        "metadata {} {} key={:?} -> {}",
        req.method,
        req.path,
        req.query_param("key"),
        resp.status
    );
    resp
}

fn route(store: &Store, req: &Request) -> Response {
    match req.path.as_str() {
        "/health" => match req.method.as_str() {
            "GET" | "HEAD" => Response::text(200, "OK"),
            _ => Response::text(405, "method not allowed"),
        },
        METADATA_PATH => {
            let method = req.method.as_str();
            if !matches!(method, "GET" | "HEAD" | "PUT" | "POST" | "DELETE") {
                return Response::text(405, "method not allowed");
            }
            let key = match req.query_param("key") {
                Some(k) if !k.is_empty() => k,
                _ => return Response::text(400, "missing key parameter"),
            };
            match method {
                "GET" | "HEAD" => {
                    let map = store.read_locked();
                    match map.get(key) {
                        Some(v) => Response::json(200, v.clone()),
                        None => Response::text(404, "metadata not found"),
                    }
                }
                "PUT" | "POST" => put(store, key, &req.body, req.peer),
                _ => {
                    let mut map = store.write_locked();
                    match map.remove(key) {
                        Some(_) => Response::text(200, "metadata deleted"),
                        None => Response::text(404, "metadata not found"),
                    }
                }
            }
        }
        _ => Response::text(404, "not found"),
    }
}

fn put(store: &Store, key: &str, body: &[u8], peer: Option<IpAddr>) -> Response {
    let Ok(value) = std::str::from_utf8(body) else {
        return Response::text(400, "metadata value is not valid UTF-8");
    };
    let mut map = store.write_locked();
    if key.contains("rpc_meta") {
        if let Some(old) = map.get(key) {
            if old != value {
                log::warn!("metadata: refusing to overwrite {key} with a different value");
                return Response::text(
                    400,
                    format!(
                        "metadata key {key} already exists with a different value \
                         (rpc port clash: another server uses this name)"
                    ),
                );
            }
            return Response::text(200, "metadata updated");
        }
    }
    match map.insert(key, value, peer) {
        Ok(()) => Response::text(200, "metadata updated"),
        Err(why) => {
            crate::warn_limited!("metadata: refusing {key}: {why}");
            Response::text(413, why)
        }
    }
}
