"""Mooncake PG as a torch.distributed backend, with real processes.

Every collective on four ranks against a reference computed in the rank itself, and a
rank killed with SIGKILL during a stream of all_reduces: the survivors' operation runs
again over them (or, where a survivor had completed it, is left with its input) and its
work names the dead rank (``get_local_success`` False, ``get_failed_ranks_hint``), the
mask no longer has it, later operations succeed over the
survivors, and a replacement started with ``is_extension=True`` joins with the old rank
number. The parent hosts the c10d TCPStore; every child is killed at the end.
"""

import os
import queue
import subprocess
import sys
import threading
import time

import pytest

torch = pytest.importorskip("torch", reason="torch is not installed (a test-time dependency)")
import torch.distributed as dist  # noqa: E402

WORLD = 4
STEP = 60  # seconds: bound on any one step a test waits for

_PRELUDE = r"""
import os, sys, datetime
import torch, torch.distributed as dist
from mooncake import pg

rank, world = int(os.environ["PG_RANK"]), int(os.environ["PG_WORLD"])
extension = os.environ.get("PG_EXTENSION") == "1"
store = dist.TCPStore("127.0.0.1", int(os.environ["PG_STORE_PORT"]), is_master=False,
                      timeout=datetime.timedelta(seconds=60))
dist.init_process_group(backend="mooncake-cpu", store=store, rank=rank, world_size=world,
                        pg_options=pg.MooncakeBackendOptions(timeout_ms=int(os.environ["PG_TIMEOUT_MS"]),
                                                             is_extension=extension))
WORLD_PG = dist.group.WORLD

def say(*a):
    print(*a, flush=True)
"""

_COLLECTIVES = r"""
DTYPES = [torch.float32, torch.float64, torch.float16, torch.bfloat16, torch.int32,
          torch.int64, torch.uint8]

def inp(r, n, seed, small=False):
    m = 2 if small else 5
    return (torch.arange(n, dtype=torch.int64) * 3 + r * 7 + seed) % m + 1

for di, dt in enumerate(DTYPES):
    for n in (1, 1001, 40000):
        seed = di * 3 + n % 7
        for op, name in [(dist.ReduceOp.SUM, "sum"), (dist.ReduceOp.MIN, "min"),
                         (dist.ReduceOp.MAX, "max"), (dist.ReduceOp.PRODUCT, "product"),
                         (dist.ReduceOp.AVG, "avg")]:
            small = name == "product"
            stack = torch.stack([inp(r, n, seed, small) for r in range(world)])
            want = {"sum": stack.sum(0), "min": stack.min(0).values,
                    "max": stack.max(0).values, "product": stack.prod(0),
                    "avg": stack.sum(0)}[name]
            if name == "avg":
                want = (want.to(torch.float64) / world).to(dt) if dt.is_floating_point \
                    else torch.div(want, world, rounding_mode="trunc")
            t = inp(rank, n, seed, small).to(dt)
            dist.all_reduce(t, op=op)
            assert torch.equal(t, want.to(dt)), (dt, n, name)
            t = inp(rank, n, seed, small).to(dt)
            dist.reduce(t, dst=(seed + 1) % world, op=op)
            if rank == (seed + 1) % world:
                assert torch.equal(t, want.to(dt)), ("reduce", dt, n, name)
        # uneven: rank r's piece has n + 3r elements
        pieces = [inp(r, n + 3 * r, seed).to(dt) for r in range(world)]
        outs = [torch.zeros(n + 3 * r, dtype=dt) for r in range(world)]
        dist.all_gather(outs, pieces[rank])
        assert all(torch.equal(o, p) for o, p in zip(outs, pieces)), ("all_gather", dt, n)
        flat = torch.zeros(world * n, dtype=dt)
        dist.all_gather_into_tensor(flat, inp(rank, n, seed).to(dt))
        assert torch.equal(flat, torch.cat([inp(r, n, seed).to(dt) for r in range(world)]))
        root = seed % world
        t = pieces[root].clone() if rank == root else torch.zeros_like(pieces[root])
        dist.broadcast(t, src=root)
        assert torch.equal(t, pieces[root]), ("broadcast", dt, n)
        # reduce_scatter_tensor: rank r gets block r of the sum
        big = inp(rank, world * n, seed).to(dt)
        out = torch.zeros(n, dtype=dt)
        dist.reduce_scatter_tensor(out, big)
        total = torch.stack([inp(r, world * n, seed) for r in range(world)]).sum(0)
        assert torch.equal(out, total[rank * n:(rank + 1) * n].to(dt)), ("rs", dt, n)
        # all_to_all_single with uneven splits: r sends r + 2p + 1 rows to p
        send = [r_ + 2 * p + 1 for r_, p in [(rank, p) for p in range(world)]]
        recv = [r + 2 * rank + 1 for r in range(world)]
        x = torch.cat([torch.full((send[p],), rank * 10 + p, dtype=dt) for p in range(world)])
        y = torch.zeros(sum(recv), dtype=dt)
        dist.all_to_all_single(y, x, output_split_sizes=recv, input_split_sizes=send)
        want = torch.cat([torch.full((recv[r],), r * 10 + rank, dtype=dt) for r in range(world)])
        assert torch.equal(y, want), ("a2a", dt, n)
        ins = [torch.full((p + 1,), rank * 10 + p, dtype=dt) for p in range(world)]
        outs = [torch.zeros(rank + 1, dtype=dt) for _ in range(world)]
        dist.all_to_all(outs, ins)
        assert all(torch.equal(o, torch.full((rank + 1,), r * 10 + rank, dtype=dt))
                   for r, o in enumerate(outs)), ("all_to_all", dt, n)
        g = [torch.zeros(n, dtype=dt) for _ in range(world)] if rank == root else None
        dist.gather(inp(rank, n, seed).to(dt), gather_list=g, dst=root)
        if rank == root:
            assert all(torch.equal(g[r], inp(r, n, seed).to(dt)) for r in range(world))
        s = [inp(r, n, seed).to(dt) for r in range(world)] if rank == root else None
        o = torch.zeros(n, dtype=dt)
        dist.scatter(o, scatter_list=s, src=root)
        assert torch.equal(o, inp(rank, n, seed).to(dt)), ("scatter", dt, n)
        # point-to-point ring, both directions posted before either waits
        nxt, prv = (rank + 1) % world, (rank - 1) % world
        mine = inp(rank, n + rank, seed).to(dt)
        got = torch.zeros(n + prv, dtype=dt)
        works = [dist.isend(mine, nxt), dist.irecv(got, prv)]
        for w in works:
            w.wait()
        assert torch.equal(got, inp(prv, n + prv, seed).to(dt)), ("p2p", dt, n)
        dist.barrier()
    say("ok", dt)
w = dist.all_reduce(torch.ones(8), async_op=True)
w.wait()
assert pg.get_local_success(w) and pg.get_failed_ranks_hint(w).tolist() == [0] * world
say("done")
"""

