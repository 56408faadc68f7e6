//! The HTTP server: [`crate::net::ConnServer`] accepts and tracks connections, and
//! each connection thread reads requests, calls the [`Handler`] and writes responses,
//! keeping the connection alive between them.

use std::io::{self, Read, Write};
use std::net::{Shutdown, SocketAddr, TcpStream};
use std::panic::{self, AssertUnwindSafe};
use std::sync::Arc;
use std::time::Duration;

use super::wire::{
    body_framing, find_header, is_token, keep_alive, parse_head, parse_target, write_response,
    Framing, ReadErr, Request, Response, Wire,
};
use super::{MAX_REQUEST_BODY, MAX_REQUEST_HEAD, SERVER_IDLE_TIMEOUT};
use crate::net::{ConnServer, ConnTicket, ServerLimits, TimedReader};

/// After an error response we keep reading (and discarding) what the client still
/// sends, so that closing does not reset the connection before it reads our answer.
const LINGER_BYTES: usize = 1024 * 1024;
const LINGER_TIMEOUT: Duration = Duration::from_secs(2);

/// Request handler; called concurrently from connection threads. A panicking
/// handler produces a 500 response.
pub type Handler = Arc<dyn Fn(&Request) -> Response + Send + Sync>;

/// A small threaded HTTP/1.1 server. Dropping it shuts it down.
pub struct HttpServer {
    local_addr: SocketAddr,
    server: Option<ConnServer>,
}

impl HttpServer {
    /// Binds `addr` (port 0 picks a free port) and starts serving with `handler`.
    pub fn bind(addr: SocketAddr, handler: Handler) -> io::Result<HttpServer> {
        let limits = ServerLimits {
            idle_timeout: SERVER_IDLE_TIMEOUT,
            ..ServerLimits::from_env()
        };
        let server = ConnServer::spawn(
            addr,
            "http",
            limits,
            Arc::new(move |stream, ticket| serve_connection(&handler, stream, ticket)),
        )?;
        Ok(HttpServer {
            local_addr: server.local_addr(),
            server: Some(server),
        })
    }

    /// The bound address (with the real port when bound to port 0).
    pub fn local_addr(&self) -> SocketAddr {
        self.local_addr
    }

    /// Stops accepting, closes every connection and joins all threads. Idempotent.
    pub fn shutdown(&mut self) {
        if let Some(mut server) = self.server.take() {
            server.shutdown();
            log::debug!("http server {} stopped", self.local_addr);
        }
    }
}

impl Drop for HttpServer {
    fn drop(&mut self) {
        self.shutdown();
    }
}

