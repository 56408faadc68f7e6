//! The store's own binary RPC between clients and the master.
//!
//! Request frame:  `u32 len | u16 version | u16 method | u64 request id | payload`.
//! Response frame: `u32 len | u16 version | u16 method | u64 request id | i32 status |
//! payload` (on a non-zero status the payload is the error's UTF-8 context).
//! `len` counts the bytes after itself and is capped at `MAX_FRAME`. Requests on one
//! connection are answered in order, so a client may pipeline them. A malformed or
//! oversized frame closes that connection (with a logged reason) and nobody else's.
//! Between processes of one host the same frames go through a shared-memory mailbox
//! (`mailbox`).

#![forbid(unsafe_code)]

use crate::util::sync::Unpoisoned;
use std::io::{Read, Write};
use std::net::{IpAddr, SocketAddr, TcpStream, ToSocketAddrs};
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

mod mailbox;

use super::codec::Writer;
use super::ha;
use super::master::Master;
use super::protocol::{Lookup, Method, Request, Response, PROTOCOL_VERSION};
use crate::auth::ClusterSecret;
use crate::error::{Code, Error, Result};
use crate::etcd::EtcdClient;
use crate::net::{ConnServer, ConnTicket, ServerLimits, TimedReader};

/// Largest RPC frame accepted, in bytes.
pub const MAX_FRAME: usize = 16 << 20;
const HEADER: usize = 12;
const IO_TIMEOUT: Duration = Duration::from_secs(30);

/// A request frame: the header, then `payload` (answers: `answer_frame`).
fn request_frame(method: u16, id: u64, payload: &[u8]) -> Vec<u8> {
    let mut out = Vec::with_capacity(4 + HEADER + payload.len());
    out.extend_from_slice(&((HEADER + payload.len()) as u32).to_le_bytes());
    out.extend_from_slice(&PROTOCOL_VERSION.to_le_bytes());
    out.extend_from_slice(&method.to_le_bytes());
    out.extend_from_slice(&id.to_le_bytes());
    out.extend_from_slice(payload);
    out
}

/// One received frame, header fields decoded.
#[derive(Debug)]
struct Frame {
    version: u16,
    method: u16,
    id: u64,
    /// What follows the header (for responses: status, then payload).
    body: Vec<u8>,
}

/// Bytes read from a connection ahead of the frame being parsed. Most frames are
/// small: one `recv` takes a frame's length, header and body together (reading them
/// apiece cost three calls each way on every round trip). A body larger than what is
/// buffered is read straight into its own vector.
struct FrameReader {
    buf: Box<[u8]>,
    start: usize,
    end: usize,
}

/// The read-ahead buffer of a master connection (it lives as long as the connection).
const READ_AHEAD: usize = 8 << 10;
/// The read-ahead buffer of one client call (made per call: most answers are small).
const ANSWER_READ_AHEAD: usize = 4 << 10;

impl FrameReader {
    fn new() -> FrameReader {
        FrameReader::with_capacity(READ_AHEAD)
    }

    fn with_capacity(bytes: usize) -> FrameReader {
        FrameReader {
            buf: vec![0; bytes].into_boxed_slice(),
            start: 0,
            end: 0,
        }
    }

    /// Bytes received and not yet parsed (the start of the next frame).
    fn buffered(&self) -> usize {
        self.end - self.start
    }

    /// Reads what the stream has into the free tail of the buffer; 0 at its end.
    fn fill(&mut self, stream: &mut impl Read) -> std::io::Result<usize> {
        if self.start == self.end {
            (self.start, self.end) = (0, 0);
        } else if self.end == self.buf.len() {
            self.buf.copy_within(self.start..self.end, 0);
            (self.start, self.end) = (0, self.end - self.start);
        }
        loop {
            match stream.read(&mut self.buf[self.end..]) {
                Ok(n) => {
                    self.end += n;
                    return Ok(n);
                }
                // A signal handled meanwhile (a Python host installs handlers without
                // SA_RESTART) is no reason to fail the call.
                Err(e) if e.kind() == std::io::ErrorKind::Interrupted => continue,
                Err(e) => return Err(e),
            }
        }
    }

    /// Reads one frame; `Ok(None)` on a clean EOF (between frames).
    fn read_frame(&mut self, stream: &mut impl Read) -> Result<Option<Frame>> {
        while self.buffered() < 4 {
            let had = self.buffered();
            match self.fill(stream) {
                Ok(0) if had == 0 => return Ok(None),
                Ok(0) => {
                    let eof = std::io::Error::from(std::io::ErrorKind::UnexpectedEof);
                    return Err(Error::io("reading frame length", eof));
                }
                Ok(_) => {}
                Err(e) if had == 0 => return Err(Error::io("reading frame", e)),
                Err(e) => return Err(Error::io("reading frame length", e)),
            }
        }
        let at = self.start;
        let len = frame_len(self.buf[at..at + 4].try_into().expect("4 bytes"))?;
        self.start += 4;
        let have = len.min(self.buffered());
        let mut body = Vec::with_capacity(len);
        body.extend_from_slice(&self.buf[self.start..self.start + have]);
        self.start += have;
        if have < len {
            body.resize(len, 0);
            stream
                .read_exact(&mut body[have..])
                .map_err(|e| Error::io("reading frame body", e))?;
        }
        Ok(Some(Frame::from_body(body)))
    }
}

/// The length a frame's first four bytes give, if it is allowed.
fn frame_len(prefix: [u8; 4]) -> Result<usize> {
    let len = u32::from_le_bytes(prefix) as usize;
    if !(HEADER..=MAX_FRAME).contains(&len) {
        return Err(Error::protocol(format!(
            "frame of {len} bytes (allowed {HEADER}..={MAX_FRAME})"
        )));
    }
    Ok(len)
}

impl Frame {
    /// The frame whose bytes after the length are `body` (at least `HEADER` long).
    fn from_body(mut body: Vec<u8>) -> Frame {
        let version = u16::from_le_bytes([body[0], body[1]]);
        let method = u16::from_le_bytes([body[2], body[3]]);
        let id = u64::from_le_bytes(body[4..12].try_into().expect("8 bytes"));
        body.drain(..HEADER);
        Frame {
            version,
            method,
            id,
            body,
        }
    }

