#!/usr/bin/env python3
"""`mooncake simulate` against the kvcache-simulator package on the same trace and the
same capacities, back to back in one run. Prints one JSON object per line (wall seconds,
best of REPEAT, and the last-half hit rates, which must agree), then a summary on stderr.

Run it with a Python where `pip install kvcache-simulator` put the package (the test
venv that .ci/run fills has it):

    ~/.cache/mooncake-test-venv/bin/python bench/simulate_compare.py [--repeat 5]
        [--trace traces/conversation_trace.jsonl] [--bin target/release/mooncake]

Lines:
  package-cli   `kvcache-simulator run` (its default C++ backend; its compile is
                cached, and a warm-up run is not timed): trace parse in Python, model
                sizing, the C++ sweep
  package-core  the package's C++ sweep alone (`run_cpp_sweep`, trace already parsed):
                writing its binary arrays, the compiled core's trie build and runs
  ours          `mooncake simulate --json` (parse, sizing, runs on all cores)
  ours-1thread  the same on one thread
  ours+store    the same block counts plus the real master (`store`, 64 KiB objects as in
                the demo), for scale

Capacities: llama-3.1-8b in BF16 is 64 MiB per 512-token block, so budgets of 512 GiB,
1 TiB and 3 TiB are 8,192, 16,384 and 49,152 blocks for both tools.
"""

import argparse
import json
import os
import subprocess
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
MODEL = "llama-3.1-8b"
BUDGETS_GIB = [512, 1024, 3072]
CAPACITIES = [8192, 16384, 49152]
POLICIES = ["fifo", "lru", "optimal"]


def best(fn, repeat):
    times = []
    out = None
    for _ in range(repeat):
        t = time.perf_counter()
        out = fn()
        times.append(time.perf_counter() - t)
    return min(times), sorted(times)[len(times) // 2], out


def package_cli(trace):
    cmd = [os.path.join(os.path.dirname(sys.executable), "kvcache-simulator"), "run",
           "--trace", trace, "--model", MODEL, "--kv-precision", "bf16_fp16",
           "--block-size", "512", "--budgets-gib", ",".join(map(str, BUDGETS_GIB)),
           "--policies", ",".join(POLICIES), "--format", "json", "--no-progress"]
    r = json.loads(subprocess.run(cmd, check=True, capture_output=True, text=True).stdout)
    return {f"{p}@{pt['cacheBlocks']}": pt["results"][p]["hitRate"]
            for pt in r["points"] for p in POLICIES}


def package_core(trace_data):
    from kvcache_sim.cpp_backend import run_cpp_sweep
    from kvcache_sim.simulator import warmup_requests_for_trace

    r = run_cpp_sweep(trace_data, capacities=CAPACITIES, policies=POLICIES,
                      warmup_requests=warmup_requests_for_trace(trace_data, 0.5))
    return {f"{p}@{c}": v.hitRate for (p, c), v in r.results.items()}


def ours(binary, trace, policies, extra=()):
    cmd = [binary, "simulate", "--trace", trace, "--model", MODEL, "--precision", "bf16",
           "--capacities", "512GiB,1TiB,3TiB", "--policies", ",".join(policies), "--json",
           *extra]
    if "store" in policies:
        # The same block counts, as the demo's 64 KiB objects: the master's cost grows
        # with the pieces a 64 MiB block is striped into, not with what is measured.
        cmd = [binary, "simulate", "--trace", trace, "--capacities",
               ",".join(map(str, CAPACITIES)), "--policies", ",".join(policies), "--json",
               *extra]
    out = subprocess.run(cmd, check=True, capture_output=True, text=True).stdout
    rows = [json.loads(line) for line in out.splitlines()]
    return {f"{r['policy']}@{r['capacity_blocks']}": r["hit_rate_last_half"] for r in rows}


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--trace", default=os.path.join(ROOT, "traces", "conversation_trace.jsonl"))
    ap.add_argument("--bin", default=os.path.join(ROOT, "target", "release", "mooncake"))
    ap.add_argument("--repeat", type=int, default=5)
    args = ap.parse_args()
    try:
        from kvcache_sim.trace import parse_trace_file
    except ImportError:
        print("simulate_compare.py: this Python cannot import kvcache_sim "
              "(pip install kvcache-simulator); nothing compared.", file=sys.stderr)
        return 0
    if not os.access(args.bin, os.X_OK):
        subprocess.run(["cargo", "build", "--release", "--bin", "mooncake"], cwd=ROOT, check=True)

    package_cli(args.trace)  # compiles and caches the package's C++ core
    parsed = parse_trace_file(args.trace, block_size=512)
    runs = [
        ("package-cli", lambda: package_cli(args.trace)),
        ("package-core", lambda: package_core(parsed)),
        ("ours", lambda: ours(args.bin, args.trace, POLICIES)),
        ("ours-1thread", lambda: ours(args.bin, args.trace, POLICIES, ["--threads", "1"])),
        ("ours+store", lambda: ours(args.bin, args.trace, POLICIES + ["store"])),
    ]
    results = {}
    for name, fn in runs:
        low, median, rates = best(fn, args.repeat)
        results[name] = (low, rates)
        print(json.dumps({"bench": "simulate", "impl": name, "trace": os.path.basename(args.trace),
                          "capacities": CAPACITIES, "policies": POLICIES, "runs": args.repeat,
                          "seconds_best": round(low, 4), "seconds_median": round(median, 4),
                          "hit_rate_last_half": {k: round(v, 6) for k, v in sorted(rates.items())}}),
              flush=True)
    theirs = results["package-cli"][1]
    worst = max(abs(results["ours"][1][k] - v) for k, v in theirs.items())
    print(f"largest hit-rate difference ours vs package: {worst:.2e}", file=sys.stderr)
    for base in ("package-cli", "package-core"):
        for name in ("ours", "ours-1thread"):
            print(f"{name} vs {base}: {results[base][0] / results[name][0]:.1f}x faster "
                  f"({results[name][0]:.3f} s vs {results[base][0]:.3f} s)", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
