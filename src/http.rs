//! A minimal HTTP/1.1 server and client for small JSON/text bodies.
//!
//! This is an internal building block (metadata REST, admin/metrics endpoints),
//! not a general web stack. The server runs one accept thread plus one thread per
//! connection, supports keep-alive, `Content-Length` and chunked request bodies,
//! and enforces limits on the request head ([`MAX_REQUEST_HEAD`]) and body
//! ([`MAX_REQUEST_BODY`]). The client keeps one persistent connection, reconnects
//! once when a reused connection turns out to be dead, and understands
//! `Content-Length`, chunked and read-to-EOF responses up to [`MAX_RESPONSE_BODY`].

use std::collections::HashMap;
use std::io::{self, Read, Write};
use std::net::{Shutdown, SocketAddr, TcpListener, TcpStream, ToSocketAddrs};
use std::os::unix::io::{AsRawFd, RawFd};
use std::panic::{self, AssertUnwindSafe};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex, MutexGuard};
use std::thread::{self, JoinHandle};
use std::time::Duration;

use crate::error::{Code, Error, Result};

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

const MAX_HEADERS: usize = 128;
const MAX_RESPONSE_HEAD: usize = 64 * 1024;
const MAX_CHUNK_LINE: usize = 4096;
const MAX_CONNECTIONS: usize = 4096;
const READ_CHUNK: usize = 16 * 1024;
/// After an error response we keep reading (and discarding) what the client still
/// sends, so that closing does not reset the connection before it reads our answer.
const LINGER_BYTES: usize = 1024 * 1024;
const LINGER_TIMEOUT: Duration = Duration::from_secs(2);

// ---------------------------------------------------------------------------
// Requests and responses
// ---------------------------------------------------------------------------

/// A parsed request as handed to a [`Handler`].
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct Request {
    /// The method as sent (methods are case-sensitive), e.g. `GET`.
    pub method: String,
    /// The percent-decoded path, e.g. `/metadata`.
    pub path: String,
    /// Query parameters in order, names and values percent-decoded (`+` is a space).
    pub query: Vec<(String, String)>,
    /// Header fields in order, names as sent, values trimmed.
    pub headers: Vec<(String, String)>,
    /// The request body (empty when none was sent).
    pub body: Vec<u8>,
}

impl Request {
    /// The first query parameter called `name` (decoded).
    pub fn query_param(&self, name: &str) -> Option<&str> {
        self.query
            .iter()
            .find(|(k, _)| k == name)
            .map(|(_, v)| v.as_str())
    }

    /// The first header called `name` (case-insensitive).
    pub fn header(&self, name: &str) -> Option<&str> {
        find_header(&self.headers, name)
    }
}

/// A response produced by a [`Handler`]. The server adds `Content-Length` and
/// `Connection`; for `HEAD` requests it sends the head only.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Response {
    pub status: u16,
    pub content_type: &'static str,
    pub body: Vec<u8>,
}

impl Response {
    pub fn new(status: u16, content_type: &'static str, body: Vec<u8>) -> Response {
        Response {
            status,
            content_type,
            body,
        }
    }

    /// A `text/plain` response.
    pub fn text(status: u16, body: impl Into<String>) -> Response {
        Response::new(
            status,
            "text/plain; charset=utf-8",
            body.into().into_bytes(),
        )
    }

    /// An `application/json` response (the body is not checked).
    pub fn json(status: u16, body: impl Into<String>) -> Response {
        Response::new(status, "application/json", body.into().into_bytes())
    }
}

/// Request handler; called concurrently from connection threads. A panicking
/// handler produces a 500 response.
pub type Handler = Arc<dyn Fn(&Request) -> Response + Send + Sync>;

/// Standard reason phrase for `status` (empty when unknown, which HTTP allows).
pub fn reason_phrase(status: u16) -> &'static str {
    match status {
        100 => "Continue",
        200 => "OK",
        201 => "Created",
        204 => "No Content",
        301 => "Moved Permanently",
        302 => "Found",
        304 => "Not Modified",
        400 => "Bad Request",
        401 => "Unauthorized",
        403 => "Forbidden",
        404 => "Not Found",
        405 => "Method Not Allowed",
        408 => "Request Timeout",
        409 => "Conflict",
        411 => "Length Required",
        413 => "Content Too Large",
        414 => "URI Too Long",
        417 => "Expectation Failed",
        431 => "Request Header Fields Too Large",
        500 => "Internal Server Error",
        501 => "Not Implemented",
        503 => "Service Unavailable",
        505 => "HTTP Version Not Supported",
        _ => "",
    }
}