    /// One whole frame, length first, and nothing after it (a mailbox message).
    fn parse(bytes: &[u8]) -> Result<Frame> {
        let prefix = bytes
            .get(..4)
            .ok_or_else(|| Error::protocol("a frame cut short"))?;
        let len = frame_len(prefix.try_into().expect("4 bytes"))?;
        if bytes.len() - 4 != len {
            return Err(Error::protocol(format!(
                "a frame of {len} bytes in a message of {}",
                bytes.len()
            )));
        }
        Ok(Frame::from_body(bytes[4..].to_vec()))
    }
}

/// How long a client polls for the master's answer before it blocks.
const CLIENT_SPIN: Duration = Duration::from_micros(100);
/// `SegmentEvents`: answered when the segment's catalog changes, not at once.
const LONG_POLL_METHOD: u16 = Method::SegmentEvents as u16;
/// Methods of the connection itself, answered here and never seen by the master,
/// numbered apart from the master's (`Method`). An offer of a same-host mailbox; its
/// answer is the offer encoded, or nothing.
const MAILBOX_OFFER: u16 = 0xff01;
/// No answer: sent once right after a client attached its mailbox, and whenever a
/// request waits there while the server reads its socket.
const MAILBOX_NUDGE: u16 = 0xff02;

/// Serves the master's RPC on `bind` until dropped.
pub fn serve(
    bind: SocketAddr,
    limits: ServerLimits,
    master: Arc<Master>,
    secret: Option<ClusterSecret>,
) -> std::io::Result<ConnServer> {
    let handler = Arc::new(move |s, ticket: &ConnTicket| serve_conn(s, ticket, &master));
    ConnServer::spawn(
        bind,
        "mc-master",
        limits,
        crate::auth::guard(secret, "master rpc", handler),
    )
}

fn serve_conn(stream: TcpStream, ticket: &ConnTicket, master: &Master) {
    let _ = stream.set_nodelay(true);
    let _ = stream.set_write_timeout(Some(IO_TIMEOUT));
    let mut conn = ServerConn::new(&stream, ticket, master);
    // A mailbox offered and not yet taken up (see `mailbox`).
    let mut offered = None;
    loop {
        let Some(frame) = conn.read_frame(true) else {
            return;
        };
        let reply = match frame.method {
            MAILBOX_NUDGE => match offered.take() {
                Some(taken) => return mailbox::serve(&mut conn, taken),
                // Nothing was offered: a confused client; nothing to answer.
                None => continue,
            },
            MAILBOX_OFFER => {
                offered = mailbox::offer(&mut conn.out, frame.id);
                Reply::Send
            }
            _ => {
                // The client did not take the mailbox up: its memfd is closed here.
                offered = None;
                conn.answer(frame)
            }
        };
        if !conn.send_answer(reply) {
            return;
        }
    }
}

/// What to do with an answer `ServerConn::answer` built.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Reply {
    Send,
    /// Send it, then close (the client speaks another protocol version).
    SendAndClose,
    /// Close without an answer (a request that did not decode).
    Close,
}

/// One master connection, between frames.
struct ServerConn<'a> {
    stream: &'a TcpStream,
    ticket: &'a ConnTicket,
    master: &'a Master,
    /// Unfinished puts count against the host a request came from (`quota::Payer`).
    peer_ip: Option<IpAddr>,
    peer: String,
    reader: TimedReader<'a>,
    frames: FrameReader,
    /// The answer being built, kept from frame to frame.
    out: Vec<u8>,
    spin: crate::sys::RequestSpin,
    answered: Instant,
}

impl<'a> ServerConn<'a> {
    fn new(stream: &'a TcpStream, ticket: &'a ConnTicket, master: &'a Master) -> Self {
        let peer_addr = stream.peer_addr().ok();
        ServerConn {
            stream,
            ticket,
            master,
            peer_ip: peer_addr.map(|a| a.ip()),
            peer: peer_addr.map(|a| a.to_string()).unwrap_or_default(),
            reader: TimedReader::new(stream, ticket),
            frames: FrameReader::new(),
            out: Vec::new(),
            spin: crate::sys::RequestSpin::default(),
            answered: Instant::now(),
        }
    }

    /// The next frame from the socket (polled for a while first when `poll`, as a
    /// request the client sends soon); None when the connection is over (the reason
    /// logged).
    fn read_frame(&mut self, poll: bool) -> Option<Frame> {
        let waited = poll && self.frames.buffered() == 0;
        if waited {
            // A client's next request often follows soon: catch it without sleeping.
            self.spin.poll(self.stream);
        } else if self.frames.buffered() > 0 {
            // Part of it came with the last one: its deadline runs from then.
            self.reader.frame_begun();
        }
        let read = self.frames.read_frame(&mut self.reader);
        self.reader.frame_done();
        if waited {
            // (A frame that came with the one before says nothing of the client's
            // pace: a touch pipelined ahead of a read, say.)
            self.came_back();
        }
        match read {
            Ok(f) => f,
            // A malformed frame is worth a warning; a peer that went away is not.
            Err(e) if e.code() == Code::Protocol => {
                crate::warn_limited!("master rpc {}: {e}; closing", self.peer);
                None
            }
            Err(e) => {
                log::debug!("master rpc {}: {e}; closing", self.peer);
                None
            }
        }
    }

    /// Notes that a request the connection waited for came in.
    fn came_back(&mut self) {
        self.spin.came_back_after(self.answered.elapsed());
    }

    /// Builds the answer to `frame` in `out`.
    fn answer(&mut self, frame: Frame) -> Reply {
        let Frame {
            version,
            method,
            id,
            body: payload,
        } = frame;
        if version != PROTOCOL_VERSION {
            answer_frame(&mut self.out, method, id, |_| {
                Err(Error::new(
                    Code::InvalidVersion,
                    format!("protocol version {version}, this master speaks {PROTOCOL_VERSION}"),
                ))
            });
            return Reply::SendAndClose;
        }
        // A lookup, a batch read's every first read of a key, is read with its keys
        // borrowed from the payload.
        if let Some(lookup) = Lookup::decode(method, &payload) {
            let Ok(lookup) = lookup.map_err(|e| {
                crate::warn_limited!("master rpc {}: method {method}: {e}; closing", self.peer)
            }) else {
                return Reply::Close;
            };
            self.ticket.prove();
            let master = self.master;
            answer_frame(&mut self.out, method, id, |w| {
                master.answer_lookup_into(&lookup, w)
            });
            return Reply::Send;
        }
        match Request::decode(method, &payload) {
            Err(e) => {
                crate::warn_limited!("master rpc {}: method {method}: {e}; closing", self.peer);
                Reply::Close
            }
            Ok(req) => {
                self.ticket.prove();
                let (master, peer_ip) = (self.master, self.peer_ip);
                answer_frame(&mut self.out, method, id, |w| {
                    master.answer_into(req, peer_ip, w)
                });
                Reply::Send
            }
        }
    }

