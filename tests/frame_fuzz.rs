//! Bounded randomized checks of every parser that reads bytes from the network: RPC
//! frames, data-plane headers and status frames, segment descriptors and RPC records.
//! None may panic; anything accepted must be self-consistent. `MC_FUZZ_ITERS` raises
//! the case count (long runs belong in bench/, see bench/README.md).

use mooncake::metadata::{RpcMeta, SegmentDesc};
use mooncake::wire::data::{Header, Status, HEADER_LEN, STATUS_LEN};
use mooncake::wire::rpc::{self, RpcType, MAX_FRAME_LEN};

struct Rng(u64);

impl Rng {
    fn next(&mut self) -> u64 {
        self.0 ^= self.0 << 13;
        self.0 ^= self.0 >> 7;
        self.0 ^= self.0 << 17;
        self.0
    }

    fn below(&mut self, n: usize) -> usize {
        (self.next() % n as u64) as usize
    }
}

fn iterations() -> usize {
    std::env::var("MC_FUZZ_ITERS")
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(20_000)
}

fn mutate(rng: &mut Rng, mut bytes: Vec<u8>) -> Vec<u8> {
    for _ in 0..1 + rng.below(4) {
        let len = bytes.len();
        match rng.below(5) {
            0 if len > 0 => {
                let i = rng.below(len);
                bytes[i] ^= 1 << rng.below(8);
            }
            1 if len > 0 => {
                let i = rng.below(len);
                bytes[i] = rng.next() as u8;
            }
            2 => {
                let i = rng.below(len + 1);
                bytes.insert(i, rng.next() as u8);
            }
            3 if len > 0 => {
                bytes.remove(rng.below(len));
            }
            _ => bytes.truncate(rng.below(len + 1)),
        }
    }
    bytes
}

const DESCRIPTOR: &str = r#"{"name":"127.0.0.1:15000","protocol":"tcp","tcp_data_port":15001,"tcp_proto_version":2,"timestamp":"1","devices":[{"name":"mlx5_0","lid":3,"gid":"fe80::1"}],"priority_matrix":{"cpu:0":[["mlx5_0"],[]]},"buffers":[{"name":"cpu:0","addr":140737488355328,"length":1073741824,"rkey":[1],"lkey":[2],"mc_shm_fd":7}],"mc_host":{"host_id":"b/pid:[1]","pid":42,"guard_fd":5,"token":99,"generation":1}}"#;

#[test]
fn rpc_frames_never_panic() {
    let mut rng = Rng(0x1234_5678_9abc_def1);
    let valid = rpc::encode(RpcType::Metadata, DESCRIPTOR);
    for _ in 0..iterations() {
        let bytes = mutate(&mut rng, valid.clone());
        if let Ok((kind, body)) = rpc::decode(&bytes, MAX_FRAME_LEN) {
            assert_eq!(
                rpc::encode(kind, body),
                bytes,
                "accepted frames re-encode identically"
            );
        }
        let _ = rpc::read_frame(&mut &bytes[..], MAX_FRAME_LEN);
    }
}

#[test]
fn data_headers_and_status_never_panic() {
    let mut rng = Rng(0x0fed_cba9_8765_4321);
    for _ in 0..iterations() {
        let mut h = [0u8; HEADER_LEN];
        h.iter_mut().for_each(|b| *b = rng.next() as u8);
        if let Ok(header) = Header::decode(&h) {
            let again = Header::decode(&header.encode()).unwrap();
            assert_eq!(again, header);
        }
        let mut s = [0u8; STATUS_LEN];
        s.iter_mut().for_each(|b| *b = rng.next() as u8);
        if rng.below(2) == 0 {
            s[4..8].copy_from_slice(&0x4D43_5456u32.to_le_bytes());
            s[1..4].fill(0);
        }
        if let Ok(st) = Status::decode(&s) {
            assert_eq!(Status::encode(st), s);
        }
    }
}

#[test]
fn descriptors_never_panic_and_round_trip() {
    let mut rng = Rng(0xdead_beef_cafe_f00d);
    let base = SegmentDesc::parse(DESCRIPTOR).unwrap();
    assert_eq!(base.buffers[0].shm_fd, Some(7));
    for _ in 0..iterations() {
        let bytes = mutate(&mut rng, DESCRIPTOR.as_bytes().to_vec());
        let Ok(text) = String::from_utf8(bytes) else {
            continue;
        };
        if let Ok(desc) = SegmentDesc::parse(&text) {
            let again = SegmentDesc::parse(&desc.to_json().to_string()).unwrap();
            assert_eq!(again, desc);
            for b in &desc.buffers {
                assert!(
                    b.addr.checked_add(b.length).is_some(),
                    "no accepted buffer overflows"
                );
            }
        }
        let _ = RpcMeta::parse(&text);
    }
}
