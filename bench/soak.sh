#!/usr/bin/env bash
# Soak: a master, two store nodes and a replay client on loopback for MINUTES (default
# 30). The replay walks the shipped conversation trace, paced to last the whole run;
# one node is killed (SIGKILL) and started again every minute; a garbage client
# connects every second to one of the ports (master RPC, metadata and metrics HTTP,
# each node's data and handshake ports) and sends random bytes. At the end, one JSON
# line per process: RSS, open fds and threads after warm-up and at the end, and whether
# they stayed flat; then a summary line. Exits 1 when a process died or grew.
#
#   bash bench/soak.sh [--minutes 30] [--segment-size 256M]
#
# Not part of the test suite. MC_SOAK_BIN=PATH uses that binary instead of building.
set -euo pipefail
cd "$(dirname "$0")/.."

minutes=30
segment=256M
while [ $# -gt 0 ]; do
  case "$1" in
    --minutes) minutes="$2"; shift 2 ;;
    --segment-size) segment="$2"; shift 2 ;;
    *) echo "usage: bash bench/soak.sh [--minutes N] [--segment-size BYTES]" >&2; exit 2 ;;
  esac
done
if [ -n "${MC_SOAK_BIN:-}" ]; then
  bin="$MC_SOAK_BIN"
else
  cargo build --release --bin mooncake >&2
  bin=target/release/mooncake
fi
duration=$(awk -v m="$minutes" 'BEGIN { printf "%d", m * 60 }')
[ "$duration" -ge 30 ] || { echo "soak: --minutes must be at least 0.5" >&2; exit 2; }
# Figures are taken as "start" once caches, pools and connection pools have filled.
warmup=$(( duration / 10 < 15 ? 15 : (duration / 10 > 120 ? 120 : duration / 10) ))

work=$(mktemp -d)
started=()
keep_logs=false
cleanup() {
  for pid in "${started[@]}"; do kill "$pid" 2>/dev/null || true; done
  wait 2>/dev/null || true
  if $keep_logs; then echo "soak: logs kept in $work" >&2; else rm -rf "$work"; fi
}
trap cleanup EXIT

# Waits (bounded) for a child's "ready" line; prints it.
ready_line() {
  local out="$1" pid="$2"
  for _ in $(seq 300); do
    if grep -q '^ready' "$out" 2>/dev/null; then
      grep -m1 '^ready' "$out"
      return 0
    fi
    kill -0 "$pid" 2>/dev/null || break
    sleep 0.1
  done
  echo "soak: a child did not start: $(cat "$out" "$out.err" 2>/dev/null | tail -n 5)" >&2
  return 1
}

"$bin" master --rpc-port 0 --metadata-port 0 --metrics-port 0 >"$work/master" 2>"$work/master.err" &
master_pid=$!
started+=("$master_pid")
line=$(ready_line "$work/master" "$master_pid")
rpc=$(sed -n 's/.*rpc=\([^ ]*\).*/\1/p' <<<"$line")
metadata=$(sed -n 's/.*metadata=\([^ ]*\).*/\1/p' <<<"$line")
metrics=$(sed -n 's/.*metrics=\([^ ]*\).*/\1/p' <<<"$line")
port_of() { sed -n 's#.*:\([0-9][0-9]*\).*#\1#p' <<<"$1"; }

# node-a stays up the whole run; node-b is the one killed every minute. Their segments
# are committed on first use (no prefault), so RSS growth means what it should: a leak.
declare -A node_pid
start_node() {
  "$bin" node --master "$rpc" --segment-size "$segment" --prefault-segment false \
    >"$work/$1" 2>"$work/$1.err" &
  node_pid[$1]=$!
  started+=("${node_pid[$1]}")
  ready_line "$work/$1" "${node_pid[$1]}" >/dev/null
}
start_node node-a
start_node node-b

# Paced so that the trace (about 59 minutes of arrivals, timestamps in ms) lasts a
# minute longer than the run: the replay client is still working when it is measured.
span_ms=$(tail -n 1 traces/conversation_trace.jsonl | sed -n 's/.*"timestamp": *\([0-9]*\).*/\1/p')
scale=$(awk -v d="$duration" -v s="$span_ms" 'BEGIN { printf "%.6f", (d + 60) * 1000 / s }')
"$bin" replay --master "$rpc" --time-scale "$scale" --json >"$work/replay" 2>"$work/replay.err" &
replay_pid=$!
started+=("$replay_pid")

