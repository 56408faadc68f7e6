"""mooncake.structured_object_store at the byte and call level, over an in-process
store that records its calls: which store calls a put, read and removal use, how write
configs carry one storage group per key, upstream's payload layouts of non-tensor codecs,
the msgpack subset, and mooncake.store's tensor serialization helpers."""

import ctypes

import pytest

np = pytest.importorskip("numpy")

import mooncake.structured_object_store as sos  # noqa: E402
from mooncake import _structured_msgpack as msgpack  # noqa: E402
from mooncake.structured_object_store import (  # noqa: E402
    BundleTransferPolicy,
    FieldSchema,
    MooncakeBundleTransfer,
    StructuredObjectPayload,
)


class Config:
    """A write config as a duck store sees it."""

    def __init__(self, group_ids=None):
        self.group_ids = group_ids


class RecordingStore:
    """put/get/remove plus the zero-copy calls, each call recorded as (name, keys)."""

    def __init__(self):
        self.objects, self.calls, self.configs = {}, [], []
        self.registered = {}

    def _note(self, name, keys, config=None):
        self.calls.append((name, list(keys)))
        self.configs.append(config)

    def count(self, name):
        return sum(1 for call, _ in self.calls if call == name)

    def put(self, key, value, config=None):
        self._note("put", [key], config)
        self.objects[key] = bytes(value)
        return 0

    def get(self, key):
        self._note("get", [key])
        return self.objects.get(key, b"")

    def remove(self, key, force=False):
        self._note("remove", [key])
        return 0 if self.objects.pop(key, None) is not None else -704

    def batch_remove(self, keys, force=False):
        self._note("batch_remove", keys)
        assert force is True
        return [0 if self.objects.pop(k, None) is not None else -704 for k in keys]

    def register_buffer(self, ptr, size):
        self.registered[ptr] = size
        return 0

    def unregister_buffer(self, ptr):
        return 0 if self.registered.pop(ptr, None) is not None else -1

    def batch_put_from(self, keys, ptrs, sizes, config=None):
        self._note("batch_put_from", keys, config)
        for k, p, n in zip(keys, ptrs, sizes):
            self.objects[k] = ctypes.string_at(p, n)
        return [0] * len(keys)

    def get_into(self, key, ptr, size):
        self._note("get_into", [key])
        data = self.objects[key]
        ctypes.memmove(ptr, data, len(data))
        return len(data)

    def batch_get_into(self, keys, ptrs, sizes):
        self._note("batch_get_into", keys)
        for k, p in zip(keys, ptrs):
            ctypes.memmove(p, self.objects[k], len(self.objects[k]))
        return [len(self.objects[k]) for k in keys]

    def get_into_ranges(self, ptrs, all_keys, all_dst, all_src, all_sizes):
        self._note("get_into_ranges", all_keys[0])
        out = []
        for base, keys, dsts, srcs, sizes in zip(ptrs, all_keys, all_dst, all_src, all_sizes):
            per_key = []
            for key, dst, src, size in zip(keys, dsts, srcs, sizes):
                data = self.objects[key]
                for d, s, n in zip(dst, src, size):
                    ctypes.memmove(base + d, data[s:s + n], n)
                per_key.append(list(size))
            out.append(per_key)
        return out


class Lease:
    def __init__(self, size):
        self._memory = ctypes.create_string_buffer(max(size, 1))
        self.ptr, self.size, self.released = ctypes.addressof(self._memory), size, False

    @property
    def buffer(self):
        return memoryview(self._memory).cast("B")[:self.size]

    def release(self):
        self.released = True


class Pool:
    def __init__(self):
        self.leases = []

    def acquire(self, size):
        self.leases.append(Lease(size))
        return self.leases[-1]


def test_a_bundle_goes_away_in_one_forced_batch_removal():
    store = RecordingStore()
    transfer = MooncakeBundleTransfer(store, key_prefix="wire", default_chunk_bytes=5)
    ref = transfer.put_bundle(b"metadata", {"a": b"0123456789ab", "b": b"xy"})
    assert [c["bytes"] for c in ref.manifest["buffers"]["a"]["chunks"]] == [5, 5, 2]
    transfer.remove_bundle(ref)
    removals = [(name, keys) for name, keys in store.calls if "remove" in name]
    assert len(removals) == 1 and removals[0][0] == "batch_remove"
    assert set(removals[0][1]) == {*ref_keys(ref), ref.manifest_key}
    assert store.objects == {}


def ref_keys(ref):
    return [c["key"] for spec in (ref.manifest["meta"], *ref.manifest["buffers"].values())
            for c in spec["chunks"]]


