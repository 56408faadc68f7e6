"""Structured objects and DataProto batches in Mooncake Store (upstream's
``mooncake.structured_object_store`` API).

``MooncakeBundleTransfer(store)`` stores, over any store with put/get/remove (a
``MooncakeDistributedStore``; its zero-copy calls are used when present):

* bundles: metadata bytes plus named buffers (``put_bundle``, ``remove_bundle``);
* structured objects: JSON metadata plus named members -- bytes, numpy arrays, CPU
  torch tensors, or ``tensor_object_buffer`` regions put zero-copy
  (``put_structured_object``, ``put_object``/``get_object``), read back lazily through a
  ``StructuredObjectReadSpec`` that selects members and axis-0 row slices
  (``read_spec``, ``materialize``, ``materialize_into`` caller destinations: numpy
  arrays, torch tensors, ``raw_destination`` memory);
* DataProto batches (verl's ``batch`` / ``non_tensor_batch`` / ``meta_info``, or a flat
  dict): ``put``/``put_dataproto`` store one stage as a structured object and return a
  ``MooncakeDataProtoRef``, a light handle (``export_ref`` makes it JSON for another
  process, ``import_ref`` reads it back); ``append_dataproto_fields`` adds fields in a
  new or the same stage; ``get``/``get_dataproto`` read selected fields and rows;
  ``cleanup_dataproto`` removes every object of a handle.

Bytes are chunked (``default_chunk_bytes``, 64 MiB) into store objects; see
``mooncake._bundle_store`` for the key layout and manifest,
``mooncake._structured_codecs`` for member encodings (jagged nested tensors included),
``mooncake._row_codecs`` for the non-tensor field codecs and
``mooncake._structure_inference`` for how a field's codec is inferred (``MISSING``,
``infer_structure``, ``_choose_leaf_codec``, ``_escape_key``). The objects of one
DataProto share a storage group (``config.group_ids``: one logical id, or ``[""]`` for
none; a fresh id by default), so the store evicts them together.

Differences from upstream: tensors (jagged nested ones and ragged_tensor rows too,
bfloat16 included) are stored as their raw bytes with dtype and shape in the manifest
(upstream uses its store's tensor serialization or torch.save); non-tensor payload
layouts are this package's own; dict/list rows fall back to json_ragged where the
msgpack package is not installed; and the module imports numpy, torch, msgpack and
Pillow only when a value needs them.
"""

import copy
import ctypes
import sys
import uuid
from dataclasses import dataclass, field
from typing import Any, Mapping, Optional, Protocol, Sequence, Union

from . import _bundle_store as B
from . import _structure_inference as I
from . import _structured_codecs as C
from ._bundle_store import (  # upstream exports these names
    AUTO_PARALLEL_MIN_BYTES,
    AUTO_PARALLEL_MIN_CHUNKS,
    DEFAULT_BUNDLE_CHUNK_BYTES,
    MISSING_OBJECT_ERROR,
)
from ._structure_inference import (  # noqa: F401 (upstream's names for these)
    MISSING,
    CodecDecision as _CodecDecision,
    InferredLeaf as _InferredLeaf,
    InferredNode as _InferredNode,
    choose_leaf_codec as _choose_leaf_codec,
    escape_key as _escape_key,
    infer_structure,
)
from ._structured_codecs import FIELD_SPECS_KEY as STRUCTURED_FIELD_SPECS_KEY

__all__ = [
    "BundleTransferPolicy", "FieldSchema", "RemoteBundleRef", "StructuredObjectPayload",
    "StructuredObjectResult", "StructuredFieldLocation", "MooncakeDataProtoRef",
    "StructuredMemberSlice", "StructuredObjectReadSpec", "MooncakeBundleTransfer",
    "tensor_object_buffer", "raw_destination", "is_dataproto_ref_handle",
    "export_dataproto_ref", "import_dataproto_ref", "export_ref", "import_ref",
    "DEFAULT_BUNDLE_CHUNK_BYTES", "DATAPROTO_REF_HANDLE_TYPE", "DATAPROTO_REF_HANDLE_VERSION",
    "STORAGE_GROUP_ID", "AUTO_PARALLEL_MIN_BYTES", "AUTO_PARALLEL_MIN_CHUNKS",
    "MISSING_OBJECT_ERROR", "STRUCTURED_FIELD_SPECS_KEY", "BundleStore", "DataProtoRefLike",
    "MISSING", "infer_structure",
]

DATAPROTO_REF_HANDLE_TYPE = "mooncake_dataproto_ref"
DATAPROTO_REF_HANDLE_VERSION = 1
STORAGE_GROUP_ID = "storage_group_id"
_WRAPPED_OBJECT = "__mooncake_wrapped_object__"
_SECTIONS = ("batch", "non_tensor_batch", "meta_info")


# ---------------------------------------------------------------- public records


class BundleStore(Protocol):
    """What a store needs for bundles (a MooncakeDistributedStore has it all, and its
    zero-copy calls are used when present)."""

    def put(self, key: str, value: Any, config: Any = None) -> int: ...

    def get(self, key: str) -> bytes: ...

    def remove(self, key: str, force: bool = False) -> int: ...

    def is_exist(self, key: str) -> int: ...


@dataclass(frozen=True)
class BundleTransferPolicy:
    """How payload chunks are written. ``max_inflight_put``: chunks written at once;
    ``put_mode``: "batch" (one at a time), "parallel", or "auto" (parallel for at least
    8 chunks and 64 MiB); ``copy_mode``: "copy" (``put``), "zero_copy" (straight from the
    caller's writable memory, registered for the call) or "auto" (through the transfer's
    BufferPool when it has one, else copy)."""

    max_inflight_put: int = 1
    put_mode: str = "auto"
    copy_mode: str = "auto"

    def as_copy(self):
        return self if self.copy_mode == "copy" else \
            BundleTransferPolicy(self.max_inflight_put, self.put_mode, "copy")


@dataclass(frozen=True)
class FieldSchema:
    """How a DataProto non-tensor field is encoded: ``codec`` (see
    ``mooncake._row_codecs``, or "auto" to infer it), ``nullable``, and ``metadata``
    ("section": batch, non_tensor_batch or meta_info, to place a flat-dict field; "dtype"
    for numeric codecs; "keys" for ragged_tensor_dict)."""

    codec: str
    nullable: bool = True
    metadata: dict = field(default_factory=dict)


@dataclass
class RemoteBundleRef:
    """A stored bundle: its manifest key (and the manifest when known)."""

    manifest_key: str
    manifest: dict


@dataclass(frozen=True, init=False)
class StructuredObjectPayload:
    """A structured object to store: JSON ``metadata`` and named ``buffers``."""

    metadata: Mapping[str, Any]
    buffers: Mapping[str, Any]

    def __init__(self, metadata=None, buffers=None):
        if buffers is None:
            raise TypeError("StructuredObjectPayload requires buffers")
        object.__setattr__(self, "metadata", {} if metadata is None else metadata)
        object.__setattr__(self, "buffers", buffers)


@dataclass
class StructuredObjectResult:
    metadata: dict
    objects: dict


