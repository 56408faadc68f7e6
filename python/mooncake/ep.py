"""Mooncake EP: expert-parallel MoE dispatch/combine that survives a dead rank.

Host (CPU) or CUDA torch tensors over a Mooncake PG process group (``mooncake.pg``);
torch is needed for this module. With CUDA tensors the rows stay on the device: the
exchanges pass their memory to the C ABI as device memory (staged by the library with
the driver, one copy in and one out per buffer), and only the routing metadata
(``topk_idx``, row counts, the mask) is handled on the host. Experts are spread evenly: rank ``r`` owns experts
``r * L .. r * L + L - 1`` with ``L = num_experts // num_ranks``.

    buf = ep.Buffer(dist.group.WORLD, ep.Buffer.get_ep_buffer_size_hint(M, H, R, E))
    active = torch.ones(R, dtype=torch.int32)
    recv_x, recv_count, handle, _, _ = buf.dispatch(x, topk_idx, active, M, E, 500_000)
    y = run_local_experts(recv_x, recv_count)       # same shape as recv_x
    out, _, _ = buf.combine(y, topk_idx, topk_weights, active, 500_000, handle)

Layout (DeepEP's low-latency mode): ``recv_x[e, :recv_count[e]]`` are the rows for
local expert ``e``, grouped by source rank in rank order, each source's rows in token
order; ``handle.recv_src_rank`` / ``handle.recv_src_token`` name each row's origin. As
upstream, rows past ``recv_count[e]`` are unspecified (not cleared: ``recv_x`` is sized
for the worst case, and zeroing it would cost more than the exchange).

Each call is two all-to-all exchanges (row counts, then rows) whose waits for peers
are bounded by ``timeout_us``. A rank not heard from in time is masked: its entry in
``active_ranks`` (int32, 1 = active) is set to 0 in place, the survivors agree on a
membership without it, and the call is redone among them, so it returns on every
survivor. What is dropped:

- dispatch: no token goes to a masked rank (its experts receive nothing) and nothing
  from a masked rank is received (``recv_count`` counts no row of it);
- combine: ``combined_x[t] = sum of topk_weights[t, j] * expert_output`` over the
  choices ``j`` whose expert lives on a rank still active at the end of the combine;
  choices that are -1, or whose expert is on a masked rank, contribute nothing (the
  weights are not renormalized).

A rank set to 0 in ``active_ranks`` by the caller is treated the same way. Dropping
relies on the group's ``auto_deactivate_on_failure`` (the default): without it a failure
is raised. ``async_finish`` and ``return_recv_hook`` are accepted for upstream's
signature; calls complete before returning (``event`` None, ``hook`` a no-op).
"""

import torch

from . import pg

__all__ = ["Buffer", "EPHandle"]

_TOKEN_BYTES = 8  # each dispatched row carries its source token index (int64)


class EPHandle:
    """What combine needs from a dispatch.

    ``send_pos``: for each row this rank sent, in send order, its position
    ``token * k + j`` in ``topk_idx``; ``send_rows[d]``: rows sent to rank d.
    ``recv_rows[s]``: rows received from rank s; ``recv_expert`` / ``recv_slot``: where
    each received row (in receive order) lies in ``recv_x`` (slot -1: dropped, its source
    masked). ``recv_src_rank`` / ``recv_src_token`` [L, R*M]: each slot's source rank and
    token index (-1 where empty).
    """

    def __init__(self, **fields):
        self.__dict__.update(fields)


def _check_mask(active_ranks, num_ranks, device):
    if not isinstance(active_ranks, torch.Tensor) or active_ranks.dtype != torch.int32 \
            or active_ranks.shape != (num_ranks,) \
            or active_ranks.device.type not in ("cpu", device.type):
        raise ValueError(f"active_ranks must be an int32 tensor of shape ({num_ranks},) on "
                         f"the CPU or {device}")


def _check_device(what, t):
    if t.device.type not in ("cpu", "cuda"):
        raise ValueError(f"{what} must be a CPU or CUDA tensor, not on {t.device}")


def _mask(active_ranks):
    """The mask as host booleans (routing is computed on the host)."""
    return active_ranks.to("cpu", torch.bool)


def _check_timeout(timeout_us):
    if int(timeout_us) <= 0:
        raise ValueError(f"timeout_us must be positive, not {timeout_us}")


