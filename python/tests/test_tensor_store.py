"""The tensor methods of MooncakeDistributedStore (put_tensor, get_tensor and their TP,
parallelism, zero-copy and safetensors forms) and the byte layout they share with
upstream's wheel (python/mooncake/_tensor_layout.py).

The layout tests need neither torch nor a master; the others skip without torch."""

import os

import pytest

from fixtures_extra import Buf, MiB, unique

from mooncake import _tensor_layout as L
from mooncake.store import (
    MooncakeDistributedStore,
    ParallelAxis,
    ReadTarget,
    ReplicateConfig,
    TensorParallelism,
)

try:
    import torch
except ImportError:
    torch = None

needs_torch = pytest.mark.skipif(torch is None, reason="torch is not installed")

INVALID_PARAMS = -600
FILE_NOT_FOUND = -1100
HDR = L.HEADER_SIZE
UNUSED_DIMS = "ff" * 48  # six unused int64 dims of a 2-d shape, each -1

# ------------------------------------------------------------------ the byte layout

# An int16 tensor of shape (3, 4), whole: our own worked example of the header.
WHOLE_INT16_3x4 = bytes.fromhex(
    "4e4f4f4d" "0100" "3001"                    # magic, version 1, header size 304
    "04000000" "02000000"                       # dtype 4 (int16), ndim 2
    "00000000" "00000000"                       # layout 0 (whole), reserved
    "3001000000000000" "1800000000000000"       # data at 304, 24 bytes
    "0300000000000000" "0400000000000000" + UNUSED_DIMS +   # global shape (3, 4)
    "0300000000000000" "0400000000000000" + UNUSED_DIMS +   # local shape (3, 4)
    "00000000" "00000000"                       # no axes, reserved
    + "00" * 128)                               # four unused axes

# Rank 1 of 2 of a float32 (4, 6) tensor cut along dimension 1: shape (4, 3).
TP_SHARD_F32 = bytes.fromhex(
    "4e4f4f4d" "0100" "3001"
    "00000000" "02000000"                       # dtype 0 (float32), ndim 2
    "01000000" "00000000"                       # layout 1 (shard)
    "3001000000000000" "3000000000000000"       # data at 304, 48 bytes
    "0400000000000000" "0600000000000000" + UNUSED_DIMS +   # global (4, 6)
    "0400000000000000" "0300000000000000" + UNUSED_DIMS +   # local (4, 3)
    "01000000" "00000000"                       # one axis
    "01000000" "00000000" "01000000" "02000000"  # kind TP, index 0, rank 1, count 2
    "01000000" "00000000" "0300000000000000"    # split dim 1, extra 0, local extent 3
    + "00" * 96)

# The manifest of that cut.
TP_MANIFEST = bytes.fromhex(
    "4e414d57" "0100" "6000"                    # magic, version 1, size 96
    "00000000" "02000000" "01000000" "02000000"  # dtype, ndim, split dim, 2 shards
    "00000000" "00000000"                       # reserved, padding
    "0400000000000000" "0600000000000000" + UNUSED_DIMS)


def test_whole_tensor_header_bytes_are_pinned():
    h = L.TensorHeader(4, (3, 4))
    assert h.pack() == WHOLE_INT16_3x4
    back = L.TensorHeader.unpack(WHOLE_INT16_3x4 + bytes(24), HDR + 24)
    assert (back.dtype, back.global_shape, back.local_shape, back.layout, back.axes,
            back.data_offset, back.data_bytes) == (4, (3, 4), (3, 4), L.FULL, (), HDR, 24)


def test_tp_shard_header_and_manifest_bytes_are_pinned():
    tp = L.AxisSpec("tp", 1, 2, 1, None, None)
    h = L.shard_header(0, (4, 6), (4, 3), [tp])
    assert h.pack() == TP_SHARD_F32
    assert L.specs_of(L.TensorHeader.unpack(TP_SHARD_F32 + bytes(48), HDR + 48)) == [tp]
    m = L.Manifest(0, 1, 2, (4, 6))
    assert L.pack_manifest(m) == TP_MANIFEST
    assert L.unpack_manifest(TP_MANIFEST) == m


