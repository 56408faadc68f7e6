"""Which codec a DataProto non-tensor field gets, and how rows of nested dicts and lists
are split into columns (upstream's ``infer_structure`` layer of
``mooncake.structured_object_store``).

A field without a FieldSchema (or with codec "auto") is inferred from its rows:

* ``choose_leaf_codec(values)`` looks at the non-null rows (None and MISSING do not
  count) and returns a CodecDecision (accepted, codec, reason, normalized_type,
  metadata), first match wins: torch tensors of one dtype -> ragged_tensor; lists of
  bytes-like values or PIL images (empty lists too) -> media_list_ragged; numeric numpy
  arrays -> typed_ragged; lists/tuples that numpy reads as numbers -> typed_ragged;
  numeric scalars -> ndarray; bytes-like -> bytes_ragged; PIL images -> media_bytes;
  str -> utf8_ragged; dicts/lists/tuples -> msgpack_ragged; anything else is refused.
* ``infer_structure(path, values, leaves, nodes)`` splits rows of str-keyed dicts (at
  most 64 keys) and short lists (at most 8 items, each a dict, list, tuple or None)
  into one column per key or position, recursively (at most 32 levels): each container
  column becomes an InferredNode, each other column an InferredLeaf. A child column
  holds ``MISSING`` where the parent row lacks the key or position, and None where the
  parent row itself is None or absent. Paths join keys with "." and positions with
  "[i]"; ``escape_key`` backslash-escapes "\\", "." and "[" in keys.

When such a split finds a leaf that a whole-row codec cannot carry (tensors, bytes,
media, numpy arrays), the field is stored "structured_recursive": every leaf column
with its own codec plus per-node flags (row present, row missing, list lengths), and
rows are rebuilt from them on read. Otherwise the whole rows get the decided codec;
dict/list rows become msgpack_ragged, or json_ragged where the msgpack package is not
installed.
"""

import json
import sys
from dataclasses import dataclass, field
from typing import Optional

from . import _row_codecs as R
from ._structured_codecs import is_ndarray, is_tensor, numpy

MAX_STRUCT_KEYS = 64
MAX_LIST_LEN = 8
MAX_DEPTH = 32
FIELD_CODECS = ("auto", *R.CODECS)
RECURSIVE_CODEC = "structured_recursive"
# Leaf codecs whose values msgpack/JSON rows cannot carry: their presence makes a
# nested field structured_recursive.
_STRUCTURE_ONLY_CODECS = ("ragged_tensor", "bytes_ragged", "media_bytes",
                          "media_list_ragged")
_NO_MSGPACK = "msgpack is not installed"


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
    row_mask: Optional[list] = None  # the row is a container here
    missing: Optional[list] = None  # the row is MISSING here


def _present(values):
    return [v for v in values if v is not None and v is not MISSING]


def _is_number(value):
    if isinstance(value, (bool, int, float)):
        return True
    np = sys.modules.get("numpy")
    return np is not None and isinstance(value, (np.number, np.bool_))


def _is_media_list(value):
    return isinstance(value, (list, tuple)) and all(
        R.is_bytes_like(item) or R.is_pil_image(item) for item in value)


def _tensor_decision(rows):
    dtypes = sorted({str(t.dtype) for t in rows})
    if len(dtypes) > 1:
        return CodecDecision(False, "ragged_tensor", f"mixed tensor dtype: {dtypes}",
                             "torch.Tensor")
    return CodecDecision(True, "ragged_tensor", "all non-null rows are Tensor",
                         "torch.Tensor", {"dtype": dtypes[0]})


def _array_decision(rows, reason):
    """typed_ragged for rows (arrays, or lists numpy reads as numbers), else None."""
    np = numpy()
    try:
        arrays = [np.asarray(v) for v in rows]
    except (TypeError, ValueError):
        return None
    if any(a.dtype.kind not in "biufc" for a in arrays):
        return None
    dtype = R.common_numeric_dtype(rows, arrays) or np.dtype("int64")
    return CodecDecision(True, "typed_ragged", reason, "numeric sequence",
                         {"dtype": str(dtype)})


def _scalar_decision(rows):
    dtype = numpy().asarray(rows).dtype
    if dtype.kind not in "biufc":
        return CodecDecision(False, "ndarray", f"no common numeric dtype ({dtype})",
                             "numeric scalar")
    return CodecDecision(True, "ndarray", "all rows are numeric scalar", "numeric scalar",
                         {"dtype": str(dtype)})


_WHOLE_ROW_CODECS = (  # (predicate, codec, normalized type), after the numeric ones
    (R.is_bytes_like, "bytes_ragged", "bytes-like"),
    (R.is_pil_image, "media_bytes", "media"),
    (lambda v: isinstance(v, str), "utf8_ragged", "str"),
    (lambda v: isinstance(v, (dict, list, tuple)), "msgpack_ragged", "msgpack"),
)