@dataclass(frozen=True)
class StructuredFieldLocation:
    """Where a DataProto field lives: its stage, member and section."""

    stage: str
    member: str
    section: str


@dataclass
class MooncakeDataProtoRef:
    """A stored DataProto: one structured object per stage, and where each field is."""

    batch_size: int
    stage_refs: dict
    field_index: dict
    meta_info: dict
    namespace: str = "default"
    partition: str = "default"
    global_indexes: Optional[list] = None
    encoded_non_tensor: dict = field(default_factory=dict)
    _storage_group_id: Optional[str] = field(default=None, repr=False)


@dataclass(frozen=True)
class StructuredMemberSlice:
    """Rows ``start:end:step`` of a member along ``axis`` (0 only)."""

    axis: int
    start: int
    end: int
    step: int = 1


@dataclass(frozen=True)
class StructuredObjectReadSpec:
    """What ``materialize`` reads: the object, the members (None: all) and slices."""

    ref: Any
    member_names: Optional[tuple] = None
    member_slices: tuple = ()

    def select_members(self, names):
        return StructuredObjectReadSpec(self.ref, None if names is None else tuple(names),
                                        self.member_slices)

    def slice_member(self, name, axis, start, end, step=1):
        slices = dict(self.member_slices)
        slices[name] = StructuredMemberSlice(axis, start, end, step)
        return StructuredObjectReadSpec(self.ref, self.member_names, tuple(slices.items()))

    def member_slice(self, name):
        return dict(self.member_slices).get(name)


class _TensorObjectBuffer(B.ZeroCopySource):
    """Memory registered with the store, put as one member without a copy; also a
    destination for reading a member's raw bytes back."""

    __slots__ = ("batch_size",)

    def __init__(self, ptr, size, owner=None, batch_size=None):
        super().__init__(ptr, size, owner)
        self.batch_size = batch_size

    def __len__(self):
        if self.batch_size is None:
            raise TypeError("tensor object buffer requires batch_size for DataProto use")
        return self.batch_size


@dataclass(frozen=True)
class _RawDestination:
    ptr: int
    size: int
    owner: Any = None
    pre_registered: bool = False


def tensor_object_buffer(ptr, size, owner=None, batch_size=None):
    """``size`` bytes at ``ptr`` (inside memory registered with the store, e.g. a
    BufferPool lease; ``owner`` keeps it alive) to store as one member without a copy,
    or to read a member into. ``batch_size`` makes it usable as a DataProto field."""
    return _TensorObjectBuffer(ptr, size, owner, batch_size)


def raw_destination(ptr, size, owner=None, *, pre_registered=False):
    """Memory at ``ptr`` to read a member into (``pre_registered``: it is registered
    with the store already, e.g. a BufferPool lease)."""
    return _RawDestination(int(ptr), int(size), owner, bool(pre_registered))


# ---------------------------------------------------------------- DataProto handles


def is_dataproto_ref_handle(value):
    return isinstance(value, Mapping) and value.get("type") == DATAPROTO_REF_HANDLE_TYPE