def test_reads_take_the_call_that_fits_the_range():
    store = RecordingStore()
    transfer = MooncakeBundleTransfer(store, key_prefix="wire")
    grid = np.arange(40, dtype=np.int32).reshape(10, 4)
    whole = transfer.put_structured_object(StructuredObjectPayload({}, {"g": grid}))
    cut = transfer.put_structured_object(StructuredObjectPayload({}, {"g": grid}),
                                         chunk_bytes=48)
    store.calls.clear()
    assert np.array_equal(transfer.materialize(transfer.read_spec(whole)).objects["g"], grid)
    assert [name for name, _ in store.calls] == ["batch_get_into", "get_into"]  # meta, g
    store.calls.clear()
    rows = transfer.materialize(transfer.read_spec(cut).slice_member("g", 0, 2, 7))
    assert np.array_equal(rows.objects["g"], grid[2:7])
    assert [name for name, _ in store.calls] == ["batch_get_into", "get_into_ranges"]
    assert store.calls[1][1] == [c["key"] for c in cut.manifest["buffers"]["g"]["chunks"][0:3]]
    assert store.registered == {}  # every destination registered for the call only


def test_pool_staged_puts_write_one_lease_per_chunk_and_reads_land_in_the_pool():
    store, pool = RecordingStore(), Pool()
    transfer = MooncakeBundleTransfer(store, key_prefix="wire", buffer_pool=pool)
    parts = (bytearray(b"abc"), bytearray(b"defgh"))
    multi = sos._MultiBufferPayload(tuple(memoryview(p) for p in parts), parts)
    ref = transfer.put_structured_object(StructuredObjectPayload({}, {"m": multi}),
                                         chunk_bytes=4)
    assert [lease.size for lease in pool.leases] == [4, 4]  # "abcd", "efgh"
    assert store.count("batch_put_from") == 2 and all(l.released for l in pool.leases)
    got = transfer.materialize(transfer.read_spec(ref)).objects["m"]
    assert bytes(got) == b"abcdefgh" and pool.leases[-1].size == 8
    assert not pool.leases[-1].released
    MooncakeBundleTransfer.release_result({"m": got})
    assert pool.leases[-1].released


def test_zero_copy_is_only_for_tensor_object_buffers():
    store = RecordingStore()
    transfer = MooncakeBundleTransfer(store, key_prefix="wire")
    with pytest.raises(RuntimeError, match="zero-copy put requires tensor-object buffers"):
        transfer.put_structured_object(StructuredObjectPayload({}, {"raw": b"bytes"}),
                                       policy=BundleTransferPolicy(copy_mode="zero_copy"))
    assert store.objects == {}  # the metadata written first was removed again


def test_one_logical_group_is_repeated_per_key_without_touching_the_callers_config():
    config = Config(["rollout"])
    assert sos._config_for_grouped_keys(config, 1) is config
    three = sos._config_for_grouped_keys(config, 3)
    assert three.group_ids == ["rollout"] * 3 and config.group_ids == ["rollout"]
    assert sos._config_for_grouped_keys(Config("rollout"), 1).group_ids == ["rollout"]
    assert sos._config_for_grouped_keys(Config([]), 2).group_ids is None
    with pytest.raises(ValueError, match="exactly one"):
        sos._config_for_grouped_keys(Config(["a", "b"]), 1)


def test_a_dataproto_writes_every_object_into_its_storage_group():
    store, pool = RecordingStore(), Pool()
    transfer = MooncakeBundleTransfer(store, key_prefix="wire", buffer_pool=pool)
    rows = [np.arange(n, dtype=np.int16) for n in (3, 1, 2)]
    ref = transfer.put({"ids": np.arange(6).reshape(3, 2), "rows": rows}, type="dict",
                       chunk_bytes=4)
    group = ref._storage_group_id
    assert group.startswith("structured-")
    seen = [c.group_ids for c in store.configs if c is not None]
    assert seen and all(ids == [group] for ids in seen)
    flat = transfer.get(ref, type="dict", rows=[2, 0])
    assert [r.tolist() for r in flat["rows"]] == [[0, 1], [0, 1, 2]]
    assert flat["ids"].tolist() == [[4, 5], [0, 1]]


def flat_data(data, dtype):
    """The bytes a data payload (fast-copy arrays or byte views) will be stored as."""
    arrays = getattr(data, "arrays", None)
    if arrays is None:
        arrays = [np.frombuffer(b, dtype=dtype) for b in data.buffers]
    return np.concatenate([a.reshape(-1) for a in arrays])


