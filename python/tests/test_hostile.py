"""Hostile input at the Python boundary (docs/python.md, Conventions): wrong types,
negative and huge sizes, None raise TypeError/ValueError (lists of unequal length fail
with INVALID_PARAMS, as upstream) and change nothing; unregistered addresses given to zero-copy calls are refused (a negative
code) and never read; keys over 4096 bytes get -400 each; soft_pin_ttl_ms accepts only
None or an int in [0, 2^64).

Calls that would crash a process that reads or writes a bogus address run in a child
interpreter, so a crash fails one test instead of the whole run."""

import textwrap

import pytest

from fixtures_extra import *  # noqa: F401,F403

pytest.importorskip("mooncake.store")
from mooncake.engine import TransferEngine  # noqa: E402
from mooncake.store import MooncakeDistributedStore, ReplicateConfig  # noqa: E402

INVALID_KEY = -400
BAD = (TypeError, ValueError)
HUGE = 2**64  # does not fit the u64 a size is
# An address inside the first page: never mapped, so reading it would crash the process.
BOGUS_ADDR = 0x10


@pytest.fixture(scope="module")
def st(module_master):
    s = new_store(module_master)
    yield s
    s.close()


@pytest.fixture(scope="module")
def engines():
    a, b = TransferEngine(), TransferEngine()
    for e in (a, b):
        assert e.initialize("127.0.0.1", "P2PHANDSHAKE", "tcp", "") == 0
    abuf, bbuf = Buf(65536, content=pattern(65536, 1)), Buf(65536, content=pattern(65536, 2))
    assert a.register_memory(abuf.addr, 65536) == 0
    assert b.register_memory(bbuf.addr, 65536) == 0
    yield a, abuf, b, bbuf, "127.0.0.1:%d" % b.get_rpc_port()


# ------------------------------------------------------------------ ReplicateConfig


@pytest.mark.parametrize("bad", [-1, HUGE, 1.5, "x", True, [], b"1"])
def test_soft_pin_ttl_rejects_anything_but_none_or_a_u64(bad):
    cfg = ReplicateConfig()
    cfg.soft_pin_ttl_ms = 5000
    with pytest.raises(TypeError):
        cfg.soft_pin_ttl_ms = bad
    assert cfg.soft_pin_ttl_ms == 5000, "a rejected value changed the attribute"


@pytest.mark.parametrize("good", [None, 0, 1, 30 * 60 * 1000, HUGE - 1])
def test_soft_pin_ttl_accepts_none_and_u64(good):
    cfg = ReplicateConfig()
    cfg.soft_pin_ttl_ms = good
    assert cfg.soft_pin_ttl_ms == good


def test_replicate_config_attribute_types():
    cfg = ReplicateConfig()
    with pytest.raises(BAD):
        cfg.replica_num = "two"
    with pytest.raises(BAD):
        cfg.replica_num = -1
    with pytest.raises(BAD):
        cfg.preferred_segments = "not-a-list"
    with pytest.raises(BAD):
        cfg.group_ids = "not-a-list"
    assert cfg.replica_num == 1 and cfg.preferred_segments == [] and cfg.group_ids is None
    cfg.group_ids = []
    assert cfg.group_ids == []


# ------------------------------------------------------------------ store setup


def _setup_args(master, **over):
    args = dict(
        local_hostname="127.0.0.1",
        metadata_server=master.metadata,
        global_segment_size=4 * MiB,
        local_buffer_size=4 * MiB,
        protocol="tcp",
        rdma_devices="",
        master_server_addr=master.rpc,
    )
    args.update(over)
    return args


def _assert_rejected(call):
    s = MooncakeDistributedStore()
    try:
        rc = call(s)
    except BAD:
        rc = None
    assert rc is None or (isinstance(rc, int) and rc != 0), "accepted: returned %r" % (rc,)
    assert s.health_check() == 1, "a rejected setup left the store set up"


@pytest.mark.parametrize("size", ["10%", "-1", "4XB", "", "GB", -1, HUGE, [4]])
def test_setup_dict_rejects_bad_sizes(master, size):
    conf = _setup_args(master, global_segment_size=size)
    _assert_rejected(lambda s: s.setup(conf))


