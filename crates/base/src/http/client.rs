//! The HTTP client: one persistent connection to one URL.

use crate::util::sync::Unpoisoned;
use std::io::{self, Read, Write};
use std::net::{TcpStream, ToSocketAddrs};
use std::sync::Mutex;
use std::time::{Duration, Instant};

use super::wire::{
    body_framing, find_header, is_token, keep_alive, parse_head, parse_status_line, parse_target,
    Framing, ReadErr, Wire,
};
use super::{CLIENT_CONNECT_TIMEOUT, CLIENT_IO_TIMEOUT, MAX_RESPONSE_BODY};
use crate::auth::ClusterSecret;
use crate::error::{Code, Error, Result};

const MAX_RESPONSE_HEAD: usize = 64 * 1024;

/// A blocking HTTP/1.1 client bound to one `http://host:port[/base]` URL, keeping
/// one persistent connection. Safe to share between threads (requests serialize).
pub struct HttpClient {
    url: String,
    host: String,
    port: u16,
    host_header: String,
    base_path: String,
    connect_timeout: Duration,
    io_timeout: Duration,
    conn: Mutex<Option<Wire<TcpStream>>>,
    /// With a secret, every write request carries a signature (`crate::http::signed`).
    secret: Option<ClusterSecret>,
    /// The identity the server last gave (`super::signed::SERVER_HEADER`), which
    /// signatures name.
    server_id: Mutex<Option<String>>,
}

/// One response as read.
pub(super) struct Answer {
    pub status: u16,
    pub body: Vec<u8>,
    /// Whether the connection may carry another request.
    pub keep: bool,
    /// The server's identity, when it gives one.
    pub server_id: Option<String>,
}

impl std::fmt::Debug for HttpClient {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("HttpClient")
            .field("url", &self.url)
            .finish()
    }
}

/// Why one exchange failed, and whether a fresh connection may fix it.
struct ExchangeError {
    err: Error,
    /// The connection died before any byte of a response arrived.
    dead_connection: bool,
}

fn is_disconnect(kind: io::ErrorKind) -> bool {
    matches!(
        kind,
        io::ErrorKind::BrokenPipe
            | io::ErrorKind::ConnectionReset
            | io::ErrorKind::ConnectionAborted
            | io::ErrorKind::NotConnected
            | io::ErrorKind::UnexpectedEof
    )
}

impl HttpClient {
    /// Parses `http://host[:port][/base/path]` (port defaults to 80). No connection
    /// is made until the first request.
    pub fn new(url: &str) -> Result<HttpClient> {
        let bad = |why: &str| Error::invalid(format!("invalid http url {url:?}: {why}"));
        let rest = match url.get(..7) {
            Some(s) if s.eq_ignore_ascii_case("http://") => &url[7..],
            _ => return Err(bad("only http://host:port[/path] is supported")),
        };
        if rest.contains(['?', '#']) || rest.bytes().any(|b| b <= b' ' || b == 0x7f) {
            return Err(bad(
                "query, fragment, spaces and control characters are not allowed",
            ));
        }
        let (authority, path) = match rest.find('/') {
            Some(i) => (&rest[..i], &rest[i..]),
            None => (rest, ""),
        };
        if authority.contains('@') {
            return Err(bad("user info is not supported"));
        }
        let (host, port) = if let Some(v6) = authority.strip_prefix('[') {
            let (h, after) = v6.split_once(']').ok_or_else(|| bad("unterminated '['"))?;
            let port = match after {
                "" => None,
                p => Some(p.strip_prefix(':').ok_or_else(|| bad("junk after ']'"))?),
            };
            (h, port)
        } else {
            match authority.rsplit_once(':') {
                Some((h, p)) => (h, Some(p)),
                None => (authority, None),
            }
        };
        if host.is_empty() || (host.contains([':', '[', ']']) && !authority.starts_with('[')) {
            return Err(bad("missing or invalid host"));
        }
        let port = match port {
            None => 80,
            Some(p) => p
                .parse::<u16>()
                .ok()
                .filter(|p| *p != 0)
                .ok_or_else(|| bad("invalid port"))?,
        };
        let base_path = path.trim_end_matches('/').to_owned();
        let host_header = if authority.starts_with('[') {
            format!("[{host}]:{port}")
        } else {
            format!("{host}:{port}")
        };
        Ok(HttpClient {
            url: url.to_owned(),
            host: host.to_owned(),
            port,
            host_header,
            base_path,
            connect_timeout: CLIENT_CONNECT_TIMEOUT,
            io_timeout: CLIENT_IO_TIMEOUT,
            conn: Mutex::new(None),
            secret: None,
            server_id: Mutex::new(None),
        })
    }

