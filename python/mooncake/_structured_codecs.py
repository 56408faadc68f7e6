"""How ``mooncake.structured_object_store`` turns structured members into payload bytes
and back, plus the lazy numpy/torch helpers its codecs share.

Members of a structured object (one payload each):
  bytes         any bytes-like value, stored as is
  ndarray       a numpy array of a non-object dtype: its C-order bytes, with
                {"dtype": numpy dtype string, "shape": [...]}
  torch_tensor  a CPU torch tensor: its bytes, with {"dtype": "torch.<name>", "shape",
                "element_size"} (any dtype torch has, bfloat16 included); a jagged nested
                tensor adds {"nested": true, "format": "jagged_parts", "ragged_idx",
                "parts": [{"dtype", "shape"}]} and stores its values, offsets (and
                lengths, when it has them) back to back

Non-tensor DataProto fields are encoded by ``mooncake._row_codecs`` (one codec per
field) and ``mooncake._structure_inference`` (which codec, and nested rows).

numpy and torch are imported only when a value needs them.
"""

import ctypes
import sys

from ._bundle_store import ZeroCopySource

FIELD_SPECS_KEY = "__mooncake_structured_fields__"


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
        raise ValueError("a nested tensor has no flat bytes (only whole jagged members are "
                         "supported)")
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
        if value.is_nested:
            return _encode_jagged(value)
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


def numel(shape):
    count = 1
    for d in shape:
        count *= d
    return count


def element_size(dtype):
    return torch_module().empty(0, dtype=dtype).element_size()


def tensor_from_buffer(buffer, offset, dtype, shape):
    """A tensor of ``shape`` over ``buffer`` (a bytearray it shares) at byte ``offset``."""
    torch = torch_module()
    count = numel(shape)
    if count == 0:
        return torch.empty(shape, dtype=dtype)
    return torch.frombuffer(buffer, dtype=dtype, count=count, offset=offset).reshape(shape)


# ---------------------------------------------------------------- jagged nested tensors


def _encode_jagged(tensor):
    """(spec, payload) of a jagged nested tensor: the raw bytes of its values, offsets
    and (when it has them) lengths, back to back."""
    torch = torch_module()
    if tensor.layout != torch.jagged:
        raise ValueError("structured nested tensor members need the torch.jagged layout")
    parts = [tensor.values(), tensor.offsets()]
    if tensor.lengths() is not None:
        parts.append(tensor.lengths())
    parts = [p.detach().cpu().contiguous() for p in parts]
    payload = bytearray()
    for part in parts:
        payload += tensor_bytes(part)
    return {"encoding": "torch_tensor", "dtype": str(tensor.dtype), "nested": True,
            "format": "jagged_parts", "ragged_idx": int(getattr(tensor, "_ragged_idx", 1)),
            "parts": [{"dtype": str(p.dtype), "shape": [int(d) for d in p.shape]}
                      for p in parts]}, payload


def decode_jagged(spec, payload, indices=None):
    """The jagged nested tensor a member spec and its payload describe; only its rows at
    ``indices`` (in that order) when given."""
    torch = torch_module()
    if spec.get("format") != "jagged_parts":
        raise ValueError(f"unsupported nested tensor format: {spec.get('format')!r}")
    parts = spec.get("parts")
    if not isinstance(parts, list) or len(parts) not in (2, 3):
        raise ValueError("nested tensor member has invalid part metadata")
    try:
        layout = [(torch_dtype(p["dtype"]), [int(d) for d in p["shape"]]) for p in parts]
    except (KeyError, TypeError, ValueError):
        raise ValueError("nested tensor member has invalid part metadata") from None
    sizes = [numel(shape) * element_size(dtype) for dtype, shape in layout]
    buffer = bytearray(payload)
    if sum(sizes) != len(buffer):
        raise ValueError(f"nested tensor payload has {len(buffer)} bytes, its parts "
                         f"describe {sum(sizes)}")
    tensors, offset = [], 0
    for (dtype, shape), size in zip(layout, sizes):
        tensors.append(tensor_from_buffer(buffer, offset, dtype, shape))
        offset += size
    values, offsets, lengths = (tensors + [None])[:3]
    ragged_idx = int(spec.get("ragged_idx", 1))
    if indices is not None:
        values, offsets, lengths = _pick_jagged_rows(values, offsets, lengths,
                                                     ragged_idx - 1, indices)
    return torch.nested.nested_tensor_from_jagged(values, offsets=offsets, lengths=lengths,
                                                  jagged_dim=ragged_idx)


def _pick_jagged_rows(values, offsets, lengths, dim, indices):
    """(values, offsets, None) of the rows at ``indices``: each row is a slice of
    ``values`` along ``dim``."""
    torch = torch_module()
    sizes = lengths if lengths is not None else offsets.diff()
    pieces = [values.narrow(dim, int(offsets[i]), int(sizes[i])) for i in indices]
    picked = torch.cat(pieces, dim) if pieces else values.narrow(dim, 0, 0)
    ends = torch.tensor([p.shape[dim] for p in pieces], dtype=offsets.dtype).cumsum(0)
    return picked, torch.cat([offsets.new_zeros(1), ends]), None
