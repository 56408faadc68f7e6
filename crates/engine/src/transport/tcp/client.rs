//! The client half, run inside an engine worker: non-blocking lanes (persistent
//! connections) per peer, each carrying a pipeline of slices. Requests go out in
//! order and the server answers in order, so each lane is a FIFO with a send cursor
//! and a receive cursor.

use std::collections::{HashMap, VecDeque};
use std::io;
use std::net::TcpStream;
use std::os::fd::{AsRawFd, RawFd};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use super::TcpConfig;
use crate::auth::challenge::ClientHandshake;
use crate::auth::ClusterSecret;
use crate::error::Result;
use crate::sys::{self, Epoll};
use crate::transport::{coarse_now, Finished, Op, Outcome, Slice, TransportWorker};
use crate::wire::data::{DataOp, Header, Status, HEADER_LEN, STATUS_LEN};

/// Slices gathered into one `writev`/`readv` at most (two iovecs each).
const MAX_GATHER: usize = 64;
/// A lane idle at least this long is checked for a server that hung up before it is
/// used again (one system call). Servers close only connections idle far longer
/// (`idle_timeout`), so one that answered more recently is used as it is; should its
/// server have gone meanwhile, the slice fails over to a new lane like any broken one.
const HANG_UP_CHECK_AGE: Duration = Duration::from_secs(1);

struct Pending {
    slice: Slice,
    header: [u8; HEADER_LEN],
    /// Where this slice's status frame is received.
    status: [u8; STATUS_LEN],
}

impl Pending {
    /// Request bytes: the header, then a WRITE's payload.
    fn send_len(&self) -> u64 {
        HEADER_LEN as u64 + self.payload(Op::Write)
    }

    /// Answer bytes: the status, then a READ's payload.
    fn recv_len(&self) -> u64 {
        STATUS_LEN as u64 + self.payload(Op::Read)
    }

    fn payload(&self, op: Op) -> u64 {
        if self.slice.op == op {
            self.slice.len
        } else {
            0
        }
    }
}

struct Lane {
    stream: TcpStream,
    peer: u64,
    connecting: bool,
    /// The cluster handshake, while it runs (requests wait until it is accepted).
    auth: Option<ClientHandshake>,
    queue: VecDeque<Pending>,
    /// Index of the first slice not fully sent, and bytes of it already sent.
    send_idx: usize,
    send_off: u64,
    /// Bytes of the front slice's answer received (status, then READ payload).
    recv_off: u64,
    /// Requests were queued since the lane was last driven (it is in `unsent`).
    unsent: bool,
    /// When its last answer completed (`coarse_now`).
    answered_at: Duration,
}

/// Why a lane stopped.
enum LaneError {
    /// The connection is unusable; every queued slice must go elsewhere.
    Broken(String),
    /// The server refused the front slice and closed.
    Rejected,
}

impl Lane {
    fn fd(&self) -> RawFd {
        self.stream.as_raw_fd()
    }

    /// Whether nothing is queued on it and, idle for `HANG_UP_CHECK_AGE` or more,
    /// its server closed it meanwhile.
    fn hung_up_while_idle(&self) -> bool {
        self.queue.is_empty()
            && !self.connecting
            && self.auth.is_none()
            && coarse_now().saturating_sub(self.answered_at) >= HANG_UP_CHECK_AGE
            && sys::idle_connection_closed(&self.stream)
    }

    /// Moves as many bytes as the socket takes until it would block: requests out,
    /// and answers in unless `send_only` (just after sending, when no answer can be
    /// there yet and epoll will say when one is); counts request `writev`s in `sends`.
    fn drive(
        &mut self,
        done: &mut Vec<Finished>,
        sends: &AtomicU64,
        send_only: bool,
    ) -> Result<bool, LaneError> {
        self.unsent = false;
        if self.connecting {
            match sys::connect_result(&self.stream) {
                None => return Ok(false),
                Some(Err(e)) => return Err(LaneError::Broken(format!("connect: {e}"))),
                Some(Ok(())) => {
                    self.connecting = false;
                    let _ = self.stream.set_nodelay(true);
                }
            }
        }
        if let Some(auth) = &mut self.auth {
            match auth.advance(&mut self.stream) {
                Ok(true) => self.auth = None,
                Ok(false) => return Ok(false),
                Err(e) => return Err(LaneError::Broken(format!("cluster handshake: {e}"))),
            }
        }
        let sent = self.send(sends)?;
        if send_only {
            return Ok(sent);
        }
        let received = self.receive(done)?;
        Ok(sent || received)
    }

