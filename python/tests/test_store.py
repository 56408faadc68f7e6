"""mooncake.store.MooncakeDistributedStore: every method of docs/python.md and the
semantics of docs/store.md that callers rely on (hostile input: test_hostile.py)."""

import ctypes
import decimal
import fractions

import pytest

from fixtures_extra import *  # noqa: F401,F403

pytest.importorskip("mooncake.store")
from mooncake.store import MooncakeDistributedStore, ReplicateConfig  # noqa: E402

OBJECT_NOT_FOUND = -704
OBJECT_HAS_LEASE = -706
NO_AVAILABLE_HANDLE = -200


@pytest.fixture(scope="module")
def st(module_master):
    """One store (16 MiB segment, 16 MiB staging buffer) for the plain-semantics tests;
    keys are unique per test."""
    s = new_store(module_master)
    yield s
    s.close()


def registered(store, size, seed=None, fill=b"\0"):
    b = Buf(size, content=pattern(size, seed)) if seed is not None else Buf(size, fill=fill)
    assert store.register_buffer(b.addr, size) == 0
    return b


# ------------------------------------------------------------------ set-up, identity, health


def test_health_check_before_and_after_setup(master):
    s = MooncakeDistributedStore()
    assert s.health_check() == 1
    assert s.setup("127.0.0.1", master.metadata, 4 * MiB, 4 * MiB, "tcp", "", master.rpc) == 0
    try:
        assert s.health_check() == 0
    finally:
        s.close()
    assert s.health_check() == 1


def test_get_hostname_reports_the_bound_port(master, store_factory):
    s = store_factory(master, 4 * MiB, 4 * MiB, host="127.0.0.1")
    name = s.get_hostname()
    host, _, port = name.rpartition(":")
    assert host == "127.0.0.1" and port.isdigit() and 0 < int(port) < 65536, name
    assert port_is_open("127.0.0.1", int(port)), "get_hostname() %s: nothing listens there" % name

    s2 = store_factory(master, 4 * MiB, 4 * MiB, host="localhost")
    host2, _, port2 = s2.get_hostname().rpartition(":")
    assert host2 == "localhost" and int(port2) > 0 and int(port2) != int(port)
    assert port_is_open("127.0.0.1", int(port2))


def test_get_hostname_keeps_a_given_port(master, store_factory):
    p = free_port()
    s = store_factory(master, 4 * MiB, 4 * MiB, host="127.0.0.1:%d" % p)
    assert s.get_hostname() == "127.0.0.1:%d" % p


def test_setup_with_p2phandshake_metadata_and_rdma_device_name(master, store_factory):
    a = store_factory(master, 8 * MiB, 4 * MiB, metadata="P2PHANDSHAKE")
    b = MooncakeDistributedStore()
    assert b.setup("127.0.0.1", "P2PHANDSHAKE", 8 * MiB, 4 * MiB, "tcp", "mlx5_0", master.rpc) == 0
    try:
        k = unique()
        v = pattern(300000, 1)
        assert a.put(k, v) == 0
        assert b.get(k) == v
    finally:
        b.close()


def test_setup_engine_keyword_none(master):
    s = MooncakeDistributedStore()
    assert s.setup("127.0.0.1", master.metadata, 4 * MiB, 4 * MiB, "tcp", "", master.rpc, engine=None) == 0
    s.close()


# ------------------------------------------------------------------ copying API


def test_put_get_roundtrip_and_miss(st):
    k = unique()
    v = pattern(123457, 2)
    assert st.put(k, v) == 0
    assert st.get(k) == v
    assert st.get(unique("missing")) == b""
    assert st.put(unique(), bytearray(b"bytearray")) == 0
    k2 = unique()
    assert st.put(k2, memoryview(b"0123456789")[2:6]) == 0
    assert st.get(k2) == b"2345"


def test_second_put_keeps_the_first_value(st):
    k = unique()
    assert st.put(k, b"first value") == 0
    assert st.put(k, b"a different, longer second value") == 0
    assert st.get(k) == b"first value"
    assert st.get_size(k) == len(b"first value")
    assert st.put_batch([k], [b"batch value"]) == 0
    src = registered(st, 64, seed=1)
    assert st.put_from(k, src.addr, 64) == 0
    assert st.batch_put_from([k], [src.addr], [64]) == [0]
    assert st.batch_put_from_multi_buffers([k], [[src.addr]], [[64]]) == [0]
    assert st.put_parts(k, b"parts") == 0
    assert st.get(k) == b"first value"