// ---------------------------------------------------------------------------
// Percent encoding
// ---------------------------------------------------------------------------

/// Percent-encodes every byte of `s` except the unreserved characters
/// (`A-Z a-z 0-9 - . _ ~`).
pub fn percent_encode(s: &str) -> String {
    const HEX: &[u8; 16] = b"0123456789ABCDEF";
    let mut out = String::with_capacity(s.len());
    for &b in s.as_bytes() {
        if b.is_ascii_alphanumeric() || matches!(b, b'-' | b'.' | b'_' | b'~') {
            out.push(b as char);
        } else {
            out.push('%');
            out.push(HEX[(b >> 4) as usize] as char);
            out.push(HEX[(b & 15) as usize] as char);
        }
    }
    out
}

/// Decodes `%XY` escapes. `None` when an escape is malformed or the result is not
/// UTF-8. `+` is left alone (query decoding turns it into a space first).
pub fn percent_decode(s: &str) -> Option<String> {
    let bytes = s.as_bytes();
    if !bytes.contains(&b'%') {
        return Some(s.to_owned());
    }
    let mut out = Vec::with_capacity(bytes.len());
    let mut i = 0;
    while i < bytes.len() {
        if bytes[i] == b'%' {
            let hi = hex_value(*bytes.get(i + 1)?)?;
            let lo = hex_value(*bytes.get(i + 2)?)?;
            out.push((hi << 4) | lo);
            i += 3;
        } else {
            out.push(bytes[i]);
            i += 1;
        }
    }
    String::from_utf8(out).ok()
}

fn hex_value(b: u8) -> Option<u8> {
    match b {
        b'0'..=b'9' => Some(b - b'0'),
        b'a'..=b'f' => Some(b - b'a' + 10),
        b'A'..=b'F' => Some(b - b'A' + 10),
        _ => None,
    }
}

/// Decodes a query component: `+` means space, then percent escapes.
fn query_decode(s: &str) -> Option<String> {
    if s.contains('+') {
        percent_decode(&s.replace('+', " "))
    } else {
        percent_decode(s)
    }
}

fn parse_query(raw: &str) -> Option<Vec<(String, String)>> {
    let mut out = Vec::new();
    for part in raw.split('&').filter(|p| !p.is_empty()) {
        let (name, value) = part.split_once('=').unwrap_or((part, ""));
        out.push((query_decode(name)?, query_decode(value)?));
    }
    Some(out)
}

// ---------------------------------------------------------------------------
// Shared wire reading
// ---------------------------------------------------------------------------

fn find_header<'a>(headers: &'a [(String, String)], name: &str) -> Option<&'a str> {
    headers
        .iter()
        .find(|(k, _)| k.eq_ignore_ascii_case(name))
        .map(|(_, v)| v.as_str())
}

/// Whether the comma-separated header list `name` contains `token`.
fn header_has_token(headers: &[(String, String)], name: &str, token: &str) -> bool {
    headers
        .iter()
        .filter(|(k, _)| k.eq_ignore_ascii_case(name))
        .flat_map(|(_, v)| v.split(','))
        .any(|t| t.trim().eq_ignore_ascii_case(token))
}

fn is_token(s: &str) -> bool {
    !s.is_empty()
        && s.bytes().all(|b| {
            b.is_ascii_alphanumeric()
                || matches!(
                    b,
                    b'!' | b'#'
                        | b'$'
                        | b'%'
                        | b'&'
                        | b'\''
                        | b'*'
                        | b'+'
                        | b'-'
                        | b'.'
                        | b'^'
                        | b'_'
                        | b'`'
                        | b'|'
                        | b'~'
                )
        })
}

#[derive(Debug)]
enum ReadErr {
    /// The peer closed the connection (cleanly) in the middle of a message.
    Eof,
    Io(io::Error),
    /// A size limit was exceeded.
    TooLarge,
    Malformed(&'static str),
}

impl From<io::Error> for ReadErr {
    fn from(e: io::Error) -> ReadErr {
        ReadErr::Io(e)
    }
}

/// How a message body is delimited.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Framing {
    Length(u64),
    Chunked,
    ToEof,
}

/// A buffered reader over a byte stream that can hand out heads, lines and bodies.
struct Wire<S> {
    stream: S,
    buf: Vec<u8>,
    pos: usize,
    /// Total bytes ever read from the stream.
    received: u64,
}

impl<S: Read> Wire<S> {
    fn new(stream: S) -> Wire<S> {
        Wire {
            stream,
            buf: Vec::new(),
            pos: 0,
            received: 0,
        }
    }

    fn avail(&self) -> &[u8] {
        &self.buf[self.pos..]
    }

