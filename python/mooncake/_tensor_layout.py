"""How Mooncake Store lays out a tensor, byte for byte as upstream's ``mooncake.store``
(0.3.13) writes it, so a tensor put by either side is read by the other; the names of
its shards; and the parallelism specs (``ParallelAxis``, ``TensorParallelism``,
``ReadTarget``) that say which shard a caller means. No store and no torch here (torch
is imported only to map dtypes, when asked).

A tensor object is a 304-byte header followed by the tensor's bytes (C order), all
integers little-endian:

  offset size  field
       0    4  magic 0x4d4f4f4e
       4    2  version 1
       6    2  header size 304
       8    4  dtype code (index into DTYPES)
      12    4  ndim, 0..8
      16    4  layout: 0 a whole tensor, 1 a shard
      20    4  reserved, 0
      24    8  data offset (304)
      32    8  data bytes (local numel * element size)
      40   64  global shape: 8 int64, -1 past ndim
     104   64  local shape (what this object holds), same form
     168    4  axis count, 0..4
     172    4  reserved, 0
     176  128  4 axes of 32 bytes (unused ones zero): int32 kind (DP 0, TP 1, EP 2, PP 3),
               index, rank, count, split_dim (-1: none), extra (EP expert id, PP stage
               id), then int64 the local extent of split_dim (0 without one)

A manifest (96 bytes) records how a tensor was cut: magic 0x574d414e, u16 version 1,
u16 size 96, int32 dtype, ndim, split_dim, shard count, reserved, 4 padding bytes, then
the global shape as 8 int64 (-1 past ndim).
"""

import functools
import struct
from collections import namedtuple

HEADER_SIZE = 304
MANIFEST_SIZE = 96
MAX_DIMS = 8
MAX_AXES = 4
FULL, SHARD = 0, 1

_MAGIC = 0x4D4F4F4E
_MANIFEST_MAGIC = 0x574D414E
_VERSION = 1
_FIXED = struct.Struct("<IHHiiIIQQ")
_SHAPE = struct.Struct("<8q")
_AXIS_COUNT = struct.Struct("<II")
_AXIS = struct.Struct("<iiiiiiq")
_MANIFEST = struct.Struct("<IHHiiiii4x8q")
assert _FIXED.size + 2 * _SHAPE.size + _AXIS_COUNT.size + MAX_AXES * _AXIS.size == HEADER_SIZE
assert _MANIFEST.size == MANIFEST_SIZE

# (torch dtype name, element size); a dtype's code is its index.
DTYPES = (
    ("float32", 4), ("float64", 8), ("int8", 1), ("uint8", 1), ("int16", 2), ("uint16", 2),
    ("int32", 4), ("uint32", 4), ("int64", 8), ("uint64", 8), ("bool", 1), ("float16", 2),
    ("bfloat16", 2), ("float8_e4m3fn", 1), ("float8_e5m2", 1),
)
# Axis kinds by code; their order is also the canonical order of axes in key names.
AXIS_KINDS = ("dp", "tp", "ep", "pp")
_RESERVED_KIND = 4  # valid in a stored header, never requested


def torch_module():
    try:
        import torch
    except ImportError as e:
        raise ImportError("the tensor methods of MooncakeDistributedStore need PyTorch "
                          "(pip install torch)") from e
    return torch


_codes = None


def dtype_code(dtype):
    """The wire code of a torch dtype, or None when Mooncake has none for it."""
    global _codes
    if _codes is None:
        torch = torch_module()
        _codes = {getattr(torch, name): code for code, (name, _) in enumerate(DTYPES)
                  if hasattr(torch, name)}
    return _codes.get(dtype)


def torch_dtype(code):
    return getattr(torch_module(), DTYPES[code][0])


def element_size(code):
    return DTYPES[code][1]


def numel(shape):
    n = 1
    for d in shape:
        n *= d
    return n


# ------------------------------------------------------------------ header

# One axis as stored: see the table in the module docstring.
StoredAxis = namedtuple("StoredAxis", "kind index rank count split_dim extra local_extent")