def _patched(raw, offset, fmt_bytes):
    return raw[:offset] + fmt_bytes + raw[offset + len(fmt_bytes):]


@pytest.mark.parametrize("offset,value,why", [
    (0, b"MOON", "bad magic"),
    (4, b"\x02\x00", "unknown version"),
    (12, b"\x09\x00\x00\x00", "ndim 9"),
    (32, b"\x19", "data bytes disagree with the shape"),
    (40, b"\xff" * 8, "a dimension of -1 inside ndim"),
    (56, b"\x05" + b"\x00" * 7, "a dimension past ndim that is not -1"),
    (168, b"\x05", "five axes"),
])
def test_damaged_headers_are_refused(offset, value, why):
    raw = _patched(WHOLE_INT16_3x4, offset, value) + bytes(24)
    assert L.TensorHeader.unpack(raw, len(raw)) is None, why


def test_a_header_must_match_the_object_size_and_its_axes_be_sane():
    assert L.TensorHeader.unpack(WHOLE_INT16_3x4 + bytes(23), HDR + 23) is None
    assert L.TensorHeader.unpack(WHOLE_INT16_3x4[:200], 200) is None
    rank_past_count = _patched(TP_SHARD_F32, 176 + 8, b"\x02") + bytes(48)
    assert L.TensorHeader.unpack(rank_past_count, HDR + 48) is None


def test_key_names():
    tp = L.AxisSpec("tp", 1, 2, 0, None, None)
    dp = L.AxisSpec("dp", 0, 4, None, None, None)
    ep = L.AxisSpec("ep", 3, 8, None, 17, None)
    pp = L.AxisSpec("pp", 1, 2, None, None, 5)
    assert L.parallelism_key("w", [tp]) == L.tp_key("w", 1) == "w_tp_1"
    assert L.parallelism_key("w", [pp, tp, ep, dp]) == \
        "w__dp_0of4__tp_1of2_sd0__ep_3of8_eid17__pp_1of2_sid5"
    assert L.writer_shard_key("w", 1, 4, 2) == "w__writer_1of4_sd2"
    assert L.writer_manifest_key("w") == "w__writer_manifest"
    assert L.parallelism_manifest_key("w") == "w__parallelism_manifest"


@pytest.mark.parametrize("axes,problem", [
    ([], "cannot be empty"),
    ([("tp", 0, 2, None, None, None)], "needs split_dim"),
    ([("dp", 0, 2, 0, None, None)], "takes no split_dim"),
    ([("ep", 0, 2, None, None, None)], "needs expert_id"),
    ([("pp", 0, 2, None, None, None)], "needs stage_id"),
    ([("tp", 2, 2, 0, None, None)], "is not in"),
    ([("xp", 0, 1, None, None, None)], "unsupported axis kind"),
    ([("dp", 0, 2, None, None, None)] * 2, "two dp axes"),
])
def test_parallelism_specs_are_checked_as_upstream_does(axes, problem):
    found = L.spec_problem([L.AxisSpec(*a) for a in axes])
    assert found is not None and problem in found


def test_parallelism_objects_parse_and_refuse_wrong_types():
    p = TensorParallelism([ParallelAxis("TP", 1, 2, split_dim=0)])
    assert L.parse_axes(p) == [L.AxisSpec("tp", 1, 2, 0, None, None)]
    with pytest.raises(TypeError):
        L.parse_axes(TensorParallelism([ParallelAxis("tp", "1", 2, split_dim=0)]))
    with pytest.raises(TypeError):
        L.parse_axes([ParallelAxis("tp")])
    with pytest.raises(ValueError):
        ReadTarget().mode = "sideways"
    t = ReadTarget()
    t.mode = "FULL"
    assert (t.mode, t.parallelism) == ("full", None)


# ------------------------------------------------------------------ the store

DTYPES = [
    "float32", "float64", "int8", "uint8", "int16", "uint16", "int32", "uint32", "int64",
    "uint64", "bool", "float16", "bfloat16", "float8_e4m3fn", "float8_e5m2",
]


