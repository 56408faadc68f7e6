"""The codecs of DataProto non-tensor fields: one column of rows (any row may be None)
as named payloads plus JSON-safe metadata, and back -- upstream's layouts, so fields
written by either side read on the other. Each payload becomes a member
``non_tensor_batch.<field>.<payload>`` of the stage object (arrays as ndarray members).

  codec               payloads (int64 offsets, bool flags per row)     metadata
  ndarray             data (numeric, one per row), nulls               dtype, shape
  typed_ragged        data (flat), offsets (elements), shapes (rows x   dtype, max_ndim,
                      max ndim, int64), ndims (int16), nulls            shape_policy, row_format,
                                                                        ndarray_rows
                                                                        [, physical_layout]
  ragged_tensor       typed_ragged's payloads                          + dtype "torch.<name>"
  ragged_tensor_dict  null_mask, <key>.<ragged_tensor payload>          keys, key_codecs
  bytes_ragged,       data (bytes back to back), offsets (bytes),       media_encodings /
  media_bytes         nulls                                             media_types for images
  utf8_ragged, json_ragged, msgpack_ragged  as bytes_ragged, rows as UTF-8 / JSON /
                      MessagePack
  media_list_ragged   data, row_offsets (items), byte_offsets, nulls   media_encodings

Numeric rows come back as ndarrays when they went in as ndarrays ("row_format"), as
lists otherwise; "contiguous_flat" ndarray rows come back as views of one array. PIL
images are stored as raw pixels and come back as images when Pillow is installed.
"""

import json
import sys
from dataclasses import dataclass, field

from . import _structured_msgpack as msgpack
from ._structured_payloads import (
    DirectCopyPayload,
    MultiBufferPayload,
    OwnerBackedList,
    facade,
    is_tensor,
    numpy,
    torch_module,
)

TYPED_RAGGED_DEFAULT_DTYPE = "int64"
RAGGED_TENSOR_DEFAULT_DTYPE = "torch.float32"
RAGGED_TENSOR_PAYLOADS = frozenset({"data", "offsets", "shapes", "ndims", "nulls"})
# What a codec may raise on rows it cannot carry.
ENCODING_ERRORS = (TypeError, ValueError, OverflowError, RuntimeError, RecursionError)


@dataclass
class EncodedLeaf:
    codec: str
    rows: int
    payload: dict
    metadata: dict = field(default_factory=dict)


def is_bytes_like(value):
    return isinstance(value, (bytes, bytearray, memoryview))


def is_pil_image(value):
    module = getattr(type(value), "__module__", None) or ""
    return module.startswith("PIL.") and hasattr(value, "save")


# ---------------------------------------------------------------- torch dtypes


def parse_torch_dtype(name):
    torch = torch_module()
    dtype = getattr(torch, str(name).replace("torch.", "", 1), None)
    if not isinstance(dtype, torch.dtype):
        raise ValueError(f"unknown torch dtype: {name}")
    return dtype


def torch_dtype_to_numpy(name):
    """The numpy dtype holding a torch dtype's values exactly (none for bfloat16)."""
    torch = torch_module()
    dtype = parse_torch_dtype(name)
    if dtype == torch.bfloat16:
        raise ValueError("torch.bfloat16 has no value-preserving numpy dtype")
    return torch.empty(0, dtype=dtype).numpy().dtype


# ---------------------------------------------------------------- typed_ragged


def _contiguous(value, dtype):
    np = numpy()
    if isinstance(value, np.ndarray) and value.dtype == dtype and value.flags.c_contiguous:
        return value
    return np.ascontiguousarray(np.asarray(value, dtype=dtype))


def _flat_data(flat_arrays, dtype, total):
    """The data payload of flat row arrays: copied by the fast-copy hook at put time
    when there is one, else written as byte views."""
    np = numpy()
    if facade("_concat_arrays_into") is not None:
        return DirectCopyPayload.from_flat_arrays(flat_arrays, dtype, total)
    return MultiBufferPayload(tuple(memoryview(a.data).cast("B") for a in flat_arrays),
                              tuple(flat_arrays), np.dtype(dtype).str, (total,))


