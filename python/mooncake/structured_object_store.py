"""Structured objects and DataProto batches in Mooncake Store (upstream's
``mooncake.structured_object_store`` API, with its key layout, manifests, field specs
and codec payloads, so either side reads what the other wrote).

``MooncakeBundleTransfer(store)`` stores, over any store with put/get/remove (a
``MooncakeDistributedStore``; its tensor and zero-copy calls are used when present):

* bundles: metadata bytes plus named buffers (``put_bundle``, ``remove_bundle``);
* structured objects: JSON metadata plus named members -- bytes, numpy arrays, CPU
  torch tensors (jagged nested ones too), or ``tensor_object_buffer`` regions put
  zero-copy (``put_structured_object``, ``put_object``/``get_object``), read back
  lazily through a ``StructuredObjectReadSpec`` that selects members and axis-0 row
  slices (``read_spec``, ``materialize``, ``materialize_into`` caller destinations:
  numpy arrays, ``tensor_object_buffer`` or ``raw_destination`` memory);
* DataProto batches (verl's ``batch`` / ``non_tensor_batch`` / ``meta_info``, or a flat
  dict): ``put``/``put_dataproto`` store one stage as a structured object and return a
  ``MooncakeDataProtoRef``, a light handle (``export_ref`` makes it JSON for another
  process, ``import_ref`` reads it back); ``append_dataproto_fields`` adds fields in a
  new or the same stage; ``get``/``get_dataproto`` read selected fields and rows;
  ``cleanup_dataproto`` removes every object of a handle.

The layers: ``_structured_transport`` (which store calls move the bytes),
``_structured_bundles`` (keys and manifests), ``_structured_codecs`` (member field
specs, tensor bytes), ``_structured_layer`` (structured objects and their reads),
``_structured_rows`` and ``_structure_inference`` (non-tensor field codecs and how one
is chosen), ``_structured_dataproto`` (DataProto shapes), ``_structured_msgpack``
(msgpack_ragged rows without the msgpack package). The objects of one DataProto share
a storage group (``config.group_ids``: one logical id, ``[""]`` for none; a fresh id by
default), so the store evicts them together.

Module-level names upstream's callers and tests reach are kept: the payload forms
(``_MultiBufferPayload``, ``_DirectCopyPayload``, ...), the codec functions
(``_encode_typed_ragged_values``, ``_encode_with_schema``, ...), and two hooks looked up
at each use, so they can be replaced: ``_concat_arrays_into`` (the fast copy of ndarray
rows into pool leases; None turns it off) and ``_has_tensor_codec_helpers`` (whether
``mooncake.store`` can serialize tensors; without it tensors are stored as torch.save
bytes).

Differences from upstream: numpy, torch and Pillow are imported only when a value needs
them and msgpack rows are packed by this package (no msgpack dependency); non-tensor
fields read with a row selection are read whole and then cut (upstream reads only the
rows' bytes), and any slice step works for them; a ``non_tensor_batch`` field given as a
plain list is encoded like an object array (upstream refuses it).
"""

import sys
import uuid
from dataclasses import dataclass, field
from typing import Any, Mapping, Optional, Protocol, Union

from . import _structure_inference as I
from . import _structured_dataproto as D
from . import _structured_payloads as P
from ._structure_inference import (  # noqa: F401 (upstream's names for these)
    MISSING,
    CodecDecision as _CodecDecision,
    InferredLeaf as _InferredLeaf,
    InferredNode as _InferredNode,
    choose_leaf_codec as _choose_leaf_codec,
    encode_with_fallback as _encode_with_fallback,
    encode_with_schema as _encode_with_schema,
    escape_key as _escape_key,
    infer_structure,
)
from ._structured_bundles import (
    BundleManifestStore,
    check_chunk_bytes,
    check_key_segment,
    decode_json,
    normalize_key_prefix,
)
from ._structured_codecs import FIELD_SPECS_KEY as STRUCTURED_FIELD_SPECS_KEY
from ._structured_codecs import tensor_codec_helpers_available
from ._structured_layer import StructuredObjects, encode_metadata
from ._structured_payloads import (  # noqa: F401 (upstream's names for these)
    MISSING_OBJECT_ERROR,
    DirectCopyPayload as _DirectCopyPayload,
    MultiBufferPayload as _MultiBufferPayload,
    RawDestination as _RawDestinationBuffer,
    TensorObjectBuffer as _TensorObjectBufferPayload,
    TensorPayload as _TensorPayload,
    config_for_keys as _config_for_grouped_keys,
)
from ._structured_rows import (  # noqa: F401 (upstream's names for these)
    EncodedLeaf as _EncodedStructuredLeaf,
    decode_msgpack as _decode_msgpack_ragged_values,
    decode_typed_ragged as _decode_typed_ragged_values,
    encode_msgpack as _encode_msgpack_ragged_values,
    encode_typed_ragged as _encode_typed_ragged_values,
    encode_typed_ragged_regular_rows as _encode_typed_ragged_regular_ndarray_rows,
)
from ._structured_transport import (
    AUTO_PARALLEL_MIN_BYTES,
    AUTO_PARALLEL_MIN_CHUNKS,
    PayloadTransport,
)

