#!/usr/bin/env bash
# Our engine next to the real Mooncake engine, same machine, same run, tcp on 127.0.0.1.
# For each configuration, back to back:
#   (a) ours:     our client -> our target (bench transfer, with its tcp baseline)
#   (b) mooncake: Mooncake client -> Mooncake target
#   (c) mc->ours: Mooncake client -> our `mooncake target`
# Usage: bash bench/compare.sh [DURATION_S]     (MC_PYTHON: a Python that imports mooncake)
# JSON lines go to stdout, a summary table to stderr. Run it on an otherwise idle machine.
set -euo pipefail
cd "$(dirname "$0")/.."
duration=${1:-3}
py=${MC_PYTHON:-/tmp/mcvenv/bin/python-mc}
if ! "$py" -c "import mooncake.engine" >/dev/null 2>&1; then
  echo "compare.sh: the Mooncake package is not importable via $py (set MC_PYTHON); nothing compared." >&2
  exit 0
fi
cargo build --release --bin mooncake >&2
bin=target/release/mooncake
out=$(mktemp)
log=$(mktemp)
trap 'rm -f "$out" "$log"' EXIT

mc() { # Mooncake's log noise goes to $log, shown only if a run fails
  "$py" bench/mooncake_bench.py run "$@" 2>"$log" || { cat "$log" >&2; return 1; }
}

configs=(
  "--op read --block-size 1M --batch-size 1"
  "--op read --block-size 1M --batch-size 8"
  "--op read --block-size 16M --batch-size 1"
  "--op read --block-size 4K --batch-size 1"
  "--op read --block-size 4K --batch-size 64"
  "--op write --block-size 1M --batch-size 8"
)
for config in "${configs[@]}"; do
  # shellcheck disable=SC2086
  {
    "$bin" bench transfer --protocol tcp $config --duration "$duration"
    mc $config --duration "$duration"
    mc $config --duration "$duration" --target ours --ours-bin "$bin"
  } | tee -a "$out"
done

python3 - "$out" >&2 <<'EOF'
import json, sys
rows = {}
for line in open(sys.argv[1]):
    r = json.loads(line)
    who = "ours" if r["bench"] == "transfer" else ("mc" if r["peer"] == "mooncake" else "mc_ours")
    rows.setdefault((r["op"], r["block_size"], r["batch_size"]), {})[who] = r
def size(n):
    for unit, s in (("G", 1 << 30), ("M", 1 << 20), ("K", 1 << 10)):
        if n % s == 0:
            return "%d%s" % (n // s, unit)
    return str(n)
print()
print("%-16s %24s %7s %26s %26s %8s" % ("config", "gbps ours/mc/mc->ours", "ours/mc",
      "p50_us ours/mc/mc->ours", "p99_us ours/mc/mc->ours", "tcp_base"))
for (op, block, batch), g in rows.items():
    o, m, x = (g.get(k, {}) for k in ("ours", "mc", "mc_ours"))
    trio = lambda f, fmt: "/".join(fmt % r[f] if f in r else "-" for r in (o, m, x))
    ratio = "%.2f" % (o["gbps"] / m["gbps"]) if o.get("gbps") and m.get("gbps") else "-"
    print("%-16s %24s %7s %26s %26s %8s" % (
        "%s %s x%d" % (op, size(block), batch), trio("gbps", "%.3f"), ratio,
        trio("lat_p50_us", "%.0f"), trio("lat_p99_us", "%.0f"), o.get("baseline_gbps", "-")))
EOF
