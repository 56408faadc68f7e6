"""How ``mooncake.structured_object_store`` turns a structured member into a field spec
and a payload, and tensors into bytes and back (upstream's formats).

Field specs (in the object's metadata under ``FIELD_SPECS_KEY``):
  {"encoding": "bytes"}                     bytes-like values, stored as they are
  {"encoding": "ndarray", "dtype", "shape"}  numpy arrays (C-order bytes; dtype as
                                            numpy's ``dtype.str``), and multi-buffer /
                                            direct-copy payloads that carry a dtype
  {"encoding": "torch_tensor", "dtype", "shape", "element_size"}  a CPU torch tensor:
        put with the store's put_tensor/pub_tensor (payload "kind": "tensor"), else
        serialized as Mooncake's 304-byte tensor header plus its bytes (payload
        "metadata_bytes"), else (no serialization helpers, or a 0-d tensor) torch.save
        bytes (payload "format": "torch_save")
  {"encoding": "torch_tensor"}              a tensor_object_buffer (bytes as given)
  {"encoding": "torch_tensor", "dtype", "nested": true, "format": "tensor_parts",
   "part_bytes", "has_lengths", "ragged_idx"}  a jagged nested tensor: its values,
        offsets (and lengths) serialized one after another; "format": "torch_save"
        where the serialization helpers are missing

The serialization helpers are ``mooncake.store._serialize_tensor`` /
``_deserialize_tensor`` / ``_tensor_metadata_size``.
"""

import ctypes
import io

from ._structured_payloads import (
    MultiBufferPayload,
    TensorObjectBuffer,
    TensorPayload,
    DirectCopyPayload,
    facade,
    is_ndarray,
    is_tensor,
    numpy,
    torch_module,
)

FIELD_SPECS_KEY = "__mooncake_structured_fields__"
_DATA_BYTES_OFFSET = 32  # where the tensor header keeps its data size, then two shapes
_GLOBAL_SHAPE_OFFSET = 40
_LOCAL_SHAPE_OFFSET = 104


# ---------------------------------------------------------------- tensor bytes


def _store_module():
    try:
        from . import store
    except Exception:  # no native library here
        return None
    return store


def tensor_codec_helpers_available():
    store = _store_module()
    return store is not None and callable(getattr(store, "_serialize_tensor", None)) and \
        callable(getattr(store, "_deserialize_tensor", None))


def _helper(name):
    helper = getattr(_store_module(), name, None)
    if not callable(helper):
        raise RuntimeError("mooncake.store tensor serialization helpers are required for "
                           "structured tensor fields")
    return helper


def tensor_metadata_size():
    helper = getattr(_store_module(), "_tensor_metadata_size", None)
    return int(helper()) if callable(helper) else 0


def serialize_tensor(tensor):
    """(header bytes, data address, data bytes, owner keeping the data alive)."""
    header, ptr, nbytes, owner = _helper("_serialize_tensor")(tensor)
    return bytes(header), int(ptr), int(nbytes), owner


def serialized_tensor_bytes(tensor):
    """(header + data bytes, header size)."""
    header, ptr, nbytes, _owner = serialize_tensor(tensor)
    data = ctypes.string_at(ptr, nbytes) if nbytes else b""
    return header + data, len(header)


def deserialize_tensor(payload):
    tensor = _helper("_deserialize_tensor")(bytes(payload))
    if tensor is None:
        raise ValueError("structured tensor payload is not a Mooncake tensor object")
    return tensor


def torch_save_bytes(value):
    buffer = io.BytesIO()
    torch_module().save(value, buffer)
    return buffer.getvalue()


def torch_load_bytes(payload):
    return torch_module().load(io.BytesIO(bytes(payload)), weights_only=True)


def slice_tensor_header(header, shape, data_bytes):
    """A tensor header rewritten for a tensor of ``shape`` holding ``data_bytes``."""
    patched = bytearray(header)
    ctypes.c_uint64.from_buffer(patched, _DATA_BYTES_OFFSET).value = int(data_bytes)
    for i, dim in enumerate(shape):
        ctypes.c_int64.from_buffer(patched, _GLOBAL_SHAPE_OFFSET + 8 * i).value = int(dim)
        ctypes.c_int64.from_buffer(patched, _LOCAL_SHAPE_OFFSET + 8 * i).value = int(dim)
    return bytes(patched)


# ---------------------------------------------------------------- member encodings


