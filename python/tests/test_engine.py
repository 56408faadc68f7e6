"""mooncake.engine.TransferEngine: every method of docs/python.md, two engines in this
process on 127.0.0.1 (initialized with "tcp", so they reach each other through shared
memory) (the cross-process flows are in
test_engines_flows.py, hostile input in test_hostile.py)."""

import ctypes
import json

import pytest

from fixtures_extra import *  # noqa: F401,F403

mooncake_engine = pytest.importorskip("mooncake.engine")
from mooncake.engine import TransferEngine, TransferNotify, TransferOpcode  # noqa: E402


class Side:
    """One initialized engine with a registered buffer."""

    def __init__(self, engine, name, size, seed):
        self.e = engine
        self.name = name
        self.buf = Buf(size, content=pattern(size, seed))
        assert engine.register_memory(self.buf.addr, size) == 0


@pytest.fixture(scope="module")
def pair():
    """Engines a and b (P2PHANDSHAKE, tcp), each with a registered 1 MiB buffer."""
    sides = []
    for seed in (1, 2):
        e = TransferEngine()
        assert e.initialize("127.0.0.1", "P2PHANDSHAKE", "tcp", "") == 0
        sides.append(Side(e, "127.0.0.1:%d" % e.get_rpc_port(), MiB, seed))
    yield sides
    for s in sides:
        s.e.unregister_memory(s.buf.addr)


def reset(side, seed):
    side.buf.write(0, pattern(side.buf.size, seed))


# ------------------------------------------------------------------ module surface


def test_module_constants_and_enums():
    assert int(TransferOpcode.Read) == 0
    assert int(TransferOpcode.Write) == 1
    for flag in ("SUPPORT_CUDA", "SUPPORT_HIP", "SUPPORT_EFA"):
        assert isinstance(getattr(mooncake_engine, flag), bool), flag
    n = TransferNotify("name-1", "msg-1")
    assert (n.name, n.msg) == ("name-1", "msg-1")


def test_initialize_p2p_reports_a_listening_rpc_port(pair):
    a, b = pair
    for side in pair:
        port = side.e.get_rpc_port()
        assert isinstance(port, int) and 0 < port < 65536
        assert port_is_open("127.0.0.1", port), "nothing listens on the rpc port %d" % port
    assert a.e.get_rpc_port() != b.e.get_rpc_port()


def test_device_name_is_ignored_for_tcp():
    e = TransferEngine()
    assert e.initialize("127.0.0.1", "P2PHANDSHAKE", "tcp", "mlx5_0") == 0
    assert e.get_rpc_port() > 0


def test_get_local_topology_is_json():
    e = TransferEngine()
    assert e.initialize("127.0.0.1", "P2PHANDSHAKE", "tcp", "") == 0
    for topo in (e.get_local_topology(), e.get_local_topology(None), e.get_local_topology("")):
        assert isinstance(topo, str)
        json.loads(topo)


# ------------------------------------------------------------------ synchronous transfers


def test_transfer_sync_write_and_read(pair):
    a, b = pair
    reset(a, 11)
    reset(b, 12)
    # a's [1000, +5000) -> b's [7, +5000)
    assert a.e.transfer_sync_write(b.name, a.buf.addr + 1000, b.buf.addr + 7, 5000) == 0
    want_b = bytearray(pattern(MiB, 12))
    want_b[7:5007] = pattern(MiB, 11)[1000:6000]
    assert b.buf.raw == bytes(want_b)
    # read b's [200000, +300001) into a's [0, ...)
    assert a.e.transfer_sync_read(b.name, a.buf.addr, b.buf.addr + 200000, 300001) == 0
    assert a.buf.read(0, 300001) == bytes(want_b[200000:500001])
    assert a.buf.read(300001) == pattern(MiB, 11)[300001:]