    /// Sends queued requests, many per `writev`: each one's unsent header part, then
    /// a WRITE's unsent payload.
    fn send(&mut self, sends: &AtomicU64) -> Result<bool, LaneError> {
        let mut moved = false;
        let mut parts: Vec<(*const u8, usize)> = Vec::with_capacity(2 * MAX_GATHER);
        while self.send_idx < self.queue.len() {
            parts.clear();
            let mut off = self.send_off;
            for p in self.queue.range(self.send_idx..).take(MAX_GATHER) {
                if off < HEADER_LEN as u64 {
                    parts.push((p.header[off as usize..].as_ptr(), HEADER_LEN - off as usize));
                }
                if p.slice.op == Op::Write {
                    let skip = off.saturating_sub(HEADER_LEN as u64);
                    parts.push((
                        (p.slice.local + skip) as *const u8,
                        (p.slice.len - skip) as usize,
                    ));
                }
                off = 0;
            }
            // SAFETY: headers live in the queue entries, which stay put during the call;
            // payloads are the callers' local buffers, valid for each slice's length by
            // the submit contract.
            match unsafe { sys::writev(self.fd(), &parts) } {
                Ok(n) => {
                    moved = true;
                    sends.fetch_add(1, Ordering::Relaxed);
                    self.advance_send(n as u64);
                }
                Err(e) if e.kind() == io::ErrorKind::WouldBlock => break,
                Err(e) if e.kind() == io::ErrorKind::Interrupted => {}
                Err(e) => return Err(LaneError::Broken(format!("send: {e}"))),
            }
        }
        Ok(moved)
    }

    fn advance_send(&mut self, mut n: u64) {
        while n > 0 {
            let left = self.queue[self.send_idx].send_len() - self.send_off;
            if n < left {
                self.send_off += n;
                return;
            }
            n -= left;
            self.send_idx += 1;
            self.send_off = 0;
        }
    }

    /// Receives answers of sent requests, many per `readv`: each one's status, then a
    /// READ's payload straight into the caller's buffer. A refused request gets no
    /// payload and the server closes, so reading ahead never consumes foreign bytes.
    fn receive(&mut self, done: &mut Vec<Finished>) -> Result<bool, LaneError> {
        let mut moved = false;
        let mut parts: Vec<(*mut u8, usize)> = Vec::with_capacity(2 * MAX_GATHER);
        while self.send_idx > 0 {
            parts.clear();
            let mut off = self.recv_off;
            for p in self.queue.range_mut(..self.send_idx).take(MAX_GATHER) {
                if off < STATUS_LEN as u64 {
                    parts.push((
                        p.status[off as usize..].as_mut_ptr(),
                        STATUS_LEN - off as usize,
                    ));
                }
                if p.slice.op == Op::Read {
                    let skip = off.saturating_sub(STATUS_LEN as u64);
                    parts.push((
                        (p.slice.local + skip) as *mut u8,
                        (p.slice.len - skip) as usize,
                    ));
                }
                off = 0;
            }
            // SAFETY: status buffers live in the queue entries, which stay put during
            // the call; payload targets are the callers' local buffers, valid and
            // exclusively ours for each slice's length.
            let n = match unsafe { sys::readv(self.fd(), &parts) } {
                Ok(0) => return Err(LaneError::Broken("connection closed by peer".into())),
                Ok(n) => n as u64,
                Err(e) if e.kind() == io::ErrorKind::WouldBlock => break,
                Err(e) if e.kind() == io::ErrorKind::Interrupted => continue,
                Err(e) => return Err(LaneError::Broken(format!("receive: {e}"))),
            };
            moved = true;
            self.advance_receive(n, done)?;
        }
        Ok(moved)
    }

