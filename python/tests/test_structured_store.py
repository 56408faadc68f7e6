"""mooncake.structured_object_store and mooncake.dataproto_catalog against a real master:
bundles, structured objects (members, slices, destinations), DataProto stages, handles
and the catalog's bookkeeping."""

import ctypes

import pytest

np = pytest.importorskip("numpy")

from mooncake.dataproto_catalog import DataProtoCatalog, DataProtoCatalogTransfer  # noqa: E402
from mooncake.store import (  # noqa: E402
    _deserialize_tensor,
    _serialize_tensor,
    _tensor_metadata_size,
)
from mooncake.structured_object_store import (  # noqa: E402
    BundleTransferPolicy,
    FieldSchema,
    MooncakeBundleTransfer,
    StructuredMemberSlice,
    StructuredObjectPayload,
    export_ref,
    import_ref,
    raw_destination,
    tensor_object_buffer,
)

MiB = 1 << 20


@pytest.fixture
def store(master_factory):
    from mooncake.store import MooncakeDistributedStore

    s = MooncakeDistributedStore()
    assert s.setup("127.0.0.1", "P2PHANDSHAKE", 32 * MiB, 8 * MiB, "tcp", "",
                   master_factory().rpc) == 0
    yield s
    s.close()


class Batch:
    """A DataProto-like object (verl's attribute names)."""

    def __init__(self, batch=None, non_tensor_batch=None, meta_info=None):
        self.batch = batch or {}
        self.non_tensor_batch = non_tensor_batch or {}
        self.meta_info = meta_info or {}

    @classmethod
    def from_dict(cls, batch, non_tensor_batch=None, meta_info=None):
        return cls(batch, non_tensor_batch, meta_info)

    def __len__(self):
        return len(next(iter({**self.batch, **self.non_tensor_batch}.values())))


def objects(values):
    out = np.empty(len(values), dtype=object)
    for i, v in enumerate(values):
        out[i] = v
    return out


def test_bundle_is_chunked_and_removed_whole(store):
    transfer = MooncakeBundleTransfer(store, default_chunk_bytes=1000)
    ref = transfer.put_bundle(b"meta", {"big": bytes(range(256)) * 10, "empty": b""})
    spec = ref.manifest["buffers"]["big"]
    assert spec["bytes"] == 2560 and [c["bytes"] for c in spec["chunks"]] == [1000, 1000, 560]
    assert all(store.is_exist(c["key"]) == 1 for c in spec["chunks"])
    reread = transfer._bundle_store.resolve_manifest({"manifest_key": ref.manifest_key})
    assert reread == ref.manifest
    transfer.remove_bundle(ref)
    assert store.is_exist(ref.manifest_key) == 0
    assert all(store.is_exist(c["key"]) == 0 for c in spec["chunks"])
    transfer.remove_bundle(ref.__class__(ref.manifest_key, {}))  # already gone: fine
    with pytest.raises(ValueError, match="buffer name"):
        transfer.put_bundle(b"", {"a/b": b"x"})
    with pytest.raises(ValueError, match="chunk_bytes"):
        MooncakeBundleTransfer(store, default_chunk_bytes=0)


def test_forged_manifest_cannot_name_foreign_keys(store):
    transfer = MooncakeBundleTransfer(store)
    ref = transfer.put_bundle(b"m", {"x": b"payload"})
    forged = dict(ref.manifest, cleanup_keys=["someone-elses-key"])
    with pytest.raises(ValueError, match="outside"):
        transfer.remove_bundle({"manifest_key": ref.manifest_key, "manifest": forged})
    transfer.remove_bundle(ref)


@pytest.mark.parametrize("mode", ["auto", "copy"])
def test_structured_members_roundtrip_in_every_copy_mode(store, mode):
    torch = pytest.importorskip("torch")
    transfer = MooncakeBundleTransfer(store, default_chunk_bytes=4096)
    array = np.arange(3000, dtype=np.float64).reshape(300, 10)
    tensor = torch.arange(64, dtype=torch.bfloat16).reshape(8, 8)
    payload = StructuredObjectPayload({"note": "x"}, {"array": array, "tensor": tensor,
                                                      "raw": bytearray(b"r" * 9000)})
    policy = BundleTransferPolicy(max_inflight_put=4, put_mode="parallel", copy_mode=mode)
    ref = transfer.put_structured_object(payload, policy=policy)
    result = transfer.materialize(transfer.read_spec(ref))
    assert result.metadata["note"] == "x"
    assert np.array_equal(result.objects["array"], array)
    assert torch.equal(result.objects["tensor"], tensor)
    assert result.objects["raw"] == b"r" * 9000
    transfer.remove_bundle(ref)
    assert store.remove_all() == 0
    zero_copy = BundleTransferPolicy(copy_mode="zero_copy")
    with pytest.raises(RuntimeError, match="zero-copy put requires tensor-object buffers"):
        transfer.put_structured_object(StructuredObjectPayload({}, {"raw": b"r"}),
                                       policy=zero_copy)
    with pytest.raises(ValueError, match="BufferPool tensor-object buffer"):
        transfer.put_structured_object(StructuredObjectPayload({}, {"t": tensor}),
                                       policy=zero_copy)
    assert store.remove_all() == 0  # the refused puts left nothing behind


