#!/bin/sh
# Builds the release library and installs it with its header and pkg-config file:
#   scripts/install.sh PREFIX
# Installs PREFIX/lib/libmooncake.so.0 (the library, whose SONAME that is), the link
# libmooncake.so -> libmooncake.so.0 that `-lmooncake` finds, libmooncake.a, the
# headers and PREFIX/lib/pkgconfig/mooncake.pc; then says what a program needs to find
# the library at run time.
set -eu
[ $# -eq 1 ] || { echo "usage: $0 PREFIX" >&2; exit 2; }
mkdir -p "$1"
prefix=$(cd "$1" && pwd)
root=$(cd "$(dirname "$0")/.." && pwd)
target=${CARGO_TARGET_DIR:-$root/target}/release

(cd "$root" && cargo build -p mooncake --release --lib)

lib="$prefix/lib"
mkdir -p "$lib/pkgconfig" "$prefix/include"
rm -f "$lib/libmooncake.so" "$lib/libmooncake.so.0"
cp "$target/libmooncake.so" "$lib/libmooncake.so.0"
ln -s libmooncake.so.0 "$lib/libmooncake.so"
cp "$target/libmooncake.a" "$lib/"
# Release builds keep line tables for backtraces (profile.release debug = 1); the
# installed copies do without.
if command -v strip >/dev/null 2>&1; then
  strip --strip-unneeded "$lib/libmooncake.so.0"
  strip --strip-debug "$lib/libmooncake.a"
else
  echo "note: no strip command; the installed libraries keep their debug info" >&2
fi
cp "$root/c_include/mooncake.h" "$root/c_include/transfer_engine_c.h" "$prefix/include/"
sed "s|@PREFIX@|$prefix|g" "$root/c_include/mooncake.pc.in" > "$lib/pkgconfig/mooncake.pc"

echo "installed into $prefix:"
echo "  $lib/libmooncake.so.0 (libmooncake.so -> it), $lib/libmooncake.a"
echo "  $prefix/include/mooncake.h, $prefix/include/transfer_engine_c.h"
echo "  $lib/pkgconfig/mooncake.pc"
echo
case "$lib" in
  /usr/lib | /usr/lib64 | /usr/local/lib | /usr/local/lib64)
    echo "next: run 'ldconfig' (as root) so that programs find libmooncake.so.0."
    ;;
  *)
    cat <<EOF
next: $lib is not searched by default.
  build:  export PKG_CONFIG_PATH=$lib/pkgconfig
          cc prog.c \$(pkg-config --cflags --libs mooncake) -Wl,-rpath,$lib
          (the rpath lets the program find libmooncake.so.0 without anything else), or
  run:    LD_LIBRARY_PATH=$lib ./prog, or, as root, once for every program:
          echo $lib > /etc/ld.so.conf.d/mooncake.conf && ldconfig
  static: link $lib/libmooncake.a and the system libraries that
          'pkg-config --static --libs mooncake' lists after -lmooncake.
EOF
    ;;
esac
