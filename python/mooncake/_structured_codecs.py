"""How ``mooncake.structured_object_store`` turns values into payload bytes and back.

Members of a structured object (one payload each):
  bytes         any bytes-like value, stored as is
  ndarray       a numpy array of a non-object dtype: its C-order bytes, with
                {"dtype": numpy dtype string, "shape": [...]}
  torch_tensor  a CPU torch tensor: its bytes, with {"dtype": "torch.<name>", "shape",
                "element_size"} (any dtype torch has, bfloat16 included)

Non-tensor DataProto fields (a numpy object array or a list of rows) use one codec each,
chosen by a FieldSchema or inferred from the rows; ``None`` rows are allowed unless the
schema says ``nullable=False``:
  ndarray        numeric scalars, no None: one typed array ({"data"})
  utf8_ragged    str rows;  bytes_ragged (alias media_bytes): bytes-like rows;
  json_ragged    JSON-safe rows (numpy scalars and arrays become JSON numbers and lists)
  typed_ragged   numeric numpy arrays (or numeric lists) of one dtype, any shapes
  ragged_tensor  CPU torch tensors of one dtype, any shapes
The ragged codecs store the rows' bytes back to back ({"data"}) and a JSON index
({"index": offsets, None rows, shapes}).

numpy and torch are imported only when a value needs them.
"""

import ctypes
import json
import sys
from dataclasses import dataclass, field

from ._bundle_store import ZeroCopySource

FIELD_SPECS_KEY = "__mooncake_structured_fields__"
SCHEMA_CODECS = ("auto", "ndarray", "typed_ragged", "ragged_tensor", "bytes_ragged",
                 "media_bytes", "utf8_ragged", "json_ragged")
_RAGGED = ("typed_ragged", "ragged_tensor", "bytes_ragged", "media_bytes", "utf8_ragged",
           "json_ragged")


def numpy():
    try:
        import numpy as np
    except ImportError:
        raise ImportError("mooncake.structured_object_store needs numpy for array values "
                          "(pip install numpy)") from None
    return np


def torch_module():
    try:
        import torch
    except ImportError:
        raise ImportError("mooncake.structured_object_store needs torch to read tensor "
                          "members (pip install torch)") from None
    return torch


def is_tensor(value):
    torch = sys.modules.get("torch")
    return torch is not None and isinstance(value, torch.Tensor)


def is_ndarray(value):
    np = sys.modules.get("numpy")
    return np is not None and isinstance(value, np.ndarray)


def torch_dtype(name):
    """The torch dtype called ``name`` ("torch.float32" or "float32")."""
    torch = torch_module()
    dtype = getattr(torch, str(name).replace("torch.", ""), None)
    if not isinstance(dtype, torch.dtype):
        raise ValueError(f"unknown torch dtype {name!r}")
    return dtype


def memory_view(ptr, nbytes, owner):
    """A writable byte view of memory at ``ptr`` that keeps ``owner`` alive."""
    if nbytes == 0:
        return memoryview(bytearray())
    array = (ctypes.c_uint8 * nbytes).from_address(ptr)
    array.owner = owner
    return memoryview(array).cast("B")


def tensor_bytes(tensor):
    """A byte view of a CPU tensor's contiguous data."""
    if tensor.device.type != "cpu":
        raise ValueError(f"structured tensor members must be CPU tensors, got {tensor.device}")
    if getattr(tensor, "is_nested", False):
        raise ValueError("nested tensors are not supported as structured members")
    tensor = tensor.contiguous()
    return memory_view(tensor.data_ptr(), tensor.numel() * tensor.element_size(), tensor)


def array_bytes(array):
    np = numpy()
    array = np.ascontiguousarray(array)
    return memory_view(array.ctypes.data, array.nbytes, array)


def encode_member(value):
    """(field spec, payload) of one structured member."""
    if isinstance(value, ZeroCopySource):
        return {"encoding": "bytes"}, value
    if is_tensor(value):
        return {"encoding": "torch_tensor", "dtype": str(value.dtype),
                "shape": [int(d) for d in value.shape],
                "element_size": int(value.element_size())}, tensor_bytes(value)
    if is_ndarray(value):
        if value.dtype.hasobject:
            raise TypeError("object arrays cannot be structured members (store them as "
                            "DataProto non_tensor_batch fields)")
        return {"encoding": "ndarray", "dtype": value.dtype.str,
                "shape": [int(d) for d in value.shape]}, array_bytes(value)
    try:
        memoryview(value)
    except TypeError:
        raise TypeError(f"unsupported structured member of type {type(value).__name__} "
                        "(bytes-like, numpy array or torch tensor)") from None
    return {"encoding": "bytes"}, value