def _empty_data(dtype):
    np = numpy()
    empty = np.empty(0, dtype=dtype)
    return MultiBufferPayload((memoryview(empty.data).cast("B"),), (empty,),
                              np.dtype(dtype).str, (0,))


def _ndarray_layout(dtype, max_ndim):
    return {"dtype": str(dtype), "max_ndim": int(max_ndim), "shape_policy": "ragged",
            "row_format": "ndarray", "ndarray_rows": None,
            "physical_layout": "contiguous_flat"}


def encode_typed_ragged(values, dtype_hint=None):
    """(payload, metadata) of numeric rows (arrays or nested lists of any shape)."""
    np = numpy()
    if dtype_hint is None:
        arrays = [np.asarray(v) for v in values if v is not None]
        dtype = np.result_type(*arrays) if arrays else np.dtype(TYPED_RAGGED_DEFAULT_DTYPE)
    else:
        dtype = np.dtype(dtype_hint)
    if dtype.hasobject:
        raise ValueError("typed_ragged codec requires non-object dtype")
    encoded = _encode_ndarray_rows(values, dtype)
    if encoded is not None:
        return encoded
    arrays = [np.asarray([], dtype=dtype) if v is None else _contiguous(v, dtype)
              for v in values]
    max_ndim = max((a.ndim for a in arrays), default=0)
    offsets = np.zeros(len(arrays) + 1, dtype=np.int64)
    ndims = np.zeros(len(arrays), dtype=np.int16)
    shapes = np.zeros((len(arrays), max(max_ndim, 1)), dtype=np.int64)
    flats = []
    for row, array in enumerate(arrays):
        flats.append(array.reshape(-1))
        offsets[row + 1] = offsets[row] + array.size
        ndims[row] = array.ndim
        if array.ndim:
            shapes[row, :array.ndim] = array.shape
    data = _flat_data(flats, dtype, int(offsets[-1])) if flats else _empty_data(dtype)
    is_array = [v is not None and isinstance(v, np.ndarray) for v in values]
    if all(v is None or a for v, a in zip(values, is_array)):
        row_format = "ndarray"
    elif any(is_array):
        row_format = "mixed"
    else:
        row_format = "list"
    return ({"data": data, "offsets": offsets, "shapes": shapes, "ndims": ndims,
             "nulls": np.asarray([v is None for v in values], dtype=np.bool_)},
            {"dtype": str(dtype), "max_ndim": int(max_ndim), "shape_policy": "ragged",
             "row_format": row_format,
             "ndarray_rows": is_array if row_format == "mixed" else None})


def encode_typed_ragged_regular_rows(values, dtype):
    """The contiguous_flat encoding of two or more C-contiguous ndarray rows of one
    shape and ``dtype`` (no None), or None when the rows are not that."""
    np = numpy()
    if len(values) < 2:
        return None
    first = values[0]
    for value in values:
        if not isinstance(value, np.ndarray) or value.dtype != dtype or \
                not value.flags.c_contiguous or value.shape != first.shape:
            return None
    rows, width = len(values), int(first.size)
    if width:
        data = _flat_data([v.reshape(-1) for v in values], dtype, rows * width)
    else:
        data = np.asarray(values, dtype=dtype).reshape(-1)
    if first.ndim == 0:
        shapes, ndims = np.zeros((rows, 1), dtype=np.int64), np.zeros(rows, dtype=np.int16)
    else:
        shapes = np.empty((rows, first.ndim), dtype=np.int64)
        shapes[:] = first.shape
        ndims = np.full(rows, first.ndim, dtype=np.int16)
    return ({"data": data, "offsets": np.arange(rows + 1, dtype=np.int64) * width,
             "shapes": shapes, "ndims": ndims, "nulls": np.zeros(rows, dtype=np.bool_)},
            _ndarray_layout(dtype, first.ndim))


