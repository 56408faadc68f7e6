"""Which codec a DataProto non-tensor field gets, how rows of nested dicts and lists are
split into columns, and how a field is encoded by a FieldSchema (upstream's
``infer_structure`` layer of ``mooncake.structured_object_store``).

* ``choose_leaf_codec(values)`` looks at the non-null rows (None and MISSING do not
  count), first match wins: torch tensors of one dtype -> ragged_tensor; lists of
  bytes-like values or PIL images -> media_list_ragged; numeric ndarrays ->
  typed_ragged; lists/tuples numpy reads as numbers -> typed_ragged; numeric scalars
  -> ndarray; bytes-like -> bytes_ragged; PIL images -> media_bytes; str ->
  utf8_ragged; dicts/lists/tuples -> msgpack_ragged; anything else is refused.
* ``infer_structure(path, values, leaves, nodes)`` splits rows of str-keyed dicts (at
  most 64 keys) and short lists (at most 8 items, each a dict, list, tuple or None)
  into one column per key or position, recursively (at most 32 levels). A child column
  holds ``MISSING`` where the parent row lacks the key or position, None where the
  parent row is None. Paths join keys with "." and positions with "[i]";
  ``escape_key`` backslash-escapes "\\", "." and "[" in keys.
* A field whose split has a leaf whole-row codecs cannot carry (tensors, bytes, media,
  ndarrays) is stored "structured_recursive": per node the payloads
  ``node.<i>.missing``/``row_mask`` (bool) and ``lengths`` (int64, lists), per leaf its
  codec's payloads as ``leaf.<i>.<payload>`` plus ``leaf.<i>.missing``; the metadata
  lists nodes and leaves with their payload names.
* ``encode_with_schema`` encodes by a FieldSchema's codec; codec "auto" tries the
  recursive split, then the inferred codec, then msgpack_ragged, then json_ragged.
"""

from dataclasses import dataclass, field
from typing import Optional

from . import _structured_rows as R
from ._structured_payloads import is_tensor, numpy

MAX_STRUCT_KEYS = 64
MAX_LIST_LEN = 8
MAX_DEPTH = 32
RECURSIVE_CODEC = "structured_recursive"
SCHEMA_CODECS = ("auto", "ragged_tensor_dict", "ragged_tensor", "typed_ragged", "ndarray",
                 "bytes_ragged", "media_bytes", "media_list_ragged", "utf8_ragged",
                 "msgpack_ragged", "json_ragged")
# Leaf codecs whose presence makes a split field structured_recursive.
_STRUCTURE_ONLY_CODECS = ("ragged_tensor", "bytes_ragged", "media_bytes", "media_list_ragged")
_MSGPACK_SAMPLE_ROWS = 128
_MSGPACK_SAMPLE_BYTES = 1 << 20


class _Missing:
    """Marks a dict key or list position a row does not have (unlike a None value)."""

    __slots__ = ()

    def __repr__(self):
        return "<MISSING>"

    def __reduce__(self):
        return "MISSING"  # copies and pickles stay the one sentinel


MISSING = _Missing()


@dataclass
class CodecDecision:
    accepted: bool
    codec: str
    reason: str
    normalized_type: str
    metadata: dict = field(default_factory=dict)


@dataclass
class InferredLeaf:
    path: str
    values: list
    decision: CodecDecision


@dataclass
class InferredNode:
    path: str
    node_type: str  # "dict" or "list"
    children: list  # keys or positions
    lengths: Optional[list] = None  # list nodes: each row's length (0 when absent)
    row_mask: Optional[list] = None  # the row holds a container here


def _present(values):
    return [v for v in values if v is not None and v is not MISSING]


def _is_number(value):
    np = numpy()
    return isinstance(value, (bool, int, float, np.number))


def _is_media_list(value):
    return isinstance(value, (list, tuple)) and all(
        R.is_bytes_like(item) or R.is_pil_image(item) for item in value)


