#!/usr/bin/env python3
"""Measure the REAL Mooncake Store (PyPI mooncake package) the way `mooncake bench store`
measures ours, so the two sit side by side from the same machine and moment.

  run [--op get|put|exists] [--size 4K] [--batch N] [--threads T] [--duration S]
      [--api copy|zero-copy|tensor] [--client real|dummy] [--segment-size B]
      [--prefill SIZE [--prefill-factor F]]
      Starts Mooncake's `mooncake_master` (embedded HTTP metadata server) and one
      store node (this script, `node` mode) as child processes; the benchmarking
      client runs here as a pure client (no segment), protocol tcp, everything on
      127.0.0.1. Prints ONE JSON line with the fields ours prints.
  node --master ADDR --metadata URL --name HOST:PORT --segment-size B
      A Mooncake store node lending B bytes; prints `ready`, serves until stdin EOF.

APIs: `zero-copy` registers one buffer per thread and calls put_from/get_into (one
object) or batch_put_from/batch_get_into; `copy` calls put(bytes)/get() (one object)
or put_batch/get_batch; `tensor` calls put_tensor/get_tensor (one object) or
batch_put_tensor/batch_get_tensor on uint8 torch tensors of --size bytes. Gets compare
every byte read (outside the latency window).

Prefill: `--prefill SIZE` first puts fresh objects of SIZE in batches of 64 (put_batch)
until --prefill-factor times the node's segment went in (default 1.5: the pool full, its
first objects evicted), so the timed phase runs on a pool small objects already hold
(issue 30: 16 MiB puts after a 4 KiB phase). Errors there end the run.

Clients: `real` (the default) is this process's own store client; `dummy` starts the
package's `mooncake_client` (a real client lending --segment-size) and attaches to it
with setup_dummy, so every call goes through the real client process (zero-copy
buffers then come from alloc_from_mem_pool).

Run through a Python that can import `mooncake`: Mooncake's package, or ours (the same
calls measure either; bench/python_compare.sh runs both).
"""

import argparse
import ctypes
import json
import math
import os
import socket
import subprocess
import sys
import threading
import time

os.environ.setdefault("MC_LOG_LEVEL", "ERROR")  # Mooncake's INFO logs drown the output

MIB = 1 << 20
GIB = 1 << 30


def size(text):
    units = {"K": 1 << 10, "M": 1 << 20, "G": 1 << 30}
    text = text.strip().upper().removesuffix("IB").removesuffix("B")
    if text and text[-1] in units:
        return int(text[:-1]) * units[text[-1]]
    return int(text, 0)


def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def wait_port(port, timeout=20.0):
    deadline = time.time() + timeout
    while time.time() < deadline:
        try:
            with socket.create_connection(("127.0.0.1", port), timeout=0.5):
                return
        except OSError:
            time.sleep(0.05)
    raise RuntimeError("nothing listens on port %d" % port)


def new_store(name, metadata, master, segment, local_buffer):
    from mooncake.store import MooncakeDistributedStore

    store = MooncakeDistributedStore()
    rc = store.setup(name, metadata, segment, local_buffer, "tcp", "", master)
    if rc != 0:
        raise RuntimeError("MooncakeDistributedStore.setup(%s) failed: %d" % (name, rc))
    return store


def node(args):
    store = new_store(args.name, args.metadata, args.master, args.segment_size, 16 * MIB)
    print("ready", flush=True)
    sys.stdin.read()
    store.close()


def percentile(sorted_values, p):  # nearest rank, as mooncake::util::percentile
    n = len(sorted_values)
    if n == 0:
        return 0.0
    return sorted_values[min(max(math.ceil(p * n - 1e-9), 1), n) - 1]


class Children:
    """mooncake_master and the node; ended and reaped on exit."""

    def __init__(self):
        self.procs = []

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        for p in reversed(self.procs):
            try:
                if p.stdin:
                    p.stdin.close()
            except OSError:
                pass
            p.terminate()
            try:
                p.wait(timeout=5)
            except subprocess.TimeoutExpired:
                p.kill()
                p.wait()


