"""Mooncake PG: fault-tolerant collectives as a ``torch.distributed`` backend.

Importing this module registers the backend ``mooncake-cpu`` (host tensors) with
``torch.distributed`` when torch is importable; torch is not a dependency of the package.

    import torch.distributed as dist
    from mooncake import pg

    dist.init_process_group(backend="mooncake-cpu", rank=r, world_size=n,
                            pg_options=pg.MooncakeBackendOptions(timeout_ms=2000))
    work = dist.all_reduce(t, async_op=True)
    try:
        work.wait()                      # raises MooncakeCollectiveError on a failure
    except pg.MooncakeCollectiveError:
        pg.get_failed_ranks_hint(work)   # the ranks it did not hear from
        pg.sync_after_failure(backend)   # survivors agree on a view without them

A rank that dies is detected by timeout; inactive ranks are holes (rank numbers never
change, collectives skip them). A replacement process starts with
``MooncakeBackendOptions(is_extension=True)``, calls ``join_group(backend)`` and takes
part once a member calls ``activate_ranks(backend, [rank])``. Every rank runs its own
transfer engine; peers write into its registered buffer one-sidedly (``c_include/
mooncake.h``, "Mooncake PG"). Collectives run when called; the Work returned is already
complete and ``wait()`` raises the failure, if any.

The backend ``mooncake`` takes CUDA tensors with the same options, module functions and
failure semantics. Their memory goes to the C ABI as device memory
(``mc_pg_set_memory``): the library copies each buffer into pinned host memory once with
the driver, runs the same host collective, and copies the outputs back once, only if the
operation succeeded (synchronously: the operation is complete on the device when the
call returns). Creating it on a machine where ``torch.cuda.is_available()`` is false
raises at ``init_process_group`` / ``new_group``.
"""

import ctypes
import contextlib
import enum
import threading
from ctypes import byref, c_char_p, c_int, c_size_t, c_uint64, c_void_p

from . import _native
from ._native import LIB, MC_OK, error_string

__all__ = [
    "MooncakeBackendOptions",
    "MooncakeCollectiveError",
    "ProcessGroupHandle",
    "ProposalStatus",
    "ViewUpdateStatus",
    "SyncAfterFailureStatus",
    "ProposalResponse",
    "SyncAfterFailureResponse",
    "get_active_ranks",
    "get_peer_state",
    "activate_ranks",
    "recover_ranks",
    "deactivate_ranks",
    "join_group",
    "sync_after_failure",
    "get_failed_ranks_hint",
    "get_local_success",
    "get_current_epoch",
    "set_device_filter",
]

BACKEND_NAME = "mooncake-cpu"
CUDA_BACKEND_NAME = "mooncake"

# mc_pg_dtype and mc_pg_reduce_op numbers
DTYPE_F32, DTYPE_F64, DTYPE_F16, DTYPE_BF16, DTYPE_I32, DTYPE_I64, DTYPE_U8 = range(7)
OP_SUM, OP_MIN, OP_MAX, OP_PRODUCT, OP_AVG = range(5)


class ProposalStatus(enum.IntEnum):
    """What a membership proposal came to (upstream's names)."""

    Rejected = 0
    Applied = 1
    AppliedWithDroppedRanks = 2


ViewUpdateStatus = ProposalStatus


class SyncAfterFailureStatus(enum.IntEnum):
    Reconciled = 0
    NoPending = 1
    Rejected = 2


class ProposalResponse:
    def __init__(self, status, new_epoch, dropped_ranks, reject_reason):
        self.status = ProposalStatus(status)
        self.new_epoch = new_epoch
        self.dropped_ranks = list(dropped_ranks)
        self.reject_reason = reject_reason

    def __repr__(self):
        return (f"ProposalResponse(status={self.status.name}, new_epoch={self.new_epoch}, "
                f"dropped_ranks={self.dropped_ranks}, reject_reason={self.reject_reason!r})")


class SyncAfterFailureResponse:
    def __init__(self, status, reject_reason=""):
        self.status = SyncAfterFailureStatus(status)
        self.reject_reason = reject_reason

    def __repr__(self):
        return f"SyncAfterFailureResponse(status={self.status.name})"


class MooncakeCollectiveError(RuntimeError):
    """A collective failed; ``failed_ranks`` are the ranks it did not hear from."""

    def __init__(self, what, code, failed_ranks):
        super().__init__(f"{what}: {error_string(code)} ({code}); failed ranks {failed_ranks}")
        self.code = code
        self.failed_ranks = list(failed_ranks)