    /// The URL's path without trailing slashes (`""` when the URL has none).
    pub fn base_path(&self) -> &str {
        &self.base_path
    }

    /// Signs every write request with `secret` from now on (`None`: none is signed).
    pub fn with_secret(mut self, secret: Option<ClusterSecret>) -> HttpClient {
        self.secret = secret;
        self
    }

    /// The URL this client was created from.
    pub fn url(&self) -> &str {
        &self.url
    }

    /// Sends one request; `path_and_query` is absolute (`/metadata?key=...`) and is
    /// sent as given (the base path is not prepended). Returns status and body for
    /// every status code; errors are transport or protocol failures only. A reused
    /// keep-alive connection found dead before any response byte arrives is
    /// replaced once and the request re-sent.
    pub fn request(
        &self,
        method: &str,
        path_and_query: &str,
        body: &[u8],
    ) -> Result<(u16, Vec<u8>)> {
        if !is_token(method) {
            return Err(Error::invalid(format!("invalid http method {method:?}")));
        }
        if !path_and_query.starts_with('/')
            || path_and_query.bytes().any(|b| b <= b' ' || b == 0x7f)
        {
            return Err(Error::invalid(format!(
                "invalid request path {path_and_query:?}"
            )));
        }
        let signed_for = self.server_id.locked().clone();
        let answer = self.send(method, path_and_query, body, signed_for.as_deref())?;
        // A signed write refused by a server that gives another identity than the one
        // signed for (first contact, or it restarted) changed nothing: sign for the
        // identity given and send it once more.
        let renamed = answer
            .server_id
            .as_deref()
            .filter(|id| signed_for.as_deref() != Some(*id));
        if let Some(id) = renamed.filter(|_| answer.status == 401 && self.signs(method)) {
            let again = self.send(method, path_and_query, body, Some(id))?;
            return Ok((again.status, again.body));
        }
        Ok((answer.status, answer.body))
    }

    /// Sends one request on a connection of its own and returns its response as a
    /// stream of body pieces (see [`BodyStream`]); no read waits past `deadline`.
    pub fn open_stream(
        &self,
        method: &str,
        path_and_query: &str,
        body: &[u8],
        deadline: Instant,
    ) -> Result<BodyStream> {
        let what = format!("{method} http://{}{path_and_query}", self.host_header);
        let mut wire = self.connect()?;
        let signed_for = self.server_id.locked().clone();
        self.send_request(
            &mut wire,
            method,
            path_and_query,
            body,
            signed_for.as_deref(),
        )
        .map_err(|e| e.err)?;
        let left = deadline.saturating_duration_since(Instant::now());
        wire.stream
            .set_read_timeout(Some(left.max(Duration::from_millis(1))))
            .map_err(|e| Error::io(&what, e))?;
        let head = read_response_head(&mut wire, method).map_err(|e| stream_error(&what, e))?;
        Ok(BodyStream {
            wire,
            status: head.status,
            framing: head.framing,
            deadline,
            what,
        })
    }

    /// Whether a `method` request carries a signature.
    fn signs(&self, method: &str) -> bool {
        self.secret.is_some() && super::signed::is_write(method)
    }

    /// Sends one request (signed for `server_id` when it is a write and there is a
    /// secret) and reads its answer, noting the server's identity if it gives one.
    fn send(
        &self,
        method: &str,
        path_and_query: &str,
        body: &[u8],
        server_id: Option<&str>,
    ) -> Result<Answer> {
        let mut conn = self.conn.locked();
        let mut retried = false;
        loop {
            let reused = conn.is_some();
            let wire = match conn.as_mut() {
                Some(w) => w,
                None => conn.insert(self.connect()?),
            };
            match self.exchange(wire, method, path_and_query, body, server_id) {
                Ok(answer) => {
                    if !answer.keep {
                        *conn = None;
                    }
                    if let Some(id) = &answer.server_id {
                        *self.server_id.locked() = Some(id.clone());
                    }
                    return Ok(answer);
                }
                Err(e) => {
                    *conn = None;
                    if reused && e.dead_connection && !retried {
                        log::debug!("http client {}: stale connection, reconnecting", self.url);
                        retried = true;
                        continue;
                    }
                    return Err(e.err);
                }
            }
        }
    }