def test_setup_dict_needs_metadata_server_and_local_hostname(master):
    for missing in ("metadata_server", "local_hostname"):
        conf = _setup_args(master)
        del conf[missing]
        _assert_rejected(lambda s: s.setup(conf))


@pytest.mark.parametrize(
    "over",
    [
        {"global_segment_size": -1},
        {"global_segment_size": HUGE},
        {"local_buffer_size": -5},
        {"global_segment_size": "10%"},
        {"global_segment_size": None},
        {"local_hostname": None},
        {"metadata_server": 8080},
        {"master_server_addr": None},
    ],
)
def test_setup_positional_rejects_bad_arguments(master, over):
    a = _setup_args(master, **over)
    _assert_rejected(lambda s: s.setup(*a.values()))


def test_setup_needs_seven_positionals_and_knows_its_keywords(master):
    a = list(_setup_args(master).values())
    s = MooncakeDistributedStore()
    with pytest.raises(TypeError):
        s.setup(*a[:6])
    with pytest.raises(TypeError):
        s.setup(*a, no_such_keyword=1)
    assert s.health_check() == 1


# ------------------------------------------------------------------ store: keys and types


def test_keys_over_4096_bytes_get_400_each(st):
    long_key = "L" * 4097
    edge = unique().ljust(4096, "e")
    assert len(edge) == 4096
    assert st.put(edge, b"4096-byte key is fine") == 0
    assert st.get(edge) == b"4096-byte key is fine"
    assert st.put(long_key, b"x") == INVALID_KEY
    assert st.is_exist(long_key) == INVALID_KEY
    assert st.get(long_key) == b""
    assert st.get_buffer(long_key) is None
    assert st.get_batch([long_key]) == [b""]
    assert st.remove(long_key) == INVALID_KEY
    assert st.get_size(long_key) == INVALID_KEY
    src = Buf(64, content=pattern(64, 3))
    assert st.register_buffer(src.addr, 64) == 0
    assert st.put_from(long_key, src.addr, 64) == INVALID_KEY
    assert st.get_into(long_key, src.addr, 64) == INVALID_KEY
    good = unique()
    assert st.batch_put_from([good, long_key], [src.addr, src.addr], [64, 64]) == [0, INVALID_KEY]
    assert st.batch_is_exist([good, long_key, edge]) == [1, INVALID_KEY, 1]
    res = st.batch_get_into([long_key, good], [src.addr, src.addr], [64, 64])
    assert res == [INVALID_KEY, 64]
    assert st.batch_remove([long_key, good], force=True) == [INVALID_KEY, 0]


@pytest.mark.parametrize(
    "call",
    [
        lambda s: s.put(None, b"x"),
        lambda s: s.put(123, b"x"),
        lambda s: s.put("k", None),
        lambda s: s.put("k", 123),
        lambda s: s.get(None),
        lambda s: s.is_exist(None),
        lambda s: s.batch_is_exist(None),
        lambda s: s.batch_is_exist("abc"),
        lambda s: s.batch_is_exist(["a", None]),
        lambda s: s.remove(None),
        lambda s: s.put_parts("k", b"a", None),
        lambda s: s.put_batch(["a"], None),
        lambda s: s.get_batch([1, 2]),
        lambda s: s.put_from("k", "addr", 10),
        lambda s: s.put_from("k", None, 10),
        lambda s: s.get_into("k", 1.5, 10),
        lambda s: s.register_buffer(None, 10),
        lambda s: s.put("k", b"x", "not-a-config"),
    ],
)
def test_wrong_types_raise_type_error(st, call):
    with pytest.raises(TypeError):
        call(st)


def test_wrong_types_change_nothing(st):
    k = unique()
    with pytest.raises(TypeError):
        st.put(k, None)
    with pytest.raises(TypeError):
        st.put_parts(k, b"a", None)
    assert st.is_exist(k) == 0


@pytest.mark.parametrize("size", [-1, -4096, HUGE, 2**70])
def test_negative_and_unrepresentable_sizes_raise(st, size):
    b = Buf(4096)
    assert st.register_buffer(b.addr, 4096) == 0
    k = unique()
    with pytest.raises(BAD):
        st.put_from(k, b.addr, size)
    with pytest.raises(BAD):
        st.get_into(k, b.addr, size)
    with pytest.raises(BAD):
        st.batch_put_from([k], [b.addr], [size])
    with pytest.raises(BAD):
        st.register_buffer(b.addr, size)
    assert st.is_exist(k) == 0


