"""``setup_dummy``: a store whose calls run in a ``mooncake_client`` process (private).

``attach`` turns a :class:`~mooncake.store.MooncakeDistributedStore` into a
:class:`DummyStore` (its class is swapped, so ``isinstance`` still holds and ``close``
swaps it back). A dummy mounts nothing and moves no bytes itself: each call becomes one
request to the real client (the wire format is in ``_dummy_wire``), which runs it on its
own store.

Bytes travel through memory shared with the real client, never through the socket:

* the staging buffer (``local_buffer_size``): copying calls (put, get, their batch and
  parts forms) copy the value into it and the real client reads or writes it there;
  values larger than it fail with NO_AVAILABLE_HANDLE (puts) or miss (gets);
* ``alloc_from_mem_pool(size)`` memory: once given to ``register_buffer`` (whole, as
  upstream requires) the zero-copy calls read and write it in place. Other addresses
  fail with INVALID_PARAMS without being sent. ``mem_pool_size`` bounds nothing, as
  upstream.

Each piece of shared memory is a memfd sealed against resizing, handed to the real
client over its local unix socket (so a dummy must run on the real client's host to
share memory). Calls are serialized on one connection. A heartbeat pings every second;
when the real client is gone every call fails at once with RPC_FAIL (-900) and the
heartbeat reconnects, sharing the memory again, as soon as a real client answers on the
same address.
"""

import contextlib
import ctypes
import fcntl
import logging
import mmap
import os
import socket
import threading

from . import _dummy_wire as W
from . import _forked
from ._native import MC_ERR_UNAVAILABLE_IN_CURRENT_STATUS as UNAVAILABLE
from ._common import buffer_address, check_int, check_str, int_list, lengths_match
from ._replicate import _DEFAULT_CONFIG, _refusal
from .mooncake_config import parse_size
from .store import (
    INVALID_KEY,
    INVALID_PARAMS,
    NO_AVAILABLE_HANDLE,
    BufferHandle,
    MooncakeDistributedStore,
    ReplicaDescriptor,
    _bool,
    _config,
    _encode_key,
    _key_list,
    _keys,
    _metadata_put_args,
    _strs,
    _triage,
)
from ._store_surface import QueryTaskResponse, task_id_pair

logger = logging.getLogger("mooncake")

RPC_FAIL = -900
BUFFER_OVERFLOW = -10
PING_INTERVAL_S = 1.0
PING_TIMEOUT_S = 5.0
CONNECT_TIMEOUT_S = 3.0
CALL_TIMEOUT_S = 120.0  # one store call on the real client, transfers included
REGISTER_TIMEOUT_S = 5.0
MAX_REPLY = 256 << 20
_ALIGN = 64  # staging slots start on cache lines


# ---------------------------------------------------------------- shared memory


class Segment:
    """Memory of this process the real client may map: a memfd sealed against resizing
    (so the real client can trust its size), mapped here at ``base``."""

    def __init__(self, size, is_local=False):
        fd = os.memfd_create("mooncake-dummy", os.MFD_CLOEXEC | os.MFD_ALLOW_SEALING)
        try:
            os.ftruncate(fd, size)
            fcntl.fcntl(fd, fcntl.F_ADD_SEALS,
                        fcntl.F_SEAL_SHRINK | fcntl.F_SEAL_GROW | fcntl.F_SEAL_SEAL)
            self._mm = mmap.mmap(fd, size, flags=mmap.MAP_SHARED,
                                 prot=mmap.PROT_READ | mmap.PROT_WRITE)
        except BaseException:
            os.close(fd)
            raise
        self.fd = fd
        self.size = size
        self.is_local = is_local
        self.registered = is_local  # pool memory is shared once register_buffer asks
        self._view = ctypes.c_char.from_buffer(self._mm)
        self.base = ctypes.addressof(self._view)

    def close(self):
        del self._view  # the mmap cannot close while a ctypes view exports it
        self._mm.close()
        os.close(self.fd)


class _Conn:
    """One TCP session with the real client: its socket, token and local socket name."""

    def __init__(self, sock, reader, token, ipc_name, health):
        self.sock = sock
        self.reader = reader
        self.token = token
        self.ipc_name = ipc_name
        self.health = health


