"""Mooncake PG's upstream-compatible surface, with real rank processes.

Batched point-to-point (``dist.batch_isend_irecv``), a group grown past its initial world
size (``max_group_size``: three ranks start, a fourth joins as an extension and is
admitted with ``recover_ranks``, then exchanges point-to-point), a rank that exits
between operations (the survivors' next operations do not raise: they run again over
the survivors and say so through ``get_local_success`` / ``get_failed_ranks_hint``),
and a group destroyed and started
again on the same store. The ``active_ranks`` tensor of the options is storage only: its
contents at init are ignored and the live mask is written into it.
"""

import pytest

pytest.importorskip("torch", reason="torch is not installed (a test-time dependency)")

from test_pg import Rank, ranks, store  # noqa: E402,F401

# Like test_pg's prelude, but each script starts its own group(s).
_BARE = r"""
import os, sys, time, datetime
import torch, torch.distributed as dist
from mooncake import pg

rank, world = int(os.environ["PG_RANK"]), int(os.environ["PG_WORLD"])
TIMEOUT_MS = int(os.environ["PG_TIMEOUT_MS"])
store = dist.TCPStore("127.0.0.1", int(os.environ["PG_STORE_PORT"]), is_master=False,
                      timeout=datetime.timedelta(seconds=60))

def say(*a):
    print(*a, flush=True)

def wait_line(want):
    assert sys.stdin.readline().strip() == want

def await_claims(g, ranks):
    # Bounded: the ranks' processes claim their slots (join_group) within a minute.
    deadline = time.monotonic() + 60
    while not all(pg.get_peer_state(g, ranks)):
        assert time.monotonic() < deadline, ("never claimed", ranks)
        time.sleep(0.02)
"""

_RING = r"""
dist.init_process_group(backend="mooncake-cpu", store=store, rank=rank, world_size=world,
                        pg_options=pg.MooncakeBackendOptions(timeout_ms=TIMEOUT_MS))
nxt, prv = (rank + 1) % world, (rank - 1) % world
for n in (1, 5000):
    mine = torch.full((n,), float(rank + 1))
    got = torch.zeros(n)
    works = dist.batch_isend_irecv([dist.P2POp(dist.isend, mine, nxt),
                                    dist.P2POp(dist.irecv, got, prv)])
    for w in works:
        w.wait()
    assert torch.equal(got, torch.full((n,), float(prv + 1))), (n, got[:3])
say("ring ok")
"""


def _all_run(ranks, store, script, world, line):
    """Starts `world` ranks of `script`; each must print `line`, then exit cleanly."""
    ranks.extend(Rank(script, store.port, r, world=world, timeout_ms=20000, prelude=_BARE)
                 for r in range(world))
    for r in ranks:
        r.expect(line)
    for r in ranks:
        r.finish()


def _lose_rank_one(ranks, store, script, world, gone, after, timeout_ms=2000):
    """Starts `world` ranks of `script`; rank 1 must print `gone` and exit cleanly, then
    the others are told "go" and must each print `after`. Returns those survivors."""
    ranks.extend(Rank(script, store.port, r, world=world, timeout_ms=timeout_ms,
                      prelude=_BARE)
                 for r in range(world))
    ranks[1].expect(gone)
    assert ranks[1].proc.wait(timeout=60) == 0
    survivors = ranks[:1] + ranks[2:]
    for r in survivors:
        r.tell("go")
    for r in survivors:
        r.expect(after)
    return survivors


def test_batch_isend_irecv_ring(store, ranks):
    _all_run(ranks, store, _RING, 3, "ring ok")


