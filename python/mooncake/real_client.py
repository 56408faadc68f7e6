"""``mooncake_client``: a real store client that serves dummy clients.

The process sets up one :class:`~mooncake.store.MooncakeDistributedStore` (it mounts the
global segment and moves the bytes) and serves the stores of other processes that
called ``setup_dummy(mem_pool_size, local_buffer_size, "host:port")``: their calls
arrive as requests on the TCP port ``--host:--port`` and are run on the real store.

Bulk data never crosses the socket. A dummy shares its memory with this process: each
region (its staging buffer, each ``alloc_from_mem_pool`` allocation it registers) is a
sealed memfd handed over with SCM_RIGHTS on a local abstract unix socket, tied to the TCP
session by a random token, mapped here and registered with the real store; requests
carry the dummy's own addresses, which are translated into the mapping after checking
that the whole range lies inside one region of that session. The memfd must be sealed
against shrinking, so a dummy cannot truncate it under a mapping (which would fault
this process). The wire format is in ``_dummy_wire``.

A session ends when its connection closes (or is silent for ``IDLE_TIMEOUT_S``; dummies
ping every second): its regions are unregistered and unmapped. SIGTERM or SIGINT stops
the server, unmounts the segment and exits 0.
"""

import bisect
import ctypes
import fcntl
import ipaddress
import logging
import mmap
import os
import secrets
import signal
import socket
import stat
import sys
import threading

from . import _dummy_wire as W
from .mooncake_config import parse_size

__all__ = ["main", "parse_flags", "RealClientServer", "FlagError"]

logger = logging.getLogger("mooncake")

INVALID_PARAMS = -600
ILLEGAL_CLIENT = -601
INTERNAL_ERROR = -1
NOT_SUPPORTED = -1012

MAX_REQUEST = 16 << 20  # keys and addresses only: data travels through shared memory
MAX_SESSIONS = 256
MAX_REGIONS = 1024  # per session
IDLE_TIMEOUT_S = 30.0
FRAME_TIMEOUT_S = 10.0
REGISTER_TIMEOUT_S = 5.0
MAX_REGISTRATIONS_IN_FLIGHT = 16
_LOGGED_REFUSALS = 5  # per session, so a hostile peer cannot flood the log


# ---------------------------------------------------------------- flags

# name: (kind, default, help). Upstream's mooncake_client flags, same names and defaults.
_FLAGS = {
    "host": ("str", "0.0.0.0", "address to serve dummy clients on; also the segment's host"),
    "metadata_server": ("str", "http://127.0.0.1:8080/metadata", "metadata server"),
    "device_names": ("str", "", "RDMA device names"),
    "master_server_address": ("str", "127.0.0.1:50051", "master address"),
    "protocol": ("str", "tcp", "transfer protocol"),
    "port": ("int", 50052, "port to serve dummy clients on (0: any free port)"),
    "global_segment_size": ("size", "4 GB", "memory lent to the pool"),
    "local_buffer_size": ("size", "0", "this client's own staging buffer"),
    "threads": ("int", 1, "accepted for compatibility (one thread per dummy here)"),
    "tenant_id": ("str", "default", "tenant identifier"),
    "enable_offload": ("bool", False, "keep evicted objects on the disk tier"),
    "start_offload_rpc_server": ("bool", True, "accepted for compatibility"),
    "enable_http_server": ("bool", False, "accepted for compatibility (not served)"),
    "http_port": ("int", 9300, "accepted for compatibility"),
}
_TRUE = ("true", "t", "yes", "y", "1")
_FALSE = ("false", "f", "no", "n", "0")


class FlagError(ValueError):
    pass


def _flag_value(name, kind, text):
    if kind == "bool":
        low = text.lower()
        if low in _TRUE:
            return True
        if low in _FALSE:
            return False
        raise FlagError(f"--{name}: {text!r} is not a boolean")
    if kind == "int":
        try:
            return int(text)
        except ValueError:
            raise FlagError(f"--{name}: {text!r} is not an integer") from None
    if kind == "size":
        try:
            return parse_size(text, f"--{name}")
        except ValueError as e:
            raise FlagError(str(e)) from None
    return text