    /// Writes `bytes` (an answer) to the socket; false when the connection is over.
    fn send(&self, bytes: &[u8]) -> bool {
        let mut stream = self.stream;
        stream.write_all(bytes).is_ok()
    }

    /// Sends the answer `reply` says on the socket; whether the connection goes on.
    fn send_answer(&mut self, reply: Reply) -> bool {
        if reply == Reply::Close || !self.send(&self.out) {
            return false;
        }
        self.sent();
        reply == Reply::Send
    }

    /// An answer went out: the next wait counts from now.
    fn sent(&mut self) {
        self.answered = Instant::now();
        if self.out.capacity() > KEPT_ANSWER_BUFFER {
            self.out = Vec::new();
        }
    }
}

/// The most an answer buffer keeps between frames (a batch of 64 descriptors takes
/// ~4 KiB): a master holds thousands of connections, and the rare large answer is
/// not held for a connection's life.
const KEPT_ANSWER_BUFFER: usize = 64 << 10;

/// Builds an answer frame in `out` (kept from frame to frame): the header, status 0
/// and what `body` writes; or, should `body` fail, the error's code and context.
fn answer_frame(
    out: &mut Vec<u8>,
    method: u16,
    id: u64,
    body: impl FnOnce(&mut Writer) -> Result<()>,
) {
    const STATUS_AT: usize = 4 + HEADER;
    let mut w = Writer::with_buffer(std::mem::take(out));
    w.u32(0)
        .raw(&PROTOCOL_VERSION.to_le_bytes())
        .raw(&method.to_le_bytes())
        .u64(id)
        .i32(0);
    let failed = body(&mut w).err();
    let mut bytes = w.into_bytes();
    if let Some(e) = failed {
        bytes.truncate(STATUS_AT + 4);
        bytes[STATUS_AT..].copy_from_slice(&(e.code() as i32).to_le_bytes());
        bytes.extend_from_slice(e.context().as_bytes());
    }
    let len = (bytes.len() - 4) as u32;
    bytes[..4].copy_from_slice(&len.to_le_bytes());
    *out = bytes;
}

/// Where the master is: a fixed address, or (Mooncake's `etcd://h:p;h:p` form) the
/// leader named in etcd's master view, looked up again whenever it stops answering.
enum MasterTarget {
    Fixed(SocketAddr),
    Elected {
        etcd: EtcdClient,
        cluster_id: String,
        /// The leader last read from etcd.
        leader: Mutex<Option<SocketAddr>>,
    },
}

fn resolve(addr: &str) -> Result<SocketAddr> {
    addr.to_socket_addrs()
        .map_err(|e| Error::new(Code::RpcFail, format!("master address {addr:?}: {e}")))?
        .next()
        .ok_or_else(|| {
            Error::new(
                Code::RpcFail,
                format!("master address {addr:?} resolves to nothing"),
            )
        })
}

impl MasterTarget {
    /// The master to talk to now; `fresh` asks etcd again instead of trusting the
    /// leader read last.
    fn current(&self, fresh: bool) -> Result<SocketAddr> {
        let (etcd, cluster_id, leader) = match self {
            MasterTarget::Fixed(a) => return Ok(*a),
            MasterTarget::Elected {
                etcd,
                cluster_id,
                leader,
            } => (etcd, cluster_id, leader),
        };
        let mut cached = leader.locked();
        if let (Some(a), false) = (*cached, fresh) {
            return Ok(a);
        }
        let view = ha::read_view(etcd, cluster_id)?.ok_or_else(|| {
            Error::new(
                Code::RpcFail,
                format!(
                    "no master leads cluster {cluster_id:?} (etcd {} has no {})",
                    etcd.describe(),
                    ha::view_key(cluster_id)
                ),
            )
        })?;
        let a = resolve(&view.address)?;
        *cached = Some(a);
        Ok(a)
    }
}

/// The environment variable with how long (milliseconds) read-only calls wait out a
/// master that is restarting or failing over; 0: not at all.
pub const MASTER_WAIT_ENV: &str = "MC_STORE_MASTER_WAIT_MS";

fn master_wait() -> Duration {
    let ms = std::env::var(MASTER_WAIT_ENV)
        .ok()
        .and_then(|v| v.trim().parse::<u64>().ok())
        .unwrap_or(5000);
    Duration::from_millis(ms)
}

/// A transport failure talking to the master at `addr`, as RPC codes.
fn rpc_error(addr: SocketAddr, e: Error) -> Error {
    match e.code() {
        Code::Timeout => Error::new(Code::RpcTimeout, format!("master {addr}: {}", e.context())),
        _ => Error::new(Code::RpcFail, format!("master {addr}: {e}")),
    }
}

/// A client of the master's RPC: a pool of persistent connections, one per concurrent
/// caller, so calls from many threads never queue behind each other.
pub struct RpcClient {
    target: MasterTarget,
    pool: Mutex<Vec<Conn>>,
    /// Whether new connections ask for a mailbox (see `mailbox`): off by the
    /// environment.
    mailbox_wanted: AtomicBool,
    /// The master that last closed a connection asking for one, and when: it is not
    /// asked again for `ASK_AGAIN_AFTER` (one from before mailboxes does that; so
    /// may one shutting down, or one dropping a connection it has no room for).
    mailbox_refused: Mutex<Option<(SocketAddr, Instant)>>,
    next_id: AtomicU64,
    secret: Option<ClusterSecret>,
    /// How long read-only calls wait out a master away (`call_after`).
    patience: Duration,
    /// When calls began failing because the master is away; `None` while it answers.
    away_since: Mutex<Option<Instant>>,
}

