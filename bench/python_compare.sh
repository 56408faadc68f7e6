#!/usr/bin/env bash
# Python to Python: the same calls through our package and through Mooncake's wheel, one
# after the other (never both running), tcp on 127.0.0.1, plus the loopback TCP socket
# baseline from the same run (our Rust engine's `bench transfer`, which also shows what
# the Python layer costs); the store rows include the tensor API and dummy clients (a
# mooncake_client process serving setup_dummy). A run that fails prints nothing and drops
# out of the table. Prints the JSON lines, then a table of ratios to stderr.
#   OUR_PYTHON  a Python where `pip install ./python` put our package
#               (default: the test venv, ~/.cache/mooncake-test-venv/bin/python)
#   MC_PYTHON   a Python with Mooncake's wheel (pip install mooncake-transfer-engine-non-cuda)
# Usage: bash bench/python_compare.sh [DURATION_S]
set -euo pipefail
cd "$(dirname "$0")/.."
duration=${1:-3}
ours=${OUR_PYTHON:-${XDG_CACHE_HOME:-$HOME/.cache}/mooncake-test-venv/bin/python}
theirs=${MC_PYTHON:-/tmp/mcvenv/bin/python}
for py in "$ours" "$theirs"; do
  if ! "$py" -c "import mooncake.engine, mooncake.store" >/dev/null 2>&1; then
    echo "python_compare.sh: $py cannot import mooncake (set OUR_PYTHON / MC_PYTHON); nothing compared." >&2
    exit 0
  fi
done
bin=$("$ours" -c "import mooncake._native as n, os; print(os.path.join(os.path.dirname(n.__file__), 'bin', 'mooncake'))")
out=$(mktemp)
trap 'rm -f "$out"' EXIT

transfer=(
  "--op read --block-size 4K --batch-size 1"
  "--op write --block-size 1M --batch-size 32"
  "--op write --block-size 16M --batch-size 4"
)
store=(
  "--op put --size 4K --segment-size 1G"
  "--op get --size 4K --segment-size 1G"
  "--op get --size 4K --batch 64 --segment-size 1G"
  "--op get --size 16M --segment-size 2G"
  "--op put --size 4K --api tensor --segment-size 1G"
  "--op get --size 4K --api tensor --segment-size 1G"
  "--op get --size 4K --batch 64 --api tensor --segment-size 1G"
  "--op get --size 4M --api tensor --segment-size 2G"
  "--op put --size 4K --client dummy --segment-size 1G"
  "--op get --size 4K --client dummy --segment-size 1G"
  "--op get --size 4K --batch 64 --client dummy --segment-size 1G"
  "--op get --size 4M --client dummy --segment-size 2G"
)
label() { sed "s/^{/{\"package\":\"$1\",/"; }
for config in "${transfer[@]}"; do
  # shellcheck disable=SC2086
  {
    "$bin" bench transfer --protocol tcp $config --duration "$duration" | label rust-engine
    "$ours" bench/mooncake_bench.py run $config --duration "$duration" 2>/dev/null | label ours || true
    MC_TCP_BIND_ADDRESS=127.0.0.1 "$theirs" bench/mooncake_bench.py run $config --duration "$duration" 2>/dev/null | label mooncake || true
  } | tee -a "$out"
done
for config in "${store[@]}"; do
  # shellcheck disable=SC2086
  {
    "$ours" bench/mooncake_store_bench.py run $config --duration "$duration" 2>/dev/null | label ours || true
    MC_TCP_BIND_ADDRESS=127.0.0.1 "$theirs" bench/mooncake_store_bench.py run $config --duration "$duration" 2>/dev/null | label mooncake || true
  } | tee -a "$out"
done

python3 - "$out" >&2 <<'PY'
import json, sys
rows = [json.loads(l) for l in open(sys.argv[1]) if l.startswith("{")]
def key(r):
    return (r.get("bench", "").replace("mooncake_", ""), r.get("op"), r.get("block_size", r.get("size")),
            r.get("batch_size", r.get("batch", 1)), r.get("api", ""), r.get("client", ""))
groups = {}
for r in rows:
    groups.setdefault(key(r), {})[r["package"]] = r
print("%-46s %12s %12s %7s %10s %10s %8s" % ("figure", "ours", "mooncake", "ratio", "p50 ours", "p99 ours", "p99 mc"))
for k, g in groups.items():
    o, m = g.get("ours"), g.get("mooncake")
    if not o or not m:
        continue
    metric = "gbps" if (k[2] or 0) >= 1 << 20 else "ops_per_s"
    base = g.get("rust-engine", {}).get("baseline_gbps")
    extra = " (socket %.2f GB/s: %.2fx)" % (base, o[metric] / base) if base and metric == "gbps" else ""
    if metric == "gbps" and o.get("gbps_in_calls") and m.get("gbps_in_calls"):
        extra += " (in calls %.2f vs %.2f GB/s: %.2fx)" % (
            o["gbps_in_calls"], m["gbps_in_calls"], o["gbps_in_calls"] / m["gbps_in_calls"])
    print("%-46s %12s %12s %7.2f %10s %10s %8s%s" % (
        "%s %s %s x%s %s %s" % k, o[metric], m[metric], o[metric] / max(m[metric], 1e-9),
        o.get("lat_p50_us", o.get("p50_us")), o.get("lat_p99_us", o.get("p99_us")),
        m.get("lat_p99_us", m.get("p99_us")), extra))
PY
