#!/usr/bin/env bash
# Master restart: a master and a node (processes, loopback), the node's segment filled
# by a replay of the shipped trace; the master is killed with SIGKILL and started again
# on the same ports. Prints one JSON line: what the node re-announced (object pieces,
# bytes), how long its remount took (catalog check + the master's rebuild), the rate
# in bytes of objects per second, and the time from the restart until the node had
# remounted (its ping interval, 1 s, dominates). Baseline in the same run: the replay's
# own write rate (bytes of objects written per second): what writing them again costs.
#
#   bash bench/restart.sh [--segment-size 2G] [--requests 4000]
#
# Not part of the test suite. MC_BENCH_BIN=PATH uses that binary instead of building.
set -euo pipefail
cd "$(dirname "$0")/.."

segment=2G
requests=4000
while [ $# -gt 0 ]; do
  case "$1" in
    --segment-size) segment="$2"; shift 2 ;;
    --requests) requests="$2"; shift 2 ;;
    *) echo "usage: bash bench/restart.sh [--segment-size BYTES] [--requests N]" >&2; exit 2 ;;
  esac
done
if [ -n "${MC_BENCH_BIN:-}" ]; then
  bin="$MC_BENCH_BIN"
else
  cargo build --release --bin mooncake >&2
  bin=target/release/mooncake
fi

work=$(mktemp -d)
pids=()
cleanup() {
  for pid in "${pids[@]}"; do kill -9 "$pid" 2>/dev/null || true; done
  rm -rf "$work"
}
trap cleanup EXIT

free_port() { python3 -c 'import socket; s = socket.socket(); s.bind(("127.0.0.1", 0)); print(s.getsockname()[1])'; }
rpc=$(free_port)
meta=$(free_port)
master_addr="127.0.0.1:$rpc"
metadata="http://127.0.0.1:$meta/metadata"

start_master() {
  "$bin" master --rpc-port "$rpc" --metadata-port "$meta" --metrics-port off >"$work/master.log" 2>&1 &
  master_pid=$!
  pids+=("$master_pid")
  for _ in $(seq 1 200); do
    grep -q '^ready' "$work/master.log" && return 0
    sleep 0.05
  done
  echo "restart: the master did not start" >&2
  exit 1
}

start_master
RUST_LOG=mooncake::store::client=info "$bin" node --master "$master_addr" --metadata "$metadata" \
  --segment-size "$segment" --protocol tcp >"$work/node.out" 2>"$work/node.log" &
pids+=($!)
for _ in $(seq 1 200); do grep -q '^ready' "$work/node.out" && break; sleep 0.05; done

"$bin" replay --master "$master_addr" --metadata "$metadata" --requests "$requests" --json \
  >"$work/replay.json"

mounts=$(grep -c 'announced in' "$work/node.log" || true)
kill -9 "$master_pid"
wait "$master_pid" 2>/dev/null || true
restarted=$(python3 -c 'import time; print(time.time())')
start_master
# The node remounts at its next ping and logs what it announced.
for _ in $(seq 1 600); do
  [ "$(grep -c 'announced in' "$work/node.log" || true)" -gt "$mounts" ] && break
  sleep 0.05
done
line=$(grep 'announced in' "$work/node.log" | tail -1)
[ "$(grep -c 'announced in' "$work/node.log" || true)" -gt "$mounts" ] || { echo "restart: the node did not remount" >&2; cat "$work/node.log" >&2; exit 1; }
back=$(python3 -c 'import sys, time; print(time.time() - float(sys.argv[1]))' "$restarted")

python3 - "$line" "$work/replay.json" "$back" "$segment" "$requests" <<'EOF'
import json, re, sys
line, replay, back, segment, requests = sys.argv[1:]
replay = json.load(open(replay))
m = re.search(r"(\d+) object pieces \((\d+) bytes\).* announced in ([0-9.]+) s", line)
pieces, nbytes, seconds = int(m.group(1)), int(m.group(2)), float(m.group(3))
rate = nbytes / seconds if seconds > 0 else 0.0
baseline = replay["bytes_written"] / replay["seconds"]
print(json.dumps({
    "figure": "master restart: catalog re-announced",
    "segment_size": segment, "requests": int(requests),
    "pieces": pieces, "bytes": nbytes, "remount_seconds": seconds,
    "announced_bytes_per_s": rate,
    "restart_to_remounted_seconds": float(back),
    "baseline_replay_write_bytes_per_s": baseline,
    "ratio": rate / baseline if baseline else None,
}))
EOF
