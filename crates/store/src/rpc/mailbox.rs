//! Same-host master connections through a mailbox ([`crate::mailbox`]).
//!
//! A loopback round trip costs ~10 µs of system calls on a VM, as much as the master's
//! whole handling of a put; a client on the master's host hands its requests over in
//! shared memory instead. Right after connecting (and authenticating), a client asks
//! for a mailbox (`MAILBOX_OFFER`); the master creates one and answers where it is. A
//! client on the same host, PID and network namespaces attaches, says so at once
//! (`MAILBOX_NUDGE`) and from then on posts each request there; the master serves the
//! connection from the mailbox. A client elsewhere goes on over TCP, and the master
//! closes the memfd at its next request. A client told not to
//! (`MC_STORE_MASTER_MAILBOX=0`) never asks.
//!
//! The TCP connection stays: frames that do not fit a mailbox slot (and pipelined
//! pairs, and long polls) travel on it, announced by a word in the mailbox so the
//! master knows to read them; its end tells either side that the other is gone (each
//! side looks at least every `PARK_SLICE`); and a master connection idle for a second
//! goes back to waiting on it (the client nudges it there), so connections idle
//! longer cost no wake-ups and keep the server's idle timeout.

use std::net::TcpStream;
use std::time::{Duration, Instant};

use super::{
    answer_frame, request_frame, Frame, Reply, ServerConn, CLIENT_SPIN, IO_TIMEOUT, MAILBOX_NUDGE,
    MAILBOX_OFFER,
};
use crate::codec::{Reader, Writer};
use crate::error::{Code, Error, Result};
use crate::mailbox::{Direction, Incoming, Mailbox, Offer, Outgoing};

/// How long a waiting side sleeps on the mailbox at a time before it looks at the
/// socket (the peer gone, the server shutting down).
const PARK_SLICE: Duration = Duration::from_millis(20);
/// A master connection without a request for this long waits on its socket instead
/// (shorter in tests, which wait for it).
const SOCKET_AFTER: Duration = if cfg!(test) {
    Duration::from_millis(100)
} else {
    Duration::from_secs(1)
};

/// The environment switch for clients: `0` keeps every connection on TCP.
pub const MAILBOX_ENV: &str = "MC_STORE_MASTER_MAILBOX";

/// Whether this process's clients ask for mailboxes (default: yes).
pub(super) fn wanted() -> bool {
    std::env::var(MAILBOX_ENV)
        .ok()
        .and_then(|v| crate::util::switch::parse(&v))
        .unwrap_or(true)
}

fn encode_offer(o: &Offer, w: &mut Writer) {
    w.str(&o.host)
        .u32(o.pid)
        .i32(o.fd)
        .u64(o.dev)
        .u64(o.ino)
        .u64(o.token[0])
        .u64(o.token[1]);
}

fn decode_offer(payload: &[u8]) -> Result<Offer> {
    let mut r = Reader::new(payload);
    let offer = Offer {
        host: r.string()?,
        pid: r.u32()?,
        fd: r.i32()?,
        dev: r.u64()?,
        ino: r.u64()?,
        token: [r.u64()?, r.u64()?],
    };
    r.finish()?;
    Ok(offer)
}

/// The master's side of `MAILBOX_OFFER`: a new mailbox, its offer in `out`
/// (nothing when none could be made).
pub(super) fn offer(out: &mut Vec<u8>, id: u64) -> Option<Mailbox> {
    let mailbox = Mailbox::create()
        .map_err(|e| log::debug!("master rpc: no mailbox to offer: {e}"))
        .ok();
    let offer = mailbox.as_ref().and_then(Mailbox::offer);
    answer_frame(out, MAILBOX_OFFER, id, |w| {
        if let Some(o) = &offer {
            encode_offer(o, w);
        }
        Ok(())
    });
    mailbox
}