impl RpcClient {
    /// A client for the master at `addr`: `host:port`, or `etcd://h:p[;h:p]` to follow
    /// the elected leader of the cluster named by `MC_STORE_CLUSTER_ID` (default
    /// `mooncake_cluster`) as Mooncake's clients do.
    /// With a secret, each connection authenticates before its first request.
    pub fn new(addr: &str, secret: Option<ClusterSecret>) -> Result<RpcClient> {
        let target = match addr.trim().strip_prefix("etcd://") {
            Some(endpoints) => MasterTarget::Elected {
                etcd: EtcdClient::new(endpoints)?,
                cluster_id: ha::cluster_id(None),
                leader: Mutex::new(None),
            },
            None => MasterTarget::Fixed(resolve(addr)?),
        };
        Ok(RpcClient {
            target,
            pool: Mutex::new(Vec::new()),
            mailbox_wanted: AtomicBool::new(mailbox::wanted()),
            mailbox_refused: Mutex::new(None),
            next_id: AtomicU64::new(1),
            secret,
            patience: master_wait(),
            away_since: Mutex::new(None),
        })
    }

    /// The master's address (for an elected master, the leader as last looked up).
    pub fn addr(&self) -> Result<SocketAddr> {
        self.target.current(false)
    }

    fn connect(&self) -> Result<Conn> {
        let addr = self.target.current(false)?;
        match self.open(addr) {
            Err(e) if matches!(self.target, MasterTarget::Elected { .. }) => {
                // The leader we knew is gone: ask etcd who leads now.
                let now = self.target.current(true)?;
                if now == addr {
                    return Err(e);
                }
                log::info!("master moved from {addr} to {now}");
                self.pool.locked().clear();
                self.open(now)
            }
            other => other,
        }
    }

    /// A new connection to `addr`, with a mailbox when the master is on this host.
    fn open(&self, addr: SocketAddr) -> Result<Conn> {
        let mut stream = self.connect_to(addr)?;
        let refused = *self.mailbox_refused.locked();
        let refused_here =
            refused.is_some_and(|(a, at)| a == addr && at.elapsed() < ASK_AGAIN_AFTER);
        if !self.mailbox_wanted.load(Ordering::Relaxed) || refused_here {
            return Ok(Conn::plain(addr, stream));
        }
        let e = match self.ask_for_mailbox(addr, &mut stream) {
            Ok(Asked::Answered(mailbox)) => {
                return Ok(Conn {
                    addr,
                    stream,
                    mailbox,
                })
            }
            Ok(Asked::Closed) => {
                *self.mailbox_refused.locked() = Some((addr, Instant::now()));
                "it closed the connection".to_string()
            }
            Err(e) => e.to_string(),
        };
        log::debug!("master {addr}: no mailbox ({e}); this connection uses TCP");
        Ok(Conn::plain(addr, self.connect_to(addr)?))
    }

    /// Asks the master for a mailbox and takes it up if it is on this host.
    fn ask_for_mailbox(&self, addr: SocketAddr, stream: &mut TcpStream) -> Result<Asked> {
        let id = self.next_id.fetch_add(1, Ordering::Relaxed);
        stream
            .write_all(&request_frame(MAILBOX_OFFER, id, &[]))
            .map_err(|e| rpc_error(addr, Error::io("asking for a mailbox", e)))?;
        let mut frames = FrameReader::with_capacity(ANSWER_READ_AHEAD);
        crate::sys::spin_until_readable(stream, CLIENT_SPIN);
        let Some(frame) = frames.read_frame(stream).map_err(|e| rpc_error(addr, e))? else {
            return Ok(Asked::Closed);
        };
        let taken = match Self::answer_payload(&frame, MAILBOX_OFFER, id)? {
            Ok(payload) => {
                mailbox::ClientMailbox::attach(payload, stream).map_err(|e| rpc_error(addr, e))?
            }
            Err(_) => None,
        };
        Ok(Asked::Answered(taken))
    }

    fn connect_to(&self, addr: SocketAddr) -> Result<TcpStream> {
        let secret = self.secret.as_ref();
        let s = crate::auth::connect(&addr, Duration::from_secs(5), secret)
            .map_err(|e| Error::new(Code::RpcFail, format!("connecting to master {addr}: {e}")))?;
        let _ = s.set_nodelay(true);
        let _ = s.set_read_timeout(Some(IO_TIMEOUT));
        let _ = s.set_write_timeout(Some(IO_TIMEOUT));
        Ok(s)
    }

    /// A pooled connection still open (the master closes idle ones) to the current
    /// master, if any.
    fn pooled(&self) -> Option<Conn> {
        let current = self.target.current(false).ok()?;
        let mut pool = self.pool.locked();
        while let Some(c) = pool.pop() {
            if c.addr == current && !crate::sys::idle_connection_closed(&c.stream) {
                return Some(c);
            }
        }
        None
    }

    fn keep(&self, conn: Conn) {
        self.pool.locked().push(conn);
    }

    /// One request and its response. A pooled connection the master closed while
    /// idle is never used; read-only requests are also retried once on a fresh
    /// connection when a pooled one dies during the call (for an elected master, to
    /// whoever leads by then).
    pub fn call(&self, req: &Request) -> Result<Response> {
        self.call_after(None, req)
    }

    /// `call(req)`, with `before` (when given) pipelined ahead of it on the same
    /// connection in the same write: one round trip for both. `before`'s answer is
    /// only logged; a failure of it does not fail `req`.
    ///
    /// A read-only request also waits out a master that is restarting or failing over:
    /// while the master cannot be reached, or answers that it just started and nodes
    /// are still remounting (`UnavailableInCurrentStatus`), it is sent again with
    /// backoff, within one window of patience (`MC_STORE_MASTER_WAIT_MS`, default 5000)
    /// counted from the first failure. Once a window ran out, calls fail at their first
    /// failure until one gets through again, so a master that is gone does not make
    /// every call wait.
    pub fn call_after(&self, before: Option<&Request>, req: &Request) -> Result<Response> {
        self.call_meanwhile(before, req.method(), &req.payload(), &mut || {})
    }

    /// As `call_after`, the request given as its method and encoded payload (a batch
    /// read's lookup, say, written straight from its keys), running `meanwhile` once
    /// while the master works: as soon as the request has left (or, when it has not,
    /// before waiting out an absent master, or before this returns). Work that does
    /// not need the answer is done then rather than after it came.
    pub fn call_meanwhile(
        &self,
        before: Option<&Request>,
        method: u16,
        payload: &[u8],
        meanwhile: &mut dyn FnMut(),
    ) -> Result<Response> {
        let mut once = Some(meanwhile);
        let mut run_once = || {
            if let Some(f) = once.take() {
                f();
            }
        };
        let answer = self.call_retrying(before, method, payload, &mut run_once);
        run_once();
        answer
    }