def console_script(name):
    """The package's console script (both packages install them), else the binary bundled
    inside Mooncake's package."""
    import mooncake

    path = os.path.join(os.path.dirname(sys.executable), name)
    if not os.path.exists(path):
        path = os.path.join(os.path.dirname(mooncake.__file__), name)
    return path


def start_real_client(children, master_addr, metadata, segment_size, local_buffer):
    """The package's `mooncake_client` on a free port; returns its address for dummies."""
    port = free_port()
    proc = subprocess.Popen(
        [
            console_script("mooncake_client"),
            "--host=127.0.0.1",
            "--port=%d" % port,
            "--master_server_address=%s" % master_addr,
            "--metadata_server=%s" % metadata,
            "--global_segment_size=%d" % segment_size,
            "--local_buffer_size=%d" % local_buffer,
        ],
        stdin=subprocess.DEVNULL,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    children.procs.append(proc)
    wait_port(port)
    return "127.0.0.1:%d" % port


def start_cluster(children, segment_size):
    master_bin = console_script("mooncake_master")
    rpc, meta, metrics = free_port(), free_port(), free_port()
    master = subprocess.Popen(
        [
            master_bin,
            "--rpc_port=%d" % rpc,
            "--rpc_address=127.0.0.1",
            "--enable_http_metadata_server=true",
            "--http_metadata_server_host=127.0.0.1",
            "--http_metadata_server_port=%d" % meta,
            "--metrics_port=%d" % metrics,
            "--enable_metric_reporting=false",
        ],
        stdin=subprocess.DEVNULL,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    children.procs.append(master)
    wait_port(rpc)
    wait_port(meta)
    master_addr = "127.0.0.1:%d" % rpc
    metadata = "http://127.0.0.1:%d/metadata" % meta
    node_proc = subprocess.Popen(
        [
            sys.executable,
            os.path.abspath(__file__),
            "node",
            "--master",
            master_addr,
            "--metadata",
            metadata,
            "--name",
            "127.0.0.1:%d" % free_port(),
            "--segment-size",
            str(segment_size),
        ],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
    )
    children.procs.append(node_proc)
    line = node_proc.stdout.readline()
    if line.strip() != "ready":
        raise RuntimeError("node did not report ready (got %r)" % line)
    return master_addr, metadata


def prefill(store, run_id, sz, total):
    """Puts fresh objects of `sz` bytes, 64 a call, until `total` bytes went in."""
    value = os.urandom(sz)
    chunk = 64
    for n in range(max(1, total // (sz * chunk))):
        ks = ["%s/fill%d.%d" % (run_id, n, j) for j in range(chunk)]
        rcs = store.put_batch(ks, [value] * chunk)
        if rcs != 0 and (not isinstance(rcs, list) or any(r != 0 for r in rcs)):
            raise RuntimeError("prefill: %r" % (rcs,))


def run(args):
    op, api, sz, batch, threads = args.op, args.api, args.size, args.batch, args.threads
    group = threads * batch
    keys_n = min(group * 64, max(group, GIB // sz)) // group * group
    if args.segment_size:
        segment = args.segment_size
    elif op == "put":
        segment = GIB
    else:
        segment = min(4 * GIB, max(256 * MIB, (keys_n * sz * 3 // 2 + 64 * MIB) // (64 * MIB) * (64 * MIB)))
    run_id = "mcbench-%d-%x" % (os.getpid(), time.time_ns())
    # Distinct values, reused across keys when many keys are large.
    n_values = min(keys_n or group, max(batch, (256 * MIB) // sz))
    values = [os.urandom(sz) for _ in range(max(1, min(n_values, 4096)))]
    value_of = lambda i: values[i % len(values)]

    if api == "tensor":
        import torch

        tensors = [torch.frombuffer(bytearray(v), dtype=torch.uint8) for v in values]
        tensor_of = lambda i: tensors[i % len(tensors)]

    with Children() as children:
        master_addr, metadata = start_cluster(children, segment)
        local_buffer = min(2 * GIB, max(64 * MIB, 4 * batch * sz * threads))
        if args.client == "dummy":
            from mooncake.store import MooncakeDistributedStore

            real = start_real_client(children, master_addr, metadata, 64 * MIB, local_buffer)
            store = MooncakeDistributedStore()
            pool = 2 * batch * sz * threads + 64 * MIB
            rc = store.setup_dummy(pool, local_buffer, real)
            if rc != 0:
                raise RuntimeError("setup_dummy(%s) failed: %d" % (real, rc))
        else:
            store = new_store("127.0.0.1:%d" % free_port(), metadata, master_addr, 0,
                              local_buffer)
        key = lambda i: "%s/k%d" % (run_id, i)
        if args.prefill:
            prefill(store, run_id, args.prefill, int(segment * args.prefill_factor))
        if op != "put":
            chunk = max(1, min(64, (64 * MIB) // sz))
            for i in range(0, keys_n, chunk):
                ks = [key(j) for j in range(i, min(keys_n, i + chunk))]
                vs = [value_of(j) for j in range(i, min(keys_n, i + chunk))]
                if api == "tensor":  # a tensor's bytes carry upstream's header
                    rcs = store.batch_put_tensor(ks, [tensor_of(j) for j in range(i, i + len(ks))])
                else:
                    rcs = store.put_batch(ks, vs)
                if rcs != 0 and (not isinstance(rcs, list) or any(r != 0 for r in rcs)):
                    raise RuntimeError("populating: %r" % (rcs,))
        stop = threading.Event()
        results = [None] * threads

        def worker(t):
            lat, objects, errors, first = [], 0, 0, None
            buf = None
            if api == "zero-copy":
                if args.client == "dummy":  # a dummy's zero-copy memory is the shared pool
                    buf = base = store.alloc_from_mem_pool(batch * sz)
                    if not base:
                        raise RuntimeError("alloc_from_mem_pool failed")
                else:
                    buf = ctypes.create_string_buffer(batch * sz)
                    base = ctypes.addressof(buf)
                if store.register_buffer(base, batch * sz) != 0:
                    raise RuntimeError("register_buffer failed")
                ptrs = [base + j * sz for j in range(batch)]
                sizes = [sz] * batch
                if op == "put":
                    for j in range(batch):
                        ctypes.memmove(ptrs[j], value_of(j), sz)
            per = keys_n // threads
            first_key = t * per
            at, n = 0, 0
            while not stop.is_set():
                if op == "put":
                    ks = ["%s/p%d/%d.%d" % (run_id, t, n, j) for j in range(batch)]
                    n += 1
                    t0 = time.perf_counter()
                    if api == "zero-copy":
                        if batch == 1:
                            rcs = [store.put_from(ks[0], ptrs[0], sz)]
                        else:
                            rcs = store.batch_put_from(ks, ptrs, sizes)
                    elif api == "tensor":
                        if batch == 1:
                            rcs = [store.put_tensor(ks[0], tensor_of(0))]
                        else:
                            rcs = store.batch_put_tensor(ks, [tensor_of(j) for j in range(batch)])
                    elif batch == 1:
                        rcs = [store.put(ks[0], value_of(0))]
                    else:
                        rcs = store.put_batch(ks, [value_of(j) for j in range(batch)])
                        rcs = rcs if isinstance(rcs, list) else [rcs] * batch
                    lat.append((time.perf_counter() - t0) * 1e6)
                    for k, rc in zip(ks, rcs):
                        objects += 1
                        if rc != 0:
                            errors += 1
                            first = first or "put %s: %r" % (k, rc)
                    continue
                if at + batch > per:
                    at = 0
                idx = list(range(first_key + at, first_key + at + batch))
                at += batch
                ks = [key(i) for i in idx]
                t0 = time.perf_counter()
                if op == "exists":
                    rcs = [store.is_exist(ks[0])] if batch == 1 else store.batch_is_exist(ks)
                    lat.append((time.perf_counter() - t0) * 1e6)
                    for k, rc in zip(ks, rcs):
                        objects += 1
                        if rc != 1:
                            errors += 1
                            first = first or "exists %s: %r" % (k, rc)
                    continue
                if api == "zero-copy":
                    if batch == 1:
                        rcs = [store.get_into(ks[0], ptrs[0], sz)]
                    else:
                        rcs = store.batch_get_into(ks, ptrs, sizes)
                    lat.append((time.perf_counter() - t0) * 1e6)
                    got = [ctypes.string_at(p, sz) for p in ptrs]
                elif api == "tensor":
                    got = [store.get_tensor(ks[0])] if batch == 1 else store.batch_get_tensor(ks)
                    lat.append((time.perf_counter() - t0) * 1e6)
                    got = [b"" if g is None else g.numpy().tobytes() for g in got]
                    rcs = [len(g) for g in got]
                else:
                    got = [store.get(ks[0])] if batch == 1 else store.get_batch(ks)
                    lat.append((time.perf_counter() - t0) * 1e6)
                    rcs = [len(g) for g in got]
                for j, (k, rc) in enumerate(zip(ks, rcs)):
                    objects += 1
                    if rc != sz or bytes(got[j]) != value_of(idx[j]):
                        errors += 1
                        first = first or "get %s: %r" % (k, rc)
            if buf is not None:
                store.unregister_buffer(base)
            results[t] = (lat, objects, errors, first)

        ths = [threading.Thread(target=worker, args=(t,)) for t in range(threads)]
        start = time.perf_counter()
        for th in ths:
            th.start()
        time.sleep(args.duration)
        stop.set()
        for th in ths:
            th.join()
        seconds = time.perf_counter() - start
        store.close()

    lat = sorted(x for r in results if r for x in r[0])
    objects = sum(r[1] for r in results if r)
    errors = sum(r[2] for r in results if r) + sum(1 for r in results if r is None)
    first = next((r[3] for r in results if r and r[3]), None)
    moved = 0 if op == "exists" else sz
    done = objects - errors  # what failed moved nothing: rates count successes only
    print(
        json.dumps(
            {
                "bench": "store",
                "impl": "mooncake",
                "op": op,
                "api": api,
                "client": args.client,
                "size": sz,
                "batch": batch,
                "threads": threads,
                "ops": objects,
                "seconds": round(seconds, 3),
                "ops_per_s": round(done / seconds),
                "gbps": round(done * moved / seconds / 1e9, 3),
                "lat_p50_us": round(percentile(lat, 0.5), 3),
                "lat_p99_us": round(percentile(lat, 0.99), 3),
                # Bytes over the time each thread spent inside the timed calls: the figure
                # above also pays this script's own checks between calls (copying and
                # comparing every byte read), which weigh alike on both packages and at
                # 4 MiB take as long as the get itself.
                "gbps_in_calls": (round(done * moved / (sum(lat) / 1e6 / threads) / 1e9, 3)
                                  if lat else 0),
                "calls": len(lat),
                "errors": errors,
                "protocol": "tcp",
                "keys": 0 if op == "put" else keys_n,
                "node_segment_size": segment,
                "prefill": args.prefill,
            }
        ),
        flush=True,
    )
    if first:
        print("first error: %s" % first, file=sys.stderr)
    return 1 if errors else 0


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = ap.add_subparsers(dest="cmd", required=True)
    r = sub.add_parser("run")
    r.add_argument("--op", choices=["get", "put", "exists"], default="get")
    r.add_argument("--api", choices=["copy", "zero-copy", "tensor"], default="zero-copy")
    r.add_argument("--client", choices=["real", "dummy"], default="real")
    r.add_argument("--size", type=size, default=4096)
    r.add_argument("--batch", type=int, default=1)
    r.add_argument("--threads", type=int, default=1)
    r.add_argument("--duration", type=float, default=3.0)
    r.add_argument("--segment-size", type=size, default=0)
    r.add_argument("--prefill", type=size, default=0)
    r.add_argument("--prefill-factor", type=float, default=1.5)
    n = sub.add_parser("node")
    n.add_argument("--master", required=True)
    n.add_argument("--metadata", required=True)
    n.add_argument("--name", required=True)
    n.add_argument("--segment-size", type=size, required=True)
    args = ap.parse_args()
    if args.cmd == "node":
        node(args)
        return 0
    return run(args)


if __name__ == "__main__":
    sys.exit(main())