pub(super) enum RequestFailure {
    /// Answer with this status and close.
    Respond(u16, &'static str),
    /// Just close the connection.
    Close,
}

fn serve_connection(handler: &Handler, stream: TcpStream, ticket: &ConnTicket) {
    let setup = stream
        .set_nodelay(true)
        .and_then(|_| stream.set_write_timeout(Some(SERVER_IDLE_TIMEOUT)));
    if let Err(e) = setup {
        log::warn!("http server: setting up a connection: {e}");
        return;
    }
    let stream = &stream;
    let mut wire = Wire::new(TimedReader::new(stream, ticket));
    loop {
        let read = read_request(&mut wire, stream);
        wire.stream.frame_done();
        match read {
            Ok(None) => return,
            Ok(Some((mut req, keep_alive))) => {
                req.peer = stream.peer_addr().ok().map(|a| a.ip());
                let head_only = req.method == "HEAD";
                let resp =
                    panic::catch_unwind(AssertUnwindSafe(|| handler(&req))).unwrap_or_else(|_| {
                        log::error!("http handler panicked on {} {}", req.method, req.path);
                        Response::text(500, "internal server error")
                    });
                // Only a request the handler served earns the connection a protected
                // slot: refused ones (401 without the secret, 405, 413, ...) do not.
                if resp.status < 400 {
                    ticket.prove();
                }
                if write_response(stream, &resp, head_only, keep_alive).is_err() || !keep_alive {
                    return;
                }
            }
            Err(RequestFailure::Respond(status, msg)) => {
                log::debug!("http server: rejecting request with {status}: {msg}");
                let resp = Response::text(status, msg);
                if write_response(stream, &resp, false, false).is_ok() {
                    linger(stream);
                }
                return;
            }
            Err(RequestFailure::Close) => return,
        }
    }
}

/// Half-closes and drains (bounded) what the client still sends, so the error
/// response is not destroyed by a reset caused by unread data.
fn linger(mut stream: &TcpStream) {
    let _ = stream.shutdown(Shutdown::Write);
    let _ = stream.set_read_timeout(Some(LINGER_TIMEOUT));
    let mut sink = [0u8; 8192];
    let mut total = 0;
    while total < LINGER_BYTES {
        match stream.read(&mut sink) {
            Ok(0) | Err(_) => return,
            Ok(n) => total += n,
        }
    }
}

/// Reads one request from `wire`; `interim` receives a `100 Continue` when the client
/// waits for one (the connection itself, or a sink when fuzzing).
pub(super) fn read_request<R: Read>(
    wire: &mut Wire<R>,
    mut interim: impl Write,
) -> std::result::Result<Option<(Request, bool)>, RequestFailure> {
    use RequestFailure::{Close, Respond};
    let head = match wire.read_head(MAX_REQUEST_HEAD) {
        Ok(Some(h)) => h,
        Ok(None) => return Ok(None),
        Err(ReadErr::TooLarge) => return Err(Respond(431, "request head too large")),
        Err(ReadErr::Malformed(m)) => return Err(Respond(400, m)),
        Err(ReadErr::Eof | ReadErr::Io(_)) => return Err(Close),
    };
    let (start, headers) = match parse_head(&head) {
        Ok(x) => x,
        Err(ReadErr::TooLarge) => return Err(Respond(431, "too many header fields")),
        Err(ReadErr::Malformed(m)) => return Err(Respond(400, m)),
        Err(_) => return Err(Respond(400, "malformed request head")),
    };
    let mut parts = start.split(' ');
    let (Some(method), Some(target), Some(version), None) =
        (parts.next(), parts.next(), parts.next(), parts.next())
    else {
        return Err(Respond(400, "malformed request line"));
    };
    if !is_token(method) {
        return Err(Respond(400, "invalid method"));
    }
    let http11 = match version {
        "HTTP/1.1" => true,
        "HTTP/1.0" => false,
        v if v.starts_with("HTTP/") => return Err(Respond(505, "HTTP version not supported")),
        _ => return Err(Respond(400, "malformed request line")),
    };
    let (path, query) = parse_target(target).ok_or(Respond(400, "invalid request target"))?;

    let keep_alive = keep_alive(&headers, http11);
    let framing = match body_framing(&headers) {
        Ok(f) => f,
        Err(_) if find_header(&headers, "transfer-encoding").is_some() => {
            return Err(Respond(501, "unsupported transfer-encoding"))
        }
        Err(_) => return Err(Respond(400, "invalid content-length")),
    };
    if framing == Some(Framing::Chunked) && find_header(&headers, "content-length").is_some() {
        return Err(Respond(400, "both content-length and transfer-encoding"));
    }
    if let Some(Framing::Length(n)) = framing {
        if n > MAX_REQUEST_BODY as u64 {
            return Err(Respond(413, "request body too large"));
        }
    }
    let expects_body = matches!(framing, Some(Framing::Chunked) | Some(Framing::Length(1..)));
    if let Some(expect) = find_header(&headers, "expect") {
        if !expect.eq_ignore_ascii_case("100-continue") {
            return Err(Respond(417, "unsupported expectation"));
        }
        if http11 && expects_body && wire.avail().is_empty() {
            let _ = interim.write_all(b"HTTP/1.1 100 Continue\r\n\r\n");
        }
    }
    let body = match framing {
        None | Some(Framing::Length(0)) => Vec::new(),
        Some(f) => match wire.read_body(f, MAX_REQUEST_BODY) {
            Ok(b) => b,
            Err(ReadErr::TooLarge) => return Err(Respond(413, "request body too large")),
            Err(ReadErr::Malformed(m)) => return Err(Respond(400, m)),
            Err(ReadErr::Eof | ReadErr::Io(_)) => return Err(Close),
        },
    };
    let req = Request {
        method: method.to_owned(),
        path,
        query,
        headers,
        body,
        peer: None,
    };
    Ok(Some((req, keep_alive)))
}