    fn consume(&mut self, n: usize) {
        self.pos += n;
        if self.pos == self.buf.len() {
            self.buf.clear();
            self.pos = 0;
        }
    }

    /// Reads more bytes into the buffer; `Ok(0)` at end of stream.
    fn fill(&mut self) -> io::Result<usize> {
        if self.pos > 0 {
            self.buf.drain(..self.pos);
            self.pos = 0;
        }
        let old = self.buf.len();
        self.buf.resize(old + READ_CHUNK, 0);
        loop {
            match self.stream.read(&mut self.buf[old..]) {
                Ok(n) => {
                    self.buf.truncate(old + n);
                    self.received += n as u64;
                    return Ok(n);
                }
                Err(e) if e.kind() == io::ErrorKind::Interrupted => continue,
                Err(e) => {
                    self.buf.truncate(old);
                    return Err(e);
                }
            }
        }
    }

    /// Reads a message head (start line plus header lines, up to and including the
    /// empty line). Leading empty lines are skipped. `Ok(None)` when the stream
    /// ends before any byte of a message.
    fn read_head(&mut self, max: usize) -> std::result::Result<Option<Vec<u8>>, ReadErr> {
        let mut skipped = 0usize;
        loop {
            while let Some(&b) = self.avail().first() {
                if b != b'\r' && b != b'\n' {
                    break;
                }
                self.consume(1);
                skipped += 1;
            }
            if skipped > max {
                return Err(ReadErr::TooLarge);
            }
            if let Some(end) = find_head_end(self.avail()) {
                if end > max {
                    return Err(ReadErr::TooLarge);
                }
                let head = self.avail()[..end].to_vec();
                self.consume(end);
                return Ok(Some(head));
            }
            if self.avail().len() > max {
                return Err(ReadErr::TooLarge);
            }
            if self.fill()? == 0 {
                return if self.avail().is_empty() {
                    Ok(None)
                } else {
                    Err(ReadErr::Eof)
                };
            }
        }
    }

    /// Reads one line (without its `\n` / `\r\n`), at most `max` bytes long.
    fn read_line(&mut self, max: usize) -> std::result::Result<Vec<u8>, ReadErr> {
        loop {
            if let Some(i) = self.avail().iter().position(|&b| b == b'\n') {
                let mut line = self.avail()[..i].to_vec();
                self.consume(i + 1);
                if line.last() == Some(&b'\r') {
                    line.pop();
                }
                return Ok(line);
            }
            if self.avail().len() > max {
                return Err(ReadErr::TooLarge);
            }
            if self.fill()? == 0 {
                return Err(ReadErr::Eof);
            }
        }
    }

    /// Appends exactly `n` bytes to `out`.
    fn read_exact_into(&mut self, n: usize, out: &mut Vec<u8>) -> std::result::Result<(), ReadErr> {
        let take = n.min(self.avail().len());
        out.extend_from_slice(&self.avail()[..take]);
        self.consume(take);
        let mut left = n - take;
        if left == 0 {
            return Ok(());
        }
        let start = out.len();
        out.resize(start + left, 0);
        let mut at = start;
        while left > 0 {
            match self.stream.read(&mut out[at..]) {
                Ok(0) => {
                    out.truncate(at);
                    return Err(ReadErr::Eof);
                }
                Ok(k) => {
                    at += k;
                    left -= k;
                    self.received += k as u64;
                }
                Err(e) if e.kind() == io::ErrorKind::Interrupted => {}
                Err(e) => {
                    out.truncate(at);
                    return Err(ReadErr::Io(e));
                }
            }
        }
        Ok(())
    }

    fn read_body(
        &mut self,
        framing: Framing,
        limit: usize,
    ) -> std::result::Result<Vec<u8>, ReadErr> {
        match framing {
            Framing::Length(n) => {
                if n > limit as u64 {
                    return Err(ReadErr::TooLarge);
                }
                let mut out = Vec::with_capacity((n as usize).min(1 << 20));
                self.read_exact_into(n as usize, &mut out)?;
                Ok(out)
            }
            Framing::Chunked => self.read_chunked(limit),
            Framing::ToEof => {
                let mut out = Vec::new();
                loop {
                    let n = self.avail().len();
                    if out.len() + n > limit {
                        return Err(ReadErr::TooLarge);
                    }
                    out.extend_from_slice(self.avail());
                    self.consume(n);
                    if self.fill()? == 0 {
                        return Ok(out);
                    }
                }
            }
        }
    }

