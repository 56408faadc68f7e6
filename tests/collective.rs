//! Mooncake PG with real processes: every collective on four ranks against a reference
//! computed here, and a rank killed with SIGKILL during a stream of all-reduces, named,
//! excluded, and replaced by a new process that takes its old rank number.
//!
//! The ranks are this test binary started again with `MC_PG_CHILD` set: the `pg_child`
//! test then runs one rank's script and reports on stdout.

mod common;

use std::io::{BufRead, BufReader, Write};
use std::path::{Path, PathBuf};
use std::process::{Child, ChildStdin, Command, Stdio};
use std::sync::mpsc::{self, Receiver};
use std::time::{Duration, Instant};

use mooncake::collective::dtype::{f32_to_bf16, f32_to_f16};
use mooncake::collective::{DType, Group, GroupOptions, ProposalStatus, ReduceOp, SyncStatus};

const WORLD: usize = 4;
/// Bound on any single step a parent waits for.
const STEP: Duration = Duration::from_secs(60);
const OP_TIMEOUT_MS: u64 = 3000;

// ---------------------------------------------------------------- children

#[test]
fn pg_child() {
    let Ok(script) = std::env::var("MC_PG_CHILD") else {
        return;
    };
    let _ = env_logger::builder().is_test(false).try_init();
    let var = |k: &str| std::env::var(k).unwrap_or_else(|_| panic!("{k} unset"));
    let rank: usize = var("MC_PG_RANK").parse().unwrap();
    let dir = PathBuf::from(var("MC_PG_DIR"));
    let extension = std::env::var("MC_PG_EXTENSION").is_ok();
    let group = start_rank(&dir, rank, extension);
    match script.as_str() {
        "collectives" => run_collectives(&group),
        "stream" => run_stream(&group),
        "replacement" => run_replacement(&group),
        "stalled" => run_stalled(&group),
        "two_deaths" => run_two_deaths(&group),
        "mismatch" => run_mismatch(&group),
        "exit_after" => run_exit_after(&group),
        other => panic!("unknown script {other}"),
    }
    say("done");
}

fn say(line: &str) {
    let mut out = std::io::stdout().lock();
    let _ = writeln!(out, "{line}");
    let _ = out.flush();
}

/// Creates the rank, publishes its address in `dir` and connects to every address there
/// (waiting, bounded, until all ranks have published).
fn start_rank(dir: &Path, rank: usize, extension: bool) -> Group {
    let mut o = GroupOptions::new(rank, WORLD);
    o.timeout = Duration::from_millis(OP_TIMEOUT_MS);
    o.is_extension = extension;
    // Small cells, so large messages are cut into many.
    o.cell_bytes = 64 << 10;
    if let Ok(p) = std::env::var("MC_PG_PROTOCOL") {
        o.set("protocol", &p).unwrap();
    }
    let g = Group::new(o).expect("group starts");
    eprintln!(
        "rank {rank} pid {} address {}",
        std::process::id(),
        g.address()
    );
    let tmp = dir.join(format!("rank-{rank}.tmp"));
    std::fs::write(&tmp, g.address()).unwrap();
    std::fs::rename(&tmp, dir.join(format!("rank-{rank}"))).unwrap();
    let deadline = Instant::now() + STEP;
    let addrs: Vec<String> = loop {
        let got: Vec<Option<String>> = (0..WORLD)
            .map(|r| std::fs::read_to_string(dir.join(format!("rank-{r}"))).ok())
            .collect();
        if got.iter().all(Option::is_some) {
            break got.into_iter().map(Option::unwrap_or_default).collect();
        }
        assert!(Instant::now() < deadline, "rendezvous incomplete: {got:?}");
        std::thread::sleep(Duration::from_millis(10));
    };
    g.connect(&addrs).expect("connect");
    if !extension {
        // Everyone connected before the first operation's clock starts: a slow start
        // on a loaded host must not look like a failure.
        let ready = dir.join(format!("ready-{rank}"));
        std::fs::write(&ready, b"").unwrap();
        while !(0..WORLD).all(|r| dir.join(format!("ready-{r}")).exists()) {
            assert!(
                Instant::now() < deadline + STEP,
                "ranks never all connected"
            );
            std::thread::sleep(Duration::from_millis(10));
        }
    }
    g
}

const DTYPES: [DType; 7] = [
    DType::F32,
    DType::F64,
    DType::F16,
    DType::BF16,
    DType::I32,
    DType::I64,
    DType::U8,
];

/// `v` (a small integer, or a quarter of one) as one element of `dt`.
fn enc(dt: DType, v: f64) -> Vec<u8> {
    match dt {
        DType::F32 => (v as f32).to_ne_bytes().to_vec(),
        DType::F64 => v.to_ne_bytes().to_vec(),
        DType::F16 => f32_to_f16(v as f32).to_ne_bytes().to_vec(),
        DType::BF16 => f32_to_bf16(v as f32).to_ne_bytes().to_vec(),
        DType::I32 => (v as i32).to_ne_bytes().to_vec(),
        DType::I64 => (v as i64).to_ne_bytes().to_vec(),
        DType::U8 => vec![v as u8],
    }
}

fn encode(dt: DType, vals: &[f64]) -> Vec<u8> {
    vals.iter().flat_map(|&v| enc(dt, v)).collect()
}

/// Element `i` of rank `r`'s input for test `seed`: 1..=5 (1..=2 for products, so
/// every result is exact in every type, bfloat16 included).
fn value(r: usize, i: usize, seed: usize, op: ReduceOp) -> f64 {
    let m = if op == ReduceOp::Product { 2 } else { 5 };
    ((r * 7 + i * 3 + seed) % m + 1) as f64
}

fn reference(dt: DType, op: ReduceOp, ranks: &[usize], len: usize, seed: usize) -> Vec<u8> {
    let vals: Vec<f64> = (0..len)
        .map(|i| {
            let xs = ranks.iter().map(|&r| value(r, i, seed, op));
            match op {
                ReduceOp::Sum => xs.sum(),
                ReduceOp::Product => xs.product(),
                ReduceOp::Min => xs.fold(f64::MAX, f64::min),
                ReduceOp::Max => xs.fold(f64::MIN, f64::max),
                ReduceOp::Avg => {
                    let s: f64 = xs.sum();
                    let integer = !matches!(dt, DType::F32 | DType::F64 | DType::F16 | DType::BF16);
                    if integer {
                        (s as i64 / ranks.len() as i64) as f64
                    } else {
                        s / ranks.len() as f64
                    }
                }
            }
        })
        .collect();
    encode(dt, &vals)
}

fn input(dt: DType, r: usize, len: usize, seed: usize, op: ReduceOp) -> Vec<u8> {
    let vals: Vec<f64> = (0..len).map(|i| value(r, i, seed, op)).collect();
    encode(dt, &vals)
}

