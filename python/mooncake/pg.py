"""Mooncake PG: fault-tolerant collectives as a ``torch.distributed`` backend.

Importing this module registers the backend ``mooncake-cpu`` (host tensors) with
``torch.distributed`` when torch is importable; torch is not a dependency of the package.

    import torch.distributed as dist
    from mooncake import pg

    dist.init_process_group(backend="mooncake-cpu", rank=r, world_size=n,
                            pg_options=pg.MooncakeBackendOptions(timeout_ms=2000))
    work = dist.all_reduce(t, async_op=True)
    work.wait()                          # a dead rank: no raise, see below
    pg.get_local_success(work)           # False when a rank did not answer
    pg.get_failed_ranks_hint(work)       # int32 tensor, 1 for each rank it missed

A rank that dies is detected by timeout; inactive ranks are holes (rank numbers never
change, collectives skip them). The survivors then agree on a view without it and run
the operation again over themselves (``wait()`` raises MooncakeCollectiveError only if
that fails too); with ``auto_deactivate_on_failure`` off, membership keeps showing the
dead rank until ``deactivate_ranks`` names it. A replacement
process (or one for a slot past the world size, ``max_group_size``) starts like the
others, is recognised as joining a running group (``is_extension``), calls
``join_group(backend)`` and takes part once a member calls ``recover_ranks(backend,
[rank])``; until then its operations involve only itself. Every rank runs its own
transfer engine; peers write into its registered buffer one-sidedly (``c_include/
mooncake.h``, "Mooncake PG"). A collective runs when called, and its Work is complete
when returned, unless ``async_op=True`` on host tensors: then it joins the backend's
queue, run by a thread of its own in the order issued, and returns at once (``wait()``
blocks until it has run; anything else the caller does with the group, synchronous
operations, sends and receives, membership calls, EP, waits for the queue first).
Sends and receives are queued and done together at the first ``wait()`` of one of them,
or before the next collective; a send is done once its receiver has taken it. A peer
that does not answer fails only the messages with it, and not as an error: ``wait()``
returns, ``get_local_success`` is False and ``get_failed_ranks_hint`` names the peer,
and (with ``auto_sync_on_failure``) the survivors have agreed on a view without it by
then; the messages with other peers go through. A rank that deactivates only itself
(``deactivate_ranks(group, [rank])``) leaves on its own, while the others are between
operations; they see the new view at their next operation, ``get_active_ranks`` or
``get_current_epoch``.

The backend ``mooncake`` takes CUDA tensors with the same options, module functions and
failure semantics. Their memory goes to the C ABI as device memory
(``mc_pg_set_memory``): the library copies each buffer into pinned host memory once with
the driver, runs the same host collective, and copies the outputs back once, only if the
operation succeeded (synchronously: the operation is complete on the device when the
call returns). Creating it on a machine where ``torch.cuda.is_available()`` is false
raises at ``init_process_group`` / ``new_group``.
"""

import atexit
import collections
import contextlib
import ctypes
import enum
import operator
import os
import threading
import time
import weakref
from ctypes import byref, c_char_p, c_int, c_size_t, c_uint64, c_void_p

from . import _forked, _native
from ._native import (LIB, MC_ERR_INVALID_PARAMS, MC_ERR_TIMEOUT,  # noqa: F401 (mooncake.pg's codes)
                      MC_ERR_UNAVAILABLE_IN_CURRENT_STATUS, MC_OK, error_string)

