//! A whole control plane in one process: the master's RPC, the admin/metrics HTTP
//! endpoints, the embedded transfer-engine metadata server, and the housekeeping tick.

#![forbid(unsafe_code)]

use crate::util::sync::StopSignal;
use std::net::{IpAddr, SocketAddr};

use std::sync::Arc;
use std::thread::JoinHandle;
use std::time::Duration;

use super::master::{Clock, Master, MasterConfig};
use super::segment_reach::{EngineReach, VerifyMounts};
use crate::auth::{self, ClusterSecret};
use crate::error::{Code, Error, Result};
use crate::http::{HttpServer, Request as HttpRequest, Response as HttpResponse};
use crate::json::Value;
use crate::metadata::http_server::{MetadataServer, METADATA_PATH};
use crate::net::{ConnServer, ServerLimits};

/// What a [`MasterServer`] listens on and how it runs.
#[derive(Clone, Debug)]
pub struct ServerConfig {
    /// Address every server listens on (the RPC always; the HTTP servers unless their
    /// own is set below).
    pub bind: IpAddr,
    /// Address of the embedded metadata server, when not `bind`.
    pub metadata_bind: Option<IpAddr>,
    /// Address of the admin HTTP server, when not `bind`.
    pub metrics_bind: Option<IpAddr>,
    /// 0 picks a free port (for every port below).
    pub rpc_port: u16,
    /// Embedded HTTP metadata server; `None` disables it.
    pub metadata_port: Option<u16>,
    /// Admin HTTP (`/metrics`, `/health`, ...); `None` disables it.
    pub metrics_port: Option<u16>,
    /// How often leases, puts and client liveness are checked.
    pub tick: Duration,
    /// The master's own tunables.
    pub master: MasterConfig,
    /// Connection caps and timeouts of the RPC port.
    pub connections: ServerLimits,
    /// With a secret, RPC connections authenticate first and HTTP writes must be
    /// signed (`crate::auth`); default from `MC_CLUSTER_SECRET`.
    pub cluster_secret: Option<ClusterSecret>,
    /// The key segment names' owner tickets are signed with (`Master::set_owner_key`):
    /// shared by the masters of a cluster (HA standbys, a restarted master) and by no
    /// node, so a node's name survives a master's restart. `None`: each master draws
    /// its own, and after a restart a name goes to the first node to remount it.
    pub owner_key: Option<ClusterSecret>,
    /// Whether a segment must be read before it counts (`segment_reach`); `Off` here,
    /// `Auto` for `mooncake master`.
    pub verify_mounts: VerifyMounts,
}

impl Default for ServerConfig {
    fn default() -> Self {
        ServerConfig {
            bind: IpAddr::from([127, 0, 0, 1]),
            metadata_bind: None,
            metrics_bind: None,
            rpc_port: 50051,
            metadata_port: Some(8080),
            metrics_port: Some(9003),
            tick: Duration::from_millis(100),
            master: MasterConfig::default(),
            connections: ServerLimits::from_env(),
            cluster_secret: ClusterSecret::env_default(),
            owner_key: None,
            verify_mounts: VerifyMounts::Off,
        }
    }
}

/// A running master: its RPC server, optional HTTP servers and housekeeping thread.
pub struct MasterServer {
    master: Arc<Master>,
    rpc: ConnServer,
    admin: Option<HttpServer>,
    metadata: Option<MetadataServer>,
    stop: Arc<StopSignal>,
    ticker: Option<JoinHandle<()>>,
}

impl MasterServer {
    /// Starts the servers and the housekeeping thread.
    pub fn start(config: ServerConfig) -> Result<MasterServer> {
        MasterServer::start_with_clock(config, Clock::system())
    }

