"""Mooncake EP dispatch/combine on four rank processes over the ``mooncake-cpu`` group.

Every rank regenerates every rank's inputs from seeds, so it checks its own receive
layout row by row (values, ``recv_count``, the handle's ``src_info`` and
``layout_range``) and its combined output against the dense reference (each expert
multiplies its rows by expert_id + 1), in float32 and in fp8 (values and per-128-channel
scales checked bit for bit against the quantization written out here). In the failure
tests one rank exits or goes silent before the second dispatch, between its two
exchanges, or in its combine: the survivors return, mask it, drop what it owned, and go
on.
"""

import pytest

pytest.importorskip("torch", reason="torch is not installed (a test-time dependency)")

from test_pg import _PRELUDE, WORLD, Rank, ranks, store  # noqa: E402,F401

_EP = r"""
from mooncake import ep

E, M, H, K = 8, 24, 256, 3
L = E // world
buf = ep.Buffer(WORLD_PG, ep.Buffer.get_ep_buffer_size_hint(M, H, world, E),
                disable_p2p=True)  # upstream's signature; no P2P path to switch off here
assert buf.group_size == world and buf.rank == rank and buf.group is WORLD_PG
buf.connect(is_update=True)  # upstream's reconnect: nothing to redo, the buffer still works

def inputs(r, it):
    g = torch.Generator().manual_seed(1000 * it + r)
    n = M - (r + it) % 5
    x = torch.randn(n, H, generator=g)
    x[1] = 0  # an all-zero row: its fp8 scale is the floor, 1e-4 / 448
    topk = torch.stack([torch.randperm(E, generator=g)[:K] for _ in range(n)])
    topk[torch.rand(n, K, generator=g) < 0.2] = -1
    return x, topk, torch.rand(n, K, generator=g)

def fp8(x):
    # Upstream's per-token cast: blocks of 128 channels, scale = max(|block|, 1e-4) / 448.
    blocks = x.reshape(x.shape[0], -1, 128)
    amax = blocks.abs().amax(dim=2).clamp(min=1e-4)
    values = (blocks * (448.0 / amax).unsqueeze(2)).to(torch.float8_e4m3fn)
    return values.reshape(x.shape), amax / 448.0

def fp8_back(values, scales):
    blocks = values.to(torch.float32).reshape(values.shape[0], -1, 128)
    return (blocks * scales.reshape(values.shape[0], -1, 1)).reshape(values.shape)

def check_dispatch(recv_x, recv_count, handle, alive, it, use_fp8):
    src_info, layout_range = handle[0], handle[1]
    assert tuple(handle[2:]) == (M, H, E)
    assert src_info.shape == (L, world * M) and src_info.dtype == torch.int32
    assert layout_range.shape == (L, world) and layout_range.dtype == torch.int64
    if use_fp8:
        values, scales = recv_x
        assert values.dtype == torch.float8_e4m3fn and values.shape == (L, world * M, H)
        # Column-major per expert, as upstream lays the scales out.
        assert scales.shape == (L, world * M, H // 128)
        assert scales.stride() == (world * M * H // 128, 1, world * M)
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
        slot_src = []
        for s in range(world):
            begin, count = int(layout_range[e, s]) >> 32, int(layout_range[e, s]) & 0xFFFFFFFF
            assert begin == len(slot_src), (it, e, s, begin)
            slot_src += [s] * count
        assert slot_src == srcs, (it, e)
        if rows:
            if use_fp8:
                want_values, want_scales = fp8(torch.stack(rows))
                assert torch.equal(values[e, :n].view(torch.uint8),
                                   want_values.view(torch.uint8)), (it, e)
                assert torch.equal(scales[e, :n], want_scales), (it, e)
            else:
                assert torch.equal(recv_x[e, :n], torch.stack(rows)), (it, e)
        assert src_info[e, :n].tolist() == toks, (it, e)
        # Rows past the count are unspecified (as upstream); src_info marks them empty.
        assert (src_info[e, n:] == -1).all(), (it, e)

def reference(x, topk, w, alive):
    out = torch.zeros_like(x)
    for t in range(x.shape[0]):
        for j in range(K):
            e = int(topk[t, j])
            if e >= 0 and alive[e // L]:
                out[t] += w[t, j] * x[t] * (e + 1)
    return out

def step(it, active, use_fp8=False, timeout_us=2_000_000):
    x, topk, w = inputs(rank, it)
    recv_x, recv_count, handle, event, hook = buf.dispatch(
        x, topk, active, M, E, timeout_us, use_fp8=use_fp8, async_finish=True)
    event.current_stream_wait()
    assert hook is None
    alive = active[:world].tolist()
    check_dispatch(recv_x, recv_count, handle, alive, it, use_fp8)
    if use_fp8:
        recv_x = fp8_back(recv_x[0].reshape(-1, H), recv_x[1].reshape(-1, H // 128)
                          ).reshape(L, world * M, H)
        x = fp8_back(*fp8(x))  # what the experts saw of this rank's tokens
    experts = (rank * L + torch.arange(L) + 1).to(recv_x.dtype).reshape(L, 1, 1)
    try:
        buf.combine(recv_x[:, 1:], topk, w, active, timeout_us, handle)
    except ValueError:
        pass
    else:
        raise AssertionError("combine accepted x not shaped as recv_x")
    combined, event, hook = buf.combine(recv_x * experts, topk, w, active, timeout_us, handle,
                                        return_recv_hook=True)
    event.current_stream_wait()
    hook()
    alive = active[:world].tolist()  # a rank stopping in combine is masked there
    want = reference(x, topk, w, alive)
    assert torch.allclose(combined, want, atol=1e-5), (it, (combined - want).abs().max())
    return alive

def refused(call, *args, **kwargs):
    try:
        call(*args, **kwargs)
    except ValueError:
        return
    raise AssertionError(f"{call.__name__} accepted bad arguments")

assert buf.update_ep_member() is None
active = torch.ones(world, dtype=torch.int32)
x, topk, w = inputs(rank, 0)
for bad in [topk.clamp(max=E - 2) + 2, topk[:, :1].repeat(1, 2).clamp(min=0)]:
    refused(buf.dispatch, x, bad, active, M, E, 2_000_000, use_fp8=False)
for bad_args, kwargs in [
        ((x, topk, active, M, E + 1, 2_000_000), {}), ((x, topk, active, M, E, 0), {}),
        ((x, topk, active, M, E, -2), {}),
        ((x, topk, active.to(torch.int64), M, E, 2_000_000), {}),
        ((x, topk, active[:world - 1], M, E, 2_000_000), {}),
        ((x[:, :100], topk, active, M, E, 2_000_000), {}),  # fp8 (the default) needs H % 128
        ((x[:, :100], topk, active, M, E, 2_000_000), {"use_fp8": True})]:
    refused(buf.dispatch, *bad_args, **kwargs)
small = ep.Buffer(WORLD_PG, ep.get_ep_buffer_size_hint(M, H, world, E) - 1)
refused(small.dispatch, x, topk, active, M, E, 2_000_000, use_fp8=False)
assert active.tolist() == [1] * world
"""

