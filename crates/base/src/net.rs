//! A thread-per-connection TCP server with a clean shutdown: the accept loop (woken
//! through an eventfd) and every connection thread are stopped and joined when the
//! server is dropped. The RPC servers, the TCP transport and HTTP all run on it.
//!
//! A thread per connection is affordable only because connections are capped
//! ([`ServerLimits`]): per port, and per peer address so one remote host cannot take
//! the whole port. A connection over a cap is closed at once, unless room can be made
//! by closing a connection that is not *proven*. A handler proves its connection
//! ([`ConnTicket::prove`]) once the peer sent a valid request; until then the peer
//! may be anyone. Proven connections are never closed for a newcomer, so a flood of
//! connections (all loopback peers share 127.0.0.1, so the per-peer cap alone cannot
//! tell a flood from a neighbour) only ever displaces itself: the oldest unproven
//! connection goes first, and the peers already served keep being served.
//!
//! Handlers read with [`TimedReader`]: a proven peer may sit idle between requests
//! for `idle_timeout` (generous: clients pool connections), a peer that has not
//! spoken yet or stopped in the middle of a frame only for `frame_timeout`.

#![forbid(unsafe_code)]

use crate::util::sync::Unpoisoned;
use std::collections::HashMap;
use std::io::{self, Read};
use std::net::{IpAddr, Shutdown, SocketAddr, TcpListener, TcpStream, UdpSocket};
use std::os::fd::AsRawFd;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex, MutexGuard};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use crate::sys::EventFd;

/// Caps and timeouts of one listening port. [`ServerLimits::from_env`] reads
/// overrides from `MC_MAX_CONNECTIONS`, `MC_MAX_CONNECTIONS_PER_PEER`,
/// `MC_IDLE_TIMEOUT_SECS` and `MC_FRAME_TIMEOUT_SECS`.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct ServerLimits {
    /// Connections served at once on the port.
    pub max_conns: usize,
    /// Connections served at once from one peer IP address.
    pub max_per_peer: usize,
    /// How long a proven connection may stay silent between requests.
    pub idle_timeout: Duration,
    /// How long a frame may take to arrive once its first byte did, and how long a
    /// new connection may take to start its first request.
    pub frame_timeout: Duration,
}

impl Default for ServerLimits {
    fn default() -> Self {
        ServerLimits {
            max_conns: 2048,
            max_per_peer: 512,
            idle_timeout: Duration::from_secs(600),
            frame_timeout: Duration::from_secs(10),
        }
    }
}

impl ServerLimits {
    /// The defaults with the `MC_*` overrides of this process's environment applied
    /// (an unparsable or zero value is reported and ignored).
    pub fn from_env() -> ServerLimits {
        let d = ServerLimits::default();
        let secs = |name, default: Duration| env_number(name).map_or(default, Duration::from_secs);
        ServerLimits {
            max_conns: env_number("MC_MAX_CONNECTIONS").map_or(d.max_conns, |n| n as usize),
            max_per_peer: env_number("MC_MAX_CONNECTIONS_PER_PEER")
                .map_or(d.max_per_peer, |n| n as usize),
            idle_timeout: secs("MC_IDLE_TIMEOUT_SECS", d.idle_timeout),
            frame_timeout: secs("MC_FRAME_TIMEOUT_SECS", d.frame_timeout),
        }
    }
}

fn env_number(name: &str) -> Option<u64> {
    let raw = std::env::var(name).ok()?;
    match raw.trim().parse::<u64>() {
        Ok(n) if n > 0 => Some(n),
        _ => {
            log::warn!("ignoring {name}={raw:?}: expected a positive whole number");
            None
        }
    }
}

/// Serves one accepted connection; the ticket carries the server's limits and lets
/// the handler prove the connection.
pub type ConnHandler = Arc<dyn Fn(TcpStream, &ConnTicket) + Send + Sync>;

/// A connection's standing with its server.
pub struct ConnTicket {
    proven: Arc<AtomicBool>,
    limits: Arc<ServerLimits>,
}

impl ConnTicket {
    /// Marks the connection as serving a real peer (it sent a valid request): it is
    /// no longer closed to make room for newcomers, and may idle for `idle_timeout`.
    pub fn prove(&self) {
        self.proven.store(true, Ordering::Relaxed);
    }