# "rss_kb fds threads" of a live process.
figures() {
  local pid="$1"
  [ -d "/proc/$pid" ] || { echo "- - -"; return; }
  local rss threads fds
  rss=$(awk '/^VmRSS:/ { print $2 }' "/proc/$pid/status" 2>/dev/null || echo -)
  threads=$(awk '/^Threads:/ { print $2 }' "/proc/$pid/status" 2>/dev/null || echo -)
  fds=$(find "/proc/$pid/fd" -mindepth 1 -maxdepth 1 2>/dev/null | wc -l)
  echo "${rss:--} $fds ${threads:--}"
}
listening_ports() { ss -ltnpH 2>/dev/null | grep "pid=$1," | awk '{ n = split($4, a, ":"); print a[n] }'; }

garbage() {
  local port="$1" n=$(( RANDOM % 4096 + 1 ))
  if (( RANDOM % 4 == 0 )); then
    # Half-plausible: a start line, then noise.
    timeout 2 bash -c "{ printf 'POST /metadata?key=x HTTP/1.1\r\nContent-Length: 99999\r\n\r\n'; head -c $n /dev/urandom; } >/dev/tcp/127.0.0.1/$port" 2>/dev/null || true
  else
    timeout 2 bash -c "head -c $n /dev/urandom >/dev/tcp/127.0.0.1/$port" 2>/dev/null || true
  fi
}

declare -A start_fig
start=$SECONDS
restarts=0
sent=0
next_kill=60
while (( SECONDS - start < duration )); do
  elapsed=$(( SECONDS - start ))
  if (( elapsed >= next_kill )); then
    kill -9 "${node_pid[node-b]}" 2>/dev/null || true
    wait "${node_pid[node-b]}" 2>/dev/null || true
    start_node node-b
    restarts=$(( restarts + 1 ))
    next_kill=$(( next_kill + 60 ))
  fi
  if (( elapsed >= warmup )) && [ -z "${start_fig[master]:-}" ]; then
    start_fig[master]=$(figures "$master_pid")
    start_fig[node-a]=$(figures "${node_pid[node-a]}")
    start_fig[replay]=$(figures "$replay_pid")
  fi
  ports=("$(port_of "$rpc")" "$(port_of "$metadata")" "$(port_of "$metrics")")
  for n in node-a node-b; do
    mapfile -t -O "${#ports[@]}" ports < <(listening_ports "${node_pid[$n]}")
  done
  garbage "${ports[RANDOM % ${#ports[@]}]}"
  sent=$(( sent + 1 ))
  sleep 1
done

all_flat=true
report() {
  local name="$1" pid="$2" first="$3"
  local now alive=true flat=true
  now=$(figures "$pid")
  kill -0 "$pid" 2>/dev/null || { alive=false; flat=false; }
  read -r r0 f0 t0 <<<"$first"
  read -r r1 f1 t1 <<<"$now"
  if $alive; then
    # Flat: RSS within 10% + 16 MiB of its warmed-up size, fds and threads within a
    # few of theirs (garbage connections still being timed out at the last sample).
    (( r1 <= r0 + r0 / 10 + 16384 && f1 <= f0 + 8 && t1 <= t0 + 8 )) || flat=false
  fi
  $flat || all_flat=false
  printf '{"soak":"process","name":"%s","pid":%s,"alive":%s,"rss_kb_start":%s,"rss_kb_end":%s,"fds_start":%s,"fds_end":%s,"threads_start":%s,"threads_end":%s,"flat":%s}\n' \
    "$name" "$pid" "$alive" "$r0" "${r1/-/null}" "$f0" "${f1/-/null}" "$t0" "${t1/-/null}" "$flat"
}
report master "$master_pid" "${start_fig[master]}"
report node-a "${node_pid[node-a]}" "${start_fig[node-a]}"
report replay "$replay_pid" "${start_fig[replay]}"
# node-b's current incarnation is at most a minute old: shown, not judged.
read -r rb fb tb <<<"$(figures "${node_pid[node-b]}")"
printf '{"soak":"process","name":"node-b","pid":%s,"restarts":%s,"rss_kb_end":%s,"fds_end":%s,"threads_end":%s}\n' \
  "${node_pid[node-b]}" "$restarts" "${rb/-/null}" "${fb/-/null}" "${tb/-/null}"
if kill -0 "$replay_pid" 2>/dev/null; then
  replay_exit=null
else
  replay_exit=0
  wait "$replay_pid" || replay_exit=$?
fi
$all_flat || keep_logs=true
printf '{"soak":"summary","minutes":%s,"node_restarts":%s,"garbage_connections":%s,"replay_exit":%s,"flat":%s}\n' \
  "$minutes" "$restarts" "$sent" "$replay_exit" "$all_flat"
$all_flat