# Three primaries start a group of world size 3 with 4 slots; the joiner starts with
# world size 4 as an extension. dist.get_world_size() grows to 4 on the primaries once
# the joiner is admitted, as upstream's.
_EXTENSION = r"""
JOINER = 3

def tensor_ops(count, me):
    # all_gather_into_tensor and reduce_scatter_tensor sized for `count` active ranks.
    out = torch.zeros(count, dtype=torch.int32)
    dist.all_gather_into_tensor(out, torch.tensor([me + 1], dtype=torch.int32))
    assert out.tolist() == list(range(1, count + 1)), out
    got = torch.zeros(1, dtype=torch.int32)
    dist.reduce_scatter_tensor(got, torch.arange(1, count + 1, dtype=torch.int32))
    assert got.item() == (me + 1) * count, got

mirror = torch.full((4,), 7, dtype=torch.int32)  # contents are ignored
if rank < JOINER:
    dist.init_process_group(backend="mooncake-cpu", store=store, rank=rank, world_size=3,
                            pg_options=pg.MooncakeBackendOptions(mirror, False, 4))
    g = dist.group.WORLD
    assert mirror.tolist() == [1, 1, 1, 0], mirror
    assert dist.get_world_size() == 3
    t = torch.tensor([rank + 1], dtype=torch.int32)
    dist.all_reduce(t)
    assert t.item() == 6, t
    tensor_ops(3, rank)
    # The list form takes one tensor per slot (the inactive one untouched) or one per
    # active rank.
    for count in (4, 3):
        outs = [torch.full((2,), -1, dtype=torch.int32) for _ in range(count)]
        dist.all_gather(outs, torch.full((2,), rank, dtype=torch.int32))
        assert [o.tolist() for o in outs] == [[0, 0], [1, 1], [2, 2], [-1, -1]][:count]
    say("primary ready")
    await_claims(g, [JOINER])
    assert pg.get_num_synced_ranks(g) == 4
    resp = pg.recover_ranks(g, [JOINER])
    assert resp.status == pg.ProposalStatus.Applied, resp
    assert mirror.tolist() == [1, 1, 1, 1], mirror
    assert dist.get_world_size() == 4 and dist.get_world_size(g) == 4
else:
    # Not told it is an extension (upstream's newest tests do not say either): rank 0
    # started the group with a world size without this rank, so it joins a running one.
    dist.init_process_group(backend="mooncake-cpu", store=store, rank=JOINER, world_size=4,
                            pg_options=pg.MooncakeBackendOptions(mirror, False, 4))
    g = dist.group.WORLD
    assert dist.get_world_size() == 4
    # Local-only until admitted: every operation involves only this rank.
    assert pg.get_active_ranks(g).tolist() == [0, 0, 0, 0]
    assert mirror.tolist() == [0, 0, 0, 0], mirror
    t = torch.tensor([JOINER + 1], dtype=torch.int32)
    dist.all_reduce(t)
    assert t.item() == JOINER + 1, t
    outs = [torch.full((1,), -1, dtype=torch.int32) for _ in range(4)]
    dist.all_gather(outs, torch.tensor([9], dtype=torch.int32))
    assert [o.item() for o in outs] == [-1, -1, -1, 9], outs
    tensor_ops(1, 0)
    one = [torch.zeros(1, dtype=torch.int32)]
    dist.all_gather(one, torch.tensor([5], dtype=torch.int32))
    assert one[0].item() == 5
    dist.barrier()
    say("joining")
    pg.join_group(g, timeout_ms=60000)
    assert mirror.tolist() == [1, 1, 1, 1], mirror
t = torch.tensor([rank + 1], dtype=torch.int32)
dist.all_reduce(t)
assert t.item() == 10, t
tensor_ops(4, rank)
assert pg.get_active_ranks(g).tolist() == [1, 1, 1, 1]
say("done")
"""


def _start_in_two_waves(ranks, store, script, first, second, ready="primary ready"):
    """Starts ranks `first` of a four-slot `script`, waits for each to say `ready`, then
    starts `second` (their stderr merged: tests read their warnings) and returns them."""
    for r in first:
        ranks.append(Rank(script, store.port, r, world=4, timeout_ms=20000, prelude=_BARE))
    for r in ranks:
        r.expect(ready)
    for r in second:
        ranks.append(Rank(script, store.port, r, world=4, timeout_ms=20000, prelude=_BARE,
                          merge_stderr=True))
    return ranks[len(first):]


def test_extension_past_the_initial_world_size(store, ranks):
    [joiner] = _start_in_two_waves(ranks, store, _EXTENSION, range(3), [3])
    joiner.expect("joining")
    for r in ranks:
        r.expect("done")
    for r in ranks:
        r.finish()


