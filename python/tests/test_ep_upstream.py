"""Upstream's Mooncake EP test scenario (mooncake-wheel/tests/test_mooncake_ep.py), on host
tensors: three rank processes, ``Buffer`` imported from ``mooncake.mooncake_ep_buffer``
over a ``dist.new_group`` of the ``mooncake-cpu`` world, bf16 as the default dtype, rank
1 building a second Buffer where the others call ``update_ep_member``. Each rank sends
tokens whose channels hold its rank (offset by -128) and, in the last 128, the token's
index, with 10 choices knocked out to -1 and a mask tensor of ``num_tokens`` entries.
For every (recv hook, fp8) pair it dispatches (twice for some), checks every local
expert's rows against the gathered routing (counts, ``layout_range``, ``src_info``,
each source's rows), then combines with and without zero copy and compares with
``x * sum of the weights``. The timed part of upstream's test (CUDA events, kernel
profiling) has no host counterpart: its calls are run once each instead. The run is
then repeated with the same seed and must give the same digest.
"""

import pytest

pytest.importorskip("torch", reason="torch is not installed (a test-time dependency)")

from test_pg import Rank, ranks, store  # noqa: E402,F401

_SCENARIO = r"""
import random
from mooncake.mooncake_ep_buffer import Buffer

torch.set_default_dtype(torch.bfloat16)
group = dist.new_group(list(range(world)))
OFFSET = 128  # rank values stay exact in bf16 once offset

def cast_back(values, scales):
    blocks = values.to(torch.float32).view(values.shape[0], -1, 128)
    return (blocks * scales.view(values.shape[0], -1, 1)).view(values.shape).to(torch.bfloat16)

def similarity_gap(a, b):
    a, b = a.double() + 1, b.double() + 1
    return (1 - 2 * (a * b).sum() / (a * a + b * b).sum()).item()

def digest(t):
    return t.contiguous().view(torch.int64).sum().item()

def scenario(num_tokens, hidden, num_experts, num_topk, buffer, seed):
    torch.manual_seed(seed + rank)
    random.seed(seed + rank)
    L = num_experts // world
    x = torch.ones((num_tokens, hidden), dtype=torch.bfloat16) * (rank - OFFSET)
    x[:, -128:] = torch.arange(num_tokens).to(torch.bfloat16).view(-1, 1)
    scores = torch.randn((num_tokens, num_experts), dtype=torch.float32).abs() + 1
    topk_idx = torch.topk(scores, num_topk, dim=-1).indices
    topk_weights = torch.randn((num_tokens, num_topk), dtype=torch.float32).abs()
    for _ in range(10):
        topk_idx[random.randrange(num_tokens), random.randrange(num_topk)] = -1
    active = torch.ones((num_tokens,), dtype=torch.int32)
    all_topk = torch.empty((world, num_tokens, num_topk), dtype=topk_idx.dtype)
    dist.all_gather_into_tensor(all_topk, topk_idx, group=group)
    total, calls = 0, 0
    for return_recv_hook in (False, True):
        for use_fp8 in (False, True):
            calls += 1
            for _ in range(calls % 2 + 1):
                recv, recv_count, handle, event, hook = buffer.dispatch(
                    x, topk_idx, active, num_tokens, num_experts, -1, use_fp8=use_fp8,
                    async_finish=not return_recv_hook, return_recv_hook=return_recv_hook)
                hook() if return_recv_hook else event.current_stream_wait()
            if use_fp8:
                values, scales = recv[0], recv[1].contiguous()
                gemm_x = cast_back(values.view(-1, hidden),
                                   scales.view(-1, hidden // 128)).view(values.shape)
            else:
                gemm_x = recv.clone()
            for i in range(L):
                expert = rank * L + i
                rows = cast_back(values[i], scales[i]) if use_fp8 else recv[i]
                n = recv_count[i].item()
                src_info, layout = handle[0][i], handle[1][i]
                assert n == (layout & 0xFFFFFFFF).sum().item(), (n, layout)
                assert n == (all_topk == expert).sum().item()
                rows = rows[:n]
                row_min = rows[:, :-128].amin(dim=-1)
                assert torch.equal(row_min, rows[:, :-128].amax(dim=-1))
                assert torch.equal(rows[:, -128:],
                                   (src_info[:n] % num_tokens).view(-1, 1).expand(n, 128)
                                   .to(torch.bfloat16))
                for j in range(world):
                    begin, count = (layout[j] >> 32).item(), (layout[j] & 0xFFFFFFFF).item()
                    assert (row_min == j - OFFSET).sum().item() == \
                        (all_topk[j] == expert).sum().item()
                    assert (rows[begin:begin + count, :-128] == j - OFFSET).all()
                if use_fp8:
                    total ^= digest(values[i, :n]) ^ digest(scales[i, :n])
                else:
                    total ^= digest(recv[i, :n])
            want = x * topk_weights.masked_fill(topk_idx == -1, 0).sum(dim=1).view(-1, 1)
            for zero_copy in (False, True):
                if zero_copy:
                    buffer.get_next_combine_buffer(handle)[:, :, :] = gemm_x
                out = torch.empty((num_tokens, hidden), dtype=torch.bfloat16)
                combined, event, hook = buffer.combine(
                    gemm_x, topk_idx, topk_weights, active, -1, handle,
                    async_finish=not return_recv_hook, zero_copy=zero_copy,
                    return_recv_hook=return_recv_hook, out=out)
                hook() if return_recv_hook else event.current_stream_wait()
                assert combined is out
                assert not torch.isnan(combined).any()
                gap = similarity_gap(want, combined)
                assert gap < 1e-5, (gap, zero_copy, use_fp8)
                total ^= digest(combined)
    assert active.tolist() == [1] * num_tokens
    # Upstream's timed loop, once per form (fp8 dispatch, its default), untimed.
    for zero_copy in (False, True):
        for return_recv_hook in (False, True):
            recv, _, handle, _, hook = buffer.dispatch(
                x, topk_idx, active, num_tokens, num_experts, -1,
                return_recv_hook=return_recv_hook)
            hook() if return_recv_hook else None
            if zero_copy:
                buffer.get_next_combine_buffer(handle)[:, :, :] = gemm_x
            _, _, hook = buffer.combine(gemm_x, topk_idx, topk_weights, active, -1, handle,
                                        zero_copy=zero_copy, return_recv_hook=return_recv_hook)
            hook() if return_recv_hook else None
    return total

num_tokens, hidden, num_topk, num_experts = 32, 512, 4, 12
size = Buffer.get_ep_buffer_size_hint(num_tokens, hidden, world, num_experts)
buffer = Buffer(group, num_ep_buffer_bytes=size)
assert buffer.group_size == world and buffer.num_ep_buffer_bytes == size
if rank != 1:
    buffer.update_ep_member()
else:
    buffer = Buffer(group, num_ep_buffer_bytes=size)
assert buffer._use_fallback  # no device kernels to profile in this build
first = scenario(num_tokens, hidden, num_experts, num_topk, buffer, seed=1)
assert scenario(num_tokens, hidden, num_experts, num_topk, buffer, seed=1) == first
dist.destroy_process_group()
say("done")
"""


def test_upstream_ep_scenario_on_three_ranks(store, ranks):
    ranks.extend(Rank(_SCENARIO, store.port, r, world=3, timeout_ms=20_000) for r in range(3))
    for r in ranks:
        r.expect("done")
    for r in ranks:
        r.finish()
