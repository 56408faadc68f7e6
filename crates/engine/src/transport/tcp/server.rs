//! The data server: one thread per connection, blocking I/O straight between the
//! socket and registered memory. Every range is validated against one registered
//! buffer before a byte moves; a rejected request is answered and the connection
//! closed, as Mooncake's v2 server does.
//!
//! Pipelined requests are cheap: headers are read in bulk into a small buffer, and the
//! answers to every request already parsed go out in one `writev` before the server
//! waits for more, so a burst of small reads costs a few syscalls, not two each. It
//! waits by polling briefly while the machine has a CPU to spare, then blocking.
//!
//! Blocking calls wake every [`TICK`] (the socket's timeouts), which costs nothing
//! while data flows. On each wake a stalled connection is checked: between requests
//! it may idle for the server's `idle_timeout` (`frame_timeout` until it sent a whole
//! request); a request (header and WRITE payload) must be whole within
//! `frame_timeout` of its first byte ([`FrameDeadline`]), and a batch of answers must
//! leave within `frame_timeout` per answer, however steadily the peer trickles; and a
//! transfer against a buffer being unregistered is abandoned (the connection closed,
//! so the peer sees an error), so a slow or stalled reader cannot hold
//! `unregister_memory` for longer than a tick. Only a whole request proves the
//! connection, so trickling connections never hold the per-peer cap.

use std::io::{self, Read};
use std::net::TcpStream;
use std::os::fd::AsRawFd;
use std::time::{Duration, Instant};

use crate::device::{self, Bounce};
use crate::net::{ConnTicket, FrameDeadline};
use crate::registry::{LocalMemory, RangeGuard};
use crate::sys;
use crate::wire::data::{DataOp, Header, Status, HEADER_LEN, STATUS_LEN};

/// How often a blocked connection wakes to check its timeouts and pinned buffers.
const TICK: Duration = Duration::from_millis(200);
/// Bytes of headers (and small write payloads) read per syscall.
const INPUT_BUFFER: usize = 64 << 10;
/// How long a connection polls its socket for the next request before it blocks,
/// when the machine has a CPU to spare for it (see `fill`). A synchronous caller's
/// next request typically follows within a few microseconds, and picking it up from a
/// blocking read costs a wake-up (a scheduler round trip, about as long as the whole
/// exchange).
const SPIN_BEFORE_BLOCKING: Duration = Duration::from_micros(20);
/// Polls between looks at the clock and at the machine's runnable threads.
const POLLS_PER_CHECK: u32 = 16;
/// Answers gathered into one `writev` at most (two iovecs each, under IOV_MAX).
const MAX_PENDING_REPLIES: usize = 256;

/// An answer not yet sent: a status, and for an accepted READ the bytes to send
/// (pinned by the guard until they are out).
struct Reply {
    status: [u8; STATUS_LEN],
    payload: Option<RangeGuard>,
}

struct Connection<'a> {
    stream: TcpStream,
    memory: &'a LocalMemory,
    ticket: &'a ConnTicket,
    peer: String,
    input: Vec<u8>,
    /// Unconsumed input is `input[start..end]`.
    start: usize,
    end: usize,
    replies: Vec<Reply>,
    /// The deadline of the request arriving.
    frame: FrameDeadline,
}

pub fn serve(stream: TcpStream, ticket: &ConnTicket, memory: &LocalMemory, socket_buffer: usize) {
    let peer = stream
        .peer_addr()
        .map(|a| a.to_string())
        .unwrap_or_default();
    let _ = stream.set_nodelay(true);
    let _ = stream.set_read_timeout(Some(TICK));
    let _ = stream.set_write_timeout(Some(TICK));
    sys::set_socket_buffers(&stream, socket_buffer);
    let mut conn = Connection {
        stream,
        memory,
        ticket,
        peer,
        input: vec![0; INPUT_BUFFER],
        start: 0,
        end: 0,
        replies: Vec::new(),
        frame: FrameDeadline::default(),
    };
    if let Err(e) = conn.run() {
        log::debug!("tcp data {}: {e}", conn.peer);
    }
}