def choose_leaf_codec(values):
    """The CodecDecision for a column of rows (see the module doc)."""
    rows = _present(values)
    if not rows:
        return CodecDecision(False, "msgpack_ragged", "all rows are null", "msgpack")
    if all(is_tensor(v) for v in rows):
        return _tensor_decision(rows)
    if all(_is_media_list(v) for v in rows):
        return CodecDecision(True, "media_list_ragged", "all rows are media lists",
                             "media list")
    if all(is_ndarray(v) for v in rows):
        return _array_decision(rows, "all rows are numeric ndarray") or CodecDecision(
            False, "msgpack_ragged", "ndarray rows are not numeric", "python object")
    if all(isinstance(v, (list, tuple)) for v in rows):
        decision = _array_decision(rows, "all rows are numeric sequences")
        if decision is not None:
            return decision
    if all(_is_number(v) for v in rows):
        return _scalar_decision(rows)
    for predicate, codec, kind in _WHOLE_ROW_CODECS:
        if all(predicate(v) for v in rows):
            return CodecDecision(True, codec, f"all rows are {kind}", kind)
    return CodecDecision(False, "msgpack_ragged", "no codec matched", "python object")


def escape_key(key):
    return key.replace("\\", "\\\\").replace(".", "\\.").replace("[", "\\[")


def _dict_keys(rows):
    """The sorted keys of dict rows, or None when they do not split into columns."""
    if not all(isinstance(v, dict) for v in rows):
        return None
    keys = {k for v in rows for k in v}
    if len(keys) > MAX_STRUCT_KEYS or not all(isinstance(k, str) for k in keys):
        return None
    return sorted(keys)


def _list_width(rows):
    """The longest list row, or None when list rows do not split into columns."""
    if not all(isinstance(v, (list, tuple)) for v in rows):
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
    keys = _dict_keys(rows) if rows else None
    if keys is not None:
        nodes.append(InferredNode(path, "dict", keys,
                                  row_mask=[isinstance(v, dict) for v in values],
                                  missing=[v is MISSING for v in values]))
        for key in keys:
            column = [v.get(key, MISSING) if isinstance(v, dict) else None for v in values]
            infer_structure(f"{path}.{escape_key(key)}", column, leaves, nodes,
                            _depth=_depth + 1)
        return
    width = _list_width(rows) if rows else None
    if width is not None:
        is_list = [isinstance(v, (list, tuple)) for v in values]
        nodes.append(InferredNode(path, "list", list(range(width)),
                                  lengths=[len(v) if flag else 0
                                           for v, flag in zip(values, is_list)],
                                  row_mask=is_list, missing=[v is MISSING for v in values]))
        for i in range(width):
            column = [(v[i] if i < len(v) else MISSING) if flag else None
                      for v, flag in zip(values, is_list)]
            infer_structure(f"{path}[{i}]", column, leaves, nodes, _depth=_depth + 1)
        return
    leaves.append(InferredLeaf(path, values, choose_leaf_codec(values)))


# ---------------------------------------------------------------- encoding a field


def encode_field(path, values, schema=None):
    """The Encoded form of a non-tensor field's rows: by ``schema`` (a FieldSchema) when
    it names a codec, else inferred. TypeError/ValueError when the rows do not fit."""
    values = list(values)
    codec = "auto" if schema is None else schema.codec
    if codec not in FIELD_CODECS:
        raise ValueError(f"unsupported schema codec: {codec!r} (supported: "
                         f"{', '.join(FIELD_CODECS)})")
    if schema is not None and not schema.nullable and any(v is None for v in values):
        raise ValueError(f"FieldSchema for {path!r} is not nullable")
    if codec != "auto":
        return R.encode(codec, values, schema.metadata)
    leaves, nodes = [], []
    infer_structure(path, values, leaves, nodes)
    if nodes and any(_needs_structure(leaf) for leaf in leaves):
        return _encode_structured(path, values, leaves, nodes)
    return _encode_leaf(path, values, choose_leaf_codec(values))


def _needs_structure(leaf):
    codec = leaf.decision.codec
    return codec in _STRUCTURE_ONLY_CODECS or (
        codec == "typed_ragged" and any(is_ndarray(v) for v in _present(leaf.values)))


def _usable_decision(decision, values):
    """``decision``, or json_ragged where it is a column of nulls (any codec stores
    those) or wants msgpack without the package."""
    if not decision.accepted and not _present(values):
        return CodecDecision(True, "json_ragged", "all rows are null or missing", "json")
    if decision.accepted and decision.codec == "msgpack_ragged" and \
            not R.msgpack_available():
        return CodecDecision(True, "json_ragged", _NO_MSGPACK, "json")
    return decision