def test_upsert_replaces(st):
    # No reads between the writes: a read's lease may hold an upsert off (-706).
    k = unique()
    assert st.upsert(k, b"v1") == 0
    assert st.upsert(k, b"version two") == 0
    assert st.get(k) == b"version two"
    k2 = unique()
    assert st.put(k2, b"old") == 0
    assert st.upsert_parts(k2, b"ab", b"cd", b"e") == 0
    assert st.get(k2) == b"abcde"


def test_put_parts_concatenates(st):
    k = unique()
    parts = [pattern(1000, 3), b"", pattern(70000, 4), memoryview(pattern(5, 5))]
    assert st.put_parts(k, *parts) == 0
    assert st.get(k) == b"".join(bytes(p) for p in parts)
    k2 = unique()
    assert st.put_parts(k2, b"x", b"y", config=ReplicateConfig()) == 0
    assert st.get(k2) == b"xy"


def test_put_batch_get_batch(st):
    keys = [unique() for _ in range(5)]
    vals = [pattern(1000 * (i + 1), 10 + i) for i in range(5)]
    assert st.put_batch(keys, vals) == 0
    missing = unique("missing")
    got = st.get_batch(keys[:2] + [missing] + keys[2:])
    assert got == vals[:2] + [b""] + vals[2:]


def test_upsert_batch(st):
    keys = [unique() for _ in range(3)]
    assert st.put_batch(keys, [b"a", b"b", b"c"]) == 0
    assert st.upsert_batch(keys, [b"A1", b"B22", b"C333"]) == 0
    assert st.get_batch(keys) == [b"A1", b"B22", b"C333"]


def test_get_buffer_exposes_the_buffer_protocol(st):
    k = unique()
    v = pattern(65537, 6)
    assert st.put(k, v) == 0
    buf = st.get_buffer(k)
    assert buf is not None
    mv = memoryview(buf)
    assert mv.nbytes == len(v)
    assert mv.tobytes() == v
    assert st.get_buffer(unique("missing")) is None
    k2 = unique()
    assert st.put(k2, b"second") == 0
    got = st.batch_get_buffer([k, unique("missing"), k2])
    assert len(got) == 3
    assert memoryview(got[0]).tobytes() == v
    assert got[1] is None
    assert memoryview(got[2]).tobytes() == b"second"


def test_is_exist_and_get_size(st):
    k = unique()
    assert st.is_exist(k) == 0
    assert st.get_size(k) < 0
    assert st.put(k, b"12345") == 0
    assert st.is_exist(k) == 1
    assert st.get_size(k) == 5
    assert st.batch_is_exist([k, unique("missing"), k]) == [1, 0, 1]


def test_local_buffer_size_zero_fails_copying_puts_but_not_zero_copy(master, store_factory):
    s = store_factory(master, 8 * MiB, 0)
    k = unique()
    assert s.put(k, b"needs a staging buffer") < 0
    assert s.is_exist(k) == 0
    b = registered(s, 4096, seed=7)
    assert s.put_from(k, b.addr, 4096) == 0
    out = registered(s, 4096)
    assert s.get_into(k, out.addr, 4096) == 4096
    assert out.raw == pattern(4096, 7)


def test_pure_client_uses_other_segments(master, store_factory):
    store_factory(master, 16 * MiB, 4 * MiB)  # provides the space
    client = store_factory(master, 0, 4 * MiB)
    k = unique()
    v = pattern(200000, 8)
    assert client.put(k, v) == 0
    assert client.get(k) == v
    other = store_factory(master, 0, 4 * MiB)
    assert other.get(k) == v


# ------------------------------------------------------------------ remove and friends


def test_remove(st):
    k = unique()
    assert st.put(k, b"x") == 0
    assert st.remove(k) == 0
    assert st.is_exist(k) == 0
    assert st.get(k) == b""
    assert st.remove(k) == OBJECT_NOT_FOUND
    assert st.remove(unique("never"), False) == OBJECT_NOT_FOUND


def test_batch_remove(st):
    k1, k2, missing = unique(), unique(), unique("missing")
    assert st.put_batch([k1, k2], [b"1", b"2"]) == 0
    assert st.batch_remove([k1, missing, k2]) == [0, OBJECT_NOT_FOUND, 0]
    assert st.batch_is_exist([k1, k2]) == [0, 0]


