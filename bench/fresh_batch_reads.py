#!/usr/bin/env python3
"""Batch reads of keys no call has read yet, many of them: the tail a long prefill or
decode run sees once the client's replica cache is full and the master holds a large
table.

Starts the package's own `mooncake_master`, sets up one store that lends a segment
large enough for every value (so nothing is evicted), writes `--keys` 4 KiB values in
batches of 64, then reads each batch once with `batch_get_into` and prints p50, p99,
p99.9, max and mean of those reads, and the slowest reads by position.

    python bench/fresh_batch_reads.py [--keys 640000]   # any Python that imports mooncake

Run it through our package's Python and through the wheel's for the same-run peer;
figures in bench/NOTEBOOK.md ("Reads of many fresh keys").
"""

import argparse
import ctypes
import sys
import time

from python_call_profile import start_master

SIZE = 4096
BATCH = 64


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--keys", type=int, default=640_000)
    args = ap.parse_args()
    from mooncake.store import MooncakeDistributedStore

    batches = [[f"f{j}" for j in range(b, b + BATCH)]
               for b in range(0, args.keys - args.keys % BATCH, BATCH)]
    # Room for every value and a quarter more: nothing is evicted.
    segment = (len(batches) * BATCH * SIZE * 5 // 4 >> 20) + 64 << 20
    master, rpc, http = start_master()
    try:
        store = MooncakeDistributedStore()
        rc = store.setup("127.0.0.1", f"http://127.0.0.1:{http}/metadata", segment,
                         64 << 20, "tcp", "", f"127.0.0.1:{rpc}")
        if rc != 0:
            sys.exit(f"setup failed: {rc}")
        buf = ctypes.create_string_buffer(SIZE * BATCH)
        addr = ctypes.addressof(buf)
        if store.register_buffer(addr, len(buf)) != 0:
            sys.exit("register_buffer failed")
        addrs = [addr + SIZE * j for j in range(BATCH)]
        sizes = [SIZE] * BATCH
        for keys in batches:
            if any(rc != 0 for rc in store.batch_put_from(keys, addrs, sizes)):
                sys.exit("a put failed")
        lat = []
        for keys in batches:
            t0 = time.perf_counter_ns()
            got = store.batch_get_into(keys, addrs, sizes)
            lat.append(time.perf_counter_ns() - t0)
            if any(n != SIZE for n in got):
                sys.exit(f"a read failed: {got}")
        slowest = sorted(range(len(lat)), key=lambda i: -lat[i])[:5]
        ordered = sorted(lat)

        def at(q):
            return ordered[min(len(ordered) - 1, int(len(ordered) * q))] / 1000

        print(f"batch_get_into x{BATCH}, {len(lat)} batches of keys never read: "
              f"p50 {at(0.5):.1f} p99 {at(0.99):.1f} p99.9 {at(0.999):.1f} "
              f"max {ordered[-1] / 1000:.1f} mean {sum(lat) / len(lat) / 1000:.1f} us")
        print("slowest (batch, us):", [(i, round(lat[i] / 1000)) for i in slowest])
        store.close()
    finally:
        master.kill()
        master.wait()


if __name__ == "__main__":
    main()