try:  # the fast copy of ndarray rows into pool leases (replaceable; None: off)
    from ._fast_copy import concat_arrays_into as _concat_arrays_into
except ImportError:  # pragma: no cover - the module ships with this package
    _concat_arrays_into = None

DEFAULT_BUNDLE_CHUNK_BYTES = 64 * 1024 ** 2
DATAPROTO_REF_HANDLE_TYPE = "mooncake_dataproto_ref"
DATAPROTO_REF_HANDLE_VERSION = 1
STORAGE_GROUP_ID = "storage_group_id"
_WRAPPED_OBJECT = "__mooncake_wrapped_object__"
_decode_manifest = lambda payload: decode_json(payload, "bundle manifest")  # noqa: E731

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


def _has_tensor_codec_helpers():
    """Whether ``mooncake.store`` serializes tensors (replaceable hook)."""
    return tensor_codec_helpers_available()


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
    8 chunks and 64 MiB); ``copy_mode``: "copy" (``put``), "zero_copy" (only tensor_object_buffer
    members, put from their registered memory; any other payload is refused) or "auto"
    (tensors with the store's tensor calls, bytes through the transfer's BufferPool when
    it has one, else copied)."""

    max_inflight_put: int = 1
    put_mode: str = "auto"
    copy_mode: str = "auto"


@dataclass(frozen=True)
class FieldSchema:
    """How a DataProto non-tensor field is encoded: ``codec`` (see
    ``mooncake._structured_rows``, or "auto" to infer it), ``nullable``, and ``metadata``
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


def tensor_object_buffer(ptr, size, owner=None, batch_size=None):
    """``size`` bytes at ``ptr`` (inside memory registered with the store, e.g. a
    BufferPool lease; ``owner`` keeps it alive) to store as one member without a copy,
    or to read a member into. ``batch_size`` makes it usable as a DataProto field."""
    return _TensorObjectBufferPayload(int(ptr), int(size), owner, batch_size)


def raw_destination(ptr, size, owner=None, *, pre_registered=False):
    """Memory at ``ptr`` to read a member into (``pre_registered``: it is registered
    with the store already, e.g. a BufferPool lease)."""
    return _RawDestinationBuffer(int(ptr), int(size), owner, bool(pre_registered))


# ---------------------------------------------------------------- storage groups


def _new_storage_group_id(config):
    """The storage group of a new DataProto: the one id ``config.group_ids`` names, a
    fresh "structured-<hex>" when it names none, or None for "" (ungrouped)."""
    raw = getattr(config, "group_ids", None)
    if raw is None:
        group = None
    elif isinstance(raw, str):
        group = raw
    else:
        try:
            ids = list(raw)
        except TypeError:
            raise ValueError("structured object store config.group_ids must contain "
                             "strings") from None
        if len(ids) > 1:
            raise ValueError(P.ONE_GROUP_ERROR)
        group = ids[0] if ids else None
    if group is None:
        return f"structured-{uuid.uuid4().hex}"
    if not isinstance(group, str):
        raise ValueError("structured object store config.group_ids must contain strings")
    return group or None


# ---------------------------------------------------------------- the transfer


