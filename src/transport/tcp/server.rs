//! The data server: one thread per connection, blocking I/O straight between the
//! socket and registered memory. Every range is validated against one registered
//! buffer before a byte moves; a rejected request is answered and the connection
//! closed, as Mooncake's v2 server does.

use std::io::{self, Read};
use std::net::TcpStream;
use std::os::fd::AsRawFd;
use std::time::Duration;

use crate::memory::LocalMemory;
use crate::sys;
use crate::wire::data::{DataOp, Header, Status, HEADER_LEN};

/// A peer that stalls mid-payload longer than this loses its connection, so it cannot
/// hold a buffer's unregistration hostage.
const STALL_TIMEOUT: Duration = Duration::from_secs(30);

pub fn serve(mut stream: TcpStream, memory: &LocalMemory, socket_buffer: usize) {
    let peer = stream
        .peer_addr()
        .map(|a| a.to_string())
        .unwrap_or_default();
    let _ = stream.set_nodelay(true);
    let _ = stream.set_read_timeout(Some(STALL_TIMEOUT));
    let _ = stream.set_write_timeout(Some(STALL_TIMEOUT));
    sys::set_socket_buffers(&stream, socket_buffer);
    loop {
        let mut raw = [0u8; HEADER_LEN];
        match read_full(&mut stream, &mut raw) {
            Ok(()) => {}
            // An idle persistent connection is normal: keep waiting.
            Err((e, 0)) if is_timeout(&e) => continue,
            Err((e, n)) => {
                if n > 0 || e.kind() != io::ErrorKind::UnexpectedEof {
                    log::debug!("tcp data {peer}: header read failed after {n} bytes: {e}");
                }
                return;
            }
        }
        let header = match Header::decode(&raw) {
            Ok(h) => h,
            Err(e) => {
                log::warn!("tcp data {peer}: {e}; closing");
                reject(&stream);
                return;
            }
        };
        let guard = match memory.guard(header.addr, header.size) {
            Ok(g) => g,
            Err(e) => {
                log::warn!("tcp data {peer}: {:?} rejected: {e}", header.op);
                reject(&stream);
                return;
            }
        };
        let result = match header.op {
            DataOp::Write => {
                // SAFETY: `guard` pins a validated registered range for this scope;
                // only this connection writes it now.
                let dst = unsafe { guard.bytes_mut() };
                read_full(&mut stream, dst)
                    .map_err(|(e, n)| {
                        io::Error::new(
                            e.kind(),
                            format!("payload short by {} bytes: {e}", dst.len() - n),
                        )
                    })
                    .and_then(|()| send_all(&stream, &[(Status::Ok.encode().as_ptr(), 8)]))
            }
            DataOp::Read => {
                let status = Status::Ok.encode();
                send_all(
                    &stream,
                    &[
                        (status.as_ptr(), 8),
                        (guard.ptr() as *const u8, guard.len() as usize),
                    ],
                )
            }
        };
        drop(guard);
        if let Err(e) = result {
            log::debug!(
                "tcp data {peer}: {:?} of {} bytes failed: {e}",
                header.op,
                header.size
            );
            return;
        }
    }
}

fn is_timeout(e: &io::Error) -> bool {
    matches!(
        e.kind(),
        io::ErrorKind::WouldBlock | io::ErrorKind::TimedOut
    )
}

fn reject(stream: &TcpStream) {
    let status = Status::Rejected.encode();
    let _ = send_all(stream, &[(status.as_ptr(), 8)]);
}

/// Reads exactly `buf.len()` bytes; on failure also says how many arrived.
fn read_full(stream: &mut TcpStream, buf: &mut [u8]) -> Result<(), (io::Error, usize)> {
    let mut got = 0;
    while got < buf.len() {
        match stream.read(&mut buf[got..]) {
            Ok(0) => return Err((io::ErrorKind::UnexpectedEof.into(), got)),
            Ok(n) => got += n,
            Err(e) if e.kind() == io::ErrorKind::Interrupted => {}
            Err(e) => return Err((e, got)),
        }
    }
    Ok(())
}

/// Writes all parts with as few syscalls as the socket allows.
fn send_all(stream: &TcpStream, parts: &[(*const u8, usize)]) -> io::Result<()> {
    let mut parts: Vec<(*const u8, usize)> = parts.to_vec();
    while parts.iter().any(|p| p.1 > 0) {
        // SAFETY: every part points into a live buffer of the stated length (a status
        // array on the caller's stack or a guarded registered range).
        let n = match unsafe { sys::writev(stream.as_raw_fd(), &parts) } {
            Ok(0) => return Err(io::ErrorKind::WriteZero.into()),
            Ok(n) => n,
            Err(e) if e.kind() == io::ErrorKind::Interrupted => continue,
            Err(e) => return Err(e),
        };
        advance(&mut parts, n);
    }
    Ok(())
}

/// Drops `n` sent bytes from the front of a part list.
fn advance(parts: &mut [(*const u8, usize)], mut n: usize) {
    for part in parts.iter_mut() {
        let take = n.min(part.1);
        part.0 = part.0.wrapping_add(take);
        part.1 -= take;
        n -= take;
    }
}