def new_store(master, segment=64 * MiB):
    s = MooncakeDistributedStore()
    assert s.setup("127.0.0.1", master.metadata, segment, 16 * MiB, "tcp", "", master.rpc) == 0
    return s


@pytest.fixture
def master(master_factory):
    return master_factory()


@pytest.fixture
def store(master):
    if torch is None:
        pytest.skip("torch is not installed")
    s = new_store(master)
    yield s
    s.close()


def registered(store, size):
    b = Buf(size)
    assert store.register_buffer(b.addr, size) == 0
    return b


def stored_into_buffer(store, key, tensor):
    """Puts ``tensor`` under ``key`` and reads that object (header and data) into a fresh
    registered buffer: (the buffer, the object's size)."""
    assert store.put_tensor(key, tensor) == 0
    buf = registered(store, 1024)
    assert store.get_tensor_into(key, buf.addr, buf.size) is not None
    return buf, store.get_size(key)


def raw_bytes(t):
    """A tensor's bytes (compares NaNs and float8 values exactly)."""
    # Through a list, not .numpy(): torch may be installed without numpy.
    return bytes(t.contiguous().view(-1).view(torch.uint8).tolist()) if t.numel() else b""


def same(got, want):
    return (got is not None and got.dtype == want.dtype and got.shape == want.shape
            and raw_bytes(got) == raw_bytes(want))


def sample(dtype, shape, seed=0):
    """Arbitrary bit patterns of ``dtype`` (0/1 for bool)."""
    g = torch.Generator().manual_seed(seed)
    n = torch.Size(shape).numel()
    if dtype == torch.bool:
        return torch.randint(0, 2, shape, generator=g).bool()
    size = torch.empty(0, dtype=dtype).element_size()
    return torch.randint(0, 256, (n * size,), dtype=torch.uint8, generator=g).view(dtype) \
        .reshape(shape)


def tp(rank, size, split_dim):
    return ParallelAxis("tp", rank, size, split_dim=split_dim)


def par(*axes):
    return TensorParallelism(list(axes))


@needs_torch
def test_every_dtype_round_trips_and_is_stored_as_header_then_bytes(store):
    for code, name in enumerate(DTYPES):
        t = sample(getattr(torch, name), (3, 5), seed=code)
        k = unique(name)
        assert store.put_tensor(k, t) == 0, name
        assert same(store.get_tensor(k), t), name
        assert store.get(k) == L.TensorHeader(code, (3, 5)).pack() + raw_bytes(t), name


@needs_torch
def test_empty_scalar_and_noncontiguous_tensors(store):
    cases = [torch.empty((2, 0, 3), dtype=torch.bfloat16), torch.tensor(-2.5, dtype=torch.float64),
             torch.arange(24, dtype=torch.int32).reshape(4, 6).t(), torch.arange(10)[::3]]
    for t in cases:
        k = unique("shape")
        assert store.put_tensor(k, t) == 0
        got = store.get_tensor(k)
        assert same(got, t) and got.is_contiguous(), t.shape


@needs_torch
def test_an_object_written_by_hand_reads_as_a_tensor(store):
    """Any writer of the layout (upstream's wheel among them) is readable."""
    data = bytes(range(24))
    k = unique("hand")
    assert store.put(k, WHOLE_INT16_3x4 + data) == 0
    want = torch.frombuffer(bytearray(data), dtype=torch.int16).reshape(3, 4)
    assert same(store.get_tensor(k), want)
    k2 = unique("notatensor")
    assert store.put(k2, b"x" * 400) == 0
    assert store.get_tensor(k2) is None


@needs_torch
def test_batches_give_none_for_a_missing_key(store):
    ks = [unique("b") for _ in range(2)]
    ts = [sample(torch.float16, (4, 4)), sample(torch.int64, (7,), seed=1)]
    assert store.batch_put_tensor(ks, ts) == [0, 0]
    got = store.batch_get_tensor([ks[0], unique("missing"), ks[1]])
    assert same(got[0], ts[0]) and got[1] is None and same(got[2], ts[1])
    buf = registered(store, 4096)
    into = store.batch_get_tensor_into([ks[1], unique("missing")], [buf.addr, buf.addr + 2048],
                                       [2048, 2048])
    assert same(into[0], ts[1]) and into[1] is None
    # parallel lists of different lengths: one code per key, as upstream
    assert store.batch_get_tensor_into([ks[1], unique("x")], [buf.addr], [2048]) == \
        [INVALID_PARAMS] * 2
    assert store.batch_put_tensor([], []) == []


