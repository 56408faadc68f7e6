#!/usr/bin/env python3
"""Mooncake PG against torch's gloo backend, same run, same host.

For each rank count (2, 4), operation (all_reduce, all_gather) and size (4 KiB, 1 MiB,
64 MiB): one process per rank, a warm-up, then timed iterations; the median per-op
latency of each backend. Then recovery: four mooncake-cpu ranks stream all_reduces, one
is killed with SIGKILL, and the survivors report when their first correct all_reduce
over the rest finished (wall clock, same host as the kill). Then Mooncake EP: four ranks
each dispatch and combine 128 tokens (hidden 1024, f32, top-4 of 16 experts) with
``mooncake.ep``; the baseline moves the same rows with gloo's all_to_all_single (counts,
rows out, rows back; no per-expert layout), reported as tokens/s over all ranks. Then
overlap: each rank issues a 4 MiB all_reduce with ``async_op=True``, computes (four
384x384 matmuls), and waits; the median of the whole, with the compute's alone and the
same without overlap (a synchronous all_reduce, then the compute).

Prints one JSON object per line: {bench, op, ranks, bytes, backend, lat_p50_us, gbps,
baseline, baseline_lat_p50_us, ratio_to_baseline, cpu_us_per_op, baseline_cpu_us_per_op}
(ratio > 1: mooncake faster; CPU time is rank 0's process, all its threads, per
operation: steadier than latency on a shared host), and
{bench: "pg_recovery", ...}. Usage: python bench/pg_bench.py [--quick] [--ranks 2,4]
[--sizes 4096,1048576] [--parts all_reduce,all_gather,ep,recovery,overlap]
[--ep-iters N]
(needs torch and the mooncake package in the interpreter running it).
"""

import json
import os
import signal
import subprocess
import sys
import time

WORKER = r"""
import os, sys, time, json, datetime, statistics, resource
import torch, torch.distributed as dist
from mooncake import pg

rank, world = int(os.environ["B_RANK"]), int(os.environ["B_WORLD"])
backend, op, nbytes, iters = (os.environ["B_BACKEND"], os.environ["B_OP"],
                              int(os.environ["B_BYTES"]), int(os.environ["B_ITERS"]))
store = dist.TCPStore("127.0.0.1", int(os.environ["B_PORT"]), is_master=False,
                      timeout=datetime.timedelta(seconds=120))
kw = {}
if backend == "mooncake-cpu":
    cell = os.environ.get("B_CELL_BYTES")
    kw["pg_options"] = pg.MooncakeBackendOptions(
        timeout_ms=int(os.environ.get("B_TIMEOUT", "30000")),
        cell_bytes=int(cell) if cell else None)
dist.init_process_group(backend=backend, store=store, rank=rank, world_size=world, **kw)
n = nbytes // 4
x = torch.ones(n, dtype=torch.float32)
outs = torch.empty(n * world, dtype=torch.float32)

def once():
    if op == "all_reduce":
        dist.all_reduce(x)
    else:
        dist.all_gather_into_tensor(outs, x)

extra = {}
if op == "overlap":
    # An all_reduce issued with async_op=True while the rank computes (four 384x384
    # matmuls, about as long as gloo's 4 MiB all_reduce here), then waited for.
    torch.set_num_threads(1)
    m = torch.randn(384, 384)

    def compute():
        for _ in range(4):
            m @ m

    def once():
        work = dist.all_reduce(x, async_op=True)
        compute()
        work.wait()

    def sequential():  # the same without overlap: all_reduce, then compute
        dist.all_reduce(x)
        compute()

    for name, f in (("compute_alone_us", compute), ("sequential_us", sequential)):
        times = []
        for _ in range(max(3, iters)):
            t0 = time.perf_counter()
            f()
            times.append(time.perf_counter() - t0)
        extra[name] = statistics.median(times) * 1e6

if op == "ep":
    from mooncake import ep
    T, H, K, E = 128, 1024, 4, 16
    g = torch.Generator().manual_seed(rank)
    xt = torch.randn(T, H, generator=g)
    topk = torch.stack([torch.randperm(E, generator=g)[:K] for _ in range(T)])
    w = torch.rand(T, K, generator=g)
    if backend == "mooncake-cpu":
        buf = ep.Buffer(dist.group.WORLD, ep.Buffer.get_ep_buffer_size_hint(T, H, world, E))
        active = torch.ones(world, dtype=torch.int32)

        def once():
            rx, cnt, h, _, _ = buf.dispatch(xt, topk, active, T, E, 30_000_000, use_fp8=False)
            buf.combine(rx, topk, w, active, 30_000_000, h)
    else:
        flat = topk.reshape(-1)
        order = torch.argsort(flat, stable=True)
        dest = flat[order] // (E // world)

        def once():
            send = torch.bincount(dest, minlength=world)
            recv = torch.empty_like(send)
            dist.all_to_all_single(recv, send)
            rows = xt[order // K]
            got = torch.empty(int(recv.sum()), H)
            dist.all_to_all_single(got, rows, recv.tolist(), send.tolist())
            back = torch.empty_like(rows)
            dist.all_to_all_single(back, got, send.tolist(), recv.tolist())
            out = torch.zeros(T, H)
            out.index_add_(0, order // K, back * w.reshape(-1)[order].reshape(-1, 1))

if op == "recovery":
    deadline = time.time() + 120
    first_fail = None
    while time.time() < deadline:
        t = torch.full((1024,), float(rank + 1))
        w = dist.all_reduce(t, async_op=True)
        try:
            w.wait()
        except pg.MooncakeCollectiveError:
            first_fail = first_fail or time.time()
            pg.sync_after_failure(dist.group.WORLD)
            continue
        active = pg.get_active_ranks(dist.group.WORLD)
        if first_fail is not None or int(active.sum()) < world:
            want = float(sum(r + 1 for r in range(world) if active[r]))
            assert float(t[0]) == want
            print(json.dumps({"recovered_at": time.time(), "failed_at": first_fail}), flush=True)
            break
        print("tick", flush=True)
    sys.exit(0)

for _ in range(max(2, iters // 10)):
    once()
dist.barrier()
lat = []
cpu0 = resource.getrusage(resource.RUSAGE_SELF)
for _ in range(iters):
    t0 = time.perf_counter()
    once()
    lat.append(time.perf_counter() - t0)
cpu1 = resource.getrusage(resource.RUSAGE_SELF)
cpu = sum(getattr(cpu1, f) - getattr(cpu0, f) for f in ("ru_utime", "ru_stime"))
if rank == 0:
    print(json.dumps({"lat_p50_us": statistics.median(lat) * 1e6,
                      "cpu_us": cpu / iters * 1e6, **extra}), flush=True)
dist.barrier()
# Before the interpreter finalizes: gloo's worker thread may still be dropping the last
# work's tensors, and taking the GIL during finalization aborts the process
# ("terminate called without an active exception"); this joins it first.
dist.destroy_process_group()
"""