def _open(address):
    """Connects and says hello; a _Conn, or OSError / wire errors."""
    sock = socket.create_connection(address, timeout=CONNECT_TIMEOUT_S)
    try:
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        W.send_frame(sock, W.REQUEST, ["hello", [W.VERSION]])
        reader = W.FrameReader(sock)
        kind, msg = reader.read(MAX_REPLY, CONNECT_TIMEOUT_S, CONNECT_TIMEOUT_S)
        if kind == W.FAULT:
            raise ConnectionError(f"the real client refused the session ({msg})")
        ok = kind == W.REPLY and isinstance(msg, list) and len(msg) == 2 and msg[0] == 0
        info = msg[1] if ok else None
        if not (isinstance(info, list) and len(info) == 4 and info[0] == W.VERSION
                and isinstance(info[1], bytes) and isinstance(info[2], bytes)
                and info[2].startswith(b"\0") and len(info[2]) <= 107
                and isinstance(info[3], int)):
            raise ConnectionError("not a mooncake_client answer")
        return _Conn(sock, reader, info[1], info[2], info[3])
    except BaseException:
        sock.close()
        raise


def _share(conn, seg):
    """Hands ``seg`` to the real client of ``conn``; 0 or a negative code."""
    try:
        with socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET) as u:
            u.settimeout(REGISTER_TIMEOUT_S)
            u.connect(conn.ipc_name)
            msg = W.frame(W.REGISTER, [conn.token, seg.base, seg.size, seg.is_local])
            socket.send_fds(u, [msg], [seg.fd])
            reply = u.recv(4096)
        kind, length = W.parse_header(reply[:W.HEADER.size], 4096)
        value = W.decode(reply[W.HEADER.size:])
        if kind != W.REPLY or not isinstance(value, list) or not value \
                or not isinstance(value[0], int):
            raise W.BodyError("malformed answer")
    except (OSError, W.FrameError, W.BodyError) as e:
        logger.error("mooncake: cannot share memory with the real client (a dummy must run "
                     "on the real client's host): %s", e)
        return RPC_FAIL
    if value[0] != 0:
        logger.error("mooncake: the real client refused %d bytes of shared memory (%d)",
                     seg.size, value[0])
    return value[0]