@needs_torch
def test_what_is_not_a_storable_tensor_is_refused_and_nothing_is_written(store):
    k = unique("bad")
    assert store.put_tensor(k, [1, 2, 3]) == INVALID_PARAMS
    assert store.put_tensor(k, torch.zeros(2, dtype=torch.complex64)) == INVALID_PARAMS
    assert store.put_tensor(k, torch.zeros([1] * 9)) == INVALID_PARAMS
    assert store.is_exist(k) == 0
    good, bad = unique("good"), unique("bad")
    assert store.batch_put_tensor([good, bad], [torch.ones(2), "nope"]) == [0, INVALID_PARAMS]
    assert store.batch_is_exist([good, bad]) == [1, 0]
    with pytest.raises(TypeError):
        store.put_tensor(7, torch.ones(1))
    # parallel lists of different lengths fail every key, as upstream
    assert store.batch_put_tensor([good, bad], [torch.ones(1)]) == [INVALID_PARAMS] * 2


@needs_torch
def test_calls_before_setup_fail_softly():
    s = MooncakeDistributedStore()
    assert s.put_tensor("k", torch.ones(1)) == INVALID_PARAMS
    assert s.get_tensor("k") is None
    assert s.batch_put_tensor(["a", "b"], [torch.ones(1)] * 2) == [INVALID_PARAMS] * 2
    assert s.batch_get_tensor(["a"]) == [None]
    assert s.get_tensor_with_parallelism("k", ReadTarget("full")) is None


@needs_torch
def test_get_tensor_into_returns_a_view_of_the_registered_buffer(store):
    t = sample(torch.float32, (8, 8))
    k = unique("into")
    assert store.put_tensor(k, t) == 0
    buf = registered(store, HDR + t.nbytes)
    got = store.get_tensor_into(k, buf.addr, buf.size)
    assert same(got, t) and got.data_ptr() == buf.addr + HDR
    assert buf.read(0, HDR) == L.TensorHeader(0, (8, 8)).pack()
    small = registered(store, HDR + t.nbytes - 1)
    assert store.get_tensor_into(k, small.addr, small.size) is None
    unregistered = Buf(HDR + t.nbytes)
    assert store.get_tensor_into(k, unregistered.addr, unregistered.size) is None


@needs_torch
def test_put_tensor_from_stores_the_object_get_tensor_into_left(store):
    t = sample(torch.int8, (5, 3))
    k2 = unique("copy")
    buf, n = stored_into_buffer(store, unique("src"), t)
    assert store.put_tensor_from(k2, buf.addr, n) == 0
    assert same(store.get_tensor(k2), t)
    assert store.batch_put_tensor_from([unique("b1")], [buf.addr], [n]) == [0]
    assert store.put_tensor_from(unique("short"), buf.addr, n - 1) == INVALID_PARAMS
    elsewhere = Buf(n, content=buf.read(0, n))
    assert store.put_tensor_from(unique("unreg"), elsewhere.addr, n) == INVALID_PARAMS
    assert store.batch_put_tensor_from([unique("x"), unique("y")], [buf.addr, buf.addr + 1],
                                       [n, n]) == [INVALID_PARAMS] * 2


