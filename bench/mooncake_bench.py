#!/usr/bin/env python3
"""Measure the REAL Mooncake Transfer Engine (PyPI mooncake-transfer-engine-non-cuda)
on this machine, so its figures sit next to ours from the same run.

Everything is on 127.0.0.1, metadata P2PHANDSHAKE, protocol tcp.

  target SIZE
      A Mooncake target: registers SIZE bytes, prints `ready NAME ADDR`, waits for stdin EOF.
  client --segment NAME [--addr ADDR] --op read|write --block-size B --batch-size N
         --duration S [--threads T] [--peer mooncake|ours]
      A Mooncake client: each call moves N blocks of B bytes (batch_transfer_sync_* for
      N > 1, transfer_sync_* for N = 1), timed per call, for S seconds. Without --addr
      the remote buffer is the segment's first one. Prints ONE JSON line.
  run [--target mooncake|ours] [--ours-bin PATH] <client options without --segment/--addr>
      Starts the target as a child (Mooncake's, or our `mooncake target`), runs the
      client in-process, then ends and reaps the child.

Sizes take binary K/M/G suffixes, as ours do. Run through a Python that can import
`mooncake`: Mooncake's package, or ours (the same calls measure either;
bench/python_compare.sh runs both).
"""

import argparse
import ctypes
import json
import math
import os
import subprocess
import sys
import threading
import time

os.environ.setdefault("MC_LOG_LEVEL", "ERROR")  # Mooncake's INFO/WARNING logs drown the output


def size(text):
    units = {"K": 1 << 10, "M": 1 << 20, "G": 1 << 30}
    text = text.strip().upper().removesuffix("IB").removesuffix("B")
    if text and text[-1] in units:
        return int(text[:-1]) * units[text[-1]]
    return int(text, 0)


def start_engine():
    from mooncake.engine import TransferEngine

    engine = TransferEngine()
    if engine.initialize("127.0.0.1", "P2PHANDSHAKE", "tcp", "") != 0:
        raise RuntimeError("TransferEngine.initialize failed")
    return engine, "127.0.0.1:%d" % engine.get_rpc_port()


def register(engine, nbytes):
    buf = ctypes.create_string_buffer(nbytes)
    addr = ctypes.addressof(buf)
    if engine.register_memory(addr, nbytes, "cpu:0") != 0:
        raise RuntimeError("register_memory(%d bytes) failed" % nbytes)
    return buf, addr


def target(nbytes):
    engine, name = start_engine()
    buf, addr = register(engine, nbytes)
    print("ready %s %d" % (name, addr), flush=True)
    sys.stdin.read()  # serve until EOF
    del buf
    return 0


def percentile(sorted_values, p):  # nearest rank, as mooncake::util::percentile
    n = len(sorted_values)
    if n == 0:
        return 0.0
    return sorted_values[min(max(math.ceil(p * n - 1e-9), 1), n) - 1]


