"""Dummy clients: ``mooncake_client`` (mooncake.real_client) serving stores that called
``setup_dummy``: objects shared between dummies of two processes, zero-copy through the
shared pool, staging limits, hostile frames and registrations, the real client dying
and coming back, flags and a clean stop."""

import ctypes
import fcntl
import os
import socket
import subprocess
import sys
import threading

import pytest

from fixtures_extra import (Child, KiB, MiB, STEP, RealClient, digest, dummies,  # noqa: F401
                            pattern, real_clients, run_isolated, served, store_factory,
                            terminate, tracked, unique, wait_until)

pytest.importorskip("mooncake.store")
from mooncake import _dummy_wire as W  # noqa: E402
from mooncake.store import (  # noqa: E402
    MooncakeDistributedStore,
    ObjectDataType,
    ReplicateConfig,
)

RPC_FAIL = -900
INVALID_PARAMS = -600
ILLEGAL_CLIENT = -601
NO_AVAILABLE_HANDLE = -200


def _other_process(address, code):
    """Runs ``code`` in a fresh interpreter with ``d``, a dummy of ``address``, and
    ``pattern``; returns its stdout lines."""
    prologue = (
        "import hashlib, random\n"
        "from mooncake.store import MooncakeDistributedStore\n"
        "def pattern(n, seed):\n"
        "    return random.Random(seed).getrandbits(8 * n).to_bytes(n, 'little')\n"
        "d = MooncakeDistributedStore()\n"
        "assert d.setup_dummy(1 << 26, 1 << 20, %r) == 0\n" % address)
    rc, out, err = run_isolated(prologue + code + "\nd.close()\n")
    assert rc == 0, err
    return out.split()


# ------------------------------------------------------------------ sharing objects


def test_dummies_of_two_processes_see_each_others_objects(served, dummies):
    a, b = dummies(served.address), dummies(served.address)
    assert type(a).__name__ == "DummyStore" and isinstance(a, MooncakeDistributedStore)
    assert a.health_check() == 0 and a.get_hostname() == ""
    k1, k2, k3, k4 = unique("d1"), unique("d2"), unique("d3"), unique("d4")
    v1, v2, v3 = pattern(300 * KiB, 1), pattern(5000, 2), pattern(1, 3)

    assert a.put(k1, v1) == 0
    assert b.get(k1) == v1 and b.get_size(k1) == len(v1) and b.is_exist(k1) == 1
    assert bytes(b.get_buffer(k1)) == v1
    assert b.put_batch([k2, k3], [v2, v3]) == 0
    assert a.get_batch([k2, unique("missing"), k3]) == [v2, b"", v3]
    assert [bytes(x) for x in a.batch_get_buffer([k3, k2])] == [v3, v2]
    assert a.batch_is_exist([k1, k2, unique("missing")]) == [1, 1, 0]
    assert a.put_parts(k4, b"head-", memoryview(v2)) == 0 and b.get(k4) == b"head-" + v2

    (their_k1,) = _other_process(served.address, (
        "print(hashlib.sha256(d.get(%r)).hexdigest())\n"
        "assert d.put(%r, pattern(70000, 9)) == 0\n") % (k1, k1 + "-theirs"))
    assert their_k1 == digest(v1)
    assert a.get(k1 + "-theirs") == pattern(70000, 9)

    replicas = b.get_replica_desc(k1)
    assert len(replicas) == 1 and replicas[0].is_memory_replica()
    pieces = replicas[0].get_memory_descriptor().buffer_descriptors
    assert sum(x.size for x in pieces) == len(v1)
    assert {x.transport_endpoint for x in pieces} == {served.segment}
    assert set(a.batch_get_replica_desc([k1, k2, unique("missing")])) == {k1, k2}
    k5 = unique("d5")  # never read, so no lease stands in the way of the upsert
    assert a.put(k5, b"old") == 0 and a.upsert(k5, b"new") == 0 and b.get(k5) == b"new"
    assert a.batch_remove([k2, k3, ""], force=True) == [0, 0, -400]
    assert b.remove(k1, force=True) == 0 and a.is_exist(k1) == 0