def _encode_ndarray_rows(values, dtype):
    """contiguous_flat payloads of rows that are all ndarrays or None; None when some
    row is something else. Rows sharing a trailing shape record it as the row shape's
    tail (max_ndim = their ndim)."""
    np = numpy()
    regular = encode_typed_ragged_regular_rows(values, dtype)
    if regular is not None or not values:
        return regular
    if not all(v is None or isinstance(v, np.ndarray) for v in values):
        return None
    nulls = np.asarray([v is None for v in values], dtype=np.bool_)
    arrays = [_contiguous(v, dtype) for v in values if v is not None]
    lengths = np.zeros(len(values), dtype=np.int64)
    lengths[~nulls] = [a.size for a in arrays]
    scalars = [a for a in arrays if a.ndim == 0]
    shaped = [a for a in arrays if a.ndim > 0]
    tail = shaped[0].shape[1:] if shaped else None
    same_tail = not scalars and bool(shaped) and all(
        a.ndim == shaped[0].ndim and a.shape[1:] == tail for a in shaped) and \
        not any(d == 0 for d in tail)
    offsets = np.zeros(len(values) + 1, dtype=np.int64)
    np.cumsum(lengths, out=offsets[1:])
    total = int(offsets[-1])
    if len(arrays) == 1:
        flat = arrays[0].reshape(-1)
        data = MultiBufferPayload((memoryview(flat.data).cast("B"),), (flat,),
                                  np.dtype(dtype).str, (total,))
    elif total:
        data = _flat_data([a.reshape(-1) for a in arrays], dtype, total)
    else:
        data = _empty_data(dtype)
    ndims = np.zeros(len(values), dtype=np.int16)
    if not shaped:
        max_ndim, shapes = 0, np.zeros((len(values), 1), dtype=np.int64)
    elif same_tail:
        max_ndim = shaped[0].ndim
        shapes = np.zeros((len(values), max_ndim), dtype=np.int64)
        width = 1
        for d in tail:
            width *= d
        shapes[:, 0] = lengths // width
        if max_ndim > 1:
            shapes[:, 1:] = tail
        ndims[~nulls] = max_ndim
    else:
        max_ndim = max(a.ndim for a in arrays)
        shapes = np.zeros((len(values), max(max_ndim, 1)), dtype=np.int64)
        present = iter(arrays)
        for row in np.flatnonzero(~nulls):
            array = next(present)
            ndims[row] = array.ndim
            if array.ndim:
                shapes[row, :array.ndim] = array.shape
    return ({"data": data, "offsets": offsets, "shapes": shapes, "ndims": ndims,
             "nulls": nulls}, _ndarray_layout(dtype, max_ndim))


def _as_typed(raw, dtype):
    np = numpy()
    if is_tensor(raw):
        return raw.numpy()
    if isinstance(raw, np.ndarray):
        return raw if raw.dtype == dtype else np.frombuffer(raw, dtype=dtype)
    if isinstance(raw, (bytes, bytearray, memoryview)):
        return np.frombuffer(raw, dtype=dtype)
    return np.asarray(raw, dtype=dtype)


def decode_typed_ragged(payload, rows, metadata=None):
    np = numpy()
    metadata = metadata or {}
    data = _as_typed(payload["data"], np.dtype(metadata.get("dtype",
                                                              TYPED_RAGGED_DEFAULT_DTYPE)))
    offsets, shapes = payload["offsets"], payload["shapes"]
    ndims, nulls = payload["ndims"], payload["nulls"]
    row_format = metadata.get("row_format")
    if row_format == "ndarray" and metadata.get("physical_layout") == "contiguous_flat":
        values = _decode_flat_views(data, offsets, shapes, ndims, nulls, rows, metadata)
        if values is not None:
            return values
    marks = metadata.get("ndarray_rows") or []
    values = []
    for row in range(rows):
        if bool(nulls[row]):
            values.append(None)
            continue
        shape = tuple(int(v) for v in shapes[row, :int(ndims[row])].tolist())
        array = data[int(offsets[row]):int(offsets[row + 1])].reshape(shape)
        as_array = row_format == "ndarray" or (row_format == "mixed" and bool(marks[row]))
        values.append(array if as_array else array.tolist())
    return values


def _regular_width(offsets, rows):
    """The common row width when ``offsets`` step evenly from 0, else None."""
    np = numpy()
    if rows <= 0 or int(offsets[0]) != 0 or int(offsets[-1]) % rows:
        return None
    width = int(offsets[-1]) // rows
    return width if bool(np.all(np.diff(offsets) == width)) else None


