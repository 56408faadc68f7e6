#!/usr/bin/env python3
"""Chaos run: a master, 3 nodes with disk tiers and a verifying load, while nodes are
killed (SIGKILL) and restarted every few seconds and the master twice.

    python3 bench/chaos.py [--minutes 10] [--seed 1] [--replicas 1] [--put-rate 25] [--master-kills 2]

Processes (all on 127.0.0.1): a `mooncake metadata-server` (never killed, so engine
metadata outlives the master), `mooncake master --lease-ttl-ms 2000 --client-ttl 2
--verify-metadata URL` (mounts read through that metadata before they count; a
dead node's segment goes after 2 s, so its restart can take its name back before the
next kill), 3 `mooncake node --segment-size 16M --ssd-size 4G --protocol tcp --name
127.0.0.1:PORT --ssd-path DIR`,
and `mooncake bench chaos-load` (bench/chaos.rs) as a pure client. The load writes
far more than the nodes' memory, so most objects are evicted to the disk tiers. Every
3-8 s a random node is killed with SIGKILL and started again at once under the same
name and disk directory; at 1/3 and 2/3 of the run (--master-kills) the master is
killed the same way and restarted on the same RPC port. Afterwards every process is back up and the load
reads every committed object again (retrying the unreadable ones for up to 120 s).

Counting (the method): an object's bytes derive from its key, so every read is
checked: `wrong` is any read (during the run or the final pass) whose bytes differ.
An object still unreadable at the end is
  - `lost` when a disk tier holds a complete copy of it: the driver reads every
    node's log files itself (record format of crates/store/src/disk/record.rs), and a value
    record whose bytes are exactly the object's is a copy the node had on disk, which
    survives its restarts (the files are append-only; the quota is never reached, so
    no file is evicted; a tombstone after it would still count as lost, since nothing
    here removes objects);
  - `lost` when one of its memory replicas right after its put (the master's
    `describe`) lay on nodes none of which was killed after the put started: it had
    a live replica;
  - `dropped_with_node` otherwise: every replica had a piece on a node killed after
    its put started, and no disk held it. (Objects are at most 256 KiB, one slab,
    so a replica is one piece on one node; `striped` counts any that were not.) If the master could not say where it was
    right after the put (down at that moment), it is `dropped_unlocated` when some
    node was killed after its put started, else `lost`.
Exit status 1 when wrong > 0 or lost > 0 (or a disk tier evicted a file, which would
void the disk check). One JSON summary line on stdout; progress on stderr. Every
process started is killed at the end, also on errors, Ctrl-C and SIGTERM; the
temporary directory is removed, except its logs after a failure or an error (--keep:
everything).
"""

import argparse
import json
import os
import random
import shutil
import signal
import socket
import struct
import subprocess
import sys
import tempfile
import time

NODES = 3
SEGMENT = "16M"
SSD_SIZE = "4G"
SSD_QUOTA = 4 << 30
# Values on disk carry a 16-byte prefix ("MCV1" | crc32c | version), crates/store/src/node/disk.rs.
VALUE_PREFIX = 16
RECORD_MAGIC = b"MCD1"
RECORD_HEADER = 24
KIND_VALUE, KIND_TOMBSTONE = 1, 2
SIZES = [16 << 10, 64 << 10, 128 << 10, 256 << 10]  # as bench/chaos.rs
MASK = (1 << 64) - 1


def log(msg):
    print(f"chaos [{time.strftime('%H:%M:%S')}] {msg}", file=sys.stderr, flush=True)


def now_ms():
    return int(time.time() * 1000)


def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def splitmix64(x):
    x = (x + 0x9E3779B97F4A7C15) & MASK
    x = ((x ^ (x >> 30)) * 0xBF58476D1CE4E5B9) & MASK
    x = ((x ^ (x >> 27)) * 0x94D049BB133111EB) & MASK
    return x ^ (x >> 31)