# ---------------------------------------------------------------- non-tensor fields


@dataclass
class Encoded:
    """A non-tensor field as payloads: ``payload`` {name: bytes-like} plus JSON-safe
    ``metadata``."""

    codec: str
    rows: int
    payload: dict
    metadata: dict = field(default_factory=dict)


def _json_default(value):
    np = sys.modules.get("numpy")
    if np is not None:
        if isinstance(value, np.generic):
            return value.item()
        if isinstance(value, np.ndarray) and not value.dtype.hasobject:
            return value.tolist()
    raise TypeError(f"{type(value).__name__} is not JSON-serializable")


def _is_scalar_number(value):
    np = sys.modules.get("numpy")
    if isinstance(value, (bool, int, float)):
        return True
    return np is not None and isinstance(value, (np.number, np.bool_))


def _is_numeric_array(value):
    return is_ndarray(value) and value.dtype.kind in "biuf"


def _is_bytes_like(value):
    return isinstance(value, (bytes, bytearray, memoryview))


def _ragged(codec, rows, pieces, extra_index=None, metadata=None):
    """An Encoded ragged field: ``pieces`` holds each row's bytes (None for a None
    row)."""
    offsets, nulls, data = [0], [], bytearray()
    for i, piece in enumerate(pieces):
        if piece is None:
            nulls.append(i)
        else:
            data += piece
        offsets.append(len(data))
    index = {"offsets": offsets, "nulls": nulls, **(extra_index or {})}
    return Encoded(codec, rows, {"data": bytes(data),
                                 "index": json.dumps(index).encode()}, metadata or {})


def _encode_ndarray_rows(values, dtype_name=None):
    np = numpy()
    if any(v is None for v in values):
        raise ValueError("the ndarray codec does not take None rows")
    dtype = np.dtype(dtype_name) if dtype_name else None
    array = np.asarray(values, dtype=dtype)
    if array.dtype.kind not in "biufc" or array.ndim != 1:
        raise TypeError("the ndarray codec takes numeric scalar rows")
    return Encoded("ndarray", len(values), {"data": array.tobytes()},
                   {"dtype": array.dtype.str})


def _encode_typed_ragged(values, dtype_name=None):
    np = numpy()
    rows, shapes, as_list = [], [], []
    for v in values:
        if v is None:
            rows.append(None)
            shapes.append(None)
            continue
        arr = np.asarray(v, dtype=dtype_name)
        if arr.dtype.kind not in "biufc":
            raise TypeError(f"typed_ragged rows must be numeric, got dtype {arr.dtype}")
        rows.append(arr)
        shapes.append(list(arr.shape))
        as_list.append(not is_ndarray(v))
    dtypes = {r.dtype.str for r in rows if r is not None}
    if len(dtypes) > 1:
        raise TypeError(f"typed_ragged rows must share one dtype, got {sorted(dtypes)}")
    dtype = dtypes.pop() if dtypes else np.dtype(dtype_name or "int64").str
    pieces = [None if r is None else np.ascontiguousarray(r, dtype=dtype).tobytes()
              for r in rows]
    return _ragged("typed_ragged", len(values), pieces, {"shapes": shapes},
                   {"dtype": dtype, "lists": bool(as_list) and all(as_list)})


def _encode_ragged_tensor(values):
    pieces, shapes, dtypes = [], [], set()
    for v in values:
        if v is None:
            pieces.append(None)
            shapes.append(None)
            continue
        if not is_tensor(v):
            raise TypeError(f"ragged_tensor rows must be torch tensors, got {type(v).__name__}")
        pieces.append(bytes(tensor_bytes(v)))
        shapes.append([int(d) for d in v.shape])
        dtypes.add(str(v.dtype))
    if len(dtypes) > 1:
        raise TypeError(f"ragged_tensor rows must share one dtype, got {sorted(dtypes)}")
    return _ragged("ragged_tensor", len(values), pieces, {"shapes": shapes},
                   {"dtype": dtypes.pop() if dtypes else "torch.float32"})


