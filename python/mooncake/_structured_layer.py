"""Structured objects over bundles: JSON metadata (with each member's field spec) plus
members, and reading members back -- whole, an axis-0 slice, or chosen rows -- into new
arrays, pool-backed arrays or caller destinations (upstream's
``_StructuredObjectLayer`` and its DataProto row reads).

Reads by encoding:
  bytes         the payload (a uint8 array over a BufferPool lease when there is a
                pool); no slicing, no destination
  ndarray       a slice with step 1 reads just its byte range (into a pool array when
                there is a pool and no destination); other steps read the covering range
  torch_tensor  a store tensor with get_tensor; a serialized one by its header and the
                rows' bytes; torch.save bytes whole; nested tensors whole, rows picked
                after; destinations are tensor_object_buffer/raw_destination memory that
                receives the serialized tensor (header + rows); any slice step works
"""

import ctypes

from . import _structured_codecs as C
from . import _structured_payloads as P
from ._structured_bundles import check_key_segment, decode_json, encode_json


def field_specs(metadata):
    specs = metadata.get(C.FIELD_SPECS_KEY, {})
    if not isinstance(specs, dict):
        raise ValueError("structured field specs must be a dict")
    return specs


def normalize_metadata(metadata):
    if not isinstance(metadata, dict) and not hasattr(metadata, "items"):
        raise TypeError("structured metadata must be a mapping")
    out = dict(metadata)
    if C.FIELD_SPECS_KEY in out:
        raise ValueError(f"structured metadata key {C.FIELD_SPECS_KEY!r} is reserved")
    if not isinstance(out.get("layout", "structured"), str):
        raise ValueError("structured metadata layout must be a string")
    out.setdefault("layout", "structured")
    return out


def encode_metadata(metadata):
    return encode_json(metadata, "structured metadata")


def decode_metadata(payload):
    return decode_json(payload, "structured metadata")


def slice_bounds(member_slice, total):
    """(start, stop, step) of an axis-0 StructuredMemberSlice over ``total`` rows."""
    if member_slice.step <= 0:
        raise ValueError("structured ndarray slicing step must be positive")
    return slice(member_slice.start, member_slice.end, member_slice.step).indices(total)


def _numel(shape):
    count = 1
    for d in shape:
        count *= int(d)
    return count


def _row_ranges(indices, width, base=0, out_base=0):
    return [(base + r * width, out_base + i * width, width) for i, r in enumerate(indices)]


def ndarray_target(name, destination, dtype, shape):
    """Where an ndarray read lands: a new array, the caller's array (checked), or an
    array over a raw_destination."""
    np = P.numpy()
    if destination is None:
        return np.empty(shape, dtype=dtype)
    if isinstance(destination, P.RawDestination):
        nbytes = _numel(shape) * dtype.itemsize
        if destination.size < nbytes:
            raise ValueError(f"raw destination has {destination.size} bytes, expected at "
                             f"least {nbytes}")
        raw = (ctypes.c_uint8 * max(nbytes, 1)).from_address(destination.ptr)
        return np.frombuffer(raw, np.uint8, nbytes).view(dtype).reshape(shape)
    if not isinstance(destination, np.ndarray):
        raise TypeError(f"structured ndarray field {name} destination must be a "
                        "numpy.ndarray or raw_destination")
    if destination.dtype != dtype:
        raise ValueError(f"structured ndarray field {name} destination dtype mismatch: "
                         f"expected {dtype.str}, got {destination.dtype.str}")
    if tuple(destination.shape) != tuple(shape):
        raise ValueError(f"structured ndarray field {name} destination shape mismatch: "
                         f"expected {tuple(shape)}, got {tuple(destination.shape)}")
    if not destination.flags["C_CONTIGUOUS"]:
        raise ValueError(f"structured ndarray field {name} destination must be C-contiguous")
    if not destination.flags["WRITEABLE"]:
        raise ValueError(f"structured ndarray field {name} destination must be writeable")
    return destination