def store():
    import torch.distributed as dist

    return dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)


def spawn(env_extra, world, port):
    procs = []
    for r in range(world):
        env = dict(os.environ, B_RANK=str(r), B_WORLD=str(world), B_PORT=str(port), **env_extra)
        procs.append(subprocess.Popen([sys.executable, "-c", WORKER], env=env,
                                      stdout=subprocess.PIPE, text=True))
    return procs


def run(backend, op, world, nbytes, iters):
    s = store()
    procs = spawn({"B_BACKEND": backend, "B_OP": op, "B_BYTES": str(nbytes),
                   "B_ITERS": str(iters)}, world, s.port)
    try:
        out = procs[0].communicate(timeout=600)[0]
        for p in procs[1:]:
            p.wait(timeout=60)
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
    lines = [json.loads(l) for l in out.splitlines() if l.startswith("{")]
    if not lines:
        raise RuntimeError(f"{backend} {op} {world} {nbytes}: no result")
    return lines[-1]["lat_p50_us"], lines[-1]["cpu_us"], lines[-1]


def recovery(timeout_ms):
    s = store()
    world, victim = 4, 2
    procs = spawn({"B_BACKEND": "mooncake-cpu", "B_OP": "recovery", "B_BYTES": "4096",
                   "B_ITERS": "0", "B_TIMEOUT": str(timeout_ms)}, world, s.port)
    try:
        for p in procs:  # every rank is streaming
            while p.stdout.readline().strip() != "tick":
                pass
        killed_at = time.time()
        procs[victim].send_signal(signal.SIGKILL)
        done = []
        for i, p in enumerate(procs):
            if i == victim:
                continue
            for line in p.stdout:
                if line.startswith("{"):
                    done.append(json.loads(line)["recovered_at"] - killed_at)
                    break
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
            p.wait()
    return max(done)


