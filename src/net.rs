//! A thread-per-connection TCP server with a clean shutdown: the accept loop and every
//! connection thread are stopped and joined when the server is dropped.

use std::collections::HashMap;
use std::io;
use std::net::{Shutdown, SocketAddr, TcpListener, TcpStream};
use std::os::fd::AsRawFd;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::thread::JoinHandle;

pub type ConnHandler = Arc<dyn Fn(TcpStream) + Send + Sync>;

/// A live connection: a handle to shut its socket down, and its thread.
type Conn = (TcpStream, Option<JoinHandle<()>>);

struct Shared {
    stopping: AtomicBool,
    next_id: AtomicU64,
    /// Live connections, so shutdown can unblock their threads.
    conns: Mutex<HashMap<u64, Conn>>,
}

pub struct ConnServer {
    addr: SocketAddr,
    shared: Arc<Shared>,
    accept: Option<JoinHandle<()>>,
}

impl ConnServer {
    /// Binds `addr` (port 0 picks one) and serves each accepted connection on its own
    /// thread named `name`.
    pub fn spawn(addr: SocketAddr, name: &str, handler: ConnHandler) -> io::Result<ConnServer> {
        let listener = TcpListener::bind(addr)?;
        let addr = listener.local_addr()?;
        let shared = Arc::new(Shared {
            stopping: AtomicBool::new(false),
            next_id: AtomicU64::new(0),
            conns: Mutex::new(HashMap::new()),
        });
        let s = shared.clone();
        let thread_name = name.to_owned();
        let accept = std::thread::Builder::new()
            .name(format!("{name}-accept"))
            .spawn(move || accept_loop(listener, s, thread_name, handler))?;
        Ok(ConnServer {
            addr,
            shared,
            accept: Some(accept),
        })
    }

    pub fn local_addr(&self) -> SocketAddr {
        self.addr
    }

    pub fn shutdown(&mut self) {
        let Some(accept) = self.accept.take() else {
            return;
        };
        self.shared.stopping.store(true, Ordering::SeqCst);
        // Wake the blocking accept with a throw-away connection.
        let _ = TcpStream::connect(self.addr);
        let _ = accept.join();
        let conns: Vec<_> = {
            let mut map = self.shared.conns.lock().unwrap_or_else(|e| e.into_inner());
            map.drain().collect()
        };
        for (_, (stream, handle)) in conns {
            let _ = stream.shutdown(Shutdown::Both);
            if let Some(h) = handle {
                let _ = h.join();
            }
        }
    }
}

impl Drop for ConnServer {
    fn drop(&mut self) {
        self.shutdown();
    }
}

fn accept_loop(listener: TcpListener, shared: Arc<Shared>, name: String, handler: ConnHandler) {
    loop {
        let stream = match listener.accept() {
            Ok((stream, _)) => stream,
            Err(e) if e.kind() == io::ErrorKind::Interrupted => continue,
            Err(e) => {
                if shared.stopping.load(Ordering::SeqCst) {
                    return;
                }
                // Out of descriptors and the like: log, back off briefly, keep serving.
                log::warn!("{name}: accept failed: {e}");
                std::thread::sleep(std::time::Duration::from_millis(10));
                continue;
            }
        };
        if shared.stopping.load(Ordering::SeqCst) {
            return;
        }
        let Ok(control) = stream.try_clone() else {
            continue;
        };
        let id = shared.next_id.fetch_add(1, Ordering::Relaxed);
        let mut conns = shared.conns.lock().unwrap_or_else(|e| e.into_inner());
        // Reap finished connections so the table tracks only live ones.
        conns.retain(|_, (_, h)| !h.as_ref().is_some_and(|h| h.is_finished()));
        let (h, s) = (handler.clone(), shared.clone());
        let fd = stream.as_raw_fd();
        let spawned = std::thread::Builder::new()
            .name(format!("{name}-{fd}"))
            .spawn(move || {
                h(stream);
                s.conns
                    .lock()
                    .unwrap_or_else(|e| e.into_inner())
                    .remove(&id);
            });
        match spawned {
            Ok(handle) => {
                conns.insert(id, (control, Some(handle)));
            }
            Err(e) => log::warn!("{name}: cannot spawn connection thread: {e}"),
        }
    }
}