/// Serves a connection whose client took `mailbox` up, until it ends.
pub(super) fn serve(conn: &mut ServerConn, mut mailbox: Mailbox) {
    mailbox.close_descriptor();
    let requests = mailbox.slot(Direction::Requests);
    let answers = mailbox.slot(Direction::Answers);
    let (mut seen, mut msg) = (0, Vec::new());
    requests.awake();
    let mut quiet_since = Instant::now();
    let mut looked_at_socket = quiet_since;
    // Poll first, and then only right after an answer (the client comes back soon,
    // if at all); otherwise sleep in slices.
    let mut poll = true;
    loop {
        let now = Instant::now();
        // Also while requests keep coming: the server may have shut the socket down.
        if now - looked_at_socket >= PARK_SLICE {
            if crate::sys::stream_ended(conn.stream) {
                return;
            }
            looked_at_socket = now;
        }
        let polled = if poll {
            poll = false;
            // The patient place (`RequestSpin`) is held for the poll only.
            conn.spin
                .spin_for(|spin| requests.spin(&mut seen, &mut msg, spin))
        } else {
            None
        };
        let got = polled.or_else(|| requests.park(&mut seen, &mut msg, PARK_SLICE));
        let go_on = match got {
            Some(Incoming::Here) => {
                conn.came_back();
                match Frame::parse(&msg) {
                    Ok(frame) => answer_in_mailbox(conn, &answers, frame),
                    Err(e) => {
                        crate::warn_limited!("master rpc {}: mailbox: {e}; closing", conn.peer);
                        false
                    }
                }
            }
            Some(Incoming::OnSocket(n)) => {
                conn.came_back();
                serve_socket_frames(conn, None, n)
            }
            None if quiet_since.elapsed() < SOCKET_AFTER || !requests.wait_on_socket(seen) => {
                continue
            }
            None => {
                // Blocks, with the server's idle timeout, until a nudge or an
                // announced frame arrives.
                let frame = conn.read_frame(false);
                requests.awake();
                match frame {
                    None => false,
                    Some(f) if f.method == MAILBOX_NUDGE => continue,
                    Some(f) => match requests.take(&mut seen, &mut msg) {
                        Some(Incoming::OnSocket(n)) => serve_socket_frames(conn, Some(f), n),
                        _ => {
                            crate::warn_limited!(
                                "master rpc {}: a frame the mailbox did not announce; closing",
                                conn.peer
                            );
                            false
                        }
                    },
                }
            }
        };
        if !go_on {
            return;
        }
        poll = true;
        quiet_since = Instant::now();
    }
}

/// Answers a request that came through the mailbox: there too when it fits, else
/// on the socket (announced there first). False once the connection is over.
fn answer_in_mailbox(conn: &mut ServerConn, answers: &crate::mailbox::Slot, frame: Frame) -> bool {
    let reply = conn.answer(frame);
    if reply == Reply::Close {
        return false;
    }
    if !Mailbox::fits(conn.out.len()) {
        answers.post(Outgoing::OnSocket(1));
        return conn.send_answer(reply);
    }
    answers.post(Outgoing::Here(&conn.out));
    conn.sent();
    reply == Reply::Send
}

/// Answers, on the socket, the `n` frames the mailbox announced there (`first`
/// already read). False once the connection is over.
fn serve_socket_frames(conn: &mut ServerConn, mut first: Option<Frame>, n: u32) -> bool {
    if n == 0 {
        crate::warn_limited!(
            "master rpc {}: mailbox announced no frames; closing",
            conn.peer
        );
        return false;
    }
    let mut left = n;
    while left > 0 {
        let Some(frame) = first.take().or_else(|| conn.read_frame(true)) else {
            return false;
        };
        if frame.method == MAILBOX_NUDGE {
            // Left from a mailbox message taken before its nudge was read.
            continue;
        }
        left -= 1;
        let reply = conn.answer(frame);
        if !conn.send_answer(reply) {
            return false;
        }
    }
    true
}

/// Tells the master, on its socket, to look at the mailbox.
fn nudge(stream: &TcpStream) -> std::io::Result<()> {
    let mut s = stream;
    std::io::Write::write_all(&mut s, &request_frame(MAILBOX_NUDGE, 0, &[]))
}

/// A client connection's mailbox.
pub(super) struct ClientMailbox {
    mailbox: Mailbox,
    /// The last answer taken.
    seen: u32,
    /// The last answer's bytes.
    msg: Vec<u8>,
}