def test_typed_ragged_rows_use_upstreams_payload_layout():
    rows = [np.arange(3, dtype=np.int16), None, np.arange(4, dtype=np.int16).reshape(2, 2)]
    payload, metadata = sos._encode_typed_ragged_values(rows)
    assert set(payload) == {"data", "offsets", "shapes", "ndims", "nulls"}
    assert payload["offsets"].tolist() == [0, 3, 3, 7]
    assert payload["ndims"].tolist() == [1, 0, 2] and payload["nulls"].tolist() == [
        False, True, False]
    assert payload["shapes"].tolist() == [[3, 0], [0, 0], [2, 2]]
    assert metadata["physical_layout"] == "contiguous_flat" and metadata["dtype"] == "int16"
    flat = flat_data(payload["data"], np.int16)
    assert flat.tolist() == [0, 1, 2, 0, 1, 2, 3]
    got = sos._decode_typed_ragged_values({**payload, "data": flat}, 3, metadata)
    assert got[1] is None and got[2].shape == (2, 2) and got[0].tolist() == [0, 1, 2]
    lists, list_meta = sos._encode_typed_ragged_values([[1, 2], [3]])
    assert list_meta["row_format"] == "list"
    data = flat_data(lists["data"], np.int64)
    assert sos._decode_typed_ragged_values({**lists, "data": data}, 2, list_meta) == [
        [1, 2], [3]]


def test_schema_codecs_refuse_what_they_cannot_carry():
    with pytest.raises(ValueError, match="unable to infer a safe codec"):
        sos._encode_with_schema("f", [object()], FieldSchema("auto"))
    with pytest.raises(ValueError, match="unsupported schema codec"):
        sos._encode_with_schema("f", [1], FieldSchema("zip"))
    payload, _ = sos._encode_msgpack_ragged_values("f", [{"k": [1, None]}, None])
    assert sos._decode_msgpack_ragged_values(payload, 2) == [{"k": [1, None]}, None]
    with pytest.raises(ValueError, match="nulls length"):
        sos._decode_msgpack_ragged_values({**payload, "nulls": payload["nulls"][:1]}, 2)


@pytest.mark.parametrize("value, packed", [
    (None, b"\xc0"), (True, b"\xc3"), (5, b"\x05"), (-3, b"\xfd"), (200, b"\xcc\xc8"),
    (-200, b"\xd1\xff\x38"), (1.0, b"\xcb\x3f\xf0\x00\x00\x00\x00\x00\x00"),
    ("hi", b"\xa2hi"), (b"\x00", b"\xc4\x01\x00"), ([1, "a"], b"\x92\x01\xa1a"),
    ({"k": None}, b"\x81\xa1k\xc0"), ("x" * 40, b"\xd9\x28" + b"x" * 40),
])
def test_msgpack_rows_match_the_messagepack_spec(value, packed):
    assert msgpack.packb(value) == packed
    assert msgpack.unpack_all(packed + packed) == [value, value]


def test_msgpack_is_strict_about_types_and_truncation():
    for value in ((1, 2), np.int64(1), 1j):
        with pytest.raises(TypeError, match="can not serialize"):
            msgpack.packb(value)
    with pytest.raises(ValueError, match="truncated"):
        msgpack.unpack_all(b"\xa3ab")
    with pytest.raises(ValueError, match="unsupported msgpack format"):
        msgpack.unpack_all(b"\xd4\x01\x00")  # an extension type


def test_store_serializes_tensors_as_mooncake_tensor_objects():
    torch = pytest.importorskip("torch")
    store_module = pytest.importorskip("mooncake.store")
    tensor = torch.arange(12, dtype=torch.int32).reshape(3, 4)
    header, ptr, nbytes, owner = store_module._serialize_tensor(tensor)
    assert len(header) == store_module._tensor_metadata_size() == 304 and nbytes == 48
    blob = header + ctypes.string_at(ptr, nbytes)
    assert torch.equal(store_module._deserialize_tensor(blob), tensor)
    assert store_module._deserialize_tensor(b"not a tensor object") is None
    with pytest.raises(ValueError, match="unsupported tensor"):
        store_module._serialize_tensor("not a tensor")
    store = RecordingStore()  # no put_tensor: the serialized bytes are stored
    transfer = MooncakeBundleTransfer(store, key_prefix="wire", default_chunk_bytes=100)
    ref = transfer.put_object({"t": tensor})
    assert ref.manifest["buffers"]["t"]["metadata_bytes"] == 304
    picked = transfer.get_dataproto(transfer.put({"batch": {"t": tensor}}), rows=[2, 0])
    assert torch.equal(picked["batch"]["t"], tensor[[2, 0]])
    del owner