    /// Accounts `n` received bytes from the front, checking each status as it
    /// completes and finishing slices whose answer is whole.
    fn advance_receive(&mut self, mut n: u64, done: &mut Vec<Finished>) -> Result<(), LaneError> {
        while n > 0 {
            let front = &self.queue[0];
            let before = self.recv_off;
            let take = n.min(front.recv_len() - before);
            self.recv_off += take;
            n -= take;
            if before < STATUS_LEN as u64 && self.recv_off >= STATUS_LEN as u64 {
                match Status::decode(&front.status) {
                    Ok(Status::Ok) => {}
                    Ok(Status::Rejected) => return Err(LaneError::Rejected),
                    Err(e) => return Err(LaneError::Broken(e.to_string())),
                }
            }
            if self.recv_off == front.recv_len() {
                let p = self.queue.pop_front().expect("front exists");
                self.send_idx -= 1;
                self.recv_off = 0;
                self.answered_at = coarse_now();
                done.push(Finished::new(p.slice.id, Outcome::Done));
            }
        }
        Ok(())
    }
}

pub struct TcpWorker {
    config: TcpConfig,
    secret: Option<ClusterSecret>,
    epoll: Epoll,
    /// Lanes by token; a token is never reused while its lane is registered.
    lanes: HashMap<u64, Lane>,
    by_peer: HashMap<u64, Vec<u64>>,
    next_token: u64,
    in_flight: usize,
    ready: Vec<u64>,
    /// Lanes with requests queued by `post` and not yet sent: they go out together
    /// at the next `progress`, so a burst of small slices leaves in one `writev`.
    unsent: Vec<u64>,
    sends: Arc<AtomicU64>,
}

impl TcpWorker {
    pub fn new(
        config: TcpConfig,
        secret: Option<ClusterSecret>,
        sends: Arc<AtomicU64>,
    ) -> Result<TcpWorker> {
        let epoll = Epoll::new().map_err(|e| crate::Error::io("creating epoll", e))?;
        Ok(TcpWorker {
            config,
            secret,
            epoll,
            lanes: HashMap::new(),
            by_peer: HashMap::new(),
            next_token: 0,
            in_flight: 0,
            ready: Vec::new(),
            unsent: Vec::new(),
            sends,
        })
    }

    /// The least loaded lane to `slice`'s peer, opening a new one while under the limit.
    fn pick_lane(&mut self, slice: &Slice) -> std::result::Result<u64, String> {
        // The lane about to be used, if idle, is checked for a server that hung up
        // (servers close connections idle too long): one peek, none for a busy lane.
        let best = loop {
            let best = self.by_peer.get(&slice.peer.id).and_then(|tokens| {
                tokens
                    .iter()
                    .copied()
                    .min_by_key(|t| self.lanes.get(t).map_or(usize::MAX, |l| l.queue.len()))
            });
            match best {
                Some(t) if self.lanes.get(&t).is_some_and(Lane::hung_up_while_idle) => {
                    // No slice is queued on it: nothing is handed back.
                    let why = LaneError::Broken("closed by the peer while idle".into());
                    self.close_lane(t, why, &mut Vec::new());
                }
                _ => break best,
            }
        };
        let tokens = self.by_peer.entry(slice.peer.id).or_default();
        let best_len = best.and_then(|t| self.lanes.get(&t)).map(|l| l.queue.len());
        let want_new = match best_len {
            None => true,
            Some(len) => len > 0 && tokens.len() < self.config.lanes_per_peer.max(1),
        };
        if !want_new {
            return Ok(best.expect("a lane exists"));
        }
        let addr = slice.peer.data_addr();
        let stream = sys::connect_nonblocking(addr).map_err(|e| format!("connect {addr}: {e}"))?;
        sys::set_socket_buffers(&stream, self.config.socket_buffer);
        let auth = match &self.secret {
            Some(secret) => {
                Some(ClientHandshake::new(secret, addr).map_err(|e| format!("nonce: {e}"))?)
            }
            None => None,
        };
        let token = self.next_token;
        self.next_token += 1;
        self.epoll
            .add(
                stream.as_raw_fd(),
                sys::READABLE | sys::WRITABLE | sys::EDGE,
                token,
            )
            .map_err(|e| format!("epoll add: {e}"))?;
        tokens.push(token);
        self.lanes.insert(
            token,
            Lane {
                stream,
                peer: slice.peer.id,
                connecting: true,
                auth,
                queue: VecDeque::new(),
                send_idx: 0,
                send_off: 0,
                recv_off: 0,
                unsent: false,
                answered_at: Duration::ZERO,
            },
        );
        Ok(token)
    }

