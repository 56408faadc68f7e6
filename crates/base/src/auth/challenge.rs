//! The connection handshake: mutual challenge-response over fresh nonces, before any
//! other byte on a connection.
//!
//! ```text
//! client → server  HELLO      "MCAUTH1\n" | client nonce (32)
//! server → client  CHALLENGE  "MCAUTH1\n" | server nonce (32) | server proof (32)
//! client → server  PROOF      client proof (32)
//! server → client  VERDICT    "MCAUTHOK"
//! proof(role) = HMAC-SHA256(secret, CONTEXT | role | len32 | server address | client nonce | server nonce)
//! ```
//!
//! Both nonces are fresh per connection, so a recorded proof is worth nothing on
//! another one; the role ("server" / "client") is inside the MAC, so a proof cannot
//! be reflected back to its sender; the server's address (as dialled by the client and
//! as accepted by the server) is inside it too, so a peer that gets a client to dial it
//! cannot relay that client's handshake to a real server. A client that reaches the
//! server through address translation (NAT, a proxy) sees another address than the
//! server does and is refused. The client checks the server's proof before it
//! sends its own (a fake server learns nothing it can use), and sends no request
//! before the verdict. A refusal is a closed connection: a peer without the secret
//! is told nothing more.

use std::io::{self, Read, Write};
use std::net::SocketAddr;

use super::ClusterSecret;
use crate::util::hmac::{self, HmacSha256};

/// Opens HELLO and CHALLENGE: no Mooncake data-plane or RPC frame starts like this.
pub const MAGIC: &[u8; 8] = b"MCAUTH1\n";
/// The server's acceptance.
pub const VERDICT: &[u8; 8] = b"MCAUTHOK";
/// Bytes of a nonce.
pub const NONCE_LEN: usize = 32;
/// Bytes of a proof.
pub const PROOF_LEN: usize = 32;
/// Bytes of HELLO.
pub const HELLO_LEN: usize = MAGIC.len() + NONCE_LEN;
/// Bytes of CHALLENGE.
pub const CHALLENGE_LEN: usize = MAGIC.len() + NONCE_LEN + PROOF_LEN;
/// Binds proofs to this protocol and version.
const CONTEXT: &[u8] = b"mooncake cluster auth v1\0";

/// Who is proving: the MAC covers it, so one side's proof never passes as the other's.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Role {
    /// The side that accepted the connection.
    Server,
    /// The side that opened it.
    Client,
}

/// The proof `role` gives for a connection to `server` (the server's address as the
/// client dialled it and the server accepted it) with these nonces. Binding the
/// address means a proof relayed from a connection to another server is worthless: a
/// peer without the secret that gets a client to dial it cannot pass the client's
/// handshake on to a real server, nor the server's back.
pub fn proof(
    secret: &ClusterSecret,
    role: Role,
    server: &SocketAddr,
    client_nonce: &[u8; NONCE_LEN],
    server_nonce: &[u8; NONCE_LEN],
) -> [u8; PROOF_LEN] {
    let mut m = HmacSha256::new(secret.key());
    m.update(CONTEXT);
    m.update(match role {
        Role::Server => b"server",
        Role::Client => b"client",
    });
    let endpoint = server.to_string();
    m.update(&(endpoint.len() as u32).to_le_bytes());
    m.update(endpoint.as_bytes());
    m.update(client_nonce);
    m.update(server_nonce);
    m.finish()
}

fn refused(why: &str) -> io::Error {
    io::Error::new(io::ErrorKind::PermissionDenied, why.to_owned())
}