@pytest.mark.parametrize("switch", [None, "0"])
def test_tcp_reaches_a_same_host_peer_through_shared_memory_unless_switched_off(
        monkeypatch, switch):
    """Upstream's "tcp" means "no RDMA": a same-host peer of ours is reached through
    shared memory, and MC_SAME_HOST_SHM=0 (read at initialize) keeps it on sockets."""
    if switch is None:
        monkeypatch.delenv("MC_SAME_HOST_SHM", raising=False)
    else:
        monkeypatch.setenv("MC_SAME_HOST_SHM", switch)
    target, client = TransferEngine(), TransferEngine()
    try:
        sides = []
        for e, seed in ((target, 31), (client, 32)):
            assert e.initialize("127.0.0.1", "P2PHANDSHAKE", "tcp", "") == 0
            sides.append(Side(e, "127.0.0.1:%d" % e.get_rpc_port(), 64 * 1024, seed))
        far, near = sides
        before = client.get_stats()
        assert client.transfer_sync_read(far.name, near.buf.addr, far.buf.addr + 5, 40000) == 0
        after = client.get_stats()
        assert near.buf.read(0, 40000) == pattern(64 * 1024, 31)[5:40005]
        carried, idle = ("shm_bytes", "tcp_bytes") if switch is None else ("tcp_bytes",
                                                                           "shm_bytes")
        assert after[carried] - before[carried] == 40000, (before, after)
        assert after[idle] == before[idle], (before, after)
        assert after["protocol"] == "tcp"
        assert after["same_host_shm"] is (switch is None)
        for side in sides:
            assert side.e.unregister_memory(side.buf.addr) == 0
    finally:
        target.close()
        client.close()


def test_transfer_sync_with_opcode_and_transport_hint(pair):
    a, b = pair
    reset(a, 21)
    reset(b, 22)
    assert a.e.transfer_sync(b.name, a.buf.addr, b.buf.addr, 4096, TransferOpcode.Write) == 0
    assert b.buf.read(0, 4096) == pattern(MiB, 21)[:4096]
    assert a.e.transfer_sync(b.name, a.buf.addr + 4096, b.buf.addr + 8192, 100, TransferOpcode.Read, None, "") == 0
    assert a.buf.read(4096, 100) == pattern(MiB, 22)[8192:8292]
    assert a.e.transfer_sync_write(b.name, a.buf.addr, b.buf.addr + 4096, 10, "") == 0
    assert b.buf.read(4096, 10) == pattern(MiB, 21)[:10]


def test_batch_transfer_sync(pair):
    a, b = pair
    reset(a, 31)
    reset(b, 32)
    src_a, src_b = pattern(MiB, 31), pattern(MiB, 32)
    locs = [a.buf.addr, a.buf.addr + 65536, a.buf.addr + 500000]
    peers = [b.buf.addr + 300000, b.buf.addr + 10, b.buf.addr + 700000]
    lens = [65536, 3, 123457]
    assert a.e.batch_transfer_sync_write(b.name, locs, peers, lens) == 0
    want = bytearray(src_b)
    for l, p, n in zip(locs, peers, lens):
        want[p - b.buf.addr : p - b.buf.addr + n] = src_a[l - a.buf.addr : l - a.buf.addr + n]
    assert b.buf.raw == bytes(want)

    reset(b, 33)
    assert a.e.batch_transfer_sync_read(b.name, [a.buf.addr, a.buf.addr + 9], [b.buf.addr + 5, b.buf.addr], [4, 1000]) == 0
    src = pattern(MiB, 33)
    assert a.buf.read(0, 4) == src[5:9]
    assert a.buf.read(9, 1000) == src[:1000]

    reset(a, 34)
    assert a.e.batch_transfer_sync(b.name, [a.buf.addr], [b.buf.addr], [777], TransferOpcode.Write) == 0
    assert b.buf.read(0, 777) == pattern(MiB, 34)[:777]


def test_transfer_to_an_unregistered_peer_range_fails_and_writes_nothing(pair):
    a, b = pair
    reset(a, 41)
    outside = Buf(8192, fill=b"\x5a")  # b's process memory, never registered
    assert a.e.transfer_sync_write(b.name, a.buf.addr, outside.addr, 4096) < 0
    assert outside.raw == b"\x5a" * 8192
    # crossing the end of b's registered buffer
    reset(b, 42)
    assert a.e.transfer_sync_write(b.name, a.buf.addr, b.buf.addr + MiB - 100, 200) < 0
    assert b.buf.raw == pattern(MiB, 42)
    # reading from outside leaves the local buffer as it was
    assert a.e.transfer_sync_read(b.name, a.buf.addr, outside.addr, 4096) < 0
    assert a.buf.raw == pattern(MiB, 41)


def test_unregistered_local_buffer_is_refused_and_never_read(pair):
    a, b = pair
    reset(b, 51)
    secret = Buf(4096, content=pattern(4096, 52))  # a's memory, not registered
    assert a.e.transfer_sync_write(b.name, secret.addr, b.buf.addr, 4096) < 0
    assert b.buf.raw == pattern(MiB, 51), "bytes of an unregistered buffer reached the peer"
    assert a.e.transfer_sync_read(b.name, secret.addr, b.buf.addr, 4096) < 0
    assert secret.raw == pattern(4096, 52), "an unregistered buffer was written"
    assert a.e.batch_transfer_sync_write(b.name, [a.buf.addr, secret.addr], [b.buf.addr, b.buf.addr + 8192], [16, 16]) < 0
    assert b.buf.read(8192, 16) == pattern(MiB, 51)[8192:8208]