    /// `call_meanwhile`'s request, sent again while a read-only one finds the master
    /// away (see `call_after`).
    fn call_retrying(
        &self,
        before: Option<&Request>,
        method: u16,
        payload: &[u8],
        meanwhile: &mut dyn FnMut(),
    ) -> Result<Response> {
        let read_only = matches!(
            Method::from_wire(method),
            Some(
                Method::Ping
                    | Method::GetReplicas
                    | Method::GetReplicasKeepable
                    | Method::Exists
                    | Method::Describe
                    | Method::Stats
                    | Method::MetadataUrl
            )
        );
        let mut backoff = Duration::from_millis(5);
        loop {
            let result = self.attempt(before, method, payload, read_only, meanwhile);
            let master_away = matches!(
                &result,
                Err(e) if matches!(e.code(), Code::RpcFail | Code::UnavailableInCurrentStatus)
            );
            if !master_away {
                // The master answered: the next absence gets a whole window again.
                *self.away_since.locked() = None;
                return result;
            }
            if !read_only {
                return result;
            }
            let Some(left) = self.patience_left() else {
                return result;
            };
            // Nothing waits on the master while it is away.
            meanwhile();
            std::thread::sleep(backoff.min(left));
            backoff = (backoff * 2).min(Duration::from_millis(200));
        }
    }

    /// A read-only request tried once, never waiting for an absent master: for health
    /// checks, which must say at once that it is away.
    pub fn call_now(&self, req: &Request) -> Result<Response> {
        self.attempt(None, req.method(), &req.payload(), true, &mut || {})
    }

    /// What is left of the patience window opened by the first failure since the last
    /// call that got through (opening it now if none is open); `None` once it ran out.
    fn patience_left(&self) -> Option<Duration> {
        let now = Instant::now();
        let since = *self.away_since.locked().get_or_insert(now);
        Some(self.patience.saturating_sub(now - since)).filter(|left| !left.is_zero())
    }

    /// One try of `call_after`: a pooled connection, or a new one; a read-only
    /// request found its pooled connection dead is sent once more on a new one.
    fn attempt(
        &self,
        before: Option<&Request>,
        method: u16,
        bytes: &[u8],
        read_only: bool,
        meanwhile: &mut dyn FnMut(),
    ) -> Result<Response> {
        let before = before.map(|r| (r.method(), r.payload()));
        let before = before.as_ref().map(|(m, b)| (*m, b.as_slice()));
        let pooled = self.pooled();
        let fresh = pooled.is_none();
        let mut conn = match pooled {
            Some(c) => c,
            None => self.connect()?,
        };
        match self.exchange(&mut conn, before, method, bytes, meanwhile) {
            Ok(resp) => {
                self.keep(conn);
                resp
            }
            Err(e) if !fresh && read_only => {
                log::debug!("master connection went stale ({e}); reconnecting");
                let mut conn = self.connect()?;
                let resp = self.exchange(&mut conn, before, method, bytes, meanwhile)?;
                self.keep(conn);
                resp
            }
            Err(e) => {
                if let MasterTarget::Elected { leader, .. } = &self.target {
                    // Look the leader up again next time.
                    *leader.locked() = None;
                }
                Err(e)
            }
        }
    }

    /// Sends and receives on one connection (`before`, a request whose answer is only
    /// logged, goes first in the same write): through its mailbox when it has one and
    /// the request fits, else on the socket; `meanwhile` runs once the request is sent.
    /// The outer error means the connection is unusable; the inner result is the
    /// master's answer.
    fn exchange(
        &self,
        conn: &mut Conn,
        before: Option<(u16, &[u8])>,
        method: u16,
        payload: &[u8],
        meanwhile: &mut dyn FnMut(),
    ) -> Result<Result<Response>> {
        let addr = conn.addr;
        let rpc = |e: Error| rpc_error(addr, e);
        let id = self.next_id.fetch_add(1, Ordering::Relaxed);
        let frame = request_frame(method, id, payload);
        let by_mailbox = before.is_none()
            && method != LONG_POLL_METHOD
            && crate::mailbox::Mailbox::fits(frame.len());
        let answers = || FrameReader::with_capacity(ANSWER_READ_AHEAD);
        if let (Some(mb), true) = (&mut conn.mailbox, by_mailbox) {
            return match mb.exchange(&conn.stream, &frame, meanwhile).map_err(rpc)? {
                mailbox::Delivered::Here(f) => Self::decoded(&f, method, id),
                mailbox::Delivered::OnSocket => {
                    Self::answer(addr, &mut conn.stream, &mut answers(), method, id)
                }
            };
        }
        let mut frames = answers();
        let mut out = Vec::new();
        let before = before.map(|(m, p)| {
            let id = self.next_id.fetch_add(1, Ordering::Relaxed);
            out.extend_from_slice(&request_frame(m, id, p));
            (m, id)
        });
        out.extend_from_slice(&frame);
        if let Some(mb) = &conn.mailbox {
            mb.announce_socket_frames(1 + u32::from(before.is_some()));
        }
        let stream = &mut conn.stream;
        stream
            .write_all(&out)
            .map_err(|e| rpc(Error::io("sending request", e)))?;
        meanwhile();
        // The answers come in order and nothing else comes: once the last is read, the
        // connection goes back to the pool with nothing buffered.
        if let Some((m, id)) = before {
            if let Err(e) = Self::answer(addr, stream, &mut frames, m, id)? {
                log::debug!("master {addr}: request {m} ahead of {method}: {e}");
            }
        }
        let answer = Self::answer(addr, stream, &mut frames, method, id)?;
        if frames.buffered() > 0 {
            return Err(Error::protocol(format!(
                "master {addr} sent {} bytes nobody asked for",
                frames.buffered()
            )));
        }
        Ok(answer)
    }

    /// Reads the answer to request `id` of `method` from the socket (as `exchange`).
    fn answer(
        addr: SocketAddr,
        stream: &mut TcpStream,
        frames: &mut FrameReader,
        method: u16,
        id: u64,
    ) -> Result<Result<Response>> {
        let frame = Self::read_answer(addr, stream, frames, method)?;
        Self::decoded(&frame, method, id)
    }