    fn read_chunked(&mut self, limit: usize) -> std::result::Result<Vec<u8>, ReadErr> {
        let mut out = Vec::new();
        loop {
            let line = self.read_line(MAX_CHUNK_LINE)?;
            let size_field = line.split(|&b| b == b';').next().unwrap_or(&[]);
            let size_field = trim_ascii(size_field);
            if size_field.is_empty()
                || size_field.len() > 15
                || !size_field.iter().all(u8::is_ascii_hexdigit)
            {
                return Err(ReadErr::Malformed("bad chunk size"));
            }
            let size = size_field.iter().fold(0u64, |acc, &b| {
                (acc << 4) | u64::from(hex_value(b).unwrap_or(0))
            });
            if size == 0 {
                // Trailer section, discarded.
                let mut trailer_bytes = 0;
                loop {
                    let t = self.read_line(MAX_CHUNK_LINE)?;
                    if t.is_empty() {
                        return Ok(out);
                    }
                    trailer_bytes += t.len();
                    if trailer_bytes > MAX_REQUEST_HEAD {
                        return Err(ReadErr::TooLarge);
                    }
                }
            }
            if out.len() as u64 + size > limit as u64 {
                return Err(ReadErr::TooLarge);
            }
            self.read_exact_into(size as usize, &mut out)?;
            if !self.read_line(MAX_CHUNK_LINE)?.is_empty() {
                return Err(ReadErr::Malformed("missing CRLF after chunk data"));
            }
        }
    }
}

fn trim_ascii(mut b: &[u8]) -> &[u8] {
    while let [first, rest @ ..] = b {
        if first.is_ascii_whitespace() {
            b = rest;
        } else {
            break;
        }
    }
    while let [rest @ .., last] = b {
        if last.is_ascii_whitespace() {
            b = rest;
        } else {
            break;
        }
    }
    b
}

/// Index just past the empty line ending a message head (`\n\n` or `\n\r\n`).
fn find_head_end(b: &[u8]) -> Option<usize> {
    let mut i = 0;
    while i < b.len() {
        if b[i] == b'\n' {
            match b.get(i + 1) {
                Some(b'\n') => return Some(i + 2),
                Some(b'\r') if b.get(i + 2) == Some(&b'\n') => return Some(i + 3),
                _ => {}
            }
        }
        i += 1;
    }
    None
}

/// Splits a head into its start line and header fields.
fn parse_head(head: &[u8]) -> std::result::Result<(String, Vec<(String, String)>), ReadErr> {
    let text = std::str::from_utf8(head).map_err(|_| ReadErr::Malformed("head is not UTF-8"))?;
    let mut lines = text
        .split('\n')
        .map(|l| l.strip_suffix('\r').unwrap_or(l))
        .take_while(|l| !l.is_empty());
    let start = lines.next().ok_or(ReadErr::Malformed("empty head"))?;
    if start.contains('\r') {
        return Err(ReadErr::Malformed("stray CR in start line"));
    }
    let mut headers = Vec::new();
    for line in lines {
        if line.starts_with(' ') || line.starts_with('\t') {
            return Err(ReadErr::Malformed("obsolete header line folding"));
        }
        let (name, value) = line
            .split_once(':')
            .ok_or(ReadErr::Malformed("header line without a colon"))?;
        if !is_token(name) {
            return Err(ReadErr::Malformed("invalid header name"));
        }
        let value = value.trim_matches(|c| c == ' ' || c == '\t');
        if value.bytes().any(|b| b == b'\r' || b == 0) {
            return Err(ReadErr::Malformed("invalid header value"));
        }
        if headers.len() >= MAX_HEADERS {
            return Err(ReadErr::TooLarge);
        }
        headers.push((name.to_owned(), value.to_owned()));
    }
    Ok((start.to_owned(), headers))
}

/// Body framing from the headers. `Ok(None)`: neither header was sent.
fn body_framing(headers: &[(String, String)]) -> std::result::Result<Option<Framing>, ReadErr> {
    if find_header(headers, "transfer-encoding").is_some() {
        let last = headers
            .iter()
            .filter(|(k, _)| k.eq_ignore_ascii_case("transfer-encoding"))
            .flat_map(|(_, v)| v.split(','))
            .map(str::trim)
            .rfind(|t| !t.is_empty());
        return match last {
            Some(t) if t.eq_ignore_ascii_case("chunked") => Ok(Some(Framing::Chunked)),
            _ => Err(ReadErr::Malformed("unsupported transfer-encoding")),
        };
    }
    let mut length: Option<u64> = None;
    for v in headers
        .iter()
        .filter(|(k, _)| k.eq_ignore_ascii_case("content-length"))
        .flat_map(|(_, v)| v.split(','))
    {
        let v = v.trim();
        if v.is_empty() || v.len() > 19 || !v.bytes().all(|b| b.is_ascii_digit()) {
            return Err(ReadErr::Malformed("invalid content-length"));
        }
        let n: u64 = v
            .parse()
            .map_err(|_| ReadErr::Malformed("invalid content-length"))?;
        if length.is_some_and(|l| l != n) {
            return Err(ReadErr::Malformed("conflicting content-length values"));
        }
        length = Some(n);
    }
    Ok(length.map(Framing::Length))
}