    fn drive(&mut self, token: u64, done: &mut Vec<Finished>, send_only: bool) -> bool {
        let Some(lane) = self.lanes.get_mut(&token) else {
            return false;
        };
        let before = done.len();
        let result = lane.drive(done, &self.sends, send_only);
        self.in_flight -= done.len() - before;
        match result {
            Ok(moved) => moved,
            Err(err) => {
                self.close_lane(token, err, done);
                true
            }
        }
    }

    /// Closes a lane and hands back every slice on it.
    fn close_lane(&mut self, token: u64, err: LaneError, done: &mut Vec<Finished>) {
        let Some(lane) = self.lanes.remove(&token) else {
            return;
        };
        let _ = self.epoll.delete(lane.fd());
        if let Some(tokens) = self.by_peer.get_mut(&lane.peer) {
            tokens.retain(|t| *t != token);
        }
        let addr = lane
            .stream
            .peer_addr()
            .map(|a| a.to_string())
            .unwrap_or_default();
        for (i, p) in lane.queue.into_iter().enumerate() {
            let outcome = match &err {
                LaneError::Rejected if i == 0 => Outcome::Rejected(format!(
                    "peer {} refused [{:#x}, +{})",
                    p.slice.peer.name, p.slice.remote, p.slice.len
                )),
                LaneError::Rejected => Outcome::PathFailed("lane closed after a rejection".into()),
                LaneError::Broken(why) => Outcome::PathFailed(format!("tcp {addr}: {why}")),
            };
            done.push(Finished::new(p.slice.id, outcome));
            self.in_flight -= 1;
        }
    }

    /// Fails lanes whose oldest slice is past its deadline.
    fn expire(&mut self, now: Instant, done: &mut Vec<Finished>) {
        let late: Vec<u64> = self
            .lanes
            .iter()
            .filter(|(_, l)| l.queue.front().is_some_and(|p| p.slice.deadline <= now))
            .map(|(t, _)| *t)
            .collect();
        for token in late {
            let start = done.len();
            self.close_lane(token, LaneError::Broken("timed out".into()), done);
            if let Some(first) = done.get_mut(start) {
                first.outcome = Outcome::TimedOut;
            }
        }
    }
}

impl TransportWorker for TcpWorker {
    fn post(&mut self, slice: Slice, done: &mut Vec<Finished>) {
        let token = match self.pick_lane(&slice) {
            Ok(t) => t,
            Err(why) => {
                done.push(Finished::new(slice.id, Outcome::PathFailed(why)));
                return;
            }
        };
        let op = match slice.op {
            Op::Read => DataOp::Read,
            Op::Write => DataOp::Write,
        };
        let header = Header {
            size: slice.len,
            addr: slice.remote,
            op,
        }
        .encode();
        let lane = self.lanes.get_mut(&token).expect("picked lane exists");
        lane.queue.push_back(Pending {
            slice,
            header,
            status: [0; STATUS_LEN],
        });
        if !lane.unsent {
            lane.unsent = true;
            self.unsent.push(token);
        }
        self.in_flight += 1;
    }

    fn progress(&mut self, now: Instant, done: &mut Vec<Finished>) -> bool {
        if self.in_flight == 0 {
            return false;
        }
        let mut moved = false;
        let mut unsent = std::mem::take(&mut self.unsent);
        for &token in &unsent {
            moved |= self.drive(token, done, true);
        }
        unsent.clear();
        self.unsent = unsent;
        let mut ready = std::mem::take(&mut self.ready);
        if let Err(e) = self.epoll.wait(&mut ready, 0) {
            log::warn!("tcp worker: epoll_wait: {e}");
        }
        for &token in &ready {
            moved |= self.drive(token, done, false);
        }
        self.ready = ready;
        if !moved {
            self.expire(now, done);
        }
        moved
    }

    fn in_flight(&self) -> usize {
        self.in_flight
    }

    fn in_flight_bytes(&self) -> u64 {
        let queued = self.lanes.values().flat_map(|l| l.queue.iter());
        queued.map(|p| p.slice.len).sum()
    }

