"""Mooncake PG: point-to-point with a peer that dies, and a rank that leaves by itself.

A send or receive whose peer does not answer is not an error: ``wait()`` returns, the
work says so (``get_local_success`` False, the peer in ``get_failed_ranks_hint``), and
the survivors have already agreed on a view without the peer when it returns. Messages
of the same batch with live peers go through. A rank that deactivates only itself
leaves while the others are between operations (they take part in nothing), they see
the new view at once through the membership queries, and a replacement rejoins.
"""

import pytest

pytest.importorskip("torch", reason="torch is not installed (a test-time dependency)")

from test_pg import Rank, ranks, store  # noqa: E402,F401
from test_pg_elastic import _BARE, _lose_rank_one  # noqa: E402

# Every rank sends one message to, and receives one from, every other in one batch.
_EXCHANGE = r"""
def exchange_with_all():
    peers = [p for p in range(world) if p != rank]
    got = {p: torch.full((3,), -1, dtype=torch.int64) for p in peers}
    ops, owners = [], []
    for p in peers:
        ops.append(dist.P2POp(dist.isend, torch.full((3,), 10 * rank + p), p))
        ops.append(dist.P2POp(dist.irecv, got[p], p))
        owners += [p, p]
    works = dist.batch_isend_irecv(ops)
    for w in works:
        w.wait()  # a peer that does not answer makes no error
    return got, list(zip(owners, works))
"""

# Three ranks exchange; rank 1 dies; the survivors exchange again, with rank 1 too.
_DEAD_PEER = _EXCHANGE + r"""
mirror = torch.zeros(world, dtype=torch.int32)
dist.init_process_group(backend="mooncake-cpu", store=store, rank=rank, world_size=world,
                        pg_options=pg.MooncakeBackendOptions(mirror, timeout_ms=TIMEOUT_MS))
g = dist.group.WORLD
got, works = exchange_with_all()
for p, w in works:
    assert pg.get_local_success(w) and pg.get_failed_ranks_hint(w).tolist() == [0] * world
    assert got[p].tolist() == [10 * p + rank] * 3, (p, got[p])
if rank == 1:
    say("exiting")
    os._exit(0)
wait_line("go")
got, works = exchange_with_all()
# The survivors agreed on the view without rank 1 before wait() returned.
assert pg.get_active_ranks(g).tolist() == [1, 0, 1], pg.get_active_ranks(g)
assert mirror.tolist() == [1, 0, 1], mirror
survivor = 2 - rank
for p, w in works:
    if p == 1:
        assert not pg.get_local_success(w)
        assert pg.get_failed_ranks_hint(w).tolist() == [0, 1, 0]
    else:
        assert pg.get_local_success(w)
        assert pg.get_failed_ranks_hint(w).tolist() == [0, 0, 0]
assert got[survivor].tolist() == [10 * survivor + rank] * 3, got
assert got[1].tolist() == [-1] * 3, got  # nothing came from the dead rank
t = torch.tensor([rank + 1])
dist.all_reduce(t)
assert t.item() == 1 + 3, t
say("done")
"""


def test_a_dead_peer_fails_only_the_messages_with_it(store, ranks):
    for r in _lose_rank_one(ranks, store, _DEAD_PEER, 3, "exiting", "done"):
        r.finish()


# Ranks 0 and 1 exchange one message each way and check it went through.
_PING_PONG = r"""
def ping_pong(peer):
    got = torch.tensor([-1])
    works = dist.batch_isend_irecv([dist.P2POp(dist.isend, torch.tensor([rank]), peer),
                                    dist.P2POp(dist.irecv, got, peer)])
    for w in works:
        w.wait()
    assert all(pg.get_local_success(w) for w in works) and got.item() == peer, got
"""

# Rank 1 deactivates itself and destroys its group while ranks 0 and 2 wait on stdin,
# outside any operation; they find the view without it, go on, and admit a replacement.
_LEAVE = _PING_PONG + r"""
dist.init_process_group(backend="mooncake-cpu", store=store, rank=rank, world_size=world,
                        pg_options=pg.MooncakeBackendOptions(timeout_ms=TIMEOUT_MS))
g = dist.group.WORLD
t = torch.tensor([rank + 1])
dist.all_reduce(t)
assert t.item() == 6, t
if rank == 1:
    resp = pg.deactivate_ranks(g, [1])
    assert resp.status == pg.ProposalStatus.Applied and resp.new_epoch == 2, resp
    assert pg.get_active_ranks(g).tolist() == [1, 0, 1]
    try:
        dist.all_reduce(torch.ones(1))
        raise AssertionError("a rank that left took part")
    except pg.MooncakeCollectiveError as e:  # not a member: join_group first
        assert e.code == pg.MC_ERR_UNAVAILABLE_IN_CURRENT_STATUS, e
    dist.destroy_process_group()
    say("left")
    sys.exit(0)
wait_line("go")
assert pg.get_current_epoch(g) == 2
assert pg.get_active_ranks(g).tolist() == [1, 0, 1], pg.get_active_ranks(g)
t = torch.tensor([rank + 1])
w = dist.all_reduce(t, async_op=True)
w.wait()
assert t.item() == 1 + 3 and pg.get_local_success(w), t
say("survived")
await_claims(g, [1])
resp = pg.recover_ranks(g, [1])
assert resp.status == pg.ProposalStatus.Applied, resp
"""

# After the leave, both the survivors and the replacement of rank 1.
_ALL_AGAIN = r"""
t = torch.tensor([rank + 1])
dist.all_reduce(t)
assert t.item() == 6, t
if rank in (0, 1):
    ping_pong(1 - rank)
say("done")
"""

_REPLACEMENT = _PING_PONG + r"""
dist.init_process_group(backend="mooncake-cpu", store=store, rank=rank, world_size=world,
                        pg_options=pg.MooncakeBackendOptions(timeout_ms=TIMEOUT_MS,
                                                             is_extension=True))
g = dist.group.WORLD
pg.join_group(g, timeout_ms=60000)
assert pg.get_active_ranks(g).tolist() == [1, 1, 1], pg.get_active_ranks(g)
"""


def test_a_rank_leaves_by_itself_while_the_others_idle(store, ranks):
    _lose_rank_one(ranks, store, _LEAVE + _ALL_AGAIN, 3, "left", "survived")
    ranks.append(Rank(_REPLACEMENT + _ALL_AGAIN, store.port, 1, world=3, timeout_ms=2000,
                      prelude=_BARE))
    for r in ranks[2:] + ranks[:1]:
        r.expect("done")
    for r in ranks[2:] + ranks[:1]:
        r.finish()