/// Runs the server's half on a blocking stream (the caller bounds its time). `Err`
/// means the peer is refused; the caller closes the connection.
/// `local` is the address the connection was accepted on.
pub fn serve(
    stream: &mut (impl Read + Write),
    secret: &ClusterSecret,
    local: &SocketAddr,
) -> io::Result<()> {
    let mut magic = [0u8; MAGIC.len()];
    stream.read_exact(&mut magic)?;
    if &magic != MAGIC {
        return Err(refused("no cluster handshake (peer without the secret?)"));
    }
    let mut client_nonce = [0u8; NONCE_LEN];
    stream.read_exact(&mut client_nonce)?;
    let mut server_nonce = [0u8; NONCE_LEN];
    super::fill_random(&mut server_nonce)?;
    let mut challenge = Vec::with_capacity(CHALLENGE_LEN);
    challenge.extend_from_slice(MAGIC);
    challenge.extend_from_slice(&server_nonce);
    challenge.extend_from_slice(&proof(
        secret,
        Role::Server,
        local,
        &client_nonce,
        &server_nonce,
    ));
    stream.write_all(&challenge)?;
    let mut answer = [0u8; PROOF_LEN];
    stream.read_exact(&mut answer)?;
    let want = proof(secret, Role::Client, local, &client_nonce, &server_nonce);
    if !hmac::equal(&answer, &want) {
        return Err(refused("wrong proof of the cluster secret"));
    }
    stream.write_all(VERDICT)
}

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Stage {
    SendHello,
    ReadChallenge,
    SendProof,
    ReadVerdict,
    Done,
}

/// The client's half as a state machine, so a non-blocking connection can run it a
/// readiness event at a time; a blocking one just calls [`advance`](Self::advance)
/// once.
pub struct ClientHandshake {
    secret: ClusterSecret,
    server: SocketAddr,
    client_nonce: [u8; NONCE_LEN],
    stage: Stage,
    out: Vec<u8>,
    sent: usize,
    input: [u8; CHALLENGE_LEN],
    got: usize,
}

impl ClientHandshake {
    /// A handshake with a fresh nonce, for a connection to `server` (the address
    /// dialled).
    pub fn new(secret: &ClusterSecret, server: SocketAddr) -> io::Result<ClientHandshake> {
        let mut client_nonce = [0u8; NONCE_LEN];
        super::fill_random(&mut client_nonce)?;
        let mut out = Vec::with_capacity(HELLO_LEN);
        out.extend_from_slice(MAGIC);
        out.extend_from_slice(&client_nonce);
        Ok(ClientHandshake {
            secret: secret.clone(),
            server,
            client_nonce,
            stage: Stage::SendHello,
            out,
            sent: 0,
            input: [0; CHALLENGE_LEN],
            got: 0,
        })
    }

    /// Moves the handshake on as far as the stream allows: `Ok(true)` once accepted,
    /// `Ok(false)` when the stream would block, `Err` when it failed (the server did
    /// not prove the secret, refused ours, or went away).
    pub fn advance(&mut self, stream: &mut (impl Read + Write)) -> io::Result<bool> {
        loop {
            let step = match self.stage {
                Stage::Done => return Ok(true),
                Stage::SendHello | Stage::SendProof => self.send(stream),
                Stage::ReadChallenge => self.receive(stream, CHALLENGE_LEN),
                Stage::ReadVerdict => self.receive(stream, VERDICT.len()),
            };
            match step {
                Ok(true) => self.next_stage()?,
                Ok(false) => {}
                Err(e) if e.kind() == io::ErrorKind::WouldBlock => return Ok(false),
                Err(e) if e.kind() == io::ErrorKind::Interrupted => {}
                Err(e) if e.kind() == io::ErrorKind::UnexpectedEof => return Err(refused(
                    "the peer closed during the cluster handshake (wrong secret, or it has none?)",
                )),
                Err(e) => return Err(e),
            }
        }
    }

    /// Writes what is left of `out`; true once all of it is out.
    fn send(&mut self, stream: &mut impl Write) -> io::Result<bool> {
        match stream.write(&self.out[self.sent..])? {
            0 => Err(io::ErrorKind::WriteZero.into()),
            n => {
                self.sent += n;
                Ok(self.sent == self.out.len())
            }
        }
    }

    /// Reads toward `len` bytes of input; true once they are in.
    fn receive(&mut self, stream: &mut impl Read, len: usize) -> io::Result<bool> {
        match stream.read(&mut self.input[self.got..len])? {
            0 => Err(io::ErrorKind::UnexpectedEof.into()),
            n => {
                self.got += n;
                Ok(self.got == len)
            }
        }
    }