impl Connection<'_> {
    fn run(&mut self) -> io::Result<()> {
        loop {
            if self.end - self.start < HEADER_LEN {
                // About to block: first answer everything parsed so far.
                self.answer()?;
                if !self.fill()? {
                    return Ok(());
                }
                continue;
            }
            let raw: [u8; HEADER_LEN] = self.input[self.start..self.start + HEADER_LEN]
                .try_into()
                .expect("header length");
            self.start += HEADER_LEN;
            let header = match Header::decode(&raw) {
                Ok(h) => h,
                Err(e) => return self.reject(&format!("{e}")),
            };
            let write = header.op == DataOp::Write;
            let guard = match self.memory.guard_for_peer(header.addr, header.size, write) {
                Ok(g) => g,
                Err(e) => return self.reject(&format!("{:?} rejected: {e}", header.op)),
            };
            match header.op {
                // Device memory is never touched by the CPU: it goes through a bounce.
                DataOp::Write if !guard.device().is_host() => {
                    if let Err(why) = self.receive_staged(&guard)? {
                        return self.reject(&why);
                    }
                    drop(guard);
                    self.replies.push(Reply {
                        status: Status::Ok.encode(),
                        payload: None,
                    });
                }
                DataOp::Read if !guard.device().is_host() => {
                    if let Err(why) = self.send_staged(&guard)? {
                        return self.reject(&why);
                    }
                }
                DataOp::Write => {
                    self.receive_into(&guard)?;
                    drop(guard);
                    self.replies.push(Reply {
                        status: Status::Ok.encode(),
                        payload: None,
                    });
                }
                DataOp::Read => self.replies.push(Reply {
                    status: Status::Ok.encode(),
                    payload: Some(guard),
                }),
            }
            // The request is whole: it proves the peer, and the next one (its first
            // bytes may be buffered already) gets its own deadline.
            self.ticket.prove();
            self.frame.done();
            if self.end > self.start {
                self.frame.start(self.ticket.limits().frame_timeout);
            }
            if self.replies.len() >= MAX_PENDING_REPLIES {
                self.answer()?;
            }
        }
    }

    /// Reads more input; false on a clean end of stream between requests.
    fn fill(&mut self) -> io::Result<bool> {
        if self.start > 0 {
            self.input.copy_within(self.start..self.end, 0);
            self.end -= self.start;
            self.start = 0;
        }
        let since = Instant::now();
        let limits = self.ticket.limits();
        // Only a served peer between requests may idle long; a request begun must
        // be whole by its deadline.
        let patience = match self.frame.left()? {
            Some(left) => left,
            None if self.end == 0 && self.ticket.is_proven() => limits.idle_timeout,
            None => limits.frame_timeout,
        };
        let deadline = since + patience;
        // Poll first, but only while no other thread is waiting for a CPU: on a small
        // machine a spinning server would take the core from the caller's other
        // threads (a Python program's main thread, say) for every request.
        let mut polls = 0u32;
        while polls % POLLS_PER_CHECK != 0 || sys::cpu_to_spare() {
            match sys::recv_nonblocking(&self.stream, &mut self.input[self.end..]) {
                Ok(n) => return self.took(n),
                Err(e) if is_timeout(&e) || e.kind() == io::ErrorKind::Interrupted => {}
                Err(e) => return Err(e),
            }
            polls += 1;
            if polls % POLLS_PER_CHECK == 0 && since.elapsed() >= SPIN_BEFORE_BLOCKING {
                break;
            }
            std::hint::spin_loop();
        }
        loop {
            match self.stream.read(&mut self.input[self.end..]) {
                Ok(n) => return self.took(n),
                Err(e) if is_timeout(&e) => keep_waiting(deadline, false)?,
                Err(e) if e.kind() == io::ErrorKind::Interrupted => {}
                Err(e) => return Err(e),
            }
        }
    }

    /// Counts `n` bytes just read into the input buffer; false on a clean end of
    /// stream between requests.
    fn took(&mut self, n: usize) -> io::Result<bool> {
        match n {
            0 if self.end == 0 => Ok(false),
            0 => Err(io::Error::new(
                io::ErrorKind::UnexpectedEof,
                format!("connection closed inside a header ({} bytes)", self.end),
            )),
            n => {
                self.end += n;
                self.frame.start(self.ticket.limits().frame_timeout);
                Ok(true)
            }
        }
    }

    /// A WRITE's payload: whatever already sits in the input buffer, then the rest
    /// straight from the socket into registered memory.
    fn receive_into(&mut self, guard: &RangeGuard) -> io::Result<()> {
        // SAFETY: `guard` pins a validated registered range; only this connection
        // writes it now.
        let dst = unsafe { guard.bytes_mut() };
        let buffered = (self.end - self.start).min(dst.len());
        dst[..buffered].copy_from_slice(&self.input[self.start..self.start + buffered]);
        self.start += buffered;
        let total = dst.len();
        let deadline = self.frame_deadline()?;
        let replies = &self.replies;
        let revoked = || guard.is_revoked() || any_revoked(replies);
        read_full(
            &mut self.stream,
            &mut dst[buffered..],
            total - buffered,
            deadline,
            &revoked,
        )
    }

    /// When the request arriving must be whole.
    fn frame_deadline(&self) -> io::Result<Instant> {
        let left = self.frame.left()?;
        Ok(Instant::now() + left.unwrap_or(self.ticket.limits().frame_timeout))
    }

    /// A WRITE into device memory: the payload lands in a host bounce buffer, a
    /// bounce at a time, and the driver copies each piece to the device. A failed
    /// device copy still consumes the payload, then refuses the request (inner `Err`).
    fn receive_staged(&mut self, guard: &RangeGuard) -> io::Result<Result<(), String>> {
        let kind = guard.device();
        let mut bounce = Bounce::take(kind);
        let total = guard.len() as usize;
        let mut failed = None;
        let mut off = 0;
        let deadline = self.frame_deadline()?;
        while off < total {
            let n = (total - off).min(bounce.len());
            let chunk = bounce.bytes_mut(n);
            let buffered = (self.end - self.start).min(n);
            chunk[..buffered].copy_from_slice(&self.input[self.start..self.start + buffered]);
            self.start += buffered;
            let replies = &self.replies;
            let revoked = || guard.is_revoked() || any_revoked(replies);
            read_full(
                &mut self.stream,
                &mut chunk[buffered..],
                total - off - buffered,
                deadline,
                &revoked,
            )?;
            if failed.is_none() {
                // SAFETY: the bounce holds `n` received bytes; the target is inside the
                // guarded registered device buffer.
                let r = unsafe {
                    device::copy_from_bounce(kind, guard.addr() + off as u64, &bounce, n)
                };
                failed = r
                    .err()
                    .map(|e| format!("WRITE into {}: {e}", kind.location()));
            }
            off += n;
        }
        Ok(failed.map_or(Ok(()), Err))
    }

    /// A READ of device memory: answers what came before, then the status and the
    /// bytes, copied out of the device a bounce at a time. A failure on the first copy
    /// refuses the request (inner `Err`); a later one can only close the connection.
    fn send_staged(&mut self, guard: &RangeGuard) -> io::Result<Result<(), String>> {
        self.flush()?;
        let kind = guard.device();
        let bounce = Bounce::take(kind);
        let total = guard.len() as usize;
        let status = Status::Ok.encode();
        let mut off = 0;
        let deadline = Instant::now() + self.ticket.limits().frame_timeout;
        while off < total {
            let n = (total - off).min(bounce.len());
            // SAFETY: the source is inside the guarded registered device buffer; the
            // bounce holds `n` bytes.
            let r =
                unsafe { device::copy_to_host(kind, bounce.ptr(), guard.addr() + off as u64, n) };
            if let Err(e) = r {
                let why = format!("READ of {}: {e}", kind.location());
                if off == 0 {
                    return Ok(Err(why));
                }
                return Err(io::Error::other(why));
            }
            let mut parts = Vec::with_capacity(2);
            if off == 0 {
                parts.push((status.as_ptr(), STATUS_LEN));
            }
            parts.push((bounce.ptr() as *const u8, n));
            let revoked = || guard.is_revoked();
            send_all(&self.stream, &mut parts, deadline, &revoked)?;
            off += n;
        }
        Ok(Ok(()))
    }

    /// Sends the pending answers between requests. The time that takes is the
    /// server's, not the peer's: a request whose first bytes came meanwhile gets its
    /// whole deadline from here.
    fn answer(&mut self) -> io::Result<()> {
        if self.replies.is_empty() {
            return Ok(());
        }
        self.flush()?;
        if self.frame.is_running() {
            self.frame.done();
            self.frame.start(self.ticket.limits().frame_timeout);
        }
        Ok(())
    }

    /// Sends every pending answer, gathering them into as few writes as possible.
    fn flush(&mut self) -> io::Result<()> {
        if self.replies.is_empty() {
            return Ok(());
        }
        let mut parts: Vec<(*const u8, usize)> = Vec::with_capacity(self.replies.len() * 2);
        for r in &self.replies {
            parts.push((r.status.as_ptr(), STATUS_LEN));
            if let Some(g) = &r.payload {
                parts.push((g.ptr() as *const u8, g.len() as usize));
            }
        }
        let replies = &self.replies;
        let revoked = || any_revoked(replies);
        // Each answer gets the frame deadline: a big batch may take long, a peer
        // reading a trickle cannot hold the connection.
        let per_answer = self.ticket.limits().frame_timeout;
        let deadline = Instant::now() + per_answer.saturating_mul(replies.len() as u32);
        let result = send_all(&self.stream, &mut parts, deadline, &revoked);
        // Dropping the replies releases their guards only now that the bytes are out.
        self.replies.clear();
        result
    }

    /// Answers what came before, refuses this request, and ends the connection.
    fn reject(&mut self, why: &str) -> io::Result<()> {
        crate::warn_limited!("tcp data {}: {why}; closing", self.peer);
        self.replies.push(Reply {
            status: Status::Rejected.encode(),
            payload: None,
        });
        self.flush()
    }
}