def test_threads_share_one_dummy_and_its_staging_buffer(served, dummies):
    d = dummies(served.address, local_buffer=96 * KiB)
    errors = []

    def work(t):
        try:
            for i in range(8):
                k = "%s-t%d-%d" % (unique("thr"), t, i)
                v = pattern(40 * KiB + i, 100 * t + i)  # two fill the staging buffer
                if d.put(k, v) != 0 or d.get(k) != v:
                    errors.append((t, i))
        except Exception as e:  # reported below, in the test's thread
            errors.append(repr(e))

    threads = [threading.Thread(target=work, args=(t,)) for t in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(STEP)
    assert not any(t.is_alive() for t in threads)
    assert errors == []


def test_close_makes_a_dummy_a_plain_store_again(served):
    d = MooncakeDistributedStore()
    assert d.setup_dummy(0, 64 * KiB, served.address) == 0
    assert d.close() == 0
    assert type(d) is MooncakeDistributedStore and d.health_check() == 1
    assert d.put(unique(), b"x") == INVALID_PARAMS


# ------------------------------------------------------------------ zero-copy and staging


def test_zero_copy_calls_use_the_shared_pool_in_place(served, dummies):
    a, b = dummies(served.address), dummies(served.address)
    size = 256 * KiB
    p = a.alloc_from_mem_pool(size)
    assert p != 0
    assert a.register_buffer(p, size) == 0
    pool = (ctypes.c_char * size).from_address(p)
    k1, k2, k3 = unique("z1"), unique("z2"), unique("z3")
    v1, v2 = pattern(100 * KiB, 4), pattern(3000, 5)
    ctypes.memmove(p, v1, len(v1))
    assert a.put_from(k1, p, len(v1)) == 0
    assert b.get(k1) == v1

    assert b.put(k2, v2) == 0
    ctypes.memset(p, 0, size)
    assert a.get_into(k2, p + 4096, 8192) == len(v2)
    assert pool[4096:4096 + len(v2)] == v2 and pool[:4096] == b"\0" * 4096
    got = a.batch_get_into([k1, k2], [p, p + 200 * KiB], [120 * KiB, 8 * KiB])
    assert got == [len(v1), len(v2)]
    assert pool[:len(v1)] == v1 and pool[200 * KiB:200 * KiB + len(v2)] == v2
    assert a.get_into(k1, p, 1000) == -10  # the buffer is too small: BUFFER_OVERFLOW

    assert a.batch_put_from_multi_buffers([k3], [[p + 200 * KiB, p]], [[len(v2), 10]]) == [0]
    assert b.get(k3) == v2 + v1[:10]
    out = a.get_into_ranges([p], [[k1, k2]], [[[0, 64], [128]]], [[[5, 50], [7]]],
                            [[[3, 4], [9]]])
    assert out == [[[3, 4], [9]]]
    assert pool[0:3] == v1[5:8] and pool[64:68] == v1[50:54] and pool[128:137] == v2[7:16]


def test_memory_outside_the_pool_is_refused_without_touching_the_server(served, dummies):
    d = dummies(served.address)
    own = (ctypes.c_char * 4096)()
    addr = ctypes.addressof(own)
    p = d.alloc_from_mem_pool(8192)
    assert d.register_buffer(addr, 4096) == -1  # not alloc_from_mem_pool memory
    assert d.register_buffer(p, 4096) == -1  # part of an allocation (upstream: whole only)
    k = unique()
    assert d.put_from(k, addr, 100) == INVALID_PARAMS
    assert d.put_from(k, p, 100) == INVALID_PARAMS  # allocated but not registered
    assert d.batch_put_from([k, unique()], [p, addr], [10, 10]) == [INVALID_PARAMS] * 2
    assert d.register_buffer(p, 8192) == 0
    assert d.put_from(k, p, 8192) == 0
    assert d.unregister_buffer(p) == 0
    assert d.get_into(k, p, 8192) == INVALID_PARAMS
    assert d.unregister_buffer(p) == -1
    assert d.is_exist(k) == 1


def test_copies_go_through_the_staging_buffer_in_rounds(served, dummies):
    small = dummies(served.address, local_buffer=64 * KiB)
    big = dummies(served.address, local_buffer=1 * MiB)
    keys = [unique("r%d" % i) for i in range(5)]
    values = [pattern(30 * KiB, 10 + i) for i in range(5)]
    assert small.put_batch(keys, values) == 0  # 150 KiB through 64 KiB: three rounds
    assert small.get_batch(keys) == values
    assert big.get_batch(keys) == values

    huge = unique("huge")
    assert small.put(huge, pattern(100 * KiB, 20)) == NO_AVAILABLE_HANDLE
    assert big.put(huge, pattern(100 * KiB, 20)) == 0
    assert small.get(huge) == b""  # larger than its staging buffer: a miss, as upstream
    assert small.get_batch([keys[0], huge]) == [values[0], b""]
    assert small.get_size(huge) == 100 * KiB

    none = dummies(served.address, local_buffer=0)
    assert none.put(unique(), b"x") == NO_AVAILABLE_HANDLE
    assert none.get(keys[0]) == b"" and none.is_exist(keys[0]) == 1


def test_tensor_methods_work_on_a_dummy(served, dummies):
    torch = pytest.importorskip("torch")
    a, b = dummies(served.address), dummies(served.address)
    t = torch.arange(12, dtype=torch.float32).reshape(3, 4)
    k = unique("tensor")
    assert a.put_tensor(k, t) == 0
    assert torch.equal(b.get_tensor(k), t)
    assert [torch.equal(x, t) for x in b.batch_get_tensor([k, k])] == [True, True]


def test_replicate_config_reaches_the_real_client(served, dummies):
    d = dummies(served.address)
    cfg = ReplicateConfig()
    cfg.preferred_segment = served.segment
    cfg.with_hard_pin = True
    k = unique()
    assert d.put(k, b"pinned", cfg) == 0
    assert d.get(k) == b"pinned"
    cfg.replica_num = 0
    assert d.put(unique(), b"x", cfg) < 0


def test_nof_and_dfs_fields_reach_the_real_client(served, dummies):
    """The real client answers for them (the dummy refuses nothing itself): what it
    answers shows the fields crossed the wire."""
    d = dummies(served.address)
    cfg = ReplicateConfig()
    cfg.nof_replica_num = 1
    assert d.put(unique(), b"x", cfg) == INVALID_PARAMS
    cfg.nof_replica_num, cfg.dfs_replica_num = 0, 1
    assert d.put(unique(), b"x", cfg) == -1601  # DFS_SERVICE_UNAVAILABLE
    cfg.dfs_replica_num = 0
    cfg.data_type = ObjectDataType.KVCACHE
    k = unique()
    assert d.put(k, b"typed", cfg) == 0
    assert d.get(k) == b"typed"


def test_tasks_run_on_the_real_client_and_sessions_are_refused(
        master_factory, real_clients, store_factory, dummies):
    master = master_factory()
    real = real_clients(master)
    other = store_factory(master, segment=32 * MiB)
    d = dummies(real.address)
    cfg = ReplicateConfig()
    cfg.preferred_segment = real.segment
    k = unique()
    assert d.put(k, b"c" * 70_000, cfg) == 0
    task, rc = d.create_copy_task(k, [other.get_hostname()])
    assert rc == 0 and task != (0, 0)
    done = {}

    def finished():
        resp, code = d.query_task(task)
        done["resp"], done["rc"] = resp, code
        return code == 0 and int(resp.status) in (2, 3)

    wait_until(finished, "the copy task to finish")
    assert done["resp"].id == task and int(done["resp"].status) == 3, done["resp"]
    segments = {p.transport_endpoint for r in d.get_replica_desc(k)
                for p in r.get_memory_descriptor().buffer_descriptors}
    assert segments == {real.segment, other.get_hostname()}
    assert d.query_task((task[0], task[1] + 1000)) == (None, -1400)
    assert d.create_copy_task("", [other.get_hostname()]) == ((0, 0), -400)
    with pytest.raises(TypeError):
        d.query_task("1-2")
    # Upstream's dummy has no sessions: refused per key, as there.
    assert d.batch_put_session_start([unique()], [4]) == [INVALID_PARAMS]


# ------------------------------------------------------------------ hostile peers


class RawPeer:
    """A hand-driven TCP session with the real client."""

    def __init__(self, address):
        host, _, port = address.rpartition(":")
        self.sock = socket.create_connection((host, int(port)), timeout=10)
        self.reader = W.FrameReader(self.sock)

    def hello(self):
        self.sock.sendall(W.frame(W.REQUEST, ["hello", [W.VERSION]]))
        kind, (status, info) = self.reader.read(1 << 20, 10, 10)
        assert kind == W.REPLY and status == 0
        self.token, self.ipc_name = info[1], info[2]
        return self

    def ask(self, raw):
        self.sock.sendall(raw)
        return self.reader.read(1 << 20, 10, 10)

    def call(self, op, args):
        kind, reply = self.ask(W.frame(W.REQUEST, [op, args]))
        assert kind == W.REPLY
        return reply

    def share(self, fd, base, size, token=None):
        with socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET) as u:
            u.settimeout(10)
            u.connect(self.ipc_name)
            msg = W.frame(W.REGISTER, [token or self.token, base, size, False])
            socket.send_fds(u, [msg], [fd])
            reply = u.recv(4096)
        return W.decode(reply[W.HEADER.size:])[0]

    def close(self):
        self.sock.close()


