"""Mooncake PG's ``async_op=True``: the operation runs on the backend's queue while the
caller goes on, in the order issued, on two real rank processes.

Rank 0 issues its operations asynchronously and says so before waiting on any; rank 1
starts its own only when the test tells it rank 0 has issued everything, so rank 0 could
not have said it if an operation blocked its caller. Operations of two groups issued in
opposite orders on the two ranks both complete (each group's queue runs on its own), and
a future's callback may issue and wait for another operation.
"""

import pytest

pytest.importorskip("torch", reason="torch is not installed (a test-time dependency)")

from test_pg import Rank, ranks, store  # noqa: E402,F401

_ASYNC = r"""
import sys
peer = 1 - rank
a = torch.full((1000,), float(rank + 1))
b = torch.arange(6.0) if rank == 1 else torch.zeros(6)
c = [torch.zeros(3, dtype=torch.int64) for _ in range(world)]
mine = torch.full((3,), rank + 7, dtype=torch.int64)
d, chained = torch.full((2,), 1.0), torch.full((3,), 1.0)
if rank == 0:
    message = torch.tensor([5, 6, 7])
    sent = dist.isend(message, peer)  # sent by the queue, before the all_reduce
    wa = dist.all_reduce(a, async_op=True)
    wb = dist.broadcast(b, src=1, async_op=True)
    wc = dist.all_gather(c, mine, async_op=True)

    def after_d(fut):  # issues and waits for another operation, as DDP comm hooks do
        dist.all_reduce(chained, async_op=True).get_future().wait()
        return chained
    fd = dist.all_reduce(d, async_op=True).get_future().then(after_d)
    # (torch's wrapper of a Python backend's work passes on wait() and get_future() only)
    futures = [w.get_future() for w in (wa, wb)]
    # Rank 1 has not started: the collectives wait for it.
    assert not any(f.done() for f in futures)
    say("issued")
    # Rank 1 runs them in this order, synchronously: run in another order here, they
    # would pair different collectives (refused, or wrong values below).
    wc.wait()
    sent.wait()
    assert futures[0].wait()[0] is a
    assert fd.wait() is chained
    assert pg.get_local_success(wa) and pg.get_failed_ranks_hint(wb).tolist() == [0, 0]
else:
    sys.stdin.readline()
    got = torch.zeros(3, dtype=torch.int64)
    dist.recv(got, peer)
    assert got.tolist() == [5, 6, 7]
    dist.all_reduce(a)
    dist.broadcast(b, src=1)
    dist.all_gather(c, mine)
    dist.all_reduce(d)
    dist.all_reduce(chained)
assert torch.equal(a, torch.full((1000,), 3.0)), a
assert torch.equal(b, torch.arange(6.0)), b
assert [t.tolist() for t in c] == [[7, 7, 7], [8, 8, 8]], c
assert torch.equal(d, torch.full((2,), 2.0)) and torch.equal(chained, torch.full((3,), 2.0))
say("ordered")

# Two groups, opposite orders: each group's queue runs its operation on its own thread.
g2 = dist.new_group([0, 1])
x, y = torch.full((10,), float(rank)), torch.full((10,), float(rank + 10))
if rank == 0:
    w1 = dist.all_reduce(x, async_op=True)
    w2 = dist.all_reduce(y, group=g2, async_op=True)
else:
    w2 = dist.all_reduce(y, group=g2, async_op=True)
    w1 = dist.all_reduce(x, async_op=True)
w1.wait()
w2.wait()
assert torch.equal(x, torch.full((10,), 1.0)) and torch.equal(y, torch.full((10,), 21.0))
say("groups")

# A synchronous operation runs after the queued ones: rank 0's queued sum is done when
# its max returns (rank 1 runs both synchronously); shutting down runs what is queued.
q = torch.full((5,), float(rank + 1))
r = torch.full((5,), float(10 * (rank + 1)))
wq = dist.all_reduce(q, async_op=True) if rank == 0 else dist.all_reduce(q)
dist.all_reduce(r, op=dist.ReduceOp.MAX)
assert torch.equal(q, torch.full((5,), 3.0)), q
assert torch.equal(r, torch.full((5,), 20.0)), r
if rank == 0:
    wq.wait()
last = torch.ones(4)
wl = dist.all_reduce(last, async_op=True)
dist.destroy_process_group()
wl.wait(datetime.timedelta(seconds=60))  # done: the bound is not reached
assert torch.equal(last, torch.full((4,), 2.0)), last
say("done")
"""


def test_async_operations_run_on_the_queue_in_the_order_issued(store, ranks):
    ranks.extend(Rank(_ASYNC, store.port, r, world=2, timeout_ms=20_000) for r in range(2))
    ranks[0].expect("issued")
    ranks[1].tell("go")
    for step in ("ordered", "groups", "done"):
        for r in ranks:
            r.expect(step)
    for r in ranks:
        r.finish()