@needs_torch
def test_tp_shards_are_stored_and_put_back_together(store):
    full = sample(torch.float32, (4, 6))
    k = unique("tp")
    assert store.put_tensor_with_tp(k, full, tp_rank=0, tp_size=2, split_dim=1) == 0
    assert store.batch_is_exist([k, f"{k}_tp_0", f"{k}_tp_1"]) == [0, 1, 1]
    for r in range(2):
        assert same(store.get_tensor_with_tp(k, tp_rank=r, tp_size=2), full[:, 3 * r:3 * r + 3])
    assert store.get(f"{k}_tp_1")[:HDR] == TP_SHARD_F32
    both = store.batch_get_tensor_with_tp([k, unique("missing")], tp_rank=1, tp_size=2)
    assert same(both[0], full[:, 3:]) and both[1] is None
    whole = store.get_tensor_with_parallelism(k, ReadTarget("full", par(tp(0, 2, 1))))
    assert same(whole, full)
    # Cut anew into three: rank 2 holds columns 4..5, taken from stored shard 1.
    third = store.get_tensor_with_parallelism(k, ReadTarget("shard", par(tp(2, 3, 1))))
    assert same(third, full[:, 4:])
    buf = registered(store, 1024)
    assert same(store.get_tensor_with_tp_into(k, buf.addr, 1024, tp_rank=0, tp_size=2),
                full[:, :3])
    assert store.get_tensor_with_tp(k) is None  # tp_size 1 reads the key itself


@needs_torch
def test_tp_arguments_are_checked(store):
    k = unique("tpbad")
    # upstream reads tp_size <= 1 as unsharded: a plain put_tensor / get_tensor
    plain = unique("tpplain")
    assert store.put_tensor_with_tp(plain, torch.arange(4.0), tp_rank=5, tp_size=0) == 0
    assert store.batch_is_exist([plain, f"{plain}_tp_0"]) == [1, 0]
    assert torch.equal(store.get_tensor_with_tp(plain, tp_size=-1), torch.arange(4.0))
    with pytest.raises(ValueError):
        store.put_tensor_with_tp(k, torch.ones(4), tp_rank=2, tp_size=2)
    with pytest.raises(ValueError):
        store.get_tensor_with_tp(k, tp_rank=-1, tp_size=2)
    assert store.put_tensor_with_tp(k, torch.ones(5), tp_size=2) == INVALID_PARAMS
    assert store.put_tensor_with_tp(k, torch.ones(4), tp_size=2, split_dim=1) == INVALID_PARAMS
    assert store.put_tensor_with_tp(k, torch.ones(4), tp_size=2, split_dim=-1) == INVALID_PARAMS
    assert store.batch_is_exist([f"{k}_tp_0", f"{k}_tp_1", k]) == [0, 0, 0]
    ok, bad = unique("tpok"), unique("tpuneven")
    assert store.batch_put_tensor_with_tp([ok, bad], [torch.ones(4, 2), torch.ones(3, 2)],
                                          tp_size=2) == [0, INVALID_PARAMS]
    assert store.batch_is_exist([f"{ok}_tp_1", f"{bad}_tp_0"]) == [1, 0]
    empty = torch.empty((2, 0, 3))
    assert store.put_tensor_with_tp(unique("tp0"), empty, tp_size=2) == 0


@needs_torch
def test_tp_from_a_registered_object(store):
    full = sample(torch.int32, (6, 2))
    k2 = unique("tpfrom")
    buf, n = stored_into_buffer(store, unique("obj"), full)
    assert store.put_tensor_with_tp_from(k2, buf.addr, n, tp_size=3) == 0
    for r in range(3):
        assert same(store.get_tensor_with_tp(k2, r, 3), full[2 * r:2 * r + 2])
    assert store.batch_put_tensor_with_tp_from([unique("a"), unique("b")], [buf.addr, buf.addr],
                                               [n, n - 1], tp_size=2) == [0, INVALID_PARAMS]


@needs_torch
def test_a_lone_tp_axis_stores_this_ranks_shard_and_a_manifest(store, master):
    full = sample(torch.bfloat16, (4, 6))
    k = unique("lone")
    for r in range(2):
        local = full[2 * r:2 * r + 2]
        assert store.put_tensor_with_parallelism(k, local, par(tp(r, 2, 0))) == 0
    assert L.unpack_manifest(store.get(f"{k}__parallelism_manifest")) == \
        L.Manifest(12, 0, 2, (4, 6))
    reader = new_store(master, segment=0)
    try:
        assert same(reader.get_tensor_with_parallelism(k, ReadTarget("full", par(tp(0, 2, 0)))),
                    full)
        assert same(reader.get_tensor_with_parallelism(k, ReadTarget("shard", par(tp(1, 2, 0)))),
                    full[2:])
        assert same(reader.get_tensor_with_parallelism(k, ReadTarget("shard", par(tp(3, 4, 0)))),
                    full[3:])
        assert reader.get_tensor_with_parallelism(k, ReadTarget("full", par(tp(0, 2, 1)))) is None
    finally:
        reader.close()


