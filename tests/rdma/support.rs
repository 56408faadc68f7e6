//! Engines on the emulated devices, registered buffers, one-request transfers, target
//! processes, a hand-driven worker, and a peer that never answers a handshake.

use std::io::Write;
use std::net::{TcpListener, TcpStream};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{mpsc, Arc};
use std::time::{Duration, Instant};

use crate::common::Target;
use crate::emu::readable;
use mooncake::engine::TaskState;
use mooncake::metadata::SegmentDesc;
use mooncake::transport::{Outcome, Slice, TransportWorker};
use mooncake::util::crc32c::crc32c;
use mooncake::wire::rpc::{self, RpcType};
use mooncake::{Code, Engine, EngineConfig, Op, Request};

pub fn rdma_engine(workers: usize) -> Engine {
    rdma_engine_with(workers, &[])
}

pub fn rdma_engine_with(workers: usize, settings: &[(&str, &str)]) -> Engine {
    let mut cfg = EngineConfig::default();
    cfg.set("metadata", "P2PHANDSHAKE").unwrap();
    cfg.set("protocol", "rdma").unwrap();
    cfg.set("workers", &workers.to_string()).unwrap();
    // These tests are about RDMA: never let an emulator problem pass as a TCP run.
    cfg.strict_protocol = true;
    for (k, v) in settings {
        cfg.set(k, v).unwrap();
    }
    Engine::new(cfg).expect("rdma engine starts on the emulated devices")
}

/// A registered buffer that unregisters itself on drop.
pub struct Buf<'a> {
    engine: &'a Engine,
    pub buf: Vec<u8>,
}

impl<'a> Buf<'a> {
    pub fn new(engine: &'a Engine, buf: Vec<u8>) -> Buf<'a> {
        let mut b = Buf { engine, buf };
        // SAFETY: the Vec lives in `b` and is unregistered before it is dropped.
        unsafe { engine.register_memory(b.buf.as_mut_ptr(), b.buf.len(), "cpu:0") }.unwrap();
        b
    }

    pub fn addr(&self) -> u64 {
        self.buf.as_ptr() as u64
    }
}

impl Drop for Buf<'_> {
    fn drop(&mut self) {
        let _ = self.engine.unregister_memory(self.buf.as_mut_ptr());
    }
}

/// Runs one request to completion; returns its final state.
pub fn run(client: &Engine, seg: u64, op: Op, local: u64, remote: u64, len: usize) -> TaskState {
    let batch = start(client, seg, op, local, remote, len);
    finish(client, batch)
}

/// Submits one request as a batch of its own.
pub fn start(client: &Engine, seg: u64, op: Op, local: u64, remote: u64, len: usize) -> u64 {
    let batch = client.allocate_batch(1).unwrap();
    let req = [Request {
        op,
        local,
        segment: seg,
        remote,
        len: len as u64,
    }];
    // SAFETY: callers keep the local range alive until the batch is final.
    unsafe { client.submit(batch, &req) }.unwrap();
    batch
}

/// Waits (bounded) for a one-request batch, frees it and returns the request's state.
pub fn finish(client: &Engine, batch: u64) -> TaskState {
    if let Err(e) = client.wait_batch(batch, Some(Duration::from_secs(30))) {
        // A failed task ends the wait with TransferFail; a hang would be a timeout.
        assert_eq!(e.code(), Code::TransferFail, "{e}");
    }
    let st = client.task_status(batch, 0).unwrap();
    client.free_batch(batch).unwrap();
    st.state
}

/// A `mooncake target --protocol rdma` child; it inherits the emulator and its fabric
/// from `emu()`'s environment.
pub fn rdma_target(size: usize, extra: &[&str]) -> Target {
    let mut args = vec!["--protocol", "rdma"];
    args.extend_from_slice(extra);
    Target::spawn_with("P2PHANDSHAKE", size, &args)
}

/// The target's answer to `checksum` when its buffer holds `bytes`.
pub fn checksum_of(bytes: &[u8]) -> String {
    format!("crc32c {:08x}", crc32c(bytes))
}

/// Posts one slice on a hand-driven worker and drives it (bounded) to its outcome.
pub fn drive(worker: &mut Box<dyn TransportWorker>, slice: Slice) -> Outcome {
    let fd = worker
        .wait_fd()
        .expect("the RDMA worker has a wait descriptor");
    let mut done = Vec::new();
    worker.post(slice, &mut done);
    for _ in 0..50 {
        worker.progress(Instant::now(), &mut done);
        if let Some(f) = done.pop() {
            return f.outcome;
        }
        readable(fd, 30_000);
    }
    panic!("the slice never finished");
}

/// A slice the remote HCA must refuse: its first remote access error asks for a fresh
/// descriptor (`Stale`); refused again, it is `Rejected` with the completion status.
pub fn refused(worker: &mut Box<dyn TransportWorker>, slice: Slice) {
    assert_eq!(drive(worker, slice.clone()), Outcome::Stale);
    match drive(worker, slice) {
        Outcome::Rejected(why) => assert!(why.contains("remote access error"), "{why}"),
        other => panic!("{other:?}"),
    }
}

/// A peer whose RPC port hands out its descriptor but never answers a Connection
/// request: it keeps those connections open, unanswered, until stopped.
pub struct SilentPeer {
    pub name: String,
    stop: Arc<AtomicBool>,
    thread: Option<std::thread::JoinHandle<()>>,
}

impl SilentPeer {
    /// Serves `desc` (renamed after its own address); reports each handshake on `seen`.
    pub fn start(mut desc: SegmentDesc, seen: mpsc::Sender<()>) -> SilentPeer {
        let listener = TcpListener::bind("127.0.0.1:0").unwrap();
        let name = listener.local_addr().unwrap().to_string();
        desc.name = name.clone();
        let text = desc.to_json().to_string();
        let stop = Arc::new(AtomicBool::new(false));
        let stopping = stop.clone();
        let thread = std::thread::spawn(move || {
            let mut unanswered = Vec::new();
            for conn in listener.incoming() {
                if stopping.load(Ordering::SeqCst) {
                    break;
                }
                let Ok(mut conn) = conn else { continue };
                let _ = conn.set_read_timeout(Some(Duration::from_secs(30)));
                match rpc::read_frame(&mut conn, rpc::MAX_FRAME_LEN) {
                    Ok((RpcType::Metadata, _)) => {
                        let _ = rpc::write_frame(&mut conn, RpcType::Metadata, &text);
                        let _ = conn.flush();
                    }
                    Ok((RpcType::Connection, _)) => {
                        unanswered.push(conn);
                        let _ = seen.send(());
                    }
                    _ => {}
                }
            }
            // Returning closes the listener and hangs up on every unanswered handshake.
        });
        SilentPeer {
            name,
            stop,
            thread: Some(thread),
        }
    }

    pub fn stop(&mut self) {
        if let Some(t) = self.thread.take() {
            self.stop.store(true, Ordering::SeqCst);
            // Wakes the accept loop; it may already have stopped on another connection.
            let _ = TcpStream::connect(&self.name);
            t.join().unwrap();
        }
    }
}

impl Drop for SilentPeer {
    fn drop(&mut self) {
        self.stop();
    }
}
