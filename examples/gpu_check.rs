//! Device-memory check for a real NVIDIA machine (run by `bench/gpu_check.sh`).
//!
//! Registers `cuda:0` memory (and `cuda:1` when there is a second GPU) with two engines
//! in this process, moves bytes host→device, device→host and device→device through
//! the engine (over TCP, which stages through pinned bounce buffers, and through the
//! local transport, which copies with the driver), then against a `mooncake target`
//! child process holding `cuda:0` memory (same host: CUDA IPC handles through the shm
//! transport, GPU to GPU), verifies every byte, and prints one JSON object with the
//! figures next to plain cuMemcpy baselines. Exits 1 on a byte mismatch or a failed
//! transfer, 2 when no CUDA device is usable.
//!
//! Environment: GPU_CHECK_MB (default 256) bytes per transfer, GPU_CHECK_ITERS (3).

use std::time::{Duration, Instant};

use mooncake::device::{self, MemoryKind};
use mooncake::ffi::cuda;
use mooncake::{Engine, EngineConfig, Op, Request};

fn env_usize(name: &str, default: usize) -> usize {
    std::env::var(name)
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(default)
}

fn pattern(seed: u64, len: usize) -> Vec<u8> {
    let mut x = seed.wrapping_mul(0x9E37_79B9_7F4A_7C15) | 1;
    let mut out = Vec::with_capacity(len + 8);
    while out.len() < len {
        x ^= x << 13;
        x ^= x >> 7;
        x ^= x << 17;
        out.extend_from_slice(&x.to_le_bytes());
    }
    out.truncate(len);
    out
}

fn engine() -> Engine {
    engine_with("tcp")
}

fn engine_with(protocol: &str) -> Engine {
    let mut cfg = EngineConfig::default();
    cfg.set("metadata", "P2PHANDSHAKE").unwrap();
    cfg.set("protocol", protocol).unwrap();
    cfg.set("bind_address", "127.0.0.1").unwrap();
    Engine::new(cfg).expect("engine starts")
}

fn fail(msg: String) -> ! {
    eprintln!("gpu_check: FAILED: {msg}");
    println!("{{\"ok\": false, \"error\": {:?}}}", msg);
    std::process::exit(1);
}

fn gbps(len: usize, d: Duration) -> f64 {
    len as f64 / d.as_secs_f64() / 1e9
}

/// Best of `iters` runs of `f`.
fn best(iters: usize, mut f: impl FnMut()) -> Duration {
    (0..iters.max(1))
        .map(|_| {
            let t = Instant::now();
            f();
            t.elapsed()
        })
        .min()
        .unwrap()
}

fn transfer(e: &Engine, req: Request) {
    let batch = e.allocate_batch(1).unwrap();
    // SAFETY: every buffer used here lives until the end of main.
    unsafe { e.submit(batch, &[req]) }.unwrap_or_else(|err| fail(format!("submit: {err}")));
    if let Err(err) = e.wait_batch(batch, Some(Duration::from_secs(120))) {
        fail(format!("{:?} of {} bytes: {err}", req.op, req.len));
    }
    e.free_batch(batch).unwrap();
}

fn dev_bytes(kind: MemoryKind, addr: u64, len: usize) -> Vec<u8> {
    let mut out = vec![0u8; len];
    // SAFETY: `addr` is device memory of `len` bytes.
    unsafe { device::copy_to_host(kind, out.as_mut_ptr(), addr, len) }
        .unwrap_or_else(|e| fail(format!("reading back: {e}")));
    out
}

fn verify(what: &str, got: &[u8], want: &[u8]) {
    if got != want {
        let at = got.iter().zip(want).position(|(a, b)| a != b).unwrap_or(0);
        fail(format!("{what}: bytes differ from offset {at}"));
    }
}