    /// The next answer frame on the socket.
    fn read_answer(
        addr: SocketAddr,
        stream: &mut TcpStream,
        frames: &mut FrameReader,
        method: u16,
    ) -> Result<Frame> {
        // Most answers come within tens of microseconds: wait for them awake. Not a
        // catalog poll's, which the master holds until something changes.
        if method != LONG_POLL_METHOD && frames.buffered() == 0 {
            crate::sys::spin_until_readable(stream, CLIENT_SPIN);
        }
        frames
            .read_frame(stream)
            .map_err(|e| rpc_error(addr, e))?
            .ok_or_else(|| {
                Error::new(
                    Code::RpcFail,
                    format!("master {addr} closed the connection"),
                )
            })
    }

    /// The response answer `frame` carries for request `id` of `method` (as
    /// `exchange`).
    fn decoded(frame: &Frame, method: u16, id: u64) -> Result<Result<Response>> {
        Ok(Self::answer_payload(frame, method, id)?
            .and_then(|payload| Response::decode(method, payload)))
    }

    /// The payload of answer `frame` to request `id` of `method`, or the master's
    /// error; the outer error: it answered something else.
    fn answer_payload(frame: &Frame, method: u16, id: u64) -> Result<Result<&[u8]>> {
        let Frame {
            version,
            method: got_method,
            id: got_id,
            body,
        } = frame;
        if *got_method != method || *got_id != id || body.len() < 4 {
            return Err(Error::protocol(format!(
                "master answered {got_method}/{got_id} to {method}/{id}"
            )));
        }
        let status = i32::from_le_bytes(body[..4].try_into().expect("4 bytes"));
        let rest = &body[4..];
        if *version != PROTOCOL_VERSION || status != 0 {
            let code = Code::from_i32(status).unwrap_or(Code::RpcFail);
            return Ok(Err(Error::new(
                code,
                String::from_utf8_lossy(rest).into_owned(),
            )));
        }
        Ok(Ok(rest))
    }
}

/// How long a client goes on over TCP to a master that closed a connection asking
/// for a mailbox.
const ASK_AGAIN_AFTER: Duration = Duration::from_secs(60);

/// How a master met a request for a mailbox.
enum Asked {
    /// With a mailbox this process took up, or none to take.
    Answered(Option<mailbox::ClientMailbox>),
    /// By closing the connection: it predates mailboxes.
    Closed,
}

/// A pooled connection to the master.
struct Conn {
    addr: SocketAddr,
    stream: TcpStream,
    /// Its mailbox, when the master is on this host.
    mailbox: Option<mailbox::ClientMailbox>,
}

impl Conn {
    fn plain(addr: SocketAddr, stream: TcpStream) -> Conn {
        Conn {
            addr,
            stream,
            mailbox: None,
        }
    }
}

#[cfg(test)]
mod tests {
    use std::net::TcpListener;

    use super::*;
    use crate::master::MasterConfig;
    use crate::protocol::{ReplicateConfig, SegmentInfo};