def test_huge_size_over_a_small_registration_is_refused(st):
    b = Buf(4096, content=pattern(4096, 4))
    assert st.register_buffer(b.addr, 4096) == 0
    k = unique()
    assert st.put_from(k, b.addr, 1 << 40) < 0
    assert st.is_exist(k) == 0
    assert st.put(k, b"x" * 10) == 0
    rc = st.get_into(k, b.addr, 1 << 40)
    # Either refused (the claimed range is not registered) or the 10-byte object read.
    assert rc == 10 or rc < 0, rc
    assert b.read(10) == pattern(4096, 4)[10:]


def test_unequal_batch_lists_fail_and_store_nothing(st):
    # As upstream: INVALID_PARAMS (per key where the call returns a list), nothing sent.
    b = Buf(3 * 4096, content=pattern(3 * 4096, 5))
    assert st.register_buffer(b.addr, b.size) == 0
    keys = [unique() for _ in range(3)]
    addrs = [b.addr, b.addr + 4096, b.addr + 8192]
    assert st.batch_put_from(keys, addrs[:2], [4096] * 3) == [-600] * 3
    assert st.batch_put_from(keys, addrs, [4096] * 2) == [-600] * 3
    assert st.put_batch(keys, [b"a", b"b"]) == -600
    assert st.batch_put_from_multi_buffers(keys, [[a] for a in addrs[:2]],
                                           [[4096]] * 3) == [-600] * 3
    # inner lists of unequal length
    assert st.batch_put_from_multi_buffers(keys[:1], [[addrs[0], addrs[1]]], [[4096]]) == [-600]
    assert st.batch_upsert_from(keys, addrs, [4096]) == [-600] * 3
    with pytest.raises(TypeError):  # one bad element: nothing of the batch is stored
        st.batch_put_from(keys, [addrs[0], None, addrs[2]], [4096] * 3)
    assert st.batch_is_exist(keys) == [0, 0, 0]


def test_unequal_get_lists_fail_and_write_nothing(st):
    k = unique()
    assert st.put(k, pattern(4096, 6)) == 0
    out = Buf(8192, fill=b"\x33")
    assert st.register_buffer(out.addr, 8192) == 0
    assert st.batch_get_into([k, k], [out.addr], [4096, 4096]) == [-600, -600]
    assert st.batch_get_into([k], [out.addr, out.addr + 4096], [4096]) == [-600]
    assert st.batch_get_into_multi_buffers([k], [[out.addr, out.addr + 2048]],
                                           [[2048]]) == [-600]
    # a key whose range lists disagree fails its ranges; the call's other keys go on
    assert st.get_into_ranges([out.addr], [[k, k]], [[[0], [100]]],
                              [[[0, 1], [0]]], [[[16], [16]]]) == [[[-600], [16]]]
    assert out.raw[:100] == b"\x33" * 100
    assert out.raw[100:116] == pattern(4096, 6)[:16]
    assert out.raw[116:] == b"\x33" * (8192 - 116)


def test_unregistered_addresses_are_refused(st):
    k = unique()
    loose = Buf(4096, content=pattern(4096, 7))  # never registered
    assert st.put_from(k, loose.addr, 4096) < 0
    assert st.is_exist(k) == 0
    assert st.put(k, pattern(4096, 8)) == 0
    assert st.get_into(k, loose.addr, 4096) < 0
    assert loose.raw == pattern(4096, 7), "get_into wrote into an unregistered buffer"
    # a registration covering only half of the range
    half = Buf(8192, fill=b"\x44")
    assert st.register_buffer(half.addr, 4096) == 0
    assert st.get_into(k, half.addr + 2048, 4096) < 0
    assert half.read(4096) == b"\x44" * 4096
    k2 = unique()
    assert st.put_from(k2, half.addr + 2048, 4096) < 0
    assert st.is_exist(k2) == 0
    # per key in a batch
    reg = Buf(4096, fill=b"\x55")
    assert st.register_buffer(reg.addr, 4096) == 0
    res = st.batch_get_into([k, k], [reg.addr, loose.addr], [4096, 4096])
    assert res[0] == 4096 and res[1] < 0
    assert reg.raw == pattern(4096, 8) and loose.raw == pattern(4096, 7)
    k3, k4 = unique(), unique()
    res = st.batch_put_from_multi_buffers([k3, k4], [[reg.addr], [reg.addr, loose.addr]], [[100], [100, 100]])
    assert res[0] == 0 and res[1] < 0
    assert st.batch_is_exist([k3, k4]) == [1, 0]