__all__ = [
    "MooncakeBackendOptions",
    "MooncakeCollectiveError",
    "ProcessGroupHandle",
    "ProposalStatus",
    "ViewUpdateStatus",
    "SyncAfterFailureStatus",
    "ProposalResponse",
    "ProposeViewUpdateResponse",
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
    "get_num_synced_ranks",
    "extend_group_size_to",
    "set_collective_timeout_us",
    "set_p2p_timeout_us",
    "set_host_ip",
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


# Upstream's name for it.
ProposeViewUpdateResponse = ProposalResponse


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

    Positional forms as upstream's: ``(max_group_size)``, ``(max_group_size,
    is_extension)``, ``(max_group_size, auto_deactivate_on_failure,
    auto_sync_on_failure)``, ``(max_group_size, is_extension, auto_deactivate_on_failure,
    auto_sync_on_failure)``, ``(active_ranks)``, ``(active_ranks, is_extension)`` and
    ``(active_ranks, is_extension, max_group_size)``; every option is also a keyword.

    ``max_group_size``: rank slots reserved up front (default: the world size); ranks
    from the world size up start inactive and come in with ``join_group`` and
    ``recover_ranks``. ``active_ranks``: an int32 tensor (or a list) of at least
    ``max_group_size`` entries whose storage receives the live mask (1 = active) after
    init, after every operation and after every membership call; what it holds at init
    is ignored, as upstream. ``timeout_ms``: how long an operation waits for a peer
    (default ``set_collective_timeout_us``'s value, else 5000). ``engine`` takes extra
    engine settings (``mc_config_set`` keys, e.g. ``{"protocol": "tcp"}``).
    """

    def __init__(self, *args, active_ranks=None, is_extension=None, max_group_size=None,
                 auto_deactivate_on_failure=None, auto_sync_on_failure=None,
                 timeout_ms=None, cells_per_peer=None, cell_bytes=None, engine=None):
        given = _positional_options(args)
        for name, value in (("active_ranks", active_ranks), ("is_extension", is_extension),
                            ("max_group_size", max_group_size),
                            ("auto_deactivate_on_failure", auto_deactivate_on_failure),
                            ("auto_sync_on_failure", auto_sync_on_failure)):
            if value is not None:
                if name in given:
                    raise TypeError(f"MooncakeBackendOptions: {name} given twice")
                given[name] = value
        self.active_ranks = given.get("active_ranks")
        self.is_extension = bool(given.get("is_extension", False))
        size = given.get("max_group_size")
        # Upstream reads a size <= 0 as "not given".
        self.max_group_size = int(size) if size is not None and int(size) > 0 else None
        self.auto_deactivate_on_failure = bool(given.get("auto_deactivate_on_failure", True))
        self.auto_sync_on_failure = bool(given.get("auto_sync_on_failure", True))
        if self.auto_sync_on_failure and not self.auto_deactivate_on_failure:
            raise ValueError("auto_sync_on_failure requires auto_deactivate_on_failure=True")
        self.timeout_ms = int(timeout_ms) if timeout_ms is not None else _DEFAULTS["timeout_ms"]
        self.cells_per_peer = cells_per_peer
        self.cell_bytes = cell_bytes
        self.engine = {**_DEFAULTS["engine"], **dict(engine or {})}
        if self.active_ranks is not None:
            _check_mirror(self.active_ranks)

    def group_size(self, world_size):
        """Rank slots of the group: the world size, or ``max_group_size`` when larger."""
        return max(int(world_size), self.max_group_size or 0)

    def to_string(self, world_size, rank=None):
        """The C ABI's option string for a group of ``world_size`` ranks (torch's) with
        ``group_size(world_size)`` slots; ``rank`` is this process's (an extension's
        own slot starts inactive)."""
        size = self.group_size(world_size)
        if self.active_ranks is not None and _mirror_len(self.active_ranks) < size:
            raise ValueError(f"active_ranks has {_mirror_len(self.active_ranks)} entries for "
                             f"a group of {size}")
        start = [1 if r < world_size and not (self.is_extension and r == rank) else 0
                 for r in range(size)]
        items = {
            "is_extension": int(self.is_extension),
            "auto_deactivate_on_failure": int(self.auto_deactivate_on_failure),
            "auto_sync_on_failure": int(self.auto_sync_on_failure),
            "timeout_ms": self.timeout_ms,
            "active_ranks": "".join(map(str, start)),
        }
        if self.cells_per_peer is not None:
            items["cells_per_peer"] = int(self.cells_per_peer)
        if self.cell_bytes is not None:
            items["cell_bytes"] = int(self.cell_bytes)
        for k, v in self.engine.items():
            if any(c in f"{k}{v}" for c in ";="):
                raise ValueError(f"engine option {k}={v!r}: ';' and '=' are not allowed")
            items[k] = v
        return ";".join(f"{k}={v}" for k, v in items.items())


def _is_count(value):
    return isinstance(value, int) and not isinstance(value, bool)


def _positional_options(args):
    """Upstream's positional overloads, by the first argument's kind: a number is
    ``max_group_size``, anything else the ``active_ranks`` storage."""
    if not args:
        return {}
    if _is_count(args[0]):
        names = {1: ("max_group_size",),
                 2: ("max_group_size", "is_extension"),
                 3: ("max_group_size", "auto_deactivate_on_failure", "auto_sync_on_failure"),
                 4: ("max_group_size", "is_extension", "auto_deactivate_on_failure",
                     "auto_sync_on_failure")}.get(len(args))
    else:
        names = {1: ("active_ranks",), 2: ("active_ranks", "is_extension"),
                 3: ("active_ranks", "is_extension", "max_group_size")}.get(len(args))
    if names is None:
        raise TypeError(f"MooncakeBackendOptions: no form takes these {len(args)} positional "
                        f"arguments ({', '.join(type(a).__name__ for a in args)})")
    if "max_group_size" in names and not _is_count(args[names.index("max_group_size")]):
        raise TypeError("MooncakeBackendOptions: max_group_size must be an int")
    return dict(zip(names, args))


def _mirror_len(mirror):
    return int(mirror.numel()) if hasattr(mirror, "numel") else len(mirror)


def _check_mirror(mirror):
    """The active-ranks storage: an int32 contiguous tensor (as upstream) or a list."""
    if hasattr(mirror, "numel"):
        if str(mirror.dtype) != "torch.int32":
            raise ValueError(f"active_ranks must have dtype int32, not {mirror.dtype}")
        if not mirror.is_contiguous():
            raise ValueError("active_ranks must be contiguous")
    elif not isinstance(mirror, list):
        raise TypeError(f"active_ranks must be an int32 tensor or a list, not "
                        f"{type(mirror).__name__}")


def _write_mirror(mirror, mask):
    """Writes the live mask into the user's active-ranks storage (its first entries)."""
    if mirror is None:
        return
    if isinstance(mirror, list):
        mirror[:len(mask)] = mask
        return
    src = torch.tensor(mask, dtype=torch.int32)
    mirror.view(-1)[:len(mask)].copy_(src)