    /// Whether [`ConnTicket::prove`] was called.
    pub fn is_proven(&self) -> bool {
        self.proven.load(Ordering::Relaxed)
    }

    /// The server's limits.
    pub fn limits(&self) -> &ServerLimits {
        &self.limits
    }
}

/// The deadline of the frame a server connection is receiving: it starts when the
/// frame's first byte arrives and holds however slowly the rest trickles in, so a
/// peer cannot keep a connection by sending a byte now and then. Every port times
/// its frames with it ([`TimedReader`] for the RPC and HTTP ports, the TCP data
/// server for a header and its WRITE payload).
#[derive(Clone, Copy, Debug, Default)]
pub struct FrameDeadline(Option<Instant>);

impl FrameDeadline {
    /// A frame's first byte arrived: it must be whole within `limit` (mid-frame,
    /// nothing changes).
    pub fn start(&mut self, limit: Duration) {
        self.0.get_or_insert_with(|| Instant::now() + limit);
    }

    /// The frame is whole: the next one gets its own deadline.
    pub fn done(&mut self) {
        self.0 = None;
    }

    /// Whether a frame is arriving.
    pub fn is_running(&self) -> bool {
        self.0.is_some()
    }

    /// Time left for the frame arriving (`None` between frames); `TimedOut` once
    /// its deadline passed.
    pub fn left(&self) -> io::Result<Option<Duration>> {
        match self.0 {
            None => Ok(None),
            Some(deadline) => deadline
                .checked_duration_since(Instant::now())
                .filter(|d| !d.is_zero())
                .map(Some)
                .ok_or_else(|| io::Error::new(io::ErrorKind::TimedOut, "frame timed out")),
        }
    }
}

/// A reader over a server connection that applies the server's timeouts: before a
/// frame, `idle_timeout` (or `frame_timeout` while the connection is unproven); once
/// a frame's first byte arrived, the whole frame must be in within `frame_timeout`
/// of it, however slowly the peer trickles. The handler calls
/// [`TimedReader::frame_done`] after each frame. An expired wait is `TimedOut`.
pub struct TimedReader<'a> {
    stream: &'a TcpStream,
    ticket: &'a ConnTicket,
    frame: FrameDeadline,
    /// The read timeout last set on the stream: between frames it rarely changes, so
    /// most reads need no `setsockopt`.
    timeout_set: Option<Duration>,
}

impl<'a> TimedReader<'a> {
    /// A reader of `stream`, between frames.
    pub fn new(stream: &'a TcpStream, ticket: &'a ConnTicket) -> TimedReader<'a> {
        TimedReader {
            stream,
            ticket,
            frame: FrameDeadline::default(),
            timeout_set: None,
        }
    }

    /// The frame being read is complete: the next read waits for a new one.
    pub fn frame_done(&mut self) {
        self.frame.done();
    }

    /// A frame's first bytes arrived with the one before (read ahead by the caller):
    /// its deadline starts now, not at the next read that returns bytes.
    pub fn frame_begun(&mut self) {
        self.frame.start(self.ticket.limits().frame_timeout);
    }
}

impl Read for TimedReader<'_> {
    fn read(&mut self, buf: &mut [u8]) -> io::Result<usize> {
        let limits = self.ticket.limits();
        let wait = match self.frame.left()? {
            None if self.ticket.is_proven() => limits.idle_timeout,
            None => limits.frame_timeout,
            Some(left) => left,
        };
        if self.timeout_set != Some(wait) {
            self.stream.set_read_timeout(Some(wait))?;
            self.timeout_set = Some(wait);
        }
        let n = match (&mut &*self.stream).read(buf) {
            Err(e) if e.kind() == io::ErrorKind::WouldBlock => {
                let what = if self.frame.is_running() {
                    "frame timed out"
                } else {
                    "connection idle too long"
                };
                return Err(io::Error::new(io::ErrorKind::TimedOut, what));
            }
            r => r?,
        };
        if n > 0 {
            self.frame.start(limits.frame_timeout);
        }
        Ok(n)
    }
}

/// How long the accept loop backs off after a failed accept (out of descriptors and
/// the like); shutdown still wakes it at once.
const ACCEPT_BACKOFF: Duration = Duration::from_millis(100);