def test_remove_by_regex(st):
    tag = unique("rx").replace("-", "_")
    doomed = ["%s_a_%d" % (tag, i) for i in range(4)]
    kept = ["%s_b_%d" % (tag, i) for i in range(3)]
    assert st.put_batch(doomed + kept, [b"v"] * 7) == 0
    assert st.remove_by_regex("^%s_a_.*" % tag) == 4
    assert st.batch_is_exist(doomed) == [0] * 4
    assert st.batch_is_exist(kept) == [1] * 3
    assert st.remove_by_regex("^%s_nothing$" % tag) == 0
    assert st.remove_by_regex("^%s_b_[01]$" % tag, force=True) == 2
    assert st.batch_is_exist(kept) == [0, 0, 1]


def test_remove_all(private_master, store_factory):
    s = store_factory(private_master, 8 * MiB, 4 * MiB)
    keys = [unique() for _ in range(6)]
    assert s.put_batch(keys, [b"x" * 100] * 6) == 0
    assert s.remove_all() == 6
    assert s.batch_is_exist(keys) == [0] * 6
    assert s.remove_all() == 0
    assert s.put(keys[0], b"again") == 0
    assert s.remove_all(force=True) == 1


def test_remove_of_a_leased_object_returns_706_until_the_ttl_passes(lease_master, store_factory):
    s = store_factory(lease_master, 8 * MiB, 4 * MiB)
    k = unique()
    assert s.put(k, b"leased") == 0
    assert s.get(k) == b"leased"  # a read grants the lease (500 ms on this master)
    assert s.remove(k) == OBJECT_HAS_LEASE
    assert s.is_exist(k) == 1
    attempts = []

    def removed():
        rc = s.remove(k)
        attempts.append(rc)
        return rc == 0

    wait_until(removed, "remove to succeed once the 500 ms lease expired", timeout=10)
    assert set(attempts[:-1]) <= {OBJECT_HAS_LEASE}, attempts
    assert s.is_exist(k) == 0


def test_forced_remove_ignores_the_lease(lease_master, store_factory):
    s = store_factory(lease_master, 8 * MiB, 4 * MiB)
    k = unique()
    assert s.put(k, b"leased") == 0
    assert s.get(k) == b"leased"
    assert s.remove(k) == OBJECT_HAS_LEASE
    assert s.remove(k, force=True) == 0
    assert s.is_exist(k) == 0


def test_replica_descriptors(st):
    k = unique()
    assert st.put(k, pattern(5000, 9)) == 0
    descs = list(st.get_replica_desc(k))
    assert len(descs) == 1
    assert descs[0].is_memory_replica() is True
    assert descs[0].is_disk_replica() is False
    missing = unique("missing")
    got = st.batch_get_replica_desc([k, missing])
    assert isinstance(got, dict)
    assert len(list(got[k])) == 1 and list(got[k])[0].is_memory_replica()
    assert not list(got.get(missing, []))


def test_batch_replica_clear(lease_master, store_factory):
    s = store_factory(lease_master, 8 * MiB, 4 * MiB)
    k, missing = unique(), unique("missing")
    assert s.put(k, b"to be cleared") == 0
    cleared = []

    def clear():
        res = s.batch_replica_clear([k, missing])
        assert isinstance(res, list) and all(isinstance(x, str) for x in res), res
        assert missing not in res
        cleared.extend(res)
        return k in res

    wait_until(clear, "batch_replica_clear to clear the key", timeout=10)
    assert s.is_exist(k) == 0
    assert s.get(k) == b""
    k2 = unique()
    assert s.put(k2, b"other segment name") == 0
    assert s.batch_replica_clear([k2], "no-such-segment:1") == []
    assert s.is_exist(k2) == 1


# ------------------------------------------------------------------ zero-copy API


def test_put_from_get_into(st):
    src = registered(st, 65536, seed=20)
    dst = registered(st, 65536, fill=b"\xee")
    k = unique()
    assert st.put_from(k, src.addr + 100, 50000) == 0
    assert st.get_size(k) == 50000
    assert st.get_into(k, dst.addr + 7, 50000) == 50000
    assert dst.read(7, 50000) == pattern(65536, 20)[100:50100]
    assert dst.read(0, 7) == b"\xee" * 7 and dst.read(50007) == b"\xee" * (65536 - 50007)
    assert st.get(k) == pattern(65536, 20)[100:50100]
    # a bigger buffer than needed: returns the object size
    assert st.get_into(k, dst.addr, 65536) == 50000
    # too small: an error, and nothing past the given size is written
    dst.write(0, b"\xee" * 65536)
    assert st.get_into(k, dst.addr, 49999) < 0
    assert dst.read(49999) == b"\xee" * (65536 - 49999)
    assert st.get_into(unique("missing"), dst.addr, 100) < 0
    assert st.put_from(k, src.addr, 10, ReplicateConfig()) == 0  # existing: kept
    assert st.get_size(k) == 50000