def test_bogus_addresses_are_never_read(master):
    """put_from/get_into/batch calls with an unmapped address return a negative code; a
    package that touched the address would crash the child."""
    code = textwrap.dedent(
        """
        from mooncake.store import MooncakeDistributedStore
        s = MooncakeDistributedStore()
        assert s.setup("127.0.0.1", %r, 4 << 20, 4 << 20, "tcp", "", %r) == 0
        A = %d
        r = [s.put_from("bogus-a", A, 4096), s.get_into("bogus-a", A, 4096)]
        assert s.put("bogus-b", b"y" * 4096) == 0
        r.append(s.get_into("bogus-b", A, 4096))
        r += s.batch_put_from(["bogus-c"], [A], [4096])
        r += s.batch_get_into(["bogus-b"], [A], [4096])
        r += s.batch_put_from_multi_buffers(["bogus-d"], [[A]], [[4096]])
        r += s.batch_get_into_multi_buffers(["bogus-b"], [[A]], [[4096]])
        print("codes", r)
        print("exist", s.batch_is_exist(["bogus-a", "bogus-c", "bogus-d"]))
        s.close()
        """
        % (master.metadata, master.rpc, BOGUS_ADDR)
    )
    rc, out, err = run_isolated(code)
    assert rc == 0, "child died (%d): %s" % (rc, err[-2000:])
    codes = eval(out.split("codes", 1)[1].splitlines()[0])
    assert all(isinstance(c, int) and c < 0 for c in codes), codes
    assert "exist [0, 0, 0]" in out, out


def test_store_calls_before_setup_do_not_crash():
    code = textwrap.dedent(
        """
        from mooncake.store import MooncakeDistributedStore
        s = MooncakeDistributedStore()
        out = []
        for name, call in [
            ("put", lambda: s.put("k", b"v")),
            ("get", lambda: s.get("k")),
            ("is_exist", lambda: s.is_exist("k")),
            ("remove", lambda: s.remove("k")),
            ("get_into", lambda: s.get_into("k", 0x10, 16)),
            ("put_from", lambda: s.put_from("k", 0x10, 16)),
            ("register_buffer", lambda: s.register_buffer(0x10, 16)),
            ("batch_is_exist", lambda: s.batch_is_exist(["k"])),
            ("close", lambda: s.close()),
        ]:
            try:
                out.append((name, repr(call())))
            except Exception as e:
                out.append((name, type(e).__name__))
        print("health", s.health_check())
        print("results", out)
        """
    )
    rc, out, err = run_isolated(code)
    assert rc == 0, "child died (%d): %s" % (rc, err[-2000:])
    assert "health 1" in out
    res = dict(eval(out.split("results", 1)[1].strip()))
    assert res["put"] != "0" and res["put_from"] != "0" and res["register_buffer"] != "0", res
    assert res["get"] == "b''" or not res["get"].startswith("b"), res
    assert res["is_exist"] not in ("1", "0"), res


# ------------------------------------------------------------------ engine


