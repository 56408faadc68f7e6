"""Codec inference of mooncake.structured_object_store: which codec a non-tensor column
gets, how nested rows split into columns (MISSING vs None), and round trips of every
non-tensor codec and of jagged nested tensors through MooncakeBundleTransfer over an
in-memory store."""

import copy
import json
import pickle
import sys
import types

import pytest

np = pytest.importorskip("numpy")

from mooncake import _structure_inference  # noqa: E402
from mooncake.structured_object_store import (  # noqa: E402
    MISSING,
    FieldSchema,
    MooncakeBundleTransfer,
    _choose_leaf_codec,
    _escape_key,
    export_ref,
    import_ref,
    infer_structure,
)


class MemoryStore:
    """The put/get/remove a MooncakeBundleTransfer needs, kept in a dict."""

    def __init__(self):
        self.objects = {}

    def put(self, key, value, config=None):
        self.objects[key] = bytes(value)
        return 0

    def get(self, key):
        return self.objects.get(key, b"")

    def remove(self, key, force=False):
        return 0 if self.objects.pop(key, None) is not None else -704


@pytest.fixture
def store():
    return MemoryStore()


@pytest.fixture
def transfer(store):
    return MooncakeBundleTransfer(store)


def objects(values):
    out = np.empty(len(values), dtype=object)
    for i, v in enumerate(values):
        out[i] = v
    return out


def put_column(transfer, values, schema=None):
    schemas = None if schema is None else {"f": schema}
    return transfer.put({"non_tensor_batch": {"f": objects(values)}}, field_schemas=schemas)


def read_column(transfer, ref, rows=None):
    return list(transfer.get(ref, rows=rows)["non_tensor_batch"]["f"])


def roundtrip(transfer, values, schema=None):
    ref = put_column(transfer, values, schema)
    return ref.encoded_non_tensor["f"]["codec"], read_column(transfer, ref)


def leaves_and_nodes(values, path="r"):
    leaves, nodes = [], []
    infer_structure(path, values, leaves, nodes)
    return {leaf.path: leaf for leaf in leaves}, {node.path: node for node in nodes}


# ---------------------------------------------------------------- choosing a codec


@pytest.mark.parametrize("values, codec, dtype", [
    ([[1, 2], (3,)], "typed_ragged", "int64"),
    ([[], [1, 2]], "typed_ragged", "float64"),  # numpy reads [] as float64
    ([np.arange(2, dtype=np.int16), np.arange(2.0)], "typed_ragged", None),  # per row
    ([[True], [False, True]], "msgpack_ragged", None),  # bools are not numbers here
    ([1, 2.5, None], "ndarray", "float64"),
    ([True, False], "ndarray", "bool"),
    ([np.float32(1), np.float32(2)], "ndarray", "float32"),
    ([b"a", bytearray(b"b"), memoryview(b"c"), None], "bytes_ragged", None),
    ([[b"a", b"b"], [], None], "media_list_ragged", None),
    ([[], []], "media_list_ragged", None),
    (["a", None, "b"], "utf8_ragged", None),
    ([{"a": 1}, [1, "x"]], "msgpack_ragged", None),
    ([["a"], ["b", "c"]], "msgpack_ragged", None),
])
def test_leaf_codec_follows_the_rows_types(values, codec, dtype):
    decision = _choose_leaf_codec(values)
    assert decision.accepted, decision.reason
    assert decision.codec == codec
    assert decision.metadata.get("dtype") == dtype


@pytest.mark.parametrize("values, reason", [
    ([], "null"),
    ([None, MISSING], "null"),
    ([object(), None], "no codec matched"),
    ([1, "a"], "no codec matched"),
    ([True, np.bool_(False)], "no codec matched"),  # a numpy bool is not a number
    ([np.array(["text"])], "object ndarray rows"),
    ([2 ** 70], "non-numeric dtype"),
])
def test_leaf_codec_refuses_rows_no_codec_takes(values, reason):
    decision = _choose_leaf_codec(values)
    assert not decision.accepted
    assert reason in decision.reason


def test_tensor_rows_need_one_dtype_but_any_shape():
    torch = pytest.importorskip("torch")
    decision = _choose_leaf_codec([torch.ones(2), torch.ones(2, 3), None])
    assert (decision.accepted, decision.codec) == (True, "ragged_tensor")
    assert decision.metadata == {"dtype": "torch.float32"}
    mixed = _choose_leaf_codec([torch.ones(1), torch.ones(1, dtype=torch.int64)])
    assert (mixed.accepted, mixed.codec) == (False, "ragged_tensor")
    assert "torch.int64" in mixed.reason and "torch.float32" in mixed.reason