/// One live connection.
struct Entry {
    /// A clone of the stream, so shutdown or eviction can unblock its thread.
    stream: TcpStream,
    /// The peer's [`peer_group`].
    peer: IpAddr,
    proven: Arc<AtomicBool>,
}

/// What the per-peer cap counts by: an IPv4 address, or an IPv6 /64 (one host
/// commonly holds a whole /64, so single addresses would not cap it).
pub fn peer_group(ip: IpAddr) -> IpAddr {
    match ip {
        IpAddr::V6(v6) => match v6.to_ipv4_mapped() {
            Some(v4) => IpAddr::V4(v4),
            None => {
                let s = v6.segments();
                IpAddr::V6(std::net::Ipv6Addr::new(s[0], s[1], s[2], s[3], 0, 0, 0, 0))
            }
        },
        v4 => v4,
    }
}

#[derive(Default)]
struct Conns {
    /// Ids grow with time, so the smallest id is the oldest connection.
    next_id: u64,
    live: HashMap<u64, Entry>,
    /// Connection threads not yet joined (finished ones are reaped on each accept).
    threads: Vec<JoinHandle<()>>,
}

impl Conns {
    /// Makes room for a connection from `peer`, closing the oldest unproven
    /// connections if a cap is reached; false if the caps are held by proven ones.
    fn make_room(&mut self, peer: IpAddr, limits: &ServerLimits) -> bool {
        let from_peer = self.live.values().filter(|e| e.peer == peer).count();
        if from_peer >= limits.max_per_peer && !self.evict_unproven(Some(peer)) {
            return false;
        }
        self.live.len() < limits.max_conns || self.evict_unproven(None)
    }

    /// Closes the oldest unproven connection (from `peer` if given); false if none.
    fn evict_unproven(&mut self, peer: Option<IpAddr>) -> bool {
        let oldest = self
            .live
            .iter()
            .filter(|(_, e)| !e.proven.load(Ordering::Relaxed))
            .filter(|(_, e)| peer.is_none_or(|p| e.peer == p))
            .map(|(id, _)| *id)
            .min();
        let Some(entry) = oldest.and_then(|id| self.live.remove(&id)) else {
            return false;
        };
        let _ = entry.stream.shutdown(Shutdown::Both);
        true
    }
}

/// What a `ConnServer` shares with its accept and connection threads: the shutdown
/// wake-up, the limits and the live connections.
struct ConnServerState {
    /// Notified once, on shutdown.
    wake: EventFd,
    limits: Arc<ServerLimits>,
    conns: Mutex<Conns>,
}

fn lock(m: &Mutex<Conns>) -> MutexGuard<'_, Conns> {
    m.locked()
}

/// A listening port served by a thread per connection (see the module docs).
pub struct ConnServer {
    addr: SocketAddr,
    shared: Arc<ConnServerState>,
    accept: Option<JoinHandle<()>>,
}

impl ConnServer {
    /// Binds `addr` (port 0 picks one) and serves each accepted connection on its own
    /// thread named after `name`, within `limits`.
    pub fn spawn(
        addr: SocketAddr,
        name: &str,
        limits: ServerLimits,
        handler: ConnHandler,
    ) -> io::Result<ConnServer> {
        let listener = TcpListener::bind(addr)?;
        listener.set_nonblocking(true)?;
        let addr = listener.local_addr()?;
        let shared = Arc::new(ConnServerState {
            wake: EventFd::new()?,
            limits: Arc::new(limits),
            conns: Mutex::new(Conns::default()),
        });
        let s = shared.clone();
        let thread_name = name.to_owned();
        let accept = std::thread::Builder::new()
            .name(format!("{name}-accept"))
            .spawn(move || accept_loop(listener, &s, &thread_name, &handler))?;
        Ok(ConnServer {
            addr,
            shared,
            accept: Some(accept),
        })
    }

    /// The bound address (with the real port when bound to port 0).
    pub fn local_addr(&self) -> SocketAddr {
        self.addr
    }

    /// Connections being served now.
    #[cfg(test)]
    fn live_connections(&self) -> usize {
        lock(&self.shared.conns).live.len()
    }

