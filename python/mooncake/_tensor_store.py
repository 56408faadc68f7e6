"""The tensor methods of MooncakeDistributedStore (upstream's ``put_tensor`` family), a
mixin over store.py's byte-level calls; objects are in ``_tensor_layout``'s format, the
one upstream's wheel writes, so either side reads what the other put. This module
writes; ``_tensor_read`` decodes and puts shards back together.

Conventions (upstream's): writes return 0 or a negative error code, INVALID_PARAMS
(-600) for what is not a storable tensor, a bad buffer or a cut upstream refuses (split
dimension out of range or not divisible by the shard count); reads return a
torch.Tensor or None; batch calls return one result per key, in order. As in store.py,
arguments of the wrong type raise TypeError and parallel lists of different lengths fail
every key with INVALID_PARAMS. A ``tp_size`` of 1 or less is a plain (unsharded) call, as
upstream's; with more shards a ``tp_rank`` outside [0, tp_size) raises ValueError.

Moving bytes: a CPU tensor is written from its own memory (header and data are two
parts of one object; no copy in Python); a non-contiguous tensor is made contiguous
first, and one on another device is copied to the host by torch. A read lands where the
returned tensor lives: ``get_tensor`` returns a view of the buffer the object was read
into, ``*_into`` a view of the caller's buffer, and shards are put back together by
ranged reads straight into the new tensor. Addresses given to ``*_from`` and ``*_into``
calls must lie in a buffer registered on this store (store.py's rule).
"""

import ctypes
import logging

from . import _native as N
from . import _tensor_layout as L
from ._common import check_int, check_str, int_list, lengths_match, str_list
from ._tensor_read import TensorReader, decode, memory, tensor_at, tensor_in

logger = logging.getLogger("mooncake")

INVALID_PARAMS = N.MC_ERR_INVALID_PARAMS
FILE_NOT_FOUND = -1100  # Mooncake's FILE_NOT_FOUND: save_tensor_to_safetensor of a miss
_INT32 = (-(1 << 31), (1 << 31) - 1)


def _store_api():
    """mooncake.store, imported when first needed (it imports this module)."""
    from . import store

    return store


# ------------------------------------------------------------------ writing


class _Object:
    """The bytes of one object to write: ``pieces``, (address, length) runs that
    concatenate to it; ``keep`` holds what they point into until the write returns."""

    __slots__ = ("pieces", "keep")

    def __init__(self, head, runs=(), owner=None):
        buf = ctypes.create_string_buffer(head, len(head))
        self.pieces = [(ctypes.addressof(buf), len(head))] + [r for r in runs if r[1]]
        self.keep = (buf, owner)


def _tensor_object(header, t):
    """The object of contiguous CPU tensor ``t`` under ``header``."""
    return _Object(header.pack(), [(t.data_ptr(), header.data_bytes)], t)


def _manifest_object(dtype, split_dim, count, global_shape):
    return _Object(L.pack_manifest(L.Manifest(dtype, split_dim, count, tuple(global_shape))))


def _host_tensor(tensor, what):
    """``tensor`` as a C-contiguous CPU tensor (copied only when it is not one), or None
    after logging why Mooncake cannot store it."""
    torch = L.torch_module()
    problem = None
    if not isinstance(tensor, torch.Tensor):
        problem = f"expected a torch.Tensor, got {type(tensor).__name__}"
    elif L.dtype_code(tensor.dtype) is None:
        problem = f"dtype {tensor.dtype} has no Mooncake code"
    elif tensor.dim() > L.MAX_DIMS:
        problem = f"{tensor.dim()} dimensions (at most {L.MAX_DIMS})"
    elif tensor.layout != torch.strided:
        problem = f"layout {tensor.layout} (only dense tensors)"
    if problem is None:
        try:
            t = tensor.detach()
            if t.device.type != "cpu":
                t = t.cpu()
            return t.resolve_conj().resolve_neg().contiguous()
        except (RuntimeError, NotImplementedError) as e:  # e.g. a meta tensor
            problem = f"cannot be copied to the host: {e}"
    logger.error("mooncake: %s: %s", what, problem)
    return None


def _whole_object(t):
    return _tensor_object(L.TensorHeader(L.dtype_code(t.dtype), t.shape), t)


