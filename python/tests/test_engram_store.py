"""EngramStoreConfig / EngramStore (mooncake._engram, exported by mooncake.store): one
float32 [N_h, D] table per head under engram:l{layer}:h{h}, looked up by row id into
[B, L, H, D]. Store-backed tests run against a real master; every layer id is unique."""

import os
import subprocess
import sys
import textwrap

import pytest

from fixtures_extra import MiB, module_master, new_store  # noqa: F401 (module_master: fixture)

np = pytest.importorskip("numpy")
from mooncake._engram import EngramStore, EngramStoreConfig  # noqa: E402

OBJECT_NOT_FOUND = -704

_next_layer = [int.from_bytes(os.urandom(3), "little")]


def new_layer():
    _next_layer[0] += 1
    return _next_layer[0]


def config(vocab=(17, 19, 23, 29), dim=8):
    cfg = EngramStoreConfig()
    cfg.table_vocab_sizes = list(vocab)
    cfg.embedding_dim = dim
    return cfg


def tables_for(engram, seed=0):
    """Random float32 tables, one per head (no two rows alike, so a wrong row shows)."""
    rng = np.random.default_rng(seed)
    return [rng.standard_normal((n, engram.get_embedding_dim()), dtype=np.float32)
            for n in engram.get_table_vocab_sizes()]


def expected(tables, ids):
    """What lookup must return: numpy indexing of the source tables, [B, L, H, D]."""
    ids = np.asarray(ids)
    return np.stack([tables[h][ids[:, :, h]] for h in range(len(tables))], axis=2)


def random_ids(engram, shape, seed):
    rng = np.random.default_rng(seed)
    cols = [rng.integers(0, n, size=shape) for n in engram.get_table_vocab_sizes()]
    return np.stack(cols, axis=-1)


@pytest.fixture(scope="module")
def st(module_master):
    s = new_store(module_master, segment=64 * MiB, local_buffer=16 * MiB)
    yield s
    s.close()


@pytest.fixture
def layers(st):
    """make(vocab, dim) -> an EngramStore on a fresh layer id; its tables are removed at
    teardown."""
    made = []

    def make(vocab=(17, 19, 23, 29), dim=8, layer=None):
        e = EngramStore(new_layer() if layer is None else layer, config(vocab, dim), st)
        made.append(e)
        return e

    yield make
    for e in made:
        e.remove_from_store(force=True)


def absent(st, engram):
    return all(st.is_exist(k) == 0 for k in engram.get_store_keys())


# ------------------------------------------------------------------ config and metadata


def test_config_defaults_and_copies():
    cfg = EngramStoreConfig()
    assert cfg.table_vocab_sizes == [1024]
    assert cfg.embedding_dim == 64
    cfg.table_vocab_sizes.append(5)  # a copy: the config does not change
    assert cfg.table_vocab_sizes == [1024]
    cfg.table_vocab_sizes = (3, np.int64(4), True)
    assert cfg.table_vocab_sizes == [3, 4, 1]
    cfg.table_vocab_sizes = np.array([7, 9])
    assert cfg.table_vocab_sizes == [7, 9]
    cfg.embedding_dim = np.int32(16)
    assert cfg.embedding_dim == 16 and type(cfg.embedding_dim) is int
    assert EngramStoreConfig.__module__ == "mooncake.store"
    assert EngramStore.__module__ == "mooncake.store"


@pytest.mark.parametrize("attr,value", [
    ("table_vocab_sizes", "ab"), ("table_vocab_sizes", 5), ("table_vocab_sizes", None),
    ("table_vocab_sizes", [1.5]), ("table_vocab_sizes", {1, 2}),
    ("table_vocab_sizes", [1 << 63]), ("embedding_dim", 1.0), ("embedding_dim", "8"),
    ("embedding_dim", 1 << 31),
])
def test_config_rejects_wrong_types(attr, value):
    cfg = EngramStoreConfig()
    before = getattr(cfg, attr)
    with pytest.raises(TypeError, match=attr):
        setattr(cfg, attr, value)
    assert getattr(cfg, attr) == before
    with pytest.raises(AttributeError):
        cfg.other = 1