    /// Stops accepting, shuts every connection's socket down and joins all threads.
    /// Idempotent.
    pub fn shutdown(&mut self) {
        let Some(accept) = self.accept.take() else {
            return;
        };
        self.shared.wake.notify();
        if accept.join().is_err() {
            log::error!("server {}: accept thread panicked", self.addr);
        }
        // The listener is closed now: no connection can be added.
        let threads = {
            let mut conns = lock(&self.shared.conns);
            for entry in conns.live.values() {
                let _ = entry.stream.shutdown(Shutdown::Both);
            }
            std::mem::take(&mut conns.threads)
        };
        for t in threads {
            let _ = t.join();
        }
    }
}

impl Drop for ConnServer {
    fn drop(&mut self) {
        self.shutdown();
    }
}

fn accept_loop(
    listener: TcpListener,
    shared: &Arc<ConnServerState>,
    name: &str,
    handler: &ConnHandler,
) {
    let fd = listener.as_raw_fd();
    loop {
        match shared.wake.wait(Some(fd), None) {
            Ok(false) => {}
            Ok(true) => return,
            Err(e) => {
                log::error!("{name}: poll failed: {e}");
                return;
            }
        }
        loop {
            match listener.accept() {
                Ok((stream, peer)) => register(shared, name, handler, stream, peer),
                Err(e) if e.kind() == io::ErrorKind::WouldBlock => break,
                Err(e)
                    if matches!(
                        e.kind(),
                        io::ErrorKind::Interrupted | io::ErrorKind::ConnectionAborted
                    ) => {}
                Err(e) => {
                    // Out of descriptors and the like: log, back off, keep serving.
                    crate::warn_limited!("{name}: accept failed: {e}");
                    if !matches!(shared.wake.wait(None, Some(ACCEPT_BACKOFF)), Ok(false)) {
                        return;
                    }
                    break;
                }
            }
        }
    }
}

/// Removes a connection from the table when its thread ends, even by a panic.
struct Deregister(Arc<ConnServerState>, u64);

impl Drop for Deregister {
    fn drop(&mut self) {
        lock(&self.0.conns).live.remove(&self.1);
    }
}

fn register(
    shared: &Arc<ConnServerState>,
    name: &str,
    handler: &ConnHandler,
    stream: TcpStream,
    peer: SocketAddr,
) {
    let control = match stream
        .set_nonblocking(false)
        .and_then(|_| stream.try_clone())
    {
        Ok(c) => c,
        Err(e) => {
            crate::warn_limited!("{name}: setting up connection from {peer}: {e}");
            return;
        }
    };
    let finished = {
        let mut conns = lock(&shared.conns);
        if !conns.make_room(peer_group(peer.ip()), &shared.limits) {
            crate::warn_limited!("{name}: refusing connection from {peer} (connection limit)");
            return;
        }
        let id = conns.next_id;
        conns.next_id += 1;
        let ticket = ConnTicket {
            proven: Arc::new(AtomicBool::new(false)),
            limits: shared.limits.clone(),
        };
        let entry = Entry {
            stream: control,
            peer: peer_group(peer.ip()),
            proven: ticket.proven.clone(),
        };
        conns.live.insert(id, entry);
        let (h, s) = (handler.clone(), shared.clone());
        let spawned = std::thread::Builder::new()
            .name(format!("{name}-{}", stream.as_raw_fd()))
            .spawn(move || {
                // Made in the thread: a failed spawn must not drop one here, under
                // the lock it takes.
                let _guard = Deregister(s, id);
                h(stream, &ticket);
            });
        match spawned {
            Ok(t) => conns.threads.push(t),
            Err(e) => {
                crate::warn_limited!("{name}: cannot spawn connection thread: {e}");
                conns.live.remove(&id);
            }
        }
        // Reap finished threads so the list tracks only live ones.
        let (done, live) = std::mem::take(&mut conns.threads)
            .into_iter()
            .partition(|t| t.is_finished());
        conns.threads = live;
        done
    };
    for t in finished {
        let _ = t.join();
    }
}

/// This host's source address for traffic on its default route (the family of
/// `wildcard`): a UDP socket connected to a documentation address (connecting sends
/// nothing; it only picks the route) reports the local address chosen.
pub fn default_route_source(wildcard: IpAddr) -> Option<IpAddr> {
    let probe = match wildcard {
        IpAddr::V4(_) => SocketAddr::from(([192, 0, 2, 1], 9)),
        IpAddr::V6(_) => SocketAddr::from(([0x2001, 0xdb8, 0, 0, 0, 0, 0, 1], 9)),
    };
    let socket = UdpSocket::bind(SocketAddr::new(wildcard, 0)).ok()?;
    socket.connect(probe).ok()?;
    let ip = socket.local_addr().ok()?.ip();
    (!ip.is_unspecified()).then_some(ip)
}