def parse_flags(argv):
    """gflags-style flags: ``--name=value``, ``--name value``, one or two dashes, bools
    bare, ``=true/false`` or as ``--noname``. Returns {name: value}; FlagError on
    anything else."""
    values = {n: _flag_value(n, k, d) if isinstance(d, str) else d
              for n, (k, d, _) in _FLAGS.items()}
    args = list(argv)
    i = 0
    while i < len(args):
        arg = args[i]
        i += 1
        if arg == "--":
            if i < len(args):
                raise FlagError(f"unexpected argument {args[i]!r}")
            break
        if not arg.startswith("-") or arg == "-":
            raise FlagError(f"unexpected argument {arg!r}")
        name, eq, text = arg.lstrip("-").partition("=")
        if name not in _FLAGS and name.startswith("no") and not eq \
                and _FLAGS.get(name[2:], ("",))[0] == "bool":
            values[name[2:]] = False
            continue
        if name not in _FLAGS:
            raise FlagError(f"unknown command line flag {name!r}")
        kind = _FLAGS[name][0]
        if not eq:
            if kind == "bool":
                values[name] = True
                continue
            if i >= len(args):
                raise FlagError(f"flag --{name} is missing its value")
            text = args[i]
            i += 1
        values[name] = _flag_value(name, kind, text)
    if not 0 <= values["port"] <= 65535:
        raise FlagError(f"--port: {values['port']} is not a port")
    if values["threads"] < 1:
        raise FlagError("--threads: must be at least 1")
    return values


def usage():
    lines = ["usage: mooncake_client [--flag=value ...]",
             "Runs a real Mooncake store client and serves dummy clients (setup_dummy).", ""]
    for name, (kind, default, text) in _FLAGS.items():
        lines.append(f"  --{name} ({kind}, default {default!r}): {text}")
    return "\n".join(lines)


# ---------------------------------------------------------------- addresses


def _split_host(host):
    """(host, port text or "") from "h", "h:p", "[v6]:p" or a bare IPv6."""
    if host.startswith("["):
        bare, _, rest = host[1:].partition("]")
        return bare, rest[1:] if rest.startswith(":") else ""
    if host.count(":") == 1:
        bare, port = host.split(":")
        return bare, port
    return host, ""


def _is_wildcard(host):
    try:
        return ipaddress.ip_address(host).is_unspecified
    except ValueError:
        return False


def advertised_host(host, master_address):
    """The segment's host: ``host`` unless it is a wildcard, then this machine's address
    on the route to the master (peers must be able to reach the segment)."""
    bare, port = _split_host(host)
    if not _is_wildcard(bare):
        return host
    first_master = master_address.split("://", 1)[-1].split(";")[0].strip()
    target = _split_host(first_master)[0] or "127.0.0.1"
    try:
        family = socket.AF_INET6 if ":" in target else socket.AF_INET
        with socket.socket(family, socket.SOCK_DGRAM) as s:
            s.connect((target, 9))  # sends nothing: only picks the route
            ip = s.getsockname()[0]
    except OSError:
        ip = socket.gethostbyname(socket.gethostname())
    if not port:
        return ip
    return f"[{ip}]:{port}" if ":" in ip else f"{ip}:{port}"


# ---------------------------------------------------------------- shared regions


class _Refused(Exception):
    def __init__(self, code):
        super().__init__(code)
        self.code = code


class Region:
    """A dummy's memfd mapped here: its [dummy_base, dummy_base + size) is our
    [server_base, server_base + size)."""

    def __init__(self, dummy_base, size, mm, is_local):
        self.dummy_base = dummy_base
        self.size = size
        self.is_local = is_local
        self._mm = mm
        self._view = ctypes.c_char.from_buffer(mm)
        self.server_base = ctypes.addressof(self._view)

    @property
    def dummy_end(self):
        return self.dummy_base + self.size

    def release(self):
        del self._view  # the mmap cannot close while a ctypes view exports it
        self._mm.close()