@pytest.mark.parametrize(
    "call",
    [
        lambda e, a, t: e.register_memory("addr", 10),
        lambda e, a, t: e.register_memory(None, 10),
        lambda e, a, t: e.batch_register_memory(None, [10]),
        lambda e, a, t: e.transfer_sync_write(None, a, a, 10),
        lambda e, a, t: e.transfer_sync_write(t, "a", a, 10),
        lambda e, a, t: e.transfer_sync_read(t, a, None, 10),
        lambda e, a, t: e.transfer_sync(t, a, a, 10, "write"),
        lambda e, a, t: e.batch_transfer_sync_write(t, a, [a], [10]),
        lambda e, a, t: e.batch_transfer_async_write(t, [a], [a], ["10"]),
        lambda e, a, t: e.get_batch_transfer_status(None),
        lambda e, a, t: e.write_bytes_to_buffer(a, None, 10),
        lambda e, a, t: e.send_probe(None),
        lambda e, a, t: e.get_first_buffer_address(None),
    ],
)
def test_engine_wrong_types_raise_type_error(engines, call):
    a, abuf, b, bbuf, target = engines
    with pytest.raises(TypeError):
        call(a, abuf.addr, target)


def test_engine_initialize_wrong_types():
    e = TransferEngine()
    with pytest.raises(TypeError):
        e.initialize(None, "P2PHANDSHAKE", "tcp", "")
    with pytest.raises(TypeError):
        e.initialize("127.0.0.1", "P2PHANDSHAKE", "tcp")
    with pytest.raises(TypeError):
        e.initialize(1, 2, 3, 4)


@pytest.mark.parametrize(
    "args",
    [
        ("127.0.0.1", "bogus://x", "tcp", ""),
        ("127.0.0.1", "P2PHANDSHAKE", "no-such-protocol", ""),
        ("127.0.0.1", "http://127.0.0.1:%d/metadata" % free_port(), "tcp", ""),
    ],
)
def test_engine_initialize_failures_are_reported(args):
    e = TransferEngine()
    try:
        rc = e.initialize(*args)
    except BAD:
        rc = None
    assert rc is None or rc != 0, "initialize%r returned 0" % (args,)


@pytest.mark.parametrize("size", [-1, HUGE, 2**80])
def test_engine_bad_sizes_raise_and_change_nothing(engines, size):
    a, abuf, b, bbuf, target = engines
    before = bbuf.raw
    with pytest.raises(BAD):
        a.transfer_sync_write(target, abuf.addr, bbuf.addr, size)
    with pytest.raises(BAD):
        a.batch_transfer_sync_write(target, [abuf.addr], [bbuf.addr], [size])
    with pytest.raises(BAD):
        a.transfer_submit_write(target, abuf.addr, bbuf.addr, size)
    with pytest.raises(BAD):
        a.register_memory(abuf.addr, size)
    with pytest.raises(BAD):
        a.allocate_managed_buffer(size)
    assert bbuf.raw == before


def test_engine_unequal_lists_raise_and_change_nothing(engines):
    a, abuf, b, bbuf, target = engines
    before = bbuf.raw
    with pytest.raises(BAD):
        a.batch_transfer_sync_write(target, [abuf.addr, abuf.addr + 8], [bbuf.addr], [8, 8])
    with pytest.raises(BAD):
        a.batch_transfer_sync_write(target, [abuf.addr], [bbuf.addr], [8, 8])
    with pytest.raises(BAD):
        a.batch_transfer_async_write(target, [abuf.addr], [bbuf.addr, bbuf.addr], [8])
    with pytest.raises(BAD):
        a.batch_transfer_sync(target, [abuf.addr], [], [8], 1)
    assert bbuf.raw == before
    # a batch registration of unequal lists registers nothing
    x, y = Buf(4096, content=pattern(4096, 9)), Buf(4096)
    with pytest.raises(BAD):
        b.batch_register_memory([x.addr, y.addr], [4096])
    assert a.transfer_sync_read(target, abuf.addr, x.addr, 4096) < 0
    assert abuf.raw == pattern(65536, 1)


def test_engine_huge_length_over_a_registration_is_refused(engines):
    a, abuf, b, bbuf, target = engines
    before = bbuf.raw
    assert a.transfer_sync_write(target, abuf.addr, bbuf.addr, 1 << 40) < 0
    assert bbuf.raw == before