fn main() {
    let len = env_usize("GPU_CHECK_MB", 256) << 20;
    let iters = env_usize("GPU_CHECK_ITERS", 3);
    let api = match cuda::api() {
        Ok(a) => a,
        Err(e) => {
            eprintln!("gpu_check: {e}");
            std::process::exit(2);
        }
    };
    let count = api.device_count().unwrap_or_else(|e| {
        eprintln!("gpu_check: {e}");
        std::process::exit(2)
    });
    if count == 0 {
        eprintln!("gpu_check: no CUDA device");
        std::process::exit(2);
    }
    let name = api.device_name(0).unwrap_or_default();
    let k0 = MemoryKind::Cuda(0);
    let k1 = MemoryKind::Cuda(if count > 1 { 1 } else { 0 });
    let alloc = |k: MemoryKind| match k {
        MemoryKind::Cuda(n) => api
            .mem_alloc(n, len)
            .unwrap_or_else(|e| fail(e.to_string())),
        _ => unreachable!(),
    };
    let (da, db, dc) = (alloc(k0), alloc(k1), alloc(k0));

    // Baselines: synchronous cuMemcpy with pageable host memory (what the engine's
    // callers hand it), and device to device.
    let src = pattern(1, len);
    let mut sink = vec![0u8; len];
    api.make_current(0).unwrap();
    // SAFETY (the three blocks): device buffers of `len` bytes, host Vecs of `len`.
    let base_htod = best(iters, || {
        // SAFETY: `da` is a device buffer of `len` bytes, `src` a host Vec of `len`.
        unsafe { api.copy_htod(da, src.as_ptr(), len) }.unwrap()
    });
    let base_dtoh = best(iters, || {
        // SAFETY: `sink` is a host Vec of `len` bytes, `da` a device buffer of `len`.
        unsafe { api.copy_dtoh(sink.as_mut_ptr(), da, len) }.unwrap()
    });
    verify("baseline round trip", &sink, &src);
    let base_dtod = best(iters, || {
        // SAFETY: `dc` and `da` are distinct device buffers of `len` bytes.
        unsafe { api.copy_dtod(dc, da, len) }.unwrap()
    });
    verify("baseline device to device", &dev_bytes(k0, dc, len), &src);

    let server = engine();
    let client = engine();
    let mut host = pattern(2, len);
    // SAFETY: all buffers live until the end of main.
    unsafe {
        server
            .register_memory(da as *mut u8, len, &k0.location())
            .unwrap();
        client
            .register_memory(db as *mut u8, len, &k1.location())
            .unwrap();
        client
            .register_memory(dc as *mut u8, len, &k0.location())
            .unwrap();
        client
            .register_memory(host.as_mut_ptr(), len, "cpu:0")
            .unwrap();
    }
    let peer = client.open_segment(server.segment_name()).unwrap();
    let own = client.open_segment(client.segment_name()).unwrap();
    let req = |op, local, segment, remote| Request {
        op,
        local,
        segment,
        remote,
        len: len as u64,
    };
    let h = host.as_mut_ptr() as u64;
    let mut figures = Vec::new();
    let mut run = |label: &str, e: &Engine, r: Request, check: &dyn Fn()| {
        let t = best(iters, || transfer(e, r));
        check();
        figures.push(format!("\"{label}_gbps\": {:.3}", gbps(len, t)));
    };

    // Over TCP: the server stages cuda memory; the client's worker stages its own.
    let want = pattern(2, len);
    run(
        "tcp_host_to_device",
        &client,
        req(Op::Write, h, peer, da),
        &|| verify("tcp host→device", &dev_bytes(k0, da, len), &want),
    );
    let p3 = pattern(3, len);
    // SAFETY: refill the device buffer with a new pattern for the next direction.
    unsafe { device::copy_from_host(k0, da, p3.as_ptr(), len) }.unwrap();
    run(
        "tcp_device_to_host",
        &client,
        req(Op::Read, h, peer, da),
        &|| {
            verify(
                "tcp device→host",
                // SAFETY: `h` is the `len`-byte host buffer, no transfer in flight.
                unsafe { std::slice::from_raw_parts(h as *const u8, len) },
                &p3,
            )
        },
    );
    run(
        "tcp_device_to_device",
        &client,
        req(Op::Read, db, peer, da),
        &|| verify("tcp device→device", &dev_bytes(k1, db, len), &p3),
    );
    // In-process (local transport): one driver copy per request.
    let p4 = pattern(4, len);
    // SAFETY: `host` is the registered host buffer, no transfer in flight.
    unsafe { std::ptr::copy_nonoverlapping(p4.as_ptr(), h as *mut u8, len) };
    run(
        "local_host_to_device",
        &client,
        req(Op::Write, h, own, dc),
        &|| verify("local host→device", &dev_bytes(k0, dc, len), &p4),
    );
    run(
        "local_device_to_device",
        &client,
        req(Op::Write, dc, own, db),
        &|| verify("local device→device", &dev_bytes(k1, db, len), &p4),
    );
    // SAFETY: as above.
    unsafe { std::ptr::write_bytes(h as *mut u8, 0, len) };
    run(
        "local_device_to_host",
        &client,
        req(Op::Read, h, own, db),
        &|| {
            verify(
                "local device→host",
                // SAFETY: `h` is the `len`-byte host buffer, no transfer in flight.
                unsafe { std::slice::from_raw_parts(h as *const u8, len) },
                &p4,
            )
        },
    );

    // Across processes on this host: CUDA IPC, one driver copy per slice.
    let ipc = ipc_figures(len, iters, (k0, dc), h, &pattern(5, len));
    figures.extend(ipc);

    let s = client.stats();
    println!(
        "{{\"ok\": true, \"device\": {name:?}, \"devices\": {count}, \"bytes\": {len}, \"iters\": {iters}, \
         \"dma_buf\": {}, \"baseline\": {{\"cumemcpy_htod_gbps\": {:.3}, \"cumemcpy_dtoh_gbps\": {:.3}, \
         \"cumemcpy_dtod_gbps\": {:.3}}}, \"engine\": {{{}}}, \"stats\": {{\"tcp_bytes\": {}, \
         \"local_bytes\": {}, \"retries\": {}, \"failed_slices\": {}}}}}",
        api.has_dma_buf(),
        gbps(len, base_htod),
        gbps(len, base_dtoh),
        gbps(len, base_dtod),
        figures.join(", "),
        s.tcp_bytes,
        s.local_bytes,
        s.retries,
        s.failed_slices
    );
}