def _narrow(t, split_dim, rank, count):
    start, extent = L.shard_range(t.shape[split_dim], rank, count)
    return t.narrow(split_dim, start, extent).contiguous()


def _cuttable(shape, split_dim, count, what):
    if not 0 <= split_dim < len(shape):
        logger.error("mooncake: %s: split_dim %d is out of range for a %d-d tensor", what,
                     split_dim, len(shape))
        return False
    if not L.uniform(shape[split_dim], count):
        logger.error("mooncake: %s: dimension %d (%d) does not split into %d equal shards",
                     what, split_dim, shape[split_dim], count)
        return False
    return True


def _all_tp_shards(key, t, specs, what):
    """(key, object) of every TP rank of host tensor ``t``, cut as the TP axis of
    ``specs`` says and named and labelled by ``specs`` with that rank; None when ``t``
    cannot be cut so."""
    tp = specs[L.tp_index(specs)]
    if not _cuttable(t.shape, tp.split_dim, tp.size, what):
        return None
    code = L.dtype_code(t.dtype)
    shards = []
    for rank in range(tp.size):
        shard = _narrow(t, tp.split_dim, rank, tp.size)
        ranked = L.with_tp(specs, rank)
        header = L.shard_header(code, t.shape, shard.shape, ranked)
        shards.append((L.parallelism_key(key, ranked), _tensor_object(header, shard)))
    return shards


def _legacy_tp(tp_size, split_dim):
    """The parallelism of upstream's ``*_with_tp`` calls (its shards are ``key_tp_<r>``)."""
    return [L.AxisSpec("tp", 0, tp_size, split_dim, None, None)]


def _parallel_steps(key, t, specs, writer, whole, what):
    """The writes, in order, each a list of (key, object), that store host tensor ``t``
    as ``specs`` or ``writer`` ask (upstream's routes); None when ``t`` cannot be cut so.

    writer (rank, size, split_dim): this rank's shard of the full ``t``, then a manifest.
    specs without TP: ``t`` as it is, labelled. With TP and ``whole`` (a ``*_from``
    call's full tensor): every rank's shard, no manifest. A lone TP axis: ``t`` is this
    rank's shard. TP with other axes: this rank's shard of the full ``t``. Both of the
    last two write a manifest."""
    code = L.dtype_code(t.dtype)
    if writer is not None:
        rank, size, split_dim = writer
        if not _cuttable(t.shape, split_dim, size, what):
            return None
        shard = _narrow(t, split_dim, rank, size)
        header = L.shard_header(code, t.shape, shard.shape,
                                [L.AxisSpec("tp", rank, size, split_dim, None, None)])
        return [[(L.writer_shard_key(key, rank, size, split_dim), _tensor_object(header, shard))],
                [(L.writer_manifest_key(key), _manifest_object(code, split_dim, size, t.shape))]]
    i = L.tp_index(specs)
    if i is None:
        header = L.shard_header(code, t.shape, t.shape, specs)
        return [[(L.parallelism_key(key, specs), _tensor_object(header, t))]]
    if whole:
        shards = _all_tp_shards(key, t, specs, what)
        return None if shards is None else [shards]
    tp = specs[i]
    if len(specs) == 1:
        if not _cuttable(t.shape, tp.split_dim, 1, what):
            return None
        shard, global_shape = t, list(t.shape)
        global_shape[tp.split_dim] *= tp.size
    else:
        if not _cuttable(t.shape, tp.split_dim, tp.size, what):
            return None
        shard, global_shape = _narrow(t, tp.split_dim, tp.rank, tp.size), list(t.shape)
    header = L.shard_header(code, global_shape, shard.shape, specs)
    return [[(L.parallelism_key(key, specs), _tensor_object(header, shard))],
            [(L.parallelism_manifest_key(key),
              _manifest_object(code, tp.split_dim, tp.size, global_shape))]]




def _requests(values, n, name):
    """A per-key list of requests (None: none given)."""
    if values is None:
        return [None] * n
    if isinstance(values, (str, bytes)) or not isinstance(values, (list, tuple)):
        raise TypeError(f"{name}: expected a list or None, got {type(values).__name__}")
    if len(values) != n:
        raise ValueError(f"{name} has {len(values)} entries for {n} keys")
    return list(values)