# Point-to-point after a scale-up (upstream's elastic P2P test): three primaries (world
# size 3, 4 slots) admit joiner 3; the joiner and primary 2 then exchange through
# batch_isend_irecv in both directions, between barriers, while the others idle.
_EXTENSION_P2P = r"""
JOINER, PEER = 3, 2
if rank < JOINER:
    dist.init_process_group(backend="mooncake-cpu", store=store, rank=rank, world_size=3,
                            pg_options=pg.MooncakeBackendOptions(4, timeout_ms=TIMEOUT_MS))
    g = dist.group.WORLD
    say("primary ready")
    await_claims(g, [JOINER])
    pg.recover_ranks(g, [JOINER])
else:
    dist.init_process_group(backend="mooncake-cpu", store=store, rank=JOINER, world_size=4,
                            pg_options=pg.MooncakeBackendOptions(4, True, timeout_ms=TIMEOUT_MS))
    g = dist.group.WORLD
    pg.join_group(g, timeout_ms=60000)
assert dist.get_world_size() == 4
t = torch.tensor([rank + 1], dtype=torch.int32)
dist.all_reduce(t)
assert t.item() == 10, t
for src, dst in ((JOINER, PEER), (PEER, JOINER)):
    dist.barrier()
    if rank == src:
        works = dist.batch_isend_irecv(
            [dist.P2POp(dist.isend, torch.full((1024,), src, dtype=torch.int32), dst)])
    elif rank == dst:
        got = torch.empty(1024, dtype=torch.int32)
        works = dist.batch_isend_irecv([dist.P2POp(dist.irecv, got, src)])
    else:
        works = []
    for w in works:
        w.wait()
    if rank == dst:
        assert torch.equal(got, torch.full((1024,), src, dtype=torch.int32)), got[:4]
dist.barrier()
say("done")
"""


def test_point_to_point_with_an_admitted_joiner(store, ranks):
    _start_in_two_waves(ranks, store, _EXTENSION_P2P, range(3), [3])
    for r in ranks:
        r.expect("done")
    for r in ranks:
        r.finish()


# Upstream's split-ranks subgroups: primaries 0 and 1 start WORLD with world size 2 (4
# slots) and make their subgroups with their current members; the joiners 2 and 3 make
# the same subgroups, in the same order, with their eventual members, join each, and
# the primaries admit them with recover_ranks in each.
_SPLIT = r"""
JOINERS = [2, 3]

def reduced(group, value):
    t = torch.tensor([value], dtype=torch.int32)
    dist.all_reduce(t, group=group)
    return t.item()

opts = lambda active, ext, slots: pg.MooncakeBackendOptions(
    torch.tensor(active, dtype=torch.int32), ext, slots, timeout_ms=TIMEOUT_MS)
joiner = rank in JOINERS
dist.init_process_group(backend="mooncake-cpu", store=store, rank=rank,
                        world_size=4 if joiner else 2,
                        pg_options=opts([1, 1, 0, 0], joiner, 4))
W = dist.group.WORLD
a = dist.new_group([0, 2] if joiner else [0], pg_options=opts([1, 0], joiner, 2))
b = dist.new_group([1, 3] if joiner else [1], pg_options=opts([1, 0], joiner, 2))
c = dist.new_group([0, 1, 2, 3] if joiner else [0, 1], pg_options=opts([1, 1, 0, 0], joiner, 4))
mine = a if rank in (0, 2) else b
if not joiner:
    assert reduced(W, rank + 1) == 3 and reduced(c, rank + 1) == 3
    say("primary ready")
    await_claims(W, JOINERS)
    pg.recover_ranks(W, JOINERS)
    await_claims(mine, [1])
    pg.recover_ranks(mine, [1])
    await_claims(c, JOINERS)
    pg.recover_ranks(c, JOINERS)
else:
    assert reduced(W, rank + 1) == rank + 1  # local-only until admitted
    pg.join_group(W, timeout_ms=60000)
    pg.join_group(mine, timeout_ms=60000)
    pg.join_group(c, timeout_ms=60000)
assert reduced(W, rank + 1) == 10 and dist.get_world_size() == 4
assert reduced(mine, rank + 1) == (4 if rank in (0, 2) else 6) and mine.size() == 2
assert reduced(c, rank + 1) == 10 and c.size() == 4
say("done")
"""