def test_batch_put_from_batch_get_into(st):
    src = registered(st, 8 * 4096, seed=21)
    dst = registered(st, 8 * 4096)
    keys = [unique() for _ in range(8)]
    addrs = [src.addr + i * 4096 for i in range(8)]
    assert st.batch_put_from(keys, addrs, [4096] * 8) == [0] * 8
    order = [3, 0, 7, 1, 6, 2, 5, 4]
    res = st.batch_get_into([keys[i] for i in order], [dst.addr + j * 4096 for j in range(8)], [4096] * 8)
    assert res == [4096] * 8
    full = pattern(8 * 4096, 21)
    for j, i in enumerate(order):
        assert dst.read(j * 4096, 4096) == full[i * 4096 : (i + 1) * 4096]
    res = st.batch_get_into([keys[0], unique("missing")], [dst.addr, dst.addr + 4096], [4096, 4096])
    assert res[0] == 4096 and res[1] < 0


@pytest.mark.parametrize("route", ["python-call", "ctypes"])
def test_regular_batch_reads_take_one_library_call_and_the_rest_answer_as_before(
        st, monkeypatch, route):
    """A regular batch (str keys, int spans in registered memory) is read by one library
    call: the function called in CPython's convention where the package has it, else
    the packed ctypes call. Anything irregular is declined by it untouched (or never
    reaches the ctypes call) and answered key by key as before."""
    from mooncake import _native as N
    from mooncake import store as S
    took = []  # per library call: whether it read the batch (False: declined)
    if route == "python-call":
        fast = S._FAST_BATCH_GET_INTO
        if fast is None:
            pytest.skip("this interpreter has no CPython-convention call")

        def counted_fast(*args):
            got = fast(*args)
            took.append(got is not None)
            return got

        monkeypatch.setattr(S, "_FAST_BATCH_GET_INTO", counted_fast)
    else:
        monkeypatch.setattr(S, "_FAST_BATCH_GET_INTO", None)
    real = N.LIB.mc_store_batch_get_into_packed
    codes = []

    def counted(*args):
        codes.append(real(*args))
        if route == "ctypes":
            took.append(codes[-1] == N.MC_OK)
        return codes[-1]

    monkeypatch.setattr(N.LIB, "mc_store_batch_get_into_packed", counted)
    src = registered(st, 3 * 4096, seed=31)
    dst = registered(st, 3 * 4096)
    keys = [unique() for _ in range(3)]
    assert st.batch_put_from(keys, [src.addr + i * 4096 for i in range(3)], [4096] * 3) == [0] * 3
    spans = [dst.addr + i * 4096 for i in range(3)]
    missing = unique("missing")
    assert st.batch_get_into(keys[::-1], spans, [4096] * 3) == [4096] * 3
    assert dst.read(0, 4096) == pattern(3 * 4096, 31)[2 * 4096:]
    got = st.batch_get_into([keys[0], missing, keys[1]], spans, [4096, 4096, 100])
    assert got[0] == 4096 and got[1] < 0 and got[2] < 0
    assert took == [True, True]
    # A span outside registered memory: declined, then key by key (the other keys
    # still read).
    outside = ctypes.create_string_buffer(4096)
    got = st.batch_get_into(keys[:2], [dst.addr, ctypes.addressof(outside)], [4096] * 2)
    assert got[0] == 4096 and got[1] < 0
    assert took[2] is False and codes[-1] == N.MC_ERR_ADDRESS_NOT_REGISTERED
    # A key with a NUL inside or an empty one: declined, failed alone.
    for bad in ("a\0b", ""):
        got = st.batch_get_into([keys[0], bad], spans[:2], [4096] * 2)
        assert got[0] == 4096 and got[1] < 0, bad
    assert len(took) == 5 and not any(took[2:])
    # Bytes keys, a bool size, a negative address, a float size equal to the others':
    # as before (the ctypes call never sees them; the CPython-convention one declines).
    assert st.batch_get_into([keys[0].encode(), keys[1]], spans[:2], [4096] * 2) == [4096] * 2
    with pytest.raises(TypeError):
        st.batch_get_into(keys[:2], spans[:2], [4096, True])
    with pytest.raises(ValueError):
        st.batch_get_into(keys[:2], [dst.addr, -1], [4096] * 2)
    with pytest.raises(TypeError):
        st.batch_get_into(keys[:2], spans[:2], [4096, 4096.0])
    assert took[5:] == ([False] * 4 if route == "python-call" else [])
    # One size built per key (equal, distinct objects) is read in one call.
    sizes = [int(str(4096)) for _ in range(3)]
    assert st.batch_get_into(keys, spans, sizes) == [4096] * 3
    assert took[-1] is True