def test_read_spec_selects_members_slices_rows_and_fills_destinations(store):
    torch = pytest.importorskip("torch")
    transfer = MooncakeBundleTransfer(store, default_chunk_bytes=1000)
    array = np.arange(2000, dtype=np.int32).reshape(200, 10)
    tensor = torch.arange(600, dtype=torch.float32).reshape(100, 6)
    ref = transfer.put_object({"a": array, "t": tensor, "b": b"bytes"})
    spec = transfer.read_spec(ref).select_members(["a", "t"]) \
        .slice_member("a", 0, 5, 150, 7).slice_member("t", 0, -10, 1000)
    result = transfer.materialize(spec)
    assert list(result.objects) == ["a", "t"]
    assert np.array_equal(result.objects["a"], array[5:150:7])
    assert torch.equal(result.objects["t"], tensor[-10:])
    target = np.zeros((200, 10), dtype=np.int32)
    into = transfer.materialize_into(transfer.read_spec(ref).select_members(["a"]),
                                     {"a": target})
    assert into.objects["a"] is target and np.array_equal(target, array)
    # a tensor destination receives the stored tensor object: its header, then its bytes
    raw = ctypes.create_string_buffer(_tensor_metadata_size() + tensor.nbytes)
    transfer.materialize_into(transfer.read_spec(ref).select_members(["t"]),
                              {"t": raw_destination(ctypes.addressof(raw), len(raw), raw)})
    assert torch.equal(_deserialize_tensor(raw.raw), tensor)
    short = ctypes.create_string_buffer(tensor.nbytes)
    with pytest.raises(RuntimeError, match="get_tensor_into failed"):
        transfer.materialize_into(transfer.read_spec(ref).select_members(["t"]),
                                  {"t": raw_destination(ctypes.addressof(short), len(short))})
    with pytest.raises(ValueError, match="shape mismatch"):
        transfer.materialize_into(transfer.read_spec(ref).select_members(["a"]),
                                  {"a": np.zeros((5, 10), dtype=np.int32)})
    with pytest.raises(ValueError, match="axis=0"):
        transfer.materialize(transfer.read_spec(ref).slice_member("a", 1, 0, 2))
    with pytest.raises(KeyError):
        transfer.materialize(transfer.read_spec(ref).select_members(["nope"]))
    assert transfer.get_object(transfer.put_object(np.array(7)))[()] == 7


def test_tensor_object_buffer_is_put_from_pool_memory_and_read_back(store):
    torch = pytest.importorskip("torch")
    from mooncake.buffer_pool import BufferPool

    pool = BufferPool(store)
    transfer = MooncakeBundleTransfer(store, buffer_pool=pool)
    tensor = torch.arange(500, dtype=torch.int64).reshape(50, 10)
    header, data_ptr, nbytes, _owner = _serialize_tensor(tensor)
    size = len(header) + nbytes
    source = pool.acquire(size)  # a serialized tensor object in registered memory
    ctypes.memmove(source.ptr, header, len(header))
    ctypes.memmove(source.ptr + len(header), data_ptr, nbytes)
    ref = transfer.put_object({"blob": tensor_object_buffer(source.ptr, size, source)})
    target = pool.acquire(size)
    transfer.materialize_into(transfer.read_spec(ref),
                              {"blob": tensor_object_buffer(target.ptr, size, target)})
    assert ctypes.string_at(target.ptr, size) == ctypes.string_at(source.ptr, size)
    result = transfer.materialize(transfer.read_spec(ref))
    assert torch.equal(_deserialize_tensor(ctypes.string_at(source.ptr, size)), tensor)
    assert torch.equal(result.objects["blob"], tensor)
    for lease in (source, target):
        lease.release()
    array_ref = transfer.put_object({"a": np.arange(100, dtype=np.int64)})
    read = transfer.get_object(array_ref)  # lands in pool memory
    assert np.array_equal(read["a"], np.arange(100))
    transfer.release_result(read)
    pool.close()