# Defaults for options created later (set_collective_timeout_us, set_host_ip).
_DEFAULTS = {"timeout_ms": 5000, "engine": {}}


# Tries of an operation whose peers did not answer: the first, then one over the
# survivors after reconciling, and one more in case another rank failed meanwhile.
_ATTEMPTS = 3
# Views a collective may find entered at its start, each sending it back to agree first
# (see ``_entered_new_view``), before such a refusal counts as a failed attempt: every
# entry needs a membership change of its own, so this bounds the loop, not the work.
_NEW_VIEWS = 16


class _AsyncQueue:
    """A backend's operations issued with ``async_op=True``, run one after another on a
    thread of the queue's own in the order they were issued. Anything that touches the
    group on the caller's thread (a synchronous operation, a send or receive, a
    membership call, EP) drains the queue first, so every rank still runs its operations
    in the order it called them. The thread starts with the first submission and stays
    (with the scratch buffers it keeps, see ``_save``) until ``close``."""

    # Every queue whose thread started: closed at exit (see _finish_threads).
    _started = weakref.WeakSet()

    def __init__(self):
        self._cond = threading.Condition()
        # Tasks not finished yet, the running one first (drain waits for it to empty).
        self._tasks = collections.deque()
        self._thread = None
        self._closed = False
        self._refusal = "the process group was shut down"
        _forked.track(self)

    def _after_fork_in_child(self):
        """The thread stayed with the parent: what it had queued never runs here, so
        the queue is closed and empty (drain and close return at once)."""
        self._cond = threading.Condition()
        self._tasks.clear()
        self._thread = None
        self._closed = True
        self._refusal = _forked.refusal("process group", os.getppid())

    def submit(self, task):
        """Queues ``task``, a callable that records its own outcome (never raises)."""
        with self._cond:
            if self._closed:
                raise RuntimeError(self._refusal)
            self._tasks.append(task)
            if self._thread is None:
                self._thread = threading.Thread(target=self._serve, daemon=True,
                                                 name="mooncake-pg-async")
                self._thread.start()
                _AsyncQueue._started.add(self)
            self._cond.notify_all()

    def _serve(self):
        while True:
            with self._cond:
                self._cond.wait_for(lambda: self._tasks or self._closed)
                if not self._tasks:
                    return  # closed
                task = self._tasks[0]
            try:
                task()
            except BaseException:  # noqa: BLE001 - tasks record their own outcome;
                pass                # the queue must go on whatever escapes one
            task = None  # an idle thread keeps no backend or tensors alive
            with self._cond:
                if self._tasks:  # emptied in a child the task forked
                    self._tasks.popleft()
                self._cond.notify_all()

    def close(self):
        """Runs what is queued, then ends the thread; later submissions are refused."""
        self.drain()
        with self._cond:
            self._closed = True
            self._cond.notify_all()
            thread = self._thread
        if thread is not None and thread is not threading.current_thread():
            # Its exit frees what it kept (scratch tensors): at exit, that must be done
            # before the interpreter goes, or torch aborts the process.
            thread.join()

    def serves_this_thread(self):
        return threading.current_thread() is self._thread

    def idle(self):
        """Whether no operation is queued or running."""
        with self._cond:
            return not self._tasks

    def drain(self):
        """Returns once every queued operation has finished."""
        with self._cond:
            if self.serves_this_thread():
                return  # a task itself: what runs before it is done
            self._cond.wait_for(lambda: not self._tasks)