    fn wait_fd(&self) -> Option<RawFd> {
        Some(self.epoll.raw_fd())
    }
}

#[cfg(test)]
mod tests {
    //! Lanes against an in-test server on 127.0.0.1 (a port from the OS): which lane
    //! a slice takes, that answers finish slices in posting order, and what a broken,
    //! refusing or silent lane does with the slices it holds.

    use std::io::{Read, Write};
    use std::net::{SocketAddr, TcpListener};
    use std::sync::Arc;
    use std::time::{Duration, Instant};

    use super::*;
    use crate::device::MemoryKind;
    use crate::metadata::SegmentDesc;
    use crate::transport::{Endpoints, Peer};

    fn listener() -> (TcpListener, SocketAddr) {
        let l = TcpListener::bind("127.0.0.1:0").unwrap();
        let addr = l.local_addr().unwrap();
        (l, addr)
    }

    fn peer(id: u64, data: SocketAddr) -> Arc<Peer> {
        let endpoints = Endpoints {
            data,
            rpc: String::new(),
        };
        Arc::new(Peer::new(id, SegmentDesc::new("peer"), endpoints))
    }

    fn worker(lanes: usize) -> TcpWorker {
        crate::sys::ignore_sigpipe();
        TcpWorker::new(
            TcpConfig {
                lanes_per_peer: lanes,
                ..TcpConfig::default()
            },
            None,
            Arc::default(),
        )
        .unwrap()
    }

    /// Slice `id` of `buf`, at remote address `0x1000 * id`.
    fn slice(id: u64, op: Op, buf: &mut [u8], peer: &Arc<Peer>, deadline: Instant) -> Slice {
        Slice {
            id,
            op,
            local: buf.as_mut_ptr() as u64,
            local_kind: MemoryKind::Host,
            remote: 0x1000 * id,
            len: buf.len() as u64,
            peer: peer.clone(),
            deadline,
            checksum: false,
        }
    }

    fn later() -> Instant {
        Instant::now() + Duration::from_secs(120)
    }

    /// Drives `w` until `want` slices are done, waiting on its descriptor between
    /// rounds (bounded: a stuck lane fails the test instead of hanging it).
    fn run_until(w: &mut TcpWorker, done: &mut Vec<Finished>, want: usize) {
        for _ in 0..10_000 {
            if done.len() >= want {
                return;
            }
            let mut p = libc::pollfd {
                fd: w.wait_fd().unwrap(),
                events: libc::POLLIN,
                revents: 0,
            };
            // SAFETY: one valid pollfd for the duration of the call.
            unsafe { libc::poll(&mut p, 1, 1000) };
            w.progress(Instant::now(), done);
        }
        panic!("only {} of {want} slices finished", done.len());
    }

    /// Serves one connection: reads a request per entry of `answers` and answers it
    /// when the entry is `Some` (a READ's payload is its request's low address byte
    /// ^ 0x5a, repeated), then closes (after reading everything sent, so with a FIN,
    /// not a reset). Returns each request's (op, addr, WRITE payload).
    fn serve(l: &TcpListener, answers: &[Option<Status>]) -> Vec<(DataOp, u64, Vec<u8>)> {
        let (mut s, _) = l.accept().unwrap();
        let mut seen = Vec::new();
        for status in answers {
            let mut h = [0u8; HEADER_LEN];
            s.read_exact(&mut h).unwrap();
            let h = Header::decode(&h).unwrap();
            let mut payload = vec![
                0u8;
                if h.op == DataOp::Write {
                    h.size as usize
                } else {
                    0
                }
            ];
            s.read_exact(&mut payload).unwrap();
            if let Some(status) = status {
                s.write_all(&status.encode()).unwrap();
            }
            if *status == Some(Status::Ok) && h.op == DataOp::Read {
                s.write_all(&vec![h.addr as u8 ^ 0x5a; h.size as usize])
                    .unwrap();
            }
            seen.push((h.op, h.addr, payload));
        }
        seen
    }

    fn queue_lens(w: &TcpWorker, peer: u64) -> Vec<usize> {
        w.by_peer[&peer]
            .iter()
            .map(|t| w.lanes[t].queue.len())
            .collect()
    }