/// Reads exactly `buf.len()` bytes of a payload (`left` bytes of which remain, for the
/// error message) by `deadline`, giving up as soon as `revoked` says a buffer this
/// connection holds is being unregistered: checked after every read, so a peer
/// trickling bytes steadily cannot hold an unregister either.
fn read_full(
    stream: &mut TcpStream,
    buf: &mut [u8],
    left: usize,
    deadline: Instant,
    revoked: &dyn Fn() -> bool,
) -> io::Result<()> {
    let mut got = 0;
    while got < buf.len() {
        match stream.read(&mut buf[got..]) {
            Ok(0) => {
                return Err(io::Error::new(
                    io::ErrorKind::UnexpectedEof,
                    format!("write payload short by {} bytes", left - got),
                ))
            }
            Ok(n) => {
                got += n;
                if got < buf.len() {
                    keep_waiting(deadline, revoked())?;
                }
            }
            Err(e) if is_timeout(&e) => keep_waiting(deadline, revoked())?,
            Err(e) if e.kind() == io::ErrorKind::Interrupted => {}
            Err(e) => return Err(e),
        }
    }
    Ok(())
}

/// Between two blocking calls: fine to go on, unless `deadline` passed or a buffer
/// of the transfer is being unregistered.
fn keep_waiting(deadline: Instant, revoked: bool) -> io::Result<()> {
    if revoked {
        return Err(io::Error::other(
            "buffer unregistered mid-transfer; abandoning it",
        ));
    }
    if Instant::now() >= deadline {
        return Err(io::Error::new(
            io::ErrorKind::TimedOut,
            "peer too slow: past the frame deadline",
        ));
    }
    Ok(())
}