    fn next_stage(&mut self) -> io::Result<()> {
        self.stage = match self.stage {
            Stage::SendHello => Stage::ReadChallenge,
            Stage::ReadChallenge => {
                let (magic, rest) = self.input.split_at(MAGIC.len());
                let (nonce, their_proof) = rest.split_at(NONCE_LEN);
                if magic != MAGIC {
                    return Err(refused("the peer does not speak the cluster handshake"));
                }
                let server_nonce: [u8; NONCE_LEN] = nonce.try_into().expect("nonce length");
                let want = proof(
                    &self.secret,
                    Role::Server,
                    &self.server,
                    &self.client_nonce,
                    &server_nonce,
                );
                if !hmac::equal(their_proof, &want) {
                    return Err(refused("the peer did not prove the cluster secret"));
                }
                self.out = proof(
                    &self.secret,
                    Role::Client,
                    &self.server,
                    &self.client_nonce,
                    &server_nonce,
                )
                .to_vec();
                self.sent = 0;
                self.got = 0;
                Stage::SendProof
            }
            Stage::SendProof => Stage::ReadVerdict,
            Stage::ReadVerdict => {
                if &self.input[..VERDICT.len()] != VERDICT {
                    return Err(refused("the peer answered the cluster handshake wrongly"));
                }
                Stage::Done
            }
            Stage::Done => Stage::Done,
        };
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::net::{TcpListener, TcpStream};
    use std::time::Duration;

    fn secret(s: &str) -> ClusterSecret {
        ClusterSecret::new(s.as_bytes()).unwrap()
    }

    /// A connected pair on loopback, both ends with a read timeout (a stuck test fails).
    fn pair() -> (TcpStream, TcpStream) {
        let l = TcpListener::bind("127.0.0.1:0").unwrap();
        let c = TcpStream::connect(l.local_addr().unwrap()).unwrap();
        let (s, _) = l.accept().unwrap();
        for x in [&c, &s] {
            x.set_read_timeout(Some(Duration::from_secs(10))).unwrap();
        }
        (c, s)
    }

    fn run(client: &str, server: &str) -> (io::Result<bool>, io::Result<()>) {
        let (mut c, mut s) = pair();
        let (cs, ss) = (secret(client), secret(server));
        std::thread::scope(|scope| {
            let local = s.local_addr().unwrap();
            let srv = scope.spawn(move || serve(&mut s, &ss, &local));
            let mut h = ClientHandshake::new(&cs, c.peer_addr().unwrap()).unwrap();
            let r = h.advance(&mut c);
            drop(c);
            (r, srv.join().unwrap())
        })
    }

    #[test]
    fn the_same_secret_is_accepted_both_ways() {
        let (c, s) = run("a shared cluster secret", "a shared cluster secret");
        assert!(c.unwrap());
        s.unwrap();
    }

    #[test]
    fn a_different_secret_fails_on_both_sides() {
        let (c, s) = run("one cluster secret", "another secret!!");
        // The client finds the server's proof wrong first and hangs up.
        assert_eq!(c.unwrap_err().kind(), io::ErrorKind::PermissionDenied);
        assert!(s.is_err());
    }

    #[test]
    fn no_handshake_is_refused_at_the_first_bytes() {
        let (mut c, mut s) = pair();
        // A Mooncake data header or RPC frame instead of HELLO.
        c.write_all(&[0u8; 40]).unwrap();
        let local = s.local_addr().unwrap();
        let e = serve(&mut s, &secret("k"), &local).unwrap_err();
        assert_eq!(e.kind(), io::ErrorKind::PermissionDenied);
    }

    #[test]
    fn a_reflected_server_proof_is_refused() {
        let (mut c, mut s) = pair();
        let k = secret("reflection test secret");
        let local = s.local_addr().unwrap();
        std::thread::scope(|scope| {
            let srv = scope.spawn(|| serve(&mut s, &k, &local));
            // The attacker sends a HELLO, then hands the server its own proof back.
            let challenge = hello(&mut c, &[7u8; NONCE_LEN]);
            c.write_all(&challenge[MAGIC.len() + NONCE_LEN..]).unwrap();
            let e = srv.join().unwrap().unwrap_err();
            assert_eq!(e.kind(), io::ErrorKind::PermissionDenied);
            let mut b = [0u8; 1];
            assert!(matches!(c.read(&mut b), Ok(0) | Err(_)), "no verdict");
        });
    }

    /// Sends a HELLO with `nonce` as a client would and returns the server's CHALLENGE.
    fn hello(c: &mut TcpStream, nonce: &[u8; NONCE_LEN]) -> [u8; CHALLENGE_LEN] {
        let mut hello = MAGIC.to_vec();
        hello.extend_from_slice(nonce);
        c.write_all(&hello).unwrap();
        let mut ch = [0u8; CHALLENGE_LEN];
        c.read_exact(&mut ch).unwrap();
        ch
    }

    #[test]
    fn a_replayed_client_proof_is_refused() {
        let k = secret("replay test secret");
        let nonce = [9u8; NONCE_LEN];
        // Recorded from an accepted connection: HELLO with `nonce`, then its proof.
        let (mut c, mut s) = pair();
        let local = s.local_addr().unwrap();
        let recorded = std::thread::scope(|scope| {
            let srv = scope.spawn(|| serve(&mut s, &k, &local));
            let ch = hello(&mut c, &nonce);
            let sn: [u8; NONCE_LEN] = ch[MAGIC.len()..MAGIC.len() + NONCE_LEN].try_into().unwrap();
            let p = proof(&k, Role::Client, &local, &nonce, &sn);
            c.write_all(&p).unwrap();
            srv.join().unwrap().unwrap();
            p
        });
        // The same HELLO and proof on a new connection meet a new server nonce.
        let (mut c, mut s) = pair();
        let local = s.local_addr().unwrap();
        std::thread::scope(|scope| {
            let srv = scope.spawn(|| serve(&mut s, &k, &local));
            hello(&mut c, &nonce);
            c.write_all(&recorded).unwrap();
            assert!(srv.join().unwrap().is_err());
        });
    }

    #[test]
    fn a_non_blocking_client_resumes_where_it_blocked() {
        let (mut c, mut s) = pair();
        let k = secret("non-blocking secret");
        c.set_nonblocking(true).unwrap();
        let mut h = ClientHandshake::new(&k, c.peer_addr().unwrap()).unwrap();
        // Nothing to read yet: HELLO goes out, then it would block.
        assert!(!h.advance(&mut c).unwrap());
        let local = s.local_addr().unwrap();
        std::thread::scope(|scope| {
            let srv = scope.spawn(|| serve(&mut s, &k, &local));
            let mut rounds = 0;
            while !h.advance(&mut c).unwrap() {
                rounds += 1;
                assert!(rounds < 100, "handshake did not finish");
                let mut p = libc::pollfd {
                    fd: std::os::fd::AsRawFd::as_raw_fd(&c),
                    events: libc::POLLIN,
                    revents: 0,
                };
                // SAFETY: one valid pollfd for the duration of the call.
                unsafe { libc::poll(&mut p, 1, 10_000) };
            }
            srv.join().unwrap().unwrap();
        });
        assert!(h.advance(&mut c).unwrap(), "stays accepted");
    }

    #[test]
    fn a_handshake_relayed_to_another_server_is_refused() {
        // The client dials a relay (no secret) believing it a cluster server; the relay
        // dials a real server and passes every message along both ways.
        let k = secret("relay test secret");
        let (mut client, mut relay_in) = pair();
        let (mut relay_out, mut server) = pair();
        let dialled = client.peer_addr().unwrap();
        let server_local = server.local_addr().unwrap();
        assert_ne!(dialled, server_local);
        std::thread::scope(|scope| {
            let srv = scope.spawn(|| serve(&mut server, &k, &server_local));
            let relay = scope.spawn(move || {
                let mut hello = [0u8; HELLO_LEN];
                relay_in.read_exact(&mut hello)?;
                relay_out.write_all(&hello)?;
                let mut challenge = [0u8; CHALLENGE_LEN];
                relay_out.read_exact(&mut challenge)?;
                relay_in.write_all(&challenge)?;
                let mut answer = [0u8; PROOF_LEN];
                relay_in.read_exact(&mut answer)?;
                relay_out.write_all(&answer)?;
                io::Result::Ok(())
            });
            let mut h = ClientHandshake::new(&k, dialled).unwrap();
            let e = h.advance(&mut client).unwrap_err();
            assert_eq!(e.kind(), io::ErrorKind::PermissionDenied, "{e}");
            drop(client);
            // The server never accepts: the relay has no valid proof to give it.
            assert!(srv.join().unwrap().is_err());
            let _ = relay.join();
        });
    }
}