    #[test]
    fn lanes_open_up_to_the_limit_then_the_least_loaded_takes_the_slice() {
        // Nobody accepts: connections wait in the backlog, requests in socket buffers.
        let (_l, addr) = listener();
        let (a, b) = (peer(1, addr), peer(2, addr));
        let mut w = worker(2);
        let mut bufs = vec![[7u8; 64]; 6];
        let mut done = Vec::new();
        let mut it = bufs.iter_mut();
        let mut post = |w: &mut TcpWorker, id, p: &Arc<Peer>| {
            let s = slice(id, Op::Write, it.next().unwrap(), p, later());
            w.post(s, &mut done);
        };
        post(&mut w, 0, &a);
        assert_eq!(queue_lens(&w, 1), [1]);
        post(&mut w, 1, &a); // the only lane is busy: a second one opens
        assert_eq!(queue_lens(&w, 1), [1, 1]);
        post(&mut w, 2, &a); // at the limit: shares a lane
        post(&mut w, 3, &a); // the less loaded one
        assert_eq!(queue_lens(&w, 1), [2, 2]);
        post(&mut w, 4, &b); // another peer has its own lanes
        assert_eq!(queue_lens(&w, 2), [1]);
        assert_eq!(w.lanes.len(), 3);
        assert!(done.is_empty(), "nothing can finish without answers");
        assert_eq!((w.in_flight(), w.in_flight_bytes()), (5, 5 * 64));
    }

    #[test]
    fn answers_finish_slices_in_posting_order() {
        let (l, addr) = listener();
        let p = peer(1, addr);
        let mut w = worker(1);
        // Reads and writes of uneven sizes, pipelined on one lane.
        let sizes = [1usize, 4096, 3, 200_000, 17, 65_536];
        let mut bufs: Vec<Vec<u8>> = sizes.iter().map(|&n| vec![0xEE; n]).collect();
        let ops: Vec<Op> = (0..sizes.len())
            .map(|i| if i % 2 == 0 { Op::Write } else { Op::Read })
            .collect();
        let seen = std::thread::scope(|s| {
            let server = s.spawn(|| serve(&l, &[Some(Status::Ok); 6]));
            let mut done = Vec::new();
            for (i, buf) in bufs.iter_mut().enumerate() {
                w.post(slice(i as u64, ops[i], buf, &p, later()), &mut done);
            }
            assert_eq!(w.lanes.len(), 1);
            run_until(&mut w, &mut done, sizes.len());
            let ids: Vec<u64> = done.iter().map(|f| f.id).collect();
            assert_eq!(ids, [0, 1, 2, 3, 4, 5]);
            assert!(done.iter().all(|f| f.outcome == Outcome::Done));
            server.join().unwrap()
        });
        for (i, (op, addr, payload)) in seen.iter().enumerate() {
            assert_eq!(*addr, 0x1000 * i as u64, "requests go out in posting order");
            match ops[i] {
                Op::Write => {
                    assert_eq!(*op, DataOp::Write);
                    assert_eq!(payload, &vec![0xEE; sizes[i]]);
                }
                Op::Read => {
                    assert_eq!(*op, DataOp::Read);
                    let want = (0x1000 * i as u64) as u8 ^ 0x5a;
                    assert!(bufs[i].iter().all(|&b| b == want), "read {i} landed");
                }
            }
        }
        assert_eq!(w.in_flight(), 0);
    }

    #[test]
    fn a_broken_lane_hands_every_slice_back_and_the_next_post_reconnects() {
        let (l, addr) = listener();
        let p = peer(1, addr);
        let mut w = worker(1);
        let mut bufs = vec![[1u8; 100]; 4];
        let mut done = Vec::new();
        std::thread::scope(|s| {
            // Answers the first request, then hangs up.
            let server = s.spawn(|| serve(&l, &[Some(Status::Ok), None, None]));
            for (i, buf) in bufs.iter_mut().take(3).enumerate() {
                w.post(slice(i as u64, Op::Write, buf, &p, later()), &mut done);
            }
            let old: Vec<u64> = w.by_peer[&1].clone();
            run_until(&mut w, &mut done, 3);
            server.join().unwrap();
            assert_eq!(done[0].id, 0);
            assert_eq!(done[0].outcome, Outcome::Done);
            let rest: Vec<_> = done[1..].iter().map(|f| f.id).collect();
            assert_eq!(rest, [1, 2], "handed back in queue order");
            assert!(done[1..]
                .iter()
                .all(|f| matches!(f.outcome, Outcome::PathFailed(_))));
            assert_eq!(w.in_flight(), 0);
            assert!(
                w.by_peer[&1].is_empty() && w.lanes.is_empty(),
                "lane closed"
            );
            w.post(slice(3, Op::Write, &mut bufs[3], &p, later()), &mut done);
            assert_eq!(w.by_peer[&1].len(), 1);
            assert_ne!(w.by_peer[&1], old, "a new connection, not the broken one");
        });
    }