def test_transfer_to_an_unreachable_peer_returns_an_error():
    e = TransferEngine()
    assert e.initialize("127.0.0.1", "P2PHANDSHAKE", "tcp", "") == 0
    local = Buf(4096)
    assert e.register_memory(local.addr, 4096) == 0
    dead = "127.0.0.1:%d" % free_port()
    assert e.transfer_sync_write(dead, local.addr, 0x10000, 4096) < 0
    assert e.batch_transfer_sync_read(dead, [local.addr], [0x10000], [16]) < 0


# ------------------------------------------------------------------ asynchronous transfers


def test_batch_transfer_async_and_get_batch_transfer_status(pair):
    a, b = pair
    reset(a, 61)
    reset(b, 62)
    bid1 = a.e.batch_transfer_async_write(b.name, [a.buf.addr, a.buf.addr + 100], [b.buf.addr, b.buf.addr + 5000], [100, 4900])
    bid2 = a.e.batch_transfer_async_read(b.name, [a.buf.addr + 600000], [b.buf.addr + 600000], [1000])
    assert bid1 != 0 and bid2 != 0 and bid1 != bid2
    assert a.e.get_batch_transfer_status([bid1, bid2]) == 0
    src_a, src_b = pattern(MiB, 61), pattern(MiB, 62)
    assert b.buf.read(0, 100) == src_a[:100]
    assert b.buf.read(5000, 4900) == src_a[100:5000]
    assert a.buf.read(600000, 1000) == src_b[600000:601000]
    bid3 = a.e.batch_transfer_async(b.name, [a.buf.addr], [b.buf.addr + 900000], [64], TransferOpcode.Write)
    assert bid3 != 0
    assert a.e.get_batch_transfer_status([bid3]) == 0
    assert b.buf.read(900000, 64) == src_a[:64]


def test_failing_async_batch_reports_failure(pair):
    a, b = pair
    outside = Buf(4096, fill=b"\x11")
    bid = a.e.batch_transfer_async_write(b.name, [a.buf.addr], [outside.addr], [4096])
    if bid != 0:  # refused at submit (0) or failed when run (-1): both honest
        assert a.e.get_batch_transfer_status([bid]) == -1
    assert outside.raw == b"\x11" * 4096


def test_transfer_submit_write_and_check_status(pair):
    a, b = pair
    reset(a, 71)
    reset(b, 72)
    bid = a.e.transfer_submit_write(b.name, a.buf.addr + 3, b.buf.addr + 11, 200000)
    assert bid != 0
    st = wait_until(lambda: a.e.transfer_check_status(bid) or None, "transfer_check_status != 0")
    assert st == 1
    assert b.buf.read(11, 200000) == pattern(MiB, 71)[3:200003]

    outside = Buf(64, fill=b"\x22")
    bid = a.e.transfer_submit_write(b.name, a.buf.addr, outside.addr, 64)
    if bid != 0:
        st = wait_until(lambda: a.e.transfer_check_status(bid) or None, "transfer_check_status != 0")
        assert st in (-1, -2)
    assert outside.raw == b"\x22" * 64


def test_async_submit_to_an_unknown_segment_returns_zero(master):
    e = TransferEngine()
    name = "127.0.0.1:%d" % free_port()
    assert e.initialize(name, master.metadata, "tcp", "") == 0
    local = Buf(4096)
    assert e.register_memory(local.addr, 4096) == 0
    nowhere = "no-such-segment-%s:1" % unique()
    assert e.batch_transfer_async_write(nowhere, [local.addr], [0x10000], [4096]) == 0
    assert e.batch_transfer_async_read(nowhere, [local.addr], [0x10000], [4096]) == 0
    assert e.batch_transfer_async(nowhere, [local.addr], [0x10000], [4096], TransferOpcode.Write) == 0
    assert e.transfer_submit_write(nowhere, local.addr, 0x10000, 4096) == 0
    p2p = TransferEngine()
    assert p2p.initialize("127.0.0.1", "P2PHANDSHAKE", "tcp", "") == 0
    assert p2p.register_memory(local.addr, 4096) == 0
    dead = "127.0.0.1:%d" % free_port()
    assert p2p.batch_transfer_async_write(dead, [local.addr], [0x10000], [4096]) == 0