class TensorHeader:
    """The 304-byte header of a tensor object."""

    __slots__ = ("dtype", "global_shape", "local_shape", "layout", "axes", "data_offset",
                 "data_bytes")

    def __init__(self, dtype, global_shape, local_shape=None, layout=FULL, axes=(),
                 data_offset=HEADER_SIZE):
        self.dtype = dtype
        self.global_shape = tuple(global_shape)
        self.local_shape = tuple(self.global_shape if local_shape is None else local_shape)
        self.layout = layout
        self.axes = tuple(axes)
        self.data_offset = data_offset
        self.data_bytes = numel(self.local_shape) * element_size(dtype)

    @property
    def ndim(self):
        return len(self.local_shape)

    @property
    def total(self):
        """Bytes of the whole object."""
        return self.data_offset + self.data_bytes

    def axis_of_kind(self, kind):
        code = AXIS_KINDS.index(kind)
        return next((a for a in self.axes if a.kind == code), None)

    def pack(self):
        def shape(dims):
            return _SHAPE.pack(*dims, *([-1] * (MAX_DIMS - len(dims))))

        axes = b"".join(_AXIS.pack(*a) for a in self.axes)
        return b"".join((
            _FIXED.pack(_MAGIC, _VERSION, HEADER_SIZE, self.dtype, self.ndim, self.layout, 0,
                        self.data_offset, self.data_bytes),
            shape(self.global_shape), shape(self.local_shape),
            _AXIS_COUNT.pack(len(self.axes), 0),
            axes, bytes(_AXIS.size * (MAX_AXES - len(self.axes))),
        ))

    @classmethod
    def unpack(cls, raw, total=None):
        """The header at the start of ``raw`` (bytes-like) if it is valid for an object of
        ``total`` bytes (None: the size the header itself gives), else None. The checks
        are upstream's: a reader never trusts a header that could send it out of bounds.
        Headers are values (never changed once made), so the answer for the same bytes
        and total is kept: a batch of same-shaped tensors is checked once."""
        if len(raw) < HEADER_SIZE:
            return None
        return _unpack_kept(bytes(memoryview(raw)[:HEADER_SIZE]), total)

    @classmethod
    def _unpack(cls, raw, total):
        (magic, version, size, dtype, ndim, layout, _, data_offset,
         data_bytes) = _FIXED.unpack_from(raw, 0)
        if (magic, version, size) != (_MAGIC, _VERSION, HEADER_SIZE):
            return None
        if not (0 <= dtype < len(DTYPES) and 0 <= ndim <= MAX_DIMS and layout in (FULL, SHARD)):
            return None
        global_dims = _SHAPE.unpack_from(raw, _FIXED.size)
        local_dims = _SHAPE.unpack_from(raw, _FIXED.size + _SHAPE.size)
        axis_count, _ = _AXIS_COUNT.unpack_from(raw, _FIXED.size + 2 * _SHAPE.size)
        if axis_count > MAX_AXES:
            return None
        if total is None:
            total = data_offset + data_bytes
        if not HEADER_SIZE <= data_offset <= total or data_bytes != total - data_offset:
            return None
        for dims in (global_dims, local_dims):
            if any(d < 0 for d in dims[:ndim]) or any(d != -1 for d in dims[ndim:]):
                return None
        if numel(local_dims[:ndim]) * element_size(dtype) != data_bytes:
            return None
        base = _FIXED.size + 2 * _SHAPE.size + _AXIS_COUNT.size
        axes = tuple(StoredAxis(*_AXIS.unpack_from(raw, base + i * _AXIS.size))
                     for i in range(axis_count))
        for a in axes:
            if not (0 <= a.kind <= _RESERVED_KIND and 0 <= a.rank < a.count
                    and -1 <= a.split_dim < ndim):
                return None
        return cls(dtype, global_dims[:ndim], local_dims[:ndim], layout, axes, data_offset)


@functools.lru_cache(maxsize=256)
def _unpack_kept(head, total):
    return TensorHeader._unpack(head, total)


def shard_header(dtype, global_shape, local_shape, specs):
    """A shard's header: ``specs`` (AxisSpec, in the order given) become its axes."""
    axes = []
    for i, s in enumerate(specs):
        extra = s.expert_id if s.kind == "ep" else s.stage_id if s.kind == "pp" else None
        axes.append(StoredAxis(
            AXIS_KINDS.index(s.kind), i, s.rank, s.size,
            -1 if s.split_dim is None else s.split_dim, extra or 0,
            0 if s.split_dim is None else local_shape[s.split_dim]))
    return TensorHeader(dtype, global_shape, local_shape, SHARD, axes)


def specs_of(header):
    """The parallelism a shard's header records (canonical order), or None for a whole
    tensor or an axis of a kind no request can name."""
    if header.layout != SHARD or any(a.kind >= len(AXIS_KINDS) for a in header.axes):
        return None
    specs = []
    for a in header.axes:
        kind = AXIS_KINDS[a.kind]
        specs.append(AxisSpec(kind, a.rank, a.count, a.split_dim if a.split_dim >= 0 else None,
                              a.extra if kind == "ep" else None,
                              a.extra if kind == "pp" else None))
    return canonical(specs)


