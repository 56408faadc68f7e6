"""The codecs of DataProto non-tensor fields: how one column of rows (any row may be
None) becomes named payloads plus JSON-safe metadata, and back.

  codec               rows                                    payloads
  ndarray             numeric scalars                         data (typed), nulls
  typed_ragged        numeric arrays or lists, any shapes     data, index
  ragged_tensor       torch tensors of one dtype, any shapes  data, index
  ragged_tensor_dict  {key: tensor} mappings                  null_mask, <key>.data,
                                                              <key>.index
  bytes_ragged        bytes-like values                       data, index
  media_bytes         bytes-like values or PIL images         data, index
  media_list_ragged   lists of bytes-like values/PIL images   data, index
  utf8_ragged         str                                     data, index
  json_ragged         JSON-safe values                        data, index
  msgpack_ragged      msgpack-safe values (msgpack package)   data, index

"data" holds the rows' bytes back to back; "index" is JSON: {"offsets": byte offsets
(one more than the pieces), "nulls": the None rows, plus per-codec lists such as
"shapes"}; flag payloads ("nulls", "null_mask") hold one byte (0 or 1) per row. numpy
scalars and arrays inside JSON/msgpack rows are stored as plain numbers and lists.

numpy, torch, msgpack and Pillow are imported only when a column needs them.
"""

import json
import sys
from collections.abc import Mapping
from dataclasses import dataclass, field

from ._structured_codecs import (
    element_size,
    is_ndarray,
    is_tensor,
    numel,
    numpy,
    tensor_bytes,
    tensor_from_buffer,
    torch_dtype,
    torch_module,
)

_DEFAULT_TYPED_DTYPE = "int64"
_DEFAULT_TENSOR_DTYPE = "torch.float32"
_NUMERIC_KINDS = "biufc"


@dataclass
class Encoded:
    """A non-tensor field as payloads: ``payload`` {name: bytes-like} plus JSON-safe
    ``metadata``."""

    codec: str
    rows: int
    payload: dict
    metadata: dict = field(default_factory=dict)


def encode(codec, values, hints=None):
    """The Encoded form of ``values`` under ``codec``; ``hints`` (a FieldSchema's or an
    inference decision's metadata) may name a numeric "dtype" or the "keys" of
    ragged_tensor_dict rows. TypeError/ValueError when a row does not fit."""
    encoder = _ENCODERS.get(codec)
    if encoder is None:
        raise ValueError(f"unsupported codec {codec!r} (supported: {', '.join(CODECS)})")
    values = list(values)
    payload, metadata = encoder(values, hints or {})
    return Encoded(codec, len(values), payload, metadata)


def decode(codec, rows, metadata, payload):
    """The ``rows`` values of a column from its payloads {name: bytes-like}."""
    decoder = _DECODERS.get(codec)
    if decoder is None:
        raise ValueError(f"unknown non-tensor codec {codec!r}")
    try:
        return decoder(rows, metadata or {}, payload)
    except (KeyError, IndexError, TypeError) as e:  # stored data that does not fit
        raise ValueError(f"malformed {codec} field ({type(e).__name__}: {e})") from None


# ---------------------------------------------------------------- shared pieces


def is_bytes_like(value):
    return isinstance(value, (bytes, bytearray, memoryview))


def is_pil_image(value):
    return type(value).__module__.startswith("PIL.") and hasattr(value, "tobytes")


def flag_bytes(flags):
    return bytes(1 if f else 0 for f in flags)


def read_flags(payload, rows, what):
    flags = bytes(payload)
    if len(flags) != rows:
        raise ValueError(f"{what} has {len(flags)} flags, expected {rows}")
    return [f != 0 for f in flags]


def json_bytes(value):
    return json.dumps(value, separators=(",", ":")).encode()


def _pack(pieces, **index):
    """Payloads {"data", "index"} of row pieces (bytes-like, or None for a None row)."""
    offsets, nulls, data = [0], [], bytearray()
    for row, piece in enumerate(pieces):
        if piece is None:
            nulls.append(row)
        else:
            data += piece
        offsets.append(len(data))
    return {"data": data, "index": json_bytes({"offsets": offsets, "nulls": nulls, **index})}