def test_dataproto_stages_append_select_rows_and_clean_up(store):
    torch = pytest.importorskip("torch")
    transfer = MooncakeBundleTransfer(store, default_chunk_bytes=512)
    data = Batch(
        {"ids": torch.arange(20).reshape(10, 2), "mask": np.ones((10, 3), dtype=bool)},
        {"text": objects([f"row {i}" if i % 3 else None for i in range(10)]),
         "info": objects([{"i": i} for i in range(10)]),
         "ragged": objects([np.arange(i, dtype=np.int16) for i in range(10)]),
         "score": np.arange(10, dtype=np.float32)},
        {"temperature": 0.5})
    ref = transfer.put(data)
    assert ref.batch_size == 10 and ref._storage_group_id.startswith("structured-")
    assert set(ref.encoded_non_tensor) == {"text", "info", "ragged"}
    handle = export_ref(ref)
    assert export_ref(import_ref(handle)) == handle and handle["batch_size"] == 10
    got = transfer.get(handle, data_cls=Batch, rows=[9, 0, 4])
    assert torch.equal(got.batch["ids"], data.batch["ids"][[9, 0, 4]])
    assert list(got.non_tensor_batch["text"]) == [None, None, "row 4"]  # i % 3 == 0: None
    assert [r["i"] for r in got.non_tensor_batch["info"]] == [9, 0, 4]
    assert [len(r) for r in got.non_tensor_batch["ragged"]] == [9, 0, 4]
    assert got.meta_info == {"temperature": 0.5}
    rewarded = transfer.append_dataproto_fields(ref, {"batch": {"reward": torch.ones(10)}},
                                                stage="reward")
    again = transfer.append_dataproto_fields(rewarded, {"batch": {"bonus": torch.zeros(10)}},
                                             stage="reward")
    assert set(again.stage_refs) == {"default", "reward"}
    flat = transfer.get(again, type="dict", fields=["reward", "bonus", "text"],
                        rows=slice(0, 10, 4))
    assert flat["text"] == [None, "row 4", "row 8"] and flat["reward"].tolist() == [1.0] * 3
    view = transfer.dataproto_manifest_view(again)
    assert view["non_tensor_fields"]["text"]["spec"]["codec"] == "utf8_ragged"
    assert view["batch_fields"]["bonus"]["stage"] == "reward"
    with pytest.raises(ValueError, match="already exist"):
        transfer.append_dataproto_fields(again, {"batch": {"bonus": torch.zeros(10)}},
                                         stage="reward")
    with pytest.raises(ValueError, match="batch size"):
        transfer.append_dataproto_fields(again, {"batch": {"x": torch.zeros(3)}}, stage="s")
    with pytest.raises(KeyError):
        transfer.get(again, fields=["missing"])
    transfer.cleanup_dataproto(again)
    transfer.cleanup_dataproto(ref)  # the first stage's old manifest too
    assert store.remove_all() == 0


def test_field_schema_places_and_encodes_flat_dict_fields(store):
    transfer = MooncakeBundleTransfer(store)
    data = {"tokens": [[1, 2], [3], []], "labels": ["a", "b", "c"], "step": 7,
            "weights": np.array([0.5, 1.0, 2.0])}
    schemas = {"tokens": FieldSchema("typed_ragged", metadata={"dtype": "int32"}),
               "labels": FieldSchema("utf8_ragged", nullable=False)}
    ref = transfer.put(data, type="dict", field_schemas=schemas)
    assert ref.encoded_non_tensor["tokens"]["codec"] == "typed_ragged"
    assert ref.meta_info == {"step": 7}
    flat = transfer.get(ref, type="dict")
    assert flat["tokens"] == [[1, 2], [3], []] and flat["labels"] == ["a", "b", "c"]
    assert np.array_equal(flat["weights"], data["weights"]) and flat["step"] == 7
    with pytest.raises(ValueError, match="not nullable"):
        transfer.put({"labels": ["a", None]}, type="dict",
                     field_schemas={"labels": FieldSchema("utf8_ragged", nullable=False,
                                                          metadata={"section":
                                                                    "non_tensor_batch"})})
    with pytest.raises(ValueError, match="unsupported schema codec"):
        transfer.put({"x": [1, 2]}, type="dict", field_schemas={"x": FieldSchema("msgpack")})
    with pytest.raises(ValueError, match="unsupported structured non-tensor field"):
        transfer.put(Batch(non_tensor_batch={"o": objects([object(), object()])}))
    transfer.cleanup_dataproto(ref)


def test_catalog_publishes_fragments_and_retires_them_from_the_store(store):
    torch = pytest.importorskip("torch")
    transfer = MooncakeBundleTransfer(store)
    catalog = DataProtoCatalog()

    def call(method, *args, **kwargs):
        return getattr(catalog, method)(*args, **kwargs)

    managed = DataProtoCatalogTransfer(transfer, call)
    managed.put(Batch({"prompt": torch.arange(4)}), partition="train",
                keys=["a", "b", "c", "d"], tags=[{"step": 1}] * 4)
    plan = managed.resolve("train", ["d", "a"], ["prompt"])
    (fragment,) = plan["handles"]
    assert plan["field_groups"][0]["locations"] == [(fragment, 3), (fragment, 0)]
    got = transfer.get(plan["handles"][fragment], rows=[3, 0])
    assert got["batch"]["prompt"].tolist() == [3, 0]
    managed.remove("train", ["a", "b", "c", "d"])
    assert store.is_exist(fragment) == 1  # a pinned read still uses it
    managed.release_read(plan["read_token"])
    assert store.is_exist(fragment) == 0  # retired and removed
    assert catalog.list() == {} and catalog.release_read(plan["read_token"]) == {
        "retired_handles": []}
    with pytest.raises(ValueError, match="same length"):
        managed.put(None, partition="train", keys=["a"], tags=[{}, {}])