_STREAM = r"""
import time
deadline = time.time() + 60
epoch_ok = [pg.get_current_epoch(WORLD_PG), 0]
failed_seen = False
while True:
    assert time.time() < deadline, "no recovery"
    vote = 1.0 if epoch_ok[0] > 1 and epoch_ok[1] >= 5 else 0.0
    t = torch.full((1001,), float(rank + 1))
    t[-1] = vote
    work = dist.all_reduce(t, async_op=True)
    # A rank that does not answer is not an error: the survivors agree on a view
    # without it and run the operation again; the work says whom it missed.
    work.wait()
    hint = pg.get_failed_ranks_hint(work).tolist()
    if not pg.get_local_success(work):
        say("failed", ",".join(str(r) for r in range(world) if hint[r]))
    else:
        assert hint == [0] * world, hint
    active = pg.get_active_ranks(WORLD_PG)
    want = float(sum(r + 1 for r in range(world) if active[r]))
    reduced = torch.equal(t[:-1], torch.full((1000,), want))
    if not reduced and not pg.get_local_success(work):
        # Run again over the survivors, or left with its input as given: a survivor
        # had completed it before the death (with the dead rank's part), so running
        # it here would meet that survivor's next operation.
        reduced = torch.equal(t[:-1], torch.full((1000,), float(rank + 1)))
    assert reduced, (t[:3], active)
    if int(t[-1].item()) == int(active.sum().item()):
        break
    e = pg.get_current_epoch(WORLD_PG)
    if e != epoch_ok[0]:
        epoch_ok = [e, 0]
    epoch_ok[1] += 1
    say("progress")
active = pg.get_active_ranks(WORLD_PG)
dead = [r for r in range(world) if not active[r]]
assert pg.get_peer_state(WORLD_PG, dead) == [False] * len(dead)
resp = pg.deactivate_ranks(WORLD_PG, dead)
assert resp.status in (pg.ProposalStatus.Applied, pg.ProposalStatus.AppliedWithDroppedRanks)
say("recovered", ",".join(map(str, dead)))
assert sys.stdin.readline().strip() == "activate"
while True:
    assert time.time() < deadline + 60, "replacement never activated"
    resp = pg.activate_ranks(WORLD_PG, dead)
    if resp.status != pg.ProposalStatus.Rejected:
        break
    time.sleep(0.02)  # the replacement's claim may still be on its way
"""

_FULL = r"""
assert pg.get_active_ranks(WORLD_PG).tolist() == [1] * world
for _ in range(5):
    t = torch.full((300,), rank + 1, dtype=torch.int64)
    dist.all_reduce(t)
    assert torch.equal(t, torch.full((300,), sum(range(1, world + 1)), dtype=torch.int64))
say("full", pg.get_current_epoch(WORLD_PG))
say("done")
"""