def _decode_flat_views(data, offsets, shapes, ndims, nulls, rows, metadata):
    """Rows as views of ``data`` when every non-null row is 1-D, or shares one trailing
    shape; None otherwise (the caller decodes row by row)."""
    np = numpy()
    max_ndim = int(metadata.get("max_ndim", 0))
    owner = getattr(data, "_mooncake_pool_owner", None)
    source = data.view(np.ndarray) if isinstance(data, np.ndarray) else data

    def owned(values):
        return values if owner is None else OwnerBackedList(values, owner)

    if max_ndim == 1:
        tail, starts = (), offsets
    else:
        if max_ndim < 1 or rows == 0:
            return None
        present = np.flatnonzero(~np.asarray(nulls, dtype=bool))
        if present.size == 0:
            return [None] * rows
        tail = tuple(int(v) for v in shapes[int(present[0]), 1:max_ndim])
        if any(d == 0 for d in tail):
            return None
        for row in present:
            if int(ndims[row]) != max_ndim or \
                    tuple(int(v) for v in shapes[int(row), 1:max_ndim]) != tail:
                return None
        width = 1
        for d in tail:
            width *= d
        if int(offsets[-1]) % width:
            return None
        source = source.reshape((-1, *tail))
        starts = offsets // width
    if not bool(np.asarray(nulls).any()):
        width = _regular_width(starts, rows)
        if width is not None:
            return owned(list(source.reshape((rows, width, *tail))))
    return owned([None if bool(nulls[r]) else source[int(starts[r]):int(starts[r + 1])]
                  for r in range(rows)])


# ---------------------------------------------------------------- ragged_tensor


def encode_ragged_tensor(values):
    """typed_ragged payloads of tensor rows of one dtype (not bfloat16)."""
    torch = torch_module()
    np = numpy()
    dtype, converted = None, []
    for value in values:
        if value is None:
            converted.append(None)
            continue
        if isinstance(value, np.ndarray):
            if value.dtype.hasobject:
                raise ValueError("ragged tensor codec requires numeric ndarray values")
            tensor = torch.as_tensor(value if value.flags.writeable else value.copy())
        elif is_tensor(value):
            tensor = value.detach()
        else:
            raise TypeError("ragged tensor codec rows must be tensors or numeric ndarrays, "
                            f"got {type(value).__name__}")
        if tensor.device.type != "cpu" or not tensor.is_contiguous():
            tensor = tensor.cpu().contiguous()
        if tensor.dtype == torch.bfloat16:
            raise ValueError("ragged tensor codec does not support torch.bfloat16")
        dtype = tensor.dtype if dtype is None else dtype
        if tensor.dtype != dtype:
            raise ValueError(f"mixed tensor dtype: {dtype} vs {tensor.dtype}")
        converted.append(tensor.numpy())
    dtype = dtype or parse_torch_dtype(RAGGED_TENSOR_DEFAULT_DTYPE)
    payload, metadata = encode_typed_ragged(converted, torch_dtype_to_numpy(str(dtype)))
    metadata["dtype"] = str(dtype)
    return payload, metadata


def decode_ragged_tensor(payload, rows, metadata=None):
    torch = torch_module()
    name = (metadata or {}).get("dtype", RAGGED_TENSOR_DEFAULT_DTYPE)
    arrays = decode_typed_ragged(payload, rows, {**(metadata or {}),
                                                 "dtype": str(torch_dtype_to_numpy(name))})
    dtype = parse_torch_dtype(name)
    np = numpy()
    return [None if v is None else
            torch.from_numpy(v).to(dtype) if isinstance(v, np.ndarray) else
            torch.as_tensor(v, dtype=dtype) for v in arrays]


# ---------------------------------------------------------------- ragged_tensor_dict


def normalize_dict_keys(keys):
    """ragged_tensor_dict keys as a checked list (a mapping gives its keys)."""
    out = []
    for key in (keys.keys() if hasattr(keys, "keys") else keys):
        if not isinstance(key, str):
            raise TypeError("ragged_tensor_dict keys must be strings")
        if not key:
            raise ValueError("ragged_tensor_dict keys must not be empty")
        if any(sep in key for sep in (".", "/", "\\")):
            raise ValueError("ragged_tensor_dict keys must not contain '.', '/', or '\\'")
        if key in out:
            raise ValueError(f"ragged_tensor_dict keys contain duplicate key {key!r}")
        out.append(key)
    return out