class _Resolvers:
    """Threads that complete the futures of works finished on a queue's thread, one
    per work: a callback may issue and wait for a later operation, whose future must
    then be completed by another thread than the one waiting (the queue's own is busy
    with the task finishing the first, and a single resolver would wait on itself)."""

    def __init__(self):
        self._lock = threading.Lock()
        self._threads = set()
        _forked.track(self)

    def _after_fork_in_child(self):
        """The resolvers stayed with the parent (join would wait for them forever)."""
        self._lock = threading.Lock()
        self._threads = set()

    def start(self, resolve):
        def run():
            try:
                resolve()
            finally:
                with self._lock:
                    self._threads.discard(thread)

        thread = threading.Thread(target=run, daemon=True, name="mooncake-pg-future")
        with self._lock:
            self._threads.add(thread)
        thread.start()

    def join(self):
        """Waits for every resolver but the calling thread, and those they start."""
        while True:
            with self._lock:
                others = [t for t in self._threads if t is not threading.current_thread()]
            if not others:
                return
            for thread in others:
                thread.join()


_RESOLVERS = _Resolvers()


@atexit.register
def _finish_threads():
    """At exit, before the interpreter goes: operations still queued run (each is
    bounded by the group's timeout), futures' callbacks finish, and the threads end."""
    _RESOLVERS.join()
    for queue in list(_AsyncQueue._started):
        queue.close()
    _RESOLVERS.join()