def test_split_rank_subgroups_admit_their_joiners(store, ranks):
    joiners = _start_in_two_waves(ranks, store, _SPLIT, range(2), [2, 3])
    for r in ranks:
        r.expect("done")
    # A joiner must find the other joiner's record when it adopts the view that admits
    # both (the coordinator passes it on), not wait it out and warn.
    for r in joiners:
        assert not [line for line in r.log if "never arrived" in line], r.log
    for r in ranks:
        r.finish()


# How the survivors and the replacement end: all four active, an all_reduce over them.
_ALL_BACK = r"""
assert mirror.tolist() == [1] * world, mirror
t = torch.tensor([rank + 1], dtype=torch.int32)
dist.all_reduce(t)
assert t.item() == 10, t
say("done")
"""

# Rank 1 exits right after an all_reduce; the survivors' next operations succeed over
# the survivors without raising, and say they missed it.
_EXIT = r"""
mirror = torch.zeros(world, dtype=torch.int32)
dist.init_process_group(backend="mooncake-cpu", store=store, rank=rank, world_size=world,
                        pg_options=pg.MooncakeBackendOptions(mirror, timeout_ms=TIMEOUT_MS))
t = torch.tensor([rank + 1], dtype=torch.int32)
w = dist.all_reduce(t, async_op=True)
w.wait()
assert t.item() == 10 and pg.get_local_success(w), t
assert pg.get_failed_ranks_hint(w).tolist() == [0] * world
assert mirror.tolist() == [1] * world
dist.barrier()
if rank == 1:
    say("exiting")
    os._exit(0)
wait_line("go")
if os.environ["PG_FIRST"] == "sized":
    # The first operation after the death is one sized for the three survivors while
    # four ranks are still active (upstream's allgather/reduce_scatter recovery test).
    out = torch.zeros(3, dtype=torch.int32)
    w = dist.all_gather_into_tensor(out, torch.tensor([rank + 1], dtype=torch.int32),
                                    async_op=True)
    w.wait()
    assert out.tolist() == [1, 3, 4], out
t = torch.tensor([rank + 1], dtype=torch.int32)
w = dist.all_reduce(t, async_op=True)
w.wait()
assert t.item() == 1 + 3 + 4, t
# It ran again over the survivors, or started after the others had agreed on a view
# without rank 1 (then it missed no one).
hint = pg.get_failed_ranks_hint(w).tolist()
assert hint == ([0] * world if pg.get_local_success(w) else [0, 1, 0, 0]), hint
assert mirror.tolist() == [1, 0, 1, 1], mirror
# Sized for the three active ranks, slots in active-rank order.
out = torch.zeros(3, dtype=torch.int32)
dist.all_gather_into_tensor(out, torch.tensor([rank + 1], dtype=torch.int32))
assert out.tolist() == [1, 3, 4], out
got = torch.zeros(1, dtype=torch.int32)
dist.reduce_scatter_tensor(got, torch.arange(1, 4, dtype=torch.int32))
assert got.item() == 3 * ([0, 2, 3].index(rank) + 1), got
w = dist.all_reduce(torch.ones(4), async_op=True)
w.wait()
assert pg.get_local_success(w) and pg.get_failed_ranks_hint(w).tolist() == [0] * world
say("survived")
await_claims(dist.group.WORLD, [1])
resp = pg.recover_ranks(dist.group.WORLD, [1])
assert resp.status == pg.ProposalStatus.Applied, resp
"""

# Rank 1's replacement, started like the original (upstream's newest tests do not say
# is_extension): its predecessor never shut down, so it joins the running group.
_REPLACEMENT = r"""
mirror = torch.zeros(world, dtype=torch.int32)
dist.init_process_group(backend="mooncake-cpu", store=store, rank=rank, world_size=world,
                        pg_options=pg.MooncakeBackendOptions(mirror, timeout_ms=TIMEOUT_MS))
t = torch.tensor([rank + 1], dtype=torch.int32)
dist.all_reduce(t)
assert t.item() == rank + 1 and mirror.tolist() == [0] * world, (t, mirror)
pg.join_group(dist.group.WORLD, timeout_ms=60000)
"""