class Session:
    """One dummy's connection: its token and the regions it shared."""

    def __init__(self, token, conn):
        self.token = token
        self.conn = conn
        self.lock = threading.Lock()
        self.bases = []  # sorted dummy bases
        self.regions = {}  # dummy base -> Region
        self.closed = False
        self.refusals = 0

    def translate(self, addr, n):
        """Our address for the dummy's [addr, addr + n), or None unless one region holds
        all of it."""
        with self.lock:
            i = bisect.bisect_right(self.bases, addr) - 1
            if i < 0:
                return None
            r = self.regions[self.bases[i]]
            if addr + n > r.dummy_end:
                return None
            return r.server_base + (addr - r.dummy_base)

    def add(self, region, real):
        """Adds and registers ``region`` with the real store; 0 or an error code."""
        with self.lock:
            if self.closed:
                return ILLEGAL_CLIENT
            same = self.regions.get(region.dummy_base)
            if same is not None and same.size == region.size:
                region.release()  # registered again (a retried call): keep the first
                return 0
            i = bisect.bisect_right(self.bases, region.dummy_base)
            before = self.regions[self.bases[i - 1]] if i > 0 else None
            after = self.regions[self.bases[i]] if i < len(self.bases) else None
            if (before and before.dummy_end > region.dummy_base) or \
                    (after and region.dummy_end > after.dummy_base) or \
                    len(self.regions) >= MAX_REGIONS:
                region.release()
                return INVALID_PARAMS
            rc = real.register_buffer(region.server_base, region.size)
            if rc != 0:
                region.release()
                return rc
            self.bases.insert(i, region.dummy_base)
            self.regions[region.dummy_base] = region
            return 0

    def drop(self, dummy_base, real):
        with self.lock:
            region = self.regions.get(dummy_base)
            if region is None or region.is_local:
                return INVALID_PARAMS
            self._forget(region, real)
            return 0

    def _forget(self, region, real):
        del self.regions[region.dummy_base]
        self.bases.remove(region.dummy_base)
        real.unregister_buffer(region.server_base)
        region.release()

    def close(self, real):
        with self.lock:
            self.closed = True
            for region in list(self.regions.values()):
                self._forget(region, real)


def _map_memfd(fd, size):
    """A writable shared mapping of the first ``size`` bytes of a memfd sealed against
    shrinking, or None (after logging) for anything else.

    Touching a mapping past the end of its file, or a huge page the system cannot
    supply, kills this process with SIGBUS: hence the seal, the size check, and plain
    (page-sized) shared memory only."""
    try:
        st = os.fstat(fd)
        seals = fcntl.fcntl(fd, fcntl.F_GET_SEALS)
    except OSError as e:
        logger.warning("mooncake_client: refused a shared region: not a memfd (%s)", e)
        return None
    if not stat.S_ISREG(st.st_mode) or not seals & fcntl.F_SEAL_SHRINK \
            or st.st_size < size or st.st_blksize != mmap.PAGESIZE:
        logger.warning("mooncake_client: refused a shared region: it must be a memfd of at "
                       "least %d bytes, sealed against shrinking, without huge pages", size)
        return None
    try:
        return mmap.mmap(fd, size, flags=mmap.MAP_SHARED,
                         prot=mmap.PROT_READ | mmap.PROT_WRITE)
    except (OSError, ValueError) as e:
        logger.warning("mooncake_client: cannot map a shared region of %d bytes: %s", size, e)
        return None


# ---------------------------------------------------------------- request arguments

_U64_MAX = (1 << 64) - 1


def _need(ok):
    if not ok:
        raise _Refused(INVALID_PARAMS)


def _u64(v):
    _need(isinstance(v, int) and not isinstance(v, bool) and 0 <= v <= _U64_MAX)
    return v


def _bool(v):
    _need(isinstance(v, bool))
    return v


def _str(v):
    _need(isinstance(v, str))
    return v


def _list(v, item):
    _need(isinstance(v, list))
    return [item(x) for x in v]


def _key(v):
    _need(isinstance(v, bytes))
    return v


def _keys(v):
    return _list(v, _key)


def _span(v):
    _need(isinstance(v, list) and len(v) == 2)
    return _u64(v[0]), _u64(v[1])


def _spans(v):
    return _list(v, _span)


def _parts(v):
    return _list(v, _spans)


def _task_id(v):
    _need(isinstance(v, list) and len(v) == 2)
    return _u64(v[0]), _u64(v[1])


def _u64_3d(v):
    return _list(v, lambda row: _list(row, lambda r: _list(r, _u64)))


# Configs by their wire form: a dummy sends the same few again and again, and a config
# kept keeps its C form (store.ReplicateConfig._to_c). Nothing here changes one.
_CONFIGS = {}
_CONFIGS_KEPT = 64


