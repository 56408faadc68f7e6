"""Reading tensors back: decoding a tensor object into a tensor over the memory it was
read into, and putting a tensor (or a shard cut anew) together from its stored shards by
ranged reads straight into the destination, as a ReadTarget asks (upstream's routes:
the shard named by the parallelism, else a writer partition, else a rebuild from the
shards a manifest or the shard names give). A mixin of MooncakeDistributedStore, used by
_tensor_store."""

import contextlib
import ctypes
import logging
from collections import namedtuple

from . import _native as N
from . import _tensor_layout as L
from ._common import check_int, check_str

logger = logging.getLogger("mooncake")

INVALID_PARAMS = N.MC_ERR_INVALID_PARAMS


def decode(header, buf):
    """The tensor ``header`` describes, over the memory of ``buf`` (a writable
    bytes-like object holding the whole object): a view, not a copy."""
    torch = L.torch_module()
    dtype = L.torch_dtype(header.dtype)
    if header.data_bytes == 0:
        return torch.empty(header.local_shape, dtype=dtype)
    flat = torch.frombuffer(buf, dtype=dtype, offset=header.data_offset,
                            count=header.data_bytes // L.element_size(header.dtype))
    # A view costs as much as the read's own bookkeeping: only where it changes something.
    return flat if len(header.local_shape) == 1 else flat.view(header.local_shape)


def tensor_in(buf, what):
    """The tensor stored in ``buf`` (a whole object), or None."""
    if buf is None:
        return None
    header = L.TensorHeader.unpack(buf, len(buf))
    if header is None:
        logger.error("mooncake: %s: the object is not a Mooncake tensor", what)
        return None
    return decode(header, buf)


def memory(addr, size):
    return (ctypes.c_char * size).from_address(addr)


def tensor_at(addr, length, what):
    """The tensor of the object read to ``addr`` (``length`` bytes, or a negative code)."""
    if length < 0:
        logger.debug("mooncake: %s: read failed (%d)", what, length)
        return None
    return tensor_in(memory(addr, length), what)


# Shards to put a tensor back together from: ``sources`` (key, header), the global
# shape and dtype, and the dimension they were cut along.
_Sources = namedtuple("_Sources", "sources global_shape split_dim dtype")
# A part [start, start + extent) of the split dimension to rebuild, with its header.
_Rebuild = namedtuple("_Rebuild", "sources start extent header")


def _whole(srcs):
    g = srcs.global_shape
    return _Rebuild(srcs, 0, g[srcs.split_dim], L.TensorHeader(srcs.dtype, g))


def _shard_of(srcs, specs):
    tp = specs[L.tp_index(specs)]
    start, extent = L.shard_range(srcs.global_shape[srcs.split_dim], tp.rank, tp.size)
    shape = list(srcs.global_shape)
    shape[srcs.split_dim] = extent
    return _Rebuild(srcs, start, extent, L.shard_header(srcs.dtype, srcs.global_shape, shape,
                                                         specs))


def _placement(header, srcs, what):
    """(start, extent) along the split dimension of the shard ``header`` describes, or
    None when it is not a TP shard of ``srcs``'s tensor."""
    g, sd = srcs.global_shape, srcs.split_dim
    tp = header.axis_of_kind("tp") if header.layout == L.SHARD else None
    ok = (tp is not None and header.dtype == srcs.dtype and len(header.local_shape) == len(g)
          and tp.split_dim == sd and L.uniform(g[sd], tp.count)
          and all(a == b for i, (a, b) in enumerate(zip(header.local_shape, g)) if i != sd))
    if ok:
        start, extent = L.shard_range(g[sd], tp.rank, tp.count)
        if header.local_shape[sd] == extent:
            return start, extent
    logger.error("mooncake: %s: a stored shard does not fit the tensor", what)
    return None


def _runs(plan, what):
    """(key, dst offset, src offset, length) copies that fill ``plan``'s part of the
    tensor (C order) from its shards; None when the shards do not cover it."""
    srcs = plan.sources
    g, sd = srcs.global_shape, srcs.split_dim
    outer = L.numel(g[:sd])
    row = L.numel(g[sd + 1:]) * L.element_size(srcs.dtype)
    covered = [False] * plan.extent
    runs = []
    for key, header in srcs.sources:
        placed = _placement(header, srcs, what)
        if placed is None:
            return None
        start, extent = placed
        lo, hi = max(start, plan.start), min(start + extent, plan.start + plan.extent)
        if hi <= lo:
            continue
        covered[lo - plan.start:hi - plan.start] = [True] * (hi - lo)
        if row == 0:
            continue
        for i in range(outer):
            runs.append((key, (i * plan.extent + lo - plan.start) * row,
                         header.data_offset + (i * extent + lo - start) * row, (hi - lo) * row))
    if not all(covered):
        logger.error("mooncake: %s: the stored shards do not cover the tensor", what)
        return None
    return runs


def _read_target(target):
    """(mode, AxisSpecs or None) of a ReadTarget-like object (None: as stored)."""
    if target is None:
        return "as_stored", None
    if not (hasattr(target, "mode") and hasattr(target, "parallelism")):
        raise TypeError(f"target: expected a ReadTarget, got {type(target).__name__}")
    mode = L.read_mode(target.mode)
    p = target.parallelism
    return mode, (None if p is None else L.parse_axes(p))


class TensorReader:
    """Reads of tensors built from shards; see the module docstring. Needs the store's
    get_buffer, get_into_ranges, register_buffer, unregister_buffer, get_tensor,
    get_tensor_into, _zero_copy and _log_unregistered."""

    @contextlib.contextmanager
    def _registration(self, addr, size):
        """Registers [addr, addr+size) for the block unless a registration covers it
        already; yields whether it is covered."""
        if size == 0 or self._zero_copy(addr, size):
            yield True
            return
        if self.register_buffer(addr, size) != 0:
            yield False
            return
        try:
            yield True
        finally:
            self.unregister_buffer(addr)

    def _read_runs(self, addr, size, runs):
        """Reads ``runs`` (key, dst offset, src offset, length) into [addr, addr+size);
        0, or the first error."""
        if not runs:
            return 0
        order, by_key = [], {}
        for key, dst, src, n in runs:
            if key not in by_key:
                order.append(key)
                by_key[key] = ([], [], [])
            for lst, v in zip(by_key[key], (dst, src, n)):
                lst.append(v)
        with self._registration(addr, size) as ok:
            if not ok:
                return INVALID_PARAMS
            res = self.get_into_ranges([addr], [order], [[by_key[k][0] for k in order]],
                                       [[by_key[k][1] for k in order]],
                                       [[by_key[k][2] for k in order]])
        for key, got in zip(order, res[0]):
            if got != by_key[key][2]:
                return next((r for r in got if r < 0), INVALID_PARAMS)
        return 0

    def _headers(self, keys):
        """The tensor header of each key (read as a 304-byte range), None where there is
        none."""
        if not keys:
            return []
        size = L.HEADER_SIZE
        scratch = ctypes.create_string_buffer(size * len(keys))
        addr = ctypes.addressof(scratch)
        with self._registration(addr, len(scratch)) as ok:
            if not ok:
                return [None] * len(keys)
            n = len(keys)
            res = self.get_into_ranges([addr], [keys], [[[i * size] for i in range(n)]],
                                       [[[0]] * n], [[[size]] * n])
        raw = scratch.raw
        return [L.TensorHeader.unpack(raw[i * size:(i + 1) * size]) if got == [size] else None
                for i, got in enumerate(res[0])]

    def _sources(self, keys, fits, what):
        """(key, header) of every key, when each header passes ``fits(rank, header)``."""
        headers = self._headers(keys)
        for rank, (key, header) in enumerate(zip(keys, headers)):
            if header is None or not fits(rank, header):
                logger.debug("mooncake: %s: %r is missing or not the expected shard", what, key)
                return None
        return list(zip(keys, headers))

    # ----------------------------------------------------------- reconstruction

    def _manifest_sources(self, key, specs, what):
        """The shards a parallelism manifest lists (upstream's first route)."""
        m = L.unpack_manifest(self.get_buffer(L.parallelism_manifest_key(key)))
        tp = specs[L.tp_index(specs)]
        if m is None or m.split_dim != tp.split_dim or not (
                L.uniform(m.global_shape[m.split_dim], tp.size)
                and L.uniform(m.global_shape[m.split_dim], m.shard_count)):
            return None
        want = [L.with_tp(L.canonical(specs), r, m.shard_count) for r in range(m.shard_count)]
        sources = self._sources(
            [L.parallelism_key(key, w) for w in want],
            lambda r, h: L.same_but_tp_rank(L.specs_of(h) or [], want[r]), what)
        return sources and _Sources(sources, m.global_shape, m.split_dim, m.dtype)

    def _legacy_tp_sources(self, key, tp, what):
        """The ``key_tp_<r>`` shards, however many the stored ones say there are."""
        first = self._headers([L.tp_read_key(key, 0, tp.size)])[0]
        axis = first.axis_of_kind("tp") if first and first.layout == L.SHARD else None
        if axis is None or axis.split_dim != tp.split_dim:
            logger.error("mooncake: %s(%r): no TP shards cut along dimension %s", what, key,
                         tp.split_dim)
            return None
        g, sd, count = first.global_shape, axis.split_dim, axis.count
        if not (L.uniform(g[sd], tp.size) and L.uniform(g[sd], count)):
            logger.error("mooncake: %s(%r): only equal shards are supported", what, key)
            return None

        def fits(rank, h):
            a = h.axis_of_kind("tp") if h.layout == L.SHARD else None
            return a is not None and (a.rank, a.count, a.split_dim) == (rank, count, sd)

        sources = self._sources([L.tp_read_key(key, r, count) for r in range(count)], fits,
                                what)
        return sources and _Sources(sources, g, sd, first.dtype)

    def _named_sources(self, key, specs, what):
        """The shards named by ``specs`` with each TP rank (no manifest, several axes)."""
        want = L.canonical(specs)
        tp = want[L.tp_index(want)]
        sources = self._sources(
            [L.parallelism_key(key, L.with_tp(want, r)) for r in range(tp.size)],
            lambda r, h: L.same_but_tp_rank(L.specs_of(h) or [], want), what)
        if not sources:
            return None
        first = sources[0][1]
        g, sd = first.global_shape, first.axis_of_kind("tp").split_dim
        if sd != tp.split_dim or not L.uniform(g[sd], tp.size):
            logger.error("mooncake: %s(%r): the shards are not cut as asked", what, key)
            return None
        return _Sources(sources, g, sd, first.dtype)

    def _tp_sources(self, key, specs, what):
        """The stored shards of the tensor ``specs`` (with a TP axis) is a part of."""
        srcs = self._manifest_sources(key, specs, what)
        if srcs is None and len(specs) == 1:
            srcs = self._legacy_tp_sources(key, specs[0], what)
        elif srcs is None:
            srcs = self._named_sources(key, specs, what)
        return srcs

    def _writer_sources(self, key, what):
        """The shards a writer manifest lists, or None when there are none (or they do
        not match it)."""
        m = L.unpack_manifest(self.get_buffer(L.writer_manifest_key(key)))
        if m is None:
            return None
        n, sd = m.shard_count, m.split_dim
        sources = self._sources(
            [L.writer_shard_key(key, r, n, sd) for r in range(n)],
            lambda r, h: L.specs_of(h) == [L.AxisSpec("tp", r, n, sd, None, None)], what)
        return sources and _Sources(sources, m.global_shape, sd, m.dtype)

    def _plan_read(self, key, target, what, legacy_fallback):
        """What a ReadTarget read fetches: ("key", k), the object under k as stored;
        ("rebuild", _Rebuild), a tensor put together from shards; or None (logged)."""
        mode, specs = _read_target(target)
        if specs is None and mode == "as_stored":
            return "key", key
        if specs is None and mode == "full":
            srcs = self._writer_sources(key, what)
            return ("rebuild", _whole(srcs)) if srcs else ("key", key)
        problem = "parallelism is required" if specs is None else L.spec_problem(specs)
        if problem is None and mode == "as_stored":
            problem = "mode as_stored takes no parallelism"
        if problem is None and mode == "full" and L.tp_index(specs) is None:
            problem = "a full read needs a tp axis"
        if problem:
            logger.error("mooncake: %s(%r): %s", what, key, problem)
            return None
        if mode == "full":
            srcs = self._tp_sources(key, specs, what)
            return srcs and ("rebuild", _whole(srcs))
        return self._plan_shard(key, specs, what, legacy_fallback)

    def _plan_shard(self, key, specs, what, legacy_fallback):
        lone_tp = len(specs) == 1 and specs[0].kind == "tp"
        candidates = [L.parallelism_key(key, specs)]
        if lone_tp:
            s = specs[0]
            candidates.append(L.writer_shard_key(key, s.rank, s.size, s.split_dim))
        want = L.canonical(specs)
        for k, header in zip(candidates, self._headers(candidates)):
            if header is not None and L.specs_of(header) == want:
                return "key", k
        if L.tp_index(specs) is not None:
            srcs = self._tp_sources(key, specs, what)
            if srcs:
                return "rebuild", _shard_of(srcs, specs)
        if lone_tp and legacy_fallback:
            return "key", L.tp_read_key(key, specs[0].rank, specs[0].size)
        logger.error("mooncake: %s(%r): no stored shard matches the parallelism", what, key)
        return None

    def _rebuild(self, plan, what):
        """A new tensor holding ``plan``'s part, read from the shards in place."""
        runs = _runs(plan, what)
        if runs is None:
            return None
        h = plan.header
        t = L.torch_module().empty(h.local_shape, dtype=L.torch_dtype(h.dtype))
        if self._read_runs(t.data_ptr(), h.data_bytes, runs):
            return None
        return t

    def _rebuild_into(self, plan, addr, size, what):
        """``plan``'s part read into the caller's registered buffer as a tensor object."""
        runs = _runs(plan, what)
        h = plan.header
        if runs is None:
            return None
        if h.total > size:
            logger.error("mooncake: %s: the buffer (%d bytes) is smaller than the tensor "
                         "(%d)", what, size, h.total)
            return None
        if not self._zero_copy(addr, h.total):
            self._log_unregistered(addr, h.total)
            return None
        runs = [(k, dst + h.data_offset, src, n) for k, dst, src, n in runs]
        if self._read_runs(addr, h.total, runs):
            return None
        ctypes.memmove(addr, h.pack(), L.HEADER_SIZE)
        return decode(h, memory(addr, h.total))

    def _read_with_target(self, key, target, what):
        check_str(key, "key")
        if not self._store:
            return None
        plan = self._plan_read(key, target, what, legacy_fallback=True)
        if plan is None:
            return None
        kind, arg = plan
        return self.get_tensor(arg) if kind == "key" else self._rebuild(arg, what)

    def _read_into_with_target(self, key, addr, size, target, what):
        check_str(key, "key")
        addr, size = check_int(addr, "buffer_ptr"), check_int(size, "size")
        if not self._store:
            return None
        plan = self._plan_read(key, target, what, legacy_fallback=False)
        if plan is None:
            return None
        kind, arg = plan
        if kind == "key":
            return self.get_tensor_into(arg, addr, size)
        return self._rebuild_into(arg, addr, size, what)

    def _fill(self, key, header, dst, what):
        """Reads the payload of ``key`` (its ``header``) into tensor ``dst`` of the same
        dtype and shape, on any device; the bytes read or a negative code."""
        torch = L.torch_module()
        if header is None:
            logger.error("mooncake: %s: no tensor under %r", what, key)
            return INVALID_PARAMS
        if not (isinstance(dst, torch.Tensor) and dst.is_contiguous()
                and L.dtype_code(dst.dtype) == header.dtype
                and tuple(dst.shape) == header.local_shape):
            logger.error("mooncake: %s: the destination for %r is not a contiguous %s tensor "
                         "of shape %s", what, key, L.DTYPES[header.dtype][0],
                         header.local_shape)
            return INVALID_PARAMS
        if header.data_bytes == 0:
            return 0
        host = dst if dst.device.type == "cpu" else torch.empty_like(dst, device="cpu")
        rc = self._read_runs(host.data_ptr(), header.data_bytes,
                             [(key, 0, header.data_offset, header.data_bytes)])
        if rc:
            return rc
        if host is not dst:
            dst.copy_(host)
        return header.data_bytes