class _Rendezvous:
    """Addresses in the c10d store, under keys of a generation: one more than the last
    group whose every rank got every address (``mooncake_pg/started``), so a group
    started again after destroy_process_group never reads an address left by the one
    before, and ranks that never took part (a group started again with more ranks)
    agree with those that did. The started mark cannot move while a group is being
    formed: its ranks read it before they publish, and it moves only once all have
    published. A process joining a running group (an extension, or the replacement of
    a process that never shut down) takes the running group's generation instead. Each
    rank's generation is also kept under its own key (``store.add``), to find its
    predecessor's address. A value is ``"<world size>|<address>"``."""

    _STARTED = "mooncake_pg/started"

    def __init__(self, store, rank, world_size, extension):
        self.store, self.rank = store, rank
        current = self._latest(rank)
        self.joining = (extension or self._predecessor_still_up(current)
                        or self._slot_of_a_running_group(world_size))
        if self.joining:
            target = max([current, 1] + [self._latest(r)
                                         for r in range(world_size) if r != rank])
        else:
            target = store.add(self._STARTED, 0) + 1
        self.generation = store.add(f"mooncake_pg/gen/{rank}", target - current)
        self.key = self._key(rank, self.generation)

    def started(self):
        """Marks this generation started, once this rank has every address: a group
        formed later takes the next one."""
        if self.joining:
            return
        for _ in range(64):  # bounded: each miss means another rank moved it up
            seen = self.store.add(self._STARTED, 0)
            if seen >= self.generation:
                return
            self.store.compare_set(self._STARTED, str(seen), str(self.generation))

    def await_members(self, world_size, timeout_s):
        """Counts this rank as started and waits (up to ``timeout_s``; a rank that died
        starting is found by the first operation) until every rank of the world size
        has: one-sided writes let a rank finish an operation with a peer still reading
        addresses, and the first to finish may host the store and take it down on
        exit. A joining rank neither counts nor waits: the group runs already."""
        if self.joining:
            return
        key = f"mooncake_pg/ready/{self.generation}"
        count = self.store.add(key, 1)
        deadline = time.monotonic() + timeout_s
        pause = 0.001
        while count < world_size and time.monotonic() < deadline:
            time.sleep(pause)
            pause = min(pause * 2, 0.05)
            count = self.store.add(key, 0)

    @staticmethod
    def _key(rank, generation):
        return f"mooncake_pg/{rank}/{generation}"

    def _latest(self, r):
        """Rank r's generation count (0 before its first start)."""
        return self.store.add(f"mooncake_pg/gen/{r}", 0)

    def _predecessor_still_up(self, current):
        """Its rank's previous process died without shutting down (its address is up,
        not retired): this one replaces it in the group that runs."""
        return (current > 0 and self.store.check([self._key(self.rank, current)])
                and not self.store.check([self._retired(self.rank, current)]))

    def _slot_of_a_running_group(self, world_size):
        """A lower rank started the group with a world size that does not include this
        rank (a slot of ``max_group_size``)."""
        return any(self._read(r, wait=True, newest=True)[0] <= self.rank
                   for r in range(min(self.rank, world_size)))

    def publish(self, world_size, address):
        self.store.set(self.key, f"{world_size}|{address}")

    def retire(self):
        """Marks this rank shut down. Its address stays readable: a rank of the same
        generation still starting (slower than the peers that already finished an
        operation with it and shut down) waits for every address, and would otherwise
        wait out the store's timeout for this one."""
        self.store.set(self._retired(self.rank, self.generation), "1")

    @staticmethod
    def _retired(rank, generation):
        return f"mooncake_pg/{rank}/{generation}/retired"

    def address(self, r, wait):
        """Rank r's address: with ``wait``, the one it publishes in this generation
        (waiting for it), else its newest, or "" when it has none up."""
        return self._read(r, wait)[1]

    def _read(self, r, wait, newest=False):
        """Rank r's (world size, address). With ``wait``: its newest if that is up and
        of this generation or later (a rank started before, as for a joiner), else the
        one it publishes in this generation, waiting as long as the store's timeout
        (with ``newest``, any generation's). Without: its newest, or (0, "").
        A retired address (its rank shut down) counts only as this generation's, which
        a rank still starting needs whatever became of the peer since."""
        timeout = getattr(self.store, "timeout", None)
        timeout = timeout.total_seconds() if timeout is not None else 300.0
        deadline = time.monotonic() + timeout
        pause = 0.005
        while True:
            latest = self._latest(r)
            if not wait or newest:
                generations = [latest]
            elif latest >= self.generation:
                generations = [latest, self.generation]
            else:
                generations = [self.generation]
            for g in (g for g in generations if g > 0):
                value = self._value(self._key(r, g))
                this_generation = wait and not newest and g == self.generation
                if value and (this_generation or not self._value(self._retired(r, g))):
                    size, _, address = value.partition("|")
                    return int(size), address
            if not wait:
                return 0, ""
            if time.monotonic() > deadline:
                raise RuntimeError(f"mooncake-cpu: rank {r} published no address in "
                                   f"{timeout:.0f} s")
            time.sleep(pause)
            pause = min(pause * 2, 0.1)

    # Never a published value: compare_set answers it for a key that is not there.
    _ABSENT = "\x00absent"

    def _value(self, key):
        """``key``'s value, or "" when it is not there, in one request that neither
        waits nor creates it (a check then a get could meet a key retired in between,
        and the get would wait out the store's timeout)."""
        value = self.store.compare_set(key, self._ABSENT, self._ABSENT)
        value = value.decode() if isinstance(value, bytes) else value
        return "" if value == self._ABSENT else value