def choose_leaf_codec(values):
    """The CodecDecision for a column of rows (see the module doc)."""
    rows = _present(values)
    if not rows:
        return CodecDecision(False, "msgpack_ragged", "all rows are null", "msgpack")
    np = numpy()
    if all(is_tensor(v) for v in rows):
        dtypes = sorted({str(v.dtype) for v in rows})
        if len(dtypes) > 1:
            return CodecDecision(False, "ragged_tensor", f"mixed tensor dtype: {dtypes}",
                                 "torch.Tensor")
        return CodecDecision(True, "ragged_tensor", "all non-null rows are Tensor",
                             "torch.Tensor", {"dtype": dtypes[0]})
    if all(_is_media_list(v) for v in rows):
        return CodecDecision(True, "media_list_ragged", "all rows are media lists",
                             "media list")
    if all(isinstance(v, np.ndarray) for v in rows):
        if all(np.issubdtype(v.dtype, np.number) for v in rows):
            return CodecDecision(True, "typed_ragged", "all rows are numeric ndarray",
                                 "numeric sequence", {"recursive_source": "ndarray"})
        return CodecDecision(False, "msgpack_ragged", "object ndarray rows", "python object")
    if all(isinstance(v, (list, tuple)) for v in rows):
        try:
            dtype = np.result_type(*[np.asarray(v).dtype for v in rows])
        except (TypeError, ValueError, OverflowError):
            dtype = None
        if dtype is not None and np.issubdtype(dtype, np.number):
            return CodecDecision(True, "typed_ragged", "all rows are numeric sequences",
                                 "numeric sequence", {"dtype": str(dtype)})
    if all(_is_number(v) for v in rows):
        dtype = np.result_type(*rows)
        if dtype.kind not in "biufc":  # e.g. ints past int64: numpy gives object
            return CodecDecision(False, "ndarray", f"non-numeric dtype: {dtype}",
                                 "numeric scalar")
        return CodecDecision(True, "ndarray", "all rows are numeric scalar",
                             "numeric scalar", {"dtype": str(dtype)})
    for predicate, codec, kind, what in (
            (R.is_bytes_like, "bytes_ragged", "bytes-like", "bytes-like"),
            (R.is_pil_image, "media_bytes", "media", "media"),
            (lambda v: isinstance(v, str), "utf8_ragged", "str", "str"),
            (lambda v: isinstance(v, (dict, list, tuple)), "msgpack_ragged", "msgpack",
             "msgpack-like")):
        if all(predicate(v) for v in rows):
            return CodecDecision(True, codec, f"all rows are {what}", kind)
    return CodecDecision(False, "msgpack_ragged", "no codec matched", "python object")


def escape_key(key):
    return key.replace("\\", "\\\\").replace(".", "\\.").replace("[", "\\[")


def _dict_keys(rows):
    if not rows or not all(isinstance(v, dict) for v in rows):
        return None
    keys = {k for v in rows for k in v}
    if len(keys) > MAX_STRUCT_KEYS or not all(isinstance(k, str) for k in keys):
        return None
    return sorted(keys)


def _list_width(rows):
    if not rows or not all(isinstance(v, (list, tuple)) for v in rows):
        return None
    width = max(len(v) for v in rows)
    if width > MAX_LIST_LEN or not all(item is None or isinstance(item, (dict, list, tuple))
                                       for v in rows for item in v):
        return None
    return width