def _config(v):
    """A ReplicateConfig from [replica_num, hard_pin, soft_pin_action, soft_pin_ttl_ms,
    preferred_segment, preferred_segments, prefer_same_node, group_ids] and, from dummies
    of this version on, [data_type, nof_replica_num, dfs_replica_num,
    preferred_nof_segments]; its own setters check every field."""
    _need(isinstance(v, list) and len(v) in (8, 12))
    try:
        key = tuple([tuple(x) if type(x) is list else x for x in v])
        hash(key)
    except TypeError:
        raise _Refused(INVALID_PARAMS) from None
    c = _CONFIGS.get(key)
    if c is None:
        c = _new_config(v)
        if len(_CONFIGS) >= _CONFIGS_KEPT:
            _CONFIGS.clear()
        _CONFIGS[key] = c
    return c


def _new_config(v):
    from .store import ObjectDataType, ReplicateConfig, SoftPinAction

    c = ReplicateConfig()
    try:
        c.replica_num = v[0]
        c.with_hard_pin = v[1]
        c.soft_pin_action = SoftPinAction(v[2])
        c.soft_pin_ttl_ms = v[3]
        c.preferred_segment = v[4]
        c.preferred_segments = v[5]
        c.prefer_alloc_in_same_node = v[6]
        c.group_ids = v[7]
        if len(v) == 12:
            c.data_type = ObjectDataType(v[8])
            c.nof_replica_num = v[9]
            c.dfs_replica_num = v[10]
            c.preferred_nof_segments = v[11]
    except (TypeError, ValueError):
        raise _Refused(INVALID_PARAMS) from None
    return c


def _replica_wire(d):
    """A ReplicaDescriptor as [kind, status, size, pieces, file_path, object_size]."""
    pieces, path, obj_size = [], "", d.size
    if d.is_memory_replica():
        pieces = [[p.size, p.buffer_address, p.protocol, p.transport_endpoint]
                  for p in d.get_memory_descriptor().buffer_descriptors]
    else:
        disk = d.get_disk_descriptor()
        path, obj_size = disk.file_path, disk.object_size
    return [d.kind, d.status.name, d.size, pieces, path, obj_size]


# ---------------------------------------------------------------- operations