fn is_timeout(e: &io::Error) -> bool {
    matches!(
        e.kind(),
        io::ErrorKind::WouldBlock | io::ErrorKind::TimedOut
    )
}

/// Writes all parts, `writev` at a time, in chunks the kernel accepts, by `deadline`,
/// giving up once `revoked` says a sent buffer is being unregistered.
fn send_all(
    stream: &TcpStream,
    parts: &mut [(*const u8, usize)],
    deadline: Instant,
    revoked: &dyn Fn() -> bool,
) -> io::Result<()> {
    let mut first = 0;
    while first < parts.len() {
        // IOV_MAX is 1024 on Linux.
        let window = &parts[first..parts.len().min(first + 1024)];
        // SAFETY: every part points into a live buffer of the stated length (a status in
        // a pending reply or a guarded registered range).
        let n = match unsafe { sys::writev(stream.as_raw_fd(), window) } {
            Ok(0) => return Err(io::ErrorKind::WriteZero.into()),
            Ok(n) => n,
            Err(e) if is_timeout(&e) => {
                keep_waiting(deadline, revoked())?;
                continue;
            }
            Err(e) if e.kind() == io::ErrorKind::Interrupted => continue,
            Err(e) => return Err(e),
        };
        first += advance(&mut parts[first..], n);
        if first < parts.len() {
            keep_waiting(deadline, revoked())?;
        }
    }
    Ok(())
}

