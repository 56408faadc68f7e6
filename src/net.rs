//! A thread-per-connection TCP server with a clean shutdown: the accept loop (woken
//! through an eventfd) and every connection thread are stopped and joined when the
//! server is dropped. The RPC servers, the TCP transport and HTTP all run on it.

use std::collections::HashMap;
use std::io;
use std::net::{Shutdown, SocketAddr, TcpListener, TcpStream};
use std::os::fd::AsRawFd;
use std::sync::{Arc, Mutex, MutexGuard};
use std::thread::JoinHandle;
use std::time::Duration;

use crate::sys::EventFd;

pub type ConnHandler = Arc<dyn Fn(TcpStream) + Send + Sync>;

/// How long the accept loop backs off after a failed accept (out of descriptors and
/// the like); shutdown still wakes it at once.
const ACCEPT_BACKOFF: Duration = Duration::from_millis(100);

#[derive(Default)]
struct Conns {
    next_id: u64,
    /// A clone of every live connection's stream, so shutdown can unblock its thread.
    streams: HashMap<u64, TcpStream>,
    /// Connection threads not yet joined (finished ones are reaped on each accept).
    threads: Vec<JoinHandle<()>>,
}

/// What a `ConnServer` shares with its accept and connection threads: the shutdown
/// wake-up, the connection limit and the live connections.
struct ConnServerState {
    /// Notified once, on shutdown.
    wake: EventFd,
    max_conns: usize,
    conns: Mutex<Conns>,
}

fn lock(m: &Mutex<Conns>) -> MutexGuard<'_, Conns> {
    m.lock().unwrap_or_else(|e| e.into_inner())
}

pub struct ConnServer {
    addr: SocketAddr,
    shared: Arc<ConnServerState>,
    accept: Option<JoinHandle<()>>,
}

impl ConnServer {
    /// Binds `addr` (port 0 picks one) and serves each accepted connection on its own
    /// thread named after `name`.
    pub fn spawn(addr: SocketAddr, name: &str, handler: ConnHandler) -> io::Result<ConnServer> {
        ConnServer::spawn_limited(addr, name, usize::MAX, handler)
    }

    /// As [`ConnServer::spawn`], closing new connections at once while `max_conns`
    /// are being served.
    pub fn spawn_limited(
        addr: SocketAddr,
        name: &str,
        max_conns: usize,
        handler: ConnHandler,
    ) -> io::Result<ConnServer> {
        let listener = TcpListener::bind(addr)?;
        listener.set_nonblocking(true)?;
        let addr = listener.local_addr()?;
        let shared = Arc::new(ConnServerState {
            wake: EventFd::new()?,
            max_conns,
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

    pub fn local_addr(&self) -> SocketAddr {
        self.addr
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
            for stream in conns.streams.values() {
                let _ = stream.shutdown(Shutdown::Both);
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
                    log::warn!("{name}: accept failed: {e}");
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
        lock(&self.0.conns).streams.remove(&self.1);
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
            log::warn!("{name}: setting up connection from {peer}: {e}");
            return;
        }
    };
    let finished = {
        let mut conns = lock(&shared.conns);
        if conns.streams.len() >= shared.max_conns {
            log::warn!("{name}: refusing connection from {peer} (too many)");
            return;
        }
        let id = conns.next_id;
        conns.next_id += 1;
        conns.streams.insert(id, control);
        let (h, s) = (handler.clone(), shared.clone());
        let spawned = std::thread::Builder::new()
            .name(format!("{name}-{}", stream.as_raw_fd()))
            .spawn(move || {
                // Made in the thread: a failed spawn must not drop one here, under
                // the lock it takes.
                let _guard = Deregister(s, id);
                h(stream);
            });
        match spawned {
            Ok(t) => conns.threads.push(t),
            Err(e) => {
                log::warn!("{name}: cannot spawn connection thread: {e}");
                conns.streams.remove(&id);
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

#[cfg(test)]
mod tests {
    use super::*;
    use std::io::{Read, Write};

    /// Echoes bytes until the peer closes.
    fn echo(mut s: TcpStream) {
        let mut b = [0u8; 64];
        while let Ok(n @ 1..) = s.read(&mut b) {
            if s.write_all(&b[..n]).is_err() {
                return;
            }
        }
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

    #[test]
    fn limit_refuses_and_shutdown_closes_open_connections() {
        let addr = "127.0.0.1:0".parse().unwrap();
        let mut server = ConnServer::spawn_limited(addr, "t", 1, Arc::new(echo)).unwrap();
        let mut first = connect(&server);
        assert!(round_trip(&mut first)); // served, so it holds the only slot
        let mut second = connect(&server);
        assert!(!round_trip(&mut second)); // closed by the server
        server.shutdown(); // must not wait for `first` to close
        let mut b = [0u8; 1];
        assert!(matches!(first.read(&mut b), Ok(0) | Err(_)));
        server.shutdown(); // idempotent
    }

    #[test]
    fn a_finished_connection_frees_its_slot() {
        let addr = "127.0.0.1:0".parse().unwrap();
        let server = ConnServer::spawn_limited(addr, "t", 1, Arc::new(echo)).unwrap();
        for _ in 0..3 {
            let mut s = connect(&server);
            assert!(round_trip(&mut s));
            s.shutdown(Shutdown::Write).unwrap();
            let mut b = [0u8; 1];
            // The handler returns on our EOF and closes: its slot is free once we see it.
            assert!(matches!(s.read(&mut b), Ok(0)));
        }
    }
}
