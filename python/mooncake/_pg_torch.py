"""The ``torch.distributed`` side of Mooncake PG (see ``mooncake.pg``): the backends
``mooncake-cpu`` and ``mooncake``, their Work, and their registration with torch, which
happens as this module is imported. ``mooncake.pg`` imports it last, and only where torch
is importable, so the rest of the package never needs torch."""

import contextlib
import copy
import os
import threading

import torch
import torch.distributed as dist
from torch._C._distributed_c10d import Backend as _TorchBackend
from torch._C._distributed_c10d import Work as _TorchWork

from . import _forked
from ._native import (MC_ERR_INVALID_PARAMS, MC_ERR_TIMEOUT,
                      MC_ERR_UNAVAILABLE_IN_CURRENT_STATUS)
from ._pg_position import Position
from .pg import (
    BACKEND_NAME,
    CUDA_BACKEND_NAME,
    DTYPE_BF16,
    DTYPE_F16,
    DTYPE_F32,
    DTYPE_F64,
    DTYPE_I32,
    DTYPE_I64,
    DTYPE_U8,
    MooncakeBackendOptions,
    MooncakeCollectiveError,
    OP_AVG,
    OP_MAX,
    OP_MIN,
    OP_PRODUCT,
    OP_SUM,
    ProcessGroupHandle,
    SyncAfterFailureStatus,
    _ATTEMPTS,
    _AsyncQueue,
    _NEW_VIEWS,
    _RESOLVERS,
    _Rendezvous,
    _WAITED,
    _backend_of,
)

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

def _reduced_before_a_failure(cs):
    """The tensors of an in-place reduction over several (one C call each) that a
    retry must have restored: a failed call leaves its own buffer as it was, but the
    calls before it completed."""
    return [c.t for c in cs[:-1]]

def _restore(inputs, saved):
    """Puts back what ``MooncakeBackend._save`` copied."""
    for t, s in zip(inputs, saved):
        t.view(-1).view(torch.uint8).copy_(s)

def _copy_alone(what, out, inp):
    """A tensor form's result on a rank alone (an extension before join_group): its
    own block, the whole buffer on both sides."""
    _check_bytes(f"{what} (one active rank before join_group)",
                 inp.numel() * inp.element_size(), out.numel() * out.element_size())
    out.view(-1).copy_(inp.view(-1))

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
    """An operation's outcome: ``wait()`` raises its failure (torch's future-based
    helper would swallow it). A synchronous operation's work is complete when
    returned; an asynchronous one's (``async_op=True``) when the backend's queue has
    run it; a send's or receive's at the first ``wait()`` of any queued message (or
    when an asynchronous operation issued after it has run)."""

    def __init__(self, backend, error=None, failed_ranks=(), result=None, queued=False,
                 local_failure=False, pending=False):
        super().__init__()
        self._backend = backend
        self._error = error
        # Ranks the operation missed: on failure, or when it completed without them
        # (``local_failure``, not an error: run again over the survivors, or a send
        # or receive whose peer did not answer).
        self._failed = list(failed_ranks)
        self._local_failure = local_failure
        self._result = result or []
        # A send or receive not handed to the library yet (see _flush_p2p).
        self._queued = queued
        self._done = threading.Event()
        # Futures handed out before completion (get_future), completed with it.
        self._lock = threading.Lock()
        self._futures = []
        if not (pending or queued):
            self._done.set()
        else:
            _forked.track(self)

    def _after_fork_in_child(self):
        """What would complete this work runs in the parent's threads: in a forked
        child a work not done yet fails at once (its callbacks are not run here)."""
        self._lock = threading.Lock()
        if not self._done.is_set():
            self._error = RuntimeError(_forked.refusal("process group", os.getppid()))
            self._queued = False
        self._done = threading.Event()
        self._done.set()

    def _complete(self, error=None):
        """Marks the work done (failed with ``error`` when given)."""
        with self._lock:
            if error is not None:
                self._error = error
                self._failed = list(getattr(error, "failed_ranks", []))
            self._done.set()
            futures, self._futures = self._futures, []
        if futures:
            self._backend._run_callbacks(lambda: [self._resolve(f) for f in futures])

    def _take(self, outcome):
        """Completes this pending work with ``outcome`` (a finished work)."""
        self._error, self._failed = outcome._error, outcome._failed
        self._local_failure = outcome._local_failure
        self._complete()

    def _complete_missed(self, ranks):
        """Completes this work as a local failure without an error: ``ranks`` (a
        message's peer) did not answer."""
        with self._lock:
            self._failed = list(ranks)
            self._local_failure = True
        self._complete()

    def _resolve(self, fut):
        if self._error is not None:
            fut.set_exception(self._error)
        else:
            fut.set_result(self._result)

    def _settle(self):
        """Blocks until the operation is done."""
        if self._queued:
            try:
                self._backend._flush_p2p()
            except Exception:
                # _flush_p2p gave the error to every work whose message was not
                # done, this one included if so; a delivered message succeeded.
                pass
        self._done.wait()

    def wait(self, timeout=None):
        """Blocks until the operation is done and raises its failure. With a
        ``timeout`` (a timedelta or seconds; 0 or None: none, as torch's default),
        raises RuntimeError if it is not done by then; it stays queued."""
        # torch hands users its own wrapper, whose wait() runs this one: the module
        # functions find this work through it (_ours).
        _WAITED.work = self
        seconds = timeout.total_seconds() if hasattr(timeout, "total_seconds") \
            else (timeout or 0)
        if seconds > 0 and not self._queued and not self._done.wait(seconds):
            raise RuntimeError(f"the operation did not complete within {seconds} s")
        self._settle()
        if self._error is not None:
            raise self._error
        return True

    def is_completed(self):
        # A queued send or receive is done at its first wait(): polling does it too.
        if self._queued:
            self._settle()
        return self._done.is_set()

    def is_success(self):
        self._settle()
        return self._error is None

    def exception(self):
        self._settle()
        return self._error

    def result(self):
        return self._result

    def get_future(self):
        """A future completed with the operation (at once when it is done)."""
        fut = torch.futures.Future()
        with self._lock:
            if not self._done.is_set() and not self._queued:
                self._futures.append(fut)
                return fut
        self._settle()
        self._resolve(fut)
        return fut