/// The address other hosts reach a server bound to `bind` at: `bind` itself when it
/// is a specific address; for a wildcard, `route_source`'s answer (this host's address
/// on its default route). A wildcard or loopback address is never the answer for a
/// wildcard bind: `None` then (no route to take one from).
pub fn reachable_address(
    bind: IpAddr,
    route_source: impl FnOnce(IpAddr) -> Option<IpAddr>,
) -> Option<IpAddr> {
    if !bind.is_unspecified() {
        return Some(bind);
    }
    route_source(bind).filter(|ip| !ip.is_unspecified() && !ip.is_loopback())
}

pub use crate::sys::interface_ipv4;

#[cfg(test)]
mod tests {
    #[test]
    fn ipv6_peers_count_by_their_64() {
        let a: IpAddr = "2001:db8:1:2:aaaa::1".parse().unwrap();
        let b: IpAddr = "2001:db8:1:2:bbbb::9".parse().unwrap();
        let c: IpAddr = "2001:db8:1:3::1".parse().unwrap();
        assert_eq!(super::peer_group(a), super::peer_group(b));
        assert_ne!(super::peer_group(a), super::peer_group(c));
        let v4: IpAddr = "127.0.0.1".parse().unwrap();
        let mapped: IpAddr = "::ffff:127.0.0.1".parse().unwrap();
        assert_eq!(super::peer_group(mapped), v4);
        assert_eq!(super::peer_group(v4), v4);
    }

    use super::*;
    use std::io::Write;

    /// Echoes bytes until the peer closes; the first byte proves the connection.
    fn echo(s: TcpStream, ticket: &ConnTicket) {
        let mut b = [0u8; 64];
        let mut reader = TimedReader::new(&s, ticket);
        while let Ok(n @ 1..) = reader.read(&mut b) {
            ticket.prove();
            reader.frame_done();
            if (&s).write_all(&b[..n]).is_err() {
                return;
            }
        }
    }

    fn limits(max_conns: usize, max_per_peer: usize) -> ServerLimits {
        ServerLimits {
            max_conns,
            max_per_peer,
            ..ServerLimits::default()
        }
    }

    fn server(limits: ServerLimits) -> ConnServer {
        let addr = "127.0.0.1:0".parse().unwrap();
        ConnServer::spawn(addr, "t", limits, Arc::new(echo)).unwrap()
    }

    fn connect(server: &ConnServer) -> TcpStream {
        let s = TcpStream::connect(server.local_addr()).unwrap();
        s.set_read_timeout(Some(Duration::from_secs(10))).unwrap();
        s
    }

    fn round_trip(s: &mut TcpStream) -> bool {
        let mut b = [0u8; 1];
        s.write_all(b"x").is_ok() && matches!(s.read(&mut b), Ok(1))
    }

    /// Whether the server closed `s` (a read sees the end or a reset; running into
    /// the test's read timeout is not a close).
    fn closed(s: &mut TcpStream) -> bool {
        let mut b = [0u8; 1];
        match s.read(&mut b) {
            Ok(n) => n == 0,
            Err(e) => !matches!(
                e.kind(),
                io::ErrorKind::WouldBlock | io::ErrorKind::TimedOut
            ),
        }
    }

    #[test]
    fn limit_refuses_and_shutdown_closes_open_connections() {
        let mut server = server(limits(1, 1));
        let mut first = connect(&server);
        assert!(round_trip(&mut first)); // proven, so it holds the only slot
        let mut second = connect(&server);
        assert!(!round_trip(&mut second)); // closed by the server
        assert!(round_trip(&mut first)); // still served
        server.shutdown(); // must not wait for `first` to close
        assert!(closed(&mut first));
        server.shutdown(); // idempotent
    }

    #[test]
    fn a_finished_connection_frees_its_slot() {
        let server = server(limits(1, 1));
        for _ in 0..3 {
            let mut s = connect(&server);
            assert!(round_trip(&mut s));
            s.shutdown(Shutdown::Write).unwrap();
            // The handler returns on our EOF and closes: its slot is free once we see it.
            assert!(closed(&mut s));
        }
    }