def dict_key_payloads(payload, key, kind="payload"):
    """The ragged_tensor payloads of one key of a ragged_tensor_dict."""
    prefix = f"{key}."
    items = {name[len(prefix):]: v for name, v in payload.items() if name.startswith(prefix)}
    missing = sorted(RAGGED_TENSOR_PAYLOADS - set(items))
    if missing:
        raise ValueError(f"ragged_tensor_dict {kind} for key {key!r} is missing payloads: "
                         f"{missing}")
    return items


def encode_ragged_tensor_dict(values, schema_metadata):
    """Rows of {key: tensor} (or None) as one ragged_tensor per key plus a null mask;
    the keys come from metadata["keys"] or the rows."""
    np = numpy()
    declared = schema_metadata.get("keys")
    keys = None if declared is None else normalize_dict_keys(declared)
    found = set()
    for row, item in enumerate(values):
        if item is None:
            continue
        if not hasattr(item, "keys") or not hasattr(item, "items"):
            raise TypeError("ragged_tensor_dict rows must be mappings or None; row "
                            f"{row} is {type(item).__name__}")
        nulls = sorted(k for k, v in item.items() if v is None)
        if nulls:
            raise TypeError("ragged_tensor_dict rows cannot contain explicit None tensor "
                            f"values; row {row} has explicit None for {nulls}")
        row_keys = normalize_dict_keys(item.keys())
        if keys is None:
            found.update(row_keys)
            continue
        extra = sorted(set(row_keys) - set(keys))
        if extra:
            raise ValueError("ragged_tensor_dict rows contain keys not declared in "
                             f"FieldSchema metadata['keys']; row {row} has keys not "
                             f"declared: {extra}")
    if keys is None:
        keys = normalize_dict_keys(sorted(found))
    if keys:
        torch_module()
    payload = {"null_mask": np.asarray([v is None for v in values], dtype=np.bool_)}
    key_codecs = {}
    for key in keys:
        try:
            sub, sub_meta = encode_ragged_tensor([None if v is None else v.get(key)
                                                  for v in values])
        except ENCODING_ERRORS as e:
            raise ValueError(f"failed to encode ragged_tensor_dict key {key!r}") from e
        payload.update({f"{key}.{name}": part for name, part in sub.items()})
        key_codecs[key] = sub_meta
    return EncodedLeaf("ragged_tensor_dict", len(values), payload,
                       {"keys": keys, "key_codecs": key_codecs})


def decode_ragged_tensor_dict(payload, rows, metadata):
    np = numpy()
    null_mask = payload["null_mask"]
    if isinstance(null_mask, (bytes, bytearray)):
        null_mask = np.frombuffer(null_mask, dtype=np.bool_)
    keys = metadata.get("keys", [])
    columns = {key: decode_ragged_tensor(dict_key_payloads(payload, key), rows,
                                         metadata.get("key_codecs", {}).get(key))
               for key in keys}
    out = []
    for row in range(rows):
        if bool(null_mask[row]):
            out.append(None)
        else:
            out.append({k: columns[k][row] for k in keys if columns[k][row] is not None})
    return out


# ---------------------------------------------------------------- numeric scalars


def encode_numeric_scalars(values, dtype):
    np = numpy()
    dtype = np.dtype(dtype)
    fill = False if dtype == np.bool_ else 0
    data = np.asarray([fill if v is None else v for v in values], dtype=dtype)
    return ({"data": data, "nulls": np.asarray([v is None for v in values], dtype=np.bool_)},
            {"dtype": str(data.dtype), "shape": list(data.shape)})


def decode_numeric_scalars(payload):
    np = numpy()
    data, nulls = payload["data"], np.asarray(payload["nulls"], dtype=bool)
    if not bool(nulls.any()):
        return data.tolist()
    values = data.astype(object)
    values[nulls] = None
    return values.tolist()