    fn connect(&self) -> Result<Wire<TcpStream>> {
        let what = format!("connect to {}", self.host_header);
        let addrs = (self.host.as_str(), self.port)
            .to_socket_addrs()
            .map_err(|e| Error::io(&what, e))?;
        let mut last = io::Error::new(io::ErrorKind::NotFound, "host resolved to no addresses");
        for addr in addrs {
            match TcpStream::connect_timeout(&addr, self.connect_timeout) {
                Ok(s) => {
                    let setup = s
                        .set_nodelay(true)
                        .and_then(|_| s.set_read_timeout(Some(self.io_timeout)))
                        .and_then(|_| s.set_write_timeout(Some(self.io_timeout)));
                    return match setup {
                        Ok(()) => Ok(Wire::new(s)),
                        Err(e) => Err(Error::io(&what, e)),
                    };
                }
                Err(e) => last = e,
            }
        }
        Err(Error::io(&what, last))
    }

    /// Writes one request (signed for `server_id` when it is a write and there is a
    /// secret).
    fn send_request(
        &self,
        wire: &mut Wire<TcpStream>,
        method: &str,
        path_and_query: &str,
        body: &[u8],
        server_id: Option<&str>,
    ) -> std::result::Result<(), ExchangeError> {
        let what = || format!("{method} http://{}{path_and_query}", self.host_header);
        let mut req = format!(
            "{method} {path_and_query} HTTP/1.1\r\nHost: {}\r\nUser-Agent: mooncake\r\nAccept: */*\r\n",
            self.host_header
        );
        if !body.is_empty() {
            req.push_str("Content-Type: application/json\r\n");
        }
        if !body.is_empty() || matches!(method, "POST" | "PUT" | "PATCH") {
            req.push_str(&format!("Content-Length: {}\r\n", body.len()));
        }
        if let Some(secret) = self.secret.as_ref().filter(|_| self.signs(method)) {
            let server = server_id.unwrap_or_default();
            let signed = parse_target(path_and_query)
                .ok_or_else(|| io::Error::other("unparsable request path"))
                .and_then(|(path, query)| {
                    super::signed::sign(secret, server, method, &path, &query, body)
                });
            match signed {
                Ok(v) => req.push_str(&format!("{}: {v}\r\n", super::signed::HEADER)),
                Err(e) => {
                    return Err(ExchangeError {
                        err: Error::io(format!("signing {}", what()), e),
                        dead_connection: false,
                    })
                }
            }
        }
        req.push_str("\r\n");
        let mut out = req.into_bytes();
        out.extend_from_slice(body);
        wire.stream
            .write_all(&out)
            .and_then(|_| wire.stream.flush())
            .map_err(|e| ExchangeError {
                dead_connection: is_disconnect(e.kind()),
                err: Error::io(what(), e),
            })
    }

    fn exchange(
        &self,
        wire: &mut Wire<TcpStream>,
        method: &str,
        path_and_query: &str,
        body: &[u8],
        server_id: Option<&str>,
    ) -> std::result::Result<Answer, ExchangeError> {
        let what = || format!("{method} http://{}{path_and_query}", self.host_header);
        self.send_request(wire, method, path_and_query, body, server_id)?;
        let received_before = wire.received;
        let fail = |wire: &Wire<TcpStream>, e: ReadErr| {
            let nothing = wire.received == received_before;
            let (err, dead) = match e {
                ReadErr::Eof => (
                    Error::new(
                        Code::Io,
                        format!("{}: connection closed before a complete response", what()),
                    ),
                    nothing,
                ),
                ReadErr::Io(e) => {
                    let dead = nothing && is_disconnect(e.kind());
                    (Error::io(what(), e), dead)
                }
                ReadErr::TooLarge => (
                    Error::protocol(format!("{}: response exceeds size limits", what())),
                    false,
                ),
                ReadErr::Malformed(m) => (
                    Error::protocol(format!("{}: malformed response: {m}", what())),
                    false,
                ),
            };
            ExchangeError {
                err,
                dead_connection: dead,
            }
        };
        read_response(wire, method).map_err(|e| fail(wire, e))
    }
}

/// A final response's head as read: status, framing of its body, whether the
/// connection may carry another request, the server's identity.
struct Head {
    status: u16,
    framing: Framing,
    keep: bool,
    server_id: Option<String>,
}

