"""The rest of upstream's ``MooncakeDistributedStore``: put and get sessions with ranged
multi-buffer transfers, copy and move tasks, extra segments (``mount_segment``,
``allocate_and_mount_segment`` and their unmounts), the disk tier's unmount,
``alloc_from_mem_pool``, ``init_all`` and ``get_offload_rpc_read_count``.

``StoreSurfaceMixin`` is a base of ``MooncakeDistributedStore``; its methods follow the
conventions of ``mooncake.store`` (calls before setup give INVALID_PARAMS, wrong types
raise TypeError, parallel lists of different lengths fail with INVALID_PARAMS) and
upstream's argument names, defaults and return forms. Where upstream answers -1 for a
failure, these give the specific negative Mooncake code (still non-zero).

Tasks are the creating store's: ``query_task`` of another store does not know their ids
(TASK_NOT_FOUND, -1400).
"""

import ctypes
import enum
import json
import logging
import mmap
import os

from . import _native as N
from ._common import check_int, check_str, int_list, lengths_match
from ._replicate import SAME_NODE_PASSED, _refusal

logger = logging.getLogger("mooncake")

INVALID_PARAMS = N.MC_ERR_INVALID_PARAMS
INVALID_KEY = N.MC_ERR_INVALID_KEY

TASK_NOT_FOUND = -1400
_SEGMENT_ID_BYTES = 64
_INIT_ALL_LOCAL_BUFFER = 1 << 30  # upstream's init_all
_DEFAULT_MASTER = "127.0.0.1:50051"


class TaskType(enum.IntEnum):
    """What a task does (upstream's numbers)."""

    REPLICA_COPY = 0
    REPLICA_MOVE = 1


class TaskStatus(enum.IntEnum):
    """Where a task stands (upstream's numbers: FAILED is 2, SUCCESS 3)."""

    PENDING = 0
    PROCESSING = 1
    FAILED = 2
    SUCCESS = 3


_TYPES = {"copy": TaskType.REPLICA_COPY, "move": TaskType.REPLICA_MOVE}
_STATUSES = {s.name.lower(): s for s in TaskStatus}


class QueryTaskResponse:
    """A task as ``query_task`` reports it (read-only): id and assigned_client (UUID
    pairs of ints), type (TaskType), status (TaskStatus), created_at_ms_epoch,
    last_updated_at_ms_epoch and message."""

    __slots__ = ("_id", "_type", "_status", "_created", "_updated", "_client", "_message")

    def __init__(self):
        self._id = (0, 0)
        self._type = TaskType.REPLICA_COPY
        self._status = TaskStatus.PENDING
        self._created = 0
        self._updated = 0
        self._client = (0, 0)
        self._message = ""

    @classmethod
    def _from_json(cls, obj):
        r = cls()
        r._id = tuple(int(x) for x in obj["id"])
        r._type = _TYPES[obj["type"]]
        r._status = _STATUSES[obj["status"]]
        r._created = int(obj["created_at_ms"])
        r._updated = int(obj["updated_at_ms"])
        r._client = tuple(int(x) for x in obj["assigned_client"])
        r._message = str(obj["message"])
        return r

    def _to_wire(self):
        """The fields as one flat list (the dummy-client wire carries no mappings)."""
        return [*self._id, int(self._type), int(self._status), self._created, self._updated,
                *self._client, self._message]

    @classmethod
    def _from_wire(cls, v):
        """The inverse of ``_to_wire``; ValueError for anything else."""
        if not isinstance(v, list) or len(v) != 9 or not isinstance(v[8], str) or \
                not all(isinstance(x, int) and not isinstance(x, bool) for x in v[:8]):
            raise ValueError(f"not a task: {v!r}")
        r = cls()
        r._id = (v[0], v[1])
        r._type, r._status = TaskType(v[2]), TaskStatus(v[3])
        r._created, r._updated = v[4], v[5]
        r._client = (v[6], v[7])
        r._message = v[8]
        return r

    id = property(lambda self: self._id)
    type = property(lambda self: self._type)
    status = property(lambda self: self._status)
    created_at_ms_epoch = property(lambda self: self._created)
    last_updated_at_ms_epoch = property(lambda self: self._updated)
    assigned_client = property(lambda self: self._client)
    message = property(lambda self: self._message)

    def __repr__(self):
        return (f"QueryTaskResponse(id={self._id[0]}-{self._id[1]}, type={int(self._type)}, "
                f"status={int(self._status)}, created_at={self._created}, "
                f"last_updated_at={self._updated}, "
                f"assigned_client={self._client[0]}-{self._client[1]}, "
                f"message=\"{self._message}\")")