class Link:
    """The dummy's connection to its real client and the memory shared over it.

    Calls go one at a time (the staging buffer is used whole by each). While connected,
    a heartbeat pings every second when no call is running; once the real client is
    lost, calls fail at once with RPC_FAIL and the heartbeat reconnects, sharing every
    registered segment again."""

    def __init__(self, address):
        self.address = address
        self.local = None  # the staging Segment
        self.pool = {}  # base -> Segment from alloc_from_mem_pool
        self.healthy = False
        self._conn = None
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._thread = None
        self._forked_from = None  # the parent's pid, in a forked child
        _forked.track(self)

    def _after_fork_in_child(self):
        """The session and the segments shared over it are the parent's: the child's
        copy of the socket is closed without a shutdown, calls are refused from now on
        (the real client maps these segments for the parent), and nothing reconnects."""
        self._forked_from = os.getppid()
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._stop.set()
        self._thread = None
        conn, self._conn = self._conn, None
        self.healthy = False
        if conn is not None:
            conn.sock.close()
        # The staging buffer is the parent's memory too (a shared mapping): the child's
        # copy goes, so no staged copy here can write into a parent's put or get. The
        # pool's allocations stay mapped: they are the caller's memory.
        local, self.local = self.local, None
        if local is not None:
            local.close()

    def refusal_code(self):
        """UNAVAILABLE_IN_CURRENT_STATUS in a forked child, logged; else None."""
        if self._forked_from is None:
            return None
        logger.error("mooncake: %s", _forked.refusal("dummy client", self._forked_from))
        return UNAVAILABLE

    def _refused(self):
        """(UNAVAILABLE_IN_CURRENT_STATUS, None) in a forked child; else None."""
        code = self.refusal_code()
        return None if code is None else (code, None)

    def open(self, local_buffer_size):
        """Connects and shares a staging buffer of ``local_buffer_size``; 0 or a code.
        The heartbeat starts only when this succeeded."""
        try:
            self._conn = _open(self.address)
        except (OSError, W.FrameError, W.BodyError) as e:
            logger.error("mooncake: setup_dummy: no real client at %s:%d: %s",
                         *self.address, e)
            return RPC_FAIL
        self.healthy = self._conn.health == 0
        if local_buffer_size:
            try:
                self.local = Segment(local_buffer_size, is_local=True)
            except (OSError, ValueError, OverflowError) as e:
                logger.error("mooncake: setup_dummy: cannot allocate a %d-byte staging "
                             "buffer: %s", local_buffer_size, e)
                return NO_AVAILABLE_HANDLE
            rc = _share(self._conn, self.local)
            if rc != 0:
                return rc
        self._thread = threading.Thread(target=self._heartbeat, daemon=True,
                                         name="mooncake-dummy-heartbeat")
        self._thread.start()
        return 0

    def close(self):
        self._stop.set()
        if self._thread is not None and self._thread is not threading.current_thread():
            self._thread.join(CONNECT_TIMEOUT_S + REGISTER_TIMEOUT_S + PING_TIMEOUT_S)
        with self._lock:
            conn, self._conn = self._conn, None
            if conn is not None:
                conn.sock.close()
            for seg in [self.local] + list(self.pool.values()):
                if seg is not None:
                    seg.close()
            self.local, self.pool = None, {}

    @property
    def connected(self):
        return self._conn is not None

    # -------------------------------------------------------- calls

    @contextlib.contextmanager
    def exclusive(self):
        """Holds the connection (and the staging buffer); yields call(op, args)."""
        with self._lock:
            yield self._call_locked

    def call(self, op, args):
        """(status, result) of one request; (RPC_FAIL, None) when not connected."""
        refused = self._refused()
        if refused is not None:
            return refused
        if self._conn is None:
            return RPC_FAIL, None
        with self._lock:
            return self._call_locked(op, args)

    def _call_locked(self, op, args, timeout=CALL_TIMEOUT_S):
        refused = self._refused()
        if refused is not None:
            return refused
        conn = self._conn
        if conn is None:
            return RPC_FAIL, None
        try:
            W.send_frame(conn.sock, W.REQUEST, [op, args])
            kind, msg = conn.reader.read(MAX_REPLY, timeout, timeout)
            if kind != W.REPLY or not isinstance(msg, list) or len(msg) != 2 \
                    or not isinstance(msg[0], int):
                raise W.FrameError(f"unexpected answer (kind {kind})")
            if conn.reader.pending():
                # One reply per request: anything more means the stream is out of step.
                raise W.FrameError("bytes nobody asked for after a reply")
            return msg[0], msg[1]
        except (OSError, W.FrameError, W.BodyError) as e:
            self._lost(conn, e)
            return RPC_FAIL, None

    def _lost(self, conn, why):
        if self._conn is conn:
            self._conn = None
            self.healthy = False
            conn.sock.close()
            logger.error("mooncake: lost the real client at %s:%d (%s); calls fail with "
                         "RPC_FAIL (-900) until it is back", *self.address, why)

    def share(self, seg):
        """Shares a pool segment with the current real client; 0 or a code."""
        refused = self.refusal_code()
        if refused is not None:
            return refused
        conn = self._conn
        return _share(conn, seg) if conn is not None else RPC_FAIL

    # -------------------------------------------------------- heartbeat

    def _heartbeat(self):
        while not self._stop.wait(PING_INTERVAL_S):
            if self._conn is None:
                self._reconnect()
            elif self._lock.acquire(blocking=False):  # a running call proves the link
                try:
                    status, result = self._call_locked("ping", [], PING_TIMEOUT_S)
                    self.healthy = status == 0 and result == 0
                finally:
                    self._lock.release()

    def _reconnect(self):
        try:
            conn = _open(self.address)
        except (OSError, W.FrameError, W.BodyError):
            return  # not back yet
        shared = [s for s in [self.local] + list(self.pool.values())
                  if s is not None and s.registered]
        if any(_share(conn, seg) != 0 for seg in shared):
            conn.sock.close()
            return
        with self._lock:
            if self._stop.is_set():
                conn.sock.close()
                return
            self._conn = conn
            self.healthy = conn.health == 0
        logger.info("mooncake: reconnected to the real client at %s:%d", *self.address)


# ---------------------------------------------------------------- helpers


def _parse_address(server_address):
    check_str(server_address, "server_address")
    host, sep, port = server_address.strip().rpartition(":")
    host = host[1:-1] if host.startswith("[") and host.endswith("]") else host
    if not sep or not host or not port.isdigit() or not 0 < int(port) < 65536:
        raise ValueError(f"server_address: expected 'host:port', got {server_address!r}")
    return host, int(port)


def _ints(status, result, n):
    """n per-key results from a reply (the refusal code for each key of a refused call)."""
    if status != 0:
        return [status] * n
    if isinstance(result, list) and len(result) == n and \
            all(isinstance(x, int) and not isinstance(x, bool) for x in result):
        return result
    return [RPC_FAIL] * n


def _int(status, result):
    return _ints(status, [result], 1)[0]


def _config_wire(c):
    if c is _DEFAULT_CONFIG:  # a put given no config: never changed, sent as built once
        return _DEFAULT_WIRE
    return _fields_wire(c)