/// Reads the head of the response to a `method` request, skipping interim (1xx)
/// answers.
fn read_response_head<R: Read>(
    wire: &mut Wire<R>,
    method: &str,
) -> std::result::Result<Head, ReadErr> {
    loop {
        let head = wire.read_head(MAX_RESPONSE_HEAD)?.ok_or(ReadErr::Eof)?;
        let (start, headers) = parse_head(&head)?;
        let (http11, status) =
            parse_status_line(&start).ok_or(ReadErr::Malformed("bad status line"))?;
        if (100..200).contains(&status) {
            if status == 101 {
                return Err(ReadErr::Malformed("unexpected protocol switch"));
            }
            continue; // interim response (e.g. 100 Continue)
        }
        let framing = if method == "HEAD" || status == 204 || status == 304 {
            Framing::Length(0)
        } else {
            body_framing(&headers)?.unwrap_or(Framing::ToEof)
        };
        // Only a plain token goes into the signatures this client writes.
        let server_id = find_header(&headers, super::signed::SERVER_HEADER)
            .filter(|id| id.len() <= 64 && id.bytes().all(|b| b.is_ascii_alphanumeric()))
            .map(str::to_owned);
        return Ok(Head {
            status,
            framing,
            keep: keep_alive(&headers, http11) && framing != Framing::ToEof,
            server_id,
        });
    }
}

/// Reads the response to a `method` request: its final head and its body.
pub(super) fn read_response<R: Read>(
    wire: &mut Wire<R>,
    method: &str,
) -> std::result::Result<Answer, ReadErr> {
    let head = read_response_head(wire, method)?;
    let body = wire.read_body(head.framing, MAX_RESPONSE_BODY)?;
    // Unsolicited bytes after the body: do not trust this connection.
    let keep = head.keep && wire.avail().is_empty();
    Ok(Answer {
        status: head.status,
        body,
        keep,
        server_id: head.server_id,
    })
}

/// A response read piece by piece as it arrives, on a connection of its own: for
/// answers that stream (etcd's watch) rather than end.
pub struct BodyStream {
    wire: Wire<TcpStream>,
    status: u16,
    framing: Framing,
    deadline: Instant,
    what: String,
}

impl BodyStream {
    /// The response's status code.
    pub fn status(&self) -> u16 {
        self.status
    }

    /// The next piece of the body, at most `limit` bytes (a chunk of a chunked
    /// answer; the whole body of any other): `None` once it ended. Past the deadline
    /// given when it was opened, an error with `Code::Timeout`.
    pub fn next_piece(&mut self, limit: usize) -> Result<Option<Vec<u8>>> {
        let left = self.deadline.saturating_duration_since(Instant::now());
        if left.is_zero() {
            return Err(Error::new(
                Code::Timeout,
                format!("{}: deadline", self.what),
            ));
        }
        self.wire
            .stream
            .set_read_timeout(Some(left))
            .map_err(|e| Error::io(&self.what, e))?;
        let piece = match self.framing {
            Framing::Chunked => self.wire.read_chunk(limit),
            framing => {
                self.framing = Framing::Length(0);
                match framing {
                    Framing::Length(0) => Ok(None),
                    _ => self.wire.read_body(framing, limit).map(Some),
                }
            }
        };
        piece.map_err(|e| stream_error(&self.what, e))
    }
}

fn stream_error(what: &str, e: ReadErr) -> Error {
    match e {
        ReadErr::Io(e)
            if matches!(
                e.kind(),
                io::ErrorKind::WouldBlock | io::ErrorKind::TimedOut
            ) =>
        {
            Error::new(Code::Timeout, format!("{what}: deadline"))
        }
        ReadErr::Io(e) => Error::io(what, e),
        ReadErr::Eof => Error::new(Code::Io, format!("{what}: connection closed mid-response")),
        ReadErr::TooLarge => Error::protocol(format!("{what}: response exceeds size limits")),
        ReadErr::Malformed(m) => Error::protocol(format!("{what}: malformed response: {m}")),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn urls() {
        let c = HttpClient::new("http://127.0.0.1:8080/metadata/").unwrap();
        assert_eq!(c.base_path(), "/metadata");
        assert_eq!(c.port, 8080);
        let c = HttpClient::new("http://[::1]:9/x").unwrap();
        assert_eq!((c.host.as_str(), c.port), ("::1", 9));
        assert_eq!(c.host_header, "[::1]:9");
        let c = HttpClient::new("HTTP://example.com").unwrap();
        assert_eq!((c.port, c.base_path()), (80, ""));
        for bad in [
            "https://h:1/",
            "h:1",
            "http://",
            "http://h:x/",
            "http://h:0/",
            "http://u@h:1/",
            "http://h:1/a?b",
            "http://::1:80/",
        ] {
            assert!(HttpClient::new(bad).is_err(), "{bad}");
        }
    }
}