# ------------------------------------------------------------------ manifest

Manifest = namedtuple("Manifest", "dtype split_dim shard_count global_shape")


def pack_manifest(m):
    dims = tuple(m.global_shape)
    return _MANIFEST.pack(_MANIFEST_MAGIC, _VERSION, MANIFEST_SIZE, m.dtype, len(dims),
                          m.split_dim, m.shard_count, 0, *dims, *([-1] * (MAX_DIMS - len(dims))))


def unpack_manifest(raw):
    """The manifest in ``raw``, or None when it is not a valid one."""
    if raw is None or len(raw) < MANIFEST_SIZE:
        return None
    magic, version, size, dtype, ndim, split_dim, count, _, *dims = _MANIFEST.unpack_from(raw)
    if (magic, version, size) != (_MANIFEST_MAGIC, _VERSION, MANIFEST_SIZE):
        return None
    if not (0 <= ndim <= MAX_DIMS and count > 0 and 0 <= split_dim < ndim
            and 0 <= dtype < len(DTYPES)):
        return None
    if any(d < 0 for d in dims[:ndim]):
        return None
    return Manifest(dtype, split_dim, count, tuple(dims[:ndim]))


# ------------------------------------------------------------------ shards and key names


def shard_range(dim, rank, count):
    """(start, extent) of shard ``rank`` of ``count`` along a dimension of ``dim``."""
    start = dim * rank // count
    return start, dim * (rank + 1) // count - start


def uniform(dim, count):
    """Upstream cuts only into equal shards."""
    return count > 0 and dim % count == 0


def tp_key(key, rank):
    return f"{key}_tp_{rank}"


def tp_read_key(key, rank, size):
    return key if size <= 1 else tp_key(key, rank)


def writer_shard_key(key, rank, size, split_dim):
    return f"{key}__writer_{rank}of{size}_sd{split_dim}"


def writer_manifest_key(key):
    return key + "__writer_manifest"


def parallelism_manifest_key(key):
    return key + "__parallelism_manifest"


def parallelism_key(key, specs):
    """Where the shard ``specs`` names lives: upstream's legacy TP name for a lone TP axis,
    else one suffix per axis in canonical order."""
    if len(specs) == 1 and specs[0].kind == "tp":
        return tp_key(key, specs[0].rank)
    parts = [key]
    for s in canonical(specs):
        suffix = f"__{s.kind}_{s.rank}of{s.size}"
        if s.split_dim is not None:
            suffix += f"_sd{s.split_dim}"
        if s.expert_id is not None:
            suffix += f"_eid{s.expert_id}"
        if s.stage_id is not None:
            suffix += f"_sid{s.stage_id}"
        parts.append(suffix)
    return "".join(parts)


# ------------------------------------------------------------------ parallelism specs

# One axis of a request, normalized: kind is one of AXIS_KINDS.
AxisSpec = namedtuple("AxisSpec", "kind rank size split_dim expert_id stage_id")


class ParallelAxis:
    """One axis of a tensor's parallel layout (upstream's ``ParallelAxis``): ``kind``
    ("tp", "dp", "ep" or "pp", any case), this shard's ``rank`` of ``size``, and
    ``split_dim`` (TP: required; others: None), ``expert_id`` (EP: required) or
    ``stage_id`` (PP: required). Checked when used."""

    __slots__ = ("kind", "rank", "size", "split_dim", "expert_id", "stage_id")

    def __init__(self, kind="", rank=0, size=1, split_dim=None, expert_id=None, stage_id=None):
        self.kind = kind
        self.rank = rank
        self.size = size
        self.split_dim = split_dim
        self.expert_id = expert_id
        self.stage_id = stage_id

    def __repr__(self):
        return (f"ParallelAxis(kind={self.kind!r}, rank={self.rank}, size={self.size}, "
                f"split_dim={self.split_dim}, expert_id={self.expert_id}, "
                f"stage_id={self.stage_id})")


class TensorParallelism:
    """A tensor's parallel layout: ``axes``, a list of ParallelAxis (at most 4, one per
    kind)."""

    __slots__ = ("axes",)

    def __init__(self, axes=None):
        self.axes = list(axes) if axes is not None else []

    def __repr__(self):
        return f"TensorParallelism(axes={self.axes!r})"


_MODES = ("as_stored", "shard", "full")