def test_one_size_for_every_key_is_recognised_at_c_speed_and_nothing_else():
    from mooncake._common import repeated_u64
    assert list(repeated_u64([4096] * 3)) == [4096] * 3
    assert list(repeated_u64([int(str(4096)) for _ in range(2)])) == [4096] * 2
    assert list(repeated_u64([(1 << 64) - 1] * 2)) == [(1 << 64) - 1] * 2
    for other in ([], [4096, 4095], [4096, 4096.0], [4096.0, 4096], [1, True], [True] * 2,
                  [0] * 2, [1 << 64] * 2, [-4096] * 2, ["4096"] * 2,
                  [4096, decimal.Decimal(4096)], [4096, fractions.Fraction(4096)]):
        assert repeated_u64(other) is None, other


def test_a_batch_of_one_answers_as_each_key_of_a_longer_batch(st):
    """A one-key batch takes the single call; its per-key answers must be a longer
    batch's: stored, already there, missing, a buffer too small, bytes read."""
    src = registered(st, 2 * 4096, seed=23)
    dst = registered(st, 2 * 4096)
    pad = unique("pad")
    k = unique()
    assert st.batch_put_from([k], [src.addr], [4096]) == [0]
    again_alone = st.batch_put_from([k], [src.addr], [4096])
    again_with_another = st.batch_put_from([k, pad], [src.addr, src.addr + 4096], [4096] * 2)
    assert again_alone == again_with_another[:1]
    assert again_with_another[1] == 0
    missing = unique("missing")
    for key, cap in ((k, 4096), (missing, 4096), (k, 100)):
        one = st.batch_get_into([key], [dst.addr], [cap])
        two = st.batch_get_into([key, pad], [dst.addr, dst.addr + 4096], [cap, 4096])
        assert one == two[:1], (key, cap, one, two)
    assert st.batch_get_into([k], [dst.addr], [4096]) == [4096]
    assert dst.read(0, 4096) == pattern(2 * 4096, 23)[:4096]


def test_multi_buffer_put_and_get(st):
    """An object is the concatenation of its buffers, whatever split the reader uses."""
    src = registered(st, 3 * 10000, seed=22)
    dst = registered(st, 3 * 10000, fill=b"\x01")
    data = pattern(30000, 22)
    k1, k2 = unique(), unique()
    res = st.batch_put_from_multi_buffers(
        [k1, k2],
        [[src.addr, src.addr + 20000], [src.addr + 10000]],
        [[3000, 5000], [10000]],
        ReplicateConfig(),
    )
    assert res == [0, 0]
    assert st.get(k1) == data[:3000] + data[20000:25000]
    assert st.get_size(k1) == 8000
    res = st.batch_get_into_multi_buffers(
        [k1, k2], [[dst.addr + 100, dst.addr + 9000], [dst.addr + 20000]], [[7000, 1000], [10000]]
    )
    assert res == [8000, 10000]
    want = data[:3000] + data[20000:25000]
    assert dst.read(100, 7000) == want[:7000]
    assert dst.read(9000, 1000) == want[7000:]
    assert dst.read(7100, 1900) == b"\x01" * 1900
    assert dst.read(20000, 10000) == data[10000:20000]
    res = st.batch_get_into_multi_buffers([unique("missing")], [[dst.addr]], [[100]], False)
    assert len(res) == 1 and res[0] < 0
    res = st.batch_get_into_multi_buffers([k2], [[dst.addr]], [[10000]], prefer_alloc_in_same_node=True)
    assert res == [10000]