// ---------------------------------------------------------------------------
// Server
// ---------------------------------------------------------------------------

/// A small threaded HTTP/1.1 server. Dropping it shuts it down.
pub struct HttpServer {
    local_addr: SocketAddr,
    shared: Arc<Shared>,
    waker: Arc<Pipe>,
    accept: Option<JoinHandle<()>>,
}

struct Shared {
    handler: Handler,
    stopping: AtomicBool,
    conns: Mutex<Conns>,
}

#[derive(Default)]
struct Conns {
    next_id: u64,
    /// A clone of every live connection's stream, so shutdown can unblock it.
    streams: HashMap<u64, TcpStream>,
    threads: Vec<JoinHandle<()>>,
    closed: bool,
}

fn lock<T>(m: &Mutex<T>) -> MutexGuard<'_, T> {
    m.lock().unwrap_or_else(|e| e.into_inner())
}

/// A non-blocking self-pipe used to wake the accept thread.
struct Pipe {
    rd: RawFd,
    wr: RawFd,
}

impl Pipe {
    fn new() -> io::Result<Pipe> {
        let mut fds = [0 as libc::c_int; 2];
        // SAFETY: `fds` is a valid array of two c_ints for pipe2 to fill.
        let r = unsafe { libc::pipe2(fds.as_mut_ptr(), libc::O_CLOEXEC | libc::O_NONBLOCK) };
        if r != 0 {
            return Err(io::Error::last_os_error());
        }
        Ok(Pipe {
            rd: fds[0],
            wr: fds[1],
        })
    }

    fn wake(&self) {
        let b = 1u8;
        // SAFETY: writes one byte from a valid local to our own open pipe fd. A full
        // pipe (EAGAIN) already means the reader will wake.
        let _ = unsafe { libc::write(self.wr, (&b as *const u8).cast(), 1) };
    }
}

impl Drop for Pipe {
    fn drop(&mut self) {
        // SAFETY: both fds were opened by pipe2 and are owned solely by this struct.
        unsafe {
            libc::close(self.rd);
            libc::close(self.wr);
        }
    }
}

/// Waits until `fd` is readable, or `waker` is signalled (returns `false`), or
/// `timeout_ms` elapses (-1: forever).
fn wait_readable(fd: RawFd, waker: &Pipe, timeout_ms: libc::c_int) -> io::Result<bool> {
    let mut fds = [
        libc::pollfd {
            fd,
            events: libc::POLLIN,
            revents: 0,
        },
        libc::pollfd {
            fd: waker.rd,
            events: libc::POLLIN,
            revents: 0,
        },
    ];
    loop {
        // SAFETY: `fds` is a valid array of two pollfd structs.
        let r = unsafe { libc::poll(fds.as_mut_ptr(), 2, timeout_ms) };
        if r < 0 {
            let e = io::Error::last_os_error();
            if e.kind() == io::ErrorKind::Interrupted {
                continue;
            }
            return Err(e);
        }
        return Ok(fds[1].revents == 0);
    }
}

impl HttpServer {
    /// Binds `addr` (port 0 picks a free port) and starts serving with `handler`.
    pub fn bind(addr: SocketAddr, handler: Handler) -> io::Result<HttpServer> {
        let listener = TcpListener::bind(addr)?;
        listener.set_nonblocking(true)?;
        let local_addr = listener.local_addr()?;
        let waker = Arc::new(Pipe::new()?);
        let shared = Arc::new(Shared {
            handler,
            stopping: AtomicBool::new(false),
            conns: Mutex::new(Conns::default()),
        });
        let accept = {
            let shared = shared.clone();
            let waker = waker.clone();
            thread::Builder::new()
                .name(format!("http-accept-{}", local_addr.port()))
                .spawn(move || accept_loop(listener, &shared, &waker))?
        };
        Ok(HttpServer {
            local_addr,
            shared,
            waker,
            accept: Some(accept),
        })
    }

    /// The bound address (with the real port when bound to port 0).
    pub fn local_addr(&self) -> SocketAddr {
        self.local_addr
    }