fn run_collectives(g: &Group) {
    let me = g.rank();
    let all: Vec<usize> = (0..WORLD).collect();
    // 70001 elements of 8 bytes take the two-phase path and many 64 KiB cells.
    let lens = [1usize, 7, 1000, 70001];
    for (t, dt) in DTYPES.into_iter().enumerate() {
        let sz = dt.size();
        for (l, &len) in lens.iter().enumerate() {
            let seed = t * 10 + l;
            for op in [
                ReduceOp::Sum,
                ReduceOp::Min,
                ReduceOp::Max,
                ReduceOp::Product,
                ReduceOp::Avg,
            ] {
                let mut buf = input(dt, me, len, seed, op);
                g.all_reduce(&mut buf, dt, op).unwrap();
                assert!(
                    buf == reference(dt, op, &all, len, seed),
                    "all_reduce {dt:?} {op:?} {len}"
                );
                let root = (seed + 1) % WORLD;
                let mut buf = input(dt, me, len, seed, op);
                let before = buf.clone();
                g.reduce(&mut buf, dt, op, root).unwrap();
                if me == root {
                    assert!(
                        buf == reference(dt, op, &all, len, seed),
                        "reduce {dt:?} {op:?} {len}"
                    );
                } else {
                    assert_eq!(buf, before, "reduce leaves non-roots alone");
                }
            }
            // Uneven blocks: rank r's block has len + 3r elements.
            let sizes: Vec<usize> = (0..WORLD).map(|r| (len + 3 * r) * sz).collect();
            let blocks: Vec<Vec<u8>> = (0..WORLD)
                .map(|r| input(dt, r, len + 3 * r, seed, ReduceOp::Sum))
                .collect();
            let concat: Vec<u8> = blocks.concat();
            let mut out = vec![0u8; concat.len()];
            g.all_gather(&blocks[me], &mut out, &sizes).unwrap();
            assert!(out == concat, "all_gather {dt:?} {len}");

            let root = seed % WORLD;
            let mut buf = if me == root {
                blocks[me].clone()
            } else {
                vec![0; blocks[root].len()]
            };
            g.broadcast(&mut buf, root).unwrap();
            assert!(buf == blocks[root], "broadcast {dt:?} {len}");

            let mut out = vec![0u8; if me == root { concat.len() } else { 0 }];
            g.gather(&blocks[me], &mut out, &sizes, root).unwrap();
            if me == root {
                assert!(out == concat, "gather {dt:?} {len}");
            }
            let src = if me == root {
                concat.clone()
            } else {
                Vec::new()
            };
            let mut out = vec![0u8; sizes[me]];
            g.scatter(&src, &mut out, &sizes, root).unwrap();
            assert!(out == blocks[me], "scatter {dt:?} {len}");

            // reduce_scatter: rank r gets the reduction of block r (len/4 + r elements).
            let counts: Vec<usize> = (0..WORLD).map(|r| len / 4 + r).collect();
            let total: usize = counts.iter().sum();
            let offsets: Vec<usize> = counts
                .iter()
                .scan(0, |a, &c| {
                    let o = *a;
                    *a += c;
                    Some(o)
                })
                .collect();
            for op in [ReduceOp::Sum, ReduceOp::Max, ReduceOp::Avg] {
                let inp = input(dt, me, total, seed, op);
                let mut out = vec![0u8; counts[me] * sz];
                g.reduce_scatter(&inp, &mut out, &counts, dt, op).unwrap();
                let full = reference(dt, op, &all, total, seed);
                let want = &full[offsets[me] * sz..(offsets[me] + counts[me]) * sz];
                assert!(out == want, "reduce_scatter {dt:?} {op:?} {len}");
            }

            // all_to_all: rank r sends (r + 2p + 1) + len/8 elements to p.
            let n = |r: usize, p: usize| (r + 2 * p + 1 + len / 8) * sz;
            let piece =
                |r: usize, p: usize| input(dt, r * WORLD + p, n(r, p) / sz, seed, ReduceOp::Sum);
            let send: Vec<usize> = (0..WORLD).map(|p| n(me, p)).collect();
            let recv: Vec<usize> = (0..WORLD).map(|r| n(r, me)).collect();
            let inp: Vec<u8> = (0..WORLD).flat_map(|p| piece(me, p)).collect();
            let mut out = vec![0u8; recv.iter().sum()];
            g.all_to_all(&inp, &send, &mut out, &recv).unwrap();
            let want: Vec<u8> = (0..WORLD).flat_map(|r| piece(r, me)).collect();
            assert!(out == want, "all_to_all {dt:?} {len}");
            // The same with its own wait bound; a zero bound is refused before any
            // message moves, so the ranks stay in step.
            let own = Some(Duration::from_millis(OP_TIMEOUT_MS / 2));
            let mut out = vec![0u8; recv.iter().sum()];
            g.all_to_all_within(&inp, &send, &mut out, &recv, own)
                .unwrap();
            assert!(out == want, "all_to_all_within {dt:?} {len}");
            let zero = Some(Duration::ZERO);
            assert!(g
                .all_to_all_within(&inp, &send, &mut out, &recv, zero)
                .is_err());

            // A ring of point-to-point messages of different sizes.
            let next = (me + 1) % WORLD;
            let prev = (me + WORLD - 1) % WORLD;
            let msg = |r: usize| input(dt, r, len + r, seed, ReduceOp::Sum);
            let mine = msg(me);
            let mut got = vec![0u8; msg(prev).len()];
            g.send_recv(&[(next, &mine)], &mut [(prev, &mut got)])
                .unwrap();
            assert!(got == msg(prev), "send/recv {dt:?} {len}");
            g.barrier().unwrap();
        }
        say(&format!("ok {dt:?}"));
    }
    // Ranks that disagree about the operation get an error, not a wrong answer (the
    // root of the broadcast only sends, so it cannot tell).
    let mut buf = vec![1u8; 16];
    if me == 0 {
        g.broadcast(&mut buf, 0).unwrap();
    } else {
        let r = g.all_reduce(&mut buf, DType::U8, ReduceOp::Sum);
        assert!(r.is_err(), "mismatched collectives must fail");
        assert!(g.failed_ranks().contains(&0), "{:?}", g.failed_ranks());
    }
}

/// All-reduces of (rank + 1) until a failure has been seen and five operations have
/// succeeded after it (every rank decides from the same all-reduced vote, so all stop
/// after the same operation); then, on the parent's word, activates the replacement
/// and runs five more over all ranks.
fn run_stream(g: &Group) {
    let deadline = Instant::now() + STEP;
    let dead = stream_until_recovered(g, "");
    assert_eq!(
        g.peer_state(&dead),
        vec![false; dead.len()],
        "dead ranks not activatable"
    );
    say(&format!(
        "recovered {}",
        dead.iter()
            .map(|r| r.to_string())
            .collect::<Vec<_>>()
            .join(",")
    ));
    let mut line = String::new();
    std::io::stdin().read_line(&mut line).unwrap();
    assert_eq!(line.trim(), "activate");
    loop {
        assert!(
            Instant::now() < deadline + STEP,
            "replacement never activated"
        );
        let resp = g.propose(true, &dead).expect("propose");
        match resp.status {
            ProposalStatus::Applied | ProposalStatus::AppliedWithDroppedRanks => break,
            // The replacement's claim may still be on its way.
            ProposalStatus::Rejected => std::thread::sleep(Duration::from_millis(20)),
        }
    }
    full_rounds(g);
}

fn full_rounds(g: &Group) {
    assert_eq!(g.active_ranks(), vec![true; WORLD]);
    let sum: usize = (1..=WORLD).sum();
    for _ in 0..5 {
        let mut buf = encode(DType::I64, &vec![(g.rank() + 1) as f64; 300]);
        g.all_reduce(&mut buf, DType::I64, ReduceOp::Sum)
            .expect("all_reduce over all ranks");
        assert!(buf == encode(DType::I64, &vec![sum as f64; 300]));
    }
    say(&format!("full epoch {}", g.epoch()));
}

fn run_replacement(g: &Group) {
    say("joining");
    g.join(STEP).expect("activated");
    say(&format!(
        "joined epoch {} {:?}",
        g.epoch(),
        g.active_ranks()
    ));
    full_rounds(g);
}

// ---------------------------------------------------------------- parent

/// A rank process: stdout lines on a channel, killed and reaped on drop.
struct Rank {
    child: Child,
    stdin: Option<ChildStdin>,
    lines: Receiver<String>,
    log: Vec<String>,
}

impl Rank {
    fn start(script: &str, dir: &Path, rank: usize, extension: bool) -> Rank {
        let mut cmd = Command::new(std::env::current_exe().unwrap());
        cmd.args(["pg_child", "--exact", "--nocapture", "--test-threads=1"])
            .env("MC_PG_CHILD", script)
            .env("MC_PG_RANK", rank.to_string())
            .env("MC_PG_DIR", dir)
            .stdin(Stdio::piped())
            .stdout(Stdio::piped())
            .stderr(Stdio::inherit());
        if extension {
            cmd.env("MC_PG_EXTENSION", "1");
        }
        let mut child = cmd.spawn().expect("spawning a rank");
        let out = child.stdout.take().unwrap();
        let (tx, lines) = mpsc::channel();
        std::thread::spawn(move || {
            for line in BufReader::new(out).lines().map_while(|l| l.ok()) {
                // The harness starts the child's first line with the test's name.
                let line = line.trim_start_matches("test pg_child ... ").to_owned();
                if tx.send(line).is_err() {
                    break;
                }
            }
        });
        Rank {
            stdin: child.stdin.take(),
            child,
            lines,
            log: Vec::new(),
        }
    }