    #[test]
    fn a_lane_the_server_closed_while_idle_is_replaced_before_use() {
        let (l, addr) = listener();
        let p = peer(1, addr);
        let mut w = worker(1);
        let mut bufs = [[1u8; 100]; 2];
        let mut done = Vec::new();
        std::thread::scope(|s| {
            // Answers one request, then closes the connection (an idle timeout).
            let server = s.spawn(|| serve(&l, &[Some(Status::Ok)]));
            w.post(slice(0, Op::Write, &mut bufs[0], &p, later()), &mut done);
            run_until(&mut w, &mut done, 1);
            server.join().unwrap();
            assert_eq!(done[0].outcome, Outcome::Done);
            // Bounded wait until the hang-up reached the lane.
            let mut hung_up = libc::pollfd {
                fd: w.lanes.values().next().unwrap().fd(),
                events: libc::POLLRDHUP,
                revents: 0,
            };
            // SAFETY: one valid pollfd for the duration of the call.
            assert_eq!(unsafe { libc::poll(&mut hung_up, 1, 10_000) }, 1);
            // As if the lane had idled past the check age since its answer.
            w.lanes.values_mut().next().unwrap().answered_at = Duration::ZERO;
            // The next slice goes out on a fresh connection and succeeds at once.
            let server = s.spawn(|| serve(&l, &[Some(Status::Ok)]));
            w.post(slice(1, Op::Write, &mut bufs[1], &p, later()), &mut done);
            run_until(&mut w, &mut done, 2);
            server.join().unwrap();
            assert_eq!(done[1].outcome, Outcome::Done);
        });
    }

    #[test]
    fn a_refusal_fails_the_front_slice_and_hands_back_the_rest() {
        let (l, addr) = listener();
        let p = peer(1, addr);
        let mut w = worker(1);
        let mut bufs = vec![[1u8; 100]; 3];
        let mut done = Vec::new();
        std::thread::scope(|s| {
            // All three go out on the one connection (waiting in the listener's backlog)
            // before the server answers the first: a refusal read while posting would
            // send the later slices on a new connection instead.
            for (i, buf) in bufs.iter_mut().enumerate() {
                w.post(slice(i as u64, Op::Write, buf, &p, later()), &mut done);
            }
            let server = s.spawn(|| serve(&l, &[Some(Status::Rejected), None, None]));
            run_until(&mut w, &mut done, 3);
            server.join().unwrap();
        });
        let ids: Vec<u64> = done.iter().map(|f| f.id).collect();
        assert_eq!(ids, [0, 1, 2]);
        assert!(matches!(done[0].outcome, Outcome::Rejected(_)));
        assert!(done[1..]
            .iter()
            .all(|f| matches!(f.outcome, Outcome::PathFailed(_))));
    }

    #[test]
    fn a_silent_lane_past_its_deadline_times_out_its_front_slice() {
        let (_l, addr) = listener(); // accepts nothing, answers nothing
        let p = peer(1, addr);
        let mut w = worker(1);
        let mut bufs = [[1u8; 10]; 2];
        let mut done = Vec::new();
        let past = Instant::now();
        for (i, buf) in bufs.iter_mut().enumerate() {
            w.post(slice(i as u64, Op::Read, buf, &p, past), &mut done);
        }
        run_until(&mut w, &mut done, 2);
        assert_eq!(done[0].outcome, Outcome::TimedOut);
        assert_eq!(done[1].id, 1);
        assert!(matches!(done[1].outcome, Outcome::PathFailed(_)));
        assert_eq!(w.in_flight(), 0);
    }
}