class _Ops:
    """The requests a dummy may make: ``TABLE`` maps each name to the checkers of its
    arguments, and the method of that name runs the matching call of the real store,
    on addresses translated into the dummy's shared memory."""

    def __init__(self, real):
        self.real = real

    def _at(self, sess, addr, n):
        got = sess.translate(addr, n)
        if got is None:
            if sess.refusals < _LOGGED_REFUSALS:
                sess.refusals += 1
                logger.warning("mooncake_client: a dummy named [0x%x, +%d), outside the "
                               "memory it shared; call refused", addr, n)
            raise _Refused(INVALID_PARAMS)
        return got

    def _addrs(self, sess, spans):
        return [self._at(sess, a, n) for a, n in spans]

    def ping(self, sess):
        return self.real.health_check()

    def unmap(self, sess, base):
        return sess.drop(base, self.real)

    def exists(self, sess, key):
        return self.real.is_exist(key)

    def batch_exists(self, sess, keys):
        return self.real.batch_is_exist(keys)

    def size(self, sess, key):
        return self.real.get_size(key)

    def sizes(self, sess, keys):
        return [self.real.get_size(k) for k in keys]

    def remove(self, sess, key, force):
        return self.real.remove(key, force)

    def remove_regex(self, sess, pattern, force):
        return self.real.remove_by_regex(pattern, force)

    def remove_all(self, sess, force):
        return self.real.remove_all(force)

    def batch_remove(self, sess, keys, force):
        return self.real.batch_remove(keys, force)

    def replica_desc(self, sess, keys):
        found = self.real.batch_get_replica_desc(keys)
        return [[_replica_wire(d) for d in found[k]] if k in found else None for k in keys]

    def replica_clear(self, sess, keys, segment):
        cleared = set(self.real.batch_replica_clear(keys, segment))
        return [i for i, k in enumerate(keys) if k in cleared]

    def put_from(self, sess, keys, spans, config, upsert):
        addrs = self._addrs(sess, spans)
        sizes = [n for _, n in spans]
        if len(keys) == 1 and not upsert and not config.group_ids:
            # One key: the single put (no arrays to build); the same per-key answer.
            return [self.real.put_from(keys[0], addrs[0], sizes[0], config)]
        put = self.real.batch_upsert_from if upsert else self.real.batch_put_from
        return put(keys, addrs, sizes, config)

    def put_parts(self, sess, keys, parts, config):
        addrs = [self._addrs(sess, p) for p in parts]
        sizes = [[n for _, n in p] for p in parts]
        return self.real.batch_put_from_multi_buffers(keys, addrs, sizes, config)

    def get_into(self, sess, keys, spans):
        addrs = self._addrs(sess, spans)
        return self.real.batch_get_into(keys, addrs, [n for _, n in spans])

    def get_parts(self, sess, keys, parts, prefer_same_node):
        addrs = [self._addrs(sess, p) for p in parts]
        sizes = [[n for _, n in p] for p in parts]
        return self.real.batch_get_into_multi_buffers(keys, addrs, sizes, prefer_same_node)

    def get_ranges(self, sess, bufs, all_keys, dsts, srcs, sizes):
        # The shape is checked in full first: every range must count in the extent that
        # is translated, or one could reach past this session's memory.
        _need(len(bufs) == len(all_keys) == len(dsts) == len(srcs) == len(sizes))
        ours = []
        for b, buf in enumerate(bufs):
            _need(len(all_keys[b]) == len(dsts[b]) == len(srcs[b]) == len(sizes[b]))
            _need(all(len(d) == len(s) == len(z)
                      for d, s, z in zip(dsts[b], srcs[b], sizes[b])))
            ends = [d + z for dk, zk in zip(dsts[b], sizes[b]) for d, z in zip(dk, zk)]
            # A buffer with no ranges is never touched: no address is needed for it.
            ours.append(self._at(sess, buf, max(ends)) if ends else 0)
        return self.real.get_into_ranges(ours, all_keys, dsts, srcs, sizes)

    def copy_task(self, sess, key, targets):
        task, rc = self.real.create_copy_task(key, targets)
        return [list(task), rc]

    def move_task(self, sess, key, source, target):
        task, rc = self.real.create_move_task(key, source, target)
        return [list(task), rc]

    def query_task(self, sess, task_id):
        found, rc = self.real.query_task(task_id)
        return [None if found is None else found._to_wire(), rc]

    TABLE = {
        "ping": (), "unmap": (_u64,),
        "exists": (_key,), "batch_exists": (_keys,), "size": (_key,), "sizes": (_keys,),
        "remove": (_key, _bool), "remove_regex": (_str, _bool), "remove_all": (_bool,),
        "batch_remove": (_keys, _bool), "replica_desc": (_keys,),
        "replica_clear": (_keys, _str),
        "put_from": (_keys, _spans, _config, _bool), "put_parts": (_keys, _parts, _config),
        "get_into": (_keys, _spans), "get_parts": (_keys, _parts, _bool),
        "get_ranges": (lambda v: _list(v, _u64), lambda v: _list(v, _keys),
                       _u64_3d, _u64_3d, _u64_3d),
        "copy_task": (_key, lambda v: _list(v, _str)), "move_task": (_key, _str, _str),
        "query_task": (_task_id,),
    }

    def run(self, sess, msg):
        """(status, result) for one request ``[op, [args...]]``."""
        if not (isinstance(msg, list) and len(msg) == 2 and isinstance(msg[0], str)
                and isinstance(msg[1], list)):
            return INVALID_PARAMS, None
        op, args = msg
        checks = self.TABLE.get(op)
        if checks is None:
            return NOT_SUPPORTED, None
        if len(args) != len(checks):
            return INVALID_PARAMS, None
        try:
            values = [check(a) for check, a in zip(checks, args)]
            return 0, getattr(self, op)(sess, *values)
        except _Refused as e:
            return e.code, None
        except NotImplementedError as e:
            logger.error("mooncake_client: %s: %s", op, e)
            return NOT_SUPPORTED, None
        except (TypeError, ValueError) as e:
            logger.warning("mooncake_client: %s refused: %s", op, e)
            return INVALID_PARAMS, None
        except Exception:
            logger.exception("mooncake_client: %s failed", op)
            return INTERNAL_ERROR, None


# ---------------------------------------------------------------- the server