# ---------------------------------------------------------------- splitting rows


def test_dict_and_list_rows_split_into_columns_keeping_missing_apart_from_none():
    rows = [{"a": {"b": 1}, "l": [{"k": "x"}, None]}, {"a": None}, None, {"l": []}]
    leaves, nodes = leaves_and_nodes(rows)
    assert {p: n.node_type for p, n in nodes.items()} == {
        "r": "dict", "r.a": "dict", "r.l": "list", "r.l[0]": "dict"}
    assert nodes["r"].children == ["a", "l"]
    assert nodes["r"].row_mask == [True, True, False, True]
    assert nodes["r.a"].row_mask == [True, False, False, False]
    assert nodes["r.l"].lengths == [2, 0, 0, 0]
    assert set(leaves) == {"r.a.b", "r.l[0].k", "r.l[1]"}  # r.l[1] holds no dict
    b = leaves["r.a.b"].values
    assert b[0] == 1 and b[1] is None and b[2] is None and b[3] is None
    k = leaves["r.l[0].k"].values
    assert k[0] == "x" and k[1] is None and k[2] is None and k[3] is None
    assert leaves["r.l[0].k"].decision.codec == "utf8_ragged"
    assert leaves["r.l[1]"].values == [None, None, None, MISSING]


def test_keys_are_escaped_in_paths():
    assert _escape_key("plain") == "plain"
    assert _escape_key("a.b[0]\\c") == "a\\.b\\[0]\\\\c"
    leaves, nodes = leaves_and_nodes([{"a.b": {"x[0]": 1}}, {"a.b": {"x[0]": 2}}])
    assert list(leaves) == ["r.a\\.b.x\\[0]"]
    assert list(nodes) == ["r", "r.a\\.b"]


@pytest.mark.parametrize("rows", [
    [{f"k{i}": i for i in range(65)}],  # more keys than a split takes
    [[{"a": 1}] * 9],  # a list longer than a split takes
    [[1, {"a": 1}]],  # list items that are not containers
    [{1: "int key"}],
])
def test_rows_beyond_the_split_limits_stay_one_leaf(rows):
    leaves, nodes = leaves_and_nodes(rows)
    assert nodes == {} and list(leaves) == ["r"]
    assert leaves["r"].decision.codec == "msgpack_ragged"


def test_nesting_deeper_than_the_limit_is_refused():
    def nest(levels):
        value = 1
        for _ in range(levels):
            value = {"a": value}
        return value

    leaves, _ = leaves_and_nodes([nest(_structure_inference.MAX_DEPTH)])
    assert len(leaves) == 1
    with pytest.raises(ValueError, match="max depth"):
        leaves_and_nodes([nest(_structure_inference.MAX_DEPTH + 2)])


def test_missing_is_one_sentinel_through_copies_and_pickles():
    assert repr(MISSING) == "<MISSING>" and MISSING is not None
    assert copy.deepcopy(MISSING) is MISSING
    assert pickle.loads(pickle.dumps(MISSING)) is MISSING


# ---------------------------------------------------------------- round trips


def test_flat_columns_roundtrip_with_their_codecs(transfer):
    assert roundtrip(transfer, [1, None, 3]) == ("ndarray", [1, None, 3])
    codec, floats = roundtrip(transfer, [1.5, np.float64(2), None])
    assert codec == "ndarray" and floats == [1.5, 2.0, None]
    assert type(floats[0]) is float  # plain Python values, not numpy scalars
    assert roundtrip(transfer, ["a", None, "ü"]) == ("utf8_ragged", ["a", None, "ü"])
    assert roundtrip(transfer, [b"a", bytearray(b"bc"), None]) == \
        ("bytes_ragged", [b"a", b"bc", None])
    assert roundtrip(transfer, [[b"a", b"b"], [], None]) == \
        ("media_list_ragged", [[b"a", b"b"], [], None])
    assert roundtrip(transfer, [None, None]) == ("json_ragged", [None, None])