@needs_torch
def test_tp_with_dp_cuts_the_full_tensor_and_names_every_axis(store):
    full = sample(torch.int64, (2, 4))
    k = unique("tpdp")
    dp = ParallelAxis("dp", 1, 2)
    for r in range(2):
        assert store.put_tensor_with_parallelism(k, full, par(tp(r, 2, 1), dp)) == 0
    assert store.batch_is_exist([f"{k}__dp_1of2__tp_{r}of2_sd1" for r in range(2)]) == [1, 1]
    assert same(store.get_tensor_with_parallelism(k, ReadTarget("full", par(dp, tp(0, 2, 1)))),
                full)
    assert same(store.get_tensor_with_parallelism(k, ReadTarget("shard", par(tp(1, 2, 1), dp))),
                full[:, 2:])
    other_dp = par(tp(0, 2, 1), ParallelAxis("dp", 0, 2))
    assert store.get_tensor_with_parallelism(k, ReadTarget("shard", other_dp)) is None


@needs_torch
def test_axes_without_tp_label_the_tensor_as_it_is(store):
    t = sample(torch.uint8, (3,))
    k = unique("ep")
    ep = ParallelAxis("ep", 1, 4, expert_id=7)
    assert store.put_tensor_with_parallelism(k, t, par(ep)) == 0
    assert store.is_exist(f"{k}__ep_1of4_eid7") == 1
    assert same(store.get_tensor_with_parallelism(k, ReadTarget("shard", par(ep))), t)
    assert store.put_tensor_with_parallelism(k, t, par(ParallelAxis("ep", 1, 4))) == INVALID_PARAMS
    assert store.put_tensor_with_parallelism(k, t, par()) == INVALID_PARAMS
    assert store.get_tensor_with_parallelism(k, ReadTarget("shard")) is None
    assert store.get_tensor_with_parallelism(k, ReadTarget("as_stored", par(ep))) is None


@needs_torch
def test_writer_partitions_and_their_full_read(store):
    full = sample(torch.float64, (4, 3))
    k = unique("writer")
    for r in range(2):
        writer = ParallelAxis("tp", r, 2, split_dim=0)
        assert store.put_tensor_with_parallelism(k, full, writer_partition=writer) == 0
    assert store.is_exist(f"{k}__writer_1of2_sd0") == 1
    assert L.unpack_manifest(store.get(f"{k}__writer_manifest")) == L.Manifest(1, 0, 2, (4, 3))
    assert same(store.get_tensor_with_parallelism(k, ReadTarget("full")), full)
    assert same(store.get_tensor_with_parallelism(k, ReadTarget("shard", par(tp(0, 2, 0)))),
                full[:2])
    writer = ParallelAxis("tp", 0, 2, split_dim=0)
    assert store.put_tensor_with_parallelism(unique("both"), full, par(tp(0, 2, 0)),
                                             writer_partition=writer) == INVALID_PARAMS
    plain = unique("plain")
    assert store.put_tensor(plain, full) == 0
    assert same(store.get_tensor_with_parallelism(plain, ReadTarget("full")), full)


@needs_torch
def test_parallelism_from_a_buffer_writes_every_tp_shard(store):
    full = sample(torch.float16, (2, 8))
    k = unique("pfrom")
    buf, n = stored_into_buffer(store, unique("src"), full)
    assert store.put_tensor_with_parallelism_from(k, buf.addr, n, par(tp(0, 4, 1))) == 0
    assert store.batch_is_exist([f"{k}_tp_{r}" for r in range(4)]) == [1] * 4
    assert store.is_exist(f"{k}__parallelism_manifest") == 0
    assert same(store.get_tensor_with_parallelism(k, ReadTarget("full", par(tp(0, 4, 1)))), full)
    assert store.put_tensor_with_parallelism_from(unique("d"), buf.addr, n) == 0
    assert store.batch_put_tensor_with_parallelism_from(
        [unique("e"), unique("f")], [buf.addr, buf.addr], [n, n],
        [par(tp(0, 2, 0)), par(ParallelAxis("pp", 0, 2, stage_id=1))]) == [0, 0]