def _encode_leaf(path, values, decision):
    decision = _usable_decision(decision, values)
    if not decision.accepted:
        raise ValueError(f"unsupported structured non-tensor field {path!r}: "
                         f"{decision.reason}")
    rows = [None if v is MISSING else v for v in values]
    try:
        encoded = R.encode(decision.codec, rows, decision.metadata)
    except (TypeError, ValueError, OverflowError) as e:
        hint = "; such rows need the msgpack package (pip install msgpack)" if \
            decision.reason == _NO_MSGPACK else ""
        raise type(e)(f"cannot encode structured non-tensor field {path!r} as "
                      f"{decision.codec}: {e}{hint}") from e
    encoded.metadata = {"schema_source": "inferred", "decision_reason": decision.reason,
                        "normalized_type": decision.normalized_type, **encoded.metadata}
    return encoded


def _encode_structured(path, values, leaves, nodes):
    """The structured_recursive Encoded form: payloads "node.<i>.row_mask",
    "node.<i>.missing", "node.<i>.lengths" (list nodes, JSON) and "leaf.<i>.<part>" plus
    "leaf.<i>.missing"; metadata names the root path, nodes and leaves."""
    payload, node_specs, leaf_specs = {}, [], []
    for i, node in enumerate(nodes):
        payload[f"node.{i}.row_mask"] = R.flag_bytes(node.row_mask)
        payload[f"node.{i}.missing"] = R.flag_bytes(node.missing)
        if node.lengths is not None:
            payload[f"node.{i}.lengths"] = R.json_bytes(node.lengths)
        node_specs.append({"path": node.path, "node_type": node.node_type,
                           "children": list(node.children)})
    for i, leaf in enumerate(leaves):
        encoded = _encode_leaf(leaf.path, leaf.values, leaf.decision)
        payload.update({f"leaf.{i}.{part}": data for part, data in encoded.payload.items()})
        payload[f"leaf.{i}.missing"] = R.flag_bytes(v is MISSING for v in leaf.values)
        leaf_specs.append({"path": leaf.path, "codec": encoded.codec,
                           "metadata": encoded.metadata, "parts": sorted(encoded.payload)})
    return R.Encoded(RECURSIVE_CODEC, len(values), payload,
                     {"schema_source": "inferred", "root_path": path, "nodes": node_specs,
                      "leaves": leaf_specs})


# ---------------------------------------------------------------- decoding a field


def decode_field(encoded, payload):
    """The rows of an encoded field entry ({"codec", "rows", "metadata"}) from its
    payloads {part: bytes}."""
    codec, rows = encoded["codec"], int(encoded["rows"])
    metadata = encoded.get("metadata") or {}
    if codec != RECURSIVE_CODEC:
        return R.decode(codec, rows, metadata, payload)
    try:
        leaves, nodes = _read_structure(rows, metadata, payload)
        root = metadata["root_path"]
        return [_rebuild(root, row, leaves, nodes) for row in range(rows)]
    except (KeyError, IndexError, TypeError) as e:
        raise ValueError(f"malformed structured_recursive field ({type(e).__name__}: "
                         f"{e})") from None


def _read_structure(rows, metadata, payload):
    """({leaf path: values with MISSING}, {node path: (type, children, row_mask,
    missing, lengths)})."""
    leaves = {}
    for i, leaf in enumerate(metadata["leaves"]):
        parts = {part: payload[f"leaf.{i}.{part}"] for part in leaf["parts"]}
        values = R.decode(leaf["codec"], rows, leaf.get("metadata"), parts)
        missing = R.read_flags(payload[f"leaf.{i}.missing"], rows, f"leaf {i} missing")
        leaves[leaf["path"]] = [MISSING if m else v for m, v in zip(missing, values)]
    nodes = {}
    for i, node in enumerate(metadata["nodes"]):
        lengths = payload.get(f"node.{i}.lengths")
        nodes[node["path"]] = (
            node["node_type"], node["children"],
            R.read_flags(payload[f"node.{i}.row_mask"], rows, f"node {i} row_mask"),
            R.read_flags(payload[f"node.{i}.missing"], rows, f"node {i} missing"),
            None if lengths is None else json.loads(bytes(lengths)))
    return leaves, nodes


def _rebuild(path, row, leaves, nodes):
    """The value at ``path`` of one row (MISSING where the row lacks it)."""
    if path in leaves:
        return leaves[path][row]
    node_type, children, row_mask, missing, lengths = nodes[path]
    if missing[row]:
        return MISSING
    if not row_mask[row]:
        return None
    if node_type == "dict":
        out = {}
        for key in children:
            value = _rebuild(f"{path}.{escape_key(key)}", row, leaves, nodes)
            if value is not MISSING:
                out[key] = value
        return out
    out = [None] * int(lengths[row])
    for i in children:
        if i < len(out):
            value = _rebuild(f"{path}[{i}]", row, leaves, nodes)
            if value is not MISSING:
                out[i] = value
    return out


__all__ = ["MISSING", "CodecDecision", "InferredLeaf", "InferredNode", "choose_leaf_codec",
           "escape_key", "infer_structure", "encode_field", "decode_field"]