def _unpack(payload, count, codec):
    """(data, spans, index) of payloads from _pack: ``spans`` holds each piece's
    (start, end) in ``data`` (a bytearray rows may share), None for a None row."""
    try:
        index = json.loads(bytes(payload["index"]))
        offsets, nulls = index["offsets"], set(index["nulls"])
    except (ValueError, TypeError):
        raise ValueError(f"{codec} field has a malformed index") from None
    data = bytearray(payload["data"])
    if len(offsets) != count + 1:
        raise ValueError(f"{codec} index describes {len(offsets) - 1} rows, expected "
                         f"{count}")
    if offsets[-1] != len(data):
        raise ValueError(f"{codec} index describes {offsets[-1]} bytes, the data has "
                         f"{len(data)}")
    spans = [None if i in nulls else (offsets[i], offsets[i + 1]) for i in range(count)]
    return data, spans, index


def _plain(value):
    """A JSON/msgpack ``default`` hook: numpy scalars and arrays as plain values."""
    np = sys.modules.get("numpy")
    if np is not None and isinstance(value, (np.ndarray, np.generic)):
        return value.tolist()
    raise TypeError(f"{type(value).__name__} is not serializable")


def _dtype_hint(hints):
    """The numeric numpy dtype ``hints`` name, or None."""
    name = hints.get("dtype")
    if name is None:
        return None
    np = numpy()
    try:
        dtype = np.dtype(name)
    except TypeError:
        raise ValueError(f"invalid dtype {name!r}") from None
    if dtype.kind not in _NUMERIC_KINDS:
        raise ValueError(f"dtype must be numeric or bool, got {dtype}")
    return dtype


def _cast(array, dtype, codec):
    np = numpy()
    if array.size == 0:
        return np.empty(array.shape, dtype)
    if not np.can_cast(array.dtype, dtype, "same_kind"):
        raise TypeError(f"{codec} cannot store {array.dtype} values as {dtype}")
    return np.ascontiguousarray(array.astype(dtype, copy=False))


# ---------------------------------------------------------------- ndarray (scalars)


def _encode_scalars(values, hints):
    np = numpy()
    present = np.asarray([v for v in values if v is not None])
    if present.ndim != 1 or present.dtype.kind not in _NUMERIC_KINDS:
        raise TypeError("ndarray field rows must be numeric scalars")
    dtype = _dtype_hint(hints) or (present.dtype if present.size else np.dtype("int64"))
    present = _cast(present, dtype, "ndarray")
    data = np.zeros(len(values), dtype)
    data[[i for i, v in enumerate(values) if v is not None]] = present
    return ({"data": data.tobytes(), "nulls": flag_bytes(v is None for v in values)},
            {"dtype": dtype.str})


def _decode_scalars(rows, metadata, payload):
    np = numpy()
    data = np.frombuffer(bytes(payload["data"]), dtype=np.dtype(metadata["dtype"]))
    nulls = read_flags(payload["nulls"], rows, "ndarray nulls")
    if len(data) != rows:
        raise ValueError(f"ndarray field has {len(data)} values, expected {rows}")
    return [None if null else value for null, value in zip(nulls, data.tolist())]


# ---------------------------------------------------------------- typed_ragged


def _numeric_array(value):
    array = numpy().asarray(value)
    if array.dtype.kind not in _NUMERIC_KINDS:
        raise TypeError(f"typed_ragged rows must be numeric, got dtype {array.dtype}")
    return array


def common_numeric_dtype(values, arrays):
    """The dtype all ``arrays`` (of ``values``) promote to; an empty list row does not
    vote (numpy calls it float64). None when nothing votes."""
    np = numpy()
    dtype = None
    for value, array in zip(values, arrays):
        if array is None or (array.size == 0 and not is_ndarray(value)):
            continue
        dtype = array.dtype if dtype is None else np.promote_types(dtype, array.dtype)
    return dtype