/// Where an answer to a mailbox request is.
pub(super) enum Delivered {
    Here(Frame),
    /// On the socket: read it there.
    OnSocket,
}

impl ClientMailbox {
    /// The mailbox a `MAILBOX_OFFER` answer names, if this process can attach it;
    /// the master is told at once (a nudge on `stream`), so it serves the connection
    /// from the mailbox whatever the first request.
    pub(super) fn attach(payload: &[u8], stream: &TcpStream) -> Result<Option<ClientMailbox>> {
        let Some(mailbox) = Self::open(payload) else {
            return Ok(None);
        };
        nudge(stream).map_err(|e| Error::io("taking the mailbox up", e))?;
        Ok(Some(mailbox))
    }

    fn open(payload: &[u8]) -> Option<ClientMailbox> {
        if payload.is_empty() {
            return None;
        }
        let attached = decode_offer(payload)
            .map_err(|e| e.to_string())
            .and_then(|o| Mailbox::attach(&o).map_err(|e| e.to_string()));
        match attached {
            Ok(mailbox) => Some(ClientMailbox {
                mailbox,
                seen: 0,
                msg: Vec::new(),
            }),
            Err(e) => {
                log::debug!("master connection stays on TCP: {e}");
                None
            }
        }
    }

    /// Posts request frame `frame`, runs `meanwhile`, and waits for the answer. An
    /// error means the connection is unusable.
    pub(super) fn exchange(
        &mut self,
        stream: &TcpStream,
        frame: &[u8],
        meanwhile: &mut dyn FnMut(),
    ) -> Result<Delivered> {
        if self
            .mailbox
            .slot(Direction::Requests)
            .post(Outgoing::Here(frame))
            == crate::mailbox::Reader::OnSocket
        {
            nudge(stream).map_err(|e| Error::io("nudging the master", e))?;
        }
        meanwhile();
        let answers = self.mailbox.slot(Direction::Answers);
        let started = Instant::now();
        // Polled once (most answers come within it), then slept on in slices.
        let mut got = answers.spin(&mut self.seen, &mut self.msg, CLIENT_SPIN);
        loop {
            let got = got
                .take()
                .or_else(|| answers.park(&mut self.seen, &mut self.msg, PARK_SLICE));
            match got {
                Some(Incoming::Here) => return Frame::parse(&self.msg).map(Delivered::Here),
                Some(Incoming::OnSocket(_)) => return Ok(Delivered::OnSocket),
                None if crate::sys::stream_ended(stream) => {
                    return Err(Error::new(
                        Code::RpcFail,
                        "the master closed the connection",
                    ))
                }
                None if started.elapsed() > IO_TIMEOUT => {
                    return Err(Error::new(Code::Timeout, "no answer in the mailbox"))
                }
                None => {}
            }
        }
    }

    /// Whether the master's side waits on its socket (a request will nudge it).
    #[cfg(test)]
    pub(super) fn master_on_socket(&self) -> bool {
        self.mailbox.slot(Direction::Requests).reader_on_socket()
    }

    /// Says that `n` request frames go on the socket (posted before they are sent).
    pub(super) fn announce_socket_frames(&self, n: u32) {
        // A master waiting on its socket is woken by the frames themselves.
        self.mailbox
            .slot(Direction::Requests)
            .post(Outgoing::OnSocket(n));
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn an_offer_round_trips_and_a_cut_one_is_refused() {
        let offer = Offer {
            host: "boot|pid|net".into(),
            pid: 7,
            fd: 9,
            dev: 1,
            ino: 2,
            token: [3, 4],
        };
        let mut w = Writer::new();
        encode_offer(&offer, &mut w);
        let bytes = w.into_bytes();
        assert_eq!(decode_offer(&bytes).unwrap(), offer);
        assert!(decode_offer(&bytes[..bytes.len() - 1]).is_err());
        assert!(ClientMailbox::open(&bytes).is_none(), "not a mailbox here");
        assert!(ClientMailbox::open(&[]).is_none(), "none offered");
    }
}
