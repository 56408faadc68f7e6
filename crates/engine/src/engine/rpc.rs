//! The handshake RPC server every engine runs (Mooncake's control-plane framing):
//! descriptor exchange, notifications, liveness probes, and queue-pair exchanges
//! (answered by a transport that takes part, e.g. RDMA, else refused).

use crate::util::sync::UnpoisonedRw;
use std::net::{SocketAddr, TcpStream};
use std::sync::{Arc, OnceLock};
use std::time::Duration;

use super::inbox::Notification;
use super::segments::Published;
use crate::auth::ClusterSecret;
use crate::error::Result;
use crate::json::{self, Value};
use crate::net::{ConnServer, ConnTicket, ServerLimits, TimedReader};
use crate::transport::Transport;
use crate::wire::rpc::{self, RpcType, MAX_FRAME_LEN};

const IO_TIMEOUT: Duration = Duration::from_secs(10);

/// Transports that answer Connection (queue-pair exchange) requests; filled once the
/// engine has built them.
pub type Handshakers = Arc<OnceLock<Vec<Arc<dyn Transport>>>>;

pub fn start(
    bind: SocketAddr,
    published: Arc<Published>,
    handshakers: Handshakers,
    secret: Option<ClusterSecret>,
) -> std::io::Result<ConnServer> {
    let handler =
        Arc::new(move |s, ticket: &ConnTicket| serve(s, ticket, &published, &handshakers));
    ConnServer::spawn(
        bind,
        "mc-rpc",
        ServerLimits::from_env(),
        crate::auth::guard(secret, "engine rpc", handler),
    )
}

fn serve(stream: TcpStream, ticket: &ConnTicket, published: &Published, handshakers: &Handshakers) {
    let peer = stream
        .peer_addr()
        .map(|a| a.to_string())
        .unwrap_or_default();
    let _ = stream.set_write_timeout(Some(IO_TIMEOUT));
    let _ = stream.set_nodelay(true);
    let mut reader = TimedReader::new(&stream, ticket);
    // Mooncake sends one request per connection; accepting more costs nothing.
    loop {
        let read = rpc::read_frame(&mut reader, MAX_FRAME_LEN);
        reader.frame_done();
        let (kind, body) = match read {
            Ok(frame) => frame,
            Err(e) => {
                if !e.context().contains("failed to fill whole buffer") {
                    log::debug!("rpc {peer}: {e}");
                }
                return;
            }
        };
        let reply = match answer(kind, &body, published, handshakers) {
            Ok(r) => r,
            Err(e) => {
                crate::warn_limited!("rpc {peer}: bad {kind:?} request: {e}; closing");
                return;
            }
        };
        ticket.prove();
        if rpc::write_frame(&mut &stream, kind, &reply).is_err() {
            return;
        }
    }
}

fn answer(
    kind: RpcType,
    body: &str,
    published: &Published,
    handshakers: &Handshakers,
) -> Result<String> {
    let request = json::parse(body).map_err(|e| crate::Error::protocol(e.to_string()))?;
    Ok(match kind {
        RpcType::Metadata => published.desc.read_locked().to_json().to_string(),
        RpcType::Probe => r#"{"status":"success"}"#.to_owned(),
        RpcType::Notify => {
            let note = Notification {
                from: request
                    .get("name")
                    .and_then(Value::as_str)
                    .unwrap_or("")
                    .to_owned(),
                message: request
                    .str_field("notify_msg")
                    .map_err(|e| crate::Error::protocol(e.to_string()))?
                    .to_owned(),
            };
            // Bounded per message, per sender and in all; what does not fit is
            // dropped (counted), and the sender is told.
            if published.inbox.push(note) {
                r#"{"name":"","notify_msg":"success"}"#.to_owned()
            } else {
                r#"{"name":"","notify_msg":"dropped: inbox limits"}"#.to_owned()
            }
        }
        RpcType::Connection => {
            let transports = handshakers.get().map(Vec::as_slice).unwrap_or(&[]);
            if let Some(reply) = transports.iter().find_map(|t| t.handshake(body)) {
                return Ok(reply);
            }
            let field = |k: &str| request.get(k).cloned().unwrap_or(Value::Null);
            Value::object([
                ("local_nic_path", field("peer_nic_path")),
                ("peer_nic_path", field("local_nic_path")),
                ("qp_num", Value::Array(Vec::new())),
                (
                    "reply_msg",
                    "this engine has no RDMA transport enabled".into(),
                ),
            ])
            .to_string()
        }
    })
}