def infer_structure(path, values, leaves, nodes, *, _depth=0):
    """Appends to ``leaves`` and ``nodes`` the columns ``values`` (the rows at ``path``)
    split into (see the module doc); ValueError past the depth limit."""
    if _depth > MAX_DEPTH:
        raise ValueError(f"infer_structure exceeded max depth {MAX_DEPTH} at {path!r}")
    rows = _present(values)
    keys = _dict_keys(rows)
    if keys is not None:
        nodes.append(InferredNode(path, "dict", keys,
                                  row_mask=[isinstance(v, dict) for v in values]))
        for key in keys:
            column = [v.get(key, MISSING) if isinstance(v, dict) else None for v in values]
            infer_structure(f"{path}.{escape_key(key)}", column, leaves, nodes,
                            _depth=_depth + 1)
        return
    width = _list_width(rows)
    if width is not None:
        is_list = [isinstance(v, (list, tuple)) for v in values]
        nodes.append(InferredNode(path, "list", list(range(width)),
                                  [len(v) if flag else 0 for v, flag in zip(values, is_list)],
                                  row_mask=is_list))
        for i in range(width):
            column = [(v[i] if i < len(v) else MISSING) if flag else None
                      for v, flag in zip(values, is_list)]
            infer_structure(f"{path}[{i}]", column, leaves, nodes, _depth=_depth + 1)
        return
    leaves.append(InferredLeaf(path, values, choose_leaf_codec(values)))


# ---------------------------------------------------------------- encoding a field


def encode_leaf(values, decision):
    """The EncodedLeaf of rows under an accepted decision (ValueError otherwise)."""
    if not decision.accepted:
        raise ValueError(f"unsupported structured non-tensor field: {decision.reason}")
    if decision.codec == "msgpack_ragged":  # numpy values inside rows as plain ones
        payload, metadata = R.encode_bytes_like([None if v is None else
                                                 _msgpack_row(R.plain_value(v))
                                                 for v in values])
    else:  # typed_ragged picks its dtype from the rows; ndarray takes the decided one
        hints = decision.metadata if decision.codec == "ndarray" else None
        payload, metadata = R.encode(decision.codec, values, metadata=hints)
    metadata.update({"schema_source": "inferred_from_runtime_values",
                     "decision_reason": decision.reason,
                     "normalized_type": decision.normalized_type, **decision.metadata})
    return R.EncodedLeaf(decision.codec, len(values), payload, metadata)


def _msgpack_row(value):
    from ._structured_msgpack import packb
    return packb(value)


def encode_inferred(path, values):
    """The EncodedLeaf of a non-tensor field's rows, its codec inferred (a column of
    only None rows is stored json_ragged)."""
    values = list(values)
    leaves, nodes = [], []
    infer_structure(path, values, leaves, nodes)
    if nodes and any(_needs_structure(leaf, "ndarray_rows") for leaf in leaves):
        return _encode_recursive(path, values, leaves, nodes, _leaf_by_decision)
    return encode_leaf(values, _all_null_decision(values, choose_leaf_codec(values)))


def _needs_structure(leaf, ndarray_test):
    codec = leaf.decision.codec
    if codec in _STRUCTURE_ONLY_CODECS:
        return True
    if codec != "typed_ragged":
        return False
    if ndarray_test == "ndarray_rows":
        np = numpy()
        return any(isinstance(v, np.ndarray) for v in _present(leaf.values))
    return leaf.decision.metadata.get("recursive_source") == "ndarray"


def _all_null_decision(values, decision):
    if not decision.accepted and not _present(values):
        return CodecDecision(True, "json_ragged", "all rows are null or missing", "json")
    return decision


def _leaf_by_decision(leaf, values):
    return encode_leaf(values, _all_null_decision(leaf.values, leaf.decision))


def _leaf_by_schema(leaf, values):
    decision = _all_null_decision(leaf.values, leaf.decision)
    from .structured_object_store import FieldSchema
    return encode_with_schema(leaf.path, _normalized_for(values, decision.codec),
                              FieldSchema(codec=decision.codec, metadata=decision.metadata))


def _lookup(value, root, path):
    """The value at ``path`` (below ``root``) inside one row; MISSING where absent."""
    current = value
    for token in _path_tokens(path[len(root):].lstrip(".") if path != root else ""):
        if current is MISSING:
            return MISSING
        if isinstance(token, str):
            if not isinstance(current, dict) or token not in current:
                return MISSING
        elif not isinstance(current, (list, tuple)) or token >= len(current):
            return MISSING
        current = current[token]
    return current