def test_metadata_without_store():
    cfg = config((5, 7, 11), 4)
    e = EngramStore(12, cfg)
    cfg.table_vocab_sizes = [1]  # the store copied the config
    assert e.get_store_keys() == ["engram:l12:h0", "engram:l12:h1", "engram:l12:h2"]
    assert e.get_table_vocab_sizes() == [5, 7, 11]
    assert e.get_num_heads() == 3 and e.get_embedding_dim() == 4
    assert EngramStore(layer_id=-3, config=cfg, store=None).get_store_keys() == ["engram:l-3:h0"]
    with pytest.raises(RuntimeError, match="store=None"):
        e.lookup([[[0, 0, 0]]])
    with pytest.raises(RuntimeError, match="store=None"):
        e.populate([np.zeros((n, 4), np.float32) for n in (5, 7, 11)])
    with pytest.raises(RuntimeError, match="remove_from_store failed, rc=-600"):
        e.remove_from_store()
    # Argument checks still come first.
    with pytest.raises(RuntimeError, match="out of range"):
        e.lookup([[[5, 0, 0]]])
    with pytest.raises(RuntimeError, match="embedding buffer shape"):
        e.populate([np.zeros((4, 4), np.float32)] * 3)


@pytest.mark.parametrize("vocab,dim,match", [
    ([], 8, "must not be empty"), ([4, 0], 8, "positive values"),
    ([4, -1], 8, "positive values"), ([4], 0, "embedding_dim must be positive"),
    ([4], -2, "embedding_dim must be positive"),
])
def test_invalid_config_is_a_value_error(vocab, dim, match):
    with pytest.raises(ValueError, match=match):
        EngramStore(1, config(vocab, dim))


def test_constructor_argument_types():
    cfg = config((3,), 2)
    with pytest.raises(TypeError, match="layer_id"):
        EngramStore(1.0, cfg)
    with pytest.raises(TypeError, match="layer_id"):
        EngramStore(1 << 31, cfg)
    with pytest.raises(TypeError, match="config"):
        EngramStore(1, {"table_vocab_sizes": [3]})
    with pytest.raises(RuntimeError, match="store parameter"):
        EngramStore(1, cfg, store=object())
    with pytest.raises(TypeError, match="force"):
        EngramStore(1, cfg).remove_from_store(force="yes")


def test_import_needs_no_numpy():
    code = textwrap.dedent("""
        import sys
        class Block:
            def find_spec(self, name, path=None, target=None):
                if name.split(".")[0] == "numpy":
                    raise ImportError("blocked " + name)
        sys.meta_path.insert(0, Block())
        from mooncake._engram import EngramStore, EngramStoreConfig
        cfg = EngramStoreConfig()
        cfg.table_vocab_sizes = [3, 4]
        print(EngramStore(2, cfg).get_store_keys())
        try:
            EngramStore(2, cfg).lookup([[[0, 0]]])
        except ImportError as e:
            print("needs numpy")
    """)
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          timeout=120, env=dict(os.environ))
    assert done.returncode == 0, done.stderr
    assert done.stdout.split("\n")[:2] == ["['engram:l2:h0', 'engram:l2:h1']", "needs numpy"]


# ------------------------------------------------------------------ populate and lookup


@pytest.mark.parametrize("shape", [(1, 1), (2, 3), (4, 7), (3, 64)])
def test_lookup_returns_exactly_the_rows(layers, shape):
    e = layers((17, 19, 23, 29), 8)
    tables = tables_for(e, seed=shape[0] * 100 + shape[1])
    assert e.populate(tables) is None
    ids = random_ids(e, shape, seed=sum(shape))
    out = e.lookup(ids)
    assert isinstance(out, np.ndarray) and out.dtype == np.float32
    assert out.shape == (shape[0], shape[1], 4, 8) and out.flags.c_contiguous
    assert np.array_equal(out, expected(tables, ids))
    # The nested-list form gives the same answer.
    assert np.array_equal(e.lookup(ids.tolist()), out)


def test_row_id_forms(layers):
    e = layers((5, 300, 2), 3)
    tables = tables_for(e, seed=7)
    e.populate(tables)
    ids = np.array([[[4, 299, 1], [0, 0, 0], [4, 150, 1]],
                    [[2, 151, 0], [3, 149, 1], [1, 298, 0]]])
    want = expected(tables, ids)
    for form in (ids.astype(np.int32), ids.astype(np.uint16), ids.astype(np.float64),
                 np.asfortranarray(ids), np.repeat(ids, 2, axis=2)[:, :, ::2],
                 ids.astype(object)):
        assert np.array_equal(e.lookup(form), want)
    nested = tuple(tuple(tuple(np.int64(v) for v in tok) for tok in b) for b in ids.tolist())
    assert np.array_equal(e.lookup(nested), want)
    assert np.array_equal(e.lookup(row_ids=(list(b) for b in ids.tolist())), want)