_REPLACEMENT = r"""
say("joining")
pg.join_group(WORLD_PG, timeout_ms=60000)
say("joined", pg.get_current_epoch(WORLD_PG))
"""


class Rank:
    """A rank process: stdout lines (and stderr's, with ``merge_stderr``) on a queue;
    killed at the end whatever happened. ``prelude`` runs before ``script``."""

    def __init__(self, script, store_port, rank, extension=False, timeout_ms=3000,
                 world=WORLD, prelude=None, merge_stderr=False):
        # One intra-op thread: four ranks' OpenMP teams spinning on a small host can
        # stall one rank past the timeout.
        env = dict(os.environ, PG_RANK=str(rank), PG_WORLD=str(world),
                   PG_STORE_PORT=str(store_port), PG_EXTENSION="1" if extension else "0",
                   PG_TIMEOUT_MS=str(timeout_ms), OMP_NUM_THREADS="1")
        code = (_PRELUDE if prelude is None else prelude) + script
        self.proc = subprocess.Popen([sys.executable, "-c", code], env=env,
                                     stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                     stderr=subprocess.STDOUT if merge_stderr else None,
                                     text=True)
        self.lines = queue.Queue()
        self.log = []
        threading.Thread(target=self._read, daemon=True).start()

    def _read(self):
        for line in self.proc.stdout:
            self.lines.put(line.rstrip("\n"))
        self.lines.put(None)

    def expect(self, prefix):
        deadline = time.monotonic() + STEP
        while True:
            try:
                line = self.lines.get(timeout=max(0.0, deadline - time.monotonic()))
            except queue.Empty:
                line = None
            if line is None:
                pytest.fail(f"no {prefix!r} line; saw {self.log}, exit {self.proc.poll()}")
            self.log.append(line)
            if line.startswith(prefix):
                return line

    def tell(self, line):
        self.proc.stdin.write(line + "\n")
        self.proc.stdin.flush()

    def finish(self):
        self.proc.stdin.close()
        assert self.proc.wait(timeout=STEP) == 0, self.log

    def kill(self):
        if self.proc.poll() is None:
            self.proc.kill()
        self.proc.wait(timeout=STEP)


@pytest.fixture
def store():
    s = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)
    yield s


@pytest.fixture
def ranks():
    started = []
    yield started
    for r in started:
        r.kill()


def test_every_collective_matches_the_reference(store, ranks):
    ranks.extend(Rank(_COLLECTIVES, store.port, r, timeout_ms=20000) for r in range(WORLD))
    for r in ranks:
        r.expect("ok torch.uint8")
        r.expect("done")
    for r in ranks:
        r.finish()


@pytest.mark.parametrize("victim", [1, 0], ids=["member", "coordinator"])
def test_killed_rank_is_named_excluded_and_replaced(store, ranks, victim):
    # Rank 0 is the lowest member: it coordinates the changes until it dies.
    ranks.extend(Rank(_STREAM + _FULL, store.port, r) for r in range(WORLD))
    for r in ranks:
        r.expect("progress")
    ranks[victim].kill()
    named = 0
    for i, r in enumerate(ranks):
        if i == victim:
            continue
        assert r.expect("recovered") == f"recovered {victim}"
        for line in r.log:
            if line.startswith("failed"):
                assert line == f"failed {victim}", (i, line)
                named += 1
    assert named > 0, "no survivor saw the failure"
    replacement = Rank(_REPLACEMENT + _FULL, store.port, victim, extension=True)
    ranks.append(replacement)
    replacement.expect("joining")
    for i, r in enumerate(ranks[:WORLD]):
        if i != victim:
            r.tell("activate")
    for r in [replacement] + [r for i, r in enumerate(ranks[:WORLD]) if i != victim]:
        r.expect("full")
        r.expect("done")
    for r in [replacement] + [r for i, r in enumerate(ranks[:WORLD]) if i != victim]:
        r.finish()


def test_options_are_checked_before_anything_starts():
    from mooncake import pg

    with pytest.raises(ValueError):
        pg.MooncakeBackendOptions(active_ranks=[1, 0]).to_string(4)
    with pytest.raises(RuntimeError):
        pg.ProcessGroupHandle(5, 4)
    with pytest.raises(TypeError):
        pg.get_current_epoch(object())


def test_module_names_the_torch_in_use_as_upstreams_does():
    import torch

    from mooncake import pg

    assert torch.__version__.startswith(pg.torch_version)
    assert pg.version_suffix == "_" + pg.torch_version.replace(".", "_")
    with pytest.raises(AttributeError):
        pg.no_such_name  # noqa: B018