class MooncakeBackendOptions:
    """Options of a Mooncake PG group (``pg_options`` of ``init_process_group``).

    ``active_ranks``: ranks active at start (a sequence or int32 tensor of 0/1; default
    all). ``max_group_size`` is accepted; the capacity is the world size (start with the
    final size and an ``active_ranks`` mask to grow). ``engine`` takes extra engine
    settings (``mc_config_set`` keys, e.g. ``{"protocol": "tcp"}``).
    """

    def __init__(self, active_ranks=None, is_extension=False, max_group_size=None,
                 auto_deactivate_on_failure=True, auto_sync_on_failure=True,
                 timeout_ms=5000, cells_per_peer=None, cell_bytes=None, engine=None):
        self.active_ranks = active_ranks
        self.is_extension = bool(is_extension)
        self.max_group_size = max_group_size
        self.auto_deactivate_on_failure = bool(auto_deactivate_on_failure)
        self.auto_sync_on_failure = bool(auto_sync_on_failure)
        self.timeout_ms = int(timeout_ms)
        self.cells_per_peer = cells_per_peer
        self.cell_bytes = cell_bytes
        self.engine = dict(engine or {})

    def to_string(self, world_size):
        items = {
            "is_extension": int(self.is_extension),
            "auto_deactivate_on_failure": int(self.auto_deactivate_on_failure),
            "auto_sync_on_failure": int(self.auto_sync_on_failure),
            "timeout_ms": self.timeout_ms,
        }
        if self.max_group_size is not None:
            items["max_group_size"] = int(self.max_group_size)
        if self.cells_per_peer is not None:
            items["cells_per_peer"] = int(self.cells_per_peer)
        if self.cell_bytes is not None:
            items["cell_bytes"] = int(self.cell_bytes)
        if self.active_ranks is not None:
            mask = [int(bool(int(v))) for v in list(self.active_ranks)]
            if len(mask) != world_size:
                raise ValueError(f"active_ranks has {len(mask)} entries for world size "
                                 f"{world_size}")
            items["active_ranks"] = "".join(map(str, mask))
        for k, v in self.engine.items():
            if any(c in f"{k}{v}" for c in ";="):
                raise ValueError(f"engine option {k}={v!r}: ';' and '=' are not allowed")
            items[k] = v
        return ";".join(f"{k}={v}" for k, v in items.items())


def _fn(name):
    if name in LIB.missing:
        raise _native.AbiRevisionError(
            f"{_native.LIB_PATH} has no {name}: rebuild it (pip install ./python)")
    return getattr(LIB, name)


def _sizes(values):
    return (c_size_t * max(len(values), 1))(*values)


