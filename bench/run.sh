#!/usr/bin/env bash
# The transfer-engine figures: each configuration REPEAT times (default 3), one JSON
# line per run, every line carrying its same-run baseline. Usage:
#   bash bench/run.sh [REPEAT] [DURATION_S]
# Run it on an otherwise idle machine: loopback figures move with any other load.
set -euo pipefail
cd "$(dirname "$0")/.."
repeat=${1:-3}
duration=${2:-3}
cargo build --release --bin mooncake >&2
bin=target/release/mooncake

configs=(
  "--protocol tcp --block-size 1M --batch-size 1"
  "--protocol tcp --block-size 1M --batch-size 8"
  "--protocol tcp --block-size 16M --batch-size 1"
  "--protocol tcp --block-size 16M --batch-size 4"
  "--protocol tcp --op write --block-size 1M --batch-size 8"
  "--protocol tcp --block-size 4K --batch-size 1"
  "--protocol tcp --block-size 4K --batch-size 64"
  "--protocol shm --block-size 1M --batch-size 1"
  "--protocol shm --block-size 16M --batch-size 1"
  "--protocol shm --op write --block-size 1M --batch-size 1"
  "--protocol auto --block-size 4K --batch-size 1"
)
for config in "${configs[@]}"; do
  for _ in $(seq "$repeat"); do
    # shellcheck disable=SC2086
    "$bin" bench transfer $config --duration "$duration"
  done
done