_RUN = r"""
say("start", step(0, active))

def stop():
    if HANG:
        sys.stdin.readline()  # alive but silent until the test ends it
    os._exit(0)

if rank == VICTIM:
    say("stopping")
    if AT_EXCHANGE:
        # Stops inside step 1, at that exchange: 2 is dispatch's rows (after its counts
        # went out), 3 combine's.
        exchange, exchanges = buf._handle.all_to_all_timeout, [0]

        def stopping_at(*args):
            exchanges[0] += 1
            if exchanges[0] == AT_EXCHANGE:
                stop()
            return exchange(*args)
        buf._handle.all_to_all_timeout = stopping_at
        step(1, active, timeout_us=TIMEOUT_US)
    stop()
for it in (1, 2):
    say("step", it, step(it, active, timeout_us=TIMEOUT_US))
say("done")
"""

_FORMS = r"""
# fp8 (upstream's default) with a mask longer than the group, as upstream's test passes
long_mask = torch.ones(M, dtype=torch.int32)
step(1, long_mask, use_fp8=True)
assert long_mask.tolist() == [1] * M
# No bound of its own (-1): the group's timeout_ms applies.
step(2, active, timeout_us=-1)
# zero_copy: combine reads get_next_combine_buffer(handle) instead of x.
x, topk, w = inputs(rank, 3)
recv_x, recv_count, handle, event, hook = buf.dispatch(x, topk, active, M, E, -1,
                                                       use_fp8=False, return_recv_hook=True)
hook()
refused(buf.combine, recv_x, topk, w, active, -1, handle, zero_copy=True)  # not fetched yet
refused(buf.combine, recv_x, topk, w, active, -1, (handle[0], handle[1], M, H, E))
next_buf = buf.get_next_combine_buffer(handle)
assert next_buf.shape == recv_x.shape and next_buf.dtype == recv_x.dtype
assert buf.get_next_combine_buffer(handle) is next_buf
experts = (rank * L + torch.arange(L) + 1).to(recv_x.dtype).reshape(L, 1, 1)
next_buf[:] = recv_x * experts
out = torch.empty(x.shape[0], H)
combined, event, _ = buf.combine(torch.zeros_like(recv_x), topk, w, active, -1, handle,
                                 zero_copy=True, out=out)
with event:
    pass
assert combined is out
assert torch.allclose(out, reference(x, topk, w, [1] * world), atol=1e-5)
refused(buf.combine, recv_x.to(torch.float8_e4m3fn), topk, w, active, -1, handle)
say("done")
"""