def _memfd(size, seal=True, huge_pages=False):
    """A memfd of ``size`` bytes, sealed against shrinking unless told not to; None when
    huge pages are asked for and this kernel has no hugetlbfs."""
    try:
        fd = os.memfd_create("hostile", os.MFD_ALLOW_SEALING |
                             (os.MFD_HUGETLB if huge_pages else 0))
    except OSError:
        if huge_pages:
            return None
        raise
    os.ftruncate(fd, size)
    if seal:
        fcntl.fcntl(fd, fcntl.F_ADD_SEALS, fcntl.F_SEAL_SHRINK)
    return fd


def test_hostile_frames_are_refused_and_the_server_stays_up(served, dummies, tmp_path):
    d = dummies(served.address)
    k = unique()
    value = pattern(5000, 7)
    assert d.put(k, value) == 0

    # A header announcing more than the server takes: refused, that connection dropped.
    bad = RawPeer(served.address)
    kind, code = bad.ask(W.HEADER.pack(W.MAGIC, W.VERSION, W.REQUEST, 0, 1 << 31))
    assert (kind, code) == (W.FAULT, INVALID_PARAMS)
    assert bad.sock.recv(1) == b""
    bad.close()
    # Not our protocol at all.
    junk = RawPeer(served.address)
    junk.sock.sendall(b"GET / HTTP/1.0\r\n\r\n")
    assert junk.reader.read(1 << 20, 10, 10)[0] == W.FAULT
    junk.close()

    peer = RawPeer(served.address).hello()
    try:
        # A body that does not decode: refused, the session goes on.
        body = b"l" + (5).to_bytes(4, "little") + b"N"
        kind, reply = peer.ask(W.HEADER.pack(W.MAGIC, W.VERSION, W.REQUEST, 0, len(body)) + body)
        assert kind == W.REPLY and reply == [INVALID_PARAMS, None]
        assert peer.call("no_such_op", []) == [-1012, None]
        assert peer.call("exists", ["not bytes"]) == [INVALID_PARAMS, None]

        # Memory handed over: only sealed memfds, only with this session's token.
        size = 64 * KiB
        fd = _memfd(size)
        unsealed = _memfd(size, seal=False)
        plain = os.open(tmp_path / "f", os.O_RDWR | os.O_CREAT)
        os.ftruncate(plain, size)
        huge = _memfd(2 * MiB, huge_pages=True)
        base = 0x7000_0000_0000
        try:
            assert peer.share(unsealed, base, size) == INVALID_PARAMS
            assert peer.share(plain, base, size) == INVALID_PARAMS
            assert peer.share(fd, base, size * 2) == INVALID_PARAMS  # larger than the memfd
            if huge is not None:  # its pages may not exist: touching them would kill
                assert peer.share(huge, base, 2 * MiB) == INVALID_PARAMS
            assert peer.share(fd, base, size, token=b"x" * 16) == ILLEGAL_CLIENT
            assert peer.share(fd, base, size) == 0
            assert peer.share(fd, base + 4096, 4096) == INVALID_PARAMS  # overlaps

            # Addresses outside what was shared: refused whole, nothing written.
            for span in ([base + size - 10, 20], [base - 1, 10], [0, 5000], [base, 1 << 63]):
                assert peer.call("get_into", [[k.encode()], [span]]) == [INVALID_PARAMS, None]
            assert peer.call("get_ranges", [[base], [[k.encode()]], [[[size - 1]]], [[[0]]],
                                            [[[2]]]]) == [INVALID_PARAMS, None]
            assert peer.call("get_ranges", [[base], [[k.encode()]], [[[0, size]]], [[[0]]],
                                            [[[2]]]]) == [INVALID_PARAMS, None]
            assert os.pread(fd, size, 0) == b"\0" * size
            # Inside it: the real client writes the value into the shared memory.
            assert peer.call("get_into", [[k.encode()], [[base + 100, 6000]]]) == [0, [5000]]
            assert os.pread(fd, 5000, 100) == value
            assert peer.call("unmap", [base]) == [0, 0]
            assert peer.call("get_into", [[k.encode()], [[base, 6000]]]) == [INVALID_PARAMS, None]
        finally:
            for f in (fd, unsealed, plain, huge):
                if f is not None:
                    os.close(f)
        assert peer.call("ping", []) == [0, 0]
    finally:
        peer.close()

    # The server still serves everyone.
    assert d.get(k) == value
    assert dummies(served.address).get(k) == value


