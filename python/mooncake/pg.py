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
import copy
import enum
import operator
import threading
import time
import weakref
from ctypes import byref, c_char_p, c_int, c_size_t, c_uint64, c_void_p

from . import _native
from ._native import (LIB, MC_ERR_INVALID_PARAMS, MC_ERR_TIMEOUT,
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

    def submit(self, task):
        """Queues ``task``, a callable that records its own outcome (never raises)."""
        with self._cond:
            if self._closed:
                raise RuntimeError("the process group was shut down")
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
        # Without auto_deactivate_on_failure, ranks the group went on without (this
        # rank's operation or another's) stay active for users, as upstream, until
        # deactivate_ranks / recover_ranks names them; operations skip them already.
        self.retained = set()
        self._shown = None  # the ranks last shown active (None: none shown yet)

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
    from torch._C._distributed_c10d import Backend as _TorchBackend
    from torch._C._distributed_c10d import Work as _TorchWork
except ImportError:  # pragma: no cover - exercised where torch is absent
    torch = None


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
            # Where this rank stands: the epoch of its last collective (or of its start)
            # and how many it completed in it (see _completed_elsewhere).
            self._ran = [self.handle.epoch(), 0]

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
            agreement round (``agree_max``, its own kind) in which every member gives
            the epoch of its last collective and the number of the one it is about to
            run in it; a member behind the furthest one of the same epoch leaves its
            operation (the caller sees local success False). Members new to the group
            (an older epoch) are never behind. A view others published or announced is
            taken part in first (whatever the auto flags: this rank would otherwise
            enter it inside its operation, where the others agree)."""
            self.handle.sync_after_failure()
            epoch = self.handle.epoch()
            if epoch == self._ran[0]:
                return False
            last, position = self._ran
            mine = (last & 0x7f_ffff) << 40 | min(position + 1, (1 << 40) - 1)
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
            self._ran = [self.handle.epoch(), 0]
            return furthest >> 40 == mine >> 40 and mine < furthest

        def _entered_new_view(self, error):
            """Whether a collective was refused because it entered a new view at its
            start (``agree_on_new_view``): unavailable while this rank is a member (one
            no longer a member gets the same code, and is not one)."""
            return (isinstance(error, MooncakeCollectiveError)
                    and error.code == MC_ERR_UNAVAILABLE_IN_CURRENT_STATUS
                    and self.handle.active_ranks()[self._rank])

        def _ran_one(self):
            epoch = self.handle.epoch()
            if epoch == self._ran[0]:
                self._ran[1] += 1
            else:
                # Run in a view it entered on the way in (every member did, or the
                # operation would have failed): the view's first.
                self._ran = [epoch, 1]

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
                    self._ran_one()
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