class ProcessGroupHandle:
    """One rank of a group over the C ABI, on raw memory (no torch needed).

    Buffers are given as ``(address, nbytes)`` of memory the caller keeps alive: host
    memory, or device memory after ``set_memory("cuda:N")``. That setting is the
    handle's, shared by every thread: a thread that calls on device buffers while others
    use the handle holds it with ``with handle.memory("cuda:N"): ...``.
    """

    def __init__(self, rank, world_size, options=None):
        opts = options or MooncakeBackendOptions()
        self.rank = int(rank)
        self.world_size = int(world_size)
        self.options = opts
        handle = c_void_p()
        text = opts.to_string(self.world_size).encode()
        rc = _fn("mc_pg_new")(self.rank, self.world_size, text, byref(handle))
        if rc != MC_OK:
            raise RuntimeError(f"mc_pg_new: {error_string(rc)} ({rc})")
        self._h = handle
        # Held from a set_memory to the calls it is for (memory()); reentrant, so a
        # block may make other calls on the handle.
        self._lock = threading.RLock()
        self._memory = "cpu:0"

    def close(self):
        if self._h:
            _fn("mc_pg_free")(self._h)
            self._h = None

    def __del__(self):
        try:
            self.close()
        except Exception:
            pass

    def address(self):
        rc, text = _native.read_json_text(_fn("mc_pg_address"), self._h, initial=256)
        if rc != MC_OK:
            raise RuntimeError(f"mc_pg_address: {error_string(rc)}")
        return text

    def connect(self, addresses):
        if len(addresses) != self.world_size:
            raise ValueError(f"{len(addresses)} addresses for world size {self.world_size}")
        arr = (c_char_p * self.world_size)(*[(a or "").encode() for a in addresses])
        self._check("connect", _fn("mc_pg_connect")(self._h, arr, self.world_size))

    def failed_ranks(self):
        buf = (ctypes.c_int32 * max(self.world_size, 1))()
        n = c_size_t(0)
        if _fn("mc_pg_failed_ranks")(self._h, buf, self.world_size, byref(n)) != MC_OK:
            return []
        return [int(buf[i]) for i in range(min(n.value, self.world_size))]

    def _check(self, what, rc):
        if rc != MC_OK:
            raise MooncakeCollectiveError(what, rc, self.failed_ranks())

    def set_memory(self, location):
        """Where the buffers of later operations live: ``"cpu:0"`` (the default),
        ``"cuda:N"``, ``"hip:N"`` or ``"npu:N"``. A bad or unusable location raises
        ValueError and leaves the setting as it was. The setting is the handle's, for
        every thread's later calls: see ``memory``."""
        with self._lock:
            if location == self._memory:
                return
            rc = _fn("mc_pg_set_memory")(self._h, location.encode())
            if rc != MC_OK:
                raise ValueError(f"mc_pg_set_memory({location!r}): {error_string(rc)} ({rc})")
            self._memory = location

    @contextlib.contextmanager
    def memory(self, location):
        """Sets where buffers live (``set_memory``) and keeps other threads' settings
        out until the block ends, so the calls in it take their buffers as
        ``location``."""
        with self._lock:
            before = self._memory
            self.set_memory(location)
            try:
                yield
            finally:
                # A nested block (the same thread: the lock is re-entrant) leaves the
                # outer one's setting as it found it.
                self.set_memory(before)

    def join(self, timeout_ms=600_000):
        self._check("join_group", _fn("mc_pg_join")(self._h, int(timeout_ms)))

    def active_ranks(self):
        buf = (ctypes.c_uint8 * self.world_size)()
        self._check("active_ranks", _fn("mc_pg_active_ranks")(self._h, buf, self.world_size))
        return [bool(v) for v in buf]

    def epoch(self):
        e = c_uint64(0)
        self._check("epoch", _fn("mc_pg_epoch")(self._h, byref(e)))
        return e.value

    def peer_state(self, ranks):
        ranks = [int(r) for r in ranks]
        arr = (ctypes.c_int32 * max(len(ranks), 1))(*ranks)
        out = (ctypes.c_uint8 * max(len(ranks), 1))()
        self._check("peer_state", _fn("mc_pg_peer_state")(self._h, arr, len(ranks), out))
        return [bool(out[i]) for i in range(len(ranks))]

    def propose(self, activate, ranks):
        ranks = [int(r) for r in ranks]
        for r in ranks:
            if not 0 <= r < self.world_size:
                raise ValueError(f"rank {r} out of range (world size {self.world_size})")
        arr = (ctypes.c_int32 * max(len(ranks), 1))(*ranks)
        status, epoch, count = c_int(0), c_uint64(0), c_size_t(0)
        dropped = (ctypes.c_int32 * max(self.world_size, 1))()
        reason = ctypes.create_string_buffer(512)
        rc = _fn("mc_pg_propose")(self._h, int(bool(activate)), arr, len(ranks), byref(status),
                                  byref(epoch), dropped, self.world_size, byref(count),
                                  reason, len(reason))
        self._check("activate_ranks" if activate else "deactivate_ranks", rc)
        return ProposalResponse(status.value, epoch.value,
                                [int(dropped[i]) for i in range(min(count.value, self.world_size))],
                                reason.value.decode("utf-8", "replace"))

    def sync_after_failure(self):
        status = c_int(0)
        self._check("sync_after_failure", _fn("mc_pg_sync_after_failure")(self._h, byref(status)))
        return SyncAfterFailureResponse(status.value)

    # ---- collectives on raw memory: (address, nbytes) ----

    def all_reduce(self, addr, count, dtype, op):
        self._check("all_reduce", _fn("mc_pg_all_reduce")(self._h, addr, count, dtype, op))

    def reduce(self, addr, count, dtype, op, root):
        self._check("reduce", _fn("mc_pg_reduce")(self._h, addr, count, dtype, op, root))

    def broadcast(self, addr, nbytes, root):
        self._check("broadcast", _fn("mc_pg_broadcast")(self._h, addr, nbytes, root))

    def all_gather(self, inp, out, sizes):
        self._check("all_gather", _fn("mc_pg_all_gather")(self._h, inp, out, _sizes(sizes)))

    def reduce_scatter(self, inp, out, counts, dtype, op):
        self._check("reduce_scatter", _fn("mc_pg_reduce_scatter")(
            self._h, inp, out, _sizes(counts), dtype, op))

    def all_to_all(self, inp, send, out, recv):
        self._check("all_to_all", _fn("mc_pg_all_to_all")(
            self._h, inp, _sizes(send), out, _sizes(recv)))

    def all_to_all_timeout(self, inp, send, out, recv, timeout_us):
        """``all_to_all`` waiting at most ``timeout_us`` microseconds for peers."""
        if int(timeout_us) <= 0:
            raise ValueError(f"timeout_us must be positive, not {timeout_us}")
        self._check("all_to_all", _fn("mc_pg_all_to_all_timeout")(
            self._h, inp, _sizes(send), out, _sizes(recv), int(timeout_us)))

    def gather(self, inp, out, sizes, root):
        self._check("gather", _fn("mc_pg_gather")(self._h, inp, out, _sizes(sizes), root))

    def scatter(self, inp, out, sizes, root):
        self._check("scatter", _fn("mc_pg_scatter")(self._h, inp, out, _sizes(sizes), root))

    def barrier(self):
        self._check("barrier", _fn("mc_pg_barrier")(self._h))

    def send_recv(self, sends, recvs):
        """``sends``/``recvs``: lists of (peer, address, nbytes)."""
        def arr(items):
            a = (_PgMessage * max(len(items), 1))()
            for i, (peer, addr, n) in enumerate(items):
                a[i].peer, a[i].buf, a[i].len = int(peer), addr, int(n)
            return a
        s, r = arr(sends), arr(recvs)
        self._check("send/recv", _fn("mc_pg_send_recv")(self._h, s, len(sends), r, len(recvs)))