def _fn(name):
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

    def __init__(self, rank, world_size, options=None, agree_on_new_view=False):
        opts = options or MooncakeBackendOptions()
        self.rank = int(rank)
        # Rank slots (``max_group_size`` when larger than the world size): the C
        # group's size; ranks from ``initial_size`` up start inactive.
        self.initial_size = int(world_size)
        self.world_size = opts.group_size(world_size)
        self.options = opts
        handle = c_void_p()
        text = opts.to_string(self.initial_size, self.rank)
        if agree_on_new_view:
            text += ";agree_on_new_view=1"
        text = text.encode()
        rc = _fn("mc_pg_new")(self.rank, self.world_size, text, byref(handle))
        if rc != MC_OK:
            raise RuntimeError(f"mc_pg_new: {error_string(rc)} ({rc})")
        self._h = handle
        # Held from a set_memory to the calls it is for (memory()); reentrant, so a
        # block may make other calls on the handle.
        self._lock = threading.RLock()
        self._memory = "cpu:0"
        _forked.track(self)
        # Without auto_deactivate_on_failure, ranks the group went on without (this
        # rank's operation or another's) stay active for users, as upstream, until
        # deactivate_ranks / recover_ranks names them; operations skip them already.
        self.retained = set()
        self._shown = None  # the ranks last shown active (None: none shown yet)

    def _after_fork_in_child(self):
        """A thread of the parent may have held the lock: the child's is free (its
        calls on the handle are refused by the library)."""
        self._lock = threading.RLock()

    def close(self):
        if self._h:
            _fn("mc_pg_free")(self._h)
            self._h = None

    @property
    def closed(self):
        return not self._h

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

    def local_only(self):
        """An extension not admitted yet: its operations involve only itself."""
        return self.options.is_extension and self.epoch() == 0

    def live_mask(self):
        """The active ranks as reported to users: 0/1 per slot; all 0 for an extension
        before a view admits it (it is in no view yet)."""
        if self.local_only():
            return [0] * self.world_size
        active = self.active_ranks()
        if not self.options.auto_deactivate_on_failure:
            if self._shown is not None:
                self.retained |= {r for r in self._shown if not active[r]}
            self.retained -= {r for r, v in enumerate(active) if v}
        mask = [int(v or r in self.retained) for r, v in enumerate(active)]
        self._shown = {r for r, v in enumerate(mask) if v}
        return mask

    def publish_mask(self):
        """Writes the live mask into the options' ``active_ranks`` storage (and, without
        auto_deactivate_on_failure, notes the ranks the group went on without)."""
        if not self._h:
            return
        if self.options.active_ranks is not None:
            _write_mirror(self.options.active_ranks, self.live_mask())
        elif not self.options.auto_deactivate_on_failure:
            self.live_mask()

    def epoch(self):
        e = c_uint64(0)
        self._check("epoch", _fn("mc_pg_epoch")(self._h, byref(e)))
        return e.value

    def refresh(self):
        """Adopts a view published while this rank was between operations (a member
        that deactivated only itself publishes one), unless an operation holds the rank
        now; ``active_ranks`` and ``epoch`` then show it."""
        self._check("refresh", _fn("mc_pg_refresh")(self._h))

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
        # Named now: from here on the group's own view says what they are.
        self.retained -= set(ranks)
        if self._shown is not None:
            self._shown -= set(ranks)
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

    def agree_max(self, value):
        """The largest of the active ranks' ``value`` (an agreement round of its own
        kind, which never pairs with another collective)."""
        out = c_uint64(0)
        self._check("agree_max", _fn("mc_pg_agree_max")(self._h, c_uint64(value), byref(out)))
        return out.value

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
except ImportError:  # pragma: no cover - exercised where torch is absent
    torch = None