# ------------------------------------------------------------------ metadata server, names


def test_engines_on_an_http_metadata_server_find_each_other_by_name(master):
    ends = []
    for seed in (81, 82):
        e = TransferEngine()
        name = "127.0.0.1:%d" % free_port()
        assert e.initialize(name, master.metadata, "tcp", "") == 0
        buf = Buf(65536, content=pattern(65536, seed))
        assert e.register_memory(buf.addr, 65536) == 0
        ends.append((e, name, buf))
    (ea, na, ba), (eb, nb, bb) = ends
    assert ea.get_first_buffer_address(nb) == bb.addr
    assert eb.get_first_buffer_address(na) == ba.addr
    assert ea.transfer_sync_write(nb, ba.addr, bb.addr + 1, 1000) == 0
    assert bb.read(1, 1000) == pattern(65536, 81)[:1000]
    assert eb.transfer_sync_read(na, bb.addr + 5000, ba.addr + 60000, 5536) == 0
    assert bb.read(5000, 5536) == pattern(65536, 81)[60000:]
    assert ea.send_probe(nb) == 0


def test_initialize_ext_with_metadata_type(master):
    url = master.metadata
    assert url.startswith("http://")
    e = TransferEngine()
    assert e.initialize_ext("127.0.0.1:%d" % free_port(), url[len("http://") :], "tcp", "", "http") == 0
    e2 = TransferEngine()
    assert e2.initialize_ext("127.0.0.1", "P2PHANDSHAKE", "tcp", "", "p2p") == 0
    assert e2.get_rpc_port() > 0


def test_get_first_buffer_address_over_p2p():
    owner = TransferEngine()
    assert owner.initialize("127.0.0.1", "P2PHANDSHAKE", "tcp", "") == 0
    buf = Buf(12345)
    assert owner.register_memory(buf.addr, 12345) == 0
    viewer = TransferEngine()
    assert viewer.initialize("127.0.0.1", "P2PHANDSHAKE", "tcp", "") == 0
    assert viewer.get_first_buffer_address("127.0.0.1:%d" % owner.get_rpc_port()) == buf.addr


# ------------------------------------------------------------------ memory


def test_register_unregister_memory(pair):
    a, b = pair
    extra = Buf(8192, content=pattern(8192, 91))
    assert b.e.register_memory(extra.addr, 8192, "cpu:0") == 0
    reset(a, 92)
    assert a.e.transfer_sync_read(b.name, a.buf.addr, extra.addr, 8192) == 0
    assert a.buf.read(0, 8192) == pattern(8192, 91)
    assert b.e.unregister_memory(extra.addr) == 0
    reset(a, 92)
    assert a.e.transfer_sync_read(b.name, a.buf.addr, extra.addr, 8192) < 0
    assert a.buf.raw == pattern(MiB, 92)
    assert b.e.unregister_memory(extra.addr) != 0, "unregistering twice succeeded"


def test_batch_register_and_unregister_memory(pair):
    a, b = pair
    bufs = [Buf(4096 * (i + 1), content=pattern(4096 * (i + 1), 100 + i)) for i in range(3)]
    assert b.e.batch_register_memory([x.addr for x in bufs], [x.size for x in bufs]) == 0
    for i, x in enumerate(bufs):
        reset(a, 0)
        assert a.e.transfer_sync_read(b.name, a.buf.addr, x.addr, x.size) == 0
        assert a.buf.read(0, x.size) == pattern(x.size, 100 + i)
    assert b.e.batch_unregister_memory([x.addr for x in bufs]) == 0
    for x in bufs:
        assert a.e.transfer_sync_read(b.name, a.buf.addr, x.addr, 16) < 0


def test_managed_buffers():
    e = TransferEngine()
    assert e.initialize("127.0.0.1", "P2PHANDSHAKE", "tcp", "") == 0
    addrs = []
    for size in (1, 4096, 65536, 3 * MiB + 7):
        addr = e.allocate_managed_buffer(size)
        assert isinstance(addr, int) and addr != 0
        data = pattern(size, size)
        e.write_bytes_to_buffer(addr, data, size)
        assert e.read_bytes_from_buffer(addr, size) == data
        addrs.append((addr, size))
    starts = sorted(a for a, _ in addrs)
    spans = sorted(addrs)
    for (a1, s1), (a2, _) in zip(spans, spans[1:]):
        assert a1 + s1 <= a2, "managed buffers overlap"
    assert len(set(starts)) == len(starts)
    # managed buffers are registered: a peer reads one
    peer = TransferEngine()
    assert peer.initialize("127.0.0.1", "P2PHANDSHAKE", "tcp", "") == 0
    dst = peer.allocate_managed_buffer(65536)
    assert dst != 0
    addr64k = [a for a, s in addrs if s == 65536][0]
    assert peer.transfer_sync_read("127.0.0.1:%d" % e.get_rpc_port(), dst, addr64k, 65536) == 0
    assert peer.read_bytes_from_buffer(dst, 65536) == pattern(65536, 65536)
    for addr, size in addrs:
        e.free_managed_buffer(addr, size)
    peer.free_managed_buffer(dst, 65536)