def test_get_into_ranges_gathers_fragments(st):
    k1, k2 = unique(), unique()
    v1, v2 = pattern(10000, 23), pattern(5000, 24)
    assert st.put(k1, v1) == 0 and st.put(k2, v2) == 0
    a = registered(st, 4096, fill=b"\x7f")
    b = registered(st, 4096, fill=b"\x7f")
    res = st.get_into_ranges(
        [a.addr, b.addr],
        [[k1, k2], [k2]],
        [[[0, 100], [1000]], [[4000]]],  # dst offsets
        [[[9000, 0], [4990]], [[0]]],  # src offsets
        [[[100, 50], [10]], [[96]]],
    )
    assert res == [[[100, 50], [10]], [[96]]]
    want_a = bytearray(b"\x7f" * 4096)
    want_a[0:100] = v1[9000:9100]
    want_a[100:150] = v1[0:50]
    want_a[1000:1010] = v2[4990:5000]
    assert a.raw == bytes(want_a)
    want_b = bytearray(b"\x7f" * 4096)
    want_b[4000:4096] = v2[0:96]
    assert b.raw == bytes(want_b)


def test_upsert_from(st):
    src = registered(st, 8192, seed=25)
    k = unique()
    assert st.upsert_from(k, src.addr, 100) == 0
    assert st.upsert_from(k, src.addr + 100, 3000, ReplicateConfig()) == 0
    assert st.get(k) == pattern(8192, 25)[100:3100]
    keys = [unique(), unique()]
    assert st.put(keys[0], b"to be replaced") == 0
    assert st.batch_upsert_from(keys, [src.addr, src.addr + 4096], [10, 20]) == [0, 0]
    assert st.get_batch(keys) == [pattern(8192, 25)[:10], pattern(8192, 25)[4096:4116]]


def test_put_from_with_metadata(st):
    data = registered(st, 4096, seed=26)
    meta = registered(st, 64, seed=27)
    k = unique()
    assert st.put_from_with_metadata(k, data.addr, meta.addr, 4096, 64) == 0
    assert st.is_exist(k) == 1
    assert st.get_size(k) > 0


def test_unregister_buffer(st):
    b = registered(st, 4096, seed=28)
    k = unique()
    assert st.put_from(k, b.addr, 4096) == 0
    assert st.unregister_buffer(b.addr) == 0
    k2 = unique()
    assert st.put_from(k2, b.addr, 4096) < 0
    assert st.is_exist(k2) == 0
    b.write(0, b"\x00" * 4096)
    assert st.get_into(k, b.addr, 4096) < 0
    assert b.raw == b"\x00" * 4096


# ------------------------------------------------------------------ pool capacity


def test_full_pool_answers_200(private_master, store_factory):
    s = store_factory(private_master, 4 * MiB, 8 * MiB)
    assert s.put(unique(), pattern(5 * MiB, 30)) == NO_AVAILABLE_HANDLE  # larger than the pool
    pinned = ReplicateConfig()
    pinned.with_hard_pin = True
    stored, codes = [], []
    for i in range(40):  # 16 objects of 256 KiB fill the 4 MiB segment
        k = unique()
        rc = s.put(k, pattern(256 * KiB, i), pinned)
        codes.append(rc)
        if rc != 0:
            break
        stored.append((k, i))
    assert codes[-1] == NO_AVAILABLE_HANDLE, codes
    assert 8 <= len(stored) <= 16, codes
    for k, i in stored:  # hard-pinned objects survive the pressure
        assert s.get(k) == pattern(256 * KiB, i)
    assert s.put(unique(), b"tiny", pinned) in (0, NO_AVAILABLE_HANDLE)


def test_soft_pin_ttl_and_replica_config_are_accepted(st):
    cfg = ReplicateConfig()
    cfg.replica_num = 1
    cfg.with_soft_pin = True
    cfg.soft_pin_ttl_ms = 60000
    cfg.preferred_segment = st.get_hostname()
    cfg.preferred_segments = [st.get_hostname()]
    cfg.group_ids = ["group-" + unique()]
    k = unique()
    assert st.put(k, b"soft pinned", cfg) == 0
    assert st.get(k) == b"soft pinned"


# ------------------------------------------------------------------ close