# ---------------------------------------------------------------- bytes-like rows


def _media_bytes(value):
    """(bytes, media type, encoding record) of a bytes-like value or PIL image."""
    if value is None:
        return b"", None, {"kind": "null"}
    if is_pil_image(value):
        image = value.convert(value.mode) if getattr(value, "readonly", False) else value
        return image.tobytes(), "image/raw", {
            "kind": "pil_raw", "mode": image.mode, "size": list(image.size),
            "format": getattr(value, "format", None)}
    return bytes(value), None, {"kind": "bytes"}


def _pieces(parts):
    return MultiBufferPayload(tuple(memoryview(p).cast("B") for p in parts if p), tuple(parts))


def encode_bytes_like(values):
    np = numpy()
    offsets, parts, types_, encodings = [0], [], set(), []
    for value in values:
        data, media_type, encoding = _media_bytes(value)
        parts.append(data)
        encodings.append(encoding)
        if media_type:
            types_.add(media_type)
        offsets.append(offsets[-1] + len(data))
    metadata = {}
    if any(e["kind"] == "pil_raw" for e in encodings):
        metadata["media_encodings"] = encodings
    if types_:
        metadata["media_types"] = sorted(types_)
        metadata["encode_source"] = "raw_pixels_from_object"
    return ({"data": _pieces(parts), "offsets": np.asarray(offsets, dtype=np.int64),
             "nulls": np.asarray([v is None for v in values], dtype=np.bool_)}, metadata)


def _decode_media(data, encoding):
    if not encoding or encoding.get("kind") != "pil_raw":
        return bytes(data)
    try:
        from PIL import Image
    except ImportError:
        return bytes(data)
    mode = encoding["mode"]
    image = Image.frombuffer(mode, tuple(encoding["size"]), bytes(data), "raw", mode, 0, 1)
    image.format = encoding.get("format")
    return image


def decode_bytes_like(payload, rows, metadata=None):
    view = memoryview(payload["data"]).cast("B")
    offsets, nulls = payload["offsets"], payload["nulls"]
    encodings = (metadata or {}).get("media_encodings", [])
    return [None if bool(nulls[r]) else
            _decode_media(view[int(offsets[r]):int(offsets[r + 1])],
                          encodings[r] if r < len(encodings) else None)
            for r in range(rows)]


def encode_media_lists(values):
    np = numpy()
    row_offsets, byte_offsets, parts, types_, encodings = [0], [0], [], set(), []
    for value in values:
        items = [] if value is None else list(value)
        for item in items:
            data, media_type, encoding = _media_bytes(item)
            parts.append(data)
            encodings.append(encoding)
            if media_type:
                types_.add(media_type)
            byte_offsets.append(byte_offsets[-1] + len(data))
        row_offsets.append(row_offsets[-1] + len(items))
    metadata = {"encode_source": "raw_pixels_from_object", "media_encodings": encodings}
    if types_:
        metadata["media_types"] = sorted(types_)
    return ({"data": b"".join(parts), "row_offsets": np.asarray(row_offsets, dtype=np.int64),
             "byte_offsets": np.asarray(byte_offsets, dtype=np.int64),
             "nulls": np.asarray([v is None for v in values], dtype=np.bool_)}, metadata)


def decode_media_lists(payload, rows, metadata=None):
    view = memoryview(payload["data"]).cast("B")
    rows_at, bytes_at = payload["row_offsets"], payload["byte_offsets"]
    nulls = payload["nulls"]
    encodings = (metadata or {}).get("media_encodings", [])
    out = []
    for r in range(rows):
        if bool(nulls[r]):
            out.append(None)
            continue
        out.append([_decode_media(view[int(bytes_at[i]):int(bytes_at[i + 1])],
                                  encodings[i] if i < len(encodings) else None)
                    for i in range(int(rows_at[r]), int(rows_at[r + 1]))])
    return out


# ---------------------------------------------------------------- msgpack rows