# ---------------------------------------------- subgroups and the membership functions

_SUBGROUP = r"""
import time
deadline = time.time() + 60
SUB = [1, 2, 3]
sub = dist.new_group(SUB, pg_options=pg.MooncakeBackendOptions(
    timeout_ms=int(os.environ["PG_TIMEOUT_MS"])))
me = SUB.index(rank) if rank in SUB else None

def reduced(group, value):
    t = torch.full((100,), float(value))
    work = dist.all_reduce(t, group=group, async_op=True)
    work.wait()
    assert pg.get_local_success(work)
    assert pg.get_failed_ranks_hint(work).tolist() == [0] * pg.get_active_ranks(group).numel()
    return int(t[0].item())

assert reduced(WORLD_PG, rank + 1) == 10
if me is not None:
    assert reduced(sub, rank + 1) == 2 + 3 + 4
    assert pg.get_active_ranks(sub).tolist() == [1, 1, 1]
    assert pg.get_peer_state(sub, [0, 1, 2]) == [True] * 3
    before = pg.get_current_epoch(sub)
# Every member has read `before` before the leaver leaves: a member slower to get
# there could otherwise read the new view's epoch as its `before` (a CI flake).
dist.barrier()
# Sub-rank 2 (global 3) leaves the subgroup by itself (a rank naming only itself
# needs no one else); the others see the new view once it has left. Had they
# proposed the same change at the same moment, two views of it would race.
if rank == 3:
    resp = pg.deactivate_ranks(sub, [2])
    assert resp.status == pg.ProposalStatus.Applied, resp
dist.barrier()
if me is not None:
    # The leaver has the new view when its call returns; the others learn it from it
    # (pushed, not part of the world barrier): wait for it, within the deadline.
    while pg.get_active_ranks(sub).tolist() != [1, 1, 0] and time.time() < deadline:
        time.sleep(0.01)
    assert pg.get_active_ranks(sub).tolist() == [1, 1, 0]
    assert pg.get_current_epoch(sub) > before
# The world group's membership is its own: untouched.
assert pg.get_active_ranks(WORLD_PG).tolist() == [1] * world
assert pg.get_current_epoch(WORLD_PG) == 1
assert reduced(WORLD_PG, rank + 1) == 10
if rank == 3:
    t = torch.ones(100)
    work = dist.all_reduce(t, group=sub, async_op=True)
    assert not pg.get_local_success(work)
    try:
        work.wait()
        raise AssertionError("an inactive rank took part")
    except pg.MooncakeCollectiveError:
        pass
elif me is not None:
    assert reduced(sub, rank + 1) == 2 + 3
    assert pg.get_peer_state(sub, [0, 1, 2]) == [True, True, False]
dist.barrier()
if rank == 3:
    pg.join_group(sub, timeout_ms=60000)
elif me is not None:
    while pg.activate_ranks(sub, [2]).status == pg.ProposalStatus.Rejected:
        assert time.time() < deadline, "never activated"
        time.sleep(0.02)  # the claim may still be on its way
if me is not None:
    assert reduced(sub, rank + 1) == 2 + 3 + 4
    assert pg.get_peer_state(sub, [0, 1, 2]) == [True] * 3
say("ready")
assert sys.stdin.readline().strip() == "go"
# Rank 0, outside the subgroup, is dead now: the subgroup does not notice.
epoch = pg.get_current_epoch(sub)
assert reduced(sub, rank + 1) == 2 + 3 + 4
assert pg.get_current_epoch(sub) == epoch
# The world group's operation runs again over the survivors (it says it missed rank
# 0), or starts in the view the others agreed on meanwhile (then it missed no one).
t = torch.full((100,), float(rank + 1))
work = dist.all_reduce(t, async_op=True)
work.wait()
hint = pg.get_failed_ranks_hint(work).tolist()
assert hint == ([0] * 4 if pg.get_local_success(work) else [1, 0, 0, 0]), hint
assert pg.get_active_ranks(WORLD_PG).tolist() == [0, 1, 1, 1]
assert int(t[0].item()) == 2 + 3 + 4
assert pg.get_current_epoch(WORLD_PG) > 1
assert pg.get_peer_state(WORLD_PG, [0, 1]) == [False, True]
assert reduced(WORLD_PG, rank + 1) == 2 + 3 + 4
assert pg.get_active_ranks(sub).tolist() == [1, 1, 1]
say("done")
"""


def test_subgroup_has_its_own_membership(store, ranks):
    ranks.extend(Rank(_SUBGROUP, store.port, r) for r in range(WORLD))
    for r in ranks:
        r.expect("ready")
    ranks[0].kill()
    for r in ranks[1:]:
        r.tell("go")
    for r in ranks[1:]:
        r.expect("done")
    for r in ranks[1:]:
        r.finish()