# The group started ROUNDS times on the same store, an all_reduce in each.
_ROUNDS = r"""
for round_ in range(ROUNDS):
    dist.init_process_group(backend="mooncake-cpu", store=store, rank=rank,
                            world_size=world,
                            pg_options=pg.MooncakeBackendOptions(timeout_ms=TIMEOUT_MS))
    t = torch.tensor([rank + 1 + round_ * 10])
    dist.all_reduce(t)
    assert t.item() == sum(r + 1 + round_ * 10 for r in range(world)), t
    dist.destroy_process_group()
"""

# Then every rank, the replacement included, starts the group again on the same store,
# twice (a replacement takes its predecessor's generation, so all agree on the keys).
_AGAIN = 'dist.destroy_process_group()\nROUNDS = 2\n' + _ROUNDS + 'say("again")\n'


@pytest.mark.parametrize("first", ["all_reduce", "sized"])
def test_exit_between_operations_is_absorbed(store, ranks, first, monkeypatch):
    monkeypatch.setenv("PG_FIRST", first)
    _lose_rank_one(ranks, store, _EXIT + _ALL_BACK + _AGAIN, 4, "exiting", "survived")
    ranks.append(Rank(_REPLACEMENT + _ALL_BACK + _AGAIN, store.port, 1,
                      timeout_ms=2000, prelude=_BARE))
    for r in ranks[2:] + ranks[:1]:
        r.expect("done")
    for r in ranks[2:] + ranks[:1]:
        r.expect("again")
    for r in ranks[2:] + ranks[:1]:
        r.finish()


# With the auto flags off (upstream's manual recovery): the operation still completes
# over the ranks that answer, but membership shows the dead rank until the survivors
# deactivate it themselves.
_MANUAL = r"""
dist.init_process_group(backend="mooncake-cpu", store=store, rank=rank, world_size=world,
                        pg_options=pg.MooncakeBackendOptions(
                            world, False, False, timeout_ms=TIMEOUT_MS))
g = dist.group.WORLD
dist.barrier()
if rank == 1:
    say("exiting")
    os._exit(0)
wait_line("go")
t = torch.tensor([rank + 1], dtype=torch.int32)
w = dist.all_reduce(t, async_op=True)
w.wait()
assert t.item() == 1 + 3, t
hint = pg.get_failed_ranks_hint(w).tolist()
assert hint == ([0] * world if pg.get_local_success(w) else [0, 1, 0]), hint
assert pg.get_active_ranks(g).tolist() == [1, 1, 1]
resp = pg.sync_after_failure(g)
assert resp.status in (pg.SyncAfterFailureStatus.Reconciled,
                       pg.SyncAfterFailureStatus.NoPending), resp
assert not pg.get_peer_state(g, [1])[0]
resp = pg.deactivate_ranks(g, [1])
assert resp.status in (pg.ProposalStatus.Applied, pg.ProposalStatus.AppliedWithDroppedRanks)
assert pg.get_active_ranks(g).tolist() == [1, 0, 1]
t = torch.tensor([rank + 1], dtype=torch.int32)
w = dist.all_reduce(t, async_op=True)
w.wait()
assert t.item() == 4 and pg.get_local_success(w), t
say("done")
"""


def test_auto_flags_off_leave_membership_to_the_survivors(store, ranks):
    for r in _lose_rank_one(ranks, store, _MANUAL, 3, "exiting", "done", timeout_ms=1000):
        r.finish()


_REINIT = "ROUNDS = 3\n" + _ROUNDS + 'say("done")\n'


def test_destroy_and_init_again_on_the_same_store(store, ranks):
    _all_run(ranks, store, _REINIT, 3, "done")


# Two ranks run a group of two, then four ranks (the two and two new processes) start a
# group of four on the same store: the new ranks agree with the old on the keys.
_GROW = r"""
if rank < 2:
    dist.init_process_group(backend="mooncake-cpu", store=store, rank=rank, world_size=2,
                            pg_options=pg.MooncakeBackendOptions(timeout_ms=TIMEOUT_MS))
    t = torch.tensor([rank + 1])
    dist.all_reduce(t)
    assert t.item() == 3, t
    dist.destroy_process_group()
    say("two")
    wait_line("grow")
ROUNDS = 2
""" + _ROUNDS + 'say("four")\n'


