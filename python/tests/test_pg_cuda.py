"""The ``mooncake`` (CUDA) backend of Mooncake PG, with real processes.

It passes CUDA tensors' memory to the ``mooncake-cpu`` collectives as device memory
(``ProcessGroupHandle.set_memory``); the library stages it with the driver. Here (no GPU)
the tests check that both backend names are registered, that
``init_process_group(backend="mooncake")`` without CUDA fails at creation on every rank
with a clear error instead of hanging, run the backend class itself over host tensors
(taken directly, as a GPU machine's ProcessGroup would hold it): results, module
functions, and a failed operation that leaves the caller's tensors unchanged. The
device-memory call the backend makes for a CUDA tensor, on the fake CUDA driver, needs
no torch: ``test_pg_device_abi.py``.
``test_cuda_collectives_match_the_reference`` runs where ``torch.cuda.is_available()``.
"""

import pytest

torch = pytest.importorskip("torch", reason="torch is not installed (a test-time dependency)")

import torch.distributed as dist  # noqa: E402

from test_pg import Rank as _Rank, ranks, store  # noqa: E402,F401

_PRELUDE = r"""
import os, sys, datetime
import torch, torch.distributed as dist
from mooncake import pg

rank, world = int(os.environ["PG_RANK"]), int(os.environ["PG_WORLD"])
store = dist.TCPStore("127.0.0.1", int(os.environ["PG_STORE_PORT"]), is_master=False,
                      timeout=datetime.timedelta(seconds=60))

def say(*a):
    print(*a, flush=True)
"""


def Rank(script, store_port, rank, world):
    """A rank process of ``test_pg``'s kind with this file's prelude, stderr included."""
    return _Rank(script, store_port, rank, world=world, prelude=_PRELUDE, merge_stderr=True)


def test_both_backend_names_are_registered():
    from mooncake import pg

    for name in (pg.BACKEND_NAME, pg.CUDA_BACKEND_NAME):
        assert name.upper() in dist.Backend._plugins, name
        assert dist.is_backend_available(name), name
    assert dist.Backend._plugins["MOONCAKE"].creator_fn is not \
        dist.Backend._plugins["MOONCAKE-CPU"].creator_fn


_NO_CUDA = r"""
try:
    dist.init_process_group(backend="mooncake", store=store, rank=rank, world_size=world,
                            pg_options=pg.MooncakeBackendOptions(timeout_ms=1000))
    say("created")
except RuntimeError as e:
    say("refused", e)
"""


@pytest.mark.skipif(torch.cuda.is_available(), reason="CUDA is available here")
def test_cuda_backend_without_cuda_is_refused_at_creation_on_every_rank(store, ranks):
    ranks.extend(Rank(_NO_CUDA, store.port, r, 2) for r in range(2))
    for r in ranks:
        line = r.expect("refused")
        assert "needs CUDA" in line and "mooncake-cpu" in line, line
    for r in ranks:
        r.finish()


