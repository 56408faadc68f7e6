//! TCP, wire-compatible with Mooncake's data plane v2 (`wire::data`). The server half
//! answers any peer; the client half keeps persistent connections ("lanes") per peer
//! per worker and pipelines many slices on each.

mod client;
mod server;

use std::net::SocketAddr;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;

use super::{Kind, Transport, TransportWorker};
use crate::auth::ClusterSecret;
use crate::error::{Error, Result};
use crate::metadata::SegmentDesc;
use crate::net::{ConnServer, ServerLimits};
use crate::registry::LocalMemory;

/// TCP transport settings.
#[derive(Clone, Debug)]
pub struct TcpConfig {
    /// Connections per peer per poll loop (each engine worker, and each calling thread
    /// that runs a transfer itself).
    pub lanes_per_peer: usize,
    /// Largest slice a transfer is cut into, in bytes.
    pub slice_size: u64,
    /// SO_SNDBUF/SO_RCVBUF; 0 keeps the kernel's auto-tuning.
    pub socket_buffer: usize,
}

impl Default for TcpConfig {
    fn default() -> Self {
        TcpConfig {
            lanes_per_peer: default_lanes(),
            slice_size: 4 << 20,
            socket_buffer: 0,
        }
    }
}

/// One lane per two cores, 1..=4: on a small machine a single stream per peer is
/// fastest (the sender, the receiver and the peer's server already fill the cores);
/// on a large one, parallel streams get past the per-flow limit.
fn default_lanes() -> usize {
    let cores = std::thread::available_parallelism().map_or(1, |n| n.get());
    (cores / 2).clamp(1, 4)
}

/// TCP transport: a data server for peers, pooled connections to theirs.
pub struct TcpTransport {
    config: TcpConfig,
    server: ConnServer,
    /// With a secret, lanes authenticate before their first request.
    secret: Option<ClusterSecret>,
    /// `writev` calls that sent requests, over every worker's lanes.
    sends: Arc<AtomicU64>,
}

impl TcpTransport {
    /// Starts the data server on `bind` (port 0 picks one).
    pub fn start(
        bind: SocketAddr,
        memory: Arc<LocalMemory>,
        config: TcpConfig,
        secret: Option<ClusterSecret>,
    ) -> Result<TcpTransport> {
        crate::sys::ignore_sigpipe();
        let buffers = config.socket_buffer;
        let handler =
            Arc::new(move |stream, ticket: &_| server::serve(stream, ticket, &memory, buffers));
        let handler = crate::auth::guard(secret.clone(), "tcp data", handler);
        let server = ConnServer::spawn(bind, "mc-tcp", ServerLimits::from_env(), handler)
            .map_err(|e| Error::io(format!("binding tcp data server on {bind}"), e))?;
        Ok(TcpTransport {
            config,
            server,
            secret,
            sends: Arc::default(),
        })
    }

    /// Port of this engine's data server.
    pub fn data_port(&self) -> u16 {
        self.server.local_addr().port()
    }
}

impl Transport for TcpTransport {
    fn kind(&self) -> Kind {
        Kind::Tcp
    }

    fn describe(&self, desc: &mut SegmentDesc) {
        let ip = self.server.local_addr().ip();
        desc.tcp_data_host = (!ip.is_unspecified()).then(|| ip.to_string());
        desc.tcp_data_port = self.data_port();
        desc.tcp_proto_version = 2;
    }

    fn reaches(&self, peer: &SegmentDesc) -> bool {
        peer.tcp_data_port != 0 && peer.tcp_proto_version >= 2
    }

    fn slice_size(&self) -> u64 {
        self.config.slice_size
    }

    fn new_worker(&self) -> Result<Box<dyn TransportWorker>> {
        Ok(Box::new(client::TcpWorker::new(
            self.config.clone(),
            self.secret.clone(),
            self.sends.clone(),
        )?))
    }

    fn sends(&self) -> u64 {
        self.sends.load(Ordering::Relaxed)
    }
}