def _tp_args(tp_rank, tp_size, split_dim=0):
    """(rank, size, split_dim); upstream reads a size of 1 or less as "not sharded"."""
    size = check_int(tp_size, "tp_size", *_INT32)
    dim = check_int(split_dim, "split_dim", *_INT32)
    if size <= 1:
        check_int(tp_rank, "tp_rank", *_INT32)
        return 0, 1, dim
    return check_int(tp_rank, "tp_rank", 0, size - 1), size, dim


# ------------------------------------------------------------------ the mixin


class TensorStoreMixin(TensorReader):
    """Tensor methods of MooncakeDistributedStore; see the module docstring."""

    # ----------------------------------------------------------- plumbing

    def _write(self, groups, config, upsert, what):
        """Writes every object of ``groups`` (lists of (key, _Object); an int stands for
        a group already failed with that code) in one batch. Per group: 0, or the first
        error among its objects."""
        api = _store_api()
        keys, pieces, spans = [], [], []
        for g in groups:
            if isinstance(g, int):
                spans.append(g)
                continue
            spans.append((len(keys), len(g)))
            for key, obj in g:
                keys.append(api._encode_key(key))
                pieces.append(obj.pieces)
        res = self._put_parts(keys, pieces, config, upsert, what) if keys else []
        return [s if isinstance(s, int) else next((r for r in res[s[0]:s[0] + s[1]] if r), 0)
                for s in spans]

    def _write_steps(self, steps, config, upsert, what):
        """Writes the steps in order, stopping at the first that fails."""
        for step in steps:
            rc = self._write([step], config, upsert, what)[0]
            if rc:
                return rc
        return 0

    @staticmethod
    def _checked_config(config, what):
        """The ReplicateConfig to use (TypeError for another type), or None when upstream
        refuses it: preferred segments must be one per replica."""
        config = _store_api()._config(config)
        if config.preferred_segments and len(config.preferred_segments) != config.replica_num:
            logger.error("mooncake: %s: %d preferred segments for %d replicas", what,
                         len(config.preferred_segments), config.replica_num)
            return None
        return config

    def _write_each(self, keys, items, config, upsert, what, objects):
        """Per key, writes what ``objects(key, item)`` returns (a list of (key, _Object);
        None fails the key with INVALID_PARAMS), all in one batch."""
        config = self._checked_config(config, what)
        if not self._store or config is None:
            return [INVALID_PARAMS] * len(keys)
        groups = []
        for k, item in zip(keys, items):
            objs = objects(k, item)
            groups.append(INVALID_PARAMS if objs is None else objs)
        return self._write(groups, config, upsert, what)

    def _write_tensors(self, keys, tensors, config, upsert, what):
        keys, tensors = str_list(keys, "keys"), list(tensors)
        if not lengths_match(what, keys=keys, tensors_list=tensors):
            return [INVALID_PARAMS] * len(keys)

        def whole(k, t):
            host = _host_tensor(t, f"{what}({k!r})")
            return None if host is None else [(k, _whole_object(host))]

        return self._write_each(keys, tensors, config, upsert, what, whole)

    def _write_tp(self, base_keys, tensors, config, tp_size, split_dim, what, prepare=None):
        """Every shard of every tensor, cut as upstream's ``*_with_tp`` calls cut them;
        ``prepare(key, item)`` gives the host tensor of an item (default: _host_tensor)."""
        if tp_size == 1:
            return self._write_tensors(base_keys, tensors, config, False, what)
        keys, tensors = str_list(base_keys, "base_keys"), list(tensors)
        if not lengths_match(what, base_keys=keys, tensors_list=tensors):
            return [INVALID_PARAMS] * len(keys)
        specs = _legacy_tp(tp_size, split_dim)

        def shards(k, item):
            host = prepare(k, item) if prepare else _host_tensor(item, f"{what}({k!r})")
            return None if host is None else _all_tp_shards(k, host, specs, what)

        return self._write_each(keys, tensors, config, False, what, shards)

    def _object_at(self, addr, size, what):
        """The header of the tensor object at [addr, addr+size), which must lie in a
        registered buffer; None (logged) when it does not or holds no tensor."""
        if not self._zero_copy(addr, size):
            self._log_unregistered(addr, size)
            return None
        header = L.TensorHeader.unpack(memory(addr, size), size)
        if header is None:
            logger.error("mooncake: %s: [0x%x, +%d) is not a Mooncake tensor object", what,
                         addr, size)
        return header

    def _write_from(self, key, buffer_ptr, size, config, upsert, what):
        check_str(key, "key")
        addr, n = check_int(buffer_ptr, "buffer_ptr"), check_int(size, "size")
        if not self._store or self._object_at(addr, n, what) is None:
            return INVALID_PARAMS
        write = self.upsert_from if upsert else self.put_from
        return write(key, addr, n, config)

    def _write_batch_from(self, keys, buffer_ptrs, sizes, config, upsert, what):
        keys = str_list(keys, "keys")
        addrs, lens = int_list(buffer_ptrs, "buffer_ptrs"), int_list(sizes, "sizes")
        if not lengths_match(what, keys=keys, buffer_ptrs=addrs, sizes=lens) \
                or not self._store:
            return [INVALID_PARAMS] * len(keys)
        # Upstream refuses the whole batch when one buffer is not a tensor object.
        if any(self._object_at(a, n, what) is None for a, n in zip(addrs, lens)):
            return [INVALID_PARAMS] * len(keys)
        write = self.batch_upsert_from if upsert else self.batch_put_from
        return write(keys, addrs, lens, config) if keys else []

    def _decoded_at(self, addr, size, what):
        """The tensor object at a registered address, as a tensor over that memory."""
        header = self._object_at(addr, size, what)
        return None if header is None else decode(header, memory(addr, size))

    def _write_tp_from(self, base_keys, buffer_ptrs, sizes, tp_rank, tp_size, split_dim, what):
        keys = str_list(base_keys, "base_keys")
        spans = self._spans(buffer_ptrs, sizes, len(keys))
        _, tp_size, split_dim = _tp_args(tp_rank, tp_size, split_dim)
        if tp_size == 1:
            return self._write_batch_from(keys, buffer_ptrs, sizes, None, False, what)
        return self._write_tp(keys, spans, None, tp_size, split_dim, what,
                              lambda k, span: self._decoded_at(*span, what))

    def _write_parallel(self, key, tensor, span, parallelism, config, writer_partition,
                        upsert, what):
        """One ``*_tensor_with_parallelism[_from]`` write: ``tensor``, or the tensor
        object at ``span`` (address, size) when it is not None."""
        check_str(key, "key")
        if span is not None:
            span = check_int(span[0], "buffer_ptr"), check_int(span[1], "size")
        config = self._checked_config(config, what)
        writer = None if writer_partition is None else L.parse_writer(writer_partition)
        specs = None if parallelism is None else L.parse_axes(parallelism)
        problem = None
        if writer is not None and specs is not None:
            problem = "writer_partition cannot be combined with parallelism"
        elif isinstance(writer, str):
            problem = writer
        elif specs is not None:
            problem = L.spec_problem(specs)
        if problem:
            logger.error("mooncake: %s(%r): %s", what, key, problem)
        if problem or not self._store or config is None:
            return INVALID_PARAMS
        if writer is None and specs is None:
            if span is None:
                return self._write_tensors([key], [tensor], config, upsert, what)[0]
            return self._write_from(key, span[0], span[1], config, upsert, what)
        if span is None:
            t = _host_tensor(tensor, f"{what}({key!r})")
        else:
            t = self._decoded_at(span[0], span[1], what)
        steps = None if t is None else _parallel_steps(key, t, specs, writer, span is not None,
                                                       what)
        if steps is None:
            return INVALID_PARAMS
        return self._write_steps(steps, config, upsert, what)

    def _write_parallel_batch(self, keys, values, spans, parallelisms, config,
                              writer_partitions, upsert, what):
        """Batch form of _write_parallel: ``values`` tensors, or None with ``spans``."""
        keys = str_list(keys, "keys")
        n = len(keys)
        if spans is None:
            values = list(values)
            if not lengths_match(what, keys=keys, tensors_list=values):
                return [INVALID_PARAMS] * n
        pars = _requests(parallelisms, n, "parallelisms")
        writers = _requests(writer_partitions, n, "writer_partitions")
        if parallelisms is None and writer_partitions is None:
            if spans is None:
                return self._write_tensors(keys, values, config, upsert, what)
            config = self._checked_config(config, what)
            if config is None:
                return [INVALID_PARAMS] * n
            return self._write_batch_from(keys, [a for a, _ in spans], [s for _, s in spans],
                                          config, upsert, what)
        if parallelisms is not None and writer_partitions is not None:
            logger.error("mooncake: %s: writer_partitions cannot be combined with "
                         "parallelisms", what)
            return [INVALID_PARAMS] * n
        return [self._write_parallel(k, values[i] if spans is None else None,
                                     None if spans is None else spans[i], pars[i], config,
                                     writers[i], upsert, what)
                for i, k in enumerate(keys)]

    @staticmethod
    def _spans(buffer_ptrs, sizes, n):
        addrs, lens = int_list(buffer_ptrs, "buffer_ptrs"), int_list(sizes, "sizes")
        if not len(addrs) == len(lens) == n:
            raise ValueError(f"lists of different lengths: keys={n}, buffer_ptrs="
                             f"{len(addrs)}, sizes={len(lens)}")
        return list(zip(addrs, lens))

    # ----------------------------------------------------------- whole tensors

    def put_tensor(self, key, tensor):
        """Stores a torch tensor under ``key``: 0 or a negative code."""
        return self._write_tensors([check_str(key, "key")], [tensor], None, False,
                                   "put_tensor")[0]

    def upsert_tensor(self, key, tensor):
        """As put_tensor, replacing an existing value."""
        return self._write_tensors([check_str(key, "key")], [tensor], None, True,
                                   "upsert_tensor")[0]

    def pub_tensor(self, key, tensor, config=None):
        """As put_tensor, with a ReplicateConfig."""
        return self._write_tensors([check_str(key, "key")], [tensor], config, False,
                                   "pub_tensor")[0]

    def upsert_pub_tensor(self, key, tensor, config=None):
        return self._write_tensors([check_str(key, "key")], [tensor], config, True,
                                   "upsert_pub_tensor")[0]

    def batch_put_tensor(self, keys, tensors_list):
        return self._write_tensors(keys, tensors_list, None, False, "batch_put_tensor")

    def batch_upsert_tensor(self, keys, tensors_list):
        return self._write_tensors(keys, tensors_list, None, True, "batch_upsert_tensor")

    def batch_pub_tensor(self, keys, tensors_list, config=None):
        return self._write_tensors(keys, tensors_list, config, False, "batch_pub_tensor")

    def batch_upsert_pub_tensor(self, keys, tensors_list, config=None):
        return self._write_tensors(keys, tensors_list, config, True, "batch_upsert_pub_tensor")

    def get_tensor(self, key):
        """The tensor under ``key`` (a view of the buffer it was read into), or None."""
        check_str(key, "key")
        if not self._store:
            return None
        return tensor_in(self.get_buffer(key), f"get_tensor({key!r})")

    def batch_get_tensor(self, keys):
        keys = str_list(keys, "keys")
        if not self._store:
            return [None] * len(keys)
        return [tensor_in(b, f"batch_get_tensor({k!r})")
                for k, b in zip(keys, self.batch_get_buffer(keys))]

    def get_tensor_into(self, key, buffer_ptr, size):
        """Reads the object under ``key`` into a registered buffer; the tensor (a view of
        that buffer) or None (also when the buffer is too small)."""
        check_str(key, "key")
        addr = check_int(buffer_ptr, "buffer_ptr")
        if not self._store:
            return None
        return tensor_at(addr, self.get_into(key, addr, size), f"get_tensor_into({key!r})")

    def batch_get_tensor_into(self, keys, buffer_ptrs, sizes):
        keys = str_list(keys, "keys")
        addrs = int_list(buffer_ptrs, "buffer_ptrs")
        lens = int_list(sizes, "sizes")
        if not self._store:
            return [None] * len(keys)
        if not lengths_match("batch_get_tensor_into", keys=keys, buffer_ptrs=addrs, sizes=lens):
            return [INVALID_PARAMS] * len(keys)
        got = self.batch_get_into(keys, addrs, lens)
        return [tensor_at(a, n, f"batch_get_tensor_into({k!r})")
                for k, a, n in zip(keys, addrs, got)]

    def get_tensor_into_cuda(self, key, tensor):
        """Reads the tensor under ``key`` into ``tensor`` (contiguous, same dtype and
        shape; a CUDA tensor, or any other): the bytes read or a negative code."""
        return self.batch_get_tensor_into_cuda([check_str(key, "key")], [tensor])[0]

    def batch_get_tensor_into_cuda(self, keys, tensors_list):
        keys = str_list(keys, "keys")
        tensors = list(tensors_list)
        if not lengths_match("batch_get_tensor_into_cuda", keys=keys, tensors_list=tensors) \
                or not self._store:
            return [INVALID_PARAMS] * len(keys)
        return [self._fill(k, h, t, "batch_get_tensor_into_cuda")
                for k, h, t in zip(keys, self._headers(keys), tensors)]

    # ----------------------------------------------------------- from tensor objects

    def put_tensor_from(self, key, buffer_ptr, size):
        """Stores the tensor object (header and data, as get_tensor_into leaves it) at
        ``buffer_ptr`` in a registered buffer."""
        return self._write_from(key, buffer_ptr, size, None, False, "put_tensor_from")

    def upsert_tensor_from(self, key, buffer_ptr, size):
        return self._write_from(key, buffer_ptr, size, None, True, "upsert_tensor_from")

    def batch_put_tensor_from(self, keys, buffer_ptrs, sizes):
        return self._write_batch_from(keys, buffer_ptrs, sizes, None, False,
                                      "batch_put_tensor_from")

    def batch_upsert_tensor_from(self, keys, buffer_ptrs, sizes):
        return self._write_batch_from(keys, buffer_ptrs, sizes, None, True,
                                      "batch_upsert_tensor_from")

    # ----------------------------------------------------------- tensor parallelism

    def put_tensor_with_tp(self, key, tensor, tp_rank=0, tp_size=1, split_dim=0):
        """Cuts ``tensor`` into ``tp_size`` equal shards along ``split_dim`` and stores
        every one, shard r under ``key_tp_<r>`` (tp_size 1: put_tensor)."""
        _, tp_size, split_dim = _tp_args(tp_rank, tp_size, split_dim)
        return self._write_tp([check_str(key, "key")], [tensor], None, tp_size,
                              split_dim, "put_tensor_with_tp")[0]

    def pub_tensor_with_tp(self, key, tensor, config=None, tp_rank=0, tp_size=1, split_dim=0):
        _, tp_size, split_dim = _tp_args(tp_rank, tp_size, split_dim)
        return self._write_tp([check_str(key, "key")], [tensor], config, tp_size,
                              split_dim, "pub_tensor_with_tp")[0]

    def batch_put_tensor_with_tp(self, base_keys, tensors_list, tp_rank=0, tp_size=1,
                                 split_dim=0):
        _, tp_size, split_dim = _tp_args(tp_rank, tp_size, split_dim)
        return self._write_tp(base_keys, tensors_list, None, tp_size, split_dim,
                              "batch_put_tensor_with_tp")

    def batch_pub_tensor_with_tp(self, base_keys, tensors_list, config=None, tp_rank=0,
                                 tp_size=1, split_dim=0):
        _, tp_size, split_dim = _tp_args(tp_rank, tp_size, split_dim)
        return self._write_tp(base_keys, tensors_list, config, tp_size, split_dim,
                              "batch_pub_tensor_with_tp")

    def put_tensor_with_tp_from(self, key, buffer_ptr, size, tp_rank=0, tp_size=1,
                                split_dim=0):
        """As put_tensor_with_tp, for the tensor object at ``buffer_ptr`` (registered)."""
        return self._write_tp_from([check_str(key, "key")], [buffer_ptr], [size], tp_rank,
                                   tp_size, split_dim, "put_tensor_with_tp_from")[0]

    def batch_put_tensor_with_tp_from(self, base_keys, buffer_ptrs, sizes, tp_rank=0,
                                      tp_size=1, split_dim=0):
        return self._write_tp_from(base_keys, buffer_ptrs, sizes, tp_rank, tp_size, split_dim,
                                   "batch_put_tensor_with_tp_from")

    def get_tensor_with_tp(self, key, tp_rank=0, tp_size=1, split_dim=0):
        """Shard ``tp_rank`` as stored by put_tensor_with_tp (tp_size 1: the tensor under
        ``key``), or None."""
        rank, size, _ = _tp_args(tp_rank, tp_size, split_dim)
        return self.get_tensor(L.tp_read_key(check_str(key, "key"), rank, size))

    def batch_get_tensor_with_tp(self, base_keys, tp_rank=0, tp_size=1):
        rank, size, _ = _tp_args(tp_rank, tp_size)
        keys = str_list(base_keys, "base_keys")
        return self.batch_get_tensor([L.tp_read_key(k, rank, size) for k in keys])

    def get_tensor_with_tp_into(self, key, buffer_ptr, size, tp_rank=0, tp_size=1,
                                split_dim=0):
        rank, tp, _ = _tp_args(tp_rank, tp_size, split_dim)
        return self.get_tensor_into(L.tp_read_key(check_str(key, "key"), rank, tp),
                                    buffer_ptr, size)

    def batch_get_tensor_with_tp_into(self, base_keys, buffer_ptrs, sizes, tp_rank=0,
                                      tp_size=1):
        rank, tp, _ = _tp_args(tp_rank, tp_size)
        keys = str_list(base_keys, "base_keys")
        return self.batch_get_tensor_into([L.tp_read_key(k, rank, tp) for k in keys],
                                          buffer_ptrs, sizes)

    # ----------------------------------------------------------- parallelism specs

    def put_tensor_with_parallelism(self, key, tensor, parallelism=None, config=None,
                                    writer_partition=None):
        """Stores ``tensor`` as a TensorParallelism names it, or this writer's shard of it
        (``writer_partition``: rank, size, split_dim), or whole when neither is given."""
        return self._write_parallel(key, tensor, None, parallelism, config, writer_partition,
                                    False, "put_tensor_with_parallelism")

    def upsert_tensor_with_parallelism(self, key, tensor, parallelism=None, config=None,
                                       writer_partition=None):
        return self._write_parallel(key, tensor, None, parallelism, config, writer_partition,
                                    True, "upsert_tensor_with_parallelism")

    def put_tensor_with_parallelism_from(self, key, buffer_ptr, size, parallelism=None,
                                         config=None, writer_partition=None):
        """As put_tensor_with_parallelism for the full tensor object at ``buffer_ptr``
        (registered); a TP parallelism stores the shards of every TP rank."""
        return self._write_parallel(key, None, (buffer_ptr, size), parallelism, config,
                                    writer_partition, False, "put_tensor_with_parallelism_from")

    def upsert_tensor_with_parallelism_from(self, key, buffer_ptr, size, parallelism=None,
                                            config=None, writer_partition=None):
        return self._write_parallel(key, None, (buffer_ptr, size), parallelism, config,
                                    writer_partition, True,
                                    "upsert_tensor_with_parallelism_from")

    def batch_put_tensor_with_parallelism(self, keys, tensors_list, parallelisms=None,
                                          config=None, writer_partitions=None):
        return self._write_parallel_batch(keys, tensors_list, None, parallelisms, config,
                                          writer_partitions, False,
                                          "batch_put_tensor_with_parallelism")

    def batch_upsert_tensor_with_parallelism(self, keys, tensors_list, parallelisms=None,
                                             config=None, writer_partitions=None):
        return self._write_parallel_batch(keys, tensors_list, None, parallelisms, config,
                                          writer_partitions, True,
                                          "batch_upsert_tensor_with_parallelism")

    def batch_put_tensor_with_parallelism_from(self, keys, buffer_ptrs, sizes,
                                               parallelisms=None, config=None,
                                               writer_partitions=None):
        spans = self._spans(buffer_ptrs, sizes, len(str_list(keys, "keys")))
        return self._write_parallel_batch(keys, None, spans, parallelisms, config,
                                          writer_partitions, False,
                                          "batch_put_tensor_with_parallelism_from")

    def batch_upsert_tensor_with_parallelism_from(self, keys, buffer_ptrs, sizes,
                                                  parallelisms=None, config=None,
                                                  writer_partitions=None):
        spans = self._spans(buffer_ptrs, sizes, len(str_list(keys, "keys")))
        return self._write_parallel_batch(keys, None, spans, parallelisms, config,
                                          writer_partitions, True,
                                          "batch_upsert_tensor_with_parallelism_from")

    def get_tensor_with_parallelism(self, key, target=None):
        """Reads as a ReadTarget says: as stored (None), one shard, or the full tensor
        put back together from its shards. The tensor or None."""
        return self._read_with_target(key, target, "get_tensor_with_parallelism")

    def batch_get_tensor_with_parallelism(self, keys, targets=None):
        keys = str_list(keys, "keys")
        if targets is None:
            return self.batch_get_tensor(keys)
        return [self._read_with_target(k, t, "batch_get_tensor_with_parallelism")
                for k, t in zip(keys, _requests(targets, len(keys), "targets"))]

    def get_tensor_with_parallelism_into(self, key, buffer_ptr, size, target=None):
        """As get_tensor_with_parallelism, into a registered buffer (a tensor object:
        header, then data); the tensor is a view of it."""
        return self._read_into_with_target(key, buffer_ptr, size, target,
                                           "get_tensor_with_parallelism_into")

    def batch_get_tensor_with_parallelism_into(self, keys, buffer_ptrs, sizes, targets=None):
        keys = str_list(keys, "keys")
        spans = self._spans(buffer_ptrs, sizes, len(keys))
        return [self._read_into_with_target(k, a, n, t, "batch_get_tensor_with_parallelism_into")
                for k, (a, n), t in zip(keys, spans, _requests(targets, len(keys), "targets"))]

    # ----------------------------------------------------------- safetensors files

    def save_tensor_to_safetensor(self, key, file_name=None):
        """Writes the tensor under ``key`` to a safetensors file (default name: the key),
        as the file's entry ``key``. 0, FILE_NOT_FOUND (-1100) when there is no such
        tensor, or INVALID_PARAMS when the file cannot be written."""
        check_str(key, "key")
        if file_name is not None:
            check_str(file_name, "file_name")
        if not self._store:
            return INVALID_PARAMS
        tensor = self.get_tensor(key)
        if tensor is None:
            logger.error("mooncake: save_tensor_to_safetensor: no tensor under %r", key)
            return FILE_NOT_FOUND
        try:
            from safetensors.torch import save_file

            save_file({key: tensor}, key if file_name is None else file_name)
        except Exception as e:  # the library's failure becomes a code, as upstream's
            logger.error("mooncake: save_tensor_to_safetensor(%r): %s", key, e)
            return INVALID_PARAMS
        return 0

    def load_tensor_from_safetensor(self, key=None, file_name=None):
        """Stores a tensor of a safetensors file under ``key`` (default: the file name):
        the entry named ``key``, else the first entry (logged). The tensor, or None."""
        if file_name is None:
            raise TypeError("load_tensor_from_safetensor() missing required argument "
                            "'file_name'")
        check_str(file_name, "file_name")
        if key is not None:
            check_str(key, "key")
        if not self._store:
            return None
        try:
            from safetensors.torch import load_file

            loaded = load_file(file_name)
        except Exception as e:  # a missing or malformed file: None, as upstream
            logger.error("mooncake: load_tensor_from_safetensor(%r): %s", file_name, e)
            return None
        if not loaded:
            logger.error("mooncake: load_tensor_from_safetensor: %r holds no tensor", file_name)
            return None
        if key is not None and key not in loaded:
            logger.warning("mooncake: load_tensor_from_safetensor: %r has no entry %r; "
                           "storing its first entry", file_name, key)
        tensor = loaded[key] if key in loaded else next(iter(loaded.values()))
        store_key = file_name if key is None else key
        rc = self.put_tensor(store_key, tensor)
        if rc:
            logger.error("mooncake: load_tensor_from_safetensor: storing %r failed (%d)",
                         store_key, rc)
            return None
        return tensor