def test_typed_ragged_returns_rows_in_the_form_they_came(transfer):
    codec, rows = roundtrip(transfer, [[1, 2], None, []])
    assert codec == "typed_ragged" and rows == [[1, 2], None, []]
    arrays = [np.arange(6, dtype=np.int16).reshape(2, 3), np.arange(1, dtype=np.int16)]
    codec, rows = roundtrip(transfer, arrays)
    assert codec == "typed_ragged"
    for got, want in zip(rows, arrays):
        assert got.dtype == np.int16 and np.array_equal(got, want)
    mixed = [np.asarray([1, 2], dtype=np.int32), [3], None]
    codec, rows = roundtrip(transfer, mixed, FieldSchema("typed_ragged",
                                                         metadata={"dtype": "int32"}))
    assert isinstance(rows[0], np.ndarray) and rows[0].dtype == np.int32
    assert rows[1] == [3] and rows[2] is None
    with pytest.raises(ValueError, match="failed to encode non_tensor_batch field 'f' "
                                         "with FieldSchema codec 'typed_ragged'"):
        put_column(transfer, [[1]], FieldSchema("typed_ragged", metadata={"dtype": "U1"}))


def test_dict_rows_are_msgpack_without_the_msgpack_package(transfer, monkeypatch):
    monkeypatch.setitem(sys.modules, "msgpack", None)  # import msgpack would fail
    rows = [{"a": np.int64(1), "blob": b"\x00"}, None, {"t": (1, 2), 3: [np.float32(0.5)]}]
    codec, got = roundtrip(transfer, rows)
    assert codec == "msgpack_ragged"
    assert got == [{"a": 1, "blob": b"\x00"}, None, {"t": [1, 2], 3: [0.5]}]


def test_dict_of_tensors_rows_are_stored_structured(transfer):
    torch = pytest.importorskip("torch")
    rows = [{"tokens": torch.arange(3), "score": 0.5},
            {"score": None},  # no tokens key at all
            None,
            {"tokens": None, "score": 2.0}]  # a tokens key holding None
    ref = put_column(transfer, rows)
    encoded = ref.encoded_non_tensor["f"]
    assert encoded["codec"] == "structured_recursive"
    assert {leaf["path"]: leaf["codec"] for leaf in encoded["metadata"]["leaves"]} == {
        "non_tensor_batch.f.score": "ndarray", "non_tensor_batch.f.tokens": "ragged_tensor"}
    assert any(part.endswith(".missing") for part in encoded["payload_members"])
    handle = json.loads(json.dumps(export_ref(ref)))
    got = read_column(transfer, import_ref(handle))
    assert torch.equal(got[0]["tokens"], rows[0]["tokens"]) and got[0]["score"] == 0.5
    assert got[1] == {"score": None}
    assert got[2] is None
    assert got[3] == {"tokens": None, "score": 2.0}
    picked = read_column(transfer, ref, rows=[3, 0])
    assert picked[0] == got[3] and torch.equal(picked[1]["tokens"], rows[0]["tokens"])
    assert read_column(transfer, ref, rows=slice(1, 3)) == [{"score": None}, None]


def test_nested_lists_and_native_leaves_are_rebuilt(transfer):
    rows = [{"images": [{"px": b"ab"}, None], "scores": np.arange(2), "tags": ["x"]},
            {"images": [], "scores": np.arange(0), "tags": []},
            {"images": [{"px": None}]},
            None]
    codec, got = roundtrip(transfer, rows)
    assert codec == "structured_recursive"
    assert got[0]["images"] == [{"px": b"ab"}, None] and got[0]["tags"] == ["x"]
    assert isinstance(got[0]["scores"], np.ndarray) and got[0]["scores"].tolist() == [0, 1]
    assert got[1]["images"] == [] and got[1]["tags"] == [] and got[1]["scores"].size == 0
    assert got[2] == {"images": [{"px": None}]}
    assert got[3] is None


def test_ragged_tensor_rows_keep_dtype_and_shape(transfer):
    torch = pytest.importorskip("torch")
    rows = [torch.arange(4, dtype=torch.int16).reshape(2, 2), None,
            torch.zeros(0, dtype=torch.int16), torch.ones(3, dtype=torch.int16)]
    codec, got = roundtrip(transfer, rows)
    assert codec == "ragged_tensor" and got[1] is None
    for i in (0, 2, 3):
        assert got[i].dtype == torch.int16 and torch.equal(got[i], rows[i])
    with pytest.raises(ValueError, match="mixed tensor dtype"):
        put_column(transfer, [torch.ones(1), torch.ones(1, dtype=torch.int64)])
    # rows are stored through numpy, which has no bfloat16 (upstream refuses it too)
    with pytest.raises(ValueError, match="bfloat16"):
        put_column(transfer, [torch.ones(2, dtype=torch.bfloat16)])