def encode_msgpack(path, values):
    np = numpy()
    offsets = np.zeros(len(values) + 1, dtype=np.int64)
    nulls = np.asarray([v is None for v in values], dtype=np.bool_)
    data = bytearray()
    try:
        for i, value in enumerate(values):
            if value is not None:
                data += msgpack.packb(value)
            offsets[i + 1] = len(data)
    except TypeError as e:
        raise ValueError(f"unsupported structured non-tensor field {path}: msgpack codec "
                         "cannot encode value") from e
    return {"data": data, "offsets": offsets, "nulls": nulls}, {}


def decode_msgpack(payload, rows):
    data, offsets, nulls = payload["data"], payload["offsets"], payload["nulls"]
    if len(offsets) != rows + 1:
        raise ValueError(f"msgpack_ragged offsets length {len(offsets)} does not match "
                         f"rows {rows}")
    if len(nulls) != rows:
        raise ValueError(f"msgpack_ragged nulls length {len(nulls)} does not match rows "
                         f"{rows}")
    packed = iter(msgpack.unpack_all(data))
    values = []
    for is_null in nulls:
        if bool(is_null):
            values.append(None)
            continue
        try:
            values.append(next(packed))
        except StopIteration:
            raise ValueError("msgpack_ragged data holds fewer rows than its nulls say") \
                from None
    if next(packed, _END) is not _END:
        raise ValueError("msgpack_ragged data holds more rows than its nulls say")
    return values


_END = object()


# ---------------------------------------------------------------- dispatch


def _json_bytes(value):
    return json.dumps(value, ensure_ascii=False, separators=(",", ":")).encode("utf-8")


def encode(codec, values, path="", metadata=None):
    """(payload, metadata) of ``values`` under a row codec (not ragged_tensor_dict);
    ``metadata`` may name the numeric "dtype" (typed_ragged, ndarray)."""
    metadata = metadata or {}
    if codec == "ragged_tensor":
        return encode_ragged_tensor(values)
    if codec == "typed_ragged":
        return encode_typed_ragged(values, metadata.get("dtype"))
    if codec == "ndarray":
        return encode_numeric_scalars(values, metadata["dtype"])
    if codec in ("bytes_ragged", "media_bytes"):
        return encode_bytes_like(values)
    if codec == "media_list_ragged":
        return encode_media_lists(values)
    if codec == "utf8_ragged":
        return encode_bytes_like([None if v is None else v.encode("utf-8") for v in values])
    if codec == "msgpack_ragged":
        return encode_msgpack(path, values)
    if codec == "json_ragged":
        return encode_bytes_like([None if v is None else _json_bytes(v) for v in values])
    raise ValueError(f"unsupported structured non-tensor codec: {codec}")


def decode(codec, payload, rows, metadata=None):
    """The ``rows`` values of a column from its payloads."""
    if codec == "ragged_tensor":
        return decode_ragged_tensor(payload, rows, metadata)
    if codec == "typed_ragged":
        return decode_typed_ragged(payload, rows, metadata)
    if codec == "ragged_tensor_dict":
        return decode_ragged_tensor_dict(payload, rows, metadata or {})
    if codec == "media_list_ragged":
        return decode_media_lists(payload, rows, metadata)
    if codec == "ndarray":
        return decode_numeric_scalars(payload)
    if codec == "media_bytes":
        return decode_bytes_like(payload, rows, metadata)
    if codec == "bytes_ragged":
        return decode_bytes_like(payload, rows)
    if codec == "utf8_ragged":
        return [None if v is None else v.decode("utf-8")
                for v in decode_bytes_like(payload, rows)]
    if codec == "msgpack_ragged":
        return decode_msgpack(payload, rows)
    if codec == "json_ragged":
        return [None if v is None else json.loads(v) for v in decode_bytes_like(payload, rows)]
    raise ValueError(f"unknown structured non-tensor codec: {codec}")


def plain_value(value):
    """numpy arrays and scalars inside a row as plain lists and numbers (for the
    msgpack/JSON fallbacks)."""
    np = sys.modules.get("numpy")
    if np is not None and isinstance(value, np.ndarray):
        return plain_value(value.tolist()) if value.dtype.hasobject else value.tolist()
    if np is not None and isinstance(value, np.generic):
        return value.item()
    if isinstance(value, dict):
        return {k: plain_value(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [plain_value(v) for v in value]
    return value