def _random_value(rng, depth=0):
    """A value of the wire's types, nested up to the wire's limit."""
    kinds = ["none", "bool", "i64", "u64", "str", "bytes"] + \
        (["list", "tuple"] if depth < W.MAX_DEPTH else [])
    kind = rng.choice(kinds)
    if kind == "none":
        return None
    if kind == "bool":
        return rng.random() < 0.5
    if kind == "i64":
        return rng.randrange(-(1 << 63), 1 << 63)
    if kind == "u64":
        return rng.randrange(1 << 63, 1 << 64)
    if kind == "str":
        return "".join(chr(rng.randrange(1, 0xD7FF)) for _ in range(rng.randrange(4)))
    if kind == "bytes":
        return rng.randbytes(rng.randrange(4))
    items = [_random_value(rng, depth + 1) for _ in range(rng.randrange(4))]
    return items if kind == "list" else tuple(items)


def _as_decoded(v):
    return [_as_decoded(x) for x in v] if isinstance(v, (list, tuple)) else v


def test_the_wire_codec_round_trips_and_refuses_malformed_bodies():
    """Every value of the wire's types comes back as sent (tuples as lists); a body
    that is not exactly one well-formed value is a BodyError naming what is wrong; a
    value the wire cannot carry is refused when encoded."""
    import random

    rng = random.Random(30)
    for _ in range(2000):
        v = _random_value(rng)
        assert W.decode(W.encode(v)) == _as_decoded(v)
    # Subclasses and buffers take the general path to the same bytes.
    import enum

    class Small(enum.IntEnum):
        SEVEN = 7

    class Named(str, enum.Enum):  # its str() is "Named.SEG", its value "node-a"
        SEG = "node-a"

    assert W.encode([Small.SEVEN, bytearray(b"ab"), memoryview(b"cd"), Named.SEG]) == \
        W.encode([7, b"ab", b"cd", "node-a"])
    assert W.encode(Named.SEG) == W.encode("node-a")

    def deep(leaf, levels):
        body = W.encode(leaf)
        for _ in range(levels):
            body = b"l" + (1).to_bytes(4, "little") + body
        return body

    u32 = (2).to_bytes(4, "little")
    bad = {
        b"": "truncated value",
        b"i\0\0": "truncated value",
        b"l" + u32 + b"i" + bytes(8): "truncated value",  # one item of two
        b"s" + u32 + b"a": "truncated value",
        b"l" + u32 + b"s" + u32 + b"a": "truncated value",  # the same inside a list
        b"NN": "trailing bytes",
        b"l" + (9).to_bytes(4, "little") + b"N": "list count exceeds the body",
        b"u" + (5).to_bytes(8, "little"): "non-canonical uint64",
        b"s" + u32 + b"\xff\xfe": "not UTF-8",
        b"l" + u32 + b"s" + u32 + b"\xff\xfeN": "not UTF-8",
        b"x": "unknown tag",
        b"l" + u32 + b"NZ": "unknown tag",
        deep(1, W.MAX_DEPTH + 1): "nested too deeply",
        deep("s", W.MAX_DEPTH + 1): "nested too deeply",
    }
    for body, why in bad.items():
        with pytest.raises(W.BodyError, match=why):
            W.decode(body)
    assert W.decode(deep(1, W.MAX_DEPTH)) is not None  # the limit itself is fine

    too_deep = 1
    for _ in range(W.MAX_DEPTH + 1):
        too_deep = [too_deep]
    for value, error in ((too_deep, ValueError), (1 << 64, ValueError),
                         (-(1 << 63) - 1, ValueError), ([1.5], TypeError), ({}, TypeError)):
        with pytest.raises(error):
            W.encode(value)