def _fields_wire(c):
    fields = [c.replica_num, c.with_hard_pin, int(c.soft_pin_action), c.soft_pin_ttl_ms,
              c.preferred_segment, list(c.preferred_segments), c.prefer_alloc_in_same_node,
              None if c.group_ids is None else list(c.group_ids)]
    extra = [int(c.data_type), c.nof_replica_num, c.dfs_replica_num,
             list(c.preferred_nof_segments)]
    # The four fields real clients before them do not take: sent only when set, so a
    # dummy of this version still works with an older mooncake_client.
    return fields + extra if extra != _UNSET_EXTRA else fields


_UNSET_EXTRA = [0, 0, 0, []]


_DEFAULT_WIRE = _fields_wire(_DEFAULT_CONFIG)


def _replicas(wire):
    """ReplicaDescriptors from the real client's [kind, status, size, pieces, path,
    object_size] lists (None for malformed data)."""
    try:
        out = []
        for kind, status, size, pieces, path, obj_size in wire:
            obj = {"kind": kind, "status": status, "file_path": path, "object_size": obj_size,
                   "pieces": [{"len": n, "addr": a, "protocol": p, "segment": s}
                              for n, a, p, s in pieces]}
            out.append(ReplicaDescriptor(obj, size))
        return out
    except (TypeError, ValueError):
        return None


def _rounds(items, capacity):
    """Packs (index, size) items into rounds of (index, size, offset) that fit in
    ``capacity`` bytes, in order."""
    batch, off = [], 0
    for i, n in items:
        if batch and off + n > capacity:
            yield batch
            batch, off = [], 0
        batch.append((i, n, off))
        off = (off + n + _ALIGN - 1) // _ALIGN * _ALIGN
    if batch:
        yield batch


def _nonzero(results):
    return next((r for r in results if r != 0), 0)


# ---------------------------------------------------------------- the dummy store


class _Remote:
    """A dummy's ``_store``: set up (the base class's checks pass), yet no native handle;
    a native call handed it raises ctypes.ArgumentError instead of touching memory."""

    def __repr__(self):
        return "<store served by a mooncake_client>"


_REMOTE = _Remote()


def attach(store, mem_pool_size, local_buffer_size, server_address):
    """``store.setup_dummy(...)``: 0, or a negative code (the store is then not set up)."""
    parse_size(mem_pool_size, "mem_pool_size")  # checked; upstream sizes nothing by it
    lbs = parse_size(local_buffer_size, "local_buffer_size")
    address = _parse_address(server_address)
    store.close()
    link = Link(address)
    rc = link.open(lbs)
    if rc != 0:
        link.close()
        return rc
    store._link = link
    store._store = _REMOTE
    store._local_buffer_size = lbs
    store.__class__ = DummyStore
    return 0