def test_engine_bogus_local_address_is_never_read():
    code = textwrap.dedent(
        """
        import ctypes
        from mooncake.engine import TransferEngine
        a, b = TransferEngine(), TransferEngine()
        for e in (a, b):
            assert e.initialize("127.0.0.1", "P2PHANDSHAKE", "tcp", "") == 0
        dst = (ctypes.c_char * 4096)()
        assert b.register_memory(ctypes.addressof(dst), 4096) == 0
        t = "127.0.0.1:%%d" %% b.get_rpc_port()
        A, D = %d, ctypes.addressof(dst)
        r = [a.transfer_sync_write(t, A, D, 4096), a.transfer_sync_read(t, A, D, 4096),
             a.batch_transfer_sync_write(t, [A], [D], [4096])]
        bid = a.batch_transfer_async_write(t, [A], [D], [4096])
        if bid != 0:
            r.append(a.get_batch_transfer_status([bid]))
        print("codes", r)
        print("untouched", dst.raw == bytes(4096))
        """
        % BOGUS_ADDR
    )
    rc, out, err = run_isolated(code)
    assert rc == 0, "child died (%d): %s" % (rc, err[-2000:])
    codes = eval(out.split("codes", 1)[1].splitlines()[0])
    assert all(c < 0 for c in codes), codes
    assert "untouched True" in out


def test_engine_calls_before_initialize_do_not_crash():
    code = textwrap.dedent(
        """
        import ctypes
        from mooncake.engine import TransferEngine
        e = TransferEngine()
        buf = (ctypes.c_char * 64)()
        A = ctypes.addressof(buf)
        out = []
        for name, call in [
            ("register_memory", lambda: e.register_memory(A, 64)),
            ("transfer_sync_write", lambda: e.transfer_sync_write("127.0.0.1:1", A, A, 64)),
            ("batch_transfer_async_write", lambda: e.batch_transfer_async_write("127.0.0.1:1", [A], [A], [64])),
            ("allocate_managed_buffer", lambda: e.allocate_managed_buffer(64)),
            ("send_probe", lambda: e.send_probe("127.0.0.1:1")),
        ]:
            try:
                out.append((name, repr(call())))
            except Exception as ex:
                out.append((name, type(ex).__name__))
        print("results", out)
        """
    )
    rc, out, err = run_isolated(code)
    assert rc == 0, "child died (%d): %s" % (rc, err[-2000:])
    res = dict(eval(out.split("results", 1)[1].strip()))
    assert res["register_memory"] != "0" and res["transfer_sync_write"] != "0", res
    assert res["batch_transfer_async_write"] != "1", res
    assert res["allocate_managed_buffer"] in ("0", "RuntimeError", "ValueError"), res


@pytest.mark.parametrize(
    "call",
    [
        "e.write_bytes_to_buffer(%d, b'x', 1)" % BOGUS_ADDR,
        "e.read_bytes_from_buffer(%d, 1)" % BOGUS_ADDR,
    ],
)
def test_engine_buffer_helpers_refuse_bogus_addresses(call):
    """write_bytes_to_buffer/read_bytes_from_buffer on an address no buffer covers are
    refused (an error code, b"" or an exception), never carried out."""
    code = textwrap.dedent(
        """
        from mooncake.engine import TransferEngine
        e = TransferEngine()
        assert e.initialize("127.0.0.1", "P2PHANDSHAKE", "tcp", "") == 0
        try:
            print("result", repr(%s))
        except Exception as ex:
            print("result", type(ex).__name__)
        """
        % call
    )
    rc, out, err = run_isolated(code)
    assert rc == 0, "%s crashed the process (exit %d)" % (call, rc)
    res = out.split("result", 1)[1].strip()
    assert res not in ("0", "b'\\x00'"), res
    assert not (res.lstrip("-").isdigit() and int(res) >= 0), res


def test_engine_write_bytes_length_must_match_data():
    e = TransferEngine()
    assert e.initialize("127.0.0.1", "P2PHANDSHAKE", "tcp", "") == 0
    addr = e.allocate_managed_buffer(64)
    assert addr != 0
    e.write_bytes_to_buffer(addr, b"\x07" * 64, 64)
    with pytest.raises(BAD):
        e.write_bytes_to_buffer(addr, b"abc", 10)
    with pytest.raises(BAD):
        e.write_bytes_to_buffer(addr, b"abc", -1)
    with pytest.raises(BAD):
        e.read_bytes_from_buffer(addr, -1)
    assert e.read_bytes_from_buffer(addr, 64) == b"\x07" * 64
    e.free_managed_buffer(addr, 64)