    /// Waits (bounded) for a line starting with `prefix`; returns it.
    fn expect(&mut self, prefix: &str) -> String {
        let deadline = Instant::now() + STEP;
        loop {
            let left = deadline.saturating_duration_since(Instant::now());
            match self.lines.recv_timeout(left) {
                Ok(l) => {
                    self.log.push(l.clone());
                    if l.starts_with(prefix) {
                        return l;
                    }
                }
                Err(_) => panic!("no {prefix:?} line; saw {:?}", self.log),
            }
        }
    }

    fn tell(&mut self, line: &str) {
        let stdin = self.stdin.as_mut().unwrap();
        writeln!(stdin, "{line}").unwrap();
        stdin.flush().unwrap();
    }

    fn kill(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }

    /// Waits (bounded) for a clean exit.
    fn finish(&mut self) {
        drop(self.stdin.take());
        let deadline = Instant::now() + STEP;
        loop {
            if let Some(s) = self.child.try_wait().unwrap() {
                assert!(s.success(), "rank exited {s}; saw {:?}", self.log);
                return;
            }
            assert!(
                Instant::now() < deadline,
                "rank did not exit; saw {:?}",
                self.log
            );
            // Draining stdout doubles as the wait between checks.
            if let Ok(l) = self.lines.recv_timeout(Duration::from_millis(50)) {
                self.log.push(l);
            }
        }
    }
}

impl Drop for Rank {
    fn drop(&mut self) {
        self.kill();
    }
}