def test_repeated_and_full_table_lookups(layers):
    e = layers((64, 3), 16)
    tables = tables_for(e, seed=3)
    e.populate(tables)
    # Every row of head 0 (in reverse), a single row of head 1 everywhere.
    ids = np.stack([np.arange(63, -1, -1).reshape(4, 16), np.full((4, 16), 2)], axis=-1)
    assert np.array_equal(e.lookup(ids), expected(tables, ids))


def test_lookup_reads_only_the_needed_rows(st, layers):
    """Through a store that records the ranged reads: distinct rows only, consecutive
    rows in one range, nothing of the table beyond them."""
    layer = new_layer()
    e = layers((1000, 50), 4, layer=layer)
    tables = tables_for(e, seed=11)
    e.populate(tables)
    calls = []

    class Recording:
        def __getattr__(self, name):
            return getattr(st, name)

        def get_into_ranges(self, *args):
            calls.append(args)
            return st.get_into_ranges(*args)

    reader = EngramStore(layer, config((1000, 50), 4), Recording())
    ids = np.array([[[10, 7], [11, 7], [12, 7], [500, 7], [10, 49]]])
    assert np.array_equal(reader.lookup(ids), expected(tables, ids))
    assert len(calls) == 1
    ptrs, keys, dsts, srcs, sizes = calls[0]
    assert len(ptrs) == 1 and keys == [e.get_store_keys()]
    row = 4 * 4
    assert srcs[0] == [[10 * row, 500 * row], [7 * row, 49 * row]]
    assert sizes[0] == [[3 * row, row], [row, row]]


def test_populate_converts_other_dtypes_and_layouts(layers):
    e = layers((6, 9), 5)
    src = tables_for(e, seed=5)
    given = [src[0].astype(np.float64), np.asfortranarray(src[1])]
    e.populate(given)
    ids = random_ids(e, (3, 4), seed=1)
    assert np.array_equal(e.lookup(ids), expected(src, ids))


def test_heads_may_share_one_array_and_registered_memory(st, layers):
    table = tables_for(layers((8,), 4), seed=1)[0]  # just a (8, 4) table
    e = layers((8, 8, 8), 4)
    e.populate([table, table, table[:, :]])  # the same memory three times
    ids = random_ids(e, (2, 5), seed=2)
    assert np.array_equal(e.lookup(ids), expected([table] * 3, ids))

    # Tables inside a buffer the caller registered keep that registration.
    block = np.ascontiguousarray(np.stack(tables_for(e, seed=9)))
    assert st.register_buffer(block.ctypes.data, block.nbytes) == 0
    try:
        f = layers((8, 8, 8), 4)
        f.populate(list(block))
        assert np.array_equal(f.lookup(ids), expected(list(block), ids))
        assert st._zero_copy(block.ctypes.data, block.nbytes)
    finally:
        assert st.unregister_buffer(block.ctypes.data) == 0


def test_larger_tables_round_trip(layers):
    e = layers((5000, 1, 3001), 64)
    tables = tables_for(e, seed=21)
    e.populate(tables)
    ids = random_ids(e, (8, 32), seed=22)
    assert np.array_equal(e.lookup(ids), expected(tables, ids))


def test_layout_matches_the_documented_key_and_bytes(st, layers):
    """Head h's table is the row-major float32 bytes under engram:l{layer}:h{h}, both
    ways: what populate wrote reads back as those bytes, and bytes put there directly
    are what lookup returns (tables written by upstream's backend are found)."""
    layer = new_layer()
    e = layers((3, 4), 2, layer=layer)
    tables = tables_for(e, seed=4)
    e.populate(tables)
    for h, t in enumerate(tables):
        assert st.get(f"engram:l{layer}:h{h}") == t.tobytes()

    other = new_layer()
    f = layers((6, 2), 3, layer=other)
    raw = [np.arange(18, dtype=np.float32).reshape(6, 3), -np.ones((2, 3), np.float32)]
    for h, t in enumerate(raw):
        assert st.put(f"engram:l{other}:h{h}", t.tobytes()) == 0
    ids = [[[5, 1], [0, 0]]]
    assert np.array_equal(f.lookup(ids), expected(raw, ids))


