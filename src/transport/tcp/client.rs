//! The client half, run inside an engine worker: non-blocking lanes (persistent
//! connections) per peer, each carrying a pipeline of slices. Requests go out in
//! order and the server answers in order, so each lane is a FIFO with a send cursor
//! and a receive cursor.

use std::collections::{HashMap, VecDeque};
use std::io;
use std::net::TcpStream;
use std::os::fd::{AsRawFd, RawFd};
use std::time::Instant;

use super::TcpConfig;
use crate::error::Result;
use crate::sys::{self, Epoll};
use crate::transport::{Finished, Op, Outcome, Slice, TransportWorker};
use crate::wire::data::{DataOp, Header, Status, HEADER_LEN, STATUS_LEN};

struct Pending {
    slice: Slice,
    header: [u8; HEADER_LEN],
}

impl Pending {
    fn send_len(&self) -> u64 {
        HEADER_LEN as u64
            + if self.slice.op == Op::Write {
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
    queue: VecDeque<Pending>,
    /// Index of the first slice not fully sent, and bytes of it already sent.
    send_idx: usize,
    send_off: u64,
    /// Bytes of the front slice's answer received (status, then READ payload).
    recv_off: u64,
    status: [u8; STATUS_LEN],
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

    /// Moves as many bytes as the socket takes, both ways, until it would block.
    fn drive(&mut self, done: &mut Vec<Finished>) -> Result<bool, LaneError> {
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
        let sent = self.send()?;
        let received = self.receive(done)?;
        Ok(sent || received)
    }

    fn send(&mut self) -> Result<bool, LaneError> {
        let mut moved = false;
        while self.send_idx < self.queue.len() {
            let p = &self.queue[self.send_idx];
            let total = p.send_len();
            let off = self.send_off;
            let mut parts: [(*const u8, usize); 2] = [(std::ptr::null(), 0); 2];
            if off < HEADER_LEN as u64 {
                parts[0] = (p.header[off as usize..].as_ptr(), HEADER_LEN - off as usize);
            }
            if p.slice.op == Op::Write {
                let skip = off.saturating_sub(HEADER_LEN as u64);
                parts[1] = (
                    (p.slice.local + skip) as *const u8,
                    (p.slice.len - skip) as usize,
                );
            }
            // SAFETY: the header lives in the queue entry; the payload is the caller's
            // local buffer, valid for the slice's length by the submit contract.
            match unsafe { sys::writev(self.fd(), &parts) } {
                Ok(n) => {
                    moved = true;
                    self.send_off += n as u64;
                    if self.send_off == total {
                        self.send_idx += 1;
                        self.send_off = 0;
                    }
                }
                Err(e) if e.kind() == io::ErrorKind::WouldBlock => break,
                Err(e) if e.kind() == io::ErrorKind::Interrupted => {}
                Err(e) => return Err(LaneError::Broken(format!("send: {e}"))),
            }
        }
        Ok(moved)
    }

    fn receive(&mut self, done: &mut Vec<Finished>) -> Result<bool, LaneError> {
        let mut moved = false;
        // Only slices fully sent can be answered.
        while self.send_idx > 0 {
            let p = &self.queue[0];
            let payload = if p.slice.op == Op::Read {
                p.slice.len
            } else {
                0
            };
            let off = self.recv_off;
            let mut parts: [(*mut u8, usize); 2] = [(std::ptr::null_mut(), 0); 2];
            if off < STATUS_LEN as u64 {
                parts[0] = (
                    self.status[off as usize..].as_mut_ptr(),
                    STATUS_LEN - off as usize,
                );
            }
            // A rejected READ gets no payload and the server closes, so reading the
            // payload speculatively in the same call cannot consume foreign bytes.
            let skip = off.saturating_sub(STATUS_LEN as u64);
            if payload > 0 {
                parts[1] = ((p.slice.local + skip) as *mut u8, (payload - skip) as usize);
            }
            // SAFETY: the status buffer is ours; the payload target is the caller's
            // local buffer, valid and exclusively ours for the slice's length.
            let n = match unsafe { sys::readv(self.fd(), &parts) } {
                Ok(0) => return Err(LaneError::Broken("connection closed by peer".into())),
                Ok(n) => n as u64,
                Err(e) if e.kind() == io::ErrorKind::WouldBlock => break,
                Err(e) if e.kind() == io::ErrorKind::Interrupted => continue,
                Err(e) => return Err(LaneError::Broken(format!("receive: {e}"))),
            };
            moved = true;
            let before = self.recv_off;
            self.recv_off += n;
            if before < STATUS_LEN as u64 && self.recv_off >= STATUS_LEN as u64 {
                match Status::decode(&self.status) {
                    Ok(Status::Ok) => {}
                    Ok(Status::Rejected) => return Err(LaneError::Rejected),
                    Err(e) => return Err(LaneError::Broken(e.to_string())),
                }
            }
            if self.recv_off == STATUS_LEN as u64 + payload {
                let p = self.queue.pop_front().expect("front exists");
                self.send_idx -= 1;
                self.recv_off = 0;
                done.push(Finished {
                    id: p.slice.id,
                    outcome: Outcome::Done,
                });
            }
        }
        Ok(moved)
    }
}

pub struct TcpWorker {
    config: TcpConfig,
    epoll: Epoll,
    /// Lanes by token; a token is never reused while its lane is registered.
    lanes: HashMap<u64, Lane>,
    by_peer: HashMap<u64, Vec<u64>>,
    next_token: u64,
    in_flight: usize,
    ready: Vec<u64>,
}

impl TcpWorker {
    pub fn new(config: TcpConfig) -> Result<TcpWorker> {
        let epoll = Epoll::new().map_err(|e| crate::Error::io("creating epoll", e))?;
        Ok(TcpWorker {
            config,
            epoll,
            lanes: HashMap::new(),
            by_peer: HashMap::new(),
            next_token: 0,
            in_flight: 0,
            ready: Vec::new(),
        })
    }

    /// The least loaded lane to `slice`'s peer, opening a new one while under the limit.
    fn pick_lane(&mut self, slice: &Slice) -> std::result::Result<u64, String> {
        let tokens = self.by_peer.entry(slice.peer.id).or_default();
        let best = tokens
            .iter()
            .copied()
            .min_by_key(|t| self.lanes.get(t).map_or(usize::MAX, |l| l.queue.len()));
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
                queue: VecDeque::new(),
                send_idx: 0,
                send_off: 0,
                recv_off: 0,
                status: [0; STATUS_LEN],
            },
        );
        Ok(token)
    }

    fn drive(&mut self, token: u64, done: &mut Vec<Finished>) -> bool {
        let Some(lane) = self.lanes.get_mut(&token) else {
            return false;
        };
        let before = done.len();
        let result = lane.drive(done);
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
            done.push(Finished {
                id: p.slice.id,
                outcome,
            });
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
                done.push(Finished {
                    id: slice.id,
                    outcome: Outcome::PathFailed(why),
                });
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
        lane.queue.push_back(Pending { slice, header });
        self.in_flight += 1;
        self.drive(token, done);
    }

    fn progress(&mut self, now: Instant, done: &mut Vec<Finished>) -> bool {
        if self.in_flight == 0 {
            return false;
        }
        let mut ready = std::mem::take(&mut self.ready);
        if let Err(e) = self.epoll.wait(&mut ready, 0) {
            log::warn!("tcp worker: epoll_wait: {e}");
        }
        let mut moved = false;
        for &token in &ready {
            moved |= self.drive(token, done);
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