def expected_value(seed, i):
    """Object i's bytes, as bench/chaos.rs writes them."""
    base = splitmix64(((seed << 32) ^ i) & MASK)
    size = SIZES[base >> 62]
    return b"".join(struct.pack("<Q", splitmix64((base + j) & MASK)) for j in range(size // 8))


class Proc:
    """A child of ours: its log files and how to start it again."""

    def __init__(self, name, args, workdir):
        self.name, self.args, self.workdir = name, args, workdir
        self.popen = None
        self.ready = None

    def start(self, timeout=30):
        out = open(os.path.join(self.workdir, f"{self.name}.out"), "ab")
        err = open(os.path.join(self.workdir, f"{self.name}.err"), "ab")
        pos = out.tell()
        self.popen = subprocess.Popen(self.args, stdout=out, stderr=err, stdin=subprocess.DEVNULL)
        out.close()
        err.close()
        deadline = time.time() + timeout
        path = os.path.join(self.workdir, f"{self.name}.out")
        while time.time() < deadline:
            with open(path, "rb") as f:
                f.seek(pos)
                for line in f.read().decode(errors="replace").splitlines():
                    if line.startswith("ready"):
                        self.ready = line
                        return True
            if self.popen.poll() is not None:
                return False
            time.sleep(0.05)
        return False

    def alive(self):
        return self.popen is not None and self.popen.poll() is None

    def kill9(self):
        if self.alive():
            self.popen.send_signal(signal.SIGKILL)
        if self.popen is not None:
            self.popen.wait()


def start_until_ready(proc, attempts=20):
    """Starts `proc`, again after a pause when it exits before its ready line (a node
    started while the master is away, a port still held)."""
    for _ in range(attempts):
        if proc.start():
            return True
        proc.kill9()
        time.sleep(0.5)
    return False


def scan_disk(directory):
    """{key: [(kind, file, value offset, value_len), ...]} of the well-formed records
    per key in a disk tier's log files, in log order. Unlike the node's own scan it
    resynchronizes on the next magic after a bad header, so a complete record behind a
    torn one still counts."""
    last = {}
    names = sorted(n for n in os.listdir(directory) if n.endswith(".mclog")) if os.path.isdir(directory) else []
    for name in names:
        path = os.path.join(directory, name)
        size = os.path.getsize(path)
        with open(path, "rb") as f:
            off = 0
            while off + RECORD_HEADER <= size:
                f.seek(off)
                head = f.read(RECORD_HEADER)
                magic, kind, _, key_len, value_len = struct.unpack_from("<4sBBHQ", head)
                end = off + RECORD_HEADER + key_len + value_len
                if magic == RECORD_MAGIC and kind in (KIND_VALUE, KIND_TOMBSTONE) and end <= size:
                    key = f.read(key_len).decode(errors="replace")
                    last.setdefault(key, []).append((kind, path, off + RECORD_HEADER + key_len, value_len))
                    off = end
                    continue
                # Not a record here: look for the next magic.
                f.seek(off + 1)
                found = -1
                pos = off + 1
                while found < 0 and pos < size:
                    chunk = f.read(1 << 20)
                    if not chunk:
                        break
                    k = chunk.find(RECORD_MAGIC)
                    if k >= 0:
                        found = pos + k
                    else:
                        pos += len(chunk) - 3
                        f.seek(pos)
                if found < 0:
                    break
                off = found
    return last, names


def disk_held(records, seed, i):
    """Whether any of `records` (kind, file, value offset, value length) is a complete
    copy of object i: a value record whose bytes after the prefix are exactly the
    object's. (A tombstone after it does not undo that: nothing here removes objects.)"""
    want = None
    for kind, path, off, value_len in records:
        if kind != KIND_VALUE:
            continue
        want = want if want is not None else expected_value(seed, i)
        if value_len != VALUE_PREFIX + len(want):
            continue
        with open(path, "rb") as f:
            f.seek(off)
            value = f.read(value_len)
        if value[:4] == b"MCV1" and value[VALUE_PREFIX:] == want:
            return True
    return False


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--minutes", type=float, default=10)
    ap.add_argument("--seed", type=int, default=1)
    ap.add_argument("--replicas", type=int, default=1)
    ap.add_argument("--put-rate", type=float, default=25)
    ap.add_argument("--master-kills", type=int, default=2, help="spread evenly over the run")
    ap.add_argument("--bin", default=None, help="mooncake binary (default: build target/release/mooncake)")
    ap.add_argument("--keep", action="store_true", help="keep the temporary directory")
    args = ap.parse_args()
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    binary = args.bin
    if binary is None:
        subprocess.run(["cargo", "build", "--release", "--bin", "mooncake"], cwd=root, check=True,
                       stdout=sys.stderr)
        binary = os.path.join(root, "target", "release", "mooncake")
    rnd = random.Random(args.seed)
    seconds = args.minutes * 60
    work = tempfile.mkdtemp(prefix="mooncake-chaos-")
    procs = []
    load = None
    summary = None
    try:
        meta = Proc("metadata", [binary, "metadata-server", "--port", "0", "--bind", "127.0.0.1"], work)
        procs.append(meta)
        if not meta.start():
            raise RuntimeError("the metadata server did not start")
        metadata = meta.ready.split()[1]
        # Every mount is read through the nodes' own metadata service before it counts.
        master = Proc("master", [binary, "master", "--bind", "127.0.0.1", "--rpc-port", "0",
                                 "--metrics-port", "off", "--lease-ttl-ms", "2000", "--client-ttl", "2",
                                 "--verify-metadata", metadata], work)
        procs.append(master)
        if not master.start():
            raise RuntimeError("the master did not start")
        rpc = next(w.split("=", 1)[1] for w in master.ready.split() if w.startswith("rpc="))
        # Restarts keep the port.
        master.args = [a if a != "0" or master.args[i - 1] != "--rpc-port" else rpc.rsplit(":", 1)[1]
                       for i, a in enumerate(master.args)]
        nodes = []
        for n in range(NODES):
            name = f"127.0.0.1:{free_port()}"
            ssd = os.path.join(work, f"ssd-{n}")
            node = Proc(f"node-{n}", [binary, "node", "--master", rpc, "--metadata", metadata,
                                      "--segment-size", SEGMENT, "--protocol", "tcp", "--name", name,
                                      "--bind", "127.0.0.1", "--ssd-size", SSD_SIZE, "--ssd-path", ssd], work)
            node.segment, node.ssd, node.kills = name, ssd, []
            procs.append(node)
            nodes.append(node)
            if not start_until_ready(node):
                raise RuntimeError(f"{node.name} did not start")
        log(f"master {rpc}, metadata {metadata}, nodes {[n.segment for n in nodes]}, work {work}")

        load_err = open(os.path.join(work, "load.err"), "wb")
        load = subprocess.Popen(
            [binary, "bench", "chaos-load", "--master", rpc, "--metadata", metadata, "--protocol", "tcp",
             "--seconds", str(seconds), "--put-rate", str(args.put_rate), "--replicas", str(args.replicas),
             "--seed", str(args.seed)],
            stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=load_err, text=True)
        load_err.close()

        start = time.time()
        master_kills = [start + seconds * (k + 1) / (args.master_kills + 1) for k in range(args.master_kills)]
        node_restarts = master_restarts = failed_starts = 0
        next_kill = start + rnd.uniform(3, 8)
        while time.time() - start < seconds:
            if load.poll() is not None:
                raise RuntimeError("the load exited early (see load.err)")
            t = time.time()
            if master_kills and t >= master_kills[0]:
                master_kills.pop(0)
                master.kill9()
                log(f"master killed at {now_ms()} ms")
                if not start_until_ready(master):
                    raise RuntimeError("the master did not come back")
                master_restarts += 1
            elif t >= next_kill:
                node = rnd.choice(nodes)
                node.kill9()
                node.kills.append(now_ms())
                log(f"{node.name} ({node.segment}) killed at {node.kills[-1]} ms")
                if start_until_ready(node):
                    node_restarts += 1
                else:
                    failed_starts += 1
                    log(f"{node.name} did not come back; retried at the end")
                next_kill = time.time() + rnd.uniform(3, 8)
            time.sleep(0.1)

        loaded = json.loads(load.stdout.readline())
        log(f"load done: {loaded['puts']} puts, {loaded['gets']} gets; bringing everything back")
        for p in [master] + nodes:
            if not p.alive() and not start_until_ready(p):
                raise RuntimeError(f"{p.name} did not come back for the final pass")
        load.stdin.write("verify\n")
        load.stdin.flush()
        verified = json.loads(load.stdout.readline())
        load.wait(timeout=60)

        # Classify what is still unreadable.
        by_segment = {n.segment: n for n in nodes}
        disks = []
        for n in nodes:
            records, files = scan_disk(n.ssd)
            ids = [int(f.split(".")[0]) for f in files]
            used = sum(os.path.getsize(os.path.join(n.ssd, f)) for f in files)
            # The tier evicts a whole file (at most 256 MiB) only when a record would
            # take it past its quota, so ending this far below it means it never did.
            disks.append((n, records, used < SSD_QUOTA - (257 << 20), used))
        lost, dropped, dropped_unlocated, details = 0, 0, 0, []
        for u in verified["unreadable"]:
            i = int(u["key"].rsplit("-", 1)[1])
            on_disk = [n.name for n, records, _, _ in disks
                       if disk_held(records.get(u["key"], []), args.seed, i)]
            tombstoned = [n.name for n, records, _, _ in disks
                          if any(r[0] == KIND_TOMBSTONE for r in records.get(u["key"], []))]
            killed_after = lambda n: any(k >= u["start_ms"] for k in n.kills)
            if on_disk:
                verdict = "lost: on disk"
            elif u["replicas"] is None:
                verdict = ("dropped_unlocated" if any(killed_after(n) for n in nodes)
                           else "lost: unlocated, no node killed since its put")
            elif all(any(s in by_segment and killed_after(by_segment[s]) for s in replica)
                     for replica in u["replicas"]):
                verdict = "dropped_with_node"
            else:
                verdict = "lost: had a live replica"
            if verdict == "dropped_with_node":
                dropped += 1
            elif verdict == "dropped_unlocated":
                dropped_unlocated += 1
            else:
                lost += 1
                if len(details) < 20:
                    details.append({**u, "verdict": verdict, "disk": on_disk, "tombstones": tombstoned})
        wrong = loaded["wrong"] + verified["wrong"]
        summary = {
            "minutes": args.minutes, "seed": args.seed, "replicas": args.replicas,
            "puts_attempted": loaded["attempted"], "puts_committed": loaded["puts"],
            "put_errors": loaded["put_errors"],
            "gets": loaded["gets"], "hits": loaded["hits"], "misses": loaded["misses"],
            "get_errors": loaded["get_errors"],
            "node_restarts": node_restarts, "node_failed_starts": failed_starts,
            "master_restarts": master_restarts,
            "final_reads": verified["committed"], "final_seconds": verified["seconds"],
            "wrong": wrong, "striped": loaded["striped"], "wrong_keys": loaded["wrong_keys"] + verified["wrong_keys"],
            "lost": lost, "dropped_with_node": dropped, "dropped_unlocated": dropped_unlocated,
            "disk_copies": sum(1 for _, records, _, _ in disks for k, rs in records.items()
                               if k.startswith(f"chaos-{args.seed}-") and any(r[0] == KIND_VALUE for r in rs)),
            "disk_bytes": [d[3] for d in disks], "disk_never_evicted": all(d[2] for d in disks),
            "lost_examples": details,
        }
    finally:
        if load is not None and load.poll() is None:
            load.kill()
            load.wait()
        for p in reversed(procs):
            p.kill9()
        bad = summary is None or summary["wrong"] > 0 or summary["lost"] > 0 \
            or not summary["disk_never_evicted"]
        interrupted = isinstance(sys.exc_info()[1], KeyboardInterrupt)
        if args.keep:
            log(f"kept {work}")
        elif bad and not interrupted:
            # The disk tiers are large; the logs are what a failure is read from.
            for n in range(NODES):
                shutil.rmtree(os.path.join(work, f"ssd-{n}"), ignore_errors=True)
            log(f"logs kept in {work}")
        else:
            shutil.rmtree(work, ignore_errors=True)
    print(json.dumps(summary), flush=True)
    return 1 if bad else 0


def on_term(signum, frame):
    raise KeyboardInterrupt


if __name__ == "__main__":
    signal.signal(signal.SIGTERM, on_term)
    signal.signal(signal.SIGINT, on_term)
    try:
        sys.exit(main())
    except KeyboardInterrupt:
        sys.exit(130)