class _PgMessage(ctypes.Structure):
    _fields_ = [("peer", ctypes.c_int32), ("buf", c_void_p), ("len", c_size_t)]


# ---------------------------------------------------------------- torch backend

try:  # torch is optional: the backend exists only where it is installed
    import torch
    import torch.distributed as dist
    from torch._C._distributed_c10d import Backend as _TorchBackend
    from torch._C._distributed_c10d import Work as _TorchWork
except ImportError:  # pragma: no cover - exercised where torch is absent
    torch = None


def _require_torch():
    if torch is None:
        raise ImportError("mooncake.pg's torch backend needs torch (pip install torch)")


if torch is not None:
    _DTYPES = {
        torch.float32: DTYPE_F32, torch.float64: DTYPE_F64, torch.float16: DTYPE_F16,
        torch.bfloat16: DTYPE_BF16, torch.int32: DTYPE_I32, torch.int64: DTYPE_I64,
        torch.uint8: DTYPE_U8,
    }

    def _dtype(t):
        try:
            return _DTYPES[t.dtype]
        except KeyError:
            raise TypeError(f"mooncake-cpu: unsupported dtype {t.dtype}") from None

    def _op(reduce_op):
        table = {dist.ReduceOp.SUM: OP_SUM, dist.ReduceOp.MIN: OP_MIN,
                 dist.ReduceOp.MAX: OP_MAX, dist.ReduceOp.PRODUCT: OP_PRODUCT,
                 dist.ReduceOp.AVG: OP_AVG}
        for k, v in table.items():
            if reduce_op == k:
                return v
        raise ValueError(f"mooncake-cpu: unsupported reduce op {reduce_op}")

    def _location(device):
        """The C ABI's memory location of a torch device (ROCm builds of torch call
        their GPUs "cuda")."""
        if device.type == "cpu":
            return "cpu:0"
        if device.type == "cuda":
            family = "hip" if getattr(torch.version, "hip", None) else "cuda"
            index = device.index if device.index is not None else torch.cuda.current_device()
            return f"{family}:{index}"
        raise ValueError(f"Mooncake PG takes cpu or cuda tensors, not {device}")

    def _check_bytes(what, got, want):
        """The C ABI takes sizes, not buffer lengths: refuse a mismatch before the call
        rather than let the collective run past a tensor's end."""
        if got != want:
            raise ValueError(f"{what}: {got} bytes where {want} are needed")

    def _check_rank(what, r, world):
        if not 0 <= int(r) < world:
            raise ValueError(f"{what}: rank {r} out of range (world size {world})")

    def _check_count(what, items, world):
        """The C ABI reads ``world`` entries of every size array: a shorter list would
        be read past its end."""
        if len(items) != world:
            raise ValueError(f"{what}: {len(items)} entries for world size {world}")

    def _check_like(what, t, ref):
        """``t`` must have ``ref``'s dtype and element count (the peer's block is sized
        from ``ref``)."""
        if t.dtype != ref.dtype:
            raise ValueError(f"{what}: dtype {t.dtype} where {ref.dtype} is needed")
        if t.numel() != ref.numel():
            raise ValueError(f"{what}: {t.numel()} elements where {ref.numel()} are needed")

    def _check_dtypes(what, tensors, dtype):
        for i, t in enumerate(tensors):
            if t.dtype != dtype:
                raise ValueError(f"{what}[{i}]: dtype {t.dtype} where {dtype} is needed")

    class _Contig:
        """A contiguous view of ``t`` for the call; copied back when it was a copy."""

        def __init__(self, t):
            self.orig = t
            self.t = t if t.is_contiguous() else t.contiguous()

        @property
        def addr(self):
            return self.t.data_ptr()

        @property
        def nbytes(self):
            return self.t.numel() * self.t.element_size()

        def done(self):
            if self.t is not self.orig:
                self.orig.copy_(self.t)

    class MooncakeWork(_TorchWork):
        """A finished operation: ``wait()`` raises its failure (torch's future-based
        helper would swallow it)."""

        def __init__(self, backend, error=None, failed_ranks=(), result=None, flush=False):
            super().__init__()
            self._backend = backend
            self._error = error
            self._failed = list(failed_ranks)
            self._result = result or []
            self._flush = flush
            self._on_success = []

        def _settle(self):
            if self._flush:
                self._flush = False
                try:
                    self._backend._flush_p2p()
                except Exception:
                    # _flush_p2p gave the error to every work whose message was not
                    # done, this one included if so; a delivered message succeeded.
                    pass
            if self._error is None:
                pending, self._on_success = self._on_success, []
                for fn in pending:
                    fn()

        def then_on_success(self, fn):
            """Runs ``fn`` once the operation has succeeded (now, if it already has);
            never if it failed."""
            self._on_success.append(fn)
            if not self._flush:
                self._settle()

        def wait(self, timeout=None):
            self._settle()
            if self._error is not None:
                raise self._error
            return True

        def is_completed(self):
            return not self._flush

        def is_success(self):
            self._settle()
            return self._error is None

        def exception(self):
            self._settle()
            return self._error

        def result(self):
            return self._result

        def get_future(self):
            self._settle()
            fut = torch.futures.Future()
            if self._error is not None:
                fut.set_exception(self._error)
            else:
                fut.set_result(self._result)
            return fut

    class MooncakeBackend(_TorchBackend):
        """The ``mooncake-cpu`` backend: one group rank, collectives over the C ABI."""

        # Where this backend's tensors may live.
        _DEVICE_TYPES = ("cpu",)

        def __init__(self, store, rank, size, options):
            super().__init__(rank, size)
            self._rank, self._size = rank, size
            self.handle = ProcessGroupHandle(rank, size, options)
            store.set(f"mooncake_pg/{rank}", self.handle.address())
            active = options.active_ranks
            addresses = []
            for r in range(size):
                key = f"mooncake_pg/{r}"
                if r == rank:
                    addresses.append("")
                elif options.is_extension or (active is not None and not int(active[r])):
                    # A rank that may not be running: take its address only if published.
                    addresses.append(store.get(key).decode() if store.check([key]) else "")
                else:
                    addresses.append(store.get(key).decode())
            self.handle.connect(addresses)
            self._p2p = []

        def getBackendName(self):
            return BACKEND_NAME

        def _device(self, tensors):
            """The one device all of an operation's tensors are on."""
            devices = {t.device for t in tensors}
            if len(devices) > 1:
                raise ValueError(f"{self.getBackendName()}: tensors on several devices "
                                 f"({sorted(map(str, devices))})")
            device = devices.pop() if devices else torch.device("cpu")
            if device.type not in self._DEVICE_TYPES:
                raise ValueError(f"{self.getBackendName()} takes "
                                 f"{' or '.join(self._DEVICE_TYPES)} tensors, not {device}")
            return device

        @contextlib.contextmanager
        def _on(self, device, every_stream=False):
            """Holds the handle with its buffers at ``device`` (other threads' calls on
            the handle wait); a CUDA tensor's pending writes are finished first (the
            driver copies do not follow torch's streams): the current stream's, or with
            ``every_stream`` the device's, for work queued under other streams."""
            with self.handle.memory(_location(device)):
                if device.type == "cuda" and every_stream:
                    torch.cuda.synchronize(device)
                elif device.type == "cuda":
                    torch.cuda.current_stream(device).synchronize()
                yield

        def _run(self, what, fn, *tensors, result=None, device=None):
            try:
                with self._on(device if device is not None else torch.device("cpu")):
                    fn()
            except MooncakeCollectiveError as e:
                return MooncakeWork(self, e, e.failed_ranks)
            for c in tensors:
                c.done()
            return MooncakeWork(self, result=result)

        # Every operation checks its tensors and sizes before the C call: the C ABI
        # trusts the sizes it is given, and a refused call must change nothing.

        def allreduce(self, tensors, opts):
            dev = self._device(tensors)
            cs = [_Contig(t) for t in tensors]
            op = _op(opts.reduceOp)
            dtypes = [_dtype(c.t) for c in cs]

            def run():
                for c, dt in zip(cs, dtypes):
                    self.handle.all_reduce(c.addr, c.t.numel(), dt, op)
            return self._run("all_reduce", run, *cs, result=tensors, device=dev)

        def broadcast(self, tensors, opts):
            dev = self._device(tensors)
            cs = [_Contig(t) for t in tensors]
            _check_rank("broadcast root", opts.rootRank, self._size)

            def run():
                for c in cs:
                    self.handle.broadcast(c.addr, c.nbytes, opts.rootRank)
            return self._run("broadcast", run, *cs, result=tensors, device=dev)

        def reduce(self, tensors, opts):
            dev = self._device(tensors)
            cs = [_Contig(t) for t in tensors]
            op = _op(opts.reduceOp)
            dtypes = [_dtype(c.t) for c in cs]
            _check_rank("reduce root", opts.rootRank, self._size)

            def run():
                for c, dt in zip(cs, dtypes):
                    self.handle.reduce(c.addr, c.t.numel(), dt, op, opts.rootRank)
            return self._run("reduce", run, *cs, result=tensors, device=dev)

        def _copy_blocks(self, outs, flat, sizes):
            """Block r of ``flat`` (``sizes[r]`` bytes) into ``outs[r]``, for active
            ranks only: an inactive rank's tensor is left as it was. The callers have
            checked every block's size, and that all outputs share a dtype (so each
            block starts aligned for it); non-contiguous outputs are fine."""
            active = self.handle.active_ranks()
            off = 0
            for r, (o, n) in enumerate(zip(outs, sizes)):
                if n and active[r]:
                    o.copy_(flat[off:off + n].view(o.dtype).view(o.shape))
                off += n

        def allgather(self, output_tensors, input_tensors, opts):
            outs = list(output_tensors[0])
            dev = self._device([input_tensors[0]] + outs)
            inp = _Contig(input_tensors[0])
            _check_count("all_gather outputs", outs, self._size)
            _check_dtypes("all_gather output", outs, inp.t.dtype)
            # Blocks may differ in size between ranks, but this rank's is the input.
            _check_like(f"all_gather output {self._rank} (this rank's)", outs[self._rank],
                        inp.t)
            sizes = [o.numel() * o.element_size() for o in outs]
            flat = torch.empty(sum(sizes), dtype=torch.uint8, device=dev)

            def run():
                self.handle.all_gather(inp.addr, flat.data_ptr(), sizes)
                self._copy_blocks(outs, flat, sizes)
            return self._run("all_gather", run, result=output_tensors, device=dev)

        def _allgather_base(self, output, input, opts):
            dev = self._device([output, input])
            out, inp = _Contig(output), _Contig(input)
            if out.t.dtype != inp.t.dtype:
                raise ValueError(f"all_gather_into_tensor: output is {out.t.dtype}, input "
                                 f"{inp.t.dtype}")
            _check_bytes("all_gather_into_tensor output", out.nbytes, inp.nbytes * self._size)

            def run():
                self.handle.all_gather(inp.addr, out.addr, [inp.nbytes] * self._size)
            return self._run("all_gather_into_tensor", run, out, result=[output], device=dev)

        def reduce_scatter(self, output_tensors, input_tensors, opts):
            ins = list(input_tensors[0])
            dev = self._device([output_tensors[0]] + ins)
            out = _Contig(output_tensors[0])
            _check_count("reduce_scatter inputs", ins, self._size)
            # Checked before the cat, which would promote mixed dtypes silently.
            _check_dtypes("reduce_scatter input", ins, out.t.dtype)
            dtype, op = _dtype(out.t), _op(opts.reduceOp)
            _check_like(f"reduce_scatter output (input {self._rank}'s block)", out.t,
                        ins[self._rank])
            flat = torch.cat([i.reshape(-1) for i in ins])
            counts = [i.numel() for i in ins]

            def run():
                self.handle.reduce_scatter(flat.data_ptr(), out.addr, counts, dtype, op)
            return self._run("reduce_scatter", run, out, result=output_tensors, device=dev)

        def _reduce_scatter_base(self, output, input, opts):
            dev = self._device([output, input])
            out, inp = _Contig(output), _Contig(input)
            if out.t.dtype != inp.t.dtype:
                raise ValueError(f"reduce_scatter_tensor: output is {out.t.dtype}, input "
                                 f"{inp.t.dtype}")
            dtype, op = _dtype(inp.t), _op(opts.reduceOp)
            _check_bytes("reduce_scatter_tensor input", inp.nbytes, out.nbytes * self._size)

            def run():
                self.handle.reduce_scatter(inp.addr, out.addr, [out.t.numel()] * self._size,
                                           dtype, op)
            return self._run("reduce_scatter_tensor", run, out, result=[output], device=dev)

        def alltoall_base(self, output, input, output_split_sizes, input_split_sizes, opts):
            dev = self._device([output, input])
            out, inp = _Contig(output), _Contig(input)
            if out.t.dtype != inp.t.dtype:
                raise ValueError(f"all_to_all_single: output is {out.t.dtype}, input "
                                 f"{inp.t.dtype}")

            def splits(what, t, given):
                """Byte sizes per peer; a split counts rows of dim 0, as in torch."""
                if t.dim() == 0:
                    raise ValueError(f"all_to_all_single {what}: a 0-dim tensor has no rows")
                rows = t.shape[0]
                row_bytes = (t.numel() // rows if rows else 0) * t.element_size()
                if given is None or len(given) == 0:  # torch passes [] for "not given"
                    if rows % self._size:
                        raise ValueError(f"all_to_all_single {what}: {rows} rows do not "
                                         f"split evenly over world size {self._size}")
                    return [rows // self._size * row_bytes] * self._size
                _check_count(f"all_to_all_single {what} split sizes", given, self._size)
                given = [int(s) for s in given]
                if any(s < 0 for s in given):
                    raise ValueError(f"all_to_all_single {what} split sizes {given}: "
                                     f"negative")
                if sum(given) != rows:
                    raise ValueError(f"all_to_all_single {what} split sizes {given} sum to "
                                     f"{sum(given)} rows; the tensor has {rows}")
                return [s * row_bytes for s in given]

            send = splits("input", inp.t, input_split_sizes)
            recv = splits("output", out.t, output_split_sizes)
            _check_bytes("all_to_all_single input splits", sum(send), inp.nbytes)
            _check_bytes("all_to_all_single output splits", sum(recv), out.nbytes)

            def run():
                self.handle.all_to_all(inp.addr, send, out.addr, recv)
            return self._run("all_to_all_single", run, out, result=[output], device=dev)

        def alltoall(self, output_tensors, input_tensors, opts):
            ins, outs = list(input_tensors), list(output_tensors)
            dev = self._device(ins + outs)
            _check_count("all_to_all inputs", ins, self._size)
            _check_count("all_to_all outputs", outs, self._size)
            # One dtype throughout, so every output block starts aligned for it.
            _check_dtypes("all_to_all input", ins, outs[0].dtype)
            _check_dtypes("all_to_all output", outs, outs[0].dtype)
            flat_in = torch.cat([t.reshape(-1).view(torch.uint8) for t in ins]) \
                if ins else torch.empty(0, dtype=torch.uint8, device=dev)
            send = [t.numel() * t.element_size() for t in ins]
            recv = [t.numel() * t.element_size() for t in outs]
            flat_out = torch.empty(sum(recv), dtype=torch.uint8, device=dev)

            def run():
                self.handle.all_to_all(flat_in.data_ptr(), send, flat_out.data_ptr(), recv)
                self._copy_blocks(outs, flat_out, recv)
            return self._run("all_to_all", run, result=output_tensors, device=dev)

        def gather(self, output_tensors, input_tensors, opts):
            root = opts.rootRank
            _check_rank("gather root", root, self._size)
            outs = list(output_tensors[0]) if self._rank == root else []
            dev = self._device([input_tensors[0]] + outs)
            inp = _Contig(input_tensors[0])
            if self._rank == root:
                _check_count("gather outputs", outs, self._size)
                for r, o in enumerate(outs):
                    _check_like(f"gather output {r}", o, inp.t)
            sizes = [inp.nbytes] * self._size
            flat = torch.empty(sum(sizes) if self._rank == root else 0, dtype=torch.uint8,
                               device=dev)

            def run():
                self.handle.gather(inp.addr, flat.data_ptr() or None, sizes, root)
                if self._rank == root:
                    self._copy_blocks(outs, flat, sizes)
            return self._run("gather", run, result=output_tensors, device=dev)

        def scatter(self, output_tensors, input_tensors, opts):
            root = opts.rootRank
            _check_rank("scatter root", root, self._size)
            ins = list(input_tensors[0]) if self._rank == root else []
            dev = self._device([output_tensors[0]] + ins)
            out = _Contig(output_tensors[0])
            sizes = [out.nbytes] * self._size
            if self._rank == root:
                _check_count("scatter inputs", ins, self._size)
                for r, t in enumerate(ins):
                    _check_like(f"scatter input {r}", t, out.t)
                flat = torch.cat([t.reshape(-1).view(torch.uint8) for t in ins])
            else:
                flat = torch.empty(0, dtype=torch.uint8, device=dev)

            def run():
                self.handle.scatter(flat.data_ptr() or None, out.addr, sizes, root)
            return self._run("scatter", run, out, result=output_tensors, device=dev)

        # Newer torch calls these names for the tensor forms.
        all_gather_single = _allgather_base
        reduce_scatter_single = _reduce_scatter_base
        all_to_all_single = alltoall_base

        def barrier(self, opts=None):
            return self._run("barrier", self.handle.barrier)

        # Point-to-point: queued, and done together at the first wait(), so a pair of
        # ranks that each send before receiving cannot wait on each other.
        def _queue_p2p(self, tensor):
            """A message's tensor, on the device of those already queued (one call
            sends and receives them all)."""
            queued = [c.orig for _, _, c, _ in self._p2p]
            self._device(queued + [tensor])
            return _Contig(tensor)

        def send(self, tensors, dst, tag=0):
            _check_rank("send destination", dst, self._size)
            c = self._queue_p2p(tensors[0])
            work = MooncakeWork(self, flush=True)
            self._p2p.append(("send", int(dst), c, work))
            return work

        def recv(self, tensors, src, tag=0):
            _check_rank("recv source", src, self._size)
            c = self._queue_p2p(tensors[0])
            work = MooncakeWork(self, result=tensors, flush=True)
            self._p2p.append(("recv", int(src), c, work))
            return work

        def _flush_p2p(self):
            """Runs every queued send and receive; a failure fails every work queued
            with it (each one's wait() raises), not just the one waited on."""
            pending, self._p2p = self._p2p, []
            works = [work for *_, work in pending]
            for work in works:
                work._flush = False
            # Messages may have been queued under other streams than the current one.
            device = pending[0][2].orig.device if pending else torch.device("cpu")
            try:
                with self._on(device, every_stream=True):
                    self._send_recv_rounds(pending)
            except BaseException as e:
                # Whatever failed (an interrupt too), the messages not done yet fail
                # with it: each one's wait() raises it.
                for *_, work in pending:
                    work._error, work._failed = e, getattr(e, "failed_ranks", [])
                raise
            for work in works:  # their results are in place: run what waits on them
                work._settle()

        def _send_recv_rounds(self, pending):
            """Sends and receives ``pending``, one message each way per peer per round
            (the rest keep their order); done messages leave the list."""
            while pending:
                sends, recvs, rest, seen = [], [], [], set()
                for item in pending:
                    kind, peer, c, _ = item
                    if (kind, peer) in seen:
                        rest.append(item)
                        continue
                    seen.add((kind, peer))
                    (sends if kind == "send" else recvs).append((peer, c))
                self.handle.send_recv([(p, c.addr, c.nbytes) for p, c in sends],
                                      [(p, c.addr, c.nbytes) for p, c in recvs])
                for _, c in recvs:
                    c.done()
                pending[:] = rest

    class MooncakeCudaBackend(MooncakeBackend):
        """The ``mooncake`` backend: CUDA tensors go to the same collectives as device
        memory (``ProcessGroupHandle.set_memory``); the library stages them through
        pinned host memory with the driver, one copy in and one out per buffer, and
        copies outputs back only if the operation succeeded, so a failed one leaves the
        device tensors unchanged. Host tensors are taken as by ``mooncake-cpu``."""

        _DEVICE_TYPES = ("cuda", "cpu")

        def getBackendName(self):
            return CUDA_BACKEND_NAME

    def _options(backend_options):
        return backend_options if isinstance(backend_options, MooncakeBackendOptions) \
            else MooncakeBackendOptions()

    def _create_backend(dist_opts, backend_options):
        return MooncakeBackend(dist_opts.store, dist_opts.group_rank, dist_opts.group_size,
                               _options(backend_options))

    def _create_cuda_backend(dist_opts, backend_options):
        # Refused here, before the rank publishes an address: every rank of the group
        # fails the same way at once instead of some waiting for a peer that never comes.
        if not torch.cuda.is_available():
            raise RuntimeError(
                f"backend {CUDA_BACKEND_NAME!r} needs CUDA, and torch.cuda.is_available() is "
                f"False here; use backend={BACKEND_NAME!r} for host tensors")
        return MooncakeCudaBackend(dist_opts.store, dist_opts.group_rank,
                                   dist_opts.group_size, _options(backend_options))

    for _name, _creator, _devices in ((BACKEND_NAME, _create_backend, ["cpu"]),
                                      (CUDA_BACKEND_NAME, _create_cuda_backend, ["cuda"])):
        if _name.upper() not in getattr(dist.Backend, "_plugins", {}):
            dist.Backend.register_backend(_name, _creator, extended_api=True, devices=_devices)


def _handle(backend):
    """The ProcessGroupHandle of a backend, a process group or None (the default group)."""
    if isinstance(backend, ProcessGroupHandle):
        return backend
    if torch is not None:
        if backend is None:
            backend = dist.group.WORLD
        if isinstance(backend, MooncakeBackend):
            return backend.handle
        if isinstance(backend, dist.ProcessGroup):
            for device in ("cpu", "cuda"):
                try:
                    inner = backend._get_backend(torch.device(device))
                except RuntimeError:  # no backend for that device in this group
                    continue
                if isinstance(inner, MooncakeBackend):  # either backend
                    return inner.handle
    raise TypeError(f"not a Mooncake PG backend: {backend!r}")


def get_active_ranks(backend=None):
    """The active-rank mask: an int32 tensor (a list without torch)."""
    mask = [int(v) for v in _handle(backend).active_ranks()]
    return torch.tensor(mask, dtype=torch.int32) if torch is not None else mask


def get_peer_state(backend, ranks):
    """For each rank: active, or ready to be activated (a process claimed it)."""
    return _handle(backend).peer_state(ranks)


def activate_ranks(backend, ranks):
    """Proposes activating ``ranks`` (each must have called ``join_group``)."""
    return _handle(backend).propose(True, ranks)


recover_ranks = activate_ranks


def deactivate_ranks(backend, ranks):
    """Proposes deactivating ``ranks``."""
    return _handle(backend).propose(False, ranks)


def join_group(backend=None, timeout_ms=600_000):
    """Claims this rank and blocks until a member activates it."""
    _handle(backend).join(timeout_ms)


def sync_after_failure(backend=None):
    """After a failure, the survivors agree on a view without the failed ranks."""
    return _handle(backend).sync_after_failure()


def _failure(work):
    """The error a work ended with, or None. torch may hand back its own wrapper of our
    work; its ``wait()`` still runs ours, which raises the failure."""
    if torch is not None and isinstance(work, MooncakeWork):
        work._settle()
        return work._error
    if not hasattr(work, "wait"):
        raise TypeError(f"not a work: {work!r}")
    try:
        work.wait()
    except MooncakeCollectiveError as e:
        return e
    return None


def get_failed_ranks_hint(work):
    """The ranks a failed operation did not hear from (empty if it succeeded)."""
    e = _failure(work)
    return list(e.failed_ranks) if e is not None else []


def get_local_success(work):
    """Whether the operation succeeded on this rank."""
    return _failure(work) is None


def get_current_epoch(backend=None):
    return _handle(backend).epoch()


_DEVICE_FILTER = []


def set_device_filter(devices):
    """Which NICs/devices the engines may use. Kept for upstream compatibility: host
    collectives choose their transport from the engine settings
    (``MooncakeBackendOptions(engine={...})``), so the list is only recorded."""
    _DEVICE_FILTER[:] = list(devices)