def ints(text):
    return [int(v) for v in text.split(",")]


def main():
    import argparse

    ap = argparse.ArgumentParser(description="Mooncake PG/EP against gloo, same run")
    ap.add_argument("--quick", action="store_true", help="4 KiB and 1 MiB, fewer EP rounds")
    ap.add_argument("--ranks", type=ints, default=[2, 4])
    ap.add_argument("--sizes", type=ints, default=None, help="bytes per rank")
    ap.add_argument("--parts", default="all_reduce,all_gather,ep,recovery,overlap")
    ap.add_argument("--ep-iters", type=int, default=None)
    args = ap.parse_args()
    quick, parts = args.quick, args.parts.split(",")
    sizes = args.sizes or ([4 << 10, 1 << 20] if quick else [4 << 10, 1 << 20, 64 << 20])
    for world in args.ranks:
        for op in [p for p in ("all_reduce", "all_gather") if p in parts]:
            for nbytes in sizes:
                iters = 200 if nbytes <= 4096 else (50 if nbytes <= (1 << 20) else 5)
                base, base_cpu, _ = run("gloo", op, world, nbytes, iters)
                ours, ours_cpu, _ = run("mooncake-cpu", op, world, nbytes, iters)
                moved = nbytes * (world if op == "all_gather" else 1)
                print(json.dumps({
                    "bench": "pg", "op": op, "ranks": world, "bytes": nbytes,
                    "backend": "mooncake-cpu", "lat_p50_us": round(ours, 1),
                    "gbps": round(moved * 8 / ours / 1e3, 3),
                    "baseline": "gloo", "baseline_lat_p50_us": round(base, 1),
                    "ratio_to_baseline": round(base / ours, 3),
                    "cpu_us_per_op": round(ours_cpu, 1),
                    "baseline_cpu_us_per_op": round(base_cpu, 1),
                }), flush=True)
    if "ep" in parts:
        ep(args.ep_iters or (20 if quick else 100))
    if "overlap" in parts:
        overlap(args.ranks)
    if "recovery" in parts:
        timeout_ms = 1000
        took = recovery(timeout_ms)
        print(json.dumps({"bench": "pg_recovery", "ranks": 4, "timeout_ms": timeout_ms,
                          "death_to_first_good_allreduce_ms": round(took * 1e3, 1),
                          "ratio_to_2x_timeout": round(took * 1e3 / (2 * timeout_ms), 3)}),
              flush=True)


def overlap(ranks):
    nbytes = 4 << 20
    for world in ranks:
        base, base_cpu, gloo = run("gloo", "overlap", world, nbytes, 30)
        ours, ours_cpu, mine = run("mooncake-cpu", "overlap", world, nbytes, 30)
        print(json.dumps({
            "bench": "pg_overlap", "op": "all_reduce async_op + compute + wait",
            "ranks": world, "bytes": nbytes, "backend": "mooncake-cpu",
            "lat_p50_us": round(ours, 1),
            "sequential_us": round(mine["sequential_us"], 1),
            "compute_alone_us": round(mine["compute_alone_us"], 1),
            "baseline": "gloo", "baseline_lat_p50_us": round(base, 1),
            "baseline_sequential_us": round(gloo["sequential_us"], 1),
            "ratio_to_baseline": round(base / ours, 3), "cpu_us_per_op": round(ours_cpu, 1),
            "baseline_cpu_us_per_op": round(base_cpu, 1)}), flush=True)


def ep(ep_iters):
    base, base_cpu, _ = run("gloo", "ep", 4, 0, ep_iters)
    ours, ours_cpu, _ = run("mooncake-cpu", "ep", 4, 0, ep_iters)
    tokens = 4 * 128  # per dispatch+combine, all ranks
    print(json.dumps({
        "bench": "ep_dispatch_combine", "ranks": 4, "tokens_per_rank": 128, "hidden": 1024,
        "topk": 4, "experts": 16, "backend": "mooncake-cpu", "lat_p50_us": round(ours, 1),
        "tokens_per_s": round(tokens / ours * 1e6), "baseline": "gloo all_to_all_single",
        "baseline_tokens_per_s": round(tokens / base * 1e6),
        "ratio_to_baseline": round(base / ours, 3), "cpu_us_per_op": round(ours_cpu, 1),
        "baseline_cpu_us_per_op": round(base_cpu, 1)}), flush=True)


if __name__ == "__main__":
    main()