def test_frames_are_read_whole_however_they_arrive():
    """The reader takes frames that share a segment one at a time, joins one that
    arrives in pieces, and bounds a frame that stops half-way."""
    a, b = socket.socketpair()
    try:
        reader = W.FrameReader(b)
        two = W.frame(W.REQUEST, ["exists", [b"k1"]]) + W.frame(W.REQUEST, ["ping", []])
        a.sendall(two)
        assert reader.read(1 << 20, 5, 5) == (W.REQUEST, ["exists", [b"k1"]])
        assert reader.pending()
        assert reader.read(1 << 20, 5, 5) == (W.REQUEST, ["ping", []])
        assert not reader.pending()

        class Pieces:
            """A socket whose every recv returns the next piece, however much is asked."""

            def __init__(self, data, cuts):
                self.pieces = [data[s:e] for s, e in zip(cuts, cuts[1:])]
                self.timeout = None

            def settimeout(self, timeout):
                self.timeout = timeout

            def gettimeout(self):
                return self.timeout

            def recv(self, n):
                piece = self.pieces.pop(0)
                assert len(piece) <= n
                return piece

        one = W.frame(W.REPLY, [0, list(range(100))])
        cuts = [0, 1, 7, W.HEADER.size, 50, len(one)]  # inside the header, then the body
        pieces = Pieces(one, cuts)
        assert W.FrameReader(pieces).read(1 << 20, 5, 5) == (W.REPLY, [0, list(range(100))])
        assert pieces.pieces == []

        # A wait that ends before the deadline (the reader keeps a socket timeout a
        # little shorter than what is left) is not the deadline: the reader waits on.
        class WokenEarly(Pieces):
            def recv(self, n):
                if not hasattr(self, "woke"):
                    self.woke = True
                    raise socket.timeout
                return super().recv(n)

        early = WokenEarly(one, [0, len(one)])
        assert W.FrameReader(early).read(1 << 20, 5, 5) == (W.REPLY, [0, list(range(100))])
        assert early.pieces == [] and 4 < early.timeout <= 5

        a.sendall(W.frame(W.REPLY, [0, None])[:-1])
        with pytest.raises(W.FrameError, match="inside a frame"):
            reader.read(1 << 20, 5, 0.2)
        with pytest.raises(W.FrameError, match="idle"):
            W.FrameReader(a).read(1 << 20, 0.05, 5)
        a.close()
        with pytest.raises(W.FrameError):
            reader.read(1 << 20, 5, 5)
    finally:
        a.close()
        b.close()