fn rendezvous_dir(name: &str) -> PathBuf {
    let dir = std::env::temp_dir().join(format!("mc-pg-{name}-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    std::fs::create_dir_all(&dir).unwrap();
    dir
}

#[test]
fn every_collective_matches_the_reference_on_four_ranks() {
    let dir = rendezvous_dir("all");
    let mut ranks: Vec<Rank> = (0..WORLD)
        .map(|r| Rank::start("collectives", &dir, r, false))
        .collect();
    // Each dtype's round gets its own time limit: on a loaded two-core host the
    // whole run in a debug build can take longer than one.
    for dt in DTYPES {
        let line = format!("ok {dt:?}");
        for r in &mut ranks {
            r.expect(&line);
        }
    }
    for r in &mut ranks {
        r.expect("done");
    }
    for r in &mut ranks {
        r.finish();
    }
    let _ = std::fs::remove_dir_all(&dir);
}

fn kill_and_replace(victim: usize) {
    let dir = rendezvous_dir(&format!("kill{victim}"));
    let mut ranks: Vec<Rank> = (0..WORLD)
        .map(|r| Rank::start("stream", &dir, r, false))
        .collect();
    for r in &mut ranks {
        r.expect("progress");
    }
    ranks[victim].kill();
    let mut named = 0;
    for (i, r) in ranks.iter_mut().enumerate().filter(|(i, _)| *i != victim) {
        // A survivor that had every byte of its operation before the death completes
        // it; every one that fails must name the dead rank, and only it.
        let recovered = r.expect("recovered");
        assert_eq!(recovered, format!("recovered {victim}"), "rank {i}");
        for failed in r.log.iter().filter(|l| l.starts_with("failed")) {
            let ranks: Vec<&str> = failed.split(' ').nth(1).unwrap().split(',').collect();
            assert_eq!(ranks, [victim.to_string()], "rank {i}: {failed}");
            eprintln!("rank {i}: {failed}");
            named += 1;
        }
    }
    assert!(named > 0, "no survivor saw the failure");
    let mut replacement = Rank::start("replacement", &dir, victim, true);
    replacement.expect("joining");
    for r in ranks.iter_mut().filter(|r| r.stdin.is_some()) {
        if r.child.try_wait().unwrap().is_none() {
            r.tell("activate");
        }
    }
    ranks[victim] = replacement;
    ranks.swap(0, victim);
    all_run_full_rounds_and_exit(&mut ranks, &dir);
}

#[test]
fn a_killed_member_is_named_excluded_and_replaced_with_its_rank() {
    kill_and_replace(2);
}

#[test]
fn a_killed_coordinator_is_named_excluded_and_replaced_with_its_rank() {
    kill_and_replace(0);
}

// ---------------------------------------------------------------- C ABI

mod abi {
    use std::ffi::{c_char, CStr, CString};
    use std::ptr;

    use mooncake::capi::*;

    /// A `mc_pg *` that may cross to the thread running the other rank.
    struct Pg(*mut McPg);
    // SAFETY: mooncake.h allows a mc_pg to be used from any thread, one call at a time;
    // each handle here is used by one thread at a time.
    unsafe impl Send for Pg {}

    fn new_rank(rank: i32, options: &str) -> Pg {
        let opts = CString::new(options).unwrap();
        let mut pg = ptr::null_mut();
        // SAFETY: valid string and out pointer.
        assert_eq!(unsafe { mc_pg_new(rank, 2, opts.as_ptr(), &mut pg) }, 0);
        Pg(pg)
    }

    fn address(pg: &Pg) -> CString {
        let mut buf = vec![0 as c_char; 512];
        // SAFETY: `buf` is writable for its length; NULL needed_out is allowed.
        let rc = unsafe { mc_pg_address(pg.0, buf.as_mut_ptr(), buf.len(), ptr::null_mut()) };
        assert_eq!(rc, 0);
        // SAFETY: NUL-terminated by mc_pg_address.
        unsafe { CStr::from_ptr(buf.as_ptr()) }.to_owned()
    }

    #[test]
    fn two_ranks_through_the_c_abi_and_bad_input_refused() {
        // Bad input: a clear error, nothing created.
        let mut pg = ptr::null_mut();
        let bad = CString::new("timeout_ms=soon").unwrap();
        // SAFETY: valid pointers.
        unsafe {
            assert_eq!(
                mc_pg_new(0, 2, bad.as_ptr(), &mut pg),
                MC_ERR_INVALID_PARAMS_CODE
            );
            assert!(pg.is_null());
            assert_eq!(
                mc_pg_new(2, 2, ptr::null(), &mut pg),
                MC_ERR_INVALID_PARAMS_CODE
            );
            assert_eq!(mc_pg_barrier(ptr::null_mut()), MC_ERR_INVALID_PARAMS_CODE);
        }
        let ranks = [
            new_rank(0, "timeout_ms=20000"),
            new_rank(1, "timeout_ms=20000"),
        ];
        let addrs = [address(&ranks[0]), address(&ranks[1])];
        let list: Vec<*const c_char> = addrs.iter().map(|a| a.as_ptr()).collect();
        for pg in &ranks {
            // SAFETY: `list` holds two valid strings.
            assert_eq!(unsafe { mc_pg_connect(pg.0, list.as_ptr(), 2) }, 0);
        }
        let threads: Vec<_> = ranks
            .into_iter()
            .enumerate()
            .map(|(r, pg)| {
                std::thread::spawn(move || {
                    let mut v = vec![r as i32 + 1; 5000];
                    // SAFETY: `v` holds 5000 i32 (dtype 4).
                    let rc =
                        unsafe { mc_pg_all_reduce(pg.0, v.as_mut_ptr().cast(), v.len(), 4, 0) };
                    assert_eq!(rc, 0);
                    assert!(v.iter().all(|&x| x == 3));
                    // A wrong dtype is refused, and the group still works afterwards.
                    // SAFETY: as above.
                    let rc =
                        unsafe { mc_pg_all_reduce(pg.0, v.as_mut_ptr().cast(), v.len(), 9, 0) };
                    assert_eq!(rc, MC_ERR_INVALID_PARAMS_CODE);
                    let sizes = [3usize, 5];
                    let mine = vec![r as u8 + 10; sizes[r]];
                    let mut out = vec![0u8; 8];
                    // SAFETY: buffers sized as `sizes` says.
                    let rc = unsafe {
                        mc_pg_all_gather(
                            pg.0,
                            mine.as_ptr().cast(),
                            out.as_mut_ptr().cast(),
                            sizes.as_ptr(),
                        )
                    };
                    assert_eq!(rc, 0);
                    assert_eq!(out, [10, 10, 10, 11, 11, 11, 11, 11]);
                    // In place, as torch's tensor forms allow: the all-gather's input is
                    // this rank's block of its output, the reduce-scatter's output this
                    // rank's block of its input (both read their input before writing).
                    let mut whole = vec![0u8; 8];
                    let at = [0usize, 3][r];
                    whole[at..at + sizes[r]].fill(r as u8 + 10);
                    let base = whole.as_mut_ptr();
                    // SAFETY: `whole` covers both ranges; mooncake.h allows the overlap.
                    let rc = unsafe {
                        mc_pg_all_gather(pg.0, base.add(at).cast(), base.cast(), sizes.as_ptr())
                    };
                    assert_eq!(rc, 0);
                    assert_eq!(whole, out, "in-place all-gather");
                    let counts = [4usize, 4];
                    let mut blocks = vec![10 * (r as i32 + 1); 8];
                    let base = blocks.as_mut_ptr();
                    // SAFETY: `blocks` holds 8 i32 (dtype 4); the output is block `r`.
                    let rc = unsafe {
                        mc_pg_reduce_scatter(
                            pg.0,
                            base.cast(),
                            base.add(4 * r).cast(),
                            counts.as_ptr(),
                            4,
                            0,
                        )
                    };
                    assert_eq!(rc, 0);
                    assert_eq!(blocks[4 * r..4 * r + 4], [30; 4], "in-place reduce-scatter");
                    // all_to_all with its own wait bound: rank r sends r + 1 bytes to
                    // each; a zero bound is refused before anything moves.
                    let send = [r + 1; 2];
                    let recv = [1usize, 2];
                    let mine = vec![r as u8 + 20; 2 * (r + 1)];
                    let mut got = vec![0u8; 3];
                    for (timeout_us, want) in [(0u64, MC_ERR_INVALID_PARAMS_CODE), (5_000_000, 0)] {
                        // SAFETY: buffers sized as `send` and `recv` say.
                        let rc = unsafe {
                            mc_pg_all_to_all_timeout(
                                pg.0,
                                mine.as_ptr().cast(),
                                send.as_ptr(),
                                got.as_mut_ptr().cast(),
                                recv.as_ptr(),
                                timeout_us,
                            )
                        };
                        assert_eq!(rc, want);
                    }
                    assert_eq!(got, [20, 21, 21]);
                    let mut epoch = 0u64;
                    let mut mask = [0u8; 2];
                    // SAFETY: valid outputs.
                    unsafe {
                        assert_eq!(mc_pg_epoch(pg.0, &mut epoch), 0);
                        assert_eq!(mc_pg_active_ranks(pg.0, mask.as_mut_ptr(), 2), 0);
                        assert_eq!(
                            mc_pg_active_ranks(pg.0, mask.as_mut_ptr(), 3),
                            MC_ERR_INVALID_PARAMS_CODE
                        );
                    }
                    assert_eq!((epoch, mask), (1, [1, 1]));
                    let mut status = -1;
                    // SAFETY: valid output.
                    assert_eq!(unsafe { mc_pg_sync_after_failure(pg.0, &mut status) }, 0);
                    assert_eq!(status, 1, "nothing pending");
                    pg
                })
            })
            .collect();
        for t in threads {
            let pg = t.join().unwrap();
            // SAFETY: from mc_pg_new, freed once.
            unsafe { mc_pg_free(pg.0) };
        }
    }

    const MC_ERR_INVALID_PARAMS_CODE: i32 = mooncake::Code::InvalidParams as i32;
}

// ------------------------------------------------- membership safety (split brain, orders of deaths)

/// A rank that the parent stops (SIGSTOP) past the timeout during the same stream of
/// all-reduces as `run_stream`, then resumes: it must learn it was excluded and fail
/// clearly, never form a view of its own; then it joins again under its rank.
fn run_stalled(g: &Group) {
    let deadline = Instant::now() + 4 * STEP;
    let mut iter = 0usize;
    let error = loop {
        assert!(Instant::now() < deadline, "the stall was never noticed");
        let mut vals = vec![(g.rank() + 1) as f64; STREAM_LEN];
        vals.push(0.0);
        let mut buf = encode(DType::F32, &vals);
        match g.all_reduce(&mut buf, DType::F32, ReduceOp::Sum) {
            Ok(()) => {
                iter += 1;
                if iter % 20 == 0 {
                    say(&format!("progress {iter}"));
                }
            }
            Err(e) => break e,
        }
    };
    say(&format!("failed after the stall: {error}"));
    let status = g.sync_after_failure();
    say(&format!("sync {status:?} active {:?}", g.active_ranks()));
    assert!(
        !matches!(status, Ok(SyncStatus::Reconciled | SyncStatus::NoPending)),
        "an excluded rank formed or kept a view: {status:?} {:?}",
        g.active_ranks()
    );
    let mut buf = encode(DType::F32, &[1.0; 10]);
    let err = g
        .all_reduce(&mut buf, DType::F32, ReduceOp::Sum)
        .expect_err("an excluded rank computed alone");
    assert!(err.to_string().contains("join_group"), "{err}");
    say("excluded");
    g.join(STEP).expect("readmitted");
    say(&format!("joined epoch {}", g.epoch()));
    full_rounds(g);
}

/// Elements of a stream's all-reduces (and one for the vote): large enough to be
/// reduced in the caller's buffer (several cells a phase), so deaths land inside those.
/// One size throughout: a survivor that completed the operation a death interrupted
/// meets the others' next one (see the agreement round in the Python backend), which
/// must then still pair.
const STREAM_LEN: usize = 40_000;

/// Streams all-reduces until a failure was reconciled and five operations succeeded
/// in the new view (decided by an all-reduced vote, so every survivor stops after the
/// same one); returns the inactive ranks.
fn stream_until_recovered(g: &Group, label: &str) -> Vec<usize> {
    let start = g.epoch();
    let deadline = Instant::now() + STEP;
    let mut ok_in_epoch = (start, 0usize);
    let mut iter = 0usize;
    loop {
        assert!(Instant::now() < deadline, "no recovery within {STEP:?}");
        iter += 1;
        let started = Instant::now();
        let vote = if ok_in_epoch.0 != start && ok_in_epoch.1 >= 5 {
            1.0
        } else {
            0.0
        };
        let len = STREAM_LEN;
        let mut vals = vec![(g.rank() + 1) as f64; len];
        vals.push(vote);
        let mut buf = encode(DType::F32, &vals);
        let input = buf.clone();
        match g.all_reduce(&mut buf, DType::F32, ReduceOp::Sum) {
            Ok(()) => {
                let active = g.active_ranks();
                let sum: usize = (0..WORLD).filter(|&r| active[r]).map(|r| r + 1).sum();
                assert!(
                    buf[..4 * len] == encode(DType::F32, &vec![sum as f64; len]),
                    "sum over {active:?}"
                );
                let votes = f32::from_ne_bytes(buf[4 * len..].try_into().unwrap()) as usize;
                if votes == active.iter().filter(|a| **a).count() {
                    return (0..WORLD).filter(|&r| !active[r]).collect();
                }
                if ok_in_epoch.0 != g.epoch() {
                    ok_in_epoch = (g.epoch(), 0);
                }
                ok_in_epoch.1 += 1;
                if iter % 20 == 0 {
                    say(&format!("{label}progress {iter}"));
                }
            }
            Err(e) => {
                assert!(
                    buf == input,
                    "a failed all_reduce of {len} changed its buffer"
                );
                let failed_after = started.elapsed();
                let status = g.sync_after_failure().expect("sync_after_failure");
                assert!(
                    matches!(status, SyncStatus::Reconciled | SyncStatus::NoPending),
                    "{status:?}"
                );
                // Named after reconciling: a rank this one merely waited for (itself
                // waiting on the dead one) answered there and is not named.
                let names: Vec<String> = g.failed_ranks().iter().map(|r| r.to_string()).collect();
                say(&format!(
                    "{label}failed {} after {} ms: {e}",
                    names.join(","),
                    failed_after.as_millis()
                ));
                say(&format!(
                    "{label}synced {:?} epoch {}",
                    g.active_ranks(),
                    g.epoch()
                ));
            }
        }
    }
}

fn run_two_deaths(g: &Group) {
    for phase in 0..2 {
        let dead = stream_until_recovered(g, &format!("phase{phase} "));
        let names: Vec<String> = dead.iter().map(|r| r.to_string()).collect();
        say(&format!("phase{phase} recovered {}", names.join(",")));
    }
}

/// Rank 0 runs a barrier while the others run an all-reduce: each side sees the other
/// send the wrong operation and names a live rank. Reconciling must keep everyone
/// (all are alive and take part) in one view, not split the group along the blame.
fn run_mismatch(g: &Group) {
    let mut buf = encode(DType::I32, &[1.0; 64]);
    let first = if g.rank() == 0 {
        g.barrier()
    } else {
        g.all_reduce(&mut buf, DType::I32, ReduceOp::Sum)
    };
    // A rank that starts late takes part in the change its peers began and runs its
    // first operation in the new view, where it fails against the next one.
    say(&format!("first {first:?} failed {:?}", g.failed_ranks()));
    let deadline = Instant::now() + STEP;
    loop {
        assert!(Instant::now() < deadline, "never reconciled");
        let status = g.sync_after_failure().expect("sync_after_failure");
        assert_ne!(status, SyncStatus::Rejected, "a live rank was excluded");
        let mut buf = encode(DType::I64, &[(g.rank() + 1) as f64; 100]);
        if g.all_reduce(&mut buf, DType::I64, ReduceOp::Sum).is_ok() {
            let sum: usize = (0..WORLD)
                .filter(|&r| g.active_ranks()[r])
                .map(|r| r + 1)
                .sum();
            assert!(buf == encode(DType::I64, &[sum as f64; 100]));
            break;
        }
    }
    say(&format!(
        "agreed {:?} epoch {}",
        g.active_ranks(),
        g.epoch()
    ));
}

/// Three all-reduces; the last rank leaves the process the moment its third returns
/// (as `os._exit` would: no destructor runs), and the others must still complete it.
fn run_exit_after(g: &Group) {
    let sum: usize = (1..=WORLD).sum();
    for i in 0..3 {
        let mut buf = encode(DType::I64, &[(g.rank() + 1) as f64; 1000]);
        let result = g.all_reduce(&mut buf, DType::I64, ReduceOp::Sum);
        if g.rank() == WORLD - 1 && i == 2 && result.is_ok() {
            // SAFETY: _exit(2) ends the process at once; nothing here is shared.
            unsafe { libc::_exit(0) };
        }
        match result {
            Ok(()) if buf == encode(DType::I64, &[sum as f64; 1000]) => say(&format!("op {i} ok")),
            Ok(()) => say(&format!("op {i} wrong")),
            Err(e) => say(&format!("op {i} failed {e}")),
        }
    }
}

/// A rank that starts after a peer has already gone (its process closed, its address
/// published) connects at once instead of waiting out the timeout for it, and an
/// operation that must write to it fails at once naming it. The timeout is a day:
/// without either check this test would wait for it (threads, not a scope: a stuck one
/// must not hold the test). A rank whose first operation fails announces it; the other
/// may see that before its own first operation and join the reconciliation instead, so
/// its first operation then succeeds over the survivors once the first rank has synced
/// and tried again (what a caller does after a failure).
#[test]
fn a_peer_gone_before_connecting_does_not_hold_up_the_start() {
    let start = |r: usize| {
        let mut o = GroupOptions::new(r, 3);
        o.timeout = Duration::from_secs(86_400);
        std::sync::Arc::new(Group::new(o).expect("group starts"))
    };
    let (g0, g1) = (start(0), start(1));
    let gone = start(2).address();
    let addrs = vec![g0.address(), g1.address(), gone];
    let (done, results) = mpsc::channel();
    for g in [g0, g1] {
        let (addrs, done) = (addrs.clone(), done.clone());
        std::thread::spawn(move || {
            let connected = g.connect(&addrs).is_ok();
            let mut first_failure = None;
            let mut outcome = Err("never tried".to_owned());
            for attempt in 0..3 {
                let mut buf = encode(DType::I32, &[1.0; 16]);
                match g.all_reduce(&mut buf, DType::I32, ReduceOp::Sum) {
                    Ok(()) => {
                        outcome = Ok(buf);
                        break;
                    }
                    Err(e) => {
                        if attempt == 0 {
                            first_failure = Some(g.failed_ranks());
                        }
                        outcome = Err(e.to_string());
                        let _ = g.sync_after_failure();
                    }
                }
            }
            let active = g.active_ranks();
            // The group goes back to be kept until the other rank is done too.
            done.send((connected, first_failure, outcome, active, g))
                .unwrap();
        });
    }
    let mut first_failures = 0;
    let mut kept = Vec::new();
    for _ in 0..2 {
        let (connected, first_failure, outcome, active, g) =
            results.recv_timeout(STEP).expect("held up by rank 2");
        kept.push(g);
        assert!(connected, "connect failed");
        if let Some(named) = first_failure {
            assert_eq!(named, vec![2], "the first operation's failed ranks");
            first_failures += 1;
        }
        assert_eq!(outcome, Ok(encode(DType::I32, &[2.0; 16])));
        assert_eq!(active, vec![true, true, false]);
    }
    assert!(first_failures >= 1, "no first operation named rank 2");
}

#[test]
fn a_rank_that_exits_right_after_an_operation_has_delivered_its_part() {
    let dir = rendezvous_dir("exitafter");
    // Same host: a write is in flight until its copy is made, on the worker or here.
    let mut ranks: Vec<Rank> = (0..WORLD)
        .map(|r| Rank::start("exit_after", &dir, r, false))
        .collect();
    for r in ranks.iter_mut().take(WORLD - 1) {
        for i in 0..3 {
            assert_eq!(r.expect(&format!("op {i}")), format!("op {i} ok"));
        }
        r.expect("done");
    }
    for r in &mut ranks {
        r.finish();
    }
    let _ = std::fs::remove_dir_all(&dir);
}

/// Every rank reports its rounds over the full group, then exits cleanly.
fn all_run_full_rounds_and_exit(ranks: &mut [Rank], dir: &Path) {
    for r in ranks.iter_mut() {
        r.expect("full epoch");
        r.expect("done");
    }
    for r in ranks.iter_mut() {
        r.finish();
    }
    let _ = std::fs::remove_dir_all(dir);
}

fn signal(r: &Rank, sig: i32) {
    let pid = r.child.id() as i32;
    // SAFETY: kill(2) on our own child's pid; it has not been reaped (the Rank holds it).
    let rc = unsafe { libc::kill(pid, sig) };
    assert_eq!(rc, 0, "kill({pid}, {sig})");
}

/// Every line starting `prefix` ("phaseN failed") a rank printed names exactly
/// `victim`; returns how many there were.
fn failures_name(r: &Rank, prefix: &str, victim: usize) -> usize {
    let lines: Vec<&String> = r.log.iter().filter(|l| l.starts_with(prefix)).collect();
    for l in &lines {
        let named = l.split(' ').nth(2).unwrap_or_default();
        assert_eq!(named, victim.to_string(), "{l}");
    }
    lines.len()
}

#[test]
fn a_stalled_rank_is_told_it_is_out_and_never_computes_alone() {
    let stalled = 3;
    let dir = rendezvous_dir("stall");
    let mut ranks: Vec<Rank> = (0..WORLD)
        .map(|r| {
            let script = if r == stalled { "stalled" } else { "stream" };
            Rank::start(script, &dir, r, false)
        })
        .collect();
    for r in &mut ranks {
        r.expect("progress");
    }
    signal(&ranks[stalled], libc::SIGSTOP);
    for r in ranks.iter_mut().take(stalled) {
        assert_eq!(r.expect("recovered"), format!("recovered {stalled}"));
    }
    signal(&ranks[stalled], libc::SIGCONT);
    let sync = ranks[stalled].expect("sync");
    eprintln!("stalled rank: {sync}");
    ranks[stalled].expect("excluded");
    for r in ranks.iter_mut().take(stalled) {
        r.tell("activate");
    }
    ranks[stalled].expect("joined");
    all_run_full_rounds_and_exit(&mut ranks, &dir);
}

#[test]
fn two_ranks_die_one_after_the_other_the_coordinator_second_and_the_rest_go_on() {
    let (first, second) = (2, 0);
    let dir = rendezvous_dir("two-deaths");
    let mut ranks: Vec<Rank> = (0..WORLD)
        .map(|r| Rank::start("two_deaths", &dir, r, false))
        .collect();
    for r in &mut ranks {
        r.expect("phase0 progress");
    }
    ranks[first].kill();
    for (i, r) in ranks.iter_mut().enumerate().filter(|(i, _)| *i != first) {
        let line = r.expect("phase0 recovered");
        assert_eq!(line, format!("phase0 recovered {first}"), "rank {i}");
        r.expect("phase1 progress");
    }
    ranks[second].kill();
    let mut named = 0;
    for (i, r) in ranks
        .iter_mut()
        .enumerate()
        .filter(|(i, _)| *i != first && *i != second)
    {
        let line = r.expect("phase1 recovered");
        assert_eq!(
            line,
            format!("phase1 recovered {second},{first}"),
            "rank {i}"
        );
        r.expect("done");
        named += failures_name(r, "phase0 failed", first);
        named += failures_name(r, "phase1 failed", second);
    }
    assert!(named > 0, "no survivor saw a failure");
    for (_, r) in ranks
        .iter_mut()
        .enumerate()
        .filter(|(i, _)| *i != first && *i != second)
    {
        r.finish();
    }
    let _ = std::fs::remove_dir_all(&dir);
}

#[test]
fn ranks_blaming_each_other_for_a_mismatch_reconcile_into_one_view() {
    let dir = rendezvous_dir("mismatch");
    let mut ranks: Vec<Rank> = (0..WORLD)
        .map(|r| Rank::start("mismatch", &dir, r, false))
        .collect();
    let mut agreed = Vec::new();
    for r in &mut ranks {
        agreed.push(r.expect("agreed"));
        r.expect("done");
    }
    assert!(
        agreed.iter().all(|a| a == &agreed[0]),
        "ranks ended in different views: {agreed:?}"
    );
    assert!(
        agreed[0].starts_with("agreed [true, true, true, true]"),
        "{agreed:?}"
    );
    for r in &mut ranks {
        r.finish();
    }
    let _ = std::fs::remove_dir_all(&dir);
}

// ------------------------------------------------- stale writes across an epoch change (issue 12 perf/safety)

mod stale_epoch {
    use std::time::{Duration, Instant};

    use mooncake::collective::layout::{encode_cell, CellStamp, Layout, CELL_HEADER};
    use mooncake::collective::view::next_epoch;
    use mooncake::collective::{DType, Group, ReduceOp};

    const CELLS: usize = 2;
    const CELL_BYTES: usize = 64 << 10;

    pub(super) fn start(world: usize) -> Vec<Group> {
        crate::common::groups::connected_groups(world, |o| {
            o.timeout = Duration::from_secs(5);
            o.cells_per_peer = CELLS;
            o.cell_bytes = CELL_BYTES;
        })
    }

    /// The base address of a group's buffer in this process (from `segment#hex#layout`).
    pub(super) fn buffer_base(g: &Group) -> usize {
        let addr = g.address();
        let hex = addr.rsplit('#').nth(1).expect("address has a buffer part");
        usize::from_str_radix(hex, 16).expect("hex buffer address")
    }

    fn read_u64(at: usize) -> u64 {
        // SAFETY: callers pass an 8-byte-aligned cell header word inside a live group's
        // buffer; peers write it concurrently, hence volatile.
        unsafe { std::ptr::read_volatile(at as *const u64) }
    }

    #[test]
    fn a_write_of_the_old_epoch_landing_after_an_epoch_change_is_ignored() {
        let mut groups = start(3);
        // Epoch change: ranks 0 and 1 deactivate rank 2 (which, proposing that itself,
        // would leave on its own, coordinating the change: see the epoch below).
        std::thread::scope(|s| {
            let handles: Vec<_> = groups[..2]
                .iter()
                .map(|g| s.spawn(move || g.propose(false, &[2])))
                .collect();
            for h in handles {
                h.join().unwrap().expect("proposal runs");
            }
        });
        drop(groups.pop());
        let (g0, g1) = (&groups[0], &groups[1]);
        assert_eq!(g1.epoch(), 2, "the proposal started the next epoch");
        assert_eq!(g0.epoch(), 2);
        // Cells carry the internal epoch: nobody was suspected, so rank 0, the lowest
        // member, coordinated the change of epoch 1.
        let (old_epoch, epoch) = (1, next_epoch(1, 0));
        assert_eq!(g1.active_ranks(), [true, true, false]);

        let layout = Layout {
            ranks: 3,
            cells: CELLS,
            cell_bytes: CELL_BYTES,
        };
        let base1 = buffer_base(g1);
        let current = base1 + layout.recv_cell(0, 0, epoch);
        let stale = base1 + layout.recv_cell(0, 0, old_epoch);
        assert_ne!(stale, current, "consecutive epochs use different cells");
        let elems = 1024;
        std::thread::scope(|s| {
            let sender = s.spawn(move || {
                let mut v = vec![1i32; elems];
                // SAFETY: viewing i32s as bytes.
                let bytes = unsafe {
                    std::slice::from_raw_parts_mut(v.as_mut_ptr().cast::<u8>(), elems * 4)
                };
                g0.all_reduce(bytes, DType::I32, ReduceOp::Sum).map(|()| v)
            });
            // Rank 0's first message of the new epoch has landed in rank 1's buffer
            // (rank 1 has not started the operation yet, so it stays unconsumed).
            let deadline = Instant::now() + Duration::from_secs(30);
            while !(read_u64(current + 8) == epoch && read_u64(current + 16) == 1) {
                assert!(Instant::now() < deadline, "rank 0's message never landed");
                std::thread::yield_now();
            }
            // Now a write rank 0 posted in the old epoch lands: same channel, same
            // message number and operation tag, wrong contents, valid CRC.
            let mut cell = vec![0u8; CELL_HEADER + elems * 4];
            let old = CellStamp {
                epoch: old_epoch,
                msg: 1,
                tag: read_u64(current + 24),
                len: elems * 4,
                total: (elems * 4) as u64,
            };
            encode_cell(&mut cell, &old, &vec![0x7f; elems * 4]);
            // SAFETY: the old epoch's cell for rank 0 lies inside rank 1's buffer
            // (`layout.total()` bytes, alive as long as `g1`); this is where the old
            // epoch's write was addressed, as the engine would store it.
            unsafe { std::ptr::copy_nonoverlapping(cell.as_ptr(), stale as *mut u8, cell.len()) };

            let mut v = vec![2i32; elems];
            // SAFETY: viewing i32s as bytes.
            let bytes =
                unsafe { std::slice::from_raw_parts_mut(v.as_mut_ptr().cast::<u8>(), elems * 4) };
            g1.all_reduce(bytes, DType::I32, ReduceOp::Sum)
                .expect("rank 1's all_reduce succeeds");
            assert!(v.iter().all(|&x| x == 3), "rank 1 got {:?}", &v[..4]);
            let v0 = sender
                .join()
                .unwrap()
                .expect("rank 0's all_reduce succeeds");
            assert!(v0.iter().all(|&x| x == 3), "rank 0 got {:?}", &v0[..4]);
        });
        // The stale cell was never taken: it is still there, stamped with the old epoch.
        assert_eq!(read_u64(stale + 8), old_epoch);
    }
}

// ------------------------------------------------- membership review fixes (rival views, dead coordinator)

mod membership_races {
    use std::time::{Duration, Instant};

    use mooncake::collective::layout::{
        decode_proposal, encode_proposal, Layout, Mask, Proposal, RecordKind, RECORD,
    };
    use mooncake::collective::view::{next_epoch, ViewRecord};
    use mooncake::collective::{Group, SyncStatus};

    use super::stale_epoch::{buffer_base, start};

    fn layout(world: usize) -> Layout {
        Layout {
            ranks: world,
            cells: 2,
            cell_bytes: 64 << 10,
        }
    }

    /// Puts `record` where rank `src` would have written it into `g`'s slot at `off`.
    fn plant(g: &Group, off: usize, record: &[u8]) {
        assert!(record.len() <= RECORD);
        // SAFETY: `off` is a control slot of `g`'s buffer (RECORD bytes, alive as long
        // as `g`), which is where a peer's one-sided write of this record would land.
        unsafe {
            std::ptr::copy_nonoverlapping(
                record.as_ptr(),
                (buffer_base(g) + off) as *mut u8,
                record.len(),
            )
        };
    }

    fn plant_view(g: &Group, world: usize, v: &ViewRecord) {
        let rec = v.encode().expect("view fits");
        plant(g, layout(world).view(v.coordinator), &rec);
    }

    /// Review finding 1: two coordinators of the same change (a stalled one that
    /// resumed, and the one the others moved to) both publish. A rank that adopted the
    /// lower view first must still move to the higher, whose coordinator is outside
    /// the lower view, and must not follow the losing side's next change.
    #[test]
    fn a_rank_that_adopted_the_lower_rival_moves_to_the_higher_and_stays() {
        let world = 3;
        let groups = start(world);
        let g2 = &groups[2];
        let lower = ViewRecord {
            epoch: next_epoch(1, 0),
            base: 1,
            coordinator: 0,
            mask: Mask::of(&[0, 2]),
            ..ViewRecord::default()
        };
        plant_view(g2, world, &lower);
        assert_eq!(g2.sync_after_failure().unwrap(), SyncStatus::Reconciled);
        assert_eq!(g2.active_ranks(), [true, false, true]);
        assert_eq!(g2.epoch(), 2);

        let higher = ViewRecord {
            epoch: next_epoch(1, 1),
            base: 1,
            coordinator: 1,
            mask: Mask::of(&[1, 2]),
            ..ViewRecord::default()
        };
        plant_view(g2, world, &higher);
        assert_eq!(g2.sync_after_failure().unwrap(), SyncStatus::Reconciled);
        assert_eq!(g2.active_ranks(), [false, true, true], "kept the higher");
        assert_eq!(g2.epoch(), 2, "rivals are one change");

        let losing_side_next = ViewRecord {
            epoch: next_epoch(lower.epoch, 0),
            base: lower.epoch,
            coordinator: 0,
            mask: Mask::of(&[0, 2]),
            ..ViewRecord::default()
        };
        plant_view(g2, world, &losing_side_next);
        assert_eq!(g2.sync_after_failure().unwrap(), SyncStatus::NoPending);
        assert_eq!(g2.active_ranks(), [false, true, true], "not pulled back");
    }

    /// Whether `g`'s sync slot for `src` holds a report of a change of `base`.
    fn reported(g: &Group, world: usize, src: usize, base: u64) -> bool {
        let off = buffer_base(g) + layout(world).sync(src);
        let mut slot = [0u8; RECORD];
        // SAFETY: the sync slot lies inside `g`'s live buffer; a torn copy fails the
        // record's CRC and reads as no report.
        unsafe { std::ptr::copy_nonoverlapping(off as *const u8, slot.as_mut_ptr(), RECORD) };
        decode_proposal(&slot, RecordKind::Sync).is_some_and(|p| p.base == base)
    }

    /// Review finding 2: ranks 2 and 3 report to coordinator 0, which then dies after
    /// announcing the change. Rank 1 arrives later, cannot reach 0 and coordinates;
    /// it must wait for 2 and 3 (still waiting out rank 0) instead of leaving the group
    /// for want of a majority, and the three go on together.
    #[test]
    fn a_coordinator_dying_mid_change_leaves_the_live_ranks_in_one_group() {
        let world = 4;
        let mut groups: Vec<Option<Group>> = start(world).into_iter().map(Some).collect();
        let l = layout(world);
        let announce = encode_proposal(
            RecordKind::Announce,
            &Proposal {
                base: 1,
                ..Proposal::default()
            },
        );
        // Rank 0 announced a change of epoch 1 to everyone (its proof of life) ...
        for g in groups.iter().skip(1).flatten() {
            plant(g, l.announce(0), &announce);
        }
        std::thread::scope(|s| {
            let (dying, live) = groups.split_at_mut(1);
            let late = live[0].as_ref().expect("rank 1");
            let early: Vec<_> = live[1..]
                .iter()
                .map(|g| {
                    let g = g.as_ref().expect("rank 2 or 3");
                    s.spawn(move || g.sync_after_failure())
                })
                .collect();
            // ... then took the reports of ranks 2 and 3 ...
            let deadline = Instant::now() + Duration::from_secs(30);
            let g0 = dying[0].as_ref().expect("rank 0");
            while !(reported(g0, world, 2, 1) && reported(g0, world, 3, 1)) {
                assert!(Instant::now() < deadline, "ranks 2 and 3 never reported");
                std::thread::yield_now();
            }
            // ... and died.
            drop(dying[0].take());
            let status = late.sync_after_failure();
            assert_eq!(status.ok(), Some(SyncStatus::Reconciled), "rank 1");
            for (i, h) in early.into_iter().enumerate() {
                let status = h.join().expect("no panic");
                assert_eq!(status.ok(), Some(SyncStatus::Reconciled), "rank {}", i + 2);
            }
        });
        for g in groups.iter().flatten() {
            assert_eq!(g.active_ranks(), [false, true, true, true]);
            assert_eq!(g.epoch(), 2);
        }
    }
}

mod agreement {
    use std::time::Duration;

    use mooncake::collective::{DType, ReduceOp};

    #[test]
    fn agree_max_gives_every_rank_the_largest_value() {
        let groups = crate::common::groups::connected_groups(3, |o| {
            o.timeout = Duration::from_secs(5);
        });
        let got: Vec<u64> = std::thread::scope(|s| {
            let handles: Vec<_> = groups
                .iter()
                .enumerate()
                .map(|(r, g)| s.spawn(move || g.agree_max([7, 1 << 45, 3][r])))
                .collect();
            handles
                .into_iter()
                .map(|h| h.join().unwrap().unwrap())
                .collect()
        });
        assert_eq!(got, vec![1 << 45; 3]);
    }

    /// An agreement never pairs with a caller's collective, even one of the same size.
    #[test]
    fn an_agreement_against_a_callers_operation_fails_on_both_sides() {
        let groups = crate::common::groups::connected_groups(2, |o| {
            o.timeout = Duration::from_secs(2);
        });
        let (agreed, reduced) = std::thread::scope(|s| {
            let a = s.spawn(|| groups[0].agree_max(5));
            let b = s.spawn(|| {
                let mut buf = 9u64.to_le_bytes();
                groups[1]
                    .all_reduce(&mut buf, DType::I64, ReduceOp::Max)
                    .map(|()| buf)
            });
            (a.join().unwrap(), b.join().unwrap())
        });
        assert!(agreed.is_err(), "agreement paired: {agreed:?}");
        assert!(reduced.is_err(), "all_reduce paired: {reduced:?}");
    }
}

mod failed_all_reduce {
    use std::time::Duration;

    use mooncake::collective::{DType, Group, GroupOptions, ReduceOp};

    /// `elems` distinct f32 values of rank `r`.
    fn input(r: usize, elems: usize) -> Vec<u8> {
        (0..elems)
            .flat_map(|i| ((r * 1000 + i) as f32).to_le_bytes())
            .collect()
    }

    /// Ranks 0 and 1 of `groups` all-reduce their `input` of `elems` with `op` at once
    /// (rank 2 does not take part) and must both fail naming rank 2, each buffer left
    /// as it was.
    fn ranks_0_and_1_fail_unchanged(groups: &[Group], elems: usize, op: ReduceOp) {
        let results: Vec<_> = std::thread::scope(|s| {
            let handles: Vec<_> = groups[..2]
                .iter()
                .enumerate()
                .map(|(r, g)| {
                    s.spawn(move || {
                        let mut buf = input(r, elems);
                        let result = g.all_reduce(&mut buf, DType::F32, op);
                        (result, buf, g.failed_ranks())
                    })
                })
                .collect();
            handles.into_iter().map(|h| h.join().unwrap()).collect()
        });
        for (r, (result, buf, failed)) in results.into_iter().enumerate() {
            let error = result.expect_err("completed without rank 2");
            assert_eq!(failed, vec![2], "rank {r}: {error}");
            assert!(
                buf == input(r, elems),
                "rank {r}: buffer changed by a failed all_reduce ({error})"
            );
        }
    }

    fn three_groups(tweak: impl Fn(&mut GroupOptions)) -> Vec<Group> {
        crate::common::groups::connected_groups(3, |o| {
            o.timeout = Duration::from_millis(1000);
            o.cell_bytes = 8 << 10;
            tweak(o);
        })
    }

    /// Above 64 KiB an all-reduce reduces in the caller's buffer; when a peer never
    /// answers, the parts already folded in from the others are undone: the buffer is
    /// the caller's input again, ready for a retry over the survivors.
    #[test]
    fn a_failed_large_all_reduce_leaves_the_buffer_as_it_was() {
        let groups = three_groups(|o| o.cells_per_peer = 4);
        // Rank 2 is alive and never calls it.
        ranks_0_and_1_fail_unchanged(&groups, 3 * 8192, ReduceOp::Sum);
    }

    /// The same when the peer fails after the reduce-scatter phase: rank 2 posts its
    /// parts of blocks 0 and 1 and then fails on its own (it gives one element more,
    /// so its block 2 is one longer than the others send), so ranks 0 and 1 finish the
    /// first phase, overwrite each other's block with the result in the second, and
    /// time out waiting for rank 2's block: all of that is undone.
    #[test]
    fn an_all_reduce_failing_in_its_second_phase_leaves_the_buffer_as_it_was() {
        let groups = three_groups(|o| {
            // Rank 2's parts (32 KiB each) go out at once, before it waits.
            o.cells_per_peer = 8;
            // No rank acts on another's failure: only the timeouts end the operations.
            o.auto_deactivate_on_failure = false;
            o.auto_sync_on_failure = false;
            // The scratch is freed after each operation (rank 2's first) and made anew.
            o.staging_keep_bytes = 0;
        });
        let elems = 3 * 8192;
        let mut longer = input(2, elems + 1);
        let early = groups[2].all_reduce(&mut longer, DType::F32, ReduceOp::Avg);
        assert!(early.is_err(), "rank 2 completed alone: {early:?}");
        ranks_0_and_1_fail_unchanged(&groups, elems, ReduceOp::Avg);
    }
}

/// With `agree_on_new_view` (what `mooncake.pg` sets), a collective that enters a new
/// view at its own start (here: reconciling the failure its previous operation saw)
/// runs nothing in it and is refused, so the caller agrees first, as the rank that
/// reconciled through `sync_after_failure` does; both then run the operation again.
/// Without the refusal the two would run different operations in the new view.
#[test]
fn a_collective_entering_a_new_view_at_its_start_is_refused_until_agreed() {
    let mut groups = common::groups::connected_groups(3, |o| {
        o.timeout = Duration::from_millis(1500);
        o.agree_on_new_view = true;
        o.cell_bytes = 64 << 10;
        o.cells_per_peer = 2;
    });
    // Rank 2 stays up, silent, through the failing operation: both ranks are then
    // inside it when it times out, whichever thread starts first. (Were it gone, a
    // write to it would fail at once, and a rank whose thread starts late would find
    // the other's failure announced and enter the change at its start, then wait
    // four timeouts there for a rank held behind the join below: no majority, and
    // each rank in turn leaves the group.)
    let silent = groups.pop();
    let (g0, g1) = (&groups[0], &groups[1]);
    let sum = |g: &Group| {
        let mut v = [1u8; 64];
        g.all_reduce(&mut v, DType::U8, ReduceOp::Sum)
            .map(|()| v[0])
    };
    std::thread::scope(|s| {
        let a = s.spawn(|| sum(g0));
        let b = s.spawn(|| sum(g1));
        assert!(a.join().unwrap().is_err(), "rank 2 never answered");
        assert!(b.join().unwrap().is_err(), "rank 2 never answered");
    });
    drop(silent); // gone now: the reconciliation drops it as a lifeless suspect
    let epoch = g0.epoch();
    std::thread::scope(|s| {
        // Rank 0 reconciles explicitly, then agrees; rank 1 just runs its next
        // operation, which reconciles at its start and must not run there.
        let a = s.spawn(|| {
            g0.sync_after_failure().expect("reconciled");
            g0.agree_max(7)
        });
        let refused = sum(g1).expect_err("entered a new view at its start");
        assert_eq!(
            refused.code(),
            mooncake::Code::UnavailableInCurrentStatus,
            "{refused}"
        );
        // Refused for the new view, not for leaving the group (same code).
        assert!(
            !refused.to_string().contains("leaves the group"),
            "{refused}"
        );
        assert_eq!(g1.agree_max(3).expect("agreed"), 7);
        assert_eq!(a.join().unwrap().expect("agreed"), 7);
    });
    assert!(g0.epoch() > epoch);
    assert_eq!(g1.active_ranks(), [true, true, false]);
    std::thread::scope(|s| {
        let a = s.spawn(|| sum(g0));
        assert_eq!(sum(g1).expect("runs in the new view"), 2);
        assert_eq!(a.join().unwrap().expect("runs in the new view"), 2);
    });
}

mod point_to_point {
    use std::time::Duration;

    use mooncake::collective::{Group, ProposalStatus};
    use mooncake::Code;

    fn three_groups(timeout_ms: u64) -> Vec<Group> {
        crate::common::groups::connected_groups(3, |o| {
            o.timeout = Duration::from_millis(timeout_ms);
        })
    }

    /// Ranks 0 and 1 each send to and receive from both other ranks in one call; rank 2
    /// is gone. Their messages to each other go through, and each call fails naming
    /// exactly rank 2, whose receive buffer is left as it was.
    #[test]
    fn a_gone_peer_fails_only_the_messages_with_it() {
        let mut groups = three_groups(1000);
        drop(groups.pop());
        let results: Vec<_> = std::thread::scope(|s| {
            let handles: Vec<_> = groups
                .iter()
                .enumerate()
                .map(|(r, g)| {
                    s.spawn(move || {
                        let other = 1 - r;
                        let mine = [r as u8 + 1; 100];
                        let (mut from_other, mut from_gone) = ([0u8; 100], [0u8; 100]);
                        let result = g.send_recv(
                            &[(other, &mine[..]), (2, &mine[..])],
                            &mut [(other, &mut from_other[..]), (2, &mut from_gone[..])],
                        );
                        (result, g.failed_ranks(), from_other, from_gone)
                    })
                })
                .collect();
            handles.into_iter().map(|h| h.join().unwrap()).collect()
        });
        for (r, (result, failed, from_other, from_gone)) in results.into_iter().enumerate() {
            let error = result.expect_err("rank 2 never answered");
            assert_eq!(error.code(), Code::Timeout, "rank {r}: {error}");
            assert_eq!(failed, vec![2], "rank {r}: {error}");
            assert_eq!(from_other, [(1 - r) as u8 + 1; 100], "rank {r}");
            assert_eq!(from_gone, [0; 100], "rank {r}");
        }
    }

    /// A send is done only once its receiver has taken it: one to a live rank that
    /// never receives fails, naming it.
    #[test]
    fn a_send_nobody_receives_fails() {
        let groups = three_groups(500);
        let error = groups[0]
            .send_recv(&[(1, &[7u8; 8][..])], &mut [])
            .expect_err("rank 1 never received");
        assert_eq!(error.code(), Code::Timeout, "{error}");
        assert_eq!(groups[0].failed_ranks(), vec![1]);
    }

    /// A rank that deactivates only itself leaves without the others, who are between
    /// operations: they see the view without it on `refresh` or at their next
    /// operation, and run without it; it is no longer a member.
    #[test]
    fn a_rank_leaving_by_itself_needs_no_one_else() {
        let groups = three_groups(2000);
        let left = groups[1].propose(false, &[1]).expect("left");
        assert_eq!(left.status, ProposalStatus::Applied, "{left:?}");
        assert_eq!((left.new_epoch, groups[1].epoch()), (2, 2));
        assert_eq!(groups[1].active_ranks(), [true, false, true]);
        assert_eq!(groups[0].epoch(), 1, "adopted only when it looks");
        groups[0].refresh();
        assert_eq!(groups[0].epoch(), 2);
        assert_eq!(groups[0].active_ranks(), [true, false, true]);
        // Rank 2 adopts it as its operation starts.
        std::thread::scope(|s| {
            let a = s.spawn(|| groups[0].barrier());
            groups[2].barrier().expect("runs without rank 1");
            a.join().unwrap().expect("runs without rank 1");
        });
        assert_eq!(groups[2].active_ranks(), [true, false, true]);
        let out = groups[1].barrier().expect_err("no longer a member");
        assert_eq!(out.code(), Code::UnavailableInCurrentStatus, "{out}");
    }
}