class ReadTarget:
    """What a read returns: ``mode`` "as_stored" (the object under the key), "shard" (the
    shard ``parallelism`` names, cut anew from the stored shards when none matches) or
    "full" (the whole tensor put back together); ``parallelism`` a TensorParallelism or
    None."""

    __slots__ = ("_mode", "parallelism")

    def __init__(self, mode="as_stored", parallelism=None):
        self.mode = mode
        self.parallelism = parallelism

    @property
    def mode(self):
        return self._mode

    @mode.setter
    def mode(self, value):
        self._mode = read_mode(value)

    def __repr__(self):
        return f"ReadTarget(mode={self._mode!r}, parallelism={self.parallelism!r})"


def read_mode(value):
    if not isinstance(value, str):
        raise TypeError(f"ReadTarget.mode: expected str, got {type(value).__name__}")
    if value.lower() not in _MODES:
        raise ValueError(f"ReadTarget.mode: {value!r} is not one of {', '.join(_MODES)}")
    return value.lower()


def _int_attr(obj, name, optional=False):
    value = getattr(obj, name, None)
    if value is None and optional:
        return None
    if isinstance(value, bool) or not isinstance(value, int):
        raise TypeError(f"{type(obj).__name__}.{name}: expected int, got "
                        f"{type(value).__name__}")
    return value


def parse_axes(parallelism):
    """AxisSpecs of a TensorParallelism-like object (anything with ``axes`` whose items
    have kind, rank, size and optional split_dim, expert_id, stage_id). TypeError when
    it is not shaped so; an unknown kind is kept as given for ``spec_problem`` to name."""
    axes = getattr(parallelism, "axes", None)
    if axes is None or isinstance(axes, (str, bytes)) or not hasattr(axes, "__iter__"):
        raise TypeError(f"parallelism: expected a TensorParallelism (with a list of axes), "
                        f"got {type(parallelism).__name__}")
    specs = []
    for axis in axes:
        kind = getattr(axis, "kind", None)
        if not isinstance(kind, str):
            raise TypeError(f"ParallelAxis.kind: expected str, got {type(kind).__name__}")
        specs.append(AxisSpec(kind.lower(), _int_attr(axis, "rank"), _int_attr(axis, "size"),
                              _int_attr(axis, "split_dim", True),
                              _int_attr(axis, "expert_id", True),
                              _int_attr(axis, "stage_id", True)))
    return specs


def spec_problem(specs):
    """Why upstream refuses this parallelism, or None when it is valid."""
    if not specs:
        return "parallelism axes cannot be empty"
    if len(specs) > MAX_AXES:
        return f"at most {MAX_AXES} axes"
    seen = set()
    for s in specs:
        if s.kind not in AXIS_KINDS:
            return f"unsupported axis kind {s.kind!r}"
        if not 0 <= s.rank < s.size:
            return f"{s.kind} axis: rank {s.rank} is not in [0, size {s.size})"
        if s.kind in seen:
            return f"two {s.kind} axes"
        seen.add(s.kind)
        if s.kind == "tp" and s.split_dim is None:
            return "a tp axis needs split_dim"
        if s.kind != "tp" and s.split_dim is not None:
            return f"a {s.kind} axis takes no split_dim"
        if s.kind == "ep" and s.expert_id is None:
            return "an ep axis needs expert_id"
        if s.kind == "pp" and s.stage_id is None:
            return "a pp axis needs stage_id"
    return None


def canonical(specs):
    return sorted(specs, key=lambda s: AXIS_KINDS.index(s.kind))


def tp_index(specs):
    return next((i for i, s in enumerate(specs) if s.kind == "tp"), None)


def with_tp(specs, rank, size=None):
    """``specs`` with the TP axis's rank (and size) replaced."""
    return [s._replace(rank=rank, size=s.size if size is None else size) if s.kind == "tp"
            else s for s in specs]


def same_but_tp_rank(a, b):
    """Two canonical parallelisms that name shards of one cut: equal axes, except that
    the TP ranks may differ."""
    return len(a) == len(b) and all(
        x._replace(rank=0) == y._replace(rank=0) if x.kind == "tp" else x == y
        for x, y in zip(a, b))


def parse_writer(obj):
    """(rank, size, split_dim) of a writer partition (any object with those int
    attributes), or a string saying why it is refused."""
    for name in ("rank", "size", "split_dim"):
        if not hasattr(obj, name):
            return "writer_partition must provide rank, size and split_dim"
    rank, size, split_dim = (_int_attr(obj, n) for n in ("rank", "size", "split_dim"))
    if size <= 0 or not 0 <= rank < size or split_dim < 0:
        return f"invalid writer partition (rank {rank}, size {size}, split_dim {split_dim})"
    return rank, size, split_dim