/// A `mooncake target` child holding `len` bytes of `cuda:0` memory, driven over its
/// stdin/stdout.
struct Child {
    process: std::process::Child,
    out: std::io::BufReader<std::process::ChildStdout>,
}

impl Child {
    fn spawn(len: usize) -> (Child, String) {
        use std::io::BufRead;
        // The binary sits next to `examples/` in the same target directory.
        let exe = std::env::current_exe().unwrap_or_default();
        let bin = exe
            .parent()
            .and_then(|d| d.parent())
            .map(|d| d.join("mooncake"))
            .unwrap_or_default();
        let mut process = std::process::Command::new(&bin)
            .args([
                "target",
                "--metadata",
                "P2PHANDSHAKE",
                "--bind",
                "127.0.0.1",
            ])
            .args([
                "--protocol",
                "shm",
                "--location",
                "cuda:0",
                "--until-stdin-eof",
            ])
            .args(["--size", &len.to_string()])
            .stdin(std::process::Stdio::piped())
            .stdout(std::process::Stdio::piped())
            .spawn()
            .unwrap_or_else(|e| fail(format!("starting {}: {e}", bin.display())));
        let mut out = std::io::BufReader::new(process.stdout.take().unwrap());
        let mut line = String::new();
        let _ = out.read_line(&mut line);
        let Some(name) = line.trim().strip_prefix("ready ").map(str::to_owned) else {
            let _ = process.kill();
            fail(format!("target said {line:?}"));
        };
        (Child { process, out }, name)
    }

    fn command(&mut self, cmd: &str) -> String {
        use std::io::{BufRead, Write};
        let stdin = self.process.stdin.as_mut().unwrap();
        let _ = writeln!(stdin, "{cmd}").and_then(|_| stdin.flush());
        let mut line = String::new();
        let _ = self.out.read_line(&mut line);
        line.trim().to_owned()
    }
}

impl Drop for Child {
    fn drop(&mut self) {
        drop(self.process.stdin.take());
        let _ = self.process.wait();
    }
}

/// Device→device and device→host against a child process's `cuda:0` buffer through
/// CUDA IPC; the child checksums what landed in its device memory.
fn ipc_figures(
    len: usize,
    iters: usize,
    local: (MemoryKind, u64),
    host: u64,
    p: &[u8],
) -> Vec<String> {
    let (kind, dev) = local;
    let (mut child, name) = Child::spawn(len);
    let engine = engine_with("auto");
    // SAFETY: `dev` and `host` live until the end of main; registered only here.
    unsafe {
        engine
            .register_memory(dev as *mut u8, len, &kind.location())
            .unwrap();
        engine
            .register_memory(host as *mut u8, len, "cpu:0")
            .unwrap();
    }
    let seg = engine
        .open_segment(&name)
        .unwrap_or_else(|e| fail(e.to_string()));
    let desc = engine.segment_descriptor(seg).unwrap();
    let Some(remote) = desc.buffers.first().filter(|b| b.ipc.is_some()) else {
        fail("the child published no IPC handle".into());
    };
    let remote = remote.addr;
    // SAFETY: `dev` is device memory of `len` bytes.
    unsafe { device::copy_from_host(kind, dev, p.as_ptr(), len) }.unwrap();
    let req = |op, local| Request {
        op,
        local,
        segment: seg,
        remote,
        len: len as u64,
    };
    let write = best(iters, || transfer(&engine, req(Op::Write, dev)));
    let want = format!("crc32c {:08x}", mooncake::util::crc32c::crc32c(p));
    let got = child.command("checksum");
    if got != want {
        fail(format!(
            "ipc device→device: child reports {got}, expected {want}"
        ));
    }
    // SAFETY: the registered host buffer, no transfer in flight.
    unsafe { std::ptr::write_bytes(host as *mut u8, 0, len) };
    let read = best(iters, || transfer(&engine, req(Op::Read, host)));
    // SAFETY: as above.
    verify(
        "ipc device→host",
        unsafe { std::slice::from_raw_parts(host as *const u8, len) },
        p,
    );
    let s = engine.stats();
    if s.tcp_bytes != 0 {
        fail(format!(
            "{} bytes went over TCP instead of IPC",
            s.tcp_bytes
        ));
    }
    engine.unregister_memory(dev as *mut u8).unwrap();
    engine.unregister_memory(host as *mut u8).unwrap();
    vec![
        format!("\"ipc_device_to_device_gbps\": {:.3}", gbps(len, write)),
        format!("\"ipc_device_to_host_gbps\": {:.3}", gbps(len, read)),
        format!("\"ipc_shm_bytes\": {}", s.shm_bytes),
    ]
}