def _script(victim, hang=False, timeout_us=2_000_000, at_exchange=0):
    return _EP + (f"VICTIM = {victim}\nHANG = {hang}\nTIMEOUT_US = {timeout_us}\n"
                  f"AT_EXCHANGE = {at_exchange}\n") + _RUN


def test_dispatch_and_combine_match_the_dense_reference(store, ranks):
    ranks.extend(Rank(_script(-1), store.port, r) for r in range(WORLD))
    for r in ranks:
        assert r.expect("start") == "start [1, 1, 1, 1]"
        r.expect("step 2")
        r.expect("done")
    for r in ranks:
        r.finish()


def test_upstream_forms_fp8_long_mask_no_timeout_and_zero_copy(store, ranks):
    ranks.extend(Rank(_EP + _FORMS, store.port, r, timeout_ms=20_000) for r in range(WORLD))
    for r in ranks:
        r.expect("done")
    for r in ranks:
        r.finish()


@pytest.mark.parametrize("hang, timeout_ms, timeout_us, at_exchange", [
    (False, 300_000, 2_000_000, 0), (True, 300_000, 2_000_000, 0), (False, 5_000, -1, 0),
    (False, 300_000, 2_000_000, 2), (True, 300_000, 2_000_000, 2),
    (False, 300_000, 2_000_000, 3)],
    ids=["exits", "hangs", "exits-no-ep-timeout", "exits-mid-dispatch",
         "hangs-mid-dispatch", "exits-in-combine"])
def test_stopped_rank_is_masked_and_its_tokens_dropped(store, ranks, hang, timeout_ms,
                                                       timeout_us, at_exchange):
    """A rank that exits, or stays alive and silent: before the second step, or inside
    it (between dispatch's two exchanges, once its counts went out; or in combine, after
    a dispatch it took part in). With timeout_us set, the group's own timeout is far
    beyond the test's bound on a step, so the survivors can only get past the silent
    rank through timeout_us; with -1 (no bound of its own) the group's timeout_ms masks
    it."""
    victim = 2
    ranks.extend(Rank(_script(victim, hang, timeout_us, at_exchange), store.port, r,
                      timeout_ms=timeout_ms) for r in range(WORLD))
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


def test_size_hint_is_upstreams_formula():
    from mooncake import ep
    from mooncake.mooncake_ep_buffer import Buffer, get_ep_buffer_size_hint

    # 16 E + 4 E M (2 H + 32): two buffers of send and receive signals and slots.
    assert Buffer.get_ep_buffer_size_hint(128, 7168, 3, 288) == 2_118_652_416
    assert get_ep_buffer_size_hint(1, 128, 2, 4) == 16 * 4 + 4 * 4 * (2 * 128 + 32)
    # num_ranks does not enter it, and E need not divide evenly here (dispatch checks).
    assert ep.get_ep_buffer_size_hint(128, 7168, 3, 8) == ep.get_ep_buffer_size_hint(
        128, 7168, 4, 8)
    with pytest.raises(ValueError):
        ep.get_ep_buffer_size_hint(-1, 7168, 4, 8)