def _path_tokens(path):
    """Keys (str) and positions (int) of a path suffix, escapes undone."""
    tokens, current, i = [], [], 0
    while i < len(path):
        c = path[i]
        if c == "\\" and i + 1 < len(path):
            current.append(path[i + 1])
            i += 2
        elif c in ".[":
            if current:
                tokens.append("".join(current))
                current = []
            if c == "[":
                end = path.index("]", i)
                tokens.append(int(path[i + 1:end]))
                i = end + 1
            else:
                i += 1
        else:
            current.append(c)
            i += 1
    if current:
        tokens.append("".join(current))
    return tokens


def _encode_recursive(path, values, leaves, nodes, encode_one):
    np = numpy()
    payload, node_specs, leaf_specs = {}, [], []
    for i, node in enumerate(nodes):
        spec = {"id": i, "path": node.path, "node_type": node.node_type,
                "children": list(node.children), "missing_payload": f"node.{i}.missing"}
        payload[f"node.{i}.missing"] = np.asarray(
            [_lookup(v, path, node.path) is MISSING for v in values], dtype=np.bool_)
        if node.row_mask is not None:
            payload[f"node.{i}.row_mask"] = np.asarray(node.row_mask, dtype=np.bool_)
            spec["row_mask_payload"] = f"node.{i}.row_mask"
        if node.lengths is not None:
            payload[f"node.{i}.lengths"] = np.asarray(node.lengths, dtype=np.int64)
            spec["lengths_payload"] = f"node.{i}.lengths"
        node_specs.append(spec)
    for i, leaf in enumerate(leaves):
        missing = [v is MISSING for v in leaf.values]
        encoded = encode_one(leaf, [None if m else v for m, v in zip(missing, leaf.values)])
        members = {}
        for name, part in encoded.payload.items():
            members[name] = f"leaf.{i}.{name}"
            payload[members[name]] = part
        payload[f"leaf.{i}.missing"] = np.asarray(missing, dtype=np.bool_)
        members["missing"] = f"leaf.{i}.missing"
        leaf_specs.append({"id": i, "path": leaf.path, "codec": encoded.codec,
                           "rows": encoded.rows, "metadata": encoded.metadata,
                           "payload_members": members})
    return R.EncodedLeaf(RECURSIVE_CODEC, len(values), payload,
                         {"schema_source": "inferred_from_runtime_values",
                          "structure_version": 1, "root_path": path, "nodes": node_specs,
                          "leaves": leaf_specs})


def _normalized_for(values, codec):
    return [R.plain_value(v) for v in values] if codec in ("msgpack_ragged", "json_ragged") \
        else values


def _schema_dtype(schema):
    dtype = schema.metadata.get("dtype")
    if dtype is None:
        return None
    np = numpy()
    try:
        dtype = np.dtype(dtype)
    except (TypeError, ValueError) as e:
        raise ValueError(f"invalid FieldSchema metadata['dtype']: "
                         f"{schema.metadata.get('dtype')!r}") from e
    if dtype.kind not in "biufc":
        raise ValueError(f"FieldSchema metadata['dtype'] must be numeric or bool, got {dtype}")
    return dtype


def encode_with_schema(path, values, schema):
    """The EncodedLeaf of a field's rows under ``schema.codec`` (no inference, except
    for "auto")."""
    values = list(values)
    if not schema.nullable and any(v is None for v in values):
        raise ValueError(f"FieldSchema for {path!r} is not nullable")
    codec = schema.codec
    if codec == "auto":
        return encode_with_fallback(path, values)
    if codec == "ragged_tensor_dict":
        return R.encode_ragged_tensor_dict(values, schema.metadata)
    if codec not in SCHEMA_CODECS:
        raise ValueError(f"unsupported schema codec: {codec!r}")
    if codec == "ndarray":
        dtype = _schema_dtype(schema)
        if dtype is None:
            return encode_with_fallback(path, values)
        payload, metadata = R.encode_numeric_scalars(values, dtype)
    elif codec == "typed_ragged":
        payload, metadata = R.encode_typed_ragged(values, _schema_dtype(schema))
    else:
        payload, metadata = R.encode(codec, values, path)
    return R.EncodedLeaf(codec, len(values), payload, metadata)