/// Whether a buffer a queued reply reads from is being unregistered.
fn any_revoked(replies: &[Reply]) -> bool {
    replies
        .iter()
        .any(|r| r.payload.as_ref().is_some_and(RangeGuard::is_revoked))
}

/// Drops `n` sent bytes from the front of a part list; returns how many parts are done.
fn advance(parts: &mut [(*const u8, usize)], mut n: usize) -> usize {
    let mut done = 0;
    for part in parts.iter_mut() {
        let take = n.min(part.1);
        part.0 = part.0.wrapping_add(take);
        part.1 -= take;
        n -= take;
        if part.1 > 0 {
            break;
        }
        done += 1;
    }
    done
}

#[cfg(test)]
mod tests {
    use std::io::Write;
    use std::sync::{mpsc, Arc};

    use super::*;
    use crate::net::{ConnServer, ServerLimits};

    /// Bytes of the registered buffer each test reads: far more than the socket
    /// buffers hold.
    const LEN: usize = 64 << 20;

    /// A data server over one registered `LEN`-byte buffer (timeouts far beyond the
    /// test: only an unregistration may end an answer) and a peer whose READ of the
    /// whole buffer has begun: the status came with the first payload bytes, so from
    /// here on the server pins the buffer while it sends.
    struct ReadUnderway {
        memory: Arc<LocalMemory>,
        _buf: Vec<u8>,
        addr: u64,
        server: ConnServer,
        peer: TcpStream,
    }

    fn read_underway() -> ReadUnderway {
        crate::sys::ignore_sigpipe();
        let buf = vec![7u8; LEN];
        let addr = buf.as_ptr() as u64;
        let memory = Arc::new(LocalMemory::new());
        memory.register(addr, LEN as u64, "cpu:0").unwrap();
        let patient = ServerLimits {
            idle_timeout: Duration::from_secs(3600),
            frame_timeout: Duration::from_secs(3600),
            ..ServerLimits::default()
        };
        let m = memory.clone();
        let handler = Arc::new(move |s, t: &_| serve(s, t, &m, 0));
        let server = ConnServer::spawn("127.0.0.1:0".parse().unwrap(), "t", patient, handler);
        let server = server.unwrap();
        let mut peer = TcpStream::connect(server.local_addr()).unwrap();
        peer.set_read_timeout(Some(Duration::from_secs(30)))
            .unwrap();
        let read = Header {
            size: LEN as u64,
            addr,
            op: DataOp::Read,
        };
        peer.write_all(&read.encode()).unwrap();
        let mut status = [0u8; STATUS_LEN];
        peer.read_exact(&mut status).unwrap();
        assert_eq!(Status::decode(&status).unwrap(), Status::Ok);
        ReadUnderway {
            memory,
            _buf: buf,
            addr,
            server,
            peer,
        }
    }

    /// Unregisters the buffer on another thread; whether that returned within a bound
    /// far above a prompt return (the old server held it for its 30 s stall timeout,
    /// and indefinitely against a reader that drains a little now and then).
    fn unregister_returns(r: &ReadUnderway) -> bool {
        let (tx, rx) = mpsc::channel();
        let (m, addr) = (r.memory.clone(), r.addr);
        std::thread::spawn(move || tx.send(m.unregister(addr).is_ok()));
        rx.recv_timeout(Duration::from_secs(20)) == Ok(true)
    }

    #[test]
    fn unregister_returns_while_a_reader_stalls_mid_answer() {
        let mut r = read_underway();
        assert!(
            unregister_returns(&r),
            "unregister stayed blocked by a stalled reader"
        );
        // The reader sees its answer cut short.
        let mut sink = vec![0u8; 1 << 20];
        let mut got = 0;
        while let Ok(n @ 1..) = r.peer.read(&mut sink) {
            got += n;
        }
        assert!(got < LEN);
        drop(r.server);
    }

    #[test]
    fn unregister_returns_while_a_reader_trickles_steadily() {
        let r = read_underway();
        // A peer that never stalls but drains slowly (16 KiB every 10 ms: the whole
        // answer would take 40 s), so the server always makes some progress.
        let mut peer = r.peer.try_clone().unwrap();
        let reader = std::thread::spawn(move || {
            let mut chunk = vec![0u8; 16 << 10];
            let mut got = 0;
            while let Ok(n @ 1..) = peer.read(&mut chunk) {
                got += n;
                std::thread::sleep(Duration::from_millis(10));
            }
            got
        });
        assert!(
            unregister_returns(&r),
            "unregister stayed blocked by a slow but steady reader"
        );
        drop(r.server);
        assert!(reader.join().unwrap() < LEN, "the answer was cut short");
    }

