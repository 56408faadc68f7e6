"""The mooncake-cpu backend refuses tensors and sizes that do not match, before any C call.

The C ABI (``mc_pg_*``) trusts the pointers and sizes it is given, so a mismatched call
must raise in Python and change nothing. Two real rank processes make every kind of bad
call (each rank the same ones, or only the root for root-only checks); every refusal
must leave the tensors as they were, and correct collectives right after must still give
the right results: a refused call that had sent anything would throw them off.
"""

import pytest

pytest.importorskip("torch", reason="torch is not installed (a test-time dependency)")

from test_pg import Rank, ranks, store  # noqa: E402,F401

_CHECKS = r"""
import torch._C._distributed_c10d as c10d

BK = WORLD_PG._get_backend(torch.device("cpu"))
assert isinstance(BK, pg.MooncakeBackend), BK
assert world == 2
other = 1 - rank
refused = 0

def opts(kind, root=None, op=None):
    o = getattr(c10d, kind)()
    if root is not None:
        o.rootRank = root
    if op is not None:
        o.reduceOp = op
    return o

def refuse(name, call, *tensors, match=None, errors=(ValueError, TypeError)):
    # Each tensor the call was given must come out unchanged.
    global refused
    before = [t.clone() for t in tensors]
    try:
        call()
    except errors as e:
        assert match is None or match in str(e), (name, str(e))
    else:
        raise AssertionError(f"{name}: not refused")
    for t, b in zip(tensors, before):
        assert torch.equal(t, b), (name, "changed a tensor")
    refused += 1

f32 = lambda *s: torch.full(s, 7.0)
f16 = lambda *s: torch.full(s, 7.0, dtype=torch.float16)
A2A = lambda: opts("AllToAllOptions")

# 1. all_to_all_single: split counts, signs and sums in rows of dim 0; even split.
out, inp = f32(4, 3), f32(4, 3)
refuse("a2a short input splits", lambda: BK.alltoall_base(out, inp, [2, 2], [4], A2A()),
       out, match="1 entries for world size 2")
refuse("a2a long output splits", lambda: BK.alltoall_base(out, inp, [1, 1, 2], [2, 2], A2A()),
       out, match="3 entries")
refuse("a2a negative split", lambda: BK.alltoall_base(out, inp, [2, 2], [5, -1], A2A()),
       out, match="negative")
refuse("a2a splits in bytes, not rows", lambda: BK.alltoall_base(out, inp, [2, 2], [6, 6],
       A2A()), out, match="sum to 12 rows")
refuse("a2a output splits sum", lambda: BK.alltoall_base(out, inp, [1, 2], [2, 2], A2A()),
       out, match="sum to 3 rows")
odd = f32(3, 2)
refuse("a2a uneven without splits", lambda: BK.alltoall_base(odd, odd.clone(), [], [], A2A()),
       odd, match="do not split evenly")
refuse("a2a dtype", lambda: BK.alltoall_base(f16(4, 3), inp, [], [], A2A()), match="float16")
refuse("a2a 0-dim", lambda: BK.alltoall_base(torch.tensor(1.0), torch.tensor(1.0), [], [],
       A2A()), match="0-dim")
# through the public API too: the refusal reaches the caller as raised
refuse("a2a via dist", lambda: dist.all_to_all_single(out, inp, [2, 2], [4]), out,
       match="1 entries")

# 2. reduce_scatter (list form): output against counts[rank] and the inputs' dtype.
RS = lambda: opts("ReduceScatterOptions", op=dist.ReduceOp.SUM)
o16 = f16(8)
refuse("rs f16 output, f32 inputs", lambda: BK.reduce_scatter([o16], [[f32(8), f32(8)]], RS()),
       o16, match="float16")
o = f32(5)
refuse("rs output size", lambda: BK.reduce_scatter([o], [[f32(8), f32(8)]], RS()), o,
       match="8 are needed")
refuse("rs mixed input dtypes", lambda: BK.reduce_scatter([o], [[f32(5), f16(5)]], RS()), o)
refuse("rs too few inputs", lambda: BK.reduce_scatter([o], [[f32(5)]], RS()), o,
       match="1 entries")

# 3. all_gather (list form): the input matches outs[rank]; one dtype throughout.
AG = lambda: opts("AllgatherOptions")
outs = [f32(4), f32(4)]
refuse("ag input bigger than its block", lambda: BK.allgather([outs], [f32(9)], AG()), *outs,
       match="where 9 are needed")
refuse("ag input dtype", lambda: BK.allgather([outs], [f16(4)], AG()), *outs)
mixed = [f32(4), f16(4)] if rank == 0 else [f16(4), f32(4)]
refuse("ag output dtypes", lambda: BK.allgather([mixed], [f32(4)], AG()), *mixed,
       match="float16")
refuse("ag too few outputs", lambda: BK.allgather([[f32(4)]], [f32(4)], AG()),
       match="1 entries")

# 5. all_gather_into_tensor: same dtype (and the byte count) as the input.
flat16 = f16(16)
refuse("agb dtype", lambda: BK._allgather_base(flat16, f32(4), AG()), flat16,
       match="float16")
flat = f32(7)
refuse("agb size", lambda: BK._allgather_base(flat, f32(4), AG()), flat, match="bytes")

# reduce_scatter_tensor, all_reduce, reduce, broadcast: dtype, op and root up front.
refuse("rsb dtype", lambda: BK._reduce_scatter_base(f16(2), f32(4), RS()))
t = torch.ones(3, dtype=torch.complex64)
refuse("all_reduce dtype", lambda: BK.allreduce([t], opts("AllreduceOptions")), t,
       match="unsupported dtype")
t = f32(3)
refuse("reduce root", lambda: BK.reduce([t], opts("ReduceOptions", root=2)), t,
       match="out of range")
refuse("broadcast root", lambda: BK.broadcast([t], opts("BroadcastOptions", root=-1)), t,
       match="out of range")

# all_to_all (list form): one tensor per rank each way, one dtype.
outs = [f32(2), f32(2)]
refuse("a2a list short", lambda: BK.alltoall(outs, [f32(2)], A2A()), *outs, match="1 entries")
refuse("a2a list dtype", lambda: BK.alltoall(outs, [f32(2), f16(2)], A2A()), *outs,
       match="float16")

# send/recv: peers in range.
refuse("send peer", lambda: BK.send([f32(2)], 5), match="out of range")
refuse("recv peer", lambda: BK.recv([f32(2)], -1), match="out of range")

# 4. scatter on the root / gather on the root: every block like the root's tensor. The
# other rank makes no call: a refused root must not have started anything.
if rank == 0:
    o = f32(4)
    SC = lambda: opts("ScatterOptions", root=0)
    refuse("scatter bigger input", lambda: BK.scatter([o], [[f32(4), f32(9)]], SC()), o,
           match="scatter input 1")
    refuse("scatter input dtype", lambda: BK.scatter([o], [[f32(4), f16(4)]], SC()), o,
           match="float16")
    refuse("scatter too few", lambda: BK.scatter([o], [[f32(4)]], SC()), o, match="1 entries")
    gl = [f32(4), f32(2)]
    GA = lambda: opts("GatherOptions", root=0)
    refuse("gather small output", lambda: BK.gather([gl], [f32(4)], GA()), *gl,
           match="gather output 1")
    gl = [f32(4), f16(4)]
    refuse("gather output dtype", lambda: BK.gather([gl], [f32(4)], GA()), *gl)
say("refused", refused)

# The group still works, and nothing refused was delivered.
x = torch.full((6,), float(rank + 1))
dist.all_reduce(x)
assert torch.equal(x, torch.full((6,), 3.0)), x
send = [1, 2] if rank == 0 else [3, 1]
recv = [1, 3] if rank == 0 else [2, 1]
inp = torch.cat([torch.full((send[p], 2), float(10 * rank + p)) for p in range(2)])
out = torch.zeros(sum(recv), 2)
dist.all_to_all_single(out, inp, recv, send)
want = torch.cat([torch.full((recv[r], 2), float(10 * r + rank)) for r in range(2)])
assert torch.equal(out, want), out
outs = [torch.zeros(2, 2), torch.zeros(3, 2)]
dist.all_gather(outs, torch.full((2 + rank, 2), float(rank)))
assert torch.equal(outs[1], torch.ones(3, 2)) and torch.equal(outs[0], torch.zeros(2, 2))
o = torch.zeros(3)
dist.reduce_scatter(o, [torch.full((3,), 1.0), torch.full((3,), 2.0)])
assert torch.equal(o, torch.full((3,), 2.0 * (rank + 1))), o
o = torch.zeros(4)
dist.scatter(o, [torch.full((4,), float(r)) for r in range(2)] if rank == 0 else None, src=0)
assert torch.equal(o, torch.full((4,), float(rank))), o
# a non-contiguous gather output is filled in place
gl = [torch.zeros(4, 2).t(), torch.zeros(4, 2).t()] if rank == 0 else None
dist.gather(torch.full((2, 4), float(rank + 5)), gather_list=gl, dst=0)
if rank == 0:
    assert all(torch.equal(gl[r], torch.full((2, 4), float(r + 5))) for r in range(2)), gl
dist.barrier()
say("done")
"""


def test_mismatched_calls_are_refused_and_the_group_still_works(store, ranks):
    ranks.extend(Rank(_CHECKS, store.port, r, world=2, timeout_ms=20000, merge_stderr=True)
                 for r in range(2))
    assert ranks[0].expect("refused") == "refused 32"
    assert ranks[1].expect("refused") == "refused 27"
    for r in ranks:
        r.expect("done")
    for r in ranks:
        r.finish()