    /// Starts the servers with the master on `clock` (tests drive leases and
    /// liveness with a manual one).
    pub fn start_with_clock(config: ServerConfig, clock: Clock) -> Result<MasterServer> {
        auth::check_env()?;
        let master = Arc::new(Master::with_clock(config.master.clone(), clock));
        if let Some(key) = &config.owner_key {
            master.set_owner_key(key.key());
        }
        let bind = |port| SocketAddr::new(config.bind, port);
        let metadata_bind =
            |port| SocketAddr::new(config.metadata_bind.unwrap_or(config.bind), port);
        let metrics_bind = |port| SocketAddr::new(config.metrics_bind.unwrap_or(config.bind), port);
        // The metadata server first, so that the RPC can tell clients its URL from the
        // first request on.
        let metadata = config
            .metadata_port
            .map(|p| {
                MetadataServer::start_with_secret(metadata_bind(p), config.cluster_secret.clone())
            })
            .transpose()?;
        if let Some(m) = &metadata {
            master.set_metadata_url(&advertised_metadata_url(m));
        }
        let own_metadata = metadata.as_ref().map(MetadataServer::url);
        let reach = EngineReach::new(
            &config.verify_mounts,
            own_metadata,
            config.cluster_secret.clone(),
        );
        if let Some(reach) = reach {
            master.set_segment_reach(Arc::new(reach));
        }
        let rpc = super::rpc::serve(
            bind(config.rpc_port),
            config.connections.clone(),
            master.clone(),
            config.cluster_secret.clone(),
        )
        .map_err(|e| {
            Error::io(
                format!("binding master rpc on {}", bind(config.rpc_port)),
                e,
            )
        })?;
        let admin = match config.metrics_port {
            Some(p) => {
                let m = master.clone();
                let handler = Arc::new(move |req: &HttpRequest| admin(&m, req));
                let handler = crate::http::signed::guard(
                    config.cluster_secret.clone(),
                    "admin http",
                    handler,
                );
                Some(HttpServer::bind(metrics_bind(p), handler).map_err(|e| {
                    Error::io(format!("binding admin http on {}", metrics_bind(p)), e)
                })?)
            }
            None => None,
        };
        let stop = StopSignal::new();
        let (m, s, tick) = (master.clone(), stop.clone(), config.tick);
        let ticker = std::thread::Builder::new()
            .name("mc-master-tick".into())
            .spawn(move || {
                while !s.wait(tick) {
                    m.tick();
                }
            })
            .map_err(|e| Error::io("spawning master tick", e))?;
        Ok(MasterServer {
            master,
            rpc,
            admin,
            metadata,
            stop,
            ticker: Some(ticker),
        })
    }

    /// The master behind the servers.
    pub fn master(&self) -> &Arc<Master> {
        &self.master
    }

    /// Where the RPC server listens.
    pub fn rpc_addr(&self) -> SocketAddr {
        self.rpc.local_addr()
    }

    /// URL of the embedded metadata server, when enabled: the one clients are told.
    pub fn metadata_url(&self) -> Option<String> {
        self.metadata.as_ref().map(advertised_metadata_url)
    }

    /// Where the admin HTTP server listens, when enabled.
    pub fn admin_addr(&self) -> Option<SocketAddr> {
        self.admin.as_ref().map(HttpServer::local_addr)
    }
}

/// The embedded metadata server's URL as other hosts reach it: bound to all
/// interfaces, at this host's address on its default route (its own `url()` names
/// loopback, which only this host reaches; that is kept when there is no route).
fn advertised_metadata_url(m: &MetadataServer) -> String {
    let addr = m.local_addr();
    if !addr.ip().is_unspecified() {
        return m.url();
    }
    match crate::net::reachable_address(addr.ip(), crate::net::default_route_source) {
        Some(ip) => format!("http://{}{METADATA_PATH}", SocketAddr::new(ip, addr.port())),
        None => m.url(),
    }
}

impl Drop for MasterServer {
    fn drop(&mut self) {
        self.stop.raise();
        if let Some(t) = self.ticker.take() {
            let _ = t.join();
        }
        self.rpc.shutdown();
    }
}

