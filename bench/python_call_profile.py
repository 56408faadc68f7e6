#!/usr/bin/env python3
"""What one Python store call costs, and how much of it is Python.

Starts the package's own `mooncake_master` (metadata on its HTTP server), sets up one
store that lends a 512 MiB segment (data moves by local copy; puts still wait for the
master), registers a buffer and times, 3,000 calls each, 4 KiB: put_from of fresh keys,
get_into (each key's first read), get and is_exist (keys read before), batch_get_into of
64 keys (keys no call read yet, then keys read before). With our package it then times
the bare C calls (`mc_store_get_into`, `mc_store_put_from`) and the Python side alone
(the same calls with the C function replaced by one returning 0).

    python bench/python_call_profile.py            # with any Python that imports mooncake

Run it through our package's Python and through the wheel's for the same-run peer;
figures in bench/NOTEBOOK.md ("One Python call, profiled").
"""

import ctypes
import os
import socket
import subprocess
import sys
import time

CALLS = 3000
SIZE = 4096


def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start_master():
    """Starts the package's `mooncake_master` on free loopback ports, metadata on its
    HTTP server; (process, rpc port, http port) once it takes connections."""
    rpc, http = free_port(), free_port()
    master = subprocess.Popen(
        [os.path.join(os.path.dirname(sys.executable), "mooncake_master"),
         f"--rpc_port={rpc}", "--rpc_address=127.0.0.1",
         "--enable_http_metadata_server=true", f"--http_metadata_server_port={http}",
         "--http_metadata_server_host=127.0.0.1"],
        stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    deadline = time.monotonic() + 10
    while True:
        try:
            socket.create_connection(("127.0.0.1", rpc), timeout=0.1).close()
            return master, rpc, http
        except OSError:
            if time.monotonic() > deadline or master.poll() is not None:
                master.kill()
                master.wait()
                sys.exit("the master did not start")
            time.sleep(0.05)


def timed(name, fn, n=CALLS):
    samples = []
    for i in range(n):
        t0 = time.perf_counter_ns()
        fn(i)
        samples.append(time.perf_counter_ns() - t0)
    samples.sort()
    p50 = samples[len(samples) // 2] / 1000
    mean = sum(samples) / len(samples) / 1000
    print(f"{name:36s} p50 {p50:8.1f} us  mean {mean:8.1f} us", flush=True)


def main():
    import mooncake
    from mooncake.store import MooncakeDistributedStore

    ours = os.path.exists(os.path.join(os.path.dirname(mooncake.__file__), "_native.py"))
    tag = "ours" if ours else "wheel"
    master, rpc, http = start_master()
    try:
        store = MooncakeDistributedStore()
        rc = store.setup("127.0.0.1", f"http://127.0.0.1:{http}/metadata", 512 << 20,
                         64 << 20, "tcp", "", f"127.0.0.1:{rpc}")
        if rc != 0:
            sys.exit(f"setup failed: {rc}")
        buf = ctypes.create_string_buffer(SIZE * 64)
        addr = ctypes.addressof(buf)
        if store.register_buffer(addr, len(buf)) != 0:
            sys.exit("register_buffer failed")
        timed(f"{tag} put_from (fresh key)", lambda i: store.put_from(f"k{i}", addr, SIZE))
        timed(f"{tag} get_into (first read)", lambda i: store.get_into(f"k{i}", addr, SIZE))
        timed(f"{tag} get (read before)", lambda i: store.get(f"k{i}"))
        timed(f"{tag} is_exist", lambda i: store.is_exist(f"k{i}"))
        addrs = [addr + SIZE * j for j in range(64)]
        for i in range(CALLS):  # keys no call has read yet
            store.put_from(f"b{i}", addr, SIZE)
        fresh = [[f"b{j}" for j in range(b * 64, b * 64 + 64)] for b in range(CALLS // 64)]
        timed(f"{tag} batch_get_into x64 (first read)", lambda i: store.batch_get_into(
            fresh[i], addrs, [SIZE] * 64), n=len(fresh))
        batches = [[f"k{j}" for j in range(b * 64, b * 64 + 64)] for b in range(CALLS // 64)]
        timed(f"{tag} batch_get_into x64 (read before)", lambda i: store.batch_get_into(
            batches[i], addrs, [SIZE] * 64), n=len(batches))
        if ours:
            bare_and_python_side(store, addr)
        store.close()
    finally:
        master.kill()
        master.wait()


def bare_and_python_side(store, addr):
    from mooncake import _native
    from mooncake.store import ReplicateConfig

    handle = store._store
    got = ctypes.c_uint64(0)
    keys = [f"k{i}".encode() for i in range(CALLS)]
    timed("ours get_into (read before)", lambda i: store.get_into(f"k{i}", addr, SIZE))
    timed("ours bare mc_store_get_into", lambda i: _native.LIB.mc_store_get_into(
        handle, keys[i], addr, SIZE, ctypes.byref(got)))
    cfg, _keep = ReplicateConfig()._to_c()
    fresh = [f"q{i}".encode() for i in range(CALLS)]
    timed("ours bare mc_store_put_from", lambda i: _native.LIB.mc_store_put_from(
        handle, fresh[i], addr, SIZE, ctypes.byref(cfg)))
    real = _native.LIB

    class Stubbed:
        def __getattr__(self, name):
            if name in ("mc_store_put_from", "mc_store_get_into"):
                return lambda *args: 0
            return getattr(real, name)

    _native.LIB = Stubbed()
    try:
        timed("python side of put_from", lambda i: store.put_from(f"z{i}", addr, SIZE))
        timed("python side of get_into", lambda i: store.get_into(f"z{i}", addr, SIZE))
    finally:
        _native.LIB = real


if __name__ == "__main__":
    main()