class DummyStore(MooncakeDistributedStore):
    """A MooncakeDistributedStore after ``setup_dummy``: the same methods, run by the real
    client. Argument checks and per-key results are those of the real store. Methods
    the base class builds on these (the tensor methods) work unchanged."""

    # ------------------------------------------------------------ lifecycle

    def setup(self, *args, **kwargs):
        self.close()  # back to a plain store, which then sets itself up
        return self.setup(*args, **kwargs)

    def close(self):
        self._store = None
        link, self._link = self._link, None
        if link is not None:
            link.close()
        self._registered.clear()
        self.__class__ = MooncakeDistributedStore
        return 0

    def health_check(self):
        return 0 if self._link.connected and self._link.healthy else 2

    def get_hostname(self):
        return ""  # a dummy has no segment of its own (upstream)

    def alloc_from_mem_pool(self, size):
        """Shared memory for zero-copy calls (pass it whole to register_buffer); its
        address, or 0."""
        n = check_int(size, "size")
        if n == 0:
            return 0
        try:
            seg = Segment(n)
        except (OSError, ValueError, OverflowError) as e:
            logger.error("mooncake: alloc_from_mem_pool(%d): %s", n, e)
            return 0
        self._link.pool[seg.base] = seg
        return seg.base

    # ------------------------------------------------------------ staged copies

    def _staged_put(self, ks, values, config, upsert):
        """Puts key i from the (addr, len) pieces values[i], copied into the staging
        buffer; per-key results."""
        results, idx = _triage(ks, values)
        refused = self._link.refusal_code()
        if refused is not None:
            chosen = set(idx)
            return [refused if i in chosen else r for i, r in enumerate(results)]
        local = self._link.local
        cap = local.size if local is not None else -1
        fits = []
        for i in idx:
            n = sum(p[1] for p in values[i])
            if n > cap:
                logger.error("mooncake: a put of %d bytes exceeds the dummy's "
                             "local_buffer_size (%d)", n, max(cap, 0))
                results[i] = NO_AVAILABLE_HANDLE
            else:
                fits.append((i, n))
        cfg = _config_wire(config)
        with self._link.exclusive() as call:
            for batch in _rounds(fits, cap):
                spans = []
                for i, n, off in batch:
                    at = local.base + off
                    for addr, m in values[i]:
                        ctypes.memmove(at, addr, m)
                        at += m
                    spans.append([local.base + off, n])
                got = _ints(*call("put_from", [[ks[i] for i, _, _ in batch], spans, cfg,
                                               upsert]), len(batch))
                for (i, _, _), r in zip(batch, got):
                    results[i] = r
        return results

    def _put_parts(self, keys, parts, config, upsert, what):
        """The base class's write of encoded keys from (addr, len) pieces in any memory
        (the tensor methods use it): staged like every copying put."""
        return self._staged_put(keys, parts, config, upsert)

    def _put_one(self, key, pieces, names, config, upsert):
        k = _encode_key(key)
        config = _config(config)
        keep = [buffer_address(p, name) for p, name in zip(pieces, names)]
        if k is None:
            return INVALID_KEY
        return self._staged_put([k], [[(a, n) for a, n, _ in keep]], config, upsert)[0]

    def put(self, key, value, config=None):
        return self._put_one(key, [value], ["value"], config, False)

    def upsert(self, key, value, config=None):
        return self._put_one(key, [value], ["value"], config, True)

    def put_parts(self, key, *parts, config=None):
        names = [f"parts[{j}]" for j in range(len(parts))]
        return self._put_one(key, parts, names, config, False)

    def upsert_parts(self, key, *parts, config=None):
        names = [f"parts[{j}]" for j in range(len(parts))]
        return self._put_one(key, parts, names, config, True)

    def _put_many(self, keys, values, config, upsert):
        ks = _keys(keys)
        if isinstance(values, (str, bytes)):
            raise TypeError("values: expected a list of bytes-like objects")
        vals = list(values)
        if not lengths_match("put_batch", keys=ks, values=vals):
            return INVALID_PARAMS
        config = _config(config)
        keep = [buffer_address(v, f"values[{i}]") for i, v in enumerate(vals)]
        if not ks:
            return 0
        return _nonzero(self._staged_put(ks, [[(a, n)] for a, n, _ in keep], config, upsert))

    def put_batch(self, keys, values, config=None):
        return self._put_many(keys, values, config, False)

    def upsert_batch(self, keys, values, config=None):
        return self._put_many(keys, values, config, True)

    def _read_one(self, call, k):
        """The value of one key through the staging buffer (lock held), or None."""
        local = self._link.local
        if local is None:
            return None
        n = _ints(*call("get_into", [[k], [[local.base, local.size]]]), 1)[0]
        if n == BUFFER_OVERFLOW:
            logger.error("mooncake: a value is larger than the dummy's local_buffer_size "
                         "(%d); read as a miss", local.size)
        return ctypes.string_at(local.base, n) if n >= 0 else None

    def _read_many(self, ks):
        """Values (bytes, or None for a miss) of encoded keys (None = invalid)."""
        out = [None] * len(ks)
        idx = [i for i, k in enumerate(ks) if k is not None]
        local = self._link.local
        if not idx or local is None:
            return out
        with self._link.exclusive() as call:
            if len(idx) == 1:
                out[idx[0]] = self._read_one(call, ks[idx[0]])
                return out
            sizes = _ints(*call("sizes", [[ks[i] for i in idx]]), len(idx))
            if any(n > local.size for n in sizes):
                logger.error("mooncake: values larger than the dummy's local_buffer_size "
                             "(%d) are read as misses", local.size)
            fits = [(i, n) for i, n in zip(idx, sizes) if 0 <= n <= local.size]
            again = []
            for batch in _rounds(fits, local.size):
                spans = [[local.base + off, n] for _, n, off in batch]
                got = _ints(*call("get_into", [[ks[i] for i, _, _ in batch], spans]),
                            len(batch))
                for (i, _, off), r in zip(batch, got):
                    if r >= 0:
                        out[i] = ctypes.string_at(local.base + off, r)
                    elif r == BUFFER_OVERFLOW:
                        again.append(i)  # replaced by a larger value meanwhile
            for i in again:
                out[i] = self._read_one(call, ks[i])
        return out

    @staticmethod
    def _handle(data):
        if data is None:
            return None
        return BufferHandle(data)

    def get(self, key):
        k = _encode_key(key)
        return self._read_many([k])[0] or b""

    def get_buffer(self, key):
        return self._handle(self._read_many([_encode_key(key)])[0])

    def get_batch(self, keys):
        return [v or b"" for v in self._read_many(_keys(keys))]

    def batch_get_buffer(self, keys):
        return [self._handle(v) for v in self._read_many(_keys(keys))]

    # ------------------------------------------------------------ query / remove

    def _keyed(self, op, ks, items, args):
        """Per-key results of ``op`` for the keys (and items) that passed their checks;
        ``args(idx)`` builds the request's arguments."""
        results, idx = _triage(ks, items)
        if idx:
            for j, r in enumerate(_ints(*self._link.call(op, args(idx)), len(idx))):
                results[idx[j]] = r
        return results

    def _single(self, op, key, *rest):
        k = _encode_key(key)
        if k is None:
            return INVALID_KEY
        return _int(*self._link.call(op, [k, *rest]))

    def is_exist(self, key):
        return self._single("exists", key)

    def batch_is_exist(self, keys):
        ks = _keys(keys)
        return self._keyed("batch_exists", ks, ks, lambda idx: [[ks[i] for i in idx]])

    def get_size(self, key):
        return self._single("size", key)

    def remove(self, key, force=False):
        return self._single("remove", key, _bool(force, "force"))

    def remove_by_regex(self, regex_pattern, force=False):
        args = [check_str(regex_pattern, "regex_pattern"), _bool(force, "force")]
        return _int(*self._link.call("remove_regex", args))

    def remove_all(self, force=False):
        return _int(*self._link.call("remove_all", [_bool(force, "force")]))

    def batch_remove(self, keys, force=False):
        ks = _keys(keys)
        _bool(force, "force")
        return self._keyed("batch_remove", ks, ks, lambda idx: [[ks[i] for i in idx], force])

    def _descriptors(self, ks):
        """{index: [ReplicaDescriptor]} for the encoded keys found."""
        idx = [i for i, k in enumerate(ks) if k is not None]
        if not idx:
            return {}
        status, result = self._link.call("replica_desc", [[ks[i] for i in idx]])
        if status != 0 or not isinstance(result, list) or len(result) != len(idx):
            return {}
        found = {}
        for i, wire in zip(idx, result):
            descs = _replicas(wire) if wire is not None else None
            if descs is not None:
                found[i] = descs
        return found

    def get_replica_desc(self, key):
        return self._descriptors([_encode_key(key)]).get(0, [])

    def batch_get_replica_desc(self, keys):
        keys = _key_list(keys)
        return {keys[i]: d for i, d in self._descriptors(_keys(keys)).items()}

    def batch_replica_clear(self, keys, segment_name=""):
        keys = _key_list(keys)
        ks = _keys(keys)
        check_str(segment_name, "segment_name")
        idx = [i for i, k in enumerate(ks) if k is not None]
        if not idx:
            return []
        status, result = self._link.call("replica_clear", [[ks[i] for i in idx], segment_name])
        if status != 0 or not isinstance(result, list):
            return []
        return [keys[idx[j]] for j in result if isinstance(j, int) and 0 <= j < len(idx)]

    # ------------------------------------------------------------ zero-copy

    def register_buffer(self, buffer_ptr, size):
        """Shares memory from alloc_from_mem_pool (the whole allocation, as upstream)
        with the real client; 0, -1 for other memory, or a negative code."""
        addr = check_int(buffer_ptr, "buffer_ptr")
        n = check_int(size, "size")
        refused = self._link.refusal_code()
        if refused is not None:
            return refused
        seg = self._link.pool.get(addr)
        if seg is None or seg.size != n:
            logger.error("mooncake: a dummy registers only whole alloc_from_mem_pool "
                         "allocations; [0x%x, +%d) is not one", addr, n)
            return -1
        if seg.registered:
            return 0
        rc = self._link.share(seg)
        if rc == 0:
            seg.registered = True
            self._registered.add(addr, n)
        return rc

    def unregister_buffer(self, buffer_ptr):
        addr = check_int(buffer_ptr, "buffer_ptr")
        seg = self._link.pool.get(addr)
        if seg is None or not seg.registered:
            logger.error("mooncake: 0x%x is not a registered alloc_from_mem_pool buffer", addr)
            return -1
        rc = _int(*self._link.call("unmap", [addr]))
        if rc == 0:
            seg.registered = False
            self._registered.remove(addr)
        return rc

    def _put_spans(self, ks, spans, config, upsert):
        cfg = _config_wire(config)
        return self._keyed("put_from", ks, spans, lambda idx: [
            [ks[i] for i in idx], [list(spans[i]) for i in idx], cfg, upsert])

    def _put_from_one(self, key, buffer_ptr, size, config, upsert):
        k = _encode_key(key)
        spans = self._checked_spans([check_int(buffer_ptr, "buffer_ptr")],
                                    [check_int(size, "size")])
        return self._put_spans([k], spans, _config(config), upsert)[0]

    def put_from(self, key, buffer_ptr, size, config=None):
        return self._put_from_one(key, buffer_ptr, size, config, False)

    def upsert_from(self, key, buffer_ptr, size, config=None):
        return self._put_from_one(key, buffer_ptr, size, config, True)

    def _put_from_many(self, keys, buffer_ptrs, sizes, config, upsert):
        ks = _keys(keys)
        addrs = int_list(buffer_ptrs, "buffer_ptrs")
        lens = int_list(sizes, "sizes")
        if not lengths_match("batch_put_from", keys=ks, buffer_ptrs=addrs, sizes=lens):
            return [INVALID_PARAMS] * len(ks)
        config = _config(config)
        return self._put_spans(ks, self._checked_spans(addrs, lens), config, upsert)

    def batch_put_from(self, keys, buffer_ptrs, sizes, config=None):
        return self._put_from_many(keys, buffer_ptrs, sizes, config, False)

    def batch_upsert_from(self, keys, buffer_ptrs, sizes, config=None):
        return self._put_from_many(keys, buffer_ptrs, sizes, config, True)

    def _put_parts_wire(self, ks, parts, config):
        cfg = _config_wire(config)
        return self._keyed("put_parts", ks, parts, lambda idx: [
            [ks[i] for i in idx], [[list(s) for s in parts[i]] for i in idx], cfg])

    def put_from_with_metadata(self, key, buffer_ptr, metadata_buffer_ptr, size,
                               metadata_size, config=None):
        k, addrs, lens, config = _metadata_put_args(key, buffer_ptr, metadata_buffer_ptr,
                                                    size, metadata_size, config)
        # The real client runs this as a multi-buffer put, which takes
        # prefer_alloc_in_same_node; upstream's put_from_with_metadata refuses it.
        refusal = _refusal(config)
        if refusal:
            return refusal
        return self._put_parts_wire([k], [self._registered_run(addrs, lens)], config)[0]

    def batch_put_from_multi_buffers(self, keys, all_buffer_ptrs, all_sizes, config=None):
        ks = _keys(keys)
        nested = self._nested(all_buffer_ptrs, all_sizes, len(ks))
        if nested is None:
            return [INVALID_PARAMS] * len(ks)
        ptrs, sizes = nested
        config = _config(config)
        parts = [self._registered_run(p, s) for p, s in zip(ptrs, sizes)]
        return self._put_parts_wire(ks, parts, config)

    def _get_spans(self, ks, spans):
        return self._keyed("get_into", ks, spans, lambda idx: [
            [ks[i] for i in idx], [list(spans[i]) for i in idx]])

    def get_into(self, key, buffer_ptr, size):
        k = _encode_key(key)
        spans = self._checked_spans([check_int(buffer_ptr, "buffer_ptr")],
                                    [check_int(size, "size")])
        return self._get_spans([k], spans)[0]

    def batch_get_into(self, keys, buffer_ptrs, sizes):
        ks = _keys(keys)
        addrs = int_list(buffer_ptrs, "buffer_ptrs")
        lens = int_list(sizes, "sizes")
        if not lengths_match("batch_get_into", keys=ks, buffer_ptrs=addrs, sizes=lens):
            return [INVALID_PARAMS] * len(ks)
        return self._get_spans(ks, self._checked_spans(addrs, lens))

    def batch_get_into_multi_buffers(self, keys, all_buffer_ptrs, all_sizes,
                                     prefer_alloc_in_same_node=False):
        ks = _keys(keys)
        nested = self._nested(all_buffer_ptrs, all_sizes, len(ks))
        if nested is None:
            return [INVALID_PARAMS] * len(ks)
        ptrs, sizes = nested
        _bool(prefer_alloc_in_same_node, "prefer_alloc_in_same_node")
        parts = [self._registered_run(p, s) for p, s in zip(ptrs, sizes)]
        return self._keyed("get_parts", ks, parts, lambda idx: [
            [ks[i] for i in idx], [[list(s) for s in parts[i]] for i in idx],
            prefer_alloc_in_same_node])

    # ------------------------------------------------------------ tasks (the real client's)

    def _task(self, op, key, *rest):
        k = _encode_key(key)
        if k is None:
            return (0, 0), INVALID_KEY
        status, got = self._link.call(op, [k, *rest])
        if status != 0:
            return (0, 0), status
        try:
            (hi, lo), rc = got
            ok = all(isinstance(x, int) and not isinstance(x, bool) for x in (hi, lo, rc))
        except (TypeError, ValueError):
            ok = False
        return ((hi, lo), rc) if ok else ((0, 0), RPC_FAIL)

    def create_copy_task(self, key, targets):
        return self._task("copy_task", key, list(_strs(targets, "targets")))

    def create_move_task(self, key, source, target):
        return self._task("move_task", key, check_str(source, "source"),
                          check_str(target, "target"))

    def query_task(self, task_id):
        status, got = self._link.call("query_task", [list(task_id_pair(task_id))])
        if status != 0:
            return None, status
        try:
            found, rc = got
            return (None if found is None else QueryTaskResponse._from_wire(found)), rc
        except (TypeError, ValueError):
            return None, RPC_FAIL

    def get_into_ranges(self, buffer_ptrs, all_keys, all_dst_offsets, all_src_offsets,
                        all_sizes):
        """As the real store's: results[b][k][r] is the range's size or the key's error.
        Entries with an invalid key or a range outside registered memory fail here; the
        rest go to the real client in one request."""
        bufs = int_list(buffer_ptrs, "buffer_ptrs")
        table = (("all_keys", all_keys), ("all_dst_offsets", all_dst_offsets),
                 ("all_src_offsets", all_src_offsets), ("all_sizes", all_sizes))
        for name, v in table:
            if isinstance(v, (str, bytes)) or not hasattr(v, "__len__"):
                raise TypeError(f"{name}: expected a list")
            if len(v) != len(bufs):
                raise ValueError(f"{name} has {len(v)} entries for {len(bufs)} buffers")
        results, sent = [], []  # sent: per buffer, [(k, key, dsts, srcs, sizes)]
        for b, buf in enumerate(bufs):
            keys_b = _keys(all_keys[b], f"all_keys[{b}]")
            d_b, s_b, z_b = all_dst_offsets[b], all_src_offsets[b], all_sizes[b]
            if not len(d_b) == len(s_b) == len(z_b) == len(keys_b):
                logger.error("mooncake: get_into_ranges: buffer %d: keys, offsets and sizes "
                             "differ in length", b)
                results.append([[INVALID_PARAMS] * (len(d_b[k]) if k < len(d_b) else 0)
                                for k in range(len(keys_b))])
                sent.append([])
                continue
            row, keep = [], []
            for k, key in enumerate(keys_b):
                d = int_list(d_b[k], f"all_dst_offsets[{b}][{k}]")
                s = int_list(s_b[k], f"all_src_offsets[{b}][{k}]")
                z = int_list(z_b[k], f"all_sizes[{b}][{k}]")
                if not lengths_match("get_into_ranges", dst_offsets=d, src_offsets=s, sizes=z):
                    row.append([INVALID_PARAMS] * len(d))
                elif key is None:
                    row.append([INVALID_KEY] * len(d))
                elif not d or not all(self._zero_copy(buf + dd, zz) for dd, zz in zip(d, z)):
                    if d:
                        self._log_unregistered(buf, max(dd + zz for dd, zz in zip(d, z)))
                    row.append([INVALID_PARAMS] * len(d))
                else:
                    row.append(None)
                    keep.append((k, key, d, s, z))
            results.append(row)
            sent.append(keep)
        if not any(sent):
            return results
        args = [bufs, [[e[1] for e in keep] for keep in sent],
                [[e[2] for e in keep] for keep in sent], [[e[3] for e in keep] for keep in sent],
                [[e[4] for e in keep] for keep in sent]]
        status, got = self._link.call("get_ranges", args)
        for b, keep in enumerate(sent):
            for j, (k, _, d, _, _) in enumerate(keep):
                try:
                    r = got[b][j] if status == 0 else None
                    ok = isinstance(r, list) and len(r) == len(d) and \
                        all(isinstance(x, int) for x in r)
                except (TypeError, IndexError):
                    ok = False
                results[b][k] = r if ok else [status if status != 0 else RPC_FAIL] * len(d)
        return results