@needs_torch
def test_parallelism_reads_into_a_registered_buffer(store):
    full = sample(torch.int16, (4, 6))
    k = unique("pinto")
    assert store.put_tensor_with_tp(k, full, tp_size=2, split_dim=0) == 0
    buf = registered(store, 1024)
    got = store.get_tensor_with_parallelism_into(k, buf.addr, 1024,
                                                 ReadTarget("full", par(tp(0, 2, 0))))
    assert same(got, full) and got.data_ptr() == buf.addr + HDR
    assert L.TensorHeader.unpack(buf.read(0, HDR)).layout == L.FULL
    assert store.get_tensor_with_parallelism_into(k, buf.addr, HDR + full.nbytes - 1,
                                                  ReadTarget("full", par(tp(0, 2, 0)))) is None
    shard = store.get_tensor_with_parallelism_into(k, buf.addr, 1024,
                                                   ReadTarget("shard", par(tp(1, 4, 0))))
    assert same(shard, full[1:2])
    got = store.batch_get_tensor_with_parallelism_into(
        [f"{k}_tp_0", unique("missing")], [buf.addr, buf.addr + 512], [512, 512])
    assert same(got[0], full[:2]) and got[1] is None


@needs_torch
def test_batch_parallelism_forms(store):
    a, b, c = sample(torch.int32, (4,)), sample(torch.int32, (2, 2), 1), sample(torch.int8, (2,))
    ks = [unique("ba"), unique("bb"), unique("bc")]
    pars = [par(tp(0, 2, 0)), None, par(ParallelAxis("dp", 0, 1))]
    assert store.batch_put_tensor_with_parallelism(ks, [a, b, c], pars) == [0, 0, 0]
    got = store.batch_get_tensor_with_parallelism(
        ks + [unique("missing")],
        [ReadTarget("shard", pars[0]), None, ReadTarget("shard", pars[2]), None])
    assert same(got[0], a) and same(got[1], b) and same(got[2], c) and got[3] is None
    with pytest.raises(ValueError):
        store.batch_put_tensor_with_parallelism(ks, [a, b, c], pars[:2])
    assert store.batch_put_tensor_with_parallelism(
        ks[:1], [a], pars[:1], writer_partitions=[ParallelAxis("tp", 0, 1, split_dim=0)]) == \
        [INVALID_PARAMS]


@needs_torch
def test_upsert_replaces_where_put_keeps(store):
    """Each key is read only at the end: a read leases it, and an upsert of a leased
    object is refused (OBJECT_HAS_LEASE), as upstream."""
    first, second = sample(torch.float32, (3,)), sample(torch.float32, (5, 2), 1)
    kept, put_then_upsert, batch, pub, dp = (unique(n) for n in ("kept", "up", "batch", "pub",
                                                                 "dp"))
    for k in (kept, put_then_upsert, batch, pub):
        assert store.put_tensor(k, first) == 0
    assert store.put_tensor(kept, second) == 0
    assert store.upsert_tensor(put_then_upsert, second) == 0
    assert store.batch_upsert_tensor([batch], [second]) == [0]
    assert store.upsert_pub_tensor(pub, second, ReplicateConfig()) == 0
    assert same(store.get_tensor(kept), first)
    for k in (put_then_upsert, batch, pub):
        assert same(store.get_tensor(k), second), k
    assert store.upsert_tensor_with_parallelism(dp, first, par(ParallelAxis("dp", 0, 2))) == 0
    assert store.upsert_tensor_with_parallelism(dp, second, par(ParallelAxis("dp", 0, 2))) == 0
    assert same(store.get_tensor(f"{dp}__dp_0of2"), second)
    target = unique("target")
    assert store.put_tensor(target, first) == 0
    buf, n = stored_into_buffer(store, unique("src"), second)
    assert store.upsert_tensor_from(target, buf.addr, n) == 0
    assert same(store.get_tensor(target), second)