def test_ragged_tensor_dict_schema(transfer):
    torch = pytest.importorskip("torch")
    schema = FieldSchema("ragged_tensor_dict", metadata={"keys": {"image": None,
                                                                  "audio": None}})
    rows = [{"image": torch.ones(2, 2)}, None, {},
            {"image": torch.zeros(1), "audio": torch.arange(3.0)}]
    ref = put_column(transfer, rows, schema)
    encoded = ref.encoded_non_tensor["f"]
    assert encoded["codec"] == "ragged_tensor_dict"
    assert encoded["metadata"]["keys"] == ["image", "audio"]
    got = read_column(transfer, ref)
    assert set(got[0]) == {"image"} and torch.equal(got[0]["image"], rows[0]["image"])
    assert got[1] is None and got[2] == {}
    assert torch.equal(got[3]["audio"], rows[3]["audio"])
    empty = put_column(transfer, [None, None], FieldSchema(
        "ragged_tensor_dict", metadata={"keys": ["image"]}))
    assert "image.data" in empty.encoded_non_tensor["f"]["payload_members"]
    assert read_column(transfer, empty) == [None, None]


@pytest.mark.parametrize("row, keys, error, message", [
    ({"a.b": 1}, None, ValueError, "must not contain"),
    ({"": 1}, None, ValueError, "must not be empty"),
    ({"audio": 1}, ["image"], ValueError, "not declared"),
    ({"image": None}, ["image"], TypeError, "explicit None"),
    ({"image": "not a tensor"}, ["image"], ValueError, "key 'image'"),
    ("not a mapping", None, TypeError, "mappings"),
])
def test_ragged_tensor_dict_refuses_bad_rows(transfer, store, row, keys, error, message):
    pytest.importorskip("torch")
    schema = FieldSchema("ragged_tensor_dict",
                         metadata={} if keys is None else {"keys": keys})
    with pytest.raises(error, match=message):
        put_column(transfer, [row], schema)
    assert store.objects == {}  # nothing was written


def test_pil_images_are_stored_as_raw_pixels(transfer, monkeypatch):
    class FakeImage:
        def __init__(self, mode, size, data):
            self.mode, self.size, self.data, self.format = mode, size, data, "PNG"

        def tobytes(self):
            return self.data

        def save(self, *args):
            raise AssertionError("images are stored as raw pixels, never saved")

    FakeImage.__module__ = "PIL.Image"
    image_module = types.ModuleType("PIL.Image")
    image_module.frombuffer = lambda mode, size, data, *args: FakeImage(mode, size, bytes(data))
    pil = types.ModuleType("PIL")
    pil.Image = image_module
    monkeypatch.setitem(sys.modules, "PIL", pil)
    monkeypatch.setitem(sys.modules, "PIL.Image", image_module)

    images = [FakeImage("L", (2, 1), b"\x01\x02"), None, FakeImage("RGB", (1, 1), b"abc")]
    codec, got = roundtrip(transfer, images)
    assert codec == "media_bytes" and got[1] is None
    for i in (0, 2):
        assert isinstance(got[i], FakeImage) and got[i].data == images[i].data
        assert (got[i].mode, got[i].size, got[i].format) == \
            (images[i].mode, images[i].size, "PNG")
    ref = put_column(transfer, [b"raw", images[0]], FieldSchema("media_bytes"))
    got = read_column(transfer, ref)
    assert got[0] == b"raw" and got[1].data == b"\x01\x02"
    monkeypatch.setitem(sys.modules, "PIL", None)  # without Pillow: the raw pixels
    assert read_column(transfer, ref) == [b"raw", b"\x01\x02"]


def test_schema_errors_name_the_field_and_codec(transfer, store):
    with pytest.raises(AttributeError, match="field 'f' with FieldSchema codec 'utf8_ragged'"):
        put_column(transfer, ["ok", object()], FieldSchema("utf8_ragged"))
    with pytest.raises(ValueError, match="unsupported schema codec"):
        put_column(transfer, ["x"], FieldSchema("no_such_codec"))
    with pytest.raises(ValueError, match="not nullable"):
        put_column(transfer, ["x", None], FieldSchema("auto", nullable=False))
    with pytest.raises(ValueError, match="numeric"):
        put_column(transfer, [1], FieldSchema("ndarray", metadata={"dtype": "U3"}))
    with pytest.raises(ValueError, match="unsupported structured non-tensor field"):
        put_column(transfer, [object(), None])
    assert store.objects == {}