    #[test]
    fn a_flood_of_silent_connections_displaces_only_itself() {
        let server = server(limits(8, 4));
        let mut known: Vec<_> = (0..3).map(|_| connect(&server)).collect();
        for s in &mut known {
            assert!(round_trip(s));
        }
        // A flood from the same address: each newcomer takes the place of the
        // oldest silent one, never a proven one, and the threads stay capped.
        let mut flood: Vec<_> = (0..50).map(|_| connect(&server)).collect();
        for s in &mut known {
            assert!(round_trip(s));
        }
        // A real peer connecting in the middle of the flood is still served.
        let mut late = connect(&server);
        assert!(round_trip(&mut late));
        assert!(server.live_connections() <= 4);
        // All but the newest silent connection were closed by the server.
        let newest = flood.pop().unwrap();
        assert!(flood.iter_mut().all(closed));
        drop(newest);
    }

    #[test]
    fn per_peer_and_per_port_caps_hold_when_every_slot_is_proven() {
        let server = server(limits(3, 2));
        let mut a = connect(&server);
        let mut b = connect(&server);
        assert!(round_trip(&mut a) && round_trip(&mut b));
        let mut c = connect(&server); // third from 127.0.0.1: over the per-peer cap
        assert!(!round_trip(&mut c));
        assert!(round_trip(&mut a) && round_trip(&mut b));
    }

    #[test]
    fn silent_connections_time_out_while_idle_served_ones_stay() {
        let server = server(ServerLimits {
            frame_timeout: Duration::from_millis(50),
            ..ServerLimits::default()
        });
        // Never says anything: closed after the frame timeout.
        let mut silent = connect(&server);
        assert!(closed(&mut silent));
        // A proven peer idle between frames is kept (idle timeout of minutes) ...
        let mut idle = connect(&server);
        assert!(round_trip(&mut idle));
        // ... while the silent ones are gone.
        let mut other = connect(&server);
        assert!(closed(&mut other));
        assert!(round_trip(&mut idle));
    }

    #[test]
    fn a_frame_trickled_byte_by_byte_still_meets_its_deadline() {
        let limits = Arc::new(ServerLimits {
            frame_timeout: Duration::from_millis(50),
            ..ServerLimits::default()
        });
        let ticket = ConnTicket {
            proven: Arc::new(AtomicBool::new(true)),
            limits,
        };
        let l = TcpListener::bind("127.0.0.1:0").unwrap();
        let mut client = TcpStream::connect(l.local_addr().unwrap()).unwrap();
        let (server_side, _) = l.accept().unwrap();
        let mut reader = TimedReader::new(&server_side, &ticket);
        client.write_all(b"a").unwrap();
        let mut b = [0u8; 4];
        assert_eq!(reader.read(&mut b).unwrap(), 1);
        // The frame started: the rest must come within the frame timeout, in total.
        let mut total = 1;
        let err = loop {
            client.write_all(b"b").unwrap();
            match reader.read(&mut b) {
                Ok(n) => total += n,
                Err(e) => break e,
            }
            assert!(total < 1_000_000, "the deadline never came");
        };
        assert_eq!(err.kind(), io::ErrorKind::TimedOut);
        reader.frame_done();
        client.write_all(b"c").unwrap();
        assert!(reader.read(&mut b).is_ok());
    }

    #[test]
    fn a_wildcard_is_reached_at_a_routable_address_only() {
        let any = IpAddr::from([0, 0, 0, 0]);
        let lo = IpAddr::from([127, 0, 0, 1]);
        let routed = IpAddr::from([10, 1, 2, 3]);
        // A specific bind is where it is reached, loopback included; no route asked.
        assert_eq!(reachable_address(lo, |_| panic!("not asked")), Some(lo));
        assert_eq!(
            reachable_address(routed, |_| panic!("not asked")),
            Some(routed)
        );
        // A wildcard takes the route's address, never a wildcard or loopback one.
        assert_eq!(reachable_address(any, |_| Some(routed)), Some(routed));
        assert_eq!(reachable_address(any, |_| Some(lo)), None);
        assert_eq!(reachable_address(any, |_| Some(any)), None);
        assert_eq!(reachable_address(any, |_| None), None);
        assert_eq!(
            reachable_address("::".parse().unwrap(), |_| Some("::1".parse().unwrap())),
            None
        );
    }
}