    /// Stops accepting, closes every connection and joins all threads. Idempotent.
    pub fn shutdown(&mut self) {
        let Some(accept) = self.accept.take() else {
            return;
        };
        self.shared.stopping.store(true, Ordering::SeqCst);
        self.waker.wake();
        if accept.join().is_err() {
            log::error!("http server {}: accept thread panicked", self.local_addr);
        }
        // The listener is closed now; no new connections can be registered.
        let threads = {
            let mut conns = lock(&self.shared.conns);
            conns.closed = true;
            for s in conns.streams.values() {
                let _ = s.shutdown(Shutdown::Both);
            }
            std::mem::take(&mut conns.threads)
        };
        for t in threads {
            let _ = t.join();
        }
        log::debug!("http server {} stopped", self.local_addr);
    }
}

impl Drop for HttpServer {
    fn drop(&mut self) {
        self.shutdown();
    }
}

fn accept_loop(listener: TcpListener, shared: &Arc<Shared>, waker: &Pipe) {
    let fd = listener.as_raw_fd();
    loop {
        match wait_readable(fd, waker, -1) {
            Ok(true) => {}
            Ok(false) => return,
            Err(e) => {
                log::error!("http server: poll failed: {e}");
                return;
            }
        }
        if shared.stopping.load(Ordering::SeqCst) {
            return;
        }
        loop {
            match listener.accept() {
                Ok((stream, peer)) => register_connection(shared, stream, peer),
                Err(e) if e.kind() == io::ErrorKind::WouldBlock => break,
                Err(e)
                    if matches!(
                        e.kind(),
                        io::ErrorKind::Interrupted | io::ErrorKind::ConnectionAborted
                    ) => {}
                Err(e) => {
                    // E.g. out of file descriptors: back off briefly instead of spinning,
                    // still waking at once on shutdown.
                    log::warn!("http server: accept failed: {e}");
                    if let Ok(false) = wait_readable(waker.rd, waker, 100) {
                        return;
                    }
                    break;
                }
            }
        }
    }
}

fn register_connection(shared: &Arc<Shared>, stream: TcpStream, peer: SocketAddr) {
    let setup = (|| -> io::Result<TcpStream> {
        stream.set_nonblocking(false)?;
        stream.set_nodelay(true)?;
        stream.set_read_timeout(Some(SERVER_IDLE_TIMEOUT))?;
        stream.set_write_timeout(Some(SERVER_IDLE_TIMEOUT))?;
        stream.try_clone()
    })();
    let clone = match setup {
        Ok(c) => c,
        Err(e) => {
            log::warn!("http server: setting up connection from {peer}: {e}");
            return;
        }
    };
    let finished = {
        let mut conns = lock(&shared.conns);
        if conns.closed || conns.streams.len() >= MAX_CONNECTIONS {
            log::warn!("http server: refusing connection from {peer} (closed or too many)");
            return;
        }
        let id = conns.next_id;
        conns.next_id += 1;
        conns.streams.insert(id, clone);
        let worker = shared.clone();
        let spawned = thread::Builder::new()
            .name("http-conn".into())
            .spawn(move || {
                serve_connection(&worker, &stream);
                lock(&worker.conns).streams.remove(&id);
            });
        match spawned {
            Ok(h) => conns.threads.push(h),
            Err(e) => {
                log::warn!("http server: cannot spawn connection thread: {e}");
                conns.streams.remove(&id);
            }
        }
        // Reap finished connection threads so the list does not grow without bound.
        let (done, live): (Vec<_>, Vec<_>) = conns.threads.drain(..).partition(|h| h.is_finished());
        conns.threads = live;
        done
    };
    for h in finished {
        let _ = h.join();
    }
}