def encode_member(value):
    """(field spec, payload form) of one structured member."""
    if isinstance(value, TensorObjectBuffer):
        return {"encoding": "torch_tensor"}, value
    if isinstance(value, TensorPayload):
        return _encode_tensor(value.tensor)
    if isinstance(value, (DirectCopyPayload, MultiBufferPayload)):
        if value.dtype is not None and value.shape is not None:
            return {"encoding": "ndarray", "dtype": value.dtype,
                    "shape": list(value.shape)}, value
        return {"encoding": "bytes"}, value
    if is_tensor(value):
        return _encode_tensor(value)
    if is_ndarray(value):
        array = numpy().ascontiguousarray(value)
        if array.dtype.hasobject:
            raise TypeError("object arrays cannot be structured members (store them as "
                            "DataProto non_tensor_batch fields)")
        return {"encoding": "ndarray", "dtype": array.dtype.str,
                "shape": [int(d) for d in array.shape]}, array.reshape(-1).view("u1")
    return {"encoding": "bytes"}, value


def _encode_tensor(tensor):
    if tensor.is_nested:
        if tensor.layout != torch_module().jagged:
            raise ValueError("structured nested tensor fields require torch.jagged layout")
        return _encode_nested(tensor)
    return {"encoding": "torch_tensor", "dtype": str(tensor.dtype),
            "shape": [int(d) for d in tensor.shape],
            "element_size": int(tensor.element_size())}, TensorPayload(tensor)


def _encode_nested(tensor):
    spec = {"encoding": "torch_tensor", "dtype": str(tensor.dtype), "nested": True,
            "format": "torch_save"}
    parts = [tensor.values(), tensor.offsets()]
    if tensor.lengths() is not None:
        parts.append(tensor.lengths())
    if facade("_has_tensor_codec_helpers")() and all(p.device.type == "cpu" for p in parts):
        blobs = [serialized_tensor_bytes(p)[0] for p in parts]
        spec.update({"format": "tensor_parts", "part_bytes": [len(b) for b in blobs],
                     "has_lengths": len(parts) == 3,
                     "ragged_idx": int(getattr(tensor, "_ragged_idx", 1))})
        return spec, MultiBufferPayload(tuple(memoryview(b) for b in blobs))
    return spec, memoryview(torch_save_bytes(tensor))


def decode_nested(payload, spec):
    """The jagged nested tensor of a nested member's payload."""
    fmt = spec.get("format", "torch_save")
    if fmt == "torch_save":
        return torch_load_bytes(payload)
    if fmt != "tensor_parts":
        raise ValueError(f"unsupported nested tensor payload format: {fmt}")
    sizes = spec.get("part_bytes")
    expected = 3 if spec.get("has_lengths") else 2
    if not isinstance(sizes, list) or len(sizes) != expected:
        raise ValueError("nested tensor payload has invalid part metadata")
    parts, offset = [], 0
    for size in sizes:
        if isinstance(size, bool) or not isinstance(size, int) or size <= 0:
            raise ValueError("nested tensor payload has invalid part size")
        if offset + size > len(payload):
            raise ValueError("nested tensor payload is truncated")
        parts.append(deserialize_tensor(payload[offset:offset + size]))
        offset += size
    if offset != len(payload):
        raise ValueError("nested tensor payload has trailing bytes")
    return torch_module().nested.nested_tensor_from_jagged(
        parts[0], offsets=parts[1], lengths=parts[2] if expected == 3 else None,
        jagged_dim=int(spec.get("ragged_idx", 1)))


def select_nested_rows(value, indices):
    """The rows at ``indices`` of a jagged nested tensor, as one (same ragged dim)."""
    torch = torch_module()
    ragged_idx = int(getattr(value, "_ragged_idx", 1))
    dim = ragged_idx - 1  # the ragged dim inside ``values``
    values, offsets, lengths = value.values(), value.offsets(), value.lengths()
    sizes = lengths if lengths is not None else offsets.diff()
    pieces = [values.narrow(dim, int(offsets[i]), int(sizes[i])) for i in indices]
    picked = torch.cat(pieces, dim) if pieces else values.narrow(dim, 0, 0)
    ends = torch.tensor([p.shape[dim] for p in pieces], dtype=offsets.dtype).cumsum(0)
    return torch.nested.nested_tensor_from_jagged(
        picked, offsets=torch.cat([offsets.new_zeros(1), ends]), jagged_dim=ragged_idx)