class RealClientServer:
    """The real store plus the two listeners: TCP (requests) and a local abstract unix
    socket (memfd hand-over)."""

    def __init__(self, flags):
        from .store import MooncakeDistributedStore

        self.flags = flags
        self.real = MooncakeDistributedStore()
        self.ops = _Ops(self.real)
        self.sessions = {}  # token -> Session
        self.lock = threading.Lock()
        self.stopping = threading.Event()
        self.threads = []
        self.tcp = None
        self.unix = None
        self.ipc_name = b""
        self.address = ""
        self._connections = threading.BoundedSemaphore(MAX_SESSIONS)
        self._registrations = threading.BoundedSemaphore(MAX_REGISTRATIONS_IN_FLIGHT)

    # -------------------------------------------------------- start / stop

    def start(self):
        """Binds, sets the store up and starts serving; 0, or a nonzero code after
        logging why."""
        f = self.flags
        bind = _split_host(f["host"])[0]
        try:
            self.tcp = socket.create_server((bind, f["port"]), family=(
                socket.AF_INET6 if ":" in bind else socket.AF_INET), backlog=64)
        except OSError as e:
            logger.error("mooncake_client: cannot listen on %s:%d: %s", bind, f["port"], e)
            return 1
        port = self.tcp.getsockname()[1]
        self.address = f"[{bind}]:{port}" if ":" in bind else f"{bind}:{port}"
        self.ipc_name = f"\0mooncake-dummy-{port}-{os.getpid()}".encode()
        try:
            self.unix = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
            self.unix.bind(self.ipc_name)
            self.unix.listen(64)
        except OSError as e:
            logger.error("mooncake_client: cannot open the local shared-memory socket: %s", e)
            self._close_listeners()
            return 1
        segment_host = advertised_host(f["host"], f["master_server_address"])
        rc = self.real.setup(segment_host, f["metadata_server"], f["global_segment_size"],
                             f["local_buffer_size"], f["protocol"], f["device_names"],
                             f["master_server_address"], enable_ssd_offload=f["enable_offload"],
                             tenant_id=f["tenant_id"])
        if rc != 0:
            logger.error("mooncake_client: store setup failed (%d)", rc)
            self._close_listeners()
            return 1
        self._spawn(self._accept_tcp)
        self._spawn(self._accept_unix)
        return 0

    def stop(self, join_timeout=10.0):
        self.stopping.set()
        self._close_listeners()
        with self.lock:
            conns = [s.conn for s in self.sessions.values()]
        for conn in conns:
            try:
                conn.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass
        with self.lock:
            threads = list(self.threads)
        for t in threads:
            t.join(join_timeout)
        self.real.close()

    def _close_listeners(self):
        for s in (self.tcp, self.unix):
            if s is not None:
                try:
                    s.shutdown(socket.SHUT_RDWR)
                except OSError:
                    pass
                s.close()

    def _spawn(self, fn, *args):
        t = threading.Thread(target=fn, args=args, daemon=True)
        with self.lock:
            self.threads = [x for x in self.threads if x.is_alive()] + [t]
        t.start()

    # -------------------------------------------------------- TCP sessions

    def _admitted(self, listener, slots, on_full=None):
        """Connections accepted on ``listener`` until the client stops (or the listener
        closes), each holding one of ``slots`` (a semaphore); one past them is closed,
        after ``on_full()`` when given."""
        while not self.stopping.is_set():
            try:
                conn, _ = listener.accept()
            except OSError:
                return
            if slots.acquire(blocking=False):
                yield conn
                continue
            if on_full is not None:
                on_full()
            conn.close()

    def _accept_tcp(self):
        def refused():
            logger.warning("mooncake_client: %d dummy connections already; refusing one",
                           MAX_SESSIONS)

        for conn in self._admitted(self.tcp, self._connections, refused):
            conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            self._spawn(self._serve, conn)

    def _hello(self, conn, reader):
        """The session a well-formed hello opens, or None (the peer was told why)."""
        kind, msg = reader.read(MAX_REQUEST, FRAME_TIMEOUT_S, FRAME_TIMEOUT_S)
        if kind != W.REQUEST or not isinstance(msg, list) or len(msg) != 2 \
                or msg[0] != "hello" or msg[1] != [W.VERSION]:
            W.send_frame(conn, W.FAULT, NOT_SUPPORTED)
            return None
        sess = Session(secrets.token_bytes(16), conn)
        with self.lock:
            self.sessions[sess.token] = sess
        W.send_frame(conn, W.REPLY, [0, [W.VERSION, sess.token, self.ipc_name,
                                         self.real.health_check()]])
        return sess

    def _serve(self, conn):
        sess = None
        reader = W.FrameReader(conn)
        try:
            sess = self._hello(conn, reader)
            while sess is not None and not self.stopping.is_set():
                try:
                    kind, msg = reader.read(MAX_REQUEST, IDLE_TIMEOUT_S, FRAME_TIMEOUT_S)
                except W.BodyError as e:
                    logger.warning("mooncake_client: malformed request refused: %s", e)
                    W.send_frame(conn, W.REPLY, [INVALID_PARAMS, None])
                    continue
                if kind != W.REQUEST:
                    W.send_frame(conn, W.FAULT, INVALID_PARAMS)
                    break
                W.send_frame(conn, W.REPLY, list(self.ops.run(sess, msg)))
        except W.Closed:
            logger.info("mooncake_client: a dummy client disconnected")
        except W.FrameError as e:
            logger.warning("mooncake_client: dropping a dummy connection: %s", e)
            try:
                W.send_frame(conn, W.FAULT, INVALID_PARAMS)
            except OSError:
                pass
        except (W.BodyError, OSError) as e:
            logger.info("mooncake_client: dummy connection ended: %s", e)
        finally:
            if sess is not None:
                with self.lock:
                    self.sessions.pop(sess.token, None)
                sess.close(self.real)
            conn.close()
            self._connections.release()

    # -------------------------------------------------------- memfd hand-over

    def _accept_unix(self):
        for conn in self._admitted(self.unix, self._registrations):
            self._spawn(self._register, conn)

    def _register(self, conn):
        fds = []
        try:
            conn.settimeout(REGISTER_TIMEOUT_S)
            msg, fds, flags, _ = socket.recv_fds(conn, 4096, 1)
            status = INVALID_PARAMS
            if not flags & (socket.MSG_TRUNC | socket.MSG_CTRUNC) and len(fds) == 1 \
                    and len(msg) >= W.HEADER.size:
                try:
                    kind, length = W.parse_header(msg[:W.HEADER.size], 4096)
                    body = W.decode(msg[W.HEADER.size:])
                    if kind == W.REGISTER and length == len(msg) - W.HEADER.size:
                        status = self._map(body, fds[0])
                except (W.FrameError, W.BodyError):
                    pass
            W.send_frame(conn, W.REPLY, [status, None])
        except OSError as e:
            logger.info("mooncake_client: a shared-memory registration failed: %s", e)
        finally:
            for fd in fds:
                os.close(fd)
            conn.close()
            self._registrations.release()

    def _map(self, body, fd):
        """Maps one REGISTER ``[token, dummy_base, size, is_local]``; 0 or a code."""
        try:
            token = body[0] if isinstance(body, list) and len(body) == 4 else None
            _need(isinstance(token, bytes))
            base, size, is_local = _u64(body[1]), _u64(body[2]), _bool(body[3])
        except _Refused as e:
            return e.code
        if size == 0 or base + size > _U64_MAX + 1:
            return INVALID_PARAMS
        with self.lock:
            sess = self.sessions.get(token)
        if sess is None:
            return ILLEGAL_CLIENT
        mm = _map_memfd(fd, size)
        if mm is None:
            return INVALID_PARAMS
        return sess.add(Region(base, size, mm, is_local), self.real)


# ---------------------------------------------------------------- main


def main(argv=None):
    """``mooncake_client [--flag=value ...]`` (upstream's flags)."""
    args = sys.argv[1:] if argv is None else list(argv)
    if any(a in ("-h", "--help", "-help", "--helpfull") for a in args):
        print(usage())
        sys.exit(0)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(message)s")
    try:
        flags = parse_flags(args)
    except FlagError as e:
        print(f"mooncake_client: {e}\n{usage()}", file=sys.stderr)
        sys.exit(2)
    server = RealClientServer(flags)
    stop = threading.Event()
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda *_: stop.set())
    if server.start() != 0:
        sys.exit(1)
    print(f"ready dummy={server.address} segment={server.real.get_hostname()}", flush=True)
    while not stop.wait(0.5):
        pass
    logger.info("mooncake_client: stopping")
    server.stop()
    sys.exit(0)


if __name__ == "__main__":
    main()