@needs_torch
def test_pub_forms_take_a_replicate_config(store):
    k = unique("pub")
    t = sample(torch.float32, (4, 2))
    cfg = ReplicateConfig()
    cfg.with_soft_pin = True
    assert store.pub_tensor(k, t, cfg) == 0
    assert same(store.get_tensor(k), t)
    assert store.pub_tensor_with_tp(unique("pubtp"), t, cfg, tp_size=2) == 0
    assert store.batch_pub_tensor([unique("pb")], [t], cfg) == [0]
    assert store.batch_pub_tensor_with_tp([unique("pbt")], [t], cfg, tp_size=2) == [0]
    mismatched = ReplicateConfig()
    mismatched.preferred_segments = ["a", "b"]
    assert store.pub_tensor(unique("bad"), t, mismatched) == INVALID_PARAMS
    with pytest.raises(TypeError):
        store.pub_tensor(unique("bad"), t, {"replica_num": 1})


@needs_torch
def test_get_tensor_into_cuda_fills_a_matching_destination(store):
    t = sample(torch.int64, (3, 3))
    k = unique("fill")
    assert store.put_tensor(k, t) == 0
    dst = torch.zeros(3, 3, dtype=torch.int64)
    assert store.get_tensor_into_cuda(k, dst) == t.nbytes
    assert same(dst, t)
    wrong = torch.full((9,), 7, dtype=torch.int64)
    assert store.get_tensor_into_cuda(k, wrong) == INVALID_PARAMS
    assert torch.equal(wrong, torch.full((9,), 7, dtype=torch.int64))
    assert store.batch_get_tensor_into_cuda([k, unique("missing")],
                                            [dst, torch.zeros(1)]) == [t.nbytes, INVALID_PARAMS]
    if torch.cuda.is_available():
        on_gpu = torch.zeros(3, 3, dtype=torch.int64, device="cuda")
        assert store.get_tensor_into_cuda(k, on_gpu) == t.nbytes
        assert same(on_gpu.cpu(), t)


@needs_torch
@pytest.mark.skipif(torch is None or not torch.cuda.is_available(), reason="no CUDA device")
def test_cuda_tensors_are_copied_to_the_host_for_writing(store):
    t = sample(torch.float32, (16,)).cuda()
    k = unique("cuda")
    assert store.put_tensor(k, t) == 0
    assert same(store.get_tensor(k), t.cpu())


@needs_torch
def test_safetensors_save_and_load(store, tmp_path, monkeypatch):
    pytest.importorskip("safetensors")
    t = sample(torch.bfloat16, (2, 3))
    k = unique("st")
    assert store.put_tensor(k, t) == 0
    path = str(tmp_path / "one.safetensors")
    assert store.save_tensor_to_safetensor(k, path) == 0
    from safetensors.torch import load_file

    assert same(load_file(path)[k], t)
    other = unique("loaded")
    assert same(store.load_tensor_from_safetensor(other, path), t)
    assert same(store.get_tensor(other), t)
    assert same(store.load_tensor_from_safetensor(file_name=path), t)
    assert same(store.get_tensor(path), t)
    monkeypatch.chdir(tmp_path)
    assert store.save_tensor_to_safetensor(k) == 0 and os.path.exists(k)
    assert store.save_tensor_to_safetensor(unique("missing"), path) == FILE_NOT_FOUND
    assert store.load_tensor_from_safetensor(k, str(tmp_path / "absent")) is None
    with pytest.raises(TypeError):
        store.load_tensor_from_safetensor(k)


def test_the_package_imports_without_torch():
    """The tensor layout and the store module load in an interpreter with no torch."""
    import subprocess
    import sys

    code = ("import sys; sys.modules['torch'] = None\n"
            "import mooncake.store, mooncake._tensor_layout as L\n"
            "assert L.TensorHeader(4, (3, 4)).pack()[:4] == b'NOOM'\n")
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(p for p in [os.path.dirname(os.path.dirname(
        os.path.abspath(__import__("mooncake").__file__))), env.get("PYTHONPATH")] if p)
    subprocess.run([sys.executable, "-c", code], check=True, env=env, timeout=60)