def test_a_reply_followed_by_bytes_nobody_asked_for_drops_the_connection(free_port):
    """One request, one reply: a server that sends more is out of step, and the dummy
    stops trusting that connection (the call fails with RPC_FAIL) rather than reading
    the extra bytes as the next call's answer."""
    from mooncake._dummy import RPC_FAIL, Link
    from mooncake._dummy import _open as _dummy_open

    srv = socket.create_server(("127.0.0.1", 0))
    port = srv.getsockname()[1]

    def serve():
        conn, _ = srv.accept()
        with conn:
            r = W.FrameReader(conn)
            r.read(1 << 20, 10, 10)  # hello
            conn.sendall(W.frame(W.REPLY, [0, [W.VERSION, b"t" * 16, b"\0nowhere", 1]]))
            r.read(1 << 20, 10, 10)  # the call
            conn.sendall(W.frame(W.REPLY, [0, 1]) + W.frame(W.REPLY, [0, 2]))
            conn.recv(1)  # until the dummy hangs up

    t = threading.Thread(target=serve, daemon=True)
    t.start()
    link = Link(("127.0.0.1", port))
    try:
        conn = _dummy_open(("127.0.0.1", port))
        link._conn = conn
        assert link._call_locked("exists", [b"k"]) == (RPC_FAIL, None)
        assert link._conn is None
    finally:
        link._conn = None
        srv.close()
        t.join(10)
        assert not t.is_alive()