def test_close_takes_the_clients_objects_away(master, store_factory):
    owner = new_store(master, 8 * MiB, 4 * MiB)
    closed = False
    try:
        pin = ReplicateConfig()
        pin.preferred_segment = owner.get_hostname()
        keys = [unique() for _ in range(3)]
        for k in keys:
            assert owner.put(k, pattern(10000, 31), pin) == 0
        assert owner.batch_is_exist(keys) == [1, 1, 1]
        assert owner.close() == 0
        closed = True
        reader = store_factory(master, 0, 4 * MiB)
        for k in keys:
            assert reader.get(k) == b""
            assert reader.is_exist(k) == 0
        # the same object set up again sees them gone as well
        assert owner.setup("127.0.0.1", master.metadata, 8 * MiB, 4 * MiB, "tcp", "", master.rpc) == 0
        closed = False
        assert owner.health_check() == 0
        for k in keys:
            assert owner.get(k) == b""
            assert owner.is_exist(k) == 0
    finally:
        if not closed:
            owner.close()


def test_health_check_reports_an_unreachable_master(mooncake_bin, tmp_path):
    import json

    with start_master(mooncake_bin) as m:
        conf = tmp_path / "c.json"
        conf.write_text(
            json.dumps(
                {
                    "local_hostname": "127.0.0.1",
                    "metadata_server": "P2PHANDSHAKE",
                    "global_segment_size": 4 * MiB,
                    "local_buffer_size": 4 * MiB,
                    "protocol": "tcp",
                    "device_name": "",
                    "master_server_address": m.rpc,
                }
            )
        )
        child, _ = start_peer("peer.py", "store", str(conf), "file", what="store peer")
        try:
            assert peer_call(child, "health_check") == 0
            m.stop()
            wait_until(lambda: peer_call(child, "health_check") == 2, "health_check() == 2 with the master gone", timeout=30, interval=0.1)
        finally:
            child.kill()


def test_setup_against_an_unreachable_master_fails():
    from mooncake.store import MooncakeDistributedStore

    s = MooncakeDistributedStore()
    dead = "127.0.0.1:%d" % free_port()
    # A pure client (no segment) as well as a node: neither can reach the master.
    for segment in (0, 4 * MiB):
        assert s.setup("127.0.0.1", "P2PHANDSHAKE", segment, 4 * MiB, "tcp", "", dead) != 0
        assert s.health_check() == 1


# ------------------------------------------------------------------ disk tier


def test_ssd_offload_keeps_evicted_objects_readable(private_master, store_factory, tmp_path):
    node = store_factory(private_master, 4 * MiB, 4 * MiB, enable_ssd_offload=True,
                         ssd_offload_path=str(tmp_path / "ssd"))
    keys = [unique() for _ in range(40)]  # 10 MiB into a 4 MiB segment
    for i, k in enumerate(keys):
        assert node.put(k, pattern(256 * KiB, i)) == 0
    assert any((tmp_path / "ssd").iterdir()), "evicted objects went to disk"
    assert node.batch_is_exist(keys) == [1] * len(keys), "nothing was dropped"
    # The evicted ones are described as upstream's LOCAL_DISK replicas, without being
    # read back (describing them again finds them still only on disk).
    for _ in range(2):
        descs = node.batch_get_replica_desc(keys[:5])
        for k in keys[:5]:
            kinds = [(r.is_memory_replica(), r.is_local_disk_replica()) for r in descs[k]]
            assert kinds == [(False, True)], (k, descs[k])
    assert node.get_size(keys[0]) == 256 * KiB
    for i in range(5):  # the oldest ones: evicted to disk, read back byte for byte
        assert node.get(keys[i]) == pattern(256 * KiB, i)


def test_a_soft_pin_ttl_without_enable_is_refused(st):
    # Upstream's master refuses a TTL unless the action enables the soft pin.
    from mooncake.store import SoftPinAction

    k = "softpin-ttl-rule"
    enable = ReplicateConfig()
    enable.soft_pin_action = SoftPinAction.ENABLE
    enable.soft_pin_ttl_ms = 1000
    assert st.put(k, b"v1", enable) == 0
    for action in (SoftPinAction.PRESERVE, SoftPinAction.DISABLE):
        cfg = ReplicateConfig()
        cfg.soft_pin_action = action
        cfg.soft_pin_ttl_ms = 1000
        assert st.upsert(k, b"v2", cfg) == -600
        assert st.put_batch([k + "-b"], [b"x"], cfg) == -600
    assert st.get(k) == b"v1"
    assert st.is_exist(k + "-b") == 0