    /// A reader handing out at most `step` bytes a call, as a socket may.
    struct Trickle<'a> {
        bytes: &'a [u8],
        step: usize,
        reads: usize,
    }

    impl Read for Trickle<'_> {
        fn read(&mut self, buf: &mut [u8]) -> std::io::Result<usize> {
            self.reads += 1;
            let n = buf.len().min(self.step).min(self.bytes.len());
            buf[..n].copy_from_slice(&self.bytes[..n]);
            self.bytes = &self.bytes[n..];
            Ok(n)
        }
    }

    #[test]
    fn frames_are_read_whole_however_the_bytes_arrive() {
        let big = vec![7u8; 3 * READ_AHEAD];
        let mut stream = request_frame(4, 1, b"first");
        let mut answer = Vec::new();
        answer_frame(&mut answer, 5, 2, |w| {
            w.raw(&big);
            Ok(())
        });
        stream.extend(answer);
        stream.extend(request_frame(6, 3, b""));
        for step in [1, 5, 13, READ_AHEAD, usize::MAX] {
            let mut src = Trickle {
                bytes: &stream,
                step,
                reads: 0,
            };
            let mut frames = FrameReader::new();
            let a = frames.read_frame(&mut src).unwrap().unwrap();
            assert_eq!((a.method, a.id, &a.body[..]), (4, 1, &b"first"[..]));
            let b = frames.read_frame(&mut src).unwrap().unwrap();
            assert_eq!((b.method, b.id, b.body.len()), (5, 2, 4 + big.len()));
            assert!(b.body[4..].iter().all(|&x| x == 7), "step {step}");
            let c = frames.read_frame(&mut src).unwrap().unwrap();
            assert_eq!((c.method, c.id, c.body.len()), (6, 3, 0));
            assert!(frames.read_frame(&mut src).unwrap().is_none(), "clean end");
            if step == usize::MAX {
                // Whole: the small frames cost no read of their own.
                assert!(src.reads <= 4, "{} reads", src.reads);
            }
        }
    }

    #[test]
    fn a_failed_answer_carries_its_code_and_context_and_nothing_it_began() {
        let mut out = vec![9; 100];
        answer_frame(&mut out, 7, 11, |w| {
            w.raw(b"half an answer");
            Err(Error::new(Code::ObjectNotFound, "gone"))
        });
        let f = FrameReader::new()
            .read_frame(&mut &out[..])
            .unwrap()
            .unwrap();
        assert_eq!((f.version, f.method, f.id), (PROTOCOL_VERSION, 7, 11));
        let status = i32::from_le_bytes(f.body[..4].try_into().unwrap());
        assert_eq!(
            (status, &f.body[4..]),
            (Code::ObjectNotFound as i32, &b"gone"[..])
        );
    }

    #[test]
    fn a_cut_or_oversized_frame_is_an_error_not_a_clean_end() {
        let whole = request_frame(4, 1, b"payload");
        for cut in [1, 3, 4, 10, whole.len() - 1] {
            let mut frames = FrameReader::new();
            let got = frames.read_frame(&mut &whole[..cut]);
            assert!(got.is_err(), "cut at {cut}: {:?}", got.map(|f| f.is_some()));
        }
        let mut huge = ((MAX_FRAME + 1) as u32).to_le_bytes().to_vec();
        huge.extend_from_slice(&[0; 12]);
        let e = FrameReader::new().read_frame(&mut &huge[..]).unwrap_err();
        assert_eq!(e.code(), Code::Protocol);
    }

    /// A client of a port nothing listens on (bound and released), patient for 30 ms,
    /// and the port.
    fn client_of_nobody() -> (RpcClient, u16) {
        let port = TcpListener::bind("127.0.0.1:0")
            .unwrap()
            .local_addr()
            .unwrap()
            .port();
        let mut c = RpcClient::new(&format!("127.0.0.1:{port}"), None).unwrap();
        c.patience = Duration::from_millis(30);
        (c, port)
    }

    #[test]
    fn reads_wait_out_an_absent_master_once_then_fail_at_once_until_it_answers() {
        let (mut c, port) = client_of_nobody();
        let exists = Request::Exists {
            keys: vec!["k".into()],
        };
        assert_eq!(c.call(&exists).unwrap_err().code(), Code::RpcFail);
        assert!(c.away_since.locked().is_some(), "the window was opened");
        assert!(c.patience_left().is_none(), "and has run out");
        // Writes never wait: they may have been applied.
        c.patience = Duration::from_secs(3600);
        *c.away_since.locked() = None;
        let unmount = Request::Unmount {
            client: 1,
            name: "n".into(),
        };
        assert_eq!(c.call(&unmount).unwrap_err().code(), Code::RpcFail);
        assert!(c.away_since.locked().is_none(), "a write opens no window");
        // Nor does a failed write close one (a node's catalog poller fails every
        // 200 ms while the master is away: it must not keep readers waiting forever).
        let opened = Instant::now();
        *c.away_since.locked() = Some(opened);
        assert_eq!(c.call(&unmount).unwrap_err().code(), Code::RpcFail);
        assert_eq!(*c.away_since.locked(), Some(opened));
        // Once a master answers, the next absence gets a whole window again.
        let master = Arc::new(Master::new(MasterConfig::default()));
        let bind = format!("127.0.0.1:{port}").parse().unwrap();
        let _server = serve(bind, ServerLimits::default(), master, None).unwrap();
        c.patience = Duration::ZERO;
        *c.away_since.locked() = Some(Instant::now());
        assert!(c.call(&exists).is_ok());
        assert!(c.away_since.locked().is_none());
    }

    #[test]
    fn meanwhile_runs_once_whether_the_request_leaves_or_not() {
        let lookup = |keys: &[&str]| {
            let mut w = Writer::new();
            Lookup::encode(keys, &mut w);
            w.into_bytes()
        };
        let method = Lookup::method(false);
        // Nothing listens: the request never leaves, and `meanwhile` still runs, once.
        let (away, _) = client_of_nobody();
        let mut ran = 0;
        let answer = away.call_meanwhile(None, method, &lookup(&["k"]), &mut || ran += 1);
        assert_eq!((answer.unwrap_err().code(), ran), (Code::RpcFail, 1));
        // A master on this host (its mailbox) and one answering on the socket alone: the
        // request has left when `meanwhile` runs, and the answer is the one asked for.
        let master = Arc::new(Master::new(MasterConfig::default()));
        let bind = "127.0.0.1:0".parse().unwrap();
        let server = serve(bind, ServerLimits::default(), master, None).unwrap();
        for mailbox in [true, false] {
            let client = RpcClient::new(&server.local_addr().to_string(), None).unwrap();
            assert!(client.call(&Request::Stats).is_ok());
            if !mailbox {
                client
                    .pool
                    .locked()
                    .iter_mut()
                    .for_each(|c| c.mailbox = None);
            }
            let mut ran = 0;
            let answer =
                client.call_meanwhile(None, method, &lookup(&["a", "b"]), &mut || ran += 1);
            let Ok(Response::GetReplicas(descs)) = answer else {
                panic!("{answer:?}");
            };
            assert_eq!(descs, vec![Err(Code::ObjectNotFound); 2]);
            assert_eq!(ran, 1, "mailbox {mailbox}");
        }
    }

    #[test]
    fn a_same_host_client_talks_through_the_mailbox_and_big_frames_take_the_socket() {
        let master = Arc::new(Master::new(MasterConfig::default()));
        let bind = "127.0.0.1:0".parse().unwrap();
        let server = serve(bind, ServerLimits::default(), master, None).unwrap();
        let client = RpcClient::new(&server.local_addr().to_string(), None).unwrap();
        // Mounts are never sent twice, so one that succeeds went through the
        // connection it started on.
        let mount = |client: u64, name: &str| Request::Mount {
            client,
            segment: SegmentInfo {
                name: name.into(),
                base: client << 40,
                size: 1 << 30,
            },
        };
        let local = |c: &RpcClient| c.pool.locked()[0].stream.local_addr().unwrap();
        assert!(matches!(client.call(&mount(7, "s")), Ok(Response::Done)));
        let has_mailbox = |c: &RpcClient| c.pool.locked().iter().all(|c| c.mailbox.is_some());
        assert!(has_mailbox(&client), "the master is on this host");
        // A request that fits and an answer that does not (2,000 placements).
        let keys: Vec<String> = (0..2000).map(|i| format!("key-{i:05}")).collect();
        let put = Request::PutStart {
            client: 7,
            items: keys.iter().map(|k| (k.clone(), 4096)).collect(),
            config: ReplicateConfig::default(),
            upsert: false,
        };
        let answer = client.call(&put).unwrap();
        let (mut w, mut r) = (Writer::new(), Writer::new());
        answer.encode(&mut w);
        put.encode(&mut r);
        assert!(w.len() > crate::mailbox::CAPACITY && r.len() < crate::mailbox::CAPACITY);
        let Response::PutStart(placed) = answer else {
            panic!("no placements");
        };
        assert_eq!(placed.len(), keys.len());
        assert!(placed
            .iter()
            .all(|p| p.as_ref().is_ok_and(|r| r.len() == 1)));
        // A request that does not fit (its answer does).
        let mut many = keys.clone();
        many.extend((0..6000).map(|i| format!("absent-key-{i:08}")));
        let exists = Request::Exists { keys: many };
        let Ok(Response::Exists(found)) = client.call(&exists) else {
            panic!("no answer");
        };
        assert_eq!(found.len(), 8000);
        assert!(found.iter().all(|f| *f == Ok(false)), "none complete yet");
        let mut r = Writer::new();
        exists.encode(&mut r);
        assert!(r.len() > crate::mailbox::CAPACITY);
        // A pipelined pair, and the mailbox again after the socket.
        let ping = Request::Ping { client: 7 };
        assert!(client.call_after(Some(&ping), &ping).is_ok());
        assert!(client.call(&ping).is_ok());
        assert_eq!(client.pool.locked().len(), 1, "one connection did it all");
        assert!(has_mailbox(&client));
        // Once the master's side of it goes back to its socket, a request nudges it.
        let before = local(&client);
        let on_socket = || {
            let pool = client.pool.locked();
            pool[0]
                .mailbox
                .as_ref()
                .is_some_and(|m| m.master_on_socket())
        };
        // Bounded: the connection goes to its socket after `SOCKET_AFTER` quiet.
        let waited = (0..200).any(|_| {
            std::thread::sleep(Duration::from_millis(10));
            on_socket()
        });
        assert!(waited, "the master's side never went to its socket");
        // (Without the nudge it would wait out the whole I/O timeout and fail.)
        assert!(matches!(client.call(&mount(8, "s8")), Ok(Response::Done)));
        assert_eq!(client.pool.locked().len(), 1);
        assert_eq!(local(&client), before, "the same connection");
        // A connection whose first request went on the socket still has the master
        // at its mailbox for the next (it was told of the mailbox at once).
        let fresh = RpcClient::new(&server.local_addr().to_string(), None).unwrap();
        assert!(fresh.call_after(Some(&ping), &ping).is_ok());
        assert!(has_mailbox(&fresh));
        let before = local(&fresh);
        assert!(matches!(fresh.call(&mount(9, "s9")), Ok(Response::Done)));
        assert_eq!(fresh.pool.locked().len(), 1);
        assert_eq!(local(&fresh), before, "the same connection");
        // Switched off, the same calls go on TCP.
        let tcp = RpcClient::new(&server.local_addr().to_string(), None).unwrap();
        tcp.mailbox_wanted.store(false, Ordering::Relaxed);
        assert!(matches!(tcp.call(&exists), Ok(Response::Exists(f)) if f.len() == 8000));
        assert!(tcp.pool.locked().iter().all(|c| c.mailbox.is_none()));
        // The server's shutdown ends its connection threads, parked on mailboxes or
        // not (it joins them: a thread that never noticed would hang this test).
        drop(server);
        let e = client.call(&mount(10, "s10")).unwrap_err();
        assert_eq!(e.code(), Code::RpcFail, "{e}");
    }

    /// A fake master's next connection, its reader and the first frame on it.
    fn accept_with_frame(listener: &TcpListener) -> (TcpStream, FrameReader, Frame) {
        let (mut s, _) = listener.accept().unwrap();
        let mut frames = FrameReader::new();
        let first = frames.read_frame(&mut s).unwrap().unwrap();
        (s, frames, first)
    }

    #[test]
    fn a_master_that_closes_when_asked_for_a_mailbox_is_served_over_tcp() {
        // A fake master from before mailboxes: closes the connection that asks, then
        // answers one request on the next.
        let listener = TcpListener::bind("127.0.0.1:0").unwrap();
        let addr = listener.local_addr().unwrap();
        let fake = std::thread::spawn(move || {
            let (s, _, asked) = accept_with_frame(&listener);
            assert_eq!(asked.method, MAILBOX_OFFER);
            drop(s);
            let (mut s, _, req) = accept_with_frame(&listener);
            assert_eq!(req.method, Method::Unmount as u16);
            let mut out = Vec::new();
            answer_frame(&mut out, req.method, req.id, |_| Ok(()));
            s.write_all(&out).unwrap();
        });
        let client = RpcClient::new(&addr.to_string(), None).unwrap();
        let unmount = Request::Unmount {
            client: 1,
            name: "n".into(),
        };
        assert!(matches!(client.call(&unmount), Ok(Response::Done)));
        assert!(client.pool.locked().iter().all(|c| c.mailbox.is_none()));
        let refused = *client.mailbox_refused.locked();
        assert_eq!(
            refused.map(|(a, _)| a),
            Some(addr),
            "not asked again for a while"
        );
        fake.join().unwrap();
    }

    #[test]
    fn a_master_gone_while_a_mailbox_request_waits_fails_the_call() {
        // A fake master: offers a real mailbox, takes the nudge and closes.
        let listener = TcpListener::bind("127.0.0.1:0").unwrap();
        let addr = listener.local_addr().unwrap();
        let fake = std::thread::spawn(move || {
            let (mut s, mut frames, offer) = accept_with_frame(&listener);
            assert_eq!(offer.method, MAILBOX_OFFER);
            let mut out = Vec::new();
            let mailbox = mailbox::offer(&mut out, offer.id).unwrap();
            s.write_all(&out).unwrap();
            let nudge = frames.read_frame(&mut s).unwrap().unwrap();
            assert_eq!(nudge.method, MAILBOX_NUDGE);
            drop(mailbox);
        });
        let client = RpcClient::new(&addr.to_string(), None).unwrap();
        let unmount = Request::Unmount {
            client: 1,
            name: "n".into(),
        };
        let e = client.call(&unmount).unwrap_err();
        assert_eq!(e.code(), Code::RpcFail, "{e}");
        fake.join().unwrap();
    }

    #[test]
    fn a_pooled_connection_closed_while_idle_is_replaced_not_failed() {
        let master = Arc::new(Master::new(MasterConfig::default()));
        let bind = "127.0.0.1:0".parse().unwrap();
        let server = serve(bind, ServerLimits::default(), master, None).unwrap();
        let client = RpcClient::new(&server.local_addr().to_string(), None).unwrap();
        // A pooled connection whose far end went away while it sat idle (as a master
        // closing idle connections does).
        let other = TcpListener::bind("127.0.0.1:0").unwrap();
        let stale = TcpStream::connect(other.local_addr().unwrap()).unwrap();
        drop(other.accept().unwrap());
        client
            .pool
            .lock()
            .unwrap()
            .push(Conn::plain(server.local_addr(), stale));
        // Mount is not retried after a failure mid-call, so only skipping the dead
        // connection lets it succeed.
        let mount = Request::Mount {
            client: 7,
            segment: SegmentInfo {
                name: "s".into(),
                base: 1 << 40,
                size: 64 << 20,
            },
        };
        assert!(matches!(client.call(&mount), Ok(Response::Done)));
    }
}
