#!/usr/bin/env bash
# The whole test suite: unit, integration (multi-process, C and C++ against the
# header), formatting and lint checks, and a smoke test of the fully static binary.
set -euo pipefail
cd "$(dirname "$0")/.."

cargo fmt --all -- --check
cargo clippy --all-targets -- -D warnings
cargo test

# Static binary: builds without glibc's dynamic loader, moves bytes over TCP and shared
# memory, and reports the runtime-loaded backends as unavailable instead of crashing.
# Only the binary is linked with crt-static (a cdylib cannot be, and rustc warns when
# asked to); MC_STATIC_BINARY=1 tells the library code it is going into one.
target=x86_64-unknown-linux-gnu
CARGO_TARGET_DIR=target/static MC_STATIC_BINARY=1 \
  cargo rustc -p mooncake --release --target "$target" --bin mooncake -- -C target-feature=+crt-static
bin="target/static/$target/release/mooncake"
# Captured first: `grep -q` stops reading at its match, and info's later lines would
# then meet a closed pipe.
info=$("$bin" info)
grep -q "static binary" <<<"$info"
if grep -q "_LIB" <<<"$info"; then
  echo "static info suggests a library override it cannot use" >&2
  exit 1
fi
for protocol in tcp shm; do
  "$bin" bench transfer --protocol "$protocol" --block-size 256K --batch-size 4 --duration 0.3 \
    | grep -q '"verified":true'
done
echo "static binary smoke test: 2 passed, 0 failed"

# Python package: `pip install ./python` (a release build of the library and binary
# inside the package) into a venv kept between runs, then its pytest suite: real
# processes on loopback, the engines' call sequences, hostile input.
venv="${MC_PY_VENV:-${XDG_CACHE_HOME:-$HOME/.cache}/mooncake-test-venv}"
[ -x "$venv/bin/python" ] || python3 -m venv "$venv"
"$venv/bin/python" -c 'import pytest' 2>/dev/null || "$venv/bin/python" -m pip install -q pytest
"$venv/bin/python" -m pip install -q --no-deps --force-reinstall ./python
"$venv/bin/python" -m pytest python/tests -q -p no:cacheprovider

# Layout check: the hand-written verbs and libfabric structs against bindgen's reading of
# the system headers (needs libclang and the -dev headers, all installed by .ci/run).
have_libclang() {
  [ -n "${LIBCLANG_PATH:-}" ] && return 0
  compgen -G '/usr/lib/llvm-*/lib/libclang.so*' >/dev/null && return 0
  compgen -G '/usr/lib/*/libclang-[0-9]*.so*' >/dev/null
}
if [ -f /usr/include/infiniband/verbs.h ] && [ -f /usr/include/rdma/fabric.h ] && have_libclang; then
  # Its own target dir: bindgen's build-time dependencies stay out of the main build.
  CARGO_TARGET_DIR=target/layout cargo test --features layout-check --test layout
  echo "ffi layout check: passed"
else
  echo "ffi layout check: skipped (needs libclang-dev, libibverbs-dev and libfabric-dev)"
fi