def test_same_layer_id_shares_tables_and_other_layers_do_not(st, layers):
    layer = new_layer()
    a = layers((4, 5), 2, layer=layer)
    tables = tables_for(a, seed=8)
    a.populate(tables)
    b = EngramStore(layer, config((4, 5), 2), st)
    ids = [[[3, 4], [0, 1]]]
    assert np.array_equal(b.lookup(ids), expected(tables, ids))
    c = layers((4, 5), 2)
    with pytest.raises(RuntimeError, match="not in the store"):
        c.lookup(ids)


# ------------------------------------------------------------------ rejected input


def test_lookup_before_populate_fails_clearly(layers):
    e = layers((4, 5), 2)
    with pytest.raises(RuntimeError, match=r"table 'engram:l\d+:h0' is not in the store"):
        e.lookup([[[0, 0]]])
    with pytest.raises(RuntimeError, match="not in the store"):
        e.lookup(np.zeros((2, 2, 2), np.int64))


@pytest.mark.parametrize("ids,match", [
    ([[[17, 0, 0, 0]]],
     r"row_ids\[0\]\[0\]\[0\] = 17 is out of range for head 0 \(table size 17\)"),
    ([[[0, 0, 0, 0], [0, 0, 0, -1]]], r"row_ids\[0\]\[1\]\[3\] = -1 is out of range for head 3"),
    # 20 is a row of head 2 (23 rows), not of head 1 (19).
    ([[[1, 20, 20, 20]]], r"row_ids\[0\]\[0\]\[1\] = 20 is out of range for head 1"),
    (np.array([[[0, 0, 0, 29]]]), r"= 29 is out of range for head 3 \(table size 29\)"),
    (np.array([[[0, 0, 0, 2 ** 64 - 1]]], dtype=np.uint64), "out of range for head 3"),
    ([[[0, 0, 0, 1 << 70]]], "does not fit in int64"),
    ([], "row_ids must not be empty"),
    ([[]], "row_ids must not be empty"),
    (np.zeros((0, 2, 4), np.int64), "row_ids must not be empty"),
    (np.zeros((2, 0, 4), np.int64), "row_ids must not be empty"),
    (np.zeros((1, 1, 3), np.int64), "last dimension must match num_heads"),
    (np.zeros((1, 4), np.int64), r"shape \[B, L, H\]"),
    (np.zeros((1, 1, 1, 4), np.int64), r"shape \[B, L, H\]"),
    (np.array([[["0", "1", "2", "3"]]]), "convertible to int64"),
    ([[[0, 1, 2]]], r"row_ids\[0\]\[0\] has 3 row ids; expected one per head \(4\)"),
    ([[[0, 1, 2, 3]], []], r"row_ids\[1\] has 0 tokens"),
    ([[[0, 1, 2, 3]], [[0, 1, 2, 3], [0, 1, 2, 3]]], r"row_ids\[1\] has 2 tokens"),
    ([[[0, 1, 2, 3], [0, 1, 2]]], r"row_ids\[0\]\[1\] has 3 row ids"),
    ([[[0, 1.0, 2, 3]]], r"row_ids\[0\]\[0\]\[1\]: expected an integer row id, got float"),
    ([[[0, "1", 2, 3]]], "expected an integer row id, got str"),
    ([[[[0], 1, 2, 3]]], "expected an integer row id, got list"),
])
def test_bad_row_ids_are_rejected(layers, ids, match):
    e = layers()
    tables = tables_for(e, seed=1)
    e.populate(tables)
    with pytest.raises(RuntimeError, match=match):
        e.lookup(ids)
    # Nothing changed: the tables are intact and lookups still work.
    ok = [[[16, 18, 22, 28]]]
    assert np.array_equal(e.lookup(ok), expected(tables, ok))


def test_non_iterable_row_ids_are_a_type_error(layers):
    e = layers()
    with pytest.raises(TypeError):
        e.lookup(5)
    with pytest.raises(TypeError, match=r"row_ids\[0\]"):
        e.lookup([7])