def test_allocate_managed_buffer_failure_returns_zero():
    e = TransferEngine()
    assert e.initialize("127.0.0.1", "P2PHANDSHAKE", "tcp", "") == 0
    assert e.allocate_managed_buffer(1 << 62) == 0


# ------------------------------------------------------------------ notifications, probes


def test_notify_reaches_the_peer(pair):
    a, b = pair
    b.e.get_notifies()  # drain
    msg = "done-" + unique()
    n = TransferNotify("req-7", msg)
    assert a.e.transfer_sync(b.name, a.buf.addr, b.buf.addr, 128, TransferOpcode.Write, n) == 0
    seen = []

    def got():
        seen.extend(b.e.get_notifies())
        return [x for x in seen if x.msg == msg]

    found = wait_until(got, "the notify at the peer")
    assert found[0].name == "req-7"  # the sender's chosen name, as upstream delivers it
    assert all(isinstance(x, TransferNotify) for x in seen)
    assert a.e.batch_transfer_sync(b.name, [a.buf.addr], [b.buf.addr], [8], TransferOpcode.Write, TransferNotify("req-8", msg + "b")) == 0
    wait_until(lambda: got() and [x for x in seen if x.msg == msg + "b"], "the batch notify at the peer")


def test_registering_unmapped_memory_is_refused():
    e = TransferEngine()
    assert e.initialize("127.0.0.1", "P2PHANDSHAKE", "tcp", "") == 0
    # A page-aligned hole: map two pages and unmap the second.
    import mmap

    m = mmap.mmap(-1, 2 * mmap.PAGESIZE)
    base = ctypes.addressof(ctypes.c_char.from_buffer(m))
    hole = base + mmap.PAGESIZE
    libc = ctypes.CDLL(None, use_errno=True)
    libc.munmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t]
    assert libc.munmap(hole, mmap.PAGESIZE) == 0
    assert e.register_memory(hole, 4096) < 0
    assert e.register_memory(base, 2 * mmap.PAGESIZE) < 0  # straddles the hole
    assert e.register_memory(base, mmap.PAGESIZE) == 0
    assert e.unregister_memory(base) == 0


def test_send_probe(pair):
    a, b = pair
    assert a.e.send_probe(b.name) == 0
    assert a.e.send_probe("127.0.0.1:%d" % free_port()) != 0


def test_get_engine_is_shareable_with_a_store(master):
    from mooncake.store import MooncakeDistributedStore

    e = TransferEngine()
    assert e.initialize("127.0.0.1:%d" % free_port(), master.metadata, "tcp", "") == 0
    handle = e.get_engine()
    assert handle is not None
    s = MooncakeDistributedStore()
    try:
        assert s.setup("127.0.0.1", master.metadata, 16 * MiB, 16 * MiB, "tcp", "", master.rpc, handle) == 0
        # One engine: the store's segment is the engine's, and memory the engine
        # registered serves the store's zero-copy calls without register_buffer.
        assert s.get_hostname() == e.get_session_id()
        k = unique("shared-engine")
        assert s.put(k, b"through a shared engine") == 0
        assert s.get(k) == b"through a shared engine"
        buf = e.allocate_managed_buffer(8192)
        assert buf != 0
        e.write_bytes_to_buffer(buf, b"z" * 4096, 4096)
        k2 = unique("shared-zero-copy")
        assert s.put_from(k2, buf, 4096) == 0
        assert s.get_into(k2, buf + 4096, 4096) == 4096
        assert e.read_bytes_from_buffer(buf + 4096, 4096) == b"z" * 4096
    finally:
        s.close()
    # The engine outlives the store that shared it.
    peer = TransferEngine()
    assert peer.initialize("127.0.0.1:%d" % free_port(), master.metadata, "tcp", "") == 0
    assert peer.send_probe(e.get_session_id()) == 0