def _encode_text(values, codec):
    pieces = []
    for v in values:
        if v is None:
            pieces.append(None)
        elif codec == "utf8_ragged":
            if not isinstance(v, str):
                raise TypeError(f"utf8_ragged rows must be str, got {type(v).__name__}")
            pieces.append(v.encode("utf-8"))
        elif codec == "json_ragged":
            pieces.append(json.dumps(v, ensure_ascii=False, separators=(",", ":"),
                                     default=_json_default).encode("utf-8"))
        else:
            if not _is_bytes_like(v):
                raise TypeError(f"{codec} rows must be bytes-like, got {type(v).__name__}")
            pieces.append(bytes(v))
    return _ragged(codec, len(values), pieces)


def _infer_codec(values):
    present = [v for v in values if v is not None]
    if not present:
        return "json_ragged"
    if all(isinstance(v, str) for v in present):
        return "utf8_ragged"
    if all(_is_bytes_like(v) for v in present):
        return "bytes_ragged"
    if all(is_tensor(v) for v in present):
        return "ragged_tensor"
    if len(present) == len(values) and all(_is_scalar_number(v) for v in present):
        return "ndarray"
    if all(_is_numeric_array(v) for v in present) and \
            len({v.dtype.str for v in present}) == 1:
        return "typed_ragged"
    return "json_ragged"


def encode_non_tensor(path, values, schema=None):
    """The Encoded form of a non-tensor field's rows (``schema``: a FieldSchema or
    None). TypeError/ValueError naming ``path`` when the rows do not fit the codec."""
    values = list(values)
    codec = "auto" if schema is None else schema.codec
    if codec not in SCHEMA_CODECS:
        raise ValueError(f"unsupported schema codec: {codec!r} (supported: "
                         f"{', '.join(SCHEMA_CODECS)})")
    if schema is not None and not schema.nullable and any(v is None for v in values):
        raise ValueError(f"FieldSchema for {path!r} is not nullable")
    dtype_name = None if schema is None else schema.metadata.get("dtype")
    if codec == "auto":
        codec = _infer_codec(values)
    try:
        if codec == "ndarray":
            return _encode_ndarray_rows(values, dtype_name)
        if codec == "typed_ragged":
            return _encode_typed_ragged(values, dtype_name)
        if codec == "ragged_tensor":
            return _encode_ragged_tensor(values)
        if codec == "media_bytes":
            codec = "bytes_ragged"
        return _encode_text(values, codec)
    except (TypeError, ValueError) as e:
        raise type(e)(f"{path}: {e}") from None


def decode_non_tensor(codec, rows, metadata, payload):
    """The rows of an Encoded field from its payloads {name: bytes}."""
    if codec == "ndarray":
        np = numpy()
        return list(np.frombuffer(payload["data"], dtype=np.dtype(metadata["dtype"])))
    if codec not in _RAGGED:
        raise ValueError(f"unknown non-tensor codec {codec!r}")
    index = json.loads(bytes(payload["index"]))
    offsets, nulls = index["offsets"], set(index["nulls"])
    if len(offsets) != rows + 1:
        raise ValueError(f"{codec} index has {len(offsets) - 1} rows, expected {rows}")
    data = bytes(payload["data"])
    pieces = [None if i in nulls else data[offsets[i]:offsets[i + 1]] for i in range(rows)]
    if codec == "utf8_ragged":
        return [None if p is None else p.decode("utf-8") for p in pieces]
    if codec == "json_ragged":
        return [None if p is None else json.loads(p) for p in pieces]
    if codec in ("bytes_ragged", "media_bytes"):
        return pieces
    shapes = index["shapes"]
    if codec == "typed_ragged":
        np = numpy()
        dtype = np.dtype(metadata["dtype"])
        out = [None if p is None else np.frombuffer(p, dtype=dtype).reshape(s).copy()
               for p, s in zip(pieces, shapes)]
        if metadata.get("lists"):
            return [None if a is None else a.tolist() for a in out]
        return out
    torch = torch_module()
    dtype = torch_dtype(metadata["dtype"])
    return [None if p is None else
            (torch.frombuffer(bytearray(p), dtype=dtype).reshape(s) if p
             else torch.empty(s, dtype=dtype))
            for p, s in zip(pieces, shapes)]