def test_a_group_started_again_with_more_ranks_on_the_same_store(store, ranks):
    _start_in_two_waves(ranks, store, _GROW, range(2), range(2, 4), ready="two")
    for r in ranks[:2]:
        r.tell("grow")
    for r in ranks:
        r.expect("four")
    for r in ranks:
        r.finish()


# Rank 1 is slow inside init_process_group (made so here: it sleeps between publishing
# its address and reading the others'). The others must not finish their gather and shut
# down in the meantime in a way that leaves it waiting for their addresses (or, with the
# store in a rank's process, without a store): init waits until every rank started.
_SLOW_START = r"""
import time
if rank == 1:
    _read_address = pg._Rendezvous.address
    def _slow_address(self, r, wait):
        time.sleep(2)  # models a rank descheduled on a busy host
        pg._Rendezvous.address = _read_address
        return _read_address(self, r, wait)
    pg._Rendezvous.address = _slow_address
dist.init_process_group(backend="mooncake-cpu", store=store, rank=rank, world_size=world,
                        pg_options=pg.MooncakeBackendOptions(timeout_ms=TIMEOUT_MS))
t = torch.tensor([rank], dtype=torch.int32)
got = [torch.zeros(1, dtype=torch.int32) for _ in range(world)] if rank == 0 else None
dist.gather(t, gather_list=got, dst=0)
assert rank != 0 or [g.item() for g in got] == list(range(world)), got
dist.destroy_process_group()
say("gathered")
"""


def test_a_rank_slow_to_start_is_not_left_behind(store, ranks):
    _all_run(ranks, store, _SLOW_START, 4, "gathered")


# extend_group_size_to: the size torch reports grows (never shrinks), collectives still
# run over the active ranks, and a gloo group's size is torch's own.
_EXTEND = r"""
dist.init_process_group(backend="mooncake-cpu", store=store, rank=rank, world_size=world,
                        pg_options=pg.MooncakeBackendOptions(timeout_ms=TIMEOUT_MS))
g = dist.group.WORLD
# Made first: a group made later without a rank list spans the grown size.
gloo = dist.new_group(backend="gloo")
assert dist.get_world_size() == world
pg.extend_group_size_to(g, world + 1)
assert dist.get_world_size() == world + 1 and g.size() == world + 1
try:
    pg.extend_group_size_to(g, world)
    raise AssertionError("shrinking was accepted")
except ValueError:
    pass
assert dist.get_world_size() == world + 1
t = torch.tensor([rank + 1])
dist.all_reduce(t)
assert t.item() == sum(range(1, world + 1)), t
assert gloo.size() == world and dist.get_world_size(gloo) == world
try:
    pg.extend_group_size_to(gloo, world + 2)
    raise AssertionError("a gloo group was taken for ours")
except TypeError:
    pass
# Lists and splits sized by the reported size work; the entry past the slots is a hole
# no rank fills, left as it was.
size = dist.get_world_size()
outs = [torch.full((2,), -1) for _ in range(size)]
dist.all_gather(outs, torch.full((2,), rank))
assert [o.tolist() for o in outs] == [[r, r] for r in range(world)] + [[-1, -1]], outs
got = torch.full((size,), -1)
dist.all_to_all_single(got, torch.full((size,), rank))
assert got.tolist() == list(range(world)) + [-1], got
outs = [torch.full((1,), -1) for _ in range(size)]
dist.all_to_all(outs, [torch.full((1,), 10 * rank + r) for r in range(size)])
assert [o.item() for o in outs] == [10 * r + rank for r in range(world)] + [-1], outs
# A group's size after it is destroyed is the last one it reported.
sub = dist.new_group(ranks=list(range(world)), backend="mooncake-cpu",
                     pg_options=pg.MooncakeBackendOptions(timeout_ms=TIMEOUT_MS))
pg.extend_group_size_to(sub, world + 2)
dist.destroy_process_group(sub)
assert sub.size() == world + 2
say("extended")
"""