class MooncakeBundleTransfer:
    """Bundles, structured objects and DataProto batches in ``store`` (see the module
    docstring). ``buffer_pool`` (a BufferPool of that store) stages copies and holds
    read arrays, saving a registration per call."""

    def __init__(self, store, key_prefix="bundle", default_chunk_bytes=DEFAULT_BUNDLE_CHUNK_BYTES,
                 buffer_pool=None):
        self.store = store
        self.key_prefix = normalize_key_prefix(key_prefix)
        self.default_chunk_bytes = check_chunk_bytes(default_chunk_bytes)
        self._transport = PayloadTransport(store, buffer_pool)
        self._bundle_store = BundleManifestStore(store, self._transport, self.key_prefix,
                                                 self.default_chunk_bytes)
        self._structured_store = StructuredObjects(self._bundle_store, self._transport)

    # ------------------------------------------------------------ bundles

    def put_bundle(self, meta, buffers, partition="default", chunk_bytes=None, policy=None,
                   max_inflight_put=None, config=None):
        """Stores ``meta`` (bytes) and ``buffers`` {name: bytes-like}."""
        return self._bundle_store.put_bundle(meta, buffers, partition, chunk_bytes, policy,
                                             max_inflight_put, config)

    def remove_bundle(self, ref):
        """Removes every object of a bundle (one forced batch removal); nothing to do
        when its manifest is already gone."""
        key = getattr(ref, "manifest_key", None) if not isinstance(ref, Mapping) \
            else ref.get("manifest_key")
        embedded = getattr(ref, "manifest", None) if not isinstance(ref, Mapping) \
            else ref.get("manifest")
        is_exist = getattr(self.store, "is_exist", None)
        if not embedded and isinstance(key, str) and callable(is_exist):
            status = is_exist(key)
            if status == 0:
                return
            if status != 1:
                raise RuntimeError(f"is_exist failed for {key}: {status}")
        self._bundle_store.remove_bundle(ref)

    # ------------------------------------------------------------ structured objects

    def put_structured_object(self, payload, partition="default", chunk_bytes=None,
                              policy=None, max_inflight_put=None, config=None):
        if not isinstance(payload, StructuredObjectPayload):
            raise TypeError(f"expected StructuredObjectPayload, got {type(payload).__name__}")
        return self._structured_store.put(payload, partition, chunk_bytes, policy,
                                          max_inflight_put, config)

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

    def materialize(self, spec):
        return self.materialize_into(spec, None)

    def materialize_into(self, spec, destinations):
        """Reads the spec's members, into ``destinations`` {member: destination} where
        given (the result then holds the destination)."""
        return self._structured_store.materialize_into(spec, destinations)

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
            elif P.is_ndarray(value) and value.dtype.hasobject:
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
            sections = D.split_sections(data)
        elif type == "dict":
            envelope = D.flat_to_envelope(data, field_schemas)
            sections = tuple(envelope[s] for s in D.SECTIONS)
        else:
            raise ValueError(f"unsupported Mooncake payload type: {type!r}")
        return _StagePut(self, None, sections, namespace, partition, stage, chunk_bytes,
                         policy, False, field_schemas, config).run()

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
        return _StagePut(self, ref, D.split_sections(data), ref.namespace, ref.partition,
                         stage, chunk_bytes, policy, overwrite, field_schemas, config).run()

    def _merge_into_stage(self, old_ref, payload, partition, chunk_bytes, policy, config):
        """Adds members to a stage: writes them as a new object, then a manifest naming
        the old and the new members; it owns both old objects' manifests and metadata
        (the new object's are removed at once)."""
        bundles = self._bundle_store
        new_ref = self.put_structured_object(payload, partition, chunk_bytes, policy,
                                             config=config)
        try:
            old_manifest, old_meta = self._structured_store.open(old_ref)
            new_manifest, new_meta = self._structured_store.open(new_ref)
            if old_meta.get("dataproto") != new_meta.get("dataproto"):
                raise ValueError("DataProto stage metadata mismatch during manifest merge")
            old_specs = old_meta.get(STRUCTURED_FIELD_SPECS_KEY, {})
            new_specs = new_meta.get(STRUCTURED_FIELD_SPECS_KEY, {})
            clash = sorted((set(old_specs) & set(new_specs)) |
                           (set(old_manifest["buffers"]) & set(new_manifest["buffers"])))
            if clash:
                raise ValueError(f"structured members already exist: {clash}")
            merged = dict(old_meta)
            if old_specs or new_specs:
                merged[STRUCTURED_FIELD_SPECS_KEY] = {**old_specs, **new_specs}
            obsolete = [bundles.manifest_key(new_ref),
                        *bundles.payload_keys(new_manifest["meta"])]
            cleanup = [*old_manifest.get("cleanup_keys", []), bundles.manifest_key(old_ref),
                       *bundles.payload_keys(old_manifest["meta"]), *obsolete]
            merged_ref = bundles.put_bundle_manifest(
                encode_metadata(merged), {**old_manifest["buffers"], **new_manifest["buffers"]},
                partition=partition, chunk_bytes=chunk_bytes, policy=policy,
                cleanup_keys=cleanup, config=config)
        except Exception:
            self.remove_bundle(new_ref)
            raise
        bundles.remove_keys(obsolete, strict=False)
        return merged_ref

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
        return D.envelope_to_flat(result) if flat else result

    def get_dataproto(self, ref, *, fields=None, batch_fields=None, non_tensor_fields=None,
                      meta_info_keys=None, data_cls=None, destinations=None, rows=None):
        return self._get(ref, fields, batch_fields, non_tensor_fields, meta_info_keys,
                         data_cls, destinations, rows, False)

    def _get(self, ref, fields, batch_fields, non_tensor_fields, meta_info_keys, data_cls,
             destinations, rows, flat):
        ref = _as_ref(ref)
        selection, _ = D.row_selection(rows, ref.batch_size)
        names = D.selected_fields(ref, fields, batch_fields, non_tensor_fields)
        destinations = destinations or {}
        plain = [n for n in names if n not in ref.encoded_non_tensor]
        values = self._read_members(ref, plain, selection, destinations)
        encoded = [n for n in names if n in ref.encoded_non_tensor]
        values.update(self._read_encoded(ref, encoded, selection, flat))
        batch = {n: values[n] for n in names if ref.field_index[n].section == "batch"}
        non_tensor = {n: values[n] for n in names
                      if ref.field_index[n].section != "batch"}
        meta = dict(ref.meta_info) if meta_info_keys is None else \
            {k: ref.meta_info[k] for k in meta_info_keys if k in ref.meta_info}
        return D.build_result(batch, non_tensor, meta, data_cls)

    def _read_members(self, ref, names, selection, destinations):
        """Member fields: one read per stage for all rows or a slice, a row gather per
        field for row indices."""
        out = {}
        if isinstance(selection, tuple):
            for name in names:
                loc = ref.field_index[name]
                out[name] = self._structured_store.read_member_rows(
                    ref.stage_refs[loc.stage], loc.member, selection, destinations.get(name))
            return out
        by_stage = {}
        for name in names:
            by_stage.setdefault(ref.field_index[name].stage, []).append(name)
        for stage, stage_names in by_stage.items():
            members = [ref.field_index[n].member for n in stage_names]
            spec = self.read_spec(ref.stage_refs[stage]).select_members(members)
            if selection is not None:
                for member in members:
                    spec = spec.slice_member(member, 0, selection.start, selection.end,
                                             selection.step)
            result = self.materialize_into(spec, {ref.field_index[n].member: destinations[n]
                                                  for n in stage_names if n in destinations})
            out.update({n: result.objects[ref.field_index[n].member] for n in stage_names})
        return out

    def _read_encoded(self, ref, names, selection, flat):
        """Encoded non-tensor fields: their payload members read (one read per stage),
        decoded, then cut to the selected rows."""
        out = {}
        by_stage = {}
        for name in names:
            by_stage.setdefault(ref.field_index[name].stage, []).append(name)
        for stage, stage_names in by_stage.items():
            members = [m for n in stage_names
                       for m in ref.encoded_non_tensor[n]["payload_members"].values()]
            objects = self.materialize(self.read_spec(ref.stage_refs[stage])
                                       .select_members(members)).objects
            for name in stage_names:
                encoded = ref.encoded_non_tensor[name]
                payload = {p: objects[m] for p, m in encoded["payload_members"].items()}
                values = I.decode_field(encoded, payload, ref.batch_size)
                values = _pick_rows(values, selection)
                out[name] = values if flat else P.object_array(values)
        return out

    def dataproto_manifest_view(self, ref):
        """Where each field is and how it is encoded: {"namespace", "partition",
        "batch_size", "batch_fields", "non_tensor_fields", "meta_info_keys", "stages"}."""
        ref = _as_ref(ref)
        metadata = {stage: self._structured_store.open(r)[1]
                    for stage, r in ref.stage_refs.items()}
        fields = {}
        for name, loc in ref.field_index.items():
            specs = metadata[loc.stage].get(STRUCTURED_FIELD_SPECS_KEY, {})
            spec = dict(specs.get(loc.member, {"encoding": "bytes"}))
            enc = ref.encoded_non_tensor.get(name)
            if enc is not None:
                spec = {"encoding": "structured_non_tensor", "codec": enc["codec"],
                        "metadata": enc.get("metadata"),
                        "payload_members": dict(enc["payload_members"]),
                        "payload_specs": {p: dict(specs.get(m, {"encoding": "bytes"}))
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
                               "dataproto": metadata[stage].get("dataproto", {})}
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
        bundles = self._bundle_store
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
            manifest = bundles.resolve_manifest(stage_ref)
            kept = {loc.member for loc in previous.field_index.values() if loc.stage == stage}
            for name, enc in previous.encoded_non_tensor.items():
                if previous.field_index[name].stage == stage:
                    kept.update(enc["payload_members"].values())
            added = [spec for member, spec in manifest["buffers"].items() if member not in kept]
            added_ids = {bundles._object_id_from_bundle_key(spec["key"]) for spec in added}
            keys = bundles.payload_keys(manifest["meta"])
            for spec in added:
                keys += bundles.payload_keys(spec)
            keys += [k for k in manifest.get("cleanup_keys", [])
                     if bundles._object_id_from_bundle_key(k) in added_ids]
            keys.append(stage_ref.manifest_key)
            bundles.remove_keys(keys, strict=True)


def _pick_rows(values, selection):
    if selection is None:
        return values
    if isinstance(selection, tuple):
        picked = [values[i] for i in selection]
    else:
        picked = values[slice(selection.start, selection.end, selection.step)]
        picked = list(picked)
    owner = getattr(values, "_mooncake_pool_owner", None)
    return picked if owner is None else P.OwnerBackedList(picked, owner)


class _StagePut:
    """One put or append of a DataProto stage: its members, its storage group, and the
    new ref."""

    def __init__(self, transfer, ref, sections, namespace, partition, stage, chunk_bytes,
                 policy, overwrite, schemas, config):
        self.transfer, self.ref, self.sections = transfer, ref, sections
        self.namespace, self.partition, self.stage = namespace, partition, stage
        self.chunk_bytes, self.policy, self.overwrite = chunk_bytes, policy, overwrite
        self.schemas, self.config = schemas or {}, config

    def run(self):
        check_key_segment(self.stage, "stage")
        batch, non_tensor, meta_info = self.sections
        D.check_schema_sections(self.sections, self.schemas)
        rows = D.batch_size(batch, non_tensor)
        base = self.ref
        if base is not None and rows != base.batch_size and (batch or non_tensor):
            raise ValueError(f"DataProto append batch size {rows} does not match ref batch "
                             f"size {base.batch_size}")
        overlap = sorted(set(batch) & set(non_tensor))
        if overlap:
            raise ValueError(f"DataProto batch and non_tensor_batch fields overlap: {overlap}")
        buffers, locations, encoded = self._members(batch, non_tensor)
        if not buffers:  # only meta_info: nothing to store
            if base is None:
                return MooncakeDataProtoRef(rows, {}, {}, dict(meta_info), self.namespace,
                                            self.partition,
                                            _storage_group_id=_new_storage_group_id(self.config))
            return MooncakeDataProtoRef(
                base.batch_size, dict(base.stage_refs), dict(base.field_index),
                {**base.meta_info, **meta_info}, base.namespace, base.partition,
                base.global_indexes, dict(base.encoded_non_tensor), base._storage_group_id)
        self._check_replacements(locations)
        group = _new_storage_group_id(self.config) if base is None else base._storage_group_id
        config = self.config if group is None else P.config_with_group(self.config, group)
        payload = StructuredObjectPayload(
            {"layout": "dataproto_stage",
             "dataproto": {"version": 1, "namespace": self.namespace,
                           "partition": self.partition, "stage": self.stage,
                           "batch_size": rows}}, buffers)
        stage_ref = self._write(payload, config)
        if base is None:
            return MooncakeDataProtoRef(rows, {self.stage: stage_ref}, locations,
                                        dict(meta_info), self.namespace, self.partition,
                                        None, encoded, group)
        encoded_fields = {n: e for n, e in base.encoded_non_tensor.items() if n not in locations}
        encoded_fields.update(encoded)
        return MooncakeDataProtoRef(
            rows, {**base.stage_refs, self.stage: stage_ref},
            {**base.field_index, **locations}, {**base.meta_info, **meta_info},
            self.namespace, self.partition, base.global_indexes, encoded_fields, group)

    def _check_replacements(self, locations):
        if self.ref is None:
            return
        existing = sorted(set(self.ref.field_index) & set(locations))
        if existing and not self.overwrite:
            raise ValueError(f"DataProto fields already exist: {existing}")
        if self.overwrite:
            dropped = sorted(n for n, loc in self.ref.field_index.items()
                             if loc.stage == self.stage and n not in locations)
            if dropped:
                raise ValueError(f"DataProto overwrite for stage {self.stage!r} must include "
                                 f"existing fields: {dropped}")

    def _write(self, payload, config):
        transfer = self.transfer
        old = None if self.ref is None else self.ref.stage_refs.get(self.stage)
        if old is not None and not self.overwrite:
            return transfer._merge_into_stage(old, payload, self.partition, self.chunk_bytes,
                                              self.policy, config)
        stage_ref = transfer.put_structured_object(payload, self.partition, self.chunk_bytes,
                                                   self.policy, config=config)
        if old is not None and old.manifest_key != stage_ref.manifest_key:
            transfer.remove_bundle(old)
        return stage_ref

    def _members(self, batch, non_tensor):
        """(buffers, field locations, encoded non-tensor entries) of the stage."""
        buffers, locations, encoded = {}, {}, {}
        for name, value in batch.items():
            check_key_segment(name, "field name")
            buffers[f"batch.{name}"] = value
            locations[name] = StructuredFieldLocation(self.stage, f"batch.{name}", "batch")
        for name, value in non_tensor.items():
            check_key_segment(name, "field name")
            member = f"non_tensor_batch.{name}"
            locations[name] = StructuredFieldLocation(self.stage, member, "non_tensor_batch")
            enc = self._encode_non_tensor(name, member, value)
            if enc is None:
                buffers[member] = value
                continue
            members = {}
            for part, data in enc.payload.items():
                members[part] = f"{member}.{part}"
                buffers[members[part]] = data
            encoded[name] = {"codec": enc.codec, "rows": enc.rows, "metadata": enc.metadata,
                             "payload_members": members}
        return buffers, locations, encoded

    def _encode_non_tensor(self, name, member, value):
        """The EncodedLeaf of a non-tensor field, or None for a dense array stored as a
        member: by its FieldSchema's codec, else inferred for object arrays and lists."""
        schema = self.schemas.get(name)
        if schema is not None and D.schema_section(name, schema) not in (None,
                                                                          "non_tensor_batch"):
            schema = None
        if schema is not None:
            rows = _schema_rows(name, value)
            try:
                if schema.codec != "auto":
                    return I.encode_with_schema(member, rows, schema)
                if not schema.nullable and any(v is None for v in rows):
                    raise ValueError(f"FieldSchema for {member!r} is not nullable")
            except (TypeError, ValueError, RuntimeError, AttributeError) as e:
                raise type(e)(f"failed to encode non_tensor_batch field {name!r} with "
                              f"FieldSchema codec {schema.codec!r}: {e}") from e
        if P.is_ndarray(value) and not value.dtype.hasobject:
            return None
        if not P.is_ndarray(value) and not D.is_row_list(value):
            raise TypeError(f"non_tensor_batch field {name!r} must be an ndarray or a "
                            "non-string sequence")
        return I.encode_inferred(member, list(value))


def _schema_rows(name, value):
    if P.is_ndarray(value) or D.is_row_list(value):
        return list(value)
    raise TypeError(f"non_tensor_batch field {name!r} with FieldSchema must be an ndarray "
                    "or non-string sequence")