    /// A data server over `len` registered bytes with these limits, and the buffer's
    /// address.
    fn data_server(len: usize, limits: ServerLimits) -> (ConnServer, Arc<LocalMemory>, Vec<u8>) {
        crate::sys::ignore_sigpipe();
        let buf = vec![7u8; len];
        let memory = Arc::new(LocalMemory::new());
        memory
            .register(buf.as_ptr() as u64, len as u64, "cpu:0")
            .unwrap();
        let m = memory.clone();
        let handler = Arc::new(move |s, t: &_| serve(s, t, &m, 0));
        let server = ConnServer::spawn("127.0.0.1:0".parse().unwrap(), "t", limits, handler);
        (server.unwrap(), memory, buf)
    }

    fn write_header(buf: &[u8], size: usize) -> [u8; HEADER_LEN] {
        Header {
            size: size as u64,
            addr: buf.as_ptr() as u64,
            op: DataOp::Write,
        }
        .encode()
    }

    #[test]
    fn a_write_payload_trickled_in_is_cut_at_the_frame_deadline() {
        let limits = ServerLimits {
            idle_timeout: Duration::from_secs(3600),
            frame_timeout: Duration::from_millis(200),
            ..ServerLimits::default()
        };
        let (server, _memory, buf) = data_server(64 << 10, limits);
        let mut peer = TcpStream::connect(server.local_addr()).unwrap();
        peer.write_all(&write_header(&buf, buf.len())).unwrap();
        // Learns when the server hangs up (the read ends).
        let mut watcher = peer.try_clone().unwrap();
        let (closed_tx, closed) = mpsc::channel();
        std::thread::spawn(move || {
            let _ = watcher.read(&mut [0u8; 64]);
            let _ = closed_tx.send(());
        });
        // A byte every 20 ms: never silent for a tenth of the deadline, and the whole
        // payload would take 20 minutes. Give up after 5 s, 25 deadlines.
        let mut hung_up = false;
        for _ in 0..250 {
            if closed.try_recv().is_ok() || peer.write_all(&[1]).is_err() {
                hung_up = true;
                break;
            }
            std::thread::sleep(Duration::from_millis(20));
        }
        assert!(
            hung_up,
            "a trickled WRITE kept its connection past 25 frame deadlines"
        );
        drop(server);
    }

    #[test]
    fn writers_that_never_finish_a_payload_do_not_hold_the_per_peer_cap() {
        const LEN: usize = 32 << 20;
        let limits = ServerLimits {
            max_per_peer: 4,
            idle_timeout: Duration::from_secs(3600),
            frame_timeout: Duration::from_secs(3600),
            ..ServerLimits::default()
        };
        let (server, _memory, buf) = data_server(LEN, limits);
        // Each fills the cap with a WRITE it never finishes. Half the payload is more
        // than the socket buffers hold, so once it is sent the server has read the
        // header and is taking the payload.
        let half = vec![1u8; LEN / 2];
        let writers: Vec<TcpStream> = (0..4)
            .map(|_| {
                let mut w = TcpStream::connect(server.local_addr()).unwrap();
                w.write_all(&write_header(&buf, LEN)).unwrap();
                w.write_all(&half).unwrap();
                w
            })
            .collect();
        // A newcomer from the same address is still served.
        let mut reader = TcpStream::connect(server.local_addr()).unwrap();
        reader
            .set_read_timeout(Some(Duration::from_secs(30)))
            .unwrap();
        let read = Header {
            size: 16,
            addr: buf.as_ptr() as u64,
            op: DataOp::Read,
        };
        reader.write_all(&read.encode()).unwrap();
        let mut answer = [0u8; STATUS_LEN + 16];
        let served = reader.read_exact(&mut answer);
        assert!(
            served.is_ok(),
            "a newcomer was locked out by writers that never finished: {served:?}"
        );
        let status: [u8; STATUS_LEN] = answer[..STATUS_LEN].try_into().unwrap();
        assert_eq!(Status::decode(&status).unwrap(), Status::Ok);
        drop(writers);
        drop(server);
    }
}