def _json_safe(value):
    if value is None or isinstance(value, (str, int, float, bool)):
        return value
    np = sys.modules.get("numpy")
    if np is not None and isinstance(value, np.generic):
        return value.item()
    if np is not None and isinstance(value, np.ndarray):
        return _json_safe(value.tolist())
    if isinstance(value, Mapping):
        return {str(k): _json_safe(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_json_safe(v) for v in value]
    raise TypeError("DataProto ref handles support only JSON-safe values, got "
                    f"{type(value).__name__}")


def export_dataproto_ref(ref):
    """The JSON-safe handle of a MooncakeDataProtoRef (upstream's layout, version 1)."""
    if not isinstance(ref, MooncakeDataProtoRef):
        raise TypeError(f"expected MooncakeDataProtoRef, got {type(ref).__name__}")
    handle = {
        "type": DATAPROTO_REF_HANDLE_TYPE,
        "version": DATAPROTO_REF_HANDLE_VERSION,
        "kind": "bundle_stages",
        "batch_size": int(ref.batch_size),
        "namespace": ref.namespace,
        "partition": ref.partition,
        "global_indexes": _json_safe(ref.global_indexes),
        "stage_refs": {stage: {"manifest_key": r.manifest_key}
                       for stage, r in ref.stage_refs.items()},
        "field_index": {name: {"stage": loc.stage, "member": loc.member,
                               "section": loc.section}
                        for name, loc in ref.field_index.items()},
        "meta_info": _json_safe(ref.meta_info),
        "encoded_non_tensor": _json_safe(ref.encoded_non_tensor),
    }
    if ref._storage_group_id is not None:
        handle[STORAGE_GROUP_ID] = ref._storage_group_id
    return handle


def _mapping(value, what):
    if not isinstance(value, Mapping):
        raise ValueError(f"DataProto ref handle {what} must be a mapping")
    return value


def _nonempty_str(value):
    return isinstance(value, str) and bool(value)


def import_dataproto_ref(handle):
    """The MooncakeDataProtoRef of a handle; ValueError for anything malformed."""
    if not is_dataproto_ref_handle(handle):
        raise ValueError("not a Mooncake DataProto ref handle")
    version = handle.get("version")
    if version not in (DATAPROTO_REF_HANDLE_VERSION, 2):
        raise ValueError(f"unsupported DataProto ref handle version: {version!r}")
    if handle.get("kind") != "bundle_stages":
        raise ValueError(f"unsupported DataProto ref handle kind: {handle.get('kind')!r}")
    stage_refs = {}
    for stage, raw in _mapping(handle.get("stage_refs"), "stage_refs").items():
        key = _mapping(raw, f"stage_refs[{stage!r}]").get("manifest_key")
        if not _nonempty_str(stage) or not _nonempty_str(key):
            raise ValueError("DataProto ref handle stage refs must contain non-empty string "
                             "names and manifest_key values")
        stage_refs[stage] = RemoteBundleRef(manifest_key=key, manifest={})
    field_index = {}
    for name, raw in _mapping(handle.get("field_index"), "field_index").items():
        loc = _mapping(raw, f"field_index[{name!r}]")
        if loc.get("section") not in ("batch", "non_tensor_batch"):
            raise ValueError(f"invalid DataProto field section: {loc.get('section')!r}")
        if not all(_nonempty_str(v) for v in (name, loc.get("stage"), loc.get("member"))):
            raise ValueError("DataProto ref handle field locations must be non-empty strings")
        if loc["stage"] not in stage_refs:
            raise ValueError(f"DataProto ref handle field {name!r} references unknown stage "
                             f"{loc['stage']!r}")
        field_index[name] = StructuredFieldLocation(loc["stage"], loc["member"], loc["section"])
    group = handle.get(STORAGE_GROUP_ID)
    if (version == 2 and group is None) or (group is not None and not _nonempty_str(group)):
        raise ValueError("DataProto ref handle has invalid storage_group_id")
    indexes = handle.get("global_indexes")
    if indexes is not None and (not isinstance(indexes, list) or any(
            isinstance(i, bool) or not isinstance(i, int) for i in indexes)):
        raise ValueError("DataProto ref handle global_indexes must be a list of integers "
                         "or null")
    batch_size = handle.get("batch_size")
    if isinstance(batch_size, bool) or not isinstance(batch_size, int) or batch_size < 0:
        raise ValueError("DataProto ref handle batch_size must be a non-negative integer")
    return MooncakeDataProtoRef(
        batch_size=batch_size, stage_refs=stage_refs, field_index=field_index,
        meta_info=dict(_mapping(handle.get("meta_info", {}), "meta_info")),
        namespace=str(handle.get("namespace", "default")),
        partition=str(handle.get("partition", "default")),
        global_indexes=None if indexes is None else list(indexes),
        encoded_non_tensor=dict(_mapping(handle.get("encoded_non_tensor", {}),
                                         "encoded_non_tensor")),
        _storage_group_id=group)


export_ref = export_dataproto_ref
import_ref = import_dataproto_ref
DataProtoRefLike = Union[MooncakeDataProtoRef, Mapping[str, Any]]


def _as_ref(ref):
    if isinstance(ref, MooncakeDataProtoRef):
        return ref
    if is_dataproto_ref_handle(ref):
        return import_dataproto_ref(ref)
    raise TypeError(f"expected MooncakeDataProtoRef or DataProto handle, got "
                    f"{type(ref).__name__}")


# ---------------------------------------------------------------- configs and groups


def _checked_policy(policy, max_inflight_put=None):
    policy = policy or BundleTransferPolicy()
    if max_inflight_put is not None:
        policy = BundleTransferPolicy(max_inflight_put, policy.put_mode, policy.copy_mode)
    if isinstance(policy.max_inflight_put, bool) or not isinstance(policy.max_inflight_put, int) \
            or policy.max_inflight_put < 1:
        raise ValueError("max_inflight_put must be positive")
    if policy.put_mode not in B.PUT_MODES:
        raise ValueError(f"unsupported put_mode: {policy.put_mode}")
    if policy.copy_mode not in B.COPY_MODES:
        raise ValueError(f"unsupported copy_mode: {policy.copy_mode}")
    return policy


def _group_ids_of(config):
    """The one logical group id a config names: None (not set), "" (ungrouped) or an
    id; ValueError for several or non-string ids."""
    raw = getattr(config, "group_ids", None)
    if raw is None:
        return None
    ids = [raw] if isinstance(raw, str) else list(raw)
    if len(ids) > 1:
        raise ValueError("structured object store config.group_ids must contain exactly one "
                         "logical group id; it is expanded across internal Mooncake keys")
    if not ids:
        return ""
    if not isinstance(ids[0], str):
        raise ValueError("structured object store config.group_ids must contain strings")
    return ids[0]


def _new_storage_group(config):
    group = _group_ids_of(config)
    if group is None:
        return f"structured-{uuid.uuid4().hex}"
    return group or None


def _copy_config(config):
    try:
        return copy.copy(config)
    except TypeError:
        raise TypeError("structured object store config must be copyable") from None


def _grouped_config(config, group):
    """``config`` writing into storage group ``group`` (None: ``config`` as given)."""
    if group is None:
        return config
    named = None if config is None else _group_ids_of(config)
    if named and named != group:
        raise ValueError("config.group_ids conflicts with the DataProto storage group")
    if config is None:
        try:
            from .store import ReplicateConfig
            grouped = ReplicateConfig()
        except (ImportError, OSError):  # no library: a plain record for a duck store
            import types
            grouped = types.SimpleNamespace()
    else:
        grouped = _copy_config(config)
    grouped.group_ids = [group]
    return grouped


# ---------------------------------------------------------------- pool-backed arrays


class _PoolOwner:
    """Gives a BufferPool lease back when the arrays over it are done (or on
    ``release_result``)."""

    def __init__(self, lease):
        self.lease = lease
        self.released = False

    def release(self):
        if not self.released:
            self.released = True
            self.lease.release()

    def __del__(self):
        try:
            self.release()
        except Exception:
            pass


_pool_array_type = None


def _pool_array(lease, dtype, shape):
    """An ndarray over a lease's memory that gives the lease back when collected."""
    global _pool_array_type
    np = C.numpy()
    if _pool_array_type is None:
        class PoolBackedArray(np.ndarray):
            def __array_finalize__(self, obj):
                self._mooncake_pool_owner = getattr(obj, "_mooncake_pool_owner", None)

        _pool_array_type = PoolBackedArray
    dtype = np.dtype(dtype)
    count = 1
    for d in shape:
        count *= d
    raw = (ctypes.c_uint8 * max(count * dtype.itemsize, 1)).from_address(lease.ptr)
    array = np.frombuffer(raw, dtype=np.uint8, count=count * dtype.itemsize)
    array = array.view(dtype).reshape(shape).view(_pool_array_type)
    array._mooncake_pool_owner = _PoolOwner(lease)
    return array


# ---------------------------------------------------------------- reading members


def _row_plan(shape, itemsize, rows):
    """(output shape, [(src, dst, n)] ranges) for ``rows``: None (all), a
    StructuredMemberSlice, or a sequence of row indices."""
    total = itemsize
    for d in shape:
        total *= d
    if rows is None:
        return tuple(shape), [(0, 0, total)]
    if not shape:
        raise ValueError("structured member slicing requires at least one dimension")
    width = total // shape[0] if shape[0] else itemsize * _prod(shape[1:])
    picked = _picked_rows(rows, shape[0])
    if isinstance(picked, range) and picked.step == 1:
        return (len(picked), *shape[1:]), [(picked.start * width, 0, len(picked) * width)]
    return (len(picked), *shape[1:]), [(r * width, i * width, width)
                                       for i, r in enumerate(picked)]


def _picked_rows(rows, count):
    """The indices ``rows`` (a StructuredMemberSlice, or row indices) picks of ``count``
    rows."""
    if not isinstance(rows, StructuredMemberSlice):
        return rows
    if rows.axis != 0:
        raise ValueError("structured member slicing currently supports axis=0 only")
    if rows.step <= 0:
        raise ValueError("structured member slicing step must be positive")
    return range(*slice(rows.start, rows.end, rows.step).indices(count))


def _prod(values):
    out = 1
    for v in values:
        out *= v
    return out


def _checked_destination_size(destination, nbytes):
    if destination.size < nbytes:
        kind = "tensor" if isinstance(destination, _TensorObjectBuffer) else "raw"
        raise ValueError(f"{kind} destination has {destination.size} bytes, expected at "
                         f"least {nbytes}")


def _ndarray_target(name, destination, dtype, shape):
    np = C.numpy()
    if destination is None:
        return np.empty(shape, dtype=dtype)
    if not isinstance(destination, np.ndarray):
        raise TypeError(f"structured ndarray field {name} destination must be a "
                        "numpy.ndarray or raw_destination")
    if destination.dtype != dtype:
        raise ValueError(f"structured ndarray field {name} destination dtype mismatch: "
                         f"expected {dtype.str}, got {destination.dtype.str}")
    if tuple(destination.shape) != tuple(shape):
        raise ValueError(f"structured ndarray field {name} destination shape mismatch: "
                         f"expected {tuple(shape)}, got {tuple(destination.shape)}")
    if not destination.flags["C_CONTIGUOUS"] or not destination.flags["WRITEABLE"]:
        raise ValueError(f"structured ndarray field {name} destination must be C-contiguous "
                         "and writeable")
    return destination


def _tensor_target(name, destination, dtype, shape):
    torch = C.torch_module()
    if destination is None:
        return torch.empty(shape, dtype=dtype)
    if tuple(destination.shape) != tuple(shape) or destination.dtype != dtype:
        raise ValueError(f"structured tensor field {name} destination must be {dtype} of "
                         f"shape {tuple(shape)}, got {destination.dtype} "
                         f"{tuple(destination.shape)}")
    if destination.device.type != "cpu" or not destination.is_contiguous():
        raise ValueError(f"structured tensor field {name} destination must be a contiguous "
                         "CPU tensor")
    return destination


class _Reader:
    """Reads members of one structured object (its manifest and metadata)."""

    def __init__(self, transfer, manifest, metadata):
        self._io = transfer._bundles.io
        self._pool = transfer._pool
        self.manifest = manifest
        self.metadata = metadata
        self.specs = metadata.get(STRUCTURED_FIELD_SPECS_KEY, {})

    def payload(self, member):
        try:
            return self.manifest["buffers"][member]
        except KeyError:
            raise KeyError(f"unknown bundle buffers: {[member]}") from None

    def field_spec(self, member):
        return self.specs.get(member, {"encoding": "bytes"})

    def read(self, name, rows=None, destination=None):
        spec = self.field_spec(name)
        payload = self.payload(name)
        encoding = spec.get("encoding", "bytes")
        if encoding == "ndarray":
            return self._read_ndarray(name, payload, spec, rows, destination)
        if encoding == "torch_tensor":
            return self._read_tensor(name, payload, spec, rows, destination)
        if encoding != "bytes":
            raise ValueError(f"unsupported structured field encoding: {encoding}")
        if rows is not None:
            raise ValueError(f"structured bytes member {name} does not support slicing")
        if destination is None:
            return self._io.read_bytes(payload)
        return self._read_raw(name, payload, [(0, 0, int(payload["bytes"]))],
                              int(payload["bytes"]), destination)

    def _read_raw(self, name, payload, ranges, nbytes, destination):
        if not isinstance(destination, (_RawDestination, _TensorObjectBuffer)):
            raise ValueError(f"structured member {name} takes a raw_destination or "
                             "tensor_object_buffer destination here")
        _checked_destination_size(destination, nbytes)
        self._io.read_ranges(payload, destination.ptr, destination.size, ranges,
                             dest_registered=isinstance(destination, _TensorObjectBuffer) or
                             destination.pre_registered)
        return destination

    def _read_ndarray(self, name, payload, spec, rows, destination):
        np = C.numpy()
        dtype = np.dtype(spec["dtype"])
        shape, ranges = _row_plan([int(d) for d in spec["shape"]], dtype.itemsize, rows)
        nbytes = _prod(shape) * dtype.itemsize
        if isinstance(destination, (_RawDestination, _TensorObjectBuffer)):
            self._read_raw(name, payload, ranges, nbytes, destination)
            raw = (ctypes.c_uint8 * max(nbytes, 1)).from_address(destination.ptr)
            return np.frombuffer(raw, np.uint8, nbytes).view(dtype).reshape(shape)
        registered = False
        if destination is None and self._pool is not None and nbytes:
            target, registered = _pool_array(self._pool.acquire(nbytes), dtype, shape), True
        else:
            target = _ndarray_target(name, destination, dtype, shape)
        if nbytes:
            self._io.read_ranges(payload, target.ctypes.data, nbytes, ranges,
                                 dest_registered=registered)
        return target

    def _read_tensor(self, name, payload, spec, rows, destination):
        if spec.get("nested"):
            return self._read_nested(name, payload, spec, rows, destination)
        dtype_name = spec["dtype"]
        itemsize = int(spec["element_size"])
        shape, ranges = _row_plan([int(d) for d in spec["shape"]], itemsize, rows)
        nbytes = _prod(shape) * itemsize
        if isinstance(destination, (_RawDestination, _TensorObjectBuffer)):
            return self._read_raw(name, payload, ranges, nbytes, destination)
        target = _tensor_target(name, destination, C.torch_dtype(dtype_name), shape)
        if nbytes:
            self._io.read_ranges(payload, target.data_ptr(), nbytes, ranges)
        return target

    def _read_nested(self, name, payload, spec, rows, destination):
        if destination is not None:
            raise ValueError(f"structured nested tensor member {name} does not support "
                             "destinations")
        try:
            count = int(spec["parts"][1]["shape"][0]) - 1  # offsets: one more than rows
        except (KeyError, IndexError, TypeError, ValueError):
            raise ValueError(f"nested tensor member {name} has invalid part metadata") \
                from None
        indices = None if rows is None else _picked_rows(rows, count)
        return C.decode_jagged(spec, self._io.read_bytes(payload), indices)

    def read_encoded(self, encoded, rows=None):
        """The rows (all, or those ``rows`` selects) of an encoded non-tensor field."""
        payload = {p: self._io.read_bytes(self.payload(m))
                   for p, m in encoded["payload_members"].items()}
        values = I.decode_field(encoded, payload)
        if rows is None:
            return values
        return [values[i] for i in _picked_rows(rows, len(values))]


# ---------------------------------------------------------------- DataProto shapes


def _to_dict(value):
    if value is None:
        return {}
    if isinstance(value, Mapping):
        return dict(value)
    items = getattr(value, "items", None)
    if callable(items):
        return dict(items())
    raise TypeError(f"expected mapping-like value, got {type(value).__name__}")


def _is_envelope(data):
    return bool(data) and set(data) <= set(_SECTIONS) and all(
        v is None or isinstance(v, Mapping) or callable(getattr(v, "items", None))
        for v in data.values())


def _split_sections(data):
    """(batch, non_tensor_batch, meta_info) of a DataProto-like object or envelope."""
    if isinstance(data, Mapping):
        if _is_envelope(data):
            return tuple(_to_dict(data.get(s)) for s in _SECTIONS)
        return dict(data), {}, {}
    return tuple(_to_dict(getattr(data, s, None)) for s in _SECTIONS)


def _rows_of(value):
    if isinstance(value, _TensorObjectBuffer):
        return len(value)
    try:
        return len(value)
    except TypeError:
        raise ValueError(f"DataProto field of type {type(value).__name__} has no batch size") \
            from None


def _batch_size(batch, non_tensor):
    sizes = {_rows_of(v) for section in (batch, non_tensor) for v in section.values()}
    if len(sizes) > 1:
        raise ValueError(f"DataProto fields have inconsistent batch sizes: {sorted(sizes)}")
    return sizes.pop() if sizes else 0


def _schema_section(name, schema):
    section = schema.metadata.get("section")
    if section is not None and section not in _SECTIONS:
        raise ValueError(f"FieldSchema for {name!r} metadata['section'] must be one of "
                         f"{sorted(_SECTIONS)}")
    return section


def _check_schema_sections(sections, schemas):
    present = {}
    for section, fields in zip(_SECTIONS, sections):
        for name in fields:
            present.setdefault(name, set()).add(section)
    for name, schema in (schemas or {}).items():
        declared = _schema_section(name, schema)
        if declared and name in present and declared not in present[name]:
            raise ValueError(f"FieldSchema for {name!r} declares section {declared!r}, but "
                             f"data contains it in {', '.join(sorted(present[name]))}")


def _is_dense(value):
    if C.is_tensor(value):
        return value.dim() > 0
    return C.is_ndarray(value) and not value.dtype.hasobject and value.ndim > 0


def _is_row_list(value):
    return isinstance(value, Sequence) and not isinstance(value, (str, bytes, bytearray))


def _flat_rows(data, schemas):
    """The row count of a flat dict: from schema-placed fields, else dense arrays, else
    row lists; ValueError when they disagree."""
    placed = {len(data[n]) for n, s in schemas.items()
              if n in data and _schema_section(n, s) in ("batch", "non_tensor_batch")}
    if placed:
        if len(placed) > 1:
            raise ValueError(f"flat dict fields have inconsistent batch sizes: {sorted(placed)}")
        return placed.pop(), True
    meta = {n for n, s in schemas.items() if _schema_section(n, s) == "meta_info"}
    dense = {len(v) for k, v in data.items() if k not in meta and _is_dense(v)}
    if len(dense) > 1:
        raise ValueError(f"flat dict dense fields have ambiguous batch sizes: {sorted(dense)}")
    if dense:
        return dense.pop(), False
    lists = {len(v) for k, v in data.items() if k not in meta and
             (_is_row_list(v) or (C.is_ndarray(v) and v.ndim > 0))}
    if len(lists) > 1:
        raise ValueError(f"flat dict fields have ambiguous batch sizes: {sorted(lists)}; pass "
                         "FieldSchema metadata['section'] for list-valued metadata fields")
    return (lists.pop() if lists else 0), False


def _object_rows(name, value, rows):
    if C.is_ndarray(value):
        if len(value) != rows:
            raise ValueError(f"flat dict non_tensor_batch field {name!r} has batch size "
                             f"{len(value)}, expected {rows}")
        return value
    if not _is_row_list(value):
        raise TypeError(f"flat dict non_tensor_batch field {name!r} must be an ndarray or "
                        "non-string sequence")
    if len(value) != rows:
        raise ValueError(f"flat dict non_tensor_batch field {name!r} has batch size "
                         f"{len(value)}, expected {rows}")
    return list(value)


def _flat_to_envelope(data, schemas):
    """A flat dict as {batch, non_tensor_batch, meta_info}: dense row-aligned arrays are
    batch fields, row lists non-tensor fields, everything else meta_info (unless a
    FieldSchema places the field)."""
    if not isinstance(data, Mapping):
        raise TypeError("flat dict payload must be a mapping")
    schemas = schemas or {}
    rows, from_schema = _flat_rows(data, schemas)
    batch, non_tensor, meta = {}, {}, {}
    for name, value in data.items():
        section = _schema_section(name, schemas[name]) if name in schemas else None
        if section is None:
            if rows and _is_dense(value) and len(value) == rows:
                section = "batch"
            elif not from_schema and rows and _is_row_list(value) and len(value) == rows:
                section = "non_tensor_batch"
            else:
                section = "meta_info"
        if section == "batch":
            batch[name] = value
        elif section == "non_tensor_batch":
            non_tensor[name] = _object_rows(name, value, rows)
        else:
            meta[name] = value
    return {"batch": batch, "non_tensor_batch": non_tensor, "meta_info": meta}


def _envelope_to_flat(result):
    sections = [_to_dict(result.get(s)) for s in ("meta_info", "batch", "non_tensor_batch")]
    seen, overlap = set(), set()
    for section in sections:
        overlap |= seen & set(section)
        seen |= set(section)
    if overlap:
        raise ValueError(f"Duplicate keys found across DataProto sections: {sorted(overlap)}")
    flat = {}
    for section in sections:
        for name, value in section.items():
            if C.is_ndarray(value) and value.dtype.hasobject:
                value = value.tolist()
            flat[name] = value
    return flat


def _object_array(values):
    np = C.numpy()
    out = np.empty(len(values), dtype=object)
    for i, v in enumerate(values):
        out[i] = v
    return out


def _build_result(batch, non_tensor, meta_info, data_cls):
    if data_cls is None or data_cls is dict:
        return {"batch": batch, "non_tensor_batch": non_tensor, "meta_info": meta_info}
    try:
        from_dict = getattr(data_cls, "from_dict", None)
        if callable(from_dict):
            return from_dict(batch, non_tensor, meta_info=meta_info)
        return data_cls(batch=batch, non_tensor_batch=non_tensor, meta_info=meta_info)
    except TypeError as e:
        raise TypeError(f"{getattr(data_cls, '__name__', data_cls)!r} cannot be constructed "
                        "from batch, non_tensor_batch, and meta_info") from e


def _row_selection(rows, total):
    """None, a StructuredMemberSlice, or a tuple of row indices; plus the row count."""
    if rows is None:
        return None, total
    if isinstance(rows, slice):
        start, end, step = rows.indices(total)
        if step <= 0:
            raise ValueError("DataProto row slicing step must be positive")
        rows = StructuredMemberSlice(0, start, end, step)
    if isinstance(rows, StructuredMemberSlice):
        if rows.axis != 0:
            raise ValueError("DataProto row slicing currently supports axis=0 only")
        if rows.step <= 0:
            raise ValueError("DataProto row slicing step must be positive")
        return rows, len(range(*slice(rows.start, rows.end, rows.step).indices(total)))
    if not _is_row_list(rows) and not C.is_ndarray(rows):
        raise TypeError("DataProto rows must be a slice, StructuredMemberSlice, or row index "
                        "sequence")
    picked = []
    np = sys.modules.get("numpy")
    for index in rows:
        if isinstance(index, bool) or not (isinstance(index, int) or (
                np is not None and isinstance(index, np.integer))):
            raise TypeError("DataProto row indices must be integers")
        i = int(index) + (total if int(index) < 0 else 0)
        if not 0 <= i < total:
            raise IndexError(f"DataProto row index {index} out of range for {total} rows")
        picked.append(i)
    return tuple(picked), len(picked)


def _encode_non_tensor(name, member, rows, schema):
    """The Encoded rows of non-tensor field ``name``; errors of a schema-chosen codec
    name the field and codec."""
    try:
        return I.encode_field(member, rows, schema)
    except (TypeError, ValueError, OverflowError) as e:
        if schema is None or schema.codec == "auto":
            raise
        raise type(e)(f"failed to encode non_tensor_batch field {name!r} with FieldSchema "
                      f"codec {schema.codec!r}: {e}") from e


def _selected_fields(ref, fields, batch_fields, non_tensor_fields):
    if fields is not None and (batch_fields is not None or non_tensor_fields is not None):
        raise ValueError("fields cannot be combined with batch_fields or non_tensor_fields")
    if fields is not None:
        names = list(fields)
    elif batch_fields is None and non_tensor_fields is None:
        names = list(ref.field_index)
    else:
        names = list(batch_fields or []) + list(non_tensor_fields or [])
    missing = [n for n in names if n not in ref.field_index]
    if missing:
        raise KeyError(f"unknown DataProto fields: {missing}")
    if fields is None and (batch_fields is not None or non_tensor_fields is not None):
        wrong = [n for n in batch_fields or [] if ref.field_index[n].section != "batch"] + \
            [n for n in non_tensor_fields or [] if ref.field_index[n].section == "batch"]
        if wrong:
            raise ValueError(f"DataProto fields are in the other section: {wrong}")
    return names


# ---------------------------------------------------------------- the transfer


class MooncakeBundleTransfer:
    """Bundles, structured objects and DataProto batches in ``store`` (see the module
    docstring). ``buffer_pool`` (a BufferPool of that store) stages copies and holds
    read arrays, saving a registration per call."""

    def __init__(self, store, key_prefix="bundle", default_chunk_bytes=DEFAULT_BUNDLE_CHUNK_BYTES,
                 buffer_pool=None):
        self.store = store
        self._pool = buffer_pool
        self._bundles = B.BundleStore(B.StoreIO(store, buffer_pool), key_prefix,
                                      default_chunk_bytes)
        self.key_prefix = self._bundles.prefix
        self.default_chunk_bytes = self._bundles.default_chunk_bytes

    # ------------------------------------------------------------ bundles

    def put_bundle(self, meta, buffers, partition="default", chunk_bytes=None, policy=None,
                   max_inflight_put=None, config=None):
        """Stores ``meta`` (bytes) and ``buffers`` {name: bytes-like}."""
        key, manifest = self._bundles.put_bundle(
            B.byte_view(meta, "meta"), dict(buffers), partition, chunk_bytes,
            _checked_policy(policy, max_inflight_put), config)
        return RemoteBundleRef(key, manifest)

    def _manifest(self, ref):
        if isinstance(ref, RemoteBundleRef):
            return self._bundles.load_manifest(ref.manifest_key, ref.manifest)
        if isinstance(ref, Mapping):
            return self._bundles.load_manifest(ref.get("manifest_key"), ref.get("manifest"))
        raise TypeError(f"expected RemoteBundleRef or mapping, got {type(ref).__name__}")

    def remove_bundle(self, ref):
        """Removes every object of a bundle; nothing to do when it is already gone."""
        key = ref.manifest_key if isinstance(ref, RemoteBundleRef) else ref.get("manifest_key")
        embedded = ref.manifest if isinstance(ref, RemoteBundleRef) else ref.get("manifest")
        is_exist = getattr(self.store, "is_exist", None)
        if not embedded and isinstance(key, str) and callable(is_exist):
            status = is_exist(key)
            if status == 0:
                return
            if status != 1:
                raise RuntimeError(f"is_exist failed for {key}: {status}")
        manifest = self._manifest(ref)
        self._bundles.io.remove_keys(self._bundles.all_keys(manifest), strict=True)
        self._bundles.io.remove_keys([self._bundles.manifest_key_of(manifest)], strict=True)

    # ------------------------------------------------------------ structured objects

    def put_structured_object(self, payload, partition="default", chunk_bytes=None,
                              policy=None, max_inflight_put=None, config=None):
        if not isinstance(payload, StructuredObjectPayload):
            raise TypeError(f"expected StructuredObjectPayload, got {type(payload).__name__}")
        metadata = self._structured_metadata(payload.metadata)
        specs, buffers = {}, {}
        for name, value in payload.buffers.items():
            B.check_key_segment(name, "buffer name")
            specs[name], buffers[name] = C.encode_member(value)
        if specs:
            metadata[STRUCTURED_FIELD_SPECS_KEY] = specs
        key, manifest = self._bundles.put_bundle(
            B.encode_json(metadata, "structured metadata"), buffers, partition, chunk_bytes,
            _checked_policy(policy, max_inflight_put), config)
        return RemoteBundleRef(key, manifest)

    @staticmethod
    def _structured_metadata(metadata):
        if not isinstance(metadata, Mapping):
            raise TypeError("structured metadata must be a mapping")
        out = dict(metadata)
        if STRUCTURED_FIELD_SPECS_KEY in out:
            raise ValueError(f"structured metadata key {STRUCTURED_FIELD_SPECS_KEY!r} is "
                             "reserved")
        if not isinstance(out.setdefault("layout", "structured"), str):
            raise ValueError("structured metadata layout must be a string")
        return out

    def put_object(self, obj, partition="default", chunk_bytes=None, policy=None,
                   max_inflight_put=None, config=None):
        """A mapping's items become members; any other value the member "value"."""
        if isinstance(obj, Mapping):
            payload = StructuredObjectPayload({}, obj)
        else:
            payload = StructuredObjectPayload({_WRAPPED_OBJECT: True}, {"value": obj})
        return self.put_structured_object(payload, partition, chunk_bytes, policy,
                                          max_inflight_put, config)

    def get_object(self, ref):
        result = self.materialize(self.read_spec(ref))
        if result.metadata.get(_WRAPPED_OBJECT):
            return result.objects["value"]
        return result.objects

    def read_spec(self, ref):
        return StructuredObjectReadSpec(ref=ref)

    def _reader(self, ref):
        manifest = self._manifest(ref)
        metadata = B.decode_json(self._bundles.io.read_bytes(manifest["meta"]),
                                 "structured metadata")
        return _Reader(self, manifest, metadata)

    def materialize(self, spec):
        return self.materialize_into(spec, None)

    def materialize_into(self, spec, destinations):
        """Reads the spec's members, into ``destinations`` {member: destination} where
        given (the result then holds the destination)."""
        if spec.member_names is not None and not spec.member_names:
            raise ValueError("structured read spec selected no members")
        reader = self._reader(spec.ref)
        names = list(reader.manifest["buffers"]) if spec.member_names is None \
            else list(spec.member_names)
        missing = [n for n in names if n not in reader.manifest["buffers"]]
        if missing:
            raise KeyError(f"unknown bundle buffers: {missing}")
        slices = dict(spec.member_slices)
        destinations = destinations or {}
        objects = {n: reader.read(n, slices.get(n), destinations.get(n)) for n in names}
        return StructuredObjectResult(metadata=dict(reader.metadata), objects=objects)

    @staticmethod
    def release_result(result):
        """Gives back at once the BufferPool leases behind arrays of a result (a dict,
        an envelope, a DataProto-like object, lists); the arrays must not be used
        after. Without a pool there is nothing to release."""
        seen, released = set(), set()

        def visit(value):
            owner = getattr(value, "_mooncake_pool_owner", None)
            if owner is not None:
                if id(owner) not in released:  # row views share their lease's owner
                    released.add(id(owner))
                    owner.release()
                return
            if id(value) in seen:
                return
            if isinstance(value, Mapping):
                children = list(value.values())
            elif hasattr(value, "batch") and hasattr(value, "non_tensor_batch"):
                children = [value.batch, value.non_tensor_batch, getattr(value, "meta_info", None)]
            elif isinstance(value, (list, tuple)):
                children = list(value)
            elif C.is_ndarray(value) and value.dtype.hasobject:
                children = list(value.flat)
            else:
                return
            seen.add(id(value))
            for child in children:
                visit(child)

        visit(result)

    # ------------------------------------------------------------ DataProto: writing

    def put(self, data, *, type="dataproto", namespace="default", partition="default",
            stage="default", chunk_bytes=None, policy=None, config=None, field_schemas=None):
        """Stores a DataProto-like object (``type="dataproto"``) or a flat dict
        (``type="dict"``) as one stage; its MooncakeDataProtoRef."""
        if type == "dataproto":
            sections = _split_sections(data)
        elif type == "dict":
            envelope = _flat_to_envelope(data, field_schemas)
            sections = tuple(envelope[s] for s in _SECTIONS)
        else:
            raise ValueError(f"unsupported Mooncake payload type: {type!r}")
        return self._put_stage(None, sections, namespace, partition, stage, chunk_bytes,
                               policy, False, field_schemas, config)

    def put_dataproto(self, data, *, namespace="default", partition="default",
                      stage="default", chunk_bytes=None, policy=None, field_schemas=None,
                      config=None):
        return self.put(data, type="dataproto", namespace=namespace, partition=partition,
                        stage=stage, chunk_bytes=chunk_bytes, policy=policy,
                        field_schemas=field_schemas, config=config)

    def append_dataproto_fields(self, ref, data, *, stage, overwrite=False, chunk_bytes=None,
                                policy=None, field_schemas=None, config=None):
        """A new ref with ``data``'s fields added in ``stage`` (a new stage, or merged
        into the existing one; ``overwrite`` replaces the stage, which must then be given
        all its fields again). The old ref stays readable."""
        ref = _as_ref(ref)
        return self._put_stage(ref, _split_sections(data), ref.namespace, ref.partition,
                               stage, chunk_bytes, policy, overwrite, field_schemas, config)

    def _stage_members(self, sections, schemas, stage):
        """(buffers, field locations, encoded non-tensor entries) of one stage."""
        batch, non_tensor, _ = sections
        buffers, locations, encoded = {}, {}, {}
        for name, value in batch.items():
            B.check_key_segment(name, "field name")
            buffers[f"batch.{name}"] = value
            locations[name] = StructuredFieldLocation(stage, f"batch.{name}", "batch")
        for name, value in non_tensor.items():
            B.check_key_segment(name, "field name")
            member = f"non_tensor_batch.{name}"
            locations[name] = StructuredFieldLocation(stage, member, "non_tensor_batch")
            schema = (schemas or {}).get(name)
            if schema is not None and _schema_section(name, schema) not in (None,
                                                                            "non_tensor_batch"):
                schema = None
            dense = C.is_ndarray(value) and not value.dtype.hasobject
            if dense and (schema is None or schema.codec == "auto"):
                buffers[member] = value
                continue
            rows = list(value) if C.is_ndarray(value) or _is_row_list(value) else None
            if rows is None:
                raise TypeError(f"non_tensor_batch field {name!r} must be an ndarray or a "
                                "non-string sequence")
            enc = _encode_non_tensor(name, member, rows, schema)
            members = {}
            for part, payload in enc.payload.items():
                members[part] = f"{member}.{part}"
                buffers[members[part]] = payload
            encoded[name] = {"codec": enc.codec, "rows": enc.rows, "metadata": enc.metadata,
                             "payload_members": members}
        return buffers, locations, encoded

    def _put_stage(self, ref, sections, namespace, partition, stage, chunk_bytes, policy,
                   overwrite, schemas, config):
        B.check_key_segment(stage, "stage")
        batch, non_tensor, meta_info = sections
        _check_schema_sections(sections, schemas)
        overlap = sorted(set(batch) & set(non_tensor))
        if overlap:
            raise ValueError(f"DataProto batch and non_tensor_batch fields overlap: {overlap}")
        rows = _batch_size(batch, non_tensor)
        if ref is not None and (batch or non_tensor) and rows != ref.batch_size:
            raise ValueError(f"DataProto append batch size {rows} does not match ref batch "
                             f"size {ref.batch_size}")
        buffers, locations, encoded = self._stage_members(sections, schemas, stage)
        policy = _checked_policy(policy)
        if ref is None:
            group = _new_storage_group(config)
            base = MooncakeDataProtoRef(rows, {}, {}, {}, namespace, partition,
                                        _storage_group_id=group)
        else:
            base, group = ref, ref._storage_group_id
            if group is not None:
                _grouped_config(config, group)  # refuses a conflicting group early
        if not buffers:  # only meta_info: nothing to store
            return MooncakeDataProtoRef(
                base.batch_size, dict(base.stage_refs), dict(base.field_index),
                {**base.meta_info, **meta_info}, namespace, partition, base.global_indexes,
                dict(base.encoded_non_tensor), group)
        existing = sorted(set(base.field_index) & set(locations))
        if existing and not overwrite:
            raise ValueError(f"DataProto fields already exist: {existing}")
        if overwrite:
            dropped = sorted(n for n, loc in base.field_index.items()
                             if loc.stage == stage and n not in locations)
            if dropped:
                raise ValueError(f"DataProto overwrite for stage {stage!r} must include "
                                 f"existing fields: {dropped}")
        write_config = _grouped_config(config, group)
        payload = StructuredObjectPayload(
            {"layout": "dataproto_stage",
             "dataproto": {"version": 1, "namespace": namespace, "partition": partition,
                           "stage": stage, "batch_size": rows}}, buffers)
        old_stage = base.stage_refs.get(stage)
        if old_stage is not None and not overwrite:
            stage_ref = self._merge_into_stage(old_stage, payload, partition, chunk_bytes,
                                               policy, write_config)
        else:
            stage_ref = self.put_structured_object(payload, partition, chunk_bytes, policy,
                                                   None, write_config)
            if old_stage is not None and old_stage.manifest_key != stage_ref.manifest_key:
                self.remove_bundle(old_stage)
        field_index = {**base.field_index, **locations}
        encoded_fields = {n: e for n, e in base.encoded_non_tensor.items() if n not in locations}
        encoded_fields.update(encoded)
        return MooncakeDataProtoRef(
            rows if ref is None else ref.batch_size, {**base.stage_refs, stage: stage_ref},
            field_index, {**base.meta_info, **meta_info}, namespace, partition,
            base.global_indexes, encoded_fields, group)

    def _merge_into_stage(self, old_ref, payload, partition, chunk_bytes, policy, config):
        """Adds members to a stage: writes them as a new object, then a manifest naming
        the old and the new members (the old manifest stays, owned by the new one)."""
        new_ref = self.put_structured_object(payload, partition, chunk_bytes, policy, None,
                                             config)
        bundles = self._bundles
        try:
            old = self._reader(old_ref)
            new = self._reader(new_ref)
            clash = sorted(set(old.manifest["buffers"]) & set(new.manifest["buffers"]))
            if clash:
                raise ValueError(f"structured members already exist: {clash}")
            metadata = {k: v for k, v in old.metadata.items() if k != STRUCTURED_FIELD_SPECS_KEY}
            metadata[STRUCTURED_FIELD_SPECS_KEY] = {**old.specs, **new.specs}
            obsolete = [bundles.manifest_key_of(new.manifest),
                        *bundles.payload_keys(new.manifest["meta"])]
            cleanup = [*old.manifest.get("cleanup_keys", []),
                       bundles.manifest_key_of(old.manifest),
                       *bundles.payload_keys(old.manifest["meta"]), *obsolete]
            key, manifest = bundles.put_bundle(
                B.encode_json(metadata, "structured metadata"), {}, partition, chunk_bytes,
                policy, config, buffer_specs={**old.manifest["buffers"],
                                              **new.manifest["buffers"]},
                cleanup_keys=cleanup)
        except Exception:
            self.remove_bundle(new_ref)
            raise
        bundles.io.remove_keys(obsolete, strict=False)
        return RemoteBundleRef(key, manifest)

    # ------------------------------------------------------------ DataProto: reading

    def get(self, ref, *, type="dataproto", fields=None, batch_fields=None,
            non_tensor_fields=None, meta_info_keys=None, data_cls=None, destinations=None,
            rows=None):
        """The selected fields (all by default) and rows (a slice, a
        StructuredMemberSlice or row indices) as an envelope dict, ``data_cls`` (its
        ``from_dict(batch, non_tensor_batch, meta_info=)`` or constructor), or a flat dict
        (``type="dict"``). ``destinations`` {field: destination} receive batch fields."""
        if type not in ("dataproto", "dict"):
            raise ValueError(f"unsupported Mooncake payload type: {type!r}")
        flat = type == "dict"
        result = self._get(ref, fields, batch_fields, non_tensor_fields, meta_info_keys,
                           dict if flat else data_cls, destinations, rows, flat)
        return _envelope_to_flat(result) if flat else result

    def get_dataproto(self, ref, *, fields=None, batch_fields=None, non_tensor_fields=None,
                      meta_info_keys=None, data_cls=None, destinations=None, rows=None):
        return self._get(ref, fields, batch_fields, non_tensor_fields, meta_info_keys,
                         data_cls, destinations, rows, False)

    def _get(self, ref, fields, batch_fields, non_tensor_fields, meta_info_keys, data_cls,
             destinations, rows, flat):
        ref = _as_ref(ref)
        selection, _ = _row_selection(rows, ref.batch_size)
        names = _selected_fields(ref, fields, batch_fields, non_tensor_fields)
        destinations = destinations or {}
        readers = {}
        batch, non_tensor = {}, {}
        for name in names:
            loc = ref.field_index[name]
            reader = readers.get(loc.stage)
            if reader is None:
                reader = readers[loc.stage] = self._reader(ref.stage_refs[loc.stage])
            if loc.section == "batch":
                batch[name] = reader.read(loc.member, selection, destinations.get(name))
            elif name in ref.encoded_non_tensor:
                values = reader.read_encoded(ref.encoded_non_tensor[name], selection)
                non_tensor[name] = values if flat else _object_array(values)
            else:
                non_tensor[name] = reader.read(loc.member, selection, destinations.get(name))
        meta = dict(ref.meta_info) if meta_info_keys is None else \
            {k: ref.meta_info[k] for k in meta_info_keys if k in ref.meta_info}
        return _build_result(batch, non_tensor, meta, data_cls)

    def dataproto_manifest_view(self, ref):
        """Where each field is and how it is encoded: {"namespace", "partition",
        "batch_size", "batch_fields", "non_tensor_fields", "meta_info_keys", "stages"}."""
        ref = _as_ref(ref)
        readers = {stage: self._reader(r) for stage, r in ref.stage_refs.items()}
        fields = {}
        for name, loc in ref.field_index.items():
            reader = readers[loc.stage]
            spec = dict(reader.field_spec(loc.member))
            enc = ref.encoded_non_tensor.get(name)
            if enc is not None:
                spec = {"encoding": "structured_non_tensor", "codec": enc["codec"],
                        "metadata": enc.get("metadata"),
                        "payload_members": dict(enc["payload_members"]),
                        "payload_specs": {p: dict(reader.field_spec(m))
                                          for p, m in enc["payload_members"].items()}}
            fields[name] = {"section": loc.section, "stage": loc.stage, "member": loc.member,
                            "spec": spec}
        return {
            "namespace": ref.namespace, "partition": ref.partition,
            "batch_size": ref.batch_size,
            "batch_fields": {n: f for n, f in fields.items() if f["section"] == "batch"},
            "non_tensor_fields": {n: f for n, f in fields.items()
                                  if f["section"] == "non_tensor_batch"},
            "meta_info_keys": list(ref.meta_info),
            "stages": {stage: {"manifest_key": r.manifest_key,
                               "dataproto": readers[stage].metadata.get("dataproto", {})}
                       for stage, r in ref.stage_refs.items()},
        }

    # ------------------------------------------------------------ DataProto: removal

    def cleanup_dataproto(self, ref):
        """Removes every stage object of a ref (once each)."""
        ref = _as_ref(ref)
        for key in dict.fromkeys(r.manifest_key for r in ref.stage_refs.values()):
            self.remove_bundle(RemoteBundleRef(key, {}))

    def cleanup_dataproto_append(self, previous, appended):
        """Removes what ``appended`` (from append_dataproto_fields on ``previous``) added,
        leaving ``previous`` intact."""
        previous, appended = _as_ref(previous), _as_ref(appended)
        bundles = self._bundles
        for stage, stage_ref in appended.stage_refs.items():
            old = previous.stage_refs.get(stage)
            if old is None:
                self.remove_bundle(stage_ref)
                continue
            if old.manifest_key == stage_ref.manifest_key:
                continue
            is_exist = getattr(self.store, "is_exist", None)
            if callable(is_exist) and is_exist(stage_ref.manifest_key) == 0:
                continue
            manifest = self._manifest(stage_ref)
            kept = {loc.member for loc in previous.field_index.values() if loc.stage == stage}
            for name, enc in previous.encoded_non_tensor.items():
                if previous.field_index[name].stage == stage:
                    kept.update(enc["payload_members"].values())
            added = [spec for member, spec in manifest["buffers"].items() if member not in kept]
            added_ids = {bundles.object_id_of(spec["key"]) for spec in added}
            keys = bundles.payload_keys(manifest["meta"])
            for spec in added:
                keys += bundles.payload_keys(spec)
            keys += [k for k in manifest.get("cleanup_keys", [])
                     if bundles.object_id_of(k) in added_ids]
            bundles.io.remove_keys(keys, strict=True)
            bundles.io.remove_keys([stage_ref.manifest_key], strict=True)
