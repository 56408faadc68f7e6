#!/usr/bin/env bash
# Our engine's same-host figures next to UCX's (Debian's ucx-utils `ucx_perftest`), same run.
#
#   4 KiB:  ours = `bench transfer --protocol auto --api sync --op read --block-size 4K`, p50 of
#           one synchronous 4 KiB read from a peer's segment (a copy, the caller polls);
#           UCX  = `ucx_perftest -t ucp_put_lat -s 4096`, UCX_TLS=sm: a ping-pong of 4 KiB puts
#           between two processes. ucx_perftest prints HALF the ping-pong time for latency tests
#           (it divides by 2), so its printed p50 is doubled here: the figure compared is UCX's
#           round trip (two 4 KiB puts, one each way) against our one read.
#   16 MiB: ours = `bench transfer --protocol shm --op write --block-size 16M` GB/s;
#           UCX  = `ucx_perftest -t ucp_put_bw -s 16777216` with UCX_TLS=posix and with
#           UCX_TLS=sm (posix, sysv and cma: UCX picks; cma alone cannot wire up), the better
#           of the two (it prints MiB/s; converted to GB/s here).
#
# Usage: bash bench/ucx_compare.sh [DURATION_S] [ROUNDS]    (MOONCAKE_BIN: our binary)
# One JSON line per figure and round: ours, theirs, ratio. Skips with a message when
# ucx_perftest is absent. Run it on an otherwise idle machine.
set -euo pipefail
cd "$(dirname "$0")/.."
duration=${1:-2}
rounds=${2:-1}
if ! command -v ucx_perftest >/dev/null 2>&1; then
  echo "ucx_compare.sh: ucx_perftest not found (Debian: apt-get install ucx-utils); nothing compared." >&2
  exit 0
fi
bin=${MOONCAKE_BIN:-${CARGO_TARGET_DIR:-target}/release/mooncake}
if [ ! -x "$bin" ]; then
  cargo build --release --bin mooncake >&2
fi

free_port() {
  python3 -c 'import socket; s=socket.socket(); s.bind(("127.0.0.1", 0)); print(s.getsockname()[1])'
}

# ucx_perftest TLS TEST SIZE ITERS: prints the final line's fields (iterations, p50 us,
# average us, overall us, MiB/s average, MiB/s overall, msg/s average, msg/s overall).
ucx() {
  local tls=$1 test=$2 size=$3 iters=$4 port server rc=0
  port=$(free_port)
  UCX_TLS=$tls timeout 120 ucx_perftest -p "$port" >/dev/null 2>&1 &
  server=$!
  local out=""
  for _ in $(seq 50); do # the server listens within a moment; retry until it does
    if out=$(UCX_TLS=$tls timeout 120 ucx_perftest 127.0.0.1 -p "$port" -t "$test" -s "$size" \
      -n "$iters" -w $((iters / 10 + 1)) -f 2>/dev/null); then
      break
    fi
    out=""
    sleep 0.1
  done
  wait "$server" 2>/dev/null || rc=$?
  [ -n "$out" ] || { echo "ucx_compare.sh: ucx_perftest $test ($tls) failed (server rc $rc)" >&2; return 1; }
  echo "$out" | awk 'NF == 8 && $1 ~ /^[0-9]+$/ { line = $0 } END { print line }'
}

field() { # field NAME JSON
  python3 -c 'import json, sys; print(json.loads(sys.argv[2])[sys.argv[1]])' "$1" "$2"
}

for round in $(seq "$rounds"); do
  ours=$("$bin" bench transfer --protocol auto --api sync --op read --block-size 4K \
    --duration "$duration" 2>/dev/null | tail -1)
  ours_p50=$(field lat_p50_us "$ours")
  read -r _ half_p50 _ <<<"$(ucx sm ucp_put_lat 4096 200000)"
  python3 - "$round" "$ours_p50" "$half_p50" <<'EOF'
import json, sys
r, ours, half = int(sys.argv[1]), float(sys.argv[2]), float(sys.argv[3])
rt = 2 * half
print(json.dumps({"figure": "same_host_4k_p50_us", "round": r,
                  "ours": ours, "ours_what": "sync read of 4 KiB, protocol auto",
                  "ucx_round_trip": round(rt, 3), "ucx_printed_half_round_trip": half,
                  "ucx_what": "ucp_put_lat -s 4096, UCX_TLS=sm, p50 x 2",
                  "ratio": round(ours / rt, 2), "goal": "<= 2"}))
EOF

  ours=$("$bin" bench transfer --protocol shm --op write --block-size 16M \
    --duration "$duration" 2>/dev/null | tail -1)
  ours_gbps=$(field gbps "$ours")
  read -r _ _ _ _ _ posix_mib _ <<<"$(ucx posix ucp_put_bw 16777216 300)"
  read -r _ _ _ _ _ sm_mib _ <<<"$(ucx sm ucp_put_bw 16777216 300)"
  python3 - "$round" "$ours_gbps" "$posix_mib" "$sm_mib" <<'EOF'
import json, sys
r, ours = int(sys.argv[1]), float(sys.argv[2])
posix, sm = (float(x) * (1 << 20) / 1e9 for x in sys.argv[3:5])
best = max(posix, sm)
print(json.dumps({"figure": "same_host_16m_write_gbps", "round": r,
                  "ours": ours, "ours_what": "write, 16 MiB blocks, protocol shm",
                  "ucx_posix": round(posix, 2), "ucx_sm": round(sm, 2),
                  "ucx_what": "ucp_put_bw -s 16777216, overall, best of posix and sm",
                  "ratio": round(ours / best, 2), "goal": ">= 0.9"}))
EOF
done