def test_auto_schema_keeps_dense_arrays_as_members(transfer):
    ref = transfer.put({"non_tensor_batch": {"f": np.arange(3)}},
                       field_schemas={"f": FieldSchema("auto")})
    assert ref.encoded_non_tensor == {}
    assert transfer.get(ref)["non_tensor_batch"]["f"].tolist() == [0, 1, 2]


def test_malformed_structured_payload_is_a_clear_error(transfer):
    torch = pytest.importorskip("torch")
    ref = put_column(transfer, [{"t": torch.ones(1)}, {"t": torch.ones(2)}])
    encoded = ref.encoded_non_tensor["f"]
    payload = {part: b"\x00" for part in encoded["payload_members"]}  # wrong sizes
    with pytest.raises(ValueError):
        _structure_inference.decode_field(encoded, payload, 2)
    broken = dict(encoded, metadata=dict(encoded["metadata"], root_path="elsewhere"))
    with pytest.raises(ValueError, match="malformed structured_recursive"):
        transfer.get(dict(export_ref(ref), encoded_non_tensor={"f": broken}))


# ---------------------------------------------------------------- jagged nested tensors


def test_jagged_nested_batch_fields_roundtrip_with_row_selection(transfer):
    torch = pytest.importorskip("torch")
    rows = [torch.arange(2), torch.arange(10, 14), torch.arange(20, 21)]
    nested = torch.nested.as_nested_tensor(rows, layout=torch.jagged)
    ref = transfer.put({"batch": {"tokens": nested}})
    spec = transfer.dataproto_manifest_view(ref)["batch_fields"]["tokens"]["spec"]
    assert spec["nested"] is True and spec["format"] == "tensor_parts"
    assert len(spec["part_bytes"]) == 2 and spec["has_lengths"] is False
    for selection, want in ((None, rows), (slice(1, 3), rows[1:]),
                            ([2, 0, 2], [rows[2], rows[0], rows[2]]), ([], [])):
        got = transfer.get(ref, rows=selection)["batch"]["tokens"]
        assert got.is_nested and got.layout == torch.jagged and len(got) == len(want)
        for a, b in zip(got.unbind(), want):
            assert torch.equal(a, b)
    with pytest.raises(ValueError, match="destinations"):
        transfer.get(ref, destinations={"tokens": torch.empty(7)})


@pytest.mark.filterwarnings("ignore:The PyTorch API of nested tensors")  # the strided one
def test_jagged_tensors_keep_their_ragged_dim_and_lengths(transfer):
    torch = pytest.importorskip("torch")
    matrices = [torch.arange(6).reshape(2, 3), torch.arange(10).reshape(2, 5)]
    wide = torch.nested.as_nested_tensor(matrices, layout=torch.jagged)
    holey = torch.nested.nested_tensor_from_jagged(
        torch.arange(10.0), offsets=torch.tensor([0, 4, 8]), lengths=torch.tensor([2, 3]))
    ref = transfer.put({"batch": {"wide": wide, "holey": holey}})
    got = transfer.get(ref)["batch"]
    assert got["wide"]._ragged_idx == 2
    for a, b in zip(got["wide"].unbind(), matrices):
        assert torch.equal(a, b)
    assert [t.tolist() for t in got["holey"].unbind()] == [[0.0, 1.0], [4.0, 5.0, 6.0]]
    picked = transfer.get(ref, rows=[1])["batch"]
    assert [t.tolist() for t in picked["holey"].unbind()] == [[4.0, 5.0, 6.0]]
    assert torch.equal(picked["wide"].unbind()[0], matrices[1])
    strided = torch.nested.nested_tensor([torch.ones(1), torch.ones(2)])
    with pytest.raises(ValueError, match="jagged"):
        transfer.put_object({"strided": strided})


# ---------------------------------------------------------------- releasing results


def test_release_result_releases_a_shared_owner_once():
    class Owner:
        releases = 0

        def release(self):
            self.releases += 1

    class Owned(np.ndarray):
        pass

    owner = Owner()
    base = np.arange(4).view(Owned)
    base._mooncake_pool_owner = owner
    views = [base[:2].view(Owned), base[2:].view(Owned)]
    for view in views:
        view._mooncake_pool_owner = owner
    MooncakeBundleTransfer.release_result({"rows": views, "again": {"x": (views[0],)}})
    assert owner.releases == 1