/// `POST /drain?segment=NAME[&force=1]`: the segment's node moves what only it holds
/// elsewhere, then leaves (signed like every write when the cluster has a secret).
/// A drain that would lose objects is refused with 409 and changes nothing, unless
/// forced; the answer says what the drain puts at risk.
fn drain(master: &Master, req: &HttpRequest) -> HttpResponse {
    let Some(segment) = req.query_param("segment") else {
        return HttpResponse::text(400, "missing segment parameter");
    };
    let force = match req.query_param("force") {
        None | Some("0" | "false") => false,
        Some("1" | "true") => true,
        Some(_) => return HttpResponse::text(400, "force must be 1, true, 0 or false"),
    };
    match master.drain(None, segment, force) {
        Ok(risk) => {
            let (objects, bytes) = risk.at_risk();
            let answer = Value::object([
                ("segment", Value::from(segment)),
                ("draining", true.into()),
                ("objects_at_risk", objects.into()),
                ("bytes_at_risk", bytes.into()),
            ]);
            HttpResponse::json(200, answer.to_string())
        }
        Err(e) => match e.code() {
            Code::SegmentNotFound => HttpResponse::text(404, "no such segment"),
            Code::NoAvailableHandle => HttpResponse::text(409, e.to_string()),
            _ => HttpResponse::text(500, e.to_string()),
        },
    }
}

/// Keys `/get_all_keys` lists when no `limit` is given, and the most it lists at all.
const DEFAULT_KEY_LIMIT: usize = 10_000;
const MAX_KEY_LIMIT: usize = 1_000_000;

fn admin(master: &Master, req: &HttpRequest) -> HttpResponse {
    if req.method == "POST" && req.path == "/drain" {
        return drain(master, req);
    }
    // Every other admin endpoint only reads.
    if !matches!(req.method.as_str(), "GET" | "HEAD") {
        return HttpResponse::text(405, "method not allowed");
    }
    match req.path.as_str() {
        "/health" => HttpResponse::text(200, "OK"),
        "/metrics" => HttpResponse::text(200, master.metrics_text()),
        "/query_key" => match req.query_param("key") {
            None => HttpResponse::text(400, "missing key parameter"),
            Some(key) => match master.query(key) {
                None => HttpResponse::text(404, "object not found"),
                Some((size, complete, replicas)) => {
                    let reps: Vec<Value> = replicas
                        .iter()
                        .map(|r| {
                            Value::Array(
                                r.pieces
                                    .iter()
                                    .map(|p| {
                                        Value::object([
                                            ("segment", Value::from(&*p.segment)),
                                            ("addr", p.addr.into()),
                                            ("len", p.len.into()),
                                        ])
                                    })
                                    .collect(),
                            )
                        })
                        .collect();
                    let v = Value::object([
                        ("key", Value::from(key)),
                        ("size", size.into()),
                        ("complete", complete.into()),
                        ("replicas", reps.into()),
                    ]);
                    HttpResponse::json(200, v.to_string())
                }
            },
        },
        "/get_all_keys" => {
            let limit = match req.query_param("limit").map(str::parse::<usize>) {
                None => DEFAULT_KEY_LIMIT,
                Some(Ok(n)) => n.min(MAX_KEY_LIMIT),
                Some(Err(_)) => return HttpResponse::text(400, "limit must be a whole number"),
            };
            let (keys, total) = master.keys(limit);
            let listed = keys.len();
            let keys = Value::Array(keys.into_iter().map(Value::from).collect());
            if listed == total {
                return HttpResponse::json(200, keys.to_string());
            }
            // Cut short: say so, and how many there are.
            let v = Value::object([
                ("keys", keys),
                ("truncated", true.into()),
                ("total", (total as u64).into()),
            ]);
            HttpResponse::json(200, v.to_string())
        }
        "/get_all_segments" => {
            let segs: Vec<Value> = master
                .all_segments()
                .into_iter()
                .map(|(info, capacity, used)| {
                    Value::object([
                        ("name", Value::from(info.name)),
                        ("base", info.base.into()),
                        ("capacity", capacity.into()),
                        ("used", used.into()),
                    ])
                })
                .collect();
            HttpResponse::json(200, Value::Array(segs).to_string())
        }
        _ => HttpResponse::text(404, "not found"),
    }
}