def task_id_pair(task_id):
    """``task_id`` as a pair of ints (TypeError for anything else)."""
    if isinstance(task_id, (str, bytes)) or not hasattr(task_id, "__len__") \
            or len(task_id) != 2:
        raise TypeError(f"task_id: expected a pair of int, got {task_id!r}")
    hi, lo = (check_int(x, "task_id") for x in task_id)
    return hi, lo


def _api():
    """mooncake.store, imported when first needed (it imports this module)."""
    from . import store

    return store


def _nested_ints(value, name, n):
    """Per-key int lists of a ranged call (TypeError on wrong types), or None (logged)
    when there are not ``n`` of them."""
    if isinstance(value, (str, bytes)) or not hasattr(value, "__iter__"):
        raise TypeError(f"{name}: expected a list of lists of int, got "
                        f"{type(value).__name__}")
    lists = [int_list(v, f"{name}[{i}]") for i, v in enumerate(value)]
    return lists if lengths_match(name, keys=range(n), **{name: lists}) else None


def _grace_ms(grace_period_seconds):
    return check_int(grace_period_seconds, "grace_period_seconds", 0, (1 << 64) // 1000 - 1) * 1000


class StoreSurfaceMixin:
    """Sessions, tasks, extra segments and the rest (see the module docstring)."""

    @property
    def _native(self):
        """The C store these calls run on, or None: not set up, or a dummy (whose
        real client runs only what upstream's dummy forwards; see ``_dummy``)."""
        handle = self._store
        return handle if isinstance(handle, int) else None

    # ------------------------------------------------------------ sessions

    def _keyed(self, fn_name, keys, what):
        """Calls a keys-only batch function: per-key codes (INVALID_KEY for keys that
        cannot be keys)."""
        ks = _api()._keys(keys)
        fn = getattr(N.LIB, fn_name)
        if not self._native:
            return [INVALID_PARAMS] * len(ks)
        results, idx = _api()._triage(ks, [()] * len(ks))
        if idx:
            c_res = (ctypes.c_int * len(idx))()
            rc = fn(self._native, N.c_strings([ks[i] for i in idx]), len(idx), c_res)
            for j, i in enumerate(idx):
                results[i] = rc if rc != N.MC_OK else int(c_res[j])
        return results

    def batch_put_session_start(self, keys, sizes, config=None):
        """Reserves each key for ``sizes[i]`` bytes without moving any (invisible to
        readers until ``batch_put_session_end``): per-key 0 or a negative code
        (INVALID_PARAMS for a key with a session already)."""
        ks = _api()._keys(keys)
        lens = int_list(sizes, "sizes")
        config = _api()._config(config)
        fn = N.LIB.mc_store_put_session_start
        if not lengths_match("batch_put_session_start", keys=ks, sizes=lens) \
                or not self._native:
            return [INVALID_PARAMS] * len(ks)
        results, idx = _api()._triage(ks, lens)
        if not idx:
            return results
        refusal = _refusal(config, len(ks), SAME_NODE_PASSED)
        if refusal:
            for i in idx:
                results[i] = refusal
            return results
        cfg, keep = config._to_c()
        for members, groups in _api()._by_group(config, idx):
            opts, keep2 = self._put_options(False, groups)
            c_res = (ctypes.c_int * len(members))()
            rc = fn(self._native, N.c_strings([ks[i] for i in members]), len(members),
                    N.c_array(ctypes.c_uint64, [lens[i] for i in members]), ctypes.byref(cfg),
                    ctypes.byref(opts), c_res)
            for j, i in enumerate(members):
                results[i] = rc if rc != N.MC_OK else int(c_res[j])
        return results

    def _ranged(self, fn_name, what, keys, all_buffer_ptrs, all_sizes, all_offsets,
                offsets_name):
        """A ranged session call: key i moves all_sizes[i][j] bytes between
        all_buffer_ptrs[i][j] (registered) and object offset all_offsets[i][j]. Per key
        the bytes moved or a negative code."""
        ks = _api()._keys(keys)
        n = len(ks)
        ptrs = _nested_ints(all_buffer_ptrs, "all_buffer_ptrs", n)
        sizes = _nested_ints(all_sizes, "all_sizes", n)
        offs = _nested_ints(all_offsets, offsets_name, n)
        fn = getattr(N.LIB, fn_name)
        if ptrs is None or sizes is None or offs is None or not self._native:
            return [INVALID_PARAMS] * n
        usable = []
        for i in range(n):
            if not lengths_match(f"{what}: key {i}", all_buffer_ptrs=ptrs[i],
                                 all_sizes=sizes[i], **{offsets_name: offs[i]}):
                usable.append(None)
                continue
            spans = self._checked_spans(ptrs[i], sizes[i])
            usable.append(() if None not in spans else None)
        results, idx = _api()._triage(ks, usable)
        if not idx:
            return results
        c_res = (ctypes.c_int64 * len(idx))()
        rc = fn(self._native, N.c_strings([ks[i] for i in idx]), len(idx),
                N.c_array(ctypes.c_void_p, [a for i in idx for a in ptrs[i]]),
                N.c_array(ctypes.c_uint64, [o for i in idx for o in offs[i]]),
                N.c_array(ctypes.c_uint64, [z for i in idx for z in sizes[i]]),
                N.c_array(ctypes.c_size_t, [len(ptrs[i]) for i in idx]), c_res)
        for j, i in enumerate(idx):
            results[i] = rc if rc != N.MC_OK else int(c_res[j])
        return results

    def batch_put_from_multi_buffer_ranges(self, keys, all_buffer_ptrs, all_sizes,
                                           all_dst_offsets):
        """Writes ranges into objects of open put sessions, with no master round trip:
        per key the bytes written or a negative code (INVALID_PARAMS for no session or a
        range past the object's end)."""
        return self._ranged("mc_store_put_session_write", "batch_put_from_multi_buffer_ranges",
                            keys, all_buffer_ptrs, all_sizes, all_dst_offsets,
                            "all_dst_offsets")

    def batch_put_session_end(self, keys):
        """Makes the objects of put sessions readable and ends the sessions: per-key 0 or
        a negative code (a key whose end fails keeps its session)."""
        return self._keyed("mc_store_put_session_end", keys, "batch_put_session_end")

    def batch_put_session_revoke(self, keys):
        """Drops the objects of put sessions and ends the sessions: per-key 0 or a
        negative code."""
        return self._keyed("mc_store_put_session_revoke", keys, "batch_put_session_revoke")

    def batch_get_session_start(self, keys):
        """Looks each key up once and keeps its replicas and read lease for ranged reads:
        per-key 0 or a negative code."""
        return self._keyed("mc_store_get_session_start", keys, "batch_get_session_start")

    def batch_get_into_multi_buffer_ranges(self, keys, all_buffer_ptrs, all_sizes,
                                           all_src_offsets):
        """Reads ranges of objects with a get session, with no master round trip: per key
        the bytes read or a negative code (LEASE_EXPIRED once the session's lease is
        over, which ends it)."""
        return self._ranged("mc_store_get_session_read", "batch_get_into_multi_buffer_ranges",
                            keys, all_buffer_ptrs, all_sizes, all_src_offsets,
                            "all_src_offsets")

    def batch_get_session_end(self, keys):
        """Ends the get sessions of ``keys``; 0."""
        ks = _api()._keys(keys)
        fn = N.LIB.mc_store_get_session_end
        if not self._native:
            return INVALID_PARAMS
        good = [k for k in ks if k is not None]
        return fn(self._native, N.c_strings(good), len(good))

    # ------------------------------------------------------------ tasks

    def _task(self, fn_name, key, *args):
        """Creates a task: (id, 0) or ((0, 0), code)."""
        k = _api()._encode_key(key)
        fn = getattr(N.LIB, fn_name)
        if not self._native:
            return (0, 0), INVALID_PARAMS
        if k is None:
            return (0, 0), INVALID_KEY
        out = (ctypes.c_uint64 * 2)()
        rc = fn(self._native, k, *args, out)
        if rc != N.MC_OK:
            logger.error("mooncake: %s for %r failed: %s (%d)", fn_name, key,
                         N.error_string(rc), rc)
            return (0, 0), rc
        return (int(out[0]), int(out[1])), 0

    def create_copy_task(self, key, targets):
        """Starts copying ``key`` onto each segment named in ``targets`` in the
        background: (task id, 0), or ((0, 0), code) when refused at once
        (INVALID_PARAMS for no target or an unmounted one, OBJECT_NOT_FOUND, ...)."""
        names = [t.encode() for t in _api()._strs(targets, "targets")]
        return self._task("mc_store_create_copy_task", key, N.c_strings(names), len(names))

    def create_move_task(self, key, source, target):
        """Starts moving ``key``'s replica on segment ``source`` to segment ``target``:
        (task id, 0) or ((0, 0), code)."""
        src = check_str(source, "source").encode()
        dst = check_str(target, "target").encode()
        return self._task("mc_store_create_move_task", key, src, dst)

    def query_task(self, task_id):
        """(QueryTaskResponse, 0) for a task of this store, else (None, code)
        (TASK_NOT_FOUND -1400 for an id it does not know)."""
        hi, lo = task_id_pair(task_id)
        fn = N.LIB.mc_store_query_task
        if not self._native:
            return None, INVALID_PARAMS
        rc, text = N.read_json_text(fn, self._native, hi, lo)
        if rc == 1:
            logger.error("mooncake: query_task: no task %d-%d of this store", hi, lo)
            return None, TASK_NOT_FOUND
        if rc != N.MC_OK:
            return None, rc
        return QueryTaskResponse._from_json(json.loads(text)), 0

    # ------------------------------------------------------------ segments

    def _segment_id(self, call):
        """Runs ``call(id_buf, len)``: (code, id)."""
        buf = ctypes.create_string_buffer(_SEGMENT_ID_BYTES)
        rc = call(buf, _SEGMENT_ID_BYTES)
        return rc, (buf.value.decode() if rc == N.MC_OK else "")

    def mount_segment(self, path, size, offset=0, protocol="tcp", location=""):
        """Maps ``size`` bytes of the file (or shared memory object) at ``path`` from
        ``offset`` (page-aligned) and lends them to the pool: {"ret": 0 or a negative
        code, "segment_ids": [id]}. What is stored there is written to the file."""
        p = check_str(path, "path").encode()
        n = check_int(size, "size")
        off = check_int(offset, "offset")
        check_str(protocol, "protocol")  # the store's own transports reach it
        loc = check_str(location, "location").encode()
        fn = N.LIB.mc_store_mount_file_segment
        if not self._native:
            return {"ret": INVALID_PARAMS, "segment_ids": []}
        rc, seg = self._segment_id(lambda b, m: fn(self._native, p, off, n, loc, b, m))
        if rc != N.MC_OK:
            logger.error("mooncake: mount_segment(%r, %d, offset=%d): %s (%d)", path, n, off,
                         N.error_string(rc), rc)
        return {"ret": rc, "segment_ids": [seg] if seg else []}

    def allocate_and_mount_segment(self, size, protocol="tcp", location=""):
        """Allocates ``size`` bytes (rounded up to 4 MiB) at ``location`` ("" host memory,
        "cpu:N", "cuda:N", ...) and lends them to the pool: {"ret", "segment_ids",
        "allocated_size"}."""
        n = check_int(size, "size")
        check_str(protocol, "protocol")
        loc = check_str(location, "location").encode()
        fn = N.LIB.mc_store_allocate_segment
        failed = {"ret": INVALID_PARAMS, "segment_ids": [], "allocated_size": 0}
        if not self._native:
            return failed
        got = ctypes.c_uint64(0)
        rc, seg = self._segment_id(
            lambda b, m: fn(self._native, n, loc, b, m, ctypes.byref(got)))
        if rc != N.MC_OK:
            logger.error("mooncake: allocate_and_mount_segment(%d): %s (%d)", n,
                         N.error_string(rc), rc)
            return dict(failed, ret=rc)
        return {"ret": 0, "segment_ids": [seg], "allocated_size": int(got.value)}

    def _unmount(self, fn_name, what, segment_ids, grace_period_seconds):
        ids = _api()._strs(segment_ids, "segment_ids")
        grace = _grace_ms(grace_period_seconds)
        fn = getattr(N.LIB, fn_name)
        if not self._native:
            return INVALID_PARAMS
        first = 0
        for seg in ids:
            rc = fn(self._native, seg.encode(), grace)
            if rc != N.MC_OK:
                logger.error("mooncake: %s(%r): %s (%d)", what, seg, N.error_string(rc), rc)
                first = first or rc
        return first

    def unmount_segment(self, segment_ids, grace_period_seconds=0):
        """Unmounts segments of ``mount_segment`` (at once, or after the grace period, in
        which nothing new is placed there) and unmaps them: 0 or the first error."""
        return self._unmount("mc_store_unmount_file_segment", "unmount_segment", segment_ids,
                             grace_period_seconds)

    def unmount_and_free_segment(self, segment_ids, grace_period_seconds=0):
        """Unmounts segments of ``allocate_and_mount_segment`` and frees their memory: 0 or
        the first error."""
        return self._unmount("mc_store_unmount_allocated_segment", "unmount_and_free_segment",
                             segment_ids, grace_period_seconds)

    def unmount_local_disk_segment(self, grace_period_seconds=0):
        """Gives up this node's disk tier: nothing new is offloaded there; after the grace
        period (waited out) its copies are deleted, and objects kept only there are gone.
        0 (also, with a warning, when there is no disk tier) or a negative code."""
        grace = _grace_ms(grace_period_seconds)
        fn = N.LIB.mc_store_drain_disk_tier
        if not self._native:
            return INVALID_PARAMS
        rc = fn(self._native, grace)
        if rc == 1:
            logger.warning("mooncake: unmount_local_disk_segment: this store has no disk "
                           "tier (enable_ssd_offload); nothing to unmount")
            return 0
        return rc

    # ------------------------------------------------------------ the rest

    def alloc_from_mem_pool(self, size):
        """Shared memory registered with this store for zero-copy calls; its address, or
        0. It lives as long as the store object (and is registered until close)."""
        n = check_int(size, "size")
        if n == 0 or not self._native:
            return 0
        try:
            m = mmap.mmap(-1, n, flags=mmap.MAP_SHARED | mmap.MAP_ANONYMOUS)
        except (OSError, ValueError, OverflowError) as e:
            logger.error("mooncake: alloc_from_mem_pool(%d): %s", n, e)
            return 0
        view = (ctypes.c_char * n).from_buffer(m)
        addr = ctypes.addressof(view)
        if self.register_buffer(addr, n) != N.MC_OK:
            del view
            m.close()
            return 0
        self.__dict__.setdefault("_mem_pool", []).append((m, view))
        return addr

    def init_all(self, protocol, device_name, mount_segment_size=16 * 1024 * 1024):
        """Sets this store up with ``mount_segment_size`` bytes of segment: host and
        metadata from MOONCAKE_LOCAL_HOSTNAME ("localhost") and MOONCAKE_TE_META_DATA_SERVER
        (P2PHANDSHAKE), the master from MOONCAKE_MASTER (127.0.0.1:50051). 0 or a
        negative code (INVALID_PARAMS when already set up)."""
        check_str(protocol, "protocol")
        check_str(device_name, "device_name")
        size = check_int(mount_segment_size, "mount_segment_size")
        if self._native:
            logger.error("mooncake: init_all: the store is set up already")
            return INVALID_PARAMS
        return self.setup(os.getenv("MOONCAKE_LOCAL_HOSTNAME", "localhost"),
                          os.getenv("MOONCAKE_TE_META_DATA_SERVER", "P2PHANDSHAKE"),
                          size, _INIT_ALL_LOCAL_BUFFER, protocol, device_name,
                          os.getenv("MOONCAKE_MASTER", _DEFAULT_MASTER))

    def get_offload_rpc_read_count(self):
        """How many of this store's reads got an object staged from a node's disk tier
        for them (0 before setup)."""
        fn = N.LIB.mc_store_disk_read_count
        if not self._native:
            return 0
        count = ctypes.c_uint64(0)
        return int(count.value) if fn(self._native, ctypes.byref(count)) == N.MC_OK else 0
