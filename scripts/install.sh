#!/bin/sh
# Builds the release library and installs it with its header and pkg-config file:
#   scripts/install.sh PREFIX
set -eu
[ $# -eq 1 ] || { echo "usage: $0 PREFIX" >&2; exit 2; }
mkdir -p "$1"
prefix=$(cd "$1" && pwd)
root=$(cd "$(dirname "$0")/.." && pwd)
target=${CARGO_TARGET_DIR:-$root/target}/release

(cd "$root" && cargo build --release --lib)

mkdir -p "$prefix/lib/pkgconfig" "$prefix/include"
cp "$target/libmooncake.a" "$prefix/lib/"
cp "$target/libmooncake.so" "$prefix/lib/"
ln -sf libmooncake.so "$prefix/lib/libmooncake.so.0"
cp "$root/c_include/mooncake.h" "$root/c_include/transfer_engine_c.h" "$prefix/include/"
sed "s|@PREFIX@|$prefix|g" "$root/c_include/mooncake.pc.in" > "$prefix/lib/pkgconfig/mooncake.pc"
echo "installed into $prefix"