_STAGED = r"""
from torch.distributed import ProcessGroup
import torch._C._distributed_c10d as c10d
options = pg.MooncakeBackendOptions(timeout_ms=1000)
backend = pg.MooncakeCudaBackend(dist.PrefixStore("staged/", store), rank, world, options)
assert backend.getBackendName() == "mooncake"
# Held by a ProcessGroup as torch holds a CUDA backend: the module functions find it.
group = ProcessGroup(dist.PrefixStore("group/", store), rank, world)
group._register_backend(torch.device("cuda"), ProcessGroup.BackendType.CUSTOM, backend)
for b in (backend, group):
    assert pg.get_active_ranks(b).tolist() == [1, 1]
    assert pg.get_current_epoch(b) == 1
    assert pg.get_peer_state(b, [0, 1]) == [True, True]

def done(work):
    work.wait()
    assert pg.get_local_success(work)
    assert pg.get_failed_ranks_hint(work).tolist() == [0] * world
    return work

other = 1 - rank
for n in (5, 70000):  # one round, and reduce-scatter + all-gather
    t = torch.arange(n, dtype=torch.float32) + rank
    opts = c10d.AllreduceOptions()
    opts.reduceOp = dist.ReduceOp.SUM
    w = done(backend.allreduce([t], opts))
    assert torch.equal(t, torch.arange(n, dtype=torch.float32) * 2 + 1), n
    assert w.result()[0] is t
outs = [torch.zeros(3 + r, dtype=torch.int64) for r in range(world)]
done(backend.allgather([outs], [torch.full((3 + rank,), rank + 7, dtype=torch.int64)],
                       c10d.AllgatherOptions()))
assert all(torch.equal(o, torch.full((3 + r,), r + 7, dtype=torch.int64))
           for r, o in enumerate(outs))
flat = torch.zeros(2 * 4, dtype=torch.float64)
done(backend._allgather_base(flat, torch.full((4,), float(rank), dtype=torch.float64), c10d.AllgatherOptions()))
assert flat.tolist() == [0.0] * 4 + [1.0] * 4
# Sizes that do not match the tensors are refused on the spot, nothing sent or written.
for call in (lambda: backend._allgather_base(flat, torch.ones(4, dtype=torch.float32),
                                             c10d.AllgatherOptions()),
             lambda: backend._reduce_scatter_base(torch.zeros(3), torch.zeros(8),
                                                  c10d.ReduceScatterOptions()),
             lambda: backend.alltoall_base(torch.zeros(2), torch.zeros(2), [2, 1], [1, 1],
                                           c10d.AllToAllOptions())):
    try:
        call()
        raise AssertionError("a size mismatch was accepted")
    except ValueError as e:
        # the dtype, the byte count or the split rows, whichever is checked first
        assert any(w in str(e) for w in ("bytes where", "output is", "rows")), e
assert flat.tolist() == [0.0] * 4 + [1.0] * 4
b = torch.full((6,), 9 if rank == 1 else 0, dtype=torch.int32)
opts = c10d.BroadcastOptions()
opts.rootRank = 1
done(backend.broadcast([b], opts))
assert b.tolist() == [9] * 6
x = torch.tensor([rank * 10 + 0, rank * 10 + 1], dtype=torch.int64)
y = torch.zeros(2, dtype=torch.int64)
done(backend.alltoall_base(y, x, [], [], c10d.AllToAllOptions()))
assert y.tolist() == [0 * 10 + rank, 1 * 10 + rank]
out = torch.zeros(3)
opts = c10d.ReduceScatterOptions()
opts.reduceOp = dist.ReduceOp.MAX
done(backend._reduce_scatter_base(out, torch.arange(6, dtype=torch.float32) * (rank + 1), opts))
assert out.tolist() == [v * 2.0 for v in range(3 * rank, 3 * rank + 3)]
# Point-to-point: both queued, the receive's copy-back runs once the pair is done.
got = torch.zeros(4, dtype=torch.int32)
works = [backend.send([torch.full((4,), rank + 1, dtype=torch.int32)], other),
         backend.recv([got], other)]
for w in works:
    done(w)
assert got.tolist() == [other + 1] * 4
# A flush failing with an error that is not a collective's (here, before anything is
# sent: the peer is not involved) fails every queued message, not just the one waited.
real_send_recv = backend.handle.send_recv

def broken_send_recv(sends, recvs):
    raise RuntimeError("broken before sending")

backend.handle.send_recv = broken_send_recv
works = [backend.send([torch.ones(4)], other), backend.recv([torch.zeros(4)], other)]
for w in works:
    try:
        w.wait()
        raise AssertionError("a failed flush reported success")
    except RuntimeError as e:
        assert "broken before sending" in str(e), e
    assert not w.is_success()
backend.handle.send_recv = real_send_recv
done(backend.barrier())
say("staged ok")
if rank == 1:
    assert sys.stdin.readline().strip() == "exit"
    backend.handle.close()
    say("closed")
    sys.exit(0)
assert sys.stdin.readline().strip() == "go"
# Rank 1 is gone: the operation runs again over the survivor, from the caller's
# original values, and says it missed rank 1.
t = torch.full((1000,), 3.0)
opts = c10d.AllreduceOptions()
opts.reduceOp = dist.ReduceOp.SUM
work = backend.allreduce([t], opts)
work.wait()
assert pg.get_failed_ranks_hint(work).tolist() == [0, 1] and not pg.get_local_success(work)
assert torch.equal(t, torch.full((1000,), 3.0))
assert pg.get_active_ranks(backend).tolist() == [1, 0]
say("failed as expected")
"""