class MooncakeBackend(_TorchBackend):
    """The ``mooncake-cpu`` backend: one group rank, collectives over the C ABI."""

    # Where this backend's tensors may live.
    _DEVICE_TYPES = ("cpu",)

    # torch asks this (through getattr) before batching point-to-point calls; the
    # messages are queued and sent together at the first wait() anyway.
    supports_coalescing = False

    def __init__(self, store, rank, size, options):
        super().__init__(rank, size)
        self._rank = rank
        self._rendezvous = _Rendezvous(store, rank, size, options.is_extension)
        if self._rendezvous.joining and not options.is_extension:
            # As upstream, a process coming to a running group is an extension
            # whatever it was told: local-only until join_group.
            options = copy.copy(options)
            options.is_extension = True
        self.handle = ProcessGroupHandle(rank, size, options, agree_on_new_view=True)
        # Rank slots, max_group_size's when larger: every per-rank list has this many.
        self._size = self.handle.world_size
        # The size torch reports for the group (see visible_size).
        self._visible = size
        self._rendezvous.publish(size, self.handle.address())
        addresses = []
        for r in range(self._size):
            if r == rank or r >= size:
                # Slots past the world size belong to ranks not started yet: the
                # core learns a joiner's address from its join record.
                addresses.append("")
            else:
                # An extension takes only addresses already up: a rank may be dead.
                addresses.append(self._rendezvous.address(
                    r, wait=not options.is_extension))
        self._rendezvous.started()
        self.handle.connect(addresses)
        self._rendezvous.await_members(size, options.timeout_ms / 1000)
        self.handle.publish_mask()
        self._p2p = []
        self._queue = _AsyncQueue()
        self._scratch = threading.local()  # see _save (the queue's thread has its own)
        # Where this rank stands in the group's collectives (see _completed_elsewhere).
        self._position = Position(self.handle.epoch())
        self._made_by = os.getpid()

    def visible_size(self):
        """The group's size as ``dist.get_world_size`` reports it: torch's world size
        at init, grown (never shrunk: inactive ranks are holes) to every reserved
        slot once a rank past torch's world size is admitted (the count torch's
        lists then take, see ``_world``), or to what ``extend_group_size_to`` set.
        After shutdown, the last size reported."""
        if not self.handle.closed:
            self._visible = max(self._visible, self._world())
        return self._visible

    def shutdown(self):
        """Stops this rank, after the operations it queued, and retires its address
        (torch calls this from destroy_process_group)."""
        self._queue.close()
        # A forked child's shutdown must not retire the parent's rank.
        if os.getpid() == self._made_by:
            try:
                self._rendezvous.retire()
            except Exception:  # the store may be gone already
                pass
        self.handle.close()

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

    @staticmethod
    def _may_retry(error):
        """Whether a failed operation is run again over the ranks that answer: peers
        did not answer in time (as upstream, an operation completes over the ranks
        that answer whatever the auto flags; those say what membership shows), or a
        peer was found in another operation (one that entered a new view before
        this rank saw it: the agreement below puts them back in step)."""
        return (error.code in (MC_ERR_TIMEOUT, MC_ERR_INVALID_PARAMS)
                and bool(error.failed_ranks))

    def _completed_elsewhere(self):
        """Whether the operation about to run was completed by surviving peers while
        it failed here (or never started here), so running it would meet their next
        one instead (same kind and size: a wrong result without an error).

        It happens when a rank dies inside an operation after its data reached some
        survivors and not others. So the first operation of each new view is an
        agreement round (``agree_max``, its own kind) in which every member gives its
        position (``_pg_position``); a member behind the furthest leaves its operation
        (the caller sees local success False). Members new to the group are never
        behind. A view others published or announced is taken part in first (whatever
        the auto flags: this rank would otherwise enter it inside its operation, where
        the others agree)."""
        self.handle.sync_after_failure()
        if not self._position.needs_agreement(self.handle.epoch()):
            return False
        mine = self._position.mine()
        for attempt in range(_ATTEMPTS):
            try:
                furthest = self.handle.agree_max(mine)
                break
            except MooncakeCollectiveError:
                # A peer still reconciling (or another death): reconcile and agree
                # again; the operation itself has not failed.
                if attempt + 1 == _ATTEMPTS:
                    raise
                self.handle.sync_after_failure()
        behind = self._position.behind(furthest)
        self._position.agreed_in(self.handle.epoch(), furthest)
        return behind

    def _joined(self):
        """Admitted (again) by a view (``join_group``): new to the group's sequence."""
        self._position.joined()

    def _entered_new_view(self, error):
        """Whether a collective was refused because it entered a new view at its
        start (``agree_on_new_view``): unavailable while this rank is a member (one
        no longer a member gets the same code, and is not one)."""
        return (isinstance(error, MooncakeCollectiveError)
                and error.code == MC_ERR_UNAVAILABLE_IN_CURRENT_STATUS
                and self.handle.active_ranks()[self._rank])

    def _save(self, inputs):
        """Copies of ``inputs`` (contiguous tensors) for a retry, in a host buffer
        this thread keeps: a fresh allocation per operation costs more than the copy
        (page faults: 0.8 ms for 1 MiB here)."""
        need = sum(t.numel() * t.element_size() for t in inputs)
        scratch = getattr(self._scratch, "buf", None)
        if scratch is None or scratch.numel() < need:
            scratch = self._scratch.buf = torch.empty(need, dtype=torch.uint8)
        saved, off = [], 0
        for t in inputs:
            n = t.numel() * t.element_size()
            saved.append(scratch[off:off + n])
            saved[-1].copy_(t.view(-1).view(torch.uint8))
            off += n
        return saved

    def _run(self, what, fn, *tensors, opts=None, result=None, device=None, inputs=(),
             local=None, check=None):
        """Runs an operation (see ``_execute``) after the sends and receives queued
        before it: at once, or on the backend's queue when the caller asked for
        ``async_op`` on host tensors, once ``check`` (what ``fn`` checks against the
        active ranks as it starts) passes against the ranks active now, so a
        caller's mistake raises here, not at ``wait()``. Device tensors are staged by
        the library synchronously on the caller's thread, against its current
        stream; an extension not admitted yet runs its local-only operations at
        once."""
        device = device if device is not None else torch.device("cpu")
        asynchronous = (device.type == "cpu" and getattr(opts, "asyncOp", False)
                        and not self.handle.local_only())
        if asynchronous and check is not None:
            check()
        # Queued sends and receives go first, in the order they were called: a peer
        # waiting in its receive must not meet this operation instead.
        if asynchronous:
            messages = self._take_p2p()
            work = MooncakeWork(self, result=result, pending=True)

            def task():
                try:
                    self._send_queued(messages)
                except BaseException:  # noqa: BLE001
                    pass  # each queued message's wait() raises it
                try:
                    work._take(self._execute(what, fn, tensors, result, device, inputs,
                                             local))
                except BaseException as e:  # noqa: BLE001 - wait() raises it
                    work._complete(e)
            try:
                self._queue.submit(task)
            except BaseException as e:
                for *_, message in messages:  # taken: they would wait forever
                    message._complete(e)
                raise
            return work
        self._queue.drain()
        messages = self._take_p2p()
        try:
            self._send_queued(messages)
        except MooncakeCollectiveError:
            pass  # each queued message's wait() raises it
        return self._execute(what, fn, tensors, result, device, inputs, local)

    def _execute(self, what, fn, tensors, result, device, inputs, local):
        """Runs ``fn`` (the C call(s); it reads the active ranks afresh each time).
        When peers do not answer, membership is reconciled and ``fn`` runs again
        over the survivors, ``inputs`` (the tensors it updates in place) restored
        first; the work then succeeds with local success False and, as its hint, the
        missed ranks that the reconciliation left out. The first operation of each
        new view checks first that no survivor completed it already
        (``_completed_elsewhere``), and leaves it if one did. An extension not
        admitted yet runs ``local`` instead: its operations involve only itself."""
        if self.handle.local_only():
            if local is None:
                raise RuntimeError(f"{what}: rank {self._rank} has not joined the group "
                                   f"yet (join_group first)")
            local()
            for c in tensors:
                c.done()
            return MooncakeWork(self, result=result)
        # What a failure may leave changed is copied for a retry: the tensors of a
        # list reduced before the call that failed (host memory here, whatever the
        # device; the failing call itself changes nothing, device memory included).
        saved = self._save(inputs)
        missed = []
        attempt = 0
        entered = 0
        while attempt < _ATTEMPTS:
            try:
                if self._completed_elsewhere():
                    # Inputs as given, outputs left as they are; local success False.
                    with self._on(device):
                        _restore(inputs, saved)
                    self.handle.publish_mask()
                    return MooncakeWork(self, result=result,
                                        failed_ranks=self._excluded(missed),
                                        local_failure=True)
                with self._on(device):
                    fn()
                self._position.completed_one(self.handle.epoch())
                break
            except (MooncakeCollectiveError, ValueError) as e:
                if entered < _NEW_VIEWS and self._entered_new_view(e):
                    entered += 1
                    # The C call entered a view the others agreed on meanwhile and
                    # ran nothing in it: agree first, as they do (not an attempt).
                    with self._on(device):
                        _restore(inputs, saved)
                    continue
                if isinstance(e, ValueError) and attempt == 0:
                    raise  # refused before anything moved: the caller's mistake
                # (A ValueError on a retry: the survivors' view no longer fits a
                # buffer sized for the ranks active before; the work fails.)
                missed = sorted(set(missed) | set(getattr(e, "failed_ranks", [])))
                retry = (isinstance(e, MooncakeCollectiveError)
                         and attempt + 1 < _ATTEMPTS and self._may_retry(e))
                if retry:
                    try:
                        status = self.handle.sync_after_failure().status
                    except MooncakeCollectiveError:
                        status = SyncAfterFailureStatus.Rejected
                    retry = status != SyncAfterFailureStatus.Rejected
                # Run again or not, in-place inputs go back to what was given.
                with self._on(device):
                    _restore(inputs, saved)
                if not retry:
                    self._position.passed_one()
                    self.handle.publish_mask()
                    return MooncakeWork(self, e, missed)
                attempt += 1
        for c in tensors:
            c.done()
        self.handle.publish_mask()
        return MooncakeWork(self, result=result, failed_ranks=self._excluded(missed),
                            local_failure=bool(missed))

    def _excluded(self, missed):
        """The ranks an operation missed that the reconciliation left out: one it
        merely waited for (slow, or itself waiting on the dead rank) answered there
        and stays a member, so it is not named as failed."""
        if not missed:
            return missed  # every operation that heard from all: no C call
        active = self.handle.active_ranks()
        return [r for r in missed if not active[r]]

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
        # Alone, every reduction of one value is that value.
        return self._run("all_reduce", run, *cs, opts=opts, result=tensors, device=dev,
                         inputs=_reduced_before_a_failure(cs), local=lambda: None)

    def broadcast(self, tensors, opts):
        dev = self._device(tensors)
        cs = [_Contig(t) for t in tensors]
        _check_rank("broadcast root", opts.rootRank, self._size)

        def run():
            for c in cs:
                self.handle.broadcast(c.addr, c.nbytes, opts.rootRank)
        return self._run("broadcast", run, *cs, opts=opts, result=tensors, device=dev,
                         local=lambda: None)

    def reduce(self, tensors, opts):
        dev = self._device(tensors)
        cs = [_Contig(t) for t in tensors]
        op = _op(opts.reduceOp)
        dtypes = [_dtype(c.t) for c in cs]
        _check_rank("reduce root", opts.rootRank, self._size)

        def run():
            for c, dt in zip(cs, dtypes):
                self.handle.reduce(c.addr, c.t.numel(), dt, op, opts.rootRank)
        return self._run("reduce", run, *cs, opts=opts, result=tensors, device=dev,
                         inputs=_reduced_before_a_failure(cs), local=lambda: None)

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
        active_count = 1 if self.handle.local_only() else sum(self.handle.active_ranks())
        if len(outs) != self._size and len(outs) == active_count:
            return self._allgather_active(outs, input_tensors[0], output_tensors, opts)
        outs = self._within_slots(outs)
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

        def local():
            outs[self._rank].copy_(inp.t.view(outs[self._rank].shape))
        return self._run("all_gather", run, opts=opts, result=output_tensors, device=dev,
                         local=local)

    def _allgather_active(self, outs, input, output_tensors, opts):
        """all_gather with one output per ACTIVE rank, in rank order (a group with
        slots past torch's world size, or after a failure), as upstream sizes it."""
        dev = self._device([input] + outs)
        inp = _Contig(input)
        _check_dtypes("all_gather output", outs, inp.t.dtype)

        def check():
            """The active ranks, one output each."""
            active = self.handle.active_ranks()
            members = [r for r in range(self._size) if active[r]]
            if len(members) != len(outs):
                raise ValueError(f"all_gather outputs: {len(outs)} entries for "
                                 f"{len(members)} active ranks")
            mine = outs[members.index(self._rank)]
            _check_like(f"all_gather output {members.index(self._rank)} (this rank's)",
                        mine, inp.t)
            return members

        def run():
            members = check()
            sizes = [0] * self._size
            for r, o in zip(members, outs):
                sizes[r] = o.numel() * o.element_size()
            flat = torch.empty(sum(sizes), dtype=torch.uint8, device=dev)
            self.handle.all_gather(inp.addr, flat.data_ptr(), sizes)
            off = 0
            for r, o in zip(members, outs):
                o.copy_(flat[off:off + sizes[r]].view(o.dtype).view(o.shape))
                off += sizes[r]

        def local():
            outs[0].copy_(inp.t.view(outs[0].shape))
        return self._run("all_gather", run, opts=opts, result=output_tensors, device=dev,
                         local=local, check=check)

    def _world(self):
        """How many ranks torch's lists and splits cover: torch's world size while
        the slots past it (``max_group_size``) are all inactive, else every slot."""
        h = self.handle
        if h.initial_size < self._size and not any(h.active_ranks()[h.initial_size:]):
            return h.initial_size
        return self._size

    def _within_slots(self, items):
        """``items`` one per rank of a size ``extend_group_size_to`` set past the
        slots, cut to the slots (the rest are holes no rank fills, left as they
        are); any other list as it is."""
        if self._size < len(items) == self._visible:
            return items[:self._size]
        return items

    def _slots(self, what, items, blank):
        """``items`` (one per rank of ``_world()``, one per slot, or one per rank of
        a size ``extend_group_size_to`` set past the slots) as one per slot: the
        slots past torch's world size get ``blank()`` (nothing to send or receive
        there); entries past the slots are holes no rank can fill, left as they
        are."""
        items = self._within_slots(items)
        if len(items) == self._size:
            return items
        _check_count(what, items, self._world())
        return items + [blank() for _ in range(self._size - len(items))]

    def _active_sizes(self, what, chunk, total):
        """Per-rank block sizes of a buffer holding one ``chunk`` per ACTIVE rank, in
        rank order (0 for inactive ranks), as upstream sizes the tensor forms; and
        whether ``total`` bytes fit that now. A buffer sized for fewer ranks is let
        through (peers may have died unnoticed: the operation then fails and runs
        again over the survivors); one sized for more is refused. The view is the
        one ``_run`` took part in just before (``_completed_elsewhere``)."""
        active = self.handle.active_ranks()
        count = sum(active)
        if total > chunk * count or (chunk and total % chunk) or (not chunk and total):
            raise ValueError(f"{what}: {total} bytes where at most {chunk * count} "
                             f"(a block of {chunk} per active rank, {count} active) "
                             f"are needed")
        return [chunk if a else 0 for a in active], total == chunk * count

    def _allgather_base(self, output, input, opts):
        dev = self._device([output, input])
        out, inp = _Contig(output), _Contig(input)
        if out.t.dtype != inp.t.dtype:
            raise ValueError(f"all_gather_into_tensor: output is {out.t.dtype}, input "
                             f"{inp.t.dtype}")
        what = "all_gather_into_tensor output"

        def check():
            return self._active_sizes(what, inp.nbytes, out.nbytes)

        def run():
            sizes, fits = check()
            if fits:
                self.handle.all_gather(inp.addr, out.addr, sizes)
                return
            spare = torch.empty(sum(sizes), dtype=torch.uint8, device=dev)
            self.handle.all_gather(inp.addr, spare.data_ptr(), sizes)
            # It succeeded with every rank it expected: the output was sized wrong.
            _check_bytes(what, out.nbytes, sum(sizes))

        def local():
            _copy_alone(what, out.t, inp.t)
        return self._run("all_gather_into_tensor", run, out, opts=opts,
                         result=[output], device=dev, local=local, check=check)

    def reduce_scatter(self, output_tensors, input_tensors, opts):
        ins = list(input_tensors[0])
        dev = self._device([output_tensors[0]] + ins)
        out = _Contig(output_tensors[0])
        ins = self._slots("reduce_scatter inputs", ins,
                          lambda: ins[0].new_empty(0) if ins else torch.empty(0))
        # Checked before the cat, which would promote mixed dtypes silently.
        _check_dtypes("reduce_scatter input", ins, out.t.dtype)
        dtype, op = _dtype(out.t), _op(opts.reduceOp)
        _check_like(f"reduce_scatter output (input {self._rank}'s block)", out.t,
                    ins[self._rank])
        flat = torch.cat([i.reshape(-1) for i in ins])
        counts = [i.numel() for i in ins]

        def run():
            self.handle.reduce_scatter(flat.data_ptr(), out.addr, counts, dtype, op)

        def local():
            out.t.copy_(ins[self._rank].view(out.t.shape))
        return self._run("reduce_scatter", run, out, opts=opts,
                         result=output_tensors, device=dev,
                         local=local)

    def _reduce_scatter_base(self, output, input, opts):
        dev = self._device([output, input])
        out, inp = _Contig(output), _Contig(input)
        if out.t.dtype != inp.t.dtype:
            raise ValueError(f"reduce_scatter_tensor: output is {out.t.dtype}, input "
                             f"{inp.t.dtype}")
        dtype, op = _dtype(inp.t), _op(opts.reduceOp)
        what = "reduce_scatter_tensor input"
        elem = out.t.element_size()

        def check():
            # Block j of the input goes to the j-th active rank.
            return self._active_sizes(what, out.nbytes, inp.nbytes)

        def run():
            sizes, fits = check()
            counts = [n // elem for n in sizes]
            if fits:
                self.handle.reduce_scatter(inp.addr, out.addr, counts, dtype, op)
                return
            spare = torch.zeros(sum(sizes), dtype=torch.uint8, device=dev)
            spare[:inp.nbytes].copy_(inp.t.reshape(-1).view(torch.uint8))
            result = torch.empty_like(out.t)
            self.handle.reduce_scatter(spare.data_ptr(), result.data_ptr(), counts,
                                       dtype, op)
            # It succeeded with every rank it expected: the input was sized wrong.
            _check_bytes(what, inp.nbytes, sum(sizes))

        def local():
            _copy_alone(what, out.t, inp.t)
        return self._run("reduce_scatter_tensor", run, out, opts=opts,
                         result=[output], device=dev, local=local, check=check)

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
            # The size get_world_size reports (past the slots after an extend).
            world = max(self._world(), self._visible)
            if given is None or len(given) == 0:  # torch passes [] for "not given"
                if rows % world:
                    raise ValueError(f"all_to_all_single {what}: {rows} rows do not "
                                     f"split evenly over world size {world}")
                given = [rows // world] * world
            given = [int(s) for s in given]
            if any(s < 0 for s in given):
                raise ValueError(f"all_to_all_single {what} split sizes {given}: "
                                 f"negative")
            if sum(given) != rows:
                raise ValueError(f"all_to_all_single {what} split sizes {given} sum to "
                                 f"{sum(given)} rows; the tensor has {rows}")
            # Rows for holes past the slots are the tensor's last: left as they are.
            given = self._slots(f"all_to_all_single {what} split sizes", given,
                                lambda: 0)
            return [s * row_bytes for s in given]

        send = splits("input", inp.t, input_split_sizes)
        recv = splits("output", out.t, output_split_sizes)

        def run():
            self.handle.all_to_all(inp.addr, send, out.addr, recv)

        def local():  # only this rank's own block moves
            me = self._rank
            _check_bytes("all_to_all_single own block", recv[me], send[me])
            src = inp.t.contiguous().view(-1).view(torch.uint8)
            dst = out.t.view(-1).view(torch.uint8)
            dst[sum(recv[:me]):sum(recv[:me + 1])].copy_(
                src[sum(send[:me]):sum(send[:me + 1])])
        return self._run("all_to_all_single", run, out, opts=opts, result=[output], device=dev,
                         local=local)

    def alltoall(self, output_tensors, input_tensors, opts):
        ins, outs = list(input_tensors), list(output_tensors)
        dev = self._device(ins + outs)
        ins = self._slots("all_to_all inputs", ins,
                          lambda: ins[0].new_empty(0) if ins else torch.empty(0))
        outs = self._slots("all_to_all outputs", outs,
                           lambda: outs[0].new_empty(0) if outs else torch.empty(0))
        # One dtype throughout, so every output block starts aligned for it.
        _check_dtypes("all_to_all input", ins, outs[0].dtype)
        _check_dtypes("all_to_all output", outs, outs[0].dtype)
        flat_in = torch.cat([t.contiguous().view(-1).view(torch.uint8) for t in ins]) \
            if ins else torch.empty(0, dtype=torch.uint8, device=dev)
        send = [t.numel() * t.element_size() for t in ins]
        recv = [t.numel() * t.element_size() for t in outs]
        flat_out = torch.empty(sum(recv), dtype=torch.uint8, device=dev)

        def run():
            self.handle.all_to_all(flat_in.data_ptr(), send, flat_out.data_ptr(), recv)
            self._copy_blocks(outs, flat_out, recv)

        def local():
            _check_like("all_to_all own block", outs[self._rank], ins[self._rank])
            outs[self._rank].copy_(ins[self._rank].view(outs[self._rank].shape))
        return self._run("all_to_all", run, opts=opts, result=output_tensors, device=dev,
                         local=local)

    def gather(self, output_tensors, input_tensors, opts):
        root = opts.rootRank
        _check_rank("gather root", root, self._size)
        outs = list(output_tensors[0]) if self._rank == root else []
        dev = self._device([input_tensors[0]] + outs)
        inp = _Contig(input_tensors[0])
        if self._rank == root:
            outs = self._slots("gather outputs", outs, lambda: torch.empty_like(inp.t))
            for r, o in enumerate(outs):
                _check_like(f"gather output {r}", o, inp.t)
        sizes = [inp.nbytes] * self._size
        flat = torch.empty(sum(sizes) if self._rank == root else 0, dtype=torch.uint8,
                           device=dev)

        def run():
            self.handle.gather(inp.addr, flat.data_ptr() or None, sizes, root)
            if self._rank == root:
                self._copy_blocks(outs, flat, sizes)

        def local():
            if self._rank == root:
                outs[root].copy_(inp.t.view(outs[root].shape))
        return self._run("gather", run, opts=opts,
                         result=output_tensors, device=dev, local=local)

    def scatter(self, output_tensors, input_tensors, opts):
        root = opts.rootRank
        _check_rank("scatter root", root, self._size)
        ins = list(input_tensors[0]) if self._rank == root else []
        dev = self._device([output_tensors[0]] + ins)
        out = _Contig(output_tensors[0])
        sizes = [out.nbytes] * self._size
        if self._rank == root:
            ins = self._slots("scatter inputs", ins, lambda: torch.zeros_like(out.t))
            for r, t in enumerate(ins):
                _check_like(f"scatter input {r}", t, out.t)
            flat = torch.cat([t.contiguous().view(-1).view(torch.uint8) for t in ins])
        else:
            flat = torch.empty(0, dtype=torch.uint8, device=dev)

        def run():
            self.handle.scatter(flat.data_ptr() or None, out.addr, sizes, root)

        def local():
            if self._rank == root:
                out.t.copy_(ins[root].view(out.t.shape))
        return self._run("scatter", run, out, opts=opts, result=output_tensors, device=dev,
                         local=local)

    # Newer torch calls these names for the tensor forms.
    all_gather_single = _allgather_base
    reduce_scatter_single = _reduce_scatter_base
    all_to_all_single = alltoall_base

    def barrier(self, opts=None):
        return self._run("barrier", self.handle.barrier, opts=opts, local=lambda: None)

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
        work = MooncakeWork(self, queued=True)
        self._p2p.append(("send", int(dst), c, work))
        return work

    def recv(self, tensors, src, tag=0):
        _check_rank("recv source", src, self._size)
        c = self._queue_p2p(tensors[0])
        work = MooncakeWork(self, result=tensors, queued=True)
        self._p2p.append(("recv", int(src), c, work))
        return work

    def _run_callbacks(self, resolve):
        """Runs ``resolve`` (completing futures runs their callbacks) off the
        queue's thread (see _Resolvers)."""
        if self._queue.serves_this_thread():
            _RESOLVERS.start(resolve)
        else:
            resolve()

    def _take_p2p(self):
        """The queued sends and receives, handed to whoever sends them next."""
        pending, self._p2p = self._p2p, []
        for *_, work in pending:
            work._queued = False
        return pending

    def _flush_p2p(self):
        """Runs every queued send and receive, after the operations queued before
        them."""
        self._queue.drain()
        self._send_queued(self._take_p2p())

    def _send_queued(self, pending):
        """Sends and receives ``pending`` and completes their works. A peer that
        does not answer fails only the messages with it, and not as an error (as
        upstream): see ``_send_round``. Any other failure fails every work whose
        message was not done yet (each one's wait() raises it), not just the one
        waited on."""
        if not pending:
            return
        # Messages may have been queued under other streams than the current one.
        device = pending[0][2].orig.device
        try:
            with self._on(device, every_stream=True):
                self._send_recv_rounds(pending)
        except BaseException as e:
            # Whatever failed (an interrupt too), the messages not done yet fail
            # with it.
            for *_, work in pending:
                work._complete(e)
            raise

    def _send_recv_rounds(self, pending):
        """Sends and receives ``pending``, one message each way per peer per round
        (the rest keep their order); done messages leave the list, their works
        completed. Messages with a peer that did not answer in an earlier round
        are not sent: they fail as that round's did."""
        silent = set()
        while pending:
            batch, rest, seen = [], [], set()
            for item in pending:
                kind, peer, _, work = item
                if peer in silent:
                    work._complete_missed([peer])
                elif (kind, peer) in seen:
                    rest.append(item)
                else:
                    seen.add((kind, peer))
                    batch.append(item)
            pending[:] = batch + rest
            silent |= self._send_round(batch)
            pending[:] = rest

    def _send_round(self, batch):
        """Sends and receives ``batch`` (one message each way per peer) and
        completes their works; returns the peers that did not answer. Their
        messages complete as local failures naming the peer in the failed-ranks
        hint; the others' complete as usual. With ``auto_sync_on_failure`` the
        survivors reconcile before the works complete, so the new view is in
        place when wait() returns, as upstream."""
        def messages(which):
            return [(peer, c.addr, c.nbytes) for kind, peer, c, _ in batch
                    if kind == which]

        silent = set()
        try:
            self.handle.send_recv(messages("send"), messages("recv"))
        except MooncakeCollectiveError as e:
            # A timeout names exactly the peers of the messages not done (the
            # library finishes the others'); any other failure is the caller's.
            if e.code != MC_ERR_TIMEOUT or not e.failed_ranks:
                raise
            silent = set(e.failed_ranks)
            if self.handle.options.auto_sync_on_failure:
                try:
                    self.handle.sync_after_failure()
                except MooncakeCollectiveError:
                    pass  # this rank's next operation fails, saying why
            self.handle.publish_mask()
        for kind, peer, c, work in batch:
            if peer in silent:
                work._complete_missed([peer])
                continue
            if kind == "recv":
                c.done()
            work._complete()
        return silent

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

def _report_grown_sizes():
    """``dist.get_world_size`` (``ProcessGroup.size``) of a group run by this backend
    reports ``MooncakeBackend.visible_size``, so it grows when ranks past torch's world
    size are admitted, as upstream's does; torch fixes a group's size when it makes
    it, and other groups keep torch's answer."""
    torch_size = dist.ProcessGroup.size
    if getattr(torch_size, "reports_mooncake_size", False):
        return  # this module imported twice (a reload)

    def size(group):
        ours = _backend_of(group)
        return torch_size(group) if ours is None else ours.visible_size()

    size.reports_mooncake_size = True
    size.__doc__ = torch_size.__doc__
    dist.ProcessGroup.size = size

_report_grown_sizes()