def _rows_of(buf, dtype, hidden):
    """The ``[rows, hidden]`` elements of ``dtype`` at the start of each row of ``buf``
    (uint8 rows of ``hidden`` elements then a token index), as a view: no copy. Every
    element size divides the 8-byte token index, so the rows stay aligned."""
    return buf.view(dtype)[:, :hidden]


def _row_bytes(t):
    return t.shape[-1] * t.element_size()


class Buffer:
    """Expert-parallel dispatch/combine over one rank of a Mooncake PG group.

    ``num_ep_buffer_bytes`` bounds the receive area of one dispatch
    (``get_ep_buffer_size_hint`` gives a size that always suffices).
    """

    def __init__(self, group, num_ep_buffer_bytes):
        self.group = group
        self._handle = pg._handle(group)
        self.rank = self._handle.rank
        self.num_ranks = self._handle.world_size
        self.num_ep_buffer_bytes = int(num_ep_buffer_bytes)
        if self.num_ep_buffer_bytes <= 0:
            raise ValueError("num_ep_buffer_bytes must be positive")

    @staticmethod
    def get_ep_buffer_size_hint(max_tokens_per_rank, hidden, num_ranks, num_experts):
        """Bytes for dispatch's receive area and combine's send area
        (``[num_experts / num_ranks, num_ranks * max_tokens_per_rank, hidden]`` each) at up
        to 8 bytes an element."""
        for name, v in [("max_tokens_per_rank", max_tokens_per_rank), ("hidden", hidden),
                        ("num_ranks", num_ranks), ("num_experts", num_experts)]:
            if int(v) <= 0:
                raise ValueError(f"{name} must be positive, not {v}")
        if num_experts % num_ranks:
            raise ValueError(f"num_experts {num_experts} is not a multiple of num_ranks "
                             f"{num_ranks}")
        return 2 * num_experts * max_tokens_per_rank * hidden * 8

    def update_ep_member(self):
        """Re-reads the group's membership (after ranks were activated or deactivated)
        and returns it as an int32 mask to pass as ``active_ranks``."""
        return torch.tensor([int(v) for v in self._handle.active_ranks()], dtype=torch.int32)

    def _exchange(self, send_buf, send_rows, recv_buf, recv_rows, active_ranks, timeout_us):
        """One all-to-all of rows. On a failure the survivors reconcile membership (the
        new view leaves out the ranks that did not take part), ``active_ranks`` takes
        it and ``_Retry`` is raised."""
        sb, rb = _row_bytes(send_buf), _row_bytes(recv_buf)
        device = send_buf.device
        try:
            # The handle's memory setting is shared with the PG backend's threads: held
            # from the setting to the call.
            with self._handle.memory(pg._location(device)):
                if device.type == "cuda":
                    # The driver's copies do not follow torch's streams: finish the rows.
                    torch.cuda.current_stream(device).synchronize()
                self._handle.all_to_all_timeout(
                    send_buf.data_ptr(), [int(n) * sb for n in send_rows],
                    recv_buf.data_ptr(), [int(n) * rb for n in recv_rows], timeout_us)
        except pg.MooncakeCollectiveError as e:
            # Which ranks are masked comes from the view the survivors agree on, not from
            # this exchange's hint: a rank that died between the two exchanges can leave
            # survivors in different exchanges, blaming a live peer for the mismatch.
            epoch = self._handle.epoch()
            if self._handle.sync_after_failure().status == pg.SyncAfterFailureStatus.Rejected:
                raise
            self._apply_membership(active_ranks)
            if self._handle.epoch() == epoch:
                raise  # no new view: redoing the call would fail the same way
            raise _Retry() from e
        self._apply_membership(active_ranks)

    def _apply_membership(self, active_ranks):
        for r, on in enumerate(self._handle.active_ranks()):
            if not on:
                active_ranks[r] = 0

    def _attempts(self):
        # Every retry follows a membership change that removed at least one rank.
        return range(self.num_ranks + 1)

    def dispatch(self, x, topk_idx, active_ranks, num_max_dispatch_tokens_per_rank,
                 num_experts, timeout_us, use_fp8=False, async_finish=False,
                 return_recv_hook=False):
        """Sends each token to the ranks owning its chosen experts.

        ``x`` [tokens, hidden], ``topk_idx`` [tokens, k] (-1: no expert). Returns
        ``(recv_x, recv_count, handle, event, hook)``: ``recv_x`` [L, R*M, hidden] of
        ``x``'s dtype, ``recv_count`` [L] int32; ``event`` is None and ``hook`` a no-op
        (the call is complete when it returns).
        """
        R, M = self.num_ranks, int(num_max_dispatch_tokens_per_rank)
        if use_fp8:
            raise ValueError("use_fp8 is not supported")
        if x.dim() != 2:
            raise ValueError("x must be a tensor [tokens, hidden]")
        _check_device("x", x)
        if topk_idx.dim() != 2 or topk_idx.shape[0] != x.shape[0] \
                or topk_idx.dtype not in (torch.int32, torch.int64):
            raise ValueError("topk_idx must be an integer tensor [tokens, k] matching x")
        if M <= 0 or x.shape[0] > M:
            raise ValueError(f"{x.shape[0]} tokens exceed num_max_dispatch_tokens_per_rank {M}")
        if num_experts <= 0 or num_experts % R:
            raise ValueError(f"num_experts {num_experts} is not a positive multiple of "
                             f"num_ranks {R}")
        _check_mask(active_ranks, R, x.device)
        _check_timeout(timeout_us)
        L, hidden = num_experts // R, x.shape[1]
        topk_idx = topk_idx.cpu()
        flat = topk_idx.reshape(-1).to(torch.int64)
        if flat.numel() and (flat.min() < -1 or flat.max() >= num_experts):
            raise ValueError(f"topk_idx holds experts outside -1..{num_experts - 1}")
        chosen = topk_idx.to(torch.int64).sort(dim=1).values
        if ((chosen.diff(dim=1) == 0) & (chosen[:, 1:] >= 0)).any():
            raise ValueError("a token chooses the same expert twice")
        if L * R * M * hidden * x.element_size() > self.num_ep_buffer_bytes:
            raise ValueError("the receive area exceeds num_ep_buffer_bytes "
                             "(see get_ep_buffer_size_hint)")
        x = x.contiguous()
        k = topk_idx.shape[1]
        pos = torch.nonzero(flat >= 0).reshape(-1)
        experts = flat[pos]
        order = torch.argsort(experts, stable=True)  # by (rank, local expert, token)
        pos, experts = pos[order], experts[order]
        for _ in self._attempts():
            keep = _mask(active_ranks)[experts // L]
            send_pos, send_exp = pos[keep], experts[keep]
            send_counts = torch.bincount(send_exp, minlength=num_experts).reshape(R, L)
            recv_counts = torch.zeros(R, L, dtype=torch.int64)
            try:
                self._exchange(send_counts, [1] * R, recv_counts, [1] * R, active_ranks,
                               timeout_us)
            except _Retry:
                continue
            hb = hidden * x.element_size()
            tokens = (send_pos // k).to(x.device)
            send_buf = torch.empty(send_pos.numel(), hb + _TOKEN_BYTES, dtype=torch.uint8,
                                   device=x.device)
            # Gathered straight into the rows' place (one copy of each row).
            torch.index_select(x, 0, tokens, out=_rows_of(send_buf, x.dtype, hidden))
            send_buf[:, hb:] = tokens.reshape(-1, 1).view(torch.uint8)
            recv_rows = recv_counts.sum(1)
            # Every byte is written: the counts name exactly what each active rank sends.
            recv_buf = torch.empty(int(recv_rows.sum()), hb + _TOKEN_BYTES, dtype=torch.uint8,
                                   device=x.device)
            try:
                self._exchange(send_buf, send_counts.sum(1), recv_buf, recv_rows,
                               active_ranks, timeout_us)
            except _Retry:
                continue
            return self._place(x, recv_buf, recv_counts, send_pos, send_counts.sum(1),
                               active_ranks, L, M, hb, return_recv_hook)
        raise RuntimeError("dispatch: membership kept changing")

    def _place(self, x, recv_buf, recv_counts, send_pos, send_rows, active_ranks, L, M, hb,
               return_recv_hook):
        R, hidden, dev = self.num_ranks, x.shape[1], x.device
        n = recv_buf.shape[0]
        row_src = torch.repeat_interleave(torch.arange(R), recv_counts.sum(1))
        row_exp = torch.repeat_interleave(torch.arange(L).repeat(R), recv_counts.reshape(-1))
        kept = _mask(active_ranks)[row_src]
        # Slot of each kept row within its expert: rows arrive by source then expert, so
        # a stable sort by expert keeps source (then token) order.
        slot = torch.full((n,), -1, dtype=torch.int64)
        kept_idx = torch.nonzero(kept).reshape(-1)
        by_exp = kept_idx[torch.argsort(row_exp[kept_idx], stable=True)]
        recv_count = torch.bincount(row_exp[kept_idx], minlength=L)
        starts = torch.cumsum(recv_count, 0) - recv_count
        slot[by_exp] = torch.arange(by_exp.numel()) - starts[row_exp[by_exp]]
        recv_x = torch.empty(L, R * M, hidden, dtype=x.dtype, device=dev)
        rows = _rows_of(recv_buf, x.dtype, hidden)
        tokens = recv_buf[:, hb:].contiguous().view(torch.int64).reshape(n).cpu()
        if kept_idx.numel() == n:
            recv_x[row_exp.to(dev), slot.to(dev)] = rows
        else:
            recv_x[row_exp[kept_idx].to(dev), slot[kept_idx].to(dev)] = rows[kept_idx.to(dev)]
        src_rank = torch.full((L, R * M), -1, dtype=torch.int32)
        src_token = torch.full((L, R * M), -1, dtype=torch.int64)
        src_rank[row_exp[kept_idx], slot[kept_idx]] = row_src[kept_idx].to(torch.int32)
        src_token[row_exp[kept_idx], slot[kept_idx]] = tokens[kept_idx]
        handle = EPHandle(send_pos=send_pos, send_rows=send_rows, recv_rows=recv_counts.sum(1),
                          recv_expert=row_exp, recv_slot=slot, recv_src_rank=src_rank,
                          recv_src_token=src_token, num_tokens=x.shape[0], hidden=hidden)
        hook = (lambda: None) if return_recv_hook else None
        return recv_x, recv_count.to(dev, torch.int32), handle, None, hook

    def combine(self, x, topk_idx, topk_weights, active_ranks, timeout_us, handle,
                async_finish=False, return_recv_hook=False, out=None):
        """Returns each token's rows to its rank, weighted and summed.

        ``x``: the experts' outputs in ``recv_x``'s layout [L, R*M, hidden]. Returns
        ``(combined_x, event, hook)``; ``combined_x`` [tokens, hidden] (written into
        ``out`` when given) is the sum over the surviving choices (module docstring).
        """
        R = self.num_ranks
        if x.shape != handle.recv_src_rank.shape + (handle.hidden,):
            raise ValueError(f"x must be a tensor shaped as dispatch's recv_x, "
                             f"{list(handle.recv_src_rank.shape) + [handle.hidden]}")
        _check_device("x", x)
        dev = x.device
        tokens = handle.num_tokens
        if topk_idx.dim() != 2 or topk_idx.shape[0] != tokens \
                or topk_weights.shape != topk_idx.shape:
            raise ValueError("topk_idx and topk_weights must be [tokens, k] as dispatched")
        _check_mask(active_ranks, R, dev)
        _check_timeout(timeout_us)
        k = topk_idx.shape[1]
        slot = handle.recv_slot
        kept = slot >= 0
        send_buf = x[handle.recv_expert.to(dev), slot.clamp(min=0).to(dev)]
        if not bool(kept.all()):
            send_buf[(~kept).to(dev)] = 0  # rows of a masked source go back empty
        # Rows from ranks dropped meanwhile stay unwritten; they are masked out below.
        recv_buf = torch.empty(handle.send_pos.numel(), handle.hidden, dtype=x.dtype,
                               device=dev)
        for _ in self._attempts():
            try:
                self._exchange(send_buf, handle.recv_rows, recv_buf, handle.send_rows,
                               active_ranks, timeout_us)
            except _Retry:
                continue
            break
        else:
            raise RuntimeError("combine: membership kept changing")
        dest = torch.repeat_interleave(torch.arange(R), handle.send_rows)
        use = _mask(active_ranks)[dest]
        pos, rows = handle.send_pos, recv_buf
        if not bool(use.all()):
            pos, rows = pos[use], rows[use.to(dev)]
        pos = pos.to(dev)
        weights = topk_weights.reshape(-1).to(dev)[pos].to(torch.float32).reshape(-1, 1)
        acc = torch.zeros(tokens, handle.hidden, dtype=torch.float32, device=dev)
        acc.index_add_(0, pos // k, rows.to(torch.float32) * weights)
        combined = acc.to(x.dtype)
        if out is not None:
            out.copy_(combined)
            combined = out
        hook = (lambda: None) if return_recv_hook else None
        return combined, None, hook


class _Retry(Exception):
    """An exchange failed and the survivors reconciled: redo the call among them."""
