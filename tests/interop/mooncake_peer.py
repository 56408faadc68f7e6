#!/usr/bin/env python3
"""A real Mooncake Transfer Engine peer for tests/interop.rs.

Needs the `mooncake` Python package (PyPI `mooncake-transfer-engine-non-cuda`
0.3.x). Everything stays on 127.0.0.1: metadata P2PHANDSHAKE, protocol tcp.

Byte patterns (i = index from the start of the region concerned):
  pattern1(i)       = (i * 7 + 3) % 251          what `target` fills its buffer with
  pattern2(i, SEED) = (i * 13 + SEED) % 256      what a peer writes to be checked
  pattern3(i)       = (i * 11 + 5) % 241         what `client` expects to read

Modes:
  target SIZE
      Registers a SIZE-byte buffer filled with pattern1 and prints
      `ready <segment_name> <buffer_addr>`. Then reads stdin lines until EOF;
      each `check OFFSET LEN SEED` line is answered with `ok` if buffer bytes
      [OFFSET, OFFSET+LEN) equal pattern2(i, SEED), else `bad <first bad index>`.
      Exits 0 at EOF.
  client NAME ADDR SIZE SEED
      Reads SIZE bytes at ADDR of segment NAME, checks they equal pattern3,
      then writes pattern2(i, SEED) over the same range and prints
      `done read_MBps=<x> write_MBps=<y>`. Exits 0 on success; on failure
      prints `error <message>` and exits 1.

Diagnostics go to stderr. The process leaves with os._exit so that engine
teardown can never keep it alive after its answer.
"""

import ctypes
import os
import sys
import time


def pattern(size, a, b, m):
    period = bytes((i * a + b) % m for i in range(m))
    return (period * (size // m + 1))[:size]


def pattern1(size):
    return pattern(size, 7, 3, 251)


def pattern2(size, seed):
    return pattern(size, 13, seed % 256, 256)


def pattern3(size):
    return pattern(size, 11, 5, 241)


def say(line):
    sys.stdout.write(line + "\n")
    sys.stdout.flush()


def log(msg):
    sys.stderr.write("mooncake_peer: %s\n" % msg)
    sys.stderr.flush()


def first_difference(a, b):
    for i, (x, y) in enumerate(zip(a, b)):
        if x != y:
            return i
    return min(len(a), len(b))


def start_engine():
    from mooncake.engine import TransferEngine

    engine = TransferEngine()
    rc = engine.initialize("127.0.0.1", "P2PHANDSHAKE", "tcp", "")
    if rc != 0:
        raise RuntimeError("TransferEngine.initialize returned %d" % rc)
    name = "127.0.0.1:%d" % engine.get_rpc_port()
    log("mooncake engine %s up (pid %d)" % (name, os.getpid()))
    return engine, name


def registered_buffer(engine, size, content):
    buf = ctypes.create_string_buffer(content, size)
    addr = ctypes.addressof(buf)
    rc = engine.register_memory(addr, size, "cpu:0")
    if rc != 0:
        raise RuntimeError("register_memory(%#x, %d) returned %d" % (addr, size, rc))
    return buf, addr


def target(size):
    engine, name = start_engine()
    buf, addr = registered_buffer(engine, size, pattern1(size))
    say("ready %s %d" % (name, addr))
    for line in sys.stdin:
        words = line.split()
        if not words:
            continue
        if words[0] == "check" and len(words) == 4:
            off, length, seed = (int(w) for w in words[1:])
            if off < 0 or length < 0 or off + length > size:
                say("bad range")
                continue
            got = ctypes.string_at(addr + off, length)
            want = pattern2(length, seed)
            if got == want:
                say("ok")
            else:
                i = first_difference(got, want)
                log("check: byte %d is %d, expected %d" % (i, got[i], want[i]))
                say("bad %d" % i)
        else:
            say("bad command")
    # Keep `buf` alive (and registered) until here.
    del buf
    return 0


def client(peer, remote, size, seed):
    engine, _ = start_engine()
    buf, addr = registered_buffer(engine, size, b"\0" * size)
    t0 = time.monotonic()
    rc = engine.transfer_sync_read(peer, addr, remote, size)
    t1 = time.monotonic()
    if rc != 0:
        raise RuntimeError("transfer_sync_read(%s, %#x, %d) returned %d" % (peer, remote, size, rc))
    got = ctypes.string_at(addr, size)
    want = pattern3(size)
    if got != want:
        i = first_difference(got, want)
        raise RuntimeError("read byte %d is %d, expected %d" % (i, got[i], want[i]))
    ctypes.memmove(addr, pattern2(size, seed), size)
    t2 = time.monotonic()
    rc = engine.transfer_sync_write(peer, addr, remote, size)
    t3 = time.monotonic()
    if rc != 0:
        raise RuntimeError("transfer_sync_write(%s, %#x, %d) returned %d" % (peer, remote, size, rc))
    mbps = lambda dt: size / max(dt, 1e-9) / 1e6
    say("done read_MBps=%.0f write_MBps=%.0f" % (mbps(t1 - t0), mbps(t3 - t2)))
    del buf
    return 0


def main(argv):
    try:
        if len(argv) == 2 and argv[0] == "target":
            return target(int(argv[1]))
        if len(argv) == 5 and argv[0] == "client":
            return client(argv[1], int(argv[2], 0), int(argv[3]), int(argv[4]))
        say("error usage: target SIZE | client NAME ADDR SIZE SEED")
        return 2
    except Exception as e:  # report every failure as one line
        say("error %s: %s" % (type(e).__name__, e))
        return 1


if __name__ == "__main__":
    code = main(sys.argv[1:])
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)