# ------------------------------------------------------------------ failures


def test_a_dead_real_client_fails_calls_and_a_restarted_one_is_reattached(
        master_factory, real_clients, dummies):
    master = master_factory()
    first = real_clients(master)
    d = dummies(first.address)
    size = 64 * KiB
    p = d.alloc_from_mem_pool(size)
    assert d.register_buffer(p, size) == 0
    assert d.put(unique(), b"before") == 0

    first.kill()
    k = unique()
    assert d.put(k, b"while down") < 0  # answered (not hung) with an error code
    assert d.put(k, b"while down") == RPC_FAIL
    assert d.get(k) == b"" and d.is_exist(k) == RPC_FAIL
    assert d.batch_is_exist([k, k]) == [RPC_FAIL, RPC_FAIL]
    assert d.health_check() == 2

    second = real_clients(master, first.port)
    wait_until(lambda: d.health_check() == 0, "the dummy to reattach", timeout=30)
    cfg = ReplicateConfig()
    cfg.preferred_segment = second.segment  # not the dead client's segment
    assert d.put(k, b"after", cfg) == 0 and d.get(k) == b"after"
    # The pool buffer registered before the restart was shared again.
    v = pattern(size, 8)
    ctypes.memmove(p, v, size)
    k2 = unique()
    assert d.put_from(k2, p, size, cfg) == 0
    assert dummies(second.address).get(k2) == v

    assert second.stop() == 0  # SIGTERM: a clean stop
    assert d.get_size(k2) < 0


def test_setup_dummy_without_a_real_client(free_port):
    d = MooncakeDistributedStore()
    assert d.setup_dummy(0, 64 * KiB, "127.0.0.1:%d" % free_port()) == RPC_FAIL
    assert type(d) is MooncakeDistributedStore and d.health_check() == 1
    with pytest.raises(ValueError):
        d.setup_dummy(0, 0, "no-port")
    with pytest.raises(TypeError):
        d.setup_dummy(0, 0, 50052)


def test_flags():
    run = [sys.executable, "-m", "mooncake.real_client"]
    p = subprocess.run(run + ["--no_such_flag=1"], capture_output=True, text=True, timeout=60)
    assert p.returncode == 2 and "no_such_flag" in p.stderr
    p = subprocess.run(run + ["--port", "x"], capture_output=True, text=True, timeout=60)
    assert p.returncode == 2 and "--port" in p.stderr
    p = subprocess.run(run + ["--help"], capture_output=True, text=True, timeout=60)
    assert p.returncode == 0 and "--master_server_address" in p.stdout

    from mooncake.real_client import FlagError, parse_flags

    f = parse_flags(["-port=1", "--global_segment_size", "4 GB", "--enable_offload",
                     "--nostart_offload_rpc_server", "--tenant_id=t"])
    assert (f["port"], f["global_segment_size"], f["enable_offload"],
            f["start_offload_rpc_server"], f["tenant_id"]) == (1, 4 << 30, True, False, "t")
    assert parse_flags([])["master_server_address"] == "127.0.0.1:50051"
    with pytest.raises(FlagError):
        parse_flags(["--enable_offload=maybe"])
    with pytest.raises(FlagError):
        parse_flags(["stray"])
