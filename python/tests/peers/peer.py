#!/usr/bin/env python3
"""A Mooncake peer in its own process, for the cross-process tests.

Only the standard library plus whichever `mooncake` package the interpreter imports:
run with our venv's Python for the engine flows, or with `$MC_INTEROP_PYTHON` (the
real `mooncake-transfer-engine-non-cuda` wheel) for interop.

Usage:
  peer.py engine [LOCATION]
      TransferEngine().initialize("127.0.0.1", "P2PHANDSHAKE", "tcp", ""); prints
      `ready <session> <pid> <mooncake module file>`. With $MC_PEER_METADATA set (e.g.
      etcd://127.0.0.1:PORT) it initializes on that metadata server instead, named
      127.0.0.1:<a free port>. With $MC_PEER_HOST set (the address of the simulated
      host it runs on) it is a user on that host: initialize($MC_PEER_HOST, metadata,
      "tcp", ""), the session being get_session_id(). Buffers are registered with
      register_memory(addr, len, LOCATION) (default "*") or batch_register_memory.
  peer.py store CONFIG_JSON_PATH file|dict
      MooncakeDistributedStore set up from a JSON config: `file` goes through
      MooncakeConfig.from_file and the seven positional arguments (vLLM's way), `dict`
      passes the parsed JSON object to setup() (SGLang's dict form). Prints
      `ready <get_hostname()> <pid>`.

Commands (one per line on stdin; each answered by one line `ok ...` or `error ...`):
  buf SIZE SEED [reg|batchreg|storereg|none]
                              a buffer filled with pattern(SIZE, SEED) (SEED < 0: zeros),
                              registered as asked (default: reg for engine, storereg
                              for store) -> `ok ADDR`
  bufs N SIZE SEED            N such buffers (seeds SEED..SEED+N-1) registered with one
                              batch_register_memory -> `ok ADDR...`
  fill ADDR LEN SEED          write pattern(LEN, SEED) at ADDR -> `ok`
  digest ADDR LEN             -> `ok <sha256 hex of the bytes>`
  call JSON                   {"m": method, "a": [args], "k": {kwargs}}; an argument
                              {"__rc__": {attrs}} becomes a ReplicateConfig with those
                              attributes -> `ok <JSON result>` (bytes become
                              {"sha256": hex, "len": n}; a list of int stays a list)
Stdin EOF ends the peer (exit 0 through os._exit, so teardown can never hang it).
Pattern: pattern(n, seed) = random.Random(seed).getrandbits(8n) as n little-endian bytes.
"""

import ctypes
import hashlib
import json
import os
import random
import sys


def pattern(n, seed):
    if n == 0:
        return b""
    return random.Random(seed).getrandbits(8 * n).to_bytes(n, "little")


def say(line):
    sys.stdout.write(line + "\n")
    sys.stdout.flush()


def log(msg):
    sys.stderr.write("peer[%d]: %s\n" % (os.getpid(), msg))
    sys.stderr.flush()


KEEP = []  # buffers stay alive (and registered) until the process ends


def new_buf(size, seed):
    buf = (ctypes.c_char * size)()
    addr = ctypes.addressof(buf)
    if seed >= 0:
        ctypes.memmove(addr, pattern(size, seed), size)
    KEEP.append(buf)
    return addr


def to_json(v):
    if isinstance(v, (bytes, bytearray, memoryview)):
        b = bytes(v)
        return {"sha256": hashlib.sha256(b).hexdigest(), "len": len(b)}
    if isinstance(v, (list, tuple)):
        return [to_json(x) for x in v]
    if isinstance(v, dict):
        return {str(k): to_json(x) for k, x in v.items()}
    if v is None or isinstance(v, (bool, int, float, str)):
        return v
    # Objects with the buffer protocol (get_buffer) become their bytes.
    try:
        return to_json(memoryview(v).tobytes())
    except TypeError:
        return repr(v)


def from_json(v, rc_class):
    if isinstance(v, dict) and "__rc__" in v:
        cfg = rc_class()
        for k, x in v["__rc__"].items():
            setattr(cfg, k, x)
        return cfg
    if isinstance(v, list):
        return [from_json(x, rc_class) for x in v]
    return v