def _backend_of(group):
    """The MooncakeBackend (either kind) of a backend or process group; None otherwise."""
    if isinstance(group, MooncakeBackend):
        return group
    if isinstance(group, dist.ProcessGroup):
        for device in ("cpu", "cuda"):
            try:
                inner = group._get_backend(torch.device(device))
            except RuntimeError:  # no backend for that device in this group
                continue
            if isinstance(inner, MooncakeBackend):
                return inner
    return None


def _ours_or_none(backend):
    """The MooncakeBackend of a backend, a process group or None (the default group);
    None for anything else (a bare ProcessGroupHandle included)."""
    if torch is None or isinstance(backend, ProcessGroupHandle):
        return None
    return _backend_of(dist.group.WORLD if backend is None else backend)


def _handle(backend):
    """The ProcessGroupHandle of a backend, a process group or None (the default group)."""
    if isinstance(backend, ProcessGroupHandle):
        return backend
    ours = _ours_or_none(backend)
    if ours is None:
        raise TypeError(f"not a Mooncake PG backend: {backend!r}")
    return ours.handle


def _refresh(backend):
    """Takes in a view published while the group was between operations (a member that
    left by deactivating itself), unless one of the group's operations is queued or
    running: that one takes it in as it starts, after its own checks."""
    ours = _ours_or_none(backend)
    if ours is None or ours._queue.idle():
        _handle(backend).refresh()


def get_active_ranks(backend=None):
    """The active-rank mask, one 0/1 per rank slot: an int32 tensor (a list without
    torch). All 0 on an extension that no view has admitted yet."""
    _refresh(backend)
    mask = _handle(backend).live_mask()
    return torch.tensor(mask, dtype=torch.int32) if torch is not None else mask


def get_peer_state(backend, ranks):
    """For each rank: active, or ready to be activated (a process claimed it)."""
    return _handle(backend).peer_state(ranks)


def get_num_synced_ranks(backend=None):
    """How many rank slots are active or ready to be activated (claimed with
    ``join_group``): the ranks ``recover_ranks`` could have active now."""
    h = _handle(backend)
    return sum(h.peer_state(range(h.world_size)))


def _drain(backend):
    """Waits until the operations ``backend`` (a backend, a process group or None: the
    default group) queued with ``async_op`` have run: calls that act on the group from
    the caller's thread (membership, EP) come after them, as on every other rank."""
    ours = _ours_or_none(backend)
    if ours is not None:
        ours._queue.drain()


def _membership_call(backend, call):
    """Runs a membership call, after the operations queued before it, and writes the new
    mask into the options' storage."""
    _drain(backend)
    h = _handle(backend)
    try:
        return call(h)
    finally:
        h.publish_mask()


def activate_ranks(backend, ranks):
    """Proposes activating ``ranks`` (each must have called ``join_group``)."""
    return _membership_call(backend, lambda h: h.propose(True, ranks))


recover_ranks = activate_ranks


def deactivate_ranks(backend, ranks):
    """Proposes deactivating ``ranks``. A rank naming only itself leaves on its own
    (graceful: the others may be between operations); they see the new view at their
    next operation or membership query."""
    return _membership_call(backend, lambda h: h.propose(False, ranks))


def join_group(backend=None, timeout_ms=600_000):
    """Claims this rank and blocks until a member activates it."""
    _membership_call(backend, lambda h: h.join(timeout_ms))
    ours = _ours_or_none(backend)
    if ours is not None:
        ours._joined()


def sync_after_failure(backend=None):
    """After a failure, the survivors agree on a view without the failed ranks."""
    return _membership_call(backend, lambda h: h.sync_after_failure())