def test_staging_path_over_host_tensors(store, ranks):
    ranks.extend(Rank(_STAGED, store.port, r, 2) for r in range(2))
    for r in ranks:
        r.expect("staged ok")
    ranks[1].tell("exit")
    ranks[1].expect("closed")
    ranks[1].finish()
    ranks[0].tell("go")
    ranks[0].expect("failed as expected")
    ranks[0].finish()


_CUDA = r"""
torch.cuda.set_device(0)
dist.init_process_group(backend="mooncake", store=store, rank=rank, world_size=world,
                        pg_options=pg.MooncakeBackendOptions(timeout_ms=20000))
dev = torch.device("cuda", 0)
for dt in (torch.float32, torch.float64, torch.float16, torch.bfloat16, torch.int32,
           torch.int64, torch.uint8):
    for n in (1, 1001, 300000):
        def inp(r):
            return ((torch.arange(n, dtype=torch.int64) * 3 + r * 7) % 5 + 1).to(dt)
        for op, ref in [(dist.ReduceOp.SUM, lambda s: s.sum(0)),
                        (dist.ReduceOp.MAX, lambda s: s.max(0).values)]:
            t = inp(rank).to(dev)
            dist.all_reduce(t, op=op)
            want = ref(torch.stack([inp(r).to(torch.int64) for r in range(world)])).to(dt)
            assert t.device == dev and torch.equal(t.cpu(), want), (dt, n, op)
        flat = torch.zeros(world * n, dtype=dt, device=dev)
        dist.all_gather_into_tensor(flat, inp(rank).to(dev))
        assert torch.equal(flat.cpu(), torch.cat([inp(r) for r in range(world)])), (dt, n)
        outs = [torch.zeros(n, dtype=dt, device=dev) for _ in range(world)]
        dist.all_gather(outs, inp(rank).to(dev))
        assert all(torch.equal(o.cpu(), inp(r)) for r, o in enumerate(outs)), (dt, n)
        b = inp(1).to(dev) if rank == 1 else torch.zeros(n, dtype=dt, device=dev)
        dist.broadcast(b, src=1)
        assert torch.equal(b.cpu(), inp(1)), (dt, n)
        big = torch.cat([inp(rank)] * world).to(dev)
        out = torch.zeros(n, dtype=dt, device=dev)
        dist.reduce_scatter_tensor(out, big)
        want = torch.stack([inp(r).to(torch.int64) for r in range(world)]).sum(0).to(dt)
        assert torch.equal(out.cpu(), want), ("reduce_scatter", dt, n)
        x = torch.cat([torch.full((n,), rank * 10 + p, dtype=dt) for p in range(world)]).to(dev)
        y = torch.zeros(world * n, dtype=dt, device=dev)
        dist.all_to_all_single(y, x)
        want = torch.cat([torch.full((n,), r * 10 + rank, dtype=dt) for r in range(world)])
        assert torch.equal(y.cpu(), want), ("all_to_all", dt, n)
        other = 1 - rank
        got = torch.zeros(n, dtype=dt, device=dev)
        works = [dist.isend(inp(rank).to(dev), other), dist.irecv(got, other)]
        for w in works:
            w.wait()
        assert torch.equal(got.cpu(), inp(other)), ("p2p", dt, n)
        dist.barrier()
assert pg.get_active_ranks().tolist() == [1, 1] and pg.get_current_epoch() == 1
say("done")
"""


@pytest.mark.skipif(not torch.cuda.is_available(),
                    reason="torch.cuda.is_available() is false: the mooncake (CUDA) backend "
                           "needs a GPU")
def test_cuda_collectives_match_the_reference(store, ranks):
    ranks.extend(Rank(_CUDA, store.port, r, 2) for r in range(2))
    for r in ranks:
        r.expect("done")
    for r in ranks:
        r.finish()


def test_torch_devices_map_to_the_c_abi_locations(monkeypatch):
    """ROCm builds of torch call their GPUs "cuda": the location must say hip then."""
    from mooncake import pg

    assert pg._location(torch.device("cpu")) == "cpu:0"
    monkeypatch.setattr(torch.version, "hip", None, raising=False)
    assert pg._location(torch.device("cuda", 1)) == "cuda:1"
    monkeypatch.setattr(torch.version, "hip", "6.2.41133", raising=False)
    assert pg._location(torch.device("cuda", 1)) == "hip:1"
    with pytest.raises(ValueError, match="cpu or cuda"):
        pg._location(torch.device("meta"))