enum RequestFailure {
    /// Answer with this status and close.
    Respond(u16, &'static str),
    /// Just close the connection.
    Close,
}

fn serve_connection(shared: &Shared, stream: &TcpStream) {
    let mut wire = Wire::new(stream);
    loop {
        if shared.stopping.load(Ordering::SeqCst) {
            return;
        }
        match read_request(&mut wire, stream) {
            Ok(None) => return,
            Ok(Some((req, keep_alive))) => {
                let head_only = req.method == "HEAD";
                let resp = panic::catch_unwind(AssertUnwindSafe(|| (shared.handler)(&req)))
                    .unwrap_or_else(|_| {
                        log::error!("http handler panicked on {} {}", req.method, req.path);
                        Response::text(500, "internal server error")
                    });
                let keep = keep_alive && !shared.stopping.load(Ordering::SeqCst);
                if write_response(stream, &resp, head_only, keep).is_err() || !keep {
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

fn read_request(
    wire: &mut Wire<&TcpStream>,
    mut stream: &TcpStream,
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

    let keep_alive = if header_has_token(&headers, "connection", "close") {
        false
    } else {
        http11 || header_has_token(&headers, "connection", "keep-alive")
    };
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
            let _ = stream.write_all(b"HTTP/1.1 100 Continue\r\n\r\n");
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
    };
    Ok(Some((req, keep_alive)))
}

/// Splits a request target into decoded path and query. Accepts origin form
/// (`/p?q`), absolute form (`http://host/p?q`) and `*`.
fn parse_target(target: &str) -> Option<(String, Vec<(String, String)>)> {
    let target = target.split('#').next().unwrap_or("");
    let rel = if target.starts_with('/') || target == "*" {
        target
    } else {
        let lower = target.get(..7)?.to_ascii_lowercase();
        if lower != "http://" {
            return None;
        }
        let rest = &target[7..];
        match rest.find(['/', '?']) {
            Some(i) => &rest[i..],
            None => "/",
        }
    };
    let (raw_path, raw_query) = rel.split_once('?').unwrap_or((rel, ""));
    let path = if raw_path.is_empty() {
        "/".to_owned()
    } else {
        percent_decode(raw_path)?
    };
    Some((path, parse_query(raw_query)?))
}

fn write_response(
    mut stream: &TcpStream,
    resp: &Response,
    head_only: bool,
    keep_alive: bool,
) -> io::Result<()> {
    let no_body = resp.status < 200 || resp.status == 204 || resp.status == 304;
    let mut out = format!(
        "HTTP/1.1 {} {}\r\n",
        resp.status,
        reason_phrase(resp.status)
    );
    if !no_body {
        out.push_str(&format!(
            "Content-Type: {}\r\nContent-Length: {}\r\n",
            resp.content_type,
            resp.body.len()
        ));
    }
    out.push_str(if keep_alive {
        "Connection: keep-alive\r\n\r\n"
    } else {
        "Connection: close\r\n\r\n"
    });
    let mut out = out.into_bytes();
    if !head_only && !no_body {
        out.extend_from_slice(&resp.body);
    }
    stream.write_all(&out)?;
    stream.flush()
}

// ---------------------------------------------------------------------------
// Client
// ---------------------------------------------------------------------------

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
        })
    }

    /// Overrides the connect and read/write timeouts.
    pub fn with_timeouts(mut self, connect: Duration, io: Duration) -> HttpClient {
        self.connect_timeout = connect;
        self.io_timeout = io;
        self
    }

    /// The URL's path without trailing slashes (`""` when the URL has none).
    pub fn base_path(&self) -> &str {
        &self.base_path
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
        let mut conn = lock(&self.conn);
        let mut retried = false;
        loop {
            let reused = conn.is_some();
            let wire = match conn.as_mut() {
                Some(w) => w,
                None => conn.insert(self.connect()?),
            };
            match self.exchange(wire, method, path_and_query, body) {
                Ok((status, resp, keep)) => {
                    if !keep {
                        *conn = None;
                    }
                    return Ok((status, resp));
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

    fn exchange(
        &self,
        wire: &mut Wire<TcpStream>,
        method: &str,
        path_and_query: &str,
        body: &[u8],
    ) -> std::result::Result<(u16, Vec<u8>, bool), ExchangeError> {
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
        req.push_str("\r\n");
        let mut out = req.into_bytes();
        out.extend_from_slice(body);
        if let Err(e) = wire
            .stream
            .write_all(&out)
            .and_then(|_| wire.stream.flush())
        {
            return Err(ExchangeError {
                dead_connection: is_disconnect(e.kind()),
                err: Error::io(what(), e),
            });
        }

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
        loop {
            let head = match wire.read_head(MAX_RESPONSE_HEAD) {
                Ok(Some(h)) => h,
                Ok(None) => return Err(fail(wire, ReadErr::Eof)),
                Err(e) => return Err(fail(wire, e)),
            };
            let (start, headers) = parse_head(&head).map_err(|e| fail(wire, e))?;
            let (http11, status) = parse_status_line(&start)
                .ok_or_else(|| fail(wire, ReadErr::Malformed("bad status line")))?;
            if (100..200).contains(&status) {
                if status == 101 {
                    return Err(fail(wire, ReadErr::Malformed("unexpected protocol switch")));
                }
                continue; // interim response (e.g. 100 Continue)
            }
            let mut keep = if header_has_token(&headers, "connection", "close") {
                false
            } else {
                http11 || header_has_token(&headers, "connection", "keep-alive")
            };
            let framing = if method == "HEAD" || status == 204 || status == 304 {
                Framing::Length(0)
            } else {
                match body_framing(&headers).map_err(|e| fail(wire, e))? {
                    Some(f) => f,
                    None => Framing::ToEof,
                }
            };
            if framing == Framing::ToEof {
                keep = false;
            }
            let resp = wire
                .read_body(framing, MAX_RESPONSE_BODY)
                .map_err(|e| fail(wire, e))?;
            if !wire.avail().is_empty() {
                keep = false; // unsolicited bytes: do not trust this connection
            }
            return Ok((status, resp, keep));
        }
    }
}

/// `HTTP/1.x NNN reason` → (is HTTP/1.1 or later, status).
fn parse_status_line(line: &str) -> Option<(bool, u16)> {
    let mut parts = line.splitn(3, ' ');
    let version = parts.next()?;
    let code = parts.next()?;
    let minor = version.strip_prefix("HTTP/1.")?;
    if code.len() != 3 || !code.bytes().all(|b| b.is_ascii_digit()) {
        return None;
    }
    let status: u16 = code.parse().ok()?;
    if !(100..=599).contains(&status) {
        return None;
    }
    Some((minor != "0", status))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn percent_round_trip() {
        for s in [
            "",
            "abc",
            "a b&c=d/e:f",
            "mooncake/ram/127.0.0.1:1234",
            "héllo ✓ 日本",
        ] {
            assert_eq!(percent_decode(&percent_encode(s)).as_deref(), Some(s));
        }
        assert_eq!(percent_encode("a-b.c_d~e f"), "a-b.c_d~e%20f");
        assert_eq!(percent_decode("%zz"), None);
        assert_eq!(percent_decode("%4"), None);
        assert_eq!(percent_decode("%ff"), None);
        assert_eq!(query_decode("a+b%2B").as_deref(), Some("a b+"));
    }

    #[test]
    fn targets() {
        let (p, q) = parse_target("/metadata?key=a%20b&x&y=1+2").unwrap();
        assert_eq!(p, "/metadata");
        assert_eq!(
            q,
            vec![
                ("key".into(), "a b".into()),
                ("x".into(), String::new()),
                ("y".into(), "1 2".into())
            ]
        );
        assert_eq!(parse_target("http://h:1/a?b=c").unwrap().0, "/a");
        assert_eq!(parse_target("http://h:1").unwrap().0, "/");
        assert!(parse_target("ftp://x/").is_none());
        assert!(parse_target("/a?k=%zz").is_none());
    }

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

    #[test]
    fn chunked_decoding() {
        let data = b"4\r\nWiki\r\n5;ext=1\r\npedia\r\n0\r\nX-T: 1\r\n\r\nrest";
        let mut w = Wire::new(&data[..]);
        assert_eq!(w.read_body(Framing::Chunked, 100).unwrap(), b"Wikipedia");
        assert_eq!(w.avail(), b"rest");
        let mut w = Wire::new(&b"ff\r\n"[..]);
        assert!(matches!(
            w.read_body(Framing::Chunked, 10),
            Err(ReadErr::TooLarge)
        ));
        let mut w = Wire::new(&b"zz\r\n"[..]);
        assert!(matches!(
            w.read_body(Framing::Chunked, 10),
            Err(ReadErr::Malformed(_))
        ));
    }

    #[test]
    fn heads() {
        let mut w = Wire::new(&b"\r\nGET / HTTP/1.1\nA: b\n\nx"[..]);
        let h = w.read_head(100).unwrap().unwrap();
        let (start, headers) = parse_head(&h).unwrap();
        assert_eq!(start, "GET / HTTP/1.1");
        assert_eq!(headers, vec![("A".into(), "b".into())]);
        assert!(parse_head(b"GET / HTTP/1.1\r\n folded\r\n\r\n").is_err());
        assert!(parse_head(b"GET / HTTP/1.1\r\nBad Name: x\r\n\r\n").is_err());
        let cl = |v: &str| body_framing(&[("Content-Length".into(), v.into())]);
        assert_eq!(cl("12").unwrap(), Some(Framing::Length(12)));
        assert_eq!(cl("3, 3").unwrap(), Some(Framing::Length(3)));
        assert!(cl("3, 4").is_err());
        assert!(cl("-1").is_err());
        assert!(cl("+1").is_err());
        assert_eq!(
            parse_status_line("HTTP/1.0 404 Not Found"),
            Some((false, 404))
        );
        assert_eq!(parse_status_line("HTTP/1.1 200"), Some((true, 200)));
        assert_eq!(parse_status_line("HTTP/2 200 OK"), None);
    }
}