@pytest.mark.parametrize("case,match", [
    ("too_few", "embedding_buffers size must match num_heads"),
    ("too_many", "embedding_buffers size must match num_heads"),
    ("short_table", r"shape does not match .*entry 2 has shape \(22, 8\), expected \(23, 8\)"),
    ("wide_table", "shape does not match"),
    ("one_d", r"must be 2D \[N_h, D\]"),
    ("three_d", r"must be 2D \[N_h, D\]"),
    ("not_array", "must be NumPy arrays"),
    ("strings", "must be float32 arrays"),
])
def test_bad_tables_are_rejected_and_nothing_is_stored(st, layers, case, match):
    e = layers()
    tables = tables_for(e, seed=2)
    if case == "too_few":
        tables = tables[:3]
    elif case == "too_many":
        tables = tables + [tables[0]]
    elif case == "short_table":
        tables[2] = tables[2][:-1]
    elif case == "wide_table":
        tables[1] = np.zeros((19, 9), np.float32)
    elif case == "one_d":
        tables[3] = tables[3].reshape(-1)
    elif case == "three_d":
        tables[0] = tables[0].reshape(17, 8, 1)
    elif case == "not_array":
        tables[1] = tables[1].tolist()
    elif case == "strings":
        tables[3] = np.full((29, 8), "x")
    with pytest.raises(RuntimeError, match=match):
        e.populate(tables)
    assert absent(st, e)


def test_populate_takes_a_list(st, layers):
    e = layers()
    with pytest.raises(TypeError, match="list"):
        e.populate(tuple(tables_for(e)))
    assert absent(st, e)


def test_populate_is_create_only(st, layers):
    e = layers((4, 6), 3)
    first = tables_for(e, seed=1)
    e.populate(first)
    with pytest.raises(RuntimeError, match=r"'engram:l\d+:h0' already exists.*remove_from_store"):
        e.populate(tables_for(e, seed=2))
    ids = [[[0, 5], [3, 2]]]
    assert np.array_equal(e.lookup(ids), expected(first, ids))

    # One head already there (say, a half-removed layer) also refuses, writing nothing.
    f = layers((4, 6), 3)
    assert st.put(f.get_store_keys()[1], b"\0" * 72) == 0
    with pytest.raises(RuntimeError, match=r"'engram:l\d+:h1' already exists"):
        f.populate(tables_for(f))
    assert st.is_exist(f.get_store_keys()[0]) == 0


def test_table_of_another_shape_is_reported(st, layers):
    layer = new_layer()
    small = layers((4,), 2, layer=layer)
    tables = tables_for(small, seed=6)
    small.populate(tables)
    bigger = EngramStore(layer, config((8,), 2), st)
    assert np.array_equal(bigger.lookup([[[3]]]), expected(tables, [[[3]]]))
    with pytest.raises(RuntimeError, match="smaller than 64 bytes"):
        bigger.lookup([[[6]]])


# ------------------------------------------------------------------ remove


def test_remove_from_store_removes_every_head(st, layers):
    e = layers((4, 5, 6), 2)
    e.populate(tables_for(e))
    assert all(st.is_exist(k) == 1 for k in e.get_store_keys())
    assert e.remove_from_store() == 3  # nothing read, nothing leased: no force needed
    assert absent(st, e)
    assert e.remove_from_store() == 0
    assert e.remove_from_store(force=True) == 0
    with pytest.raises(RuntimeError, match="not in the store"):
        e.lookup([[[0, 0, 0]]])

    # Repopulating after a remove works; a head removed by hand is skipped.
    tables = tables_for(e, seed=5)
    e.populate(tables)
    ids = [[[3, 4, 5]]]
    assert np.array_equal(e.lookup(ids), expected(tables, ids))
    assert st.remove(e.get_store_keys()[1], True) == 0
    assert e.remove_from_store(force=True) == 2
    assert absent(st, e)


def test_remove_of_a_leased_layer_needs_force(st, layers):
    e = layers((4, 5), 2)
    e.populate(tables_for(e))
    e.lookup([[[1, 1]]])  # the read leases both tables
    with pytest.raises(RuntimeError, match=r"rc=-706 \(OBJECT_HAS_LEASE\).*force=True"):
        e.remove_from_store()
    assert e.remove_from_store(force=True) == 2
    assert absent(st, e)
