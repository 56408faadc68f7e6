#!/usr/bin/env bash
# Builds every fuzz target and runs each for SECONDS (default 60) with libFuzzer.
#
#   fuzz/run.sh [SECONDS] [TARGET...]
#
# SECONDS=0 only replays the seeds and the corpus kept so far (a regression check).
# New inputs collect in fuzz/corpus/<target> (kept between runs, not committed); the
# committed seeds in fuzz/seeds/<target> are read too. A crash leaves its input in
# fuzz/artifacts/<target>/ and the script goes on with the other targets, then fails;
# replay one with `cargo fuzz run <target> <file>` (with RUSTC_BOOTSTRAP=1, see below).
set -euo pipefail
cd "$(dirname "$0")"

seconds="${1:-60}"
shift || true
targets=("$@")

# cargo-fuzz itself, once (kept in ~/.cargo/bin).
command -v cargo-fuzz >/dev/null || cargo install cargo-fuzz --version 0.13.2 --locked
# cargo fuzz passes -Z flags (sanitizer, coverage). A nightly toolchain accepts them;
# the machine's stable one does when told it may (there may be no other toolchain).
export RUSTC_BOOTSTRAP=1

build_log="$(mktemp)"
trap 'rm -f "$build_log"' EXIT
build() { cargo fuzz build "$@" >"$build_log" 2>&1 || { tail -n 40 "$build_log" >&2; exit 1; }; }
if [ ${#targets[@]} -eq 0 ]; then
  mapfile -t targets < <(cargo fuzz list)
  build
else
  for t in "${targets[@]}"; do build "$t"; done
fi

if [ "$seconds" -gt 0 ]; then
  budget=(-max_total_time="$seconds")
else
  budget=(-runs=0)
fi

failed=()
for t in "${targets[@]}"; do
  mkdir -p "corpus/$t"
  seeds=()
  [ -d "seeds/$t" ] && seeds=("seeds/$t")
  log="$(mktemp)"
  # -timeout: one input taking this long is a hang; -rss_limit_mb: a blow-up is a crash.
  if cargo fuzz run "$t" "corpus/$t" "${seeds[@]}" -- \
      "${budget[@]}" -timeout=10 -rss_limit_mb=2048 -print_final_stats=1 \
      >"$log" 2>&1; then
    runs=$(grep -m1 '^stat::number_of_executed_units' "$log" | awk '{print $2}')
    cov=$(grep -E '^#[0-9]+.*(DONE|cov:)' "$log" | tail -n 1 | grep -o 'cov: [0-9]*' || true)
    echo "fuzz $t: ${runs:-?} inputs in ${seconds}s, ${cov:-cov: ?}, no crash"
  else
    echo "fuzz $t: FAILED" >&2
    grep -E -A 1 -m 5 'panicked' "$log" >&2 || tail -n 30 "$log" >&2
    grep -E -m 5 'SUMMARY|Test unit written' "$log" >&2 || true
    failed+=("$t")
  fi
  rm -f "$log"
done
total=${#targets[@]}
echo "fuzz: $((total - ${#failed[@]})) passed, ${#failed[@]} failed"
[ ${#failed[@]} -eq 0 ]