def encode_with_fallback(path, values):
    """Codec "auto": the recursive split when it applies, else the inferred codec, then
    msgpack_ragged, then json_ragged; ValueError naming what each refused."""
    values = list(values)
    errors = []
    try:
        leaves, nodes = [], []
        infer_structure(path, values, leaves, nodes)
        if nodes and any(_needs_structure(leaf, "decision") for leaf in leaves):
            return _encode_recursive(path, values, leaves, nodes, _leaf_by_schema)
    except R.ENCODING_ERRORS as e:
        errors.append(f"structured_recursive: {e}")
    from .structured_object_store import FieldSchema
    decision = choose_leaf_codec(values)
    for codec in dict.fromkeys((decision.codec, "msgpack_ragged", "json_ragged")):
        metadata = dict(decision.metadata) if codec == decision.codec else {}
        try:
            return encode_with_schema(path, _normalized_for(values, codec),
                                      FieldSchema(codec=codec, metadata=metadata))
        except R.ENCODING_ERRORS as e:
            errors.append(f"{codec}: {e}")
    raise ValueError(f"unable to infer a safe codec for structured non-tensor field "
                     f"{path!r}; tried {errors}")


# ---------------------------------------------------------------- decoding a field


def decode_field(encoded, payload, rows, metadata=None):
    """The rows of an encoded field entry ({"codec", "metadata", ...}) from its
    payloads {payload name: value}."""
    codec = encoded.get("codec")
    metadata = encoded.get("metadata") if metadata is None else metadata
    if codec != RECURSIVE_CODEC:
        return R.decode(codec, payload, rows, metadata)
    try:
        return _decode_recursive(metadata or {}, payload, rows)
    except (KeyError, IndexError, TypeError) as e:
        raise ValueError(f"malformed structured_recursive field ({type(e).__name__}: "
                         f"{e})") from None


def _decode_recursive(metadata, payload, rows):
    columns = {}
    for leaf in metadata.get("leaves", []):
        members = leaf["payload_members"]
        parts = {name: payload[full] for name, full in members.items() if name != "missing"}
        values = R.decode(leaf["codec"], parts, rows, leaf.get("metadata"))
        missing = payload[members["missing"]]
        columns[leaf["path"]] = [MISSING if bool(missing[r]) else values[r]
                                 for r in range(rows)]
    deepest_first = sorted(metadata.get("nodes", []),
                           key=lambda n: n["path"].count(".") + n["path"].count("["),
                           reverse=True)
    for node in deepest_first:
        columns[node["path"]] = [_rebuild_node(node, payload, columns, r) for r in range(rows)]
    return columns[metadata["root_path"]]


def _child_path(node, child):
    if node["node_type"] == "dict":
        return f"{node['path']}.{escape_key(str(child))}"
    return f"{node['path']}[{int(child)}]"


def _rebuild_node(node, payload, columns, row):
    def flag(key):
        name = node.get(key)
        return None if name is None else payload[name][row]

    if flag("missing_payload") is not None and bool(flag("missing_payload")):
        return MISSING
    mask = flag("row_mask_payload")
    if mask is not None and not bool(mask):
        return None
    if node["node_type"] == "dict":
        out = {}
        for child in node["children"]:
            value = columns[_child_path(node, child)][row]
            if value is not MISSING:
                out[child] = value
        return out
    length = flag("lengths_payload")
    out = [None] * (len(node["children"]) if length is None else int(length))
    for child in node["children"]:
        if int(child) < len(out):
            value = columns[_child_path(node, child)][row]
            if value is not MISSING:
                out[int(child)] = value
    return out


__all__ = ["MISSING", "CodecDecision", "InferredLeaf", "InferredNode", "choose_leaf_codec",
           "escape_key", "infer_structure", "encode_inferred", "encode_with_schema",
           "encode_with_fallback", "decode_field"]