def _encode_typed_ragged(values, hints):
    np = numpy()
    arrays = [None if v is None else _numeric_array(v) for v in values]
    dtype = _dtype_hint(hints) or common_numeric_dtype(values, arrays) or \
        np.dtype(_DEFAULT_TYPED_DTYPE)
    pieces = [None if a is None else _cast(a, dtype, "typed_ragged").tobytes()
              for a in arrays]
    shapes = [None if a is None else list(a.shape) for a in arrays]
    is_array = [is_ndarray(v) for v in values]
    kinds = [flag for flag, v in zip(is_array, values) if v is not None]
    metadata = {"dtype": dtype.str,
                "row_format": "ndarray" if all(kinds) else "list" if not any(kinds)
                else "mixed"}
    if metadata["row_format"] == "mixed":
        metadata["ndarray_rows"] = is_array
    return _pack(pieces, shapes=shapes), metadata


def _decode_typed_ragged(rows, metadata, payload):
    np = numpy()
    data, spans, index = _unpack(payload, rows, "typed_ragged")
    dtype = np.dtype(metadata["dtype"])
    flat = np.frombuffer(data, dtype=dtype)  # writable: rows are views of one copy
    row_format = metadata.get("row_format", "ndarray")
    as_array = metadata.get("ndarray_rows") or [row_format == "ndarray"] * rows
    out = []
    for span, shape, keep_array in zip(spans, index["shapes"], as_array):
        if span is None:
            out.append(None)
            continue
        array = flat[span[0] // dtype.itemsize:span[1] // dtype.itemsize].reshape(shape)
        out.append(array if keep_array else array.tolist())
    return out


# ---------------------------------------------------------------- ragged_tensor


def _row_tensor(value):
    torch = torch_module()
    if is_ndarray(value):
        if value.dtype.kind not in _NUMERIC_KINDS:
            raise TypeError(f"ragged_tensor rows must be numeric, got dtype {value.dtype}")
        return torch.from_numpy(numpy().array(value, copy=True))
    if not is_tensor(value):
        raise TypeError(f"ragged_tensor rows must be torch tensors, got "
                        f"{type(value).__name__}")
    return value.detach().cpu().contiguous()


def _encode_ragged_tensor(values, hints):
    tensors = [None if v is None else _row_tensor(v) for v in values]
    dtypes = sorted({str(t.dtype) for t in tensors if t is not None})
    if len(dtypes) > 1:
        raise ValueError(f"mixed tensor dtype: {dtypes}")
    pieces = [None if t is None else tensor_bytes(t) for t in tensors]
    shapes = [None if t is None else list(t.shape) for t in tensors]
    return (_pack(pieces, shapes=shapes),
            {"dtype": dtypes[0] if dtypes else _DEFAULT_TENSOR_DTYPE})


def _decode_ragged_tensor(rows, metadata, payload):
    data, spans, index = _unpack(payload, rows, "ragged_tensor")
    dtype = torch_dtype(metadata.get("dtype", _DEFAULT_TENSOR_DTYPE))
    out = []
    for span, shape in zip(spans, index["shapes"]):
        if span is not None and (span[1] - span[0]) != numel(shape) * element_size(dtype):
            raise ValueError(f"ragged_tensor row of shape {shape} has "
                             f"{span[1] - span[0]} bytes")
        out.append(None if span is None else tensor_from_buffer(data, span[0], dtype, shape))
    return out


# ---------------------------------------------------------------- ragged_tensor_dict


def _dict_keys(keys):
    """``keys`` (a mapping's keys or an iterable) checked: non-empty str without '.',
    '/' or '\\' (they name payloads), no repeats."""
    out = []
    for key in keys.keys() if isinstance(keys, Mapping) else keys:
        if not isinstance(key, str):
            raise TypeError("ragged_tensor_dict keys must be strings")
        if not key:
            raise ValueError("ragged_tensor_dict keys must not be empty")
        if any(c in key for c in "./\\"):
            raise ValueError(f"ragged_tensor_dict keys must not contain '.', '/', or '\\' "
                             f"(got {key!r})")
        if key in out:
            raise ValueError(f"ragged_tensor_dict keys contain duplicate key {key!r}")
        out.append(key)
    return out


def _encode_tensor_dicts(values, hints):
    declared = None if hints.get("keys") is None else _dict_keys(hints["keys"])
    seen = set()
    for row, item in enumerate(values):
        if item is None:
            continue
        if not isinstance(item, Mapping):
            raise TypeError(f"ragged_tensor_dict rows must be mappings or None; row {row} "
                            f"is {type(item).__name__}")
        explicit_none = sorted(str(k) for k, v in item.items() if v is None)
        if explicit_none:
            raise TypeError(f"ragged_tensor_dict rows cannot contain explicit None tensor "
                            f"values; row {row} has explicit None for {explicit_none}")
        keys = _dict_keys(item)
        undeclared = [] if declared is None else sorted(set(keys) - set(declared))
        if undeclared:
            raise ValueError(f"ragged_tensor_dict row {row} has keys not declared in "
                             f"FieldSchema metadata['keys']: {undeclared}")
        seen.update(keys)
    keys = declared if declared is not None else sorted(seen)
    payload, key_codecs = {"null_mask": flag_bytes(v is None for v in values)}, {}
    for key in keys:
        column = [None if v is None else v.get(key) for v in values]
        try:
            parts, key_codecs[key] = _encode_ragged_tensor(column, {})
        except (TypeError, ValueError) as e:
            raise ValueError(f"failed to encode ragged_tensor_dict key {key!r}: {e}") from e
        payload.update({f"{key}.{name}": part for name, part in parts.items()})
    return payload, {"keys": keys, "key_codecs": key_codecs}


def _decode_tensor_dicts(rows, metadata, payload):
    nulls = read_flags(payload["null_mask"], rows, "ragged_tensor_dict null_mask")
    columns = {}
    for key in metadata.get("keys", []):
        parts = {name: payload[f"{key}.{name}"] for name in ("data", "index")}
        columns[key] = _decode_ragged_tensor(rows, metadata["key_codecs"][key], parts)
    return [None if null else {k: c[row] for k, c in columns.items() if c[row] is not None}
            for row, null in enumerate(nulls)]


# ---------------------------------------------------------------- bytes and media


def _media_piece(value):
    """(bytes, encoding) of a bytes-like value or a PIL image (its raw pixels)."""
    if is_bytes_like(value):
        return value, {"kind": "bytes"}
    if is_pil_image(value):
        return value.tobytes(), {"kind": "pil_raw", "mode": value.mode,
                                 "size": list(value.size),
                                 "format": getattr(value, "format", None)}
    raise TypeError(f"media rows must be bytes-like or PIL images, got "
                    f"{type(value).__name__}")


def _media_metadata(encodings):
    if not any(e and e["kind"] == "pil_raw" for e in encodings):
        return {}
    return {"media_encodings": encodings}


def _decode_media(piece, encoding):
    if not encoding or encoding.get("kind") != "pil_raw":
        return bytes(piece)
    try:
        from PIL import Image
    except ImportError:
        raise ImportError("this field holds PIL images: reading it needs Pillow "
                          "(pip install pillow)") from None
    image = Image.frombytes(encoding["mode"], tuple(encoding["size"]), bytes(piece))
    image.format = encoding.get("format")
    return image


def _encode_media(values, hints):
    pieces = [None if v is None else _media_piece(v) for v in values]
    return (_pack([None if p is None else p[0] for p in pieces]),
            _media_metadata([None if p is None else p[1] for p in pieces]))


def _decode_media_rows(rows, metadata, payload):
    data, spans, _ = _unpack(payload, rows, "bytes")
    encodings = metadata.get("media_encodings") or [None] * rows
    return [None if span is None else _decode_media(data[span[0]:span[1]], encoding)
            for span, encoding in zip(spans, encodings)]


def _encode_media_lists(values, hints):
    pieces, row_items, nulls = [], [0], []
    for row, value in enumerate(values):
        if value is None:
            nulls.append(row)
        elif not isinstance(value, (list, tuple)):
            raise TypeError(f"media_list_ragged rows must be lists, got "
                            f"{type(value).__name__}")
        else:
            pieces += [_media_piece(item) for item in value]
        row_items.append(len(pieces))
    payload = _pack([p[0] for p in pieces], row_items=row_items, row_nulls=nulls)
    return payload, _media_metadata([p[1] for p in pieces])


def _decode_media_lists(rows, metadata, payload):
    try:
        index = json.loads(bytes(payload["index"]))
        row_items, nulls = index["row_items"], set(index["row_nulls"])
    except (ValueError, TypeError):
        raise ValueError("media_list_ragged field has a malformed index") from None
    if len(row_items) != rows + 1:
        raise ValueError(f"media_list_ragged index has {len(row_items) - 1} rows, "
                         f"expected {rows}")
    items = _decode_media_rows(row_items[-1], metadata, payload)
    return [None if row in nulls else items[row_items[row]:row_items[row + 1]]
            for row in range(rows)]


# ---------------------------------------------------------------- text, JSON, msgpack


def _encode_utf8(values, hints):
    for v in values:
        if v is not None and not isinstance(v, str):
            raise TypeError(f"utf8_ragged rows must be str, got {type(v).__name__}")
    return _pack([None if v is None else v.encode("utf-8") for v in values]), {}


def _decode_utf8(rows, metadata, payload):
    data, spans, _ = _unpack(payload, rows, "utf8_ragged")
    return [None if s is None else data[s[0]:s[1]].decode("utf-8") for s in spans]


def _encode_json(values, hints):
    return _pack([None if v is None else
                  json.dumps(v, ensure_ascii=False, separators=(",", ":"),
                             default=_plain).encode("utf-8")
                  for v in values]), {}


def _decode_json(rows, metadata, payload):
    data, spans, _ = _unpack(payload, rows, "json_ragged")
    return [None if s is None else json.loads(bytes(data[s[0]:s[1]])) for s in spans]


def msgpack_available():
    try:
        import msgpack  # noqa: F401
    except ImportError:
        return False
    return True


def _msgpack():
    try:
        import msgpack
    except ImportError:
        raise ImportError("the msgpack_ragged codec needs the msgpack package "
                          "(pip install msgpack)") from None
    return msgpack


def _encode_msgpack(values, hints):
    packer = _msgpack().Packer(use_bin_type=True, default=_plain)
    return _pack([None if v is None else packer.pack(v) for v in values]), {}


def _decode_msgpack(rows, metadata, payload):
    msgpack = _msgpack()
    data, spans, _ = _unpack(payload, rows, "msgpack_ragged")
    return [None if s is None else
            msgpack.unpackb(bytes(data[s[0]:s[1]]), raw=False, strict_map_key=False)
            for s in spans]


_ENCODERS = {
    "ndarray": _encode_scalars,
    "typed_ragged": _encode_typed_ragged,
    "ragged_tensor": _encode_ragged_tensor,
    "ragged_tensor_dict": _encode_tensor_dicts,
    "bytes_ragged": _encode_media,
    "media_bytes": _encode_media,
    "media_list_ragged": _encode_media_lists,
    "utf8_ragged": _encode_utf8,
    "json_ragged": _encode_json,
    "msgpack_ragged": _encode_msgpack,
}
_DECODERS = {
    "ndarray": _decode_scalars,
    "typed_ragged": _decode_typed_ragged,
    "ragged_tensor": _decode_ragged_tensor,
    "ragged_tensor_dict": _decode_tensor_dicts,
    "bytes_ragged": _decode_media_rows,
    "media_bytes": _decode_media_rows,
    "media_list_ragged": _decode_media_lists,
    "utf8_ragged": _decode_utf8,
    "json_ragged": _decode_json,
    "msgpack_ragged": _decode_msgpack,
}
CODECS = tuple(_ENCODERS)