def client(a, segment, remote_base):
    engine, _ = start_engine()
    if not remote_base:
        remote_base = engine.get_first_buffer_address(segment)
    span = a.block_size * a.batch_size
    buf, local_base = register(engine, span * a.threads * 2)  # [work | check] per thread
    batched = a.batch_size > 1
    api = "batch_transfer_sync_%s" if batched else "transfer_sync_%s"

    def call(op, local, remote):
        if batched:
            offs = [i * a.block_size for i in range(a.batch_size)]
            fn = getattr(engine, "batch_transfer_sync_" + op)
            return fn(segment, [local + o for o in offs], [remote + o for o in offs],
                      [a.block_size] * a.batch_size)
        return getattr(engine, "transfer_sync_" + op)(segment, local, remote, span)

    stop = threading.Event()
    results = [None] * a.threads

    def worker(t):
        local, check = local_base + 2 * t * span, local_base + (2 * t + 1) * span
        remote = remote_base + t * span
        pattern = bytes((i * 13 + t + 1) % 256 for i in range(256)) * (span // 256 + 1)
        ctypes.memmove(local, pattern, span)
        if call("write", local, remote) != 0:  # seed the remote region
            raise RuntimeError("seeding write failed")
        if a.op == "read":
            ctypes.memset(local, 0, span)
        lat, moved = [], 0
        while not stop.is_set():
            t0 = time.perf_counter()
            rc = call(a.op, local, remote)
            lat.append((time.perf_counter() - t0) * 1e6)
            if rc != 0:
                raise RuntimeError("%s returned %d" % (api % a.op, rc))
            moved += span
        ok = call("read", check, remote) == 0 and ctypes.string_at(check, span) == pattern[:span]
        if a.op == "read":
            ok = ok and ctypes.string_at(local, span) == pattern[:span]
        results[t] = (moved, lat, ok)

    def guarded(t):
        try:
            worker(t)
        except Exception as e:  # reported by the main thread
            results[t] = e

    threads = [threading.Thread(target=guarded, args=(t,)) for t in range(a.threads)]
    start = time.perf_counter()
    for th in threads:
        th.start()
    time.sleep(a.duration)
    stop.set()
    for th in threads:
        th.join()
    seconds = time.perf_counter() - start
    for r in results:
        if isinstance(r, Exception):
            raise r
    moved = sum(r[0] for r in results)
    lat = sorted(x for r in results for x in r[1])
    verified = all(r[2] for r in results)
    r3 = lambda x: round(x, 3)
    print(json.dumps({
        "bench": "mooncake_transfer", "protocol": "tcp", "op": a.op,
        "block_size": a.block_size, "batch_size": a.batch_size, "threads": a.threads,
        "bytes": moved, "seconds": r3(seconds), "gbps": r3(moved / seconds / 1e9),
        "ops_per_s": round(moved / a.block_size / seconds),
        "lat_p50_us": r3(percentile(lat, 0.5)), "lat_p99_us": r3(percentile(lat, 0.99)),
        "calls": len(lat), "peer": a.peer, "api": api % a.op, "verified": verified,
    }), flush=True)
    del buf
    return 0 if verified else 1


def run(a):
    need = a.block_size * a.batch_size * a.threads
    if a.target == "ours":
        cmd = [a.ours_bin, "target", "--metadata", "P2PHANDSHAKE", "--bind", "127.0.0.1",
               "--size", str(need), "--until-stdin-eof"]
    else:
        cmd = [sys.executable, os.path.abspath(__file__), "target", str(need)]
    child = subprocess.Popen(cmd, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    try:
        words = child.stdout.readline().split()
        if len(words) < 2 or words[0] != "ready":
            raise RuntimeError("target did not report ready: %r" % " ".join(words))
        # Upstream's target: `ready NAME ADDR`; ours: `ready NAME addr=0x... size=N`.
        addr = int(words[2].split("=")[-1], 0) if len(words) > 2 else 0
        a.peer = a.target
        return client(a, words[1], addr)
    finally:
        child.stdin.close()
        try:
            child.wait(timeout=5)
        except subprocess.TimeoutExpired:
            child.kill()
            child.wait()


def main(argv):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    sub = p.add_subparsers(dest="mode", required=True)
    sub.add_parser("target").add_argument("size", type=size)
    for mode in ("client", "run"):
        m = sub.add_parser(mode)
        m.add_argument("--op", choices=("read", "write"), default="read")
        m.add_argument("--block-size", type=size, default=1 << 20)
        m.add_argument("--batch-size", type=int, default=1)
        m.add_argument("--threads", type=int, default=1)
        m.add_argument("--duration", type=float, default=3.0)
        if mode == "client":
            m.add_argument("--segment", required=True)
            m.add_argument("--addr", type=lambda s: int(s, 0), default=0)
            m.add_argument("--peer", choices=("mooncake", "ours"), default="mooncake")
        else:
            m.add_argument("--target", choices=("mooncake", "ours"), default="mooncake")
            m.add_argument("--ours-bin", default="target/release/mooncake")
    a = p.parse_args(argv)
    if a.mode == "target":
        return target(a.size)
    if min(a.block_size, a.batch_size, a.threads) <= 0 or a.duration <= 0:
        p.error("sizes, counts and duration must be positive")
    return client(a, a.segment, a.addr) if a.mode == "client" else run(a)


if __name__ == "__main__":
    try:
        code = main(sys.argv[1:])
    except Exception as e:
        print("mooncake_bench: error %s: %s" % (type(e).__name__, e), file=sys.stderr)
        code = 1
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)  # Mooncake's engine teardown must never keep us alive