def test_extend_group_size_to_grows_the_reported_size(store, ranks):
    _all_run(ranks, store, _EXTEND, 2, "extended")


def test_options_positional_forms():
    import torch
    from mooncake import pg

    o = pg.MooncakeBackendOptions(4)
    assert (o.max_group_size, o.is_extension, o.active_ranks) == (4, False, None)
    assert pg.MooncakeBackendOptions(4, True).is_extension
    o = pg.MooncakeBackendOptions(4, True, False)  # (max, auto_deactivate, auto_sync)
    assert (o.auto_deactivate_on_failure, o.auto_sync_on_failure) == (True, False)
    o = pg.MooncakeBackendOptions(4, True, True, False)
    assert (o.is_extension, o.auto_sync_on_failure) == (True, False)
    mirror = torch.zeros(5, dtype=torch.int32)
    o = pg.MooncakeBackendOptions(mirror, True, 5)
    assert o.active_ranks is mirror and o.is_extension and o.max_group_size == 5
    assert "active_ranks=11100" in pg.MooncakeBackendOptions(mirror, False, 5).to_string(3)
    assert "active_ranks=111;" in pg.MooncakeBackendOptions(mirror).to_string(3) + ";"
    assert "active_ranks=1110" in pg.MooncakeBackendOptions(4, True).to_string(4, 3)
    with pytest.raises(ValueError, match="int32"):
        pg.MooncakeBackendOptions(torch.zeros(4))
    with pytest.raises(ValueError, match="requires auto_deactivate"):
        pg.MooncakeBackendOptions(4, False, True)
    with pytest.raises(TypeError):
        pg.MooncakeBackendOptions(4, True, True, True, True)
    with pytest.raises(TypeError, match="twice"):
        pg.MooncakeBackendOptions(4, max_group_size=5)
    assert pg.ProposeViewUpdateResponse is pg.ProposalResponse


def test_module_defaults_apply_to_options_made_later():
    from mooncake import pg

    before = {"timeout_ms": pg._DEFAULTS["timeout_ms"], "engine": dict(pg._DEFAULTS["engine"])}
    try:
        pg.set_collective_timeout_us(1_500_001)
        pg.set_host_ip("127.0.0.1")
        o = pg.MooncakeBackendOptions(4)
        assert o.timeout_ms == 1501 and "bind_address=127.0.0.1" in o.to_string(4)
        assert pg.MooncakeBackendOptions(timeout_ms=7).timeout_ms == 7
        with pytest.raises(ValueError):
            pg.set_collective_timeout_us(0)
        with pytest.raises(ValueError):
            pg.set_host_ip("not-an-ip")
        assert pg.MooncakeBackendOptions().timeout_ms == 1501
    finally:
        pg._DEFAULTS.update(before)


# A queued isend goes out before the sender's next collective (the receiver waits in its
# recv, which must not meet the collective instead); list all_to_all takes
# non-contiguous tensors.
_P2P_THEN_COLLECTIVE = r"""
dist.init_process_group(backend="mooncake-cpu", store=store, rank=rank, world_size=world,
                        pg_options=pg.MooncakeBackendOptions(timeout_ms=TIMEOUT_MS))
if rank == 0:
    w = dist.isend(torch.arange(8, dtype=torch.float32), 1)
    dist.barrier()
    w.wait()
else:
    got = torch.zeros(8)
    dist.recv(got, 0)
    assert torch.equal(got, torch.arange(8, dtype=torch.float32)), got
    dist.barrier()
base = torch.arange(8, dtype=torch.float32) + 100 * rank
ins = [base[0::4], base[1::4]]  # strided views
outs = [torch.zeros(2), torch.zeros(2)]
dist.all_to_all(outs, ins)
for src in range(world):
    assert outs[src].tolist() == (torch.arange(8.0) + 100 * src)[rank::4].tolist(), outs
say("p2p ok")
"""


def test_a_queued_send_goes_before_the_next_collective(store, ranks):
    _all_run(ranks, store, _P2P_THEN_COLLECTIVE, 2, "p2p ok")
