"""Mooncake EP dispatch/combine on four rank processes over the ``mooncake-cpu`` group.

Every rank regenerates every rank's inputs from seeds, so it checks its own receive
layout row by row and its combined output against the dense reference (each expert
multiplies its rows by expert_id + 1). In the failure test one rank exits before the
second dispatch: the survivors return, mask it, drop what it owned, and go on.
"""

import pytest

pytest.importorskip("torch", reason="torch is not installed (a test-time dependency)")

from test_pg import _PRELUDE, WORLD, Rank, ranks, store  # noqa: E402,F401

_EP = r"""
from mooncake import ep

E, M, H, K = 8, 24, 16, 3
L = E // world
TIMEOUT_US = 2_000_000
buf = ep.Buffer(WORLD_PG, ep.Buffer.get_ep_buffer_size_hint(M, H, world, E))

def inputs(r, it):
    g = torch.Generator().manual_seed(1000 * it + r)
    n = M - (r + it) % 5
    x = torch.randn(n, H, generator=g)
    topk = torch.stack([torch.randperm(E, generator=g)[:K] for _ in range(n)])
    topk[torch.rand(n, K, generator=g) < 0.2] = -1
    return x, topk, torch.rand(n, K, generator=g)

def check_dispatch(recv_x, recv_count, handle, alive, it):
    for e in range(L):
        expert = rank * L + e
        rows, srcs, toks = [], [], []
        for s in range(world):
            if not alive[s]:
                continue
            x, topk, _ = inputs(s, it)
            for t in range(x.shape[0]):
                if expert in topk[t].tolist():
                    rows.append(x[t]); srcs.append(s); toks.append(t)
        n = int(recv_count[e])
        assert n == len(rows), (it, e, n, len(rows))
        if rows:
            assert torch.equal(recv_x[e, :n], torch.stack(rows)), (it, e)
        assert handle.recv_src_rank[e, :n].tolist() == srcs, (it, e)
        assert handle.recv_src_token[e, :n].tolist() == toks, (it, e)
        # Rows past the count are unspecified (as upstream); the handle marks them empty.
        assert (handle.recv_src_rank[e, n:] == -1).all(), (it, e)

def reference(x, topk, w, alive):
    out = torch.zeros_like(x)
    for t in range(x.shape[0]):
        for j in range(K):
            e = int(topk[t, j])
            if e >= 0 and alive[e // L]:
                out[t] += w[t, j] * x[t] * (e + 1)
    return out

def step(it, active):
    x, topk, w = inputs(rank, it)
    recv_x, recv_count, handle, _, _ = buf.dispatch(x, topk, active, M, E, TIMEOUT_US)
    alive = active.tolist()
    check_dispatch(recv_x, recv_count, handle, alive, it)
    experts = (rank * L + torch.arange(L) + 1).to(recv_x.dtype).reshape(L, 1, 1)
    try:
        buf.combine(recv_x[:, 1:], topk, w, active, TIMEOUT_US, handle)
    except ValueError:
        pass
    else:
        raise AssertionError("combine accepted x not shaped as recv_x")
    combined, _, _ = buf.combine(recv_x * experts, topk, w, active, TIMEOUT_US, handle)
    want = reference(x, topk, w, active.tolist())
    assert torch.allclose(combined, want, atol=1e-5), (it, (combined - want).abs().max())
    return alive

active = buf.update_ep_member()
assert active.tolist() == [1] * world
x, topk, w = inputs(rank, 0)
for bad in [topk.clamp(max=E - 2) + 2, topk[:, :1].repeat(1, 2).clamp(min=0)]:
    try:
        buf.dispatch(x, bad, active, M, E, TIMEOUT_US)
    except ValueError:
        pass
    else:
        raise AssertionError("bad topk_idx accepted")
for bad_args in [(x, topk, active, M, E + 1, TIMEOUT_US), (x, topk, active, M, E, 0),
                 (x, topk, active.to(torch.int64), M, E, TIMEOUT_US)]:
    try:
        buf.dispatch(*bad_args)
    except ValueError:
        pass
    else:
        raise AssertionError("bad dispatch arguments accepted")
assert active.tolist() == [1] * world
"""

_RUN = r"""
say("start", step(0, active))
if rank == VICTIM:
    say("stopping")
    if HANG:
        sys.stdin.readline()  # alive but silent until the test ends it
    os._exit(0)
for it in (1, 2):
    say("step", it, step(it, active))
say("done")
"""


def _script(victim, hang=False):
    return _EP + f"VICTIM = {victim}\nHANG = {hang}\n" + _RUN


def test_dispatch_and_combine_match_the_dense_reference(store, ranks):
    ranks.extend(Rank(_script(-1), store.port, r) for r in range(WORLD))
    for r in ranks:
        assert r.expect("start") == "start [1, 1, 1, 1]"
        r.expect("step 2")
        r.expect("done")
    for r in ranks:
        r.finish()


@pytest.mark.parametrize("hang", [False, True], ids=["exits", "hangs"])
def test_stopped_rank_is_masked_and_its_tokens_dropped(store, ranks, hang):
    """A rank that exits, or stays alive without calling dispatch, before the second
    step. The group's own timeout is far beyond the test's bound on a step, so the
    survivors can only get past the silent rank through dispatch's timeout_us."""
    victim = 2
    ranks.extend(Rank(_script(victim, hang), store.port, r, timeout_ms=300_000)
                 for r in range(WORLD))
    ranks[victim].expect("stopping")
    mask = str([0 if r == victim else 1 for r in range(WORLD)])
    for i, r in enumerate(ranks):
        if i != victim:
            assert r.expect("step 1") == f"step 1 {mask}"
            assert r.expect("step 2") == f"step 2 {mask}"
            r.expect("done")
    for i, r in enumerate(ranks):
        if i != victim:
            r.finish()


def test_size_hint_checks_its_arguments():
    from mooncake import ep

    assert ep.Buffer.get_ep_buffer_size_hint(128, 7168, 4, 8) > 0
    with pytest.raises(ValueError):
        ep.Buffer.get_ep_buffer_size_hint(128, 7168, 3, 8)
    with pytest.raises(ValueError):
        ep.Buffer.get_ep_buffer_size_hint(0, 7168, 4, 8)
