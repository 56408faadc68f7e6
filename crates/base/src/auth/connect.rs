//! The two places a connection is authenticated: [`connect`], which every client
//! connect site calls, and [`guard`], which wraps every server's connection handler.

use std::io::{self, Read, Write};
use std::net::{SocketAddr, TcpStream};
use std::sync::Arc;
use std::time::{Duration, Instant};

use super::challenge::{self, ClientHandshake};
use super::ClusterSecret;
use crate::net::{ConnHandler, ConnTicket};

/// How long a handshake may take, all messages together: a silent or slow peer is
/// refused after this.
pub const HANDSHAKE_TIMEOUT: Duration = Duration::from_secs(5);

/// Connects to `addr` within `timeout` and, with a secret, runs the client handshake
/// (within `timeout` again, at most [`HANDSHAKE_TIMEOUT`]) before handing the stream
/// back. Without a secret it
/// is a plain connect. A refused handshake is a `PermissionDenied` error.
pub fn connect(
    addr: &SocketAddr,
    timeout: Duration,
    secret: Option<&ClusterSecret>,
) -> io::Result<TcpStream> {
    let mut stream = TcpStream::connect_timeout(addr, timeout)?;
    if let Some(secret) = secret {
        // The address actually dialled (resolved), as the server sees it accepted.
        let mut handshake = ClientHandshake::new(secret, stream.peer_addr()?)?;
        let mut io = Deadline::new(&mut stream, timeout.min(HANDSHAKE_TIMEOUT));
        // A blocking read that times out reports WouldBlock, which `advance` treats
        // as "not yet".
        if !handshake.advance(&mut io)? {
            return Err(io::Error::new(
                io::ErrorKind::TimedOut,
                "no answer to the cluster handshake in time",
            ));
        }
        io.restore()?;
    }
    Ok(stream)
}

/// Wraps a server's handler: with a secret, each connection runs the server
/// handshake first (within [`HANDSHAKE_TIMEOUT`]) and only an authenticated peer
/// reaches `handler`; a refused one is logged (rate-limited) and closed. Without a
/// secret the handler is returned as it is.
pub fn guard(
    secret: Option<ClusterSecret>,
    what: &'static str,
    handler: ConnHandler,
) -> ConnHandler {
    let Some(secret) = secret else {
        return handler;
    };
    Arc::new(move |mut stream: TcpStream, ticket: &ConnTicket| {
        let peer = stream
            .peer_addr()
            .map_or_else(|_| "?".to_owned(), |a| a.to_string());
        let local = match stream.local_addr() {
            Ok(a) => a,
            Err(e) => return super::log_refusal(what, &peer, &e.to_string()),
        };
        let mut io = Deadline::new(&mut stream, HANDSHAKE_TIMEOUT);
        let outcome = challenge::serve(&mut io, &secret, &local).and_then(|_| io.restore());
        match outcome {
            Ok(()) => {
                // An authenticated peer is a known one: never displaced by a flood.
                ticket.prove();
                handler(stream, ticket)
            }
            Err(e) => {
                let why = match e.kind() {
                    io::ErrorKind::WouldBlock | io::ErrorKind::TimedOut => {
                        "no cluster handshake in time".to_owned()
                    }
                    io::ErrorKind::UnexpectedEof => {
                        "closed during the cluster handshake".to_owned()
                    }
                    _ => e.to_string(),
                };
                super::log_refusal(what, &peer, &why);
            }
        }
    })
}

/// A stream whose reads and writes together end by a deadline (each call's timeout is
/// what is left), so a peer trickling a byte at a time cannot stretch a handshake.
struct Deadline<'a> {
    stream: &'a mut TcpStream,
    end: Instant,
}

impl<'a> Deadline<'a> {
    fn new(stream: &'a mut TcpStream, limit: Duration) -> Deadline<'a> {
        Deadline {
            stream,
            end: Instant::now() + limit,
        }
    }

    fn left(&self) -> io::Result<Duration> {
        let left = self.end.saturating_duration_since(Instant::now());
        if left.is_zero() {
            return Err(io::ErrorKind::TimedOut.into());
        }
        Ok(left)
    }

    /// Puts the stream back as a fresh connection has it: no timeouts (the caller sets
    /// its own).
    fn restore(self) -> io::Result<()> {
        self.stream.set_read_timeout(None)?;
        self.stream.set_write_timeout(None)
    }
}

impl Read for Deadline<'_> {
    fn read(&mut self, buf: &mut [u8]) -> io::Result<usize> {
        self.stream.set_read_timeout(Some(self.left()?))?;
        self.stream.read(buf)
    }
}

impl Write for Deadline<'_> {
    fn write(&mut self, buf: &[u8]) -> io::Result<usize> {
        self.stream.set_write_timeout(Some(self.left()?))?;
        self.stream.write(buf)
    }

    fn flush(&mut self) -> io::Result<()> {
        self.stream.flush()
    }
}