def main(argv):
    mode = argv[0]
    location = "*"
    rc_class = None
    if mode == "engine":
        from mooncake.engine import TransferEngine

        obj = TransferEngine()
        if len(argv) > 1:
            location = argv[1]
        metadata = os.environ.get("MC_PEER_METADATA", "P2PHANDSHAKE")
        own_host = os.environ.get("MC_PEER_HOST")
        session = None
        if own_host:
            rc = obj.initialize(own_host, metadata, "tcp", "")
        elif metadata == "P2PHANDSHAKE":
            rc = obj.initialize("127.0.0.1", metadata, "tcp", "")
        else:
            # With a metadata server the hostname is the segment name: give it a port.
            import socket

            with socket.socket() as s:
                s.bind(("127.0.0.1", 0))
                port = s.getsockname()[1]
            session = "127.0.0.1:%d" % port
            rc = obj.initialize(session, metadata, "tcp", "")
        if rc != 0:
            say("error initialize returned %r" % (rc,))
            return 1
        import mooncake

        if own_host:
            session = obj.get_session_id()
        session = session or "127.0.0.1:%d" % obj.get_rpc_port()
        say("ready %s %d %s" % (session, os.getpid(), os.path.realpath(mooncake.__file__)))
        default_reg = "reg"
    elif mode == "store":
        from mooncake.store import MooncakeDistributedStore, ReplicateConfig

        rc_class = ReplicateConfig
        with open(argv[1]) as f:
            conf = json.load(f)
        obj = MooncakeDistributedStore()
        if argv[2] == "file":
            from mooncake.mooncake_config import MooncakeConfig

            c = MooncakeConfig.from_file(argv[1])
            rc = obj.setup(
                c.local_hostname,
                c.metadata_server,
                c.global_segment_size,
                c.local_buffer_size,
                c.protocol,
                c.device_name,
                c.master_server_address,
            )
        else:
            rc = obj.setup(conf)
        if rc != 0:
            say("error setup returned %r" % (rc,))
            return 1
        say("ready %s %d" % (obj.get_hostname(), os.getpid()))
        default_reg = "storereg"
    else:
        say("error usage")
        return 2

    for line in sys.stdin:
        words = line.split(None, 1)
        if not words:
            continue
        cmd, rest = words[0], (words[1] if len(words) > 1 else "")
        try:
            if cmd == "buf":
                p = rest.split()
                size, seed = int(p[0]), int(p[1])
                how = p[2] if len(p) > 2 else default_reg
                addr = new_buf(size, seed)
                if how == "reg":
                    rc = obj.register_memory(addr, size, location)
                elif how == "batchreg":
                    rc = obj.batch_register_memory([addr], [size])
                elif how == "storereg":
                    rc = obj.register_buffer(addr, size)
                else:
                    rc = 0
                if rc != 0:
                    say("error registering %d bytes returned %r" % (size, rc))
                    continue
                say("ok %d" % addr)
            elif cmd == "bufs":
                n, size, seed = (int(x) for x in rest.split())
                addrs = [new_buf(size, seed + i) for i in range(n)]
                rc = obj.batch_register_memory(addrs, [size] * n)
                if rc != 0:
                    say("error batch_register_memory returned %r" % (rc,))
                    continue
                say("ok " + " ".join(str(a) for a in addrs))
            elif cmd == "fill":
                addr, n, seed = (int(x) for x in rest.split())
                ctypes.memmove(addr, pattern(n, seed), n)
                say("ok")
            elif cmd == "digest":
                addr, n = (int(x) for x in rest.split())
                say("ok " + hashlib.sha256(ctypes.string_at(addr, n)).hexdigest())
            elif cmd == "call":
                req = json.loads(rest)
                args = from_json(req.get("a", []), rc_class)
                kwargs = {k: from_json(v, rc_class) for k, v in req.get("k", {}).items()}
                res = getattr(obj, req["m"])(*args, **kwargs)
                say("ok " + json.dumps(to_json(res)))
            else:
                say("error unknown command %r" % cmd)
        except Exception as e:  # one line per failure; the parent decides
            say("error %s: %s" % (type(e).__name__, e))
    return 0


if __name__ == "__main__":
    try:
        code = main(sys.argv[1:])
    except Exception as e:
        say("error %s: %s" % (type(e).__name__, e))
        code = 1
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)