class StructuredObjects:
    def __init__(self, bundles, transport):
        self._bundles = bundles
        self._io = transport

    # ------------------------------------------------------------ writing

    def put(self, payload, partition, chunk_bytes, policy, max_inflight_put, config=None):
        metadata = normalize_metadata(payload.metadata)
        specs, buffers = {}, {}
        for name, value in payload.buffers.items():
            check_key_segment(name, "buffer name")
            specs[name], buffers[name] = C.encode_member(value)
        if specs:
            metadata[C.FIELD_SPECS_KEY] = specs
        policy = self._bundles._policy(policy, max_inflight_put)
        return self._bundles.put_bundle(encode_metadata(metadata), buffers, partition,
                                        chunk_bytes, policy, None, config)

    # ------------------------------------------------------------ reading

    def open(self, ref):
        """(manifest, metadata) of a stored object."""
        manifest = self._bundles.resolve_manifest(ref)
        return manifest, decode_metadata(self._io.read_payload(manifest["meta"]))

    def materialize_into(self, spec, destinations):
        from .structured_object_store import StructuredObjectResult
        if spec.member_names is not None and not spec.member_names:
            raise ValueError("structured read spec selected no members")
        manifest, metadata = self.open(spec.ref)
        buffers = manifest["buffers"]
        names = list(buffers) if spec.member_names is None else list(spec.member_names)
        missing = [n for n in names if n not in buffers]
        if missing:
            raise KeyError(f"unknown bundle buffers: {missing}")
        specs = field_specs(metadata)
        slices = dict(spec.member_slices)
        destinations = destinations or {}
        objects = {n: self.read_member(n, buffers[n], specs.get(n, {"encoding": "bytes"}),
                                       slices.get(n), destinations.get(n)) for n in names}
        return StructuredObjectResult(metadata=dict(metadata), objects=objects)

    def read_member(self, name, payload, spec, member_slice, destination):
        encoding = spec.get("encoding", "bytes")
        if encoding == "bytes":
            return self._read_bytes(name, payload, member_slice, destination)
        if encoding == "torch_tensor":
            return self._read_tensor(name, payload, spec, member_slice, destination)
        if encoding != "ndarray":
            raise ValueError(f"unsupported structured field encoding: {encoding}")
        return self._read_ndarray(name, payload, spec, member_slice, destination)

    def _read_bytes(self, name, payload, member_slice, destination):
        if member_slice is not None:
            raise ValueError(f"structured bytes member {name} does not support slicing")
        if destination is not None:
            raise ValueError(f"structured bytes member {name} does not support "
                             "materialize_into")
        total = int(payload.get("bytes", 0))
        if total > 0:
            pooled = self._io.read_range_into_pool_array(payload, P.numpy().dtype("u1"),
                                                         (total,), 0)
            if pooled is not None:
                return pooled
        return self._io.read_payload(payload)

    def _read_ndarray(self, name, payload, spec, member_slice, destination):
        np = P.numpy()
        dtype, shape = self._array_layout(name, spec)
        width = dtype.itemsize * _numel(shape[1:]) if shape else dtype.itemsize
        if member_slice is None:
            start, step, count, cover = 0, 1, (shape[0] if shape else 1), None
            out_shape = shape
        else:
            if member_slice.axis != 0:
                raise ValueError("structured ndarray slicing currently supports axis=0 only")
            if not shape:
                raise ValueError("structured ndarray slicing requires at least one "
                                 "dimension")
            start, stop, step = slice_bounds(member_slice, shape[0])
            count = len(range(start, stop, step))
            out_shape = (count, *shape[1:])
        nbytes = _numel(out_shape) * dtype.itemsize
        offset = start * width
        if destination is None and nbytes and step == 1:
            pooled = self._io.read_range_into_pool_array(payload, dtype, out_shape, offset)
            if pooled is not None:
                return pooled
        target = ndarray_target(name, destination, dtype, out_shape)
        if nbytes == 0:
            return target
        if step == 1:
            self._fill(payload, target, offset, destination)
            return target
        cover = (count - 1) * step + 1
        temp = np.empty((cover, *shape[1:]), dtype=dtype)
        self._io.read_range_into(payload, temp, offset)
        target[...] = temp[::step]
        return target

    def _fill(self, payload, target, offset, destination):
        """Payload bytes from ``offset`` into ``target`` (over a raw destination when
        one is given: read there directly when it is pre-registered)."""
        if isinstance(destination, P.RawDestination):
            nbytes = int(target.nbytes)
            if destination.pre_registered and \
                    self._io.read_ranges_into_raw(payload, destination.ptr,
                                                  [(offset, 0, nbytes)]):
                return
            data = self._io.read_range(payload, offset, nbytes)
            ctypes.memmove(destination.ptr, data, nbytes)
            return
        self._io.read_range_into(payload, target, offset)

    @staticmethod
    def _array_layout(name, spec):
        dtype, shape = spec.get("dtype"), spec.get("shape")
        if not isinstance(dtype, str) or not isinstance(shape, list):
            raise ValueError(f"structured ndarray field {name} is missing dtype or shape")
        return P.numpy().dtype(dtype), tuple(int(d) for d in shape)

    def _read_tensor(self, name, payload, spec, member_slice, destination):
        if spec.get("nested"):
            if destination is not None:
                raise ValueError(f"structured nested tensor member {name} does not support "
                                 "destinations")
            value = C.decode_nested(self._io.read_payload(payload), spec)
            if member_slice is None:
                return value
            if member_slice.axis != 0:
                raise ValueError("structured nested tensor slicing currently supports "
                                 "axis=0 only")
            return C.select_nested_rows(value, range(*slice_bounds(member_slice, len(value))))
        if member_slice is not None:
            return self._read_tensor_slice(name, payload, spec, member_slice, destination)
        if destination is not None:
            _check_tensor_destination(name, destination)
            got = self._io.read_tensor_into(payload, destination)
            return destination if got is None else got
        if payload.get("kind") == "tensor":
            return self._io.read_tensor(payload)
        if payload.get("format") == "torch_save":
            return C.torch_load_bytes(self._io.read_payload(payload))
        return C.deserialize_tensor(self._io.read_payload(payload))

    def _read_tensor_slice(self, name, payload, spec, member_slice, destination):
        if member_slice.axis != 0:
            raise ValueError("structured tensor slicing currently supports axis=0 only")
        if payload.get("format") == "torch_save":
            if destination is not None:
                raise ValueError(f"structured torch_save tensor member {name} does not "
                                 "support destinations")
            value = C.torch_load_bytes(self._io.read_payload(payload))
            start, stop, step = slice_bounds(member_slice, len(value))
            return value[start:stop:step]
        header_bytes, shape, width = self._tensor_layout(name, payload, spec)
        if not shape:
            raise ValueError("structured tensor slicing requires at least one dimension")
        rows = range(*slice_bounds(member_slice, int(shape[0])))
        return self._tensor_rows(name, payload, header_bytes, shape, width, rows, destination)

    def read_member_rows(self, ref, member, indices, destination):
        """Rows ``indices`` (in order, repeats allowed) of an ndarray or tensor member."""
        manifest, metadata = self.open(ref)
        spec = field_specs(metadata).get(member, {"encoding": "bytes"})
        payload = manifest["buffers"][member]
        encoding = spec.get("encoding", "bytes")
        if encoding == "ndarray":
            return self._ndarray_rows(member, payload, spec, indices, destination)
        if encoding != "torch_tensor":
            raise ValueError(f"structured member {member} does not support indexed rows")
        if spec.get("nested"):
            if destination is not None:
                raise ValueError(f"structured nested tensor member {member} does not "
                                 "support destinations")
            value = C.decode_nested(self._io.read_payload(payload), spec)
            return C.select_nested_rows(value, indices)
        if payload.get("format") == "torch_save":
            if destination is not None:
                raise ValueError(f"structured torch_save tensor member {member} does not "
                                 "support destinations")
            return C.torch_load_bytes(self._io.read_payload(payload))[list(indices)]
        header_bytes, shape, width = self._tensor_layout(member, payload, spec)
        if not shape:
            raise ValueError("structured tensor indexed read requires at least one "
                             "dimension")
        return self._tensor_rows(member, payload, header_bytes, shape, width, indices,
                                 destination)

    def _ndarray_rows(self, name, payload, spec, indices, destination):
        dtype, shape = self._array_layout(name, spec)
        if not shape:
            raise ValueError("structured ndarray indexed read requires at least one "
                             "dimension")
        target = ndarray_target(name, destination, dtype, (len(indices), *shape[1:]))
        width = dtype.itemsize * _numel(shape[1:])
        if not indices or not width:
            return target
        ranges = _row_ranges(indices, width)
        if isinstance(destination, P.RawDestination):
            if destination.pre_registered and \
                    self._io.read_ranges_into_raw(payload, destination.ptr, ranges):
                return target
            data = bytearray(int(target.nbytes))
            self._io.read_ranges_into(payload, data, ranges)
            ctypes.memmove(destination.ptr, bytes(data), len(data))
            return target
        self._io.read_ranges_into(payload, target, ranges)
        return target

    @staticmethod
    def _tensor_layout(name, payload, spec):
        header_bytes = int(payload.get("metadata_bytes", -1))
        shape = spec.get("shape")
        element_size = int(spec.get("element_size", 0))
        if header_bytes < 0 or not isinstance(shape, list) or element_size <= 0:
            raise ValueError(f"structured tensor field {name} is missing slice metadata")
        return header_bytes, shape, element_size * _numel(shape[1:])

    def _tensor_rows(self, name, payload, header_bytes, shape, width, indices, destination):
        """The serialized tensor of rows ``indices``: its header patched to their shape,
        then their bytes; a tensor, or written into ``destination``."""
        indices = list(indices)
        data_bytes = len(indices) * width
        header = C.slice_tensor_header(self._io.read_range(payload, 0, header_bytes),
                                       (len(indices), *shape[1:]), data_bytes)
        ranges = _merge_runs(indices, width, header_bytes)
        if destination is None:
            data = bytearray(data_bytes)
            if ranges:
                self._io.read_ranges_into(payload, data, ranges)
            return C.deserialize_tensor(header + bytes(data))
        _check_tensor_destination(name, destination)
        if destination.size < header_bytes + data_bytes:
            raise ValueError(f"tensor destination has {destination.size} bytes, expected at "
                             f"least {header_bytes + data_bytes}")
        ctypes.memmove(destination.ptr, header, header_bytes)
        if ranges:
            registered = isinstance(destination, P.RawDestination) and \
                destination.pre_registered
            into_dest = [(s, header_bytes + d, n) for s, d, n in ranges]
            if not (registered and self._io.read_ranges_into_raw(payload, destination.ptr,
                                                                  into_dest)):
                data = bytearray(data_bytes)
                self._io.read_ranges_into(payload, data, ranges)
                ctypes.memmove(destination.ptr + header_bytes, bytes(data), data_bytes)
        return destination


def _merge_runs(indices, width, base):
    """(source, destination, length) ranges of rows ``indices`` of ``width`` bytes
    after a ``base``-byte header; consecutive rows become one range."""
    ranges = []
    for out, row in enumerate(indices):
        src, dst = base + row * width, out * width
        if ranges and ranges[-1][0] + ranges[-1][2] == src and \
                ranges[-1][1] + ranges[-1][2] == dst:
            ranges[-1] = (ranges[-1][0], ranges[-1][1], ranges[-1][2] + width)
        elif width:
            ranges.append((src, dst, width))
    return ranges


def _check_tensor_destination(name, destination):
    if not isinstance(destination, (P.TensorObjectBuffer, P.RawDestination)):
        raise ValueError(f"structured tensor member {name} only supports "
                         "tensor_object_buffer or raw_destination destinations")
