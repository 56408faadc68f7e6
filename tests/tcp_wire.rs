//! The TCP data server against raw, hostile clients: every malformed or out-of-range
//! request is refused and nothing outside the addressed registered buffer changes.

mod common;

use std::io::{Read, Write};
use std::net::TcpStream;
use std::time::Duration;

use common::{engine_with, Registered};
use mooncake::wire::data::{DataOp, Header, Status};

fn data_conn(port: u16) -> TcpStream {
    let s = TcpStream::connect(("127.0.0.1", port)).unwrap();
    s.set_read_timeout(Some(Duration::from_secs(10))).unwrap();
    s
}

fn status(s: &mut TcpStream) -> Option<Status> {
    let mut b = [0u8; 8];
    s.read_exact(&mut b).ok()?;
    Some(Status::decode(&b).unwrap())
}

fn closed(s: &mut TcpStream) -> bool {
    let mut b = [0u8; 1];
    matches!(s.read(&mut b), Ok(0) | Err(_))
}

#[test]
fn valid_requests_pipeline_on_one_connection() {
    let e = engine_with("P2PHANDSHAKE", "tcp");
    let r = Registered::new(&e, (0..=255u8).cycle().take(8192).collect());
    let port = e.descriptor().tcp_data_port;
    let mut s = data_conn(port);
    // Two pipelined requests: a write then a read of the same bytes.
    let mut out = Header {
        size: 4,
        addr: r.addr() + 10,
        op: DataOp::Write,
    }
    .encode()
    .to_vec();
    out.extend_from_slice(b"abcd");
    out.extend_from_slice(
        &Header {
            size: 6,
            addr: r.addr() + 9,
            op: DataOp::Read,
        }
        .encode(),
    );
    s.write_all(&out).unwrap();
    assert_eq!(status(&mut s), Some(Status::Ok));
    assert_eq!(status(&mut s), Some(Status::Ok));
    let mut got = [0u8; 6];
    s.read_exact(&mut got).unwrap();
    assert_eq!(&got, &[9, b'a', b'b', b'c', b'd', 14]);
}

#[test]
fn hostile_headers_are_rejected_without_writes() {
    let e = engine_with("P2PHANDSHAKE", "tcp");
    let a = Registered::new(&e, vec![0xAA; 4096]);
    let b = Registered::new(&e, vec![0xBB; 4096]);
    let port = e.descriptor().tcp_data_port;
    let write = |addr: u64, size: u64| {
        Header {
            size,
            addr,
            op: DataOp::Write,
        }
        .encode()
    };
    let mut v1 = write(a.addr(), 4);
    v1[16] = 1; // protocol v1: no acknowledgements, refused
    let mut unknown = write(a.addr(), 4);
    unknown[16] = 0x80 | 0x33;
    let cases: Vec<(&str, [u8; 24])> = vec![
        ("length 0", write(a.addr(), 0)),
        ("before buffer", write(a.addr() - 1, 4)),
        ("past end", write(a.addr() + 4093, 4)),
        ("unregistered", write(8, 4)),
        ("overflowing", write(u64::MAX - 1, 4)),
        ("huge", write(a.addr(), u64::MAX)),
        ("v1", v1),
        ("unknown opcode", unknown),
    ];
    for (what, header) in cases {
        let mut s = data_conn(port);
        s.write_all(&header).unwrap();
        // The payload a client would have sent: must never land.
        let _ = s.write_all(&[0x11; 8]);
        assert_eq!(status(&mut s), Some(Status::Rejected), "{what}");
        assert!(closed(&mut s), "{what}: connection closed after rejection");
    }
    // Spanning two adjacent-or-not buffers is never one buffer.
    let (lo, hi) = if a.addr() < b.addr() {
        (&a, &b)
    } else {
        (&b, &a)
    };
    let mut s = data_conn(port);
    s.write_all(&write(lo.addr() + 4000, hi.addr() - lo.addr()))
        .unwrap();
    assert_eq!(status(&mut s), Some(Status::Rejected));
    assert!(a.buf.iter().all(|&x| x == 0xAA));
    assert!(b.buf.iter().all(|&x| x == 0xBB));
}

#[test]
fn truncated_frames_and_vanishing_clients_harm_nobody() {
    let e = engine_with("P2PHANDSHAKE", "tcp");
    let r = Registered::new(&e, vec![0u8; 4096]);
    let port = e.descriptor().tcp_data_port;
    // Half a header, then gone.
    let mut s = data_conn(port);
    s.write_all(
        &Header {
            size: 4,
            addr: r.addr(),
            op: DataOp::Write,
        }
        .encode()[..10],
    )
    .unwrap();
    drop(s);
    // A write whose payload stops short: no acknowledgement, nothing past the range.
    let mut s = data_conn(port);
    s.write_all(
        &Header {
            size: 100,
            addr: r.addr() + 8,
            op: DataOp::Write,
        }
        .encode(),
    )
    .unwrap();
    s.write_all(&[0x55; 40]).unwrap();
    s.shutdown(std::net::Shutdown::Write).unwrap();
    assert!(
        status(&mut s).is_none(),
        "short payload is never acknowledged"
    );
    assert!(r.buf[..8].iter().all(|&x| x == 0));
    assert!(r.buf[108..].iter().all(|&x| x == 0));
    // The server still serves everyone else.
    let mut s = data_conn(port);
    s.write_all(
        &Header {
            size: 8,
            addr: r.addr(),
            op: DataOp::Read,
        }
        .encode(),
    )
    .unwrap();
    assert_eq!(status(&mut s), Some(Status::Ok));
}