def extend_group_size_to(backend, size):
    """Makes ``dist.get_world_size`` report ``size`` for the group from now on (it only
    grows). Ranks are still admitted by ``recover_ranks`` / ``activate_ranks`` (a joiner
    calls ``join_group``), and only into the rank slots reserved at init
    (``max(world_size, max_group_size)``): a rank past them cannot join, so reserve them
    with ``MooncakeBackendOptions(max_group_size)``."""
    ours = _ours_or_none(backend)
    if ours is None:
        raise TypeError(f"not a Mooncake PG backend: {backend!r}")
    size = operator.index(size)
    if size < ours.visible_size():
        raise ValueError(f"extend_group_size_to({size}): the group already has size "
                         f"{ours.visible_size()}; it does not shrink (inactive ranks are "
                         f"holes)")
    ours._visible = size


def set_collective_timeout_us(us):
    """How long operations of groups created from now on wait for a peer before it
    counts as failed (microseconds; rounded up to whole milliseconds)."""
    us = int(us)
    if us <= 0:
        raise ValueError(f"timeout must be positive, not {us} us")
    _DEFAULTS["timeout_ms"] = (us + 999) // 1000


# Point-to-point messages go through the same channels and wait as long as collectives.
set_p2p_timeout_us = set_collective_timeout_us


def set_host_ip(host):
    """The IP address the engines of groups created from now on bind and publish."""
    import ipaddress

    try:
        ipaddress.ip_address(host)
    except ValueError:
        raise ValueError(f"set_host_ip({host!r}): not an IP address") from None
    _DEFAULTS["engine"]["bind_address"] = host


_WAITED = threading.local()


def _ours(work):
    """Our work behind ``work``, which may be torch's wrapper of it (its ``wait()``
    runs ours, which says who it is), settled."""
    if torch is not None and isinstance(work, MooncakeWork):
        work._settle()
        return work
    if not hasattr(work, "wait"):
        raise TypeError(f"not a work: {work!r}")
    _WAITED.work = None
    try:
        work.wait()
    except MooncakeCollectiveError:
        pass
    ours = getattr(_WAITED, "work", None)
    if ours is None:
        raise TypeError(f"not a Mooncake PG work: {work!r}")
    return ours


def get_failed_ranks_hint(work):
    """The ranks an operation did not hear from: an int32 tensor with one 0/1 per rank
    slot. For a failed operation, 1 for each rank it missed; for one run again over the
    survivors, 1 for each rank it missed that the reconciliation then left out (a rank
    that was only slow answers there and is not named); for a send or receive whose
    peer did not answer, 1 for that peer; all 0 when every rank answered at once."""
    ours = _ours(work)
    missed = set(ours._failed)
    return torch.tensor([1 if r in missed else 0 for r in range(ours._backend._size)],
                        dtype=torch.int32)


def get_local_success(work):
    """Whether every rank this operation tried answered at once: False when it failed,
    when it ran again over the survivors after a rank did not answer, and for a send or
    receive whose peer did not answer."""
    ours = _ours(work)
    return ours._error is None and not ours._local_failure


def get_current_epoch(backend=None):
    _refresh(backend)
    return _handle(backend).epoch()


_DEVICE_FILTER = []


def set_device_filter(devices):
    """Which NICs/devices the engines may use. Kept for upstream compatibility: host
    collectives choose their transport from the engine settings
    (``MooncakeBackendOptions(engine={...})``), so the list is only recorded."""
    _DEVICE_FILTER[:] = list(devices)


if torch is not None:
    # The torch backends, registered with torch.distributed as the module is imported
    # (re-exported: mooncake.pg.MooncakeBackend and friends are where callers look).
    from ._pg_torch import (  # noqa: E402
        MooncakeBackend,
        MooncakeCudaBackend,
        MooncakeWork,
        _location,
    )


def __getattr__(name):
    # Upstream's module names the torch it was built for (its extension is one build
    # per torch release); this one binds any torch through the C ABI, so they describe
    # the torch in use, computed when asked for (importing this module needs no torch).
    if name in ("torch_version", "version_suffix"):
        import re

        import torch

        version = re.match(r"\d+(?:\.\d+)*", torch.__version__).group()
        return version if name == "torch_version" else "_" + version.replace(".", "_")
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
