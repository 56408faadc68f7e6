"""Mooncake EP: expert-parallel MoE dispatch/combine that survives a dead rank.

Host (CPU) or CUDA torch tensors over a Mooncake PG process group (``mooncake.pg``);
torch is needed for this module. With CUDA tensors the rows stay on the device: the
exchanges pass their memory to the C ABI as device memory (staged by the library with
the driver, one copy in and one out per buffer), and only the routing metadata
(``topk_idx``, row counts, the mask) is handled on the host. Experts are spread evenly:
rank ``r`` owns experts ``r * L .. r * L + L - 1`` with ``L = num_experts // num_ranks``.
Upstream's import path, ``from mooncake.mooncake_ep_buffer import Buffer``, gives the
same class.

    buf = ep.Buffer(dist.group.WORLD, ep.get_ep_buffer_size_hint(M, H, R, E))
    active = torch.ones(R, dtype=torch.int32)
    recv_x, recv_count, handle, event, hook = buf.dispatch(x, topk_idx, active, M, E, 500_000,
                                                           use_fp8=False)
    y = run_local_experts(recv_x, recv_count)       # same shape as recv_x
    out, event, hook = buf.combine(y, topk_idx, topk_weights, active, 500_000, handle)

Layout (DeepEP's low-latency mode): ``recv_x[e, :recv_count[e]]`` are the rows for
local expert ``e``, grouped by source rank in rank order, each source's rows in token
order. ``handle`` is upstream's tuple ``(src_info, layout_range, M, hidden, num_experts)``:
``src_info[e, i]`` (int32) is the source token index of row ``i`` (-1 past the count),
``layout_range[e, s]`` (int64) is ``(begin << 32) | count`` of source ``s``'s rows. As
upstream, rows past ``recv_count[e]`` are unspecified (not cleared: ``recv_x`` is sized
for the worst case, and zeroing it would cost more than the exchange).

``use_fp8`` (the default, as upstream) sends each row as float8_e4m3fn with one float32
scale per 128 channels (``hidden % 128 == 0``): ``recv_x`` is then ``(values [L, R*M,
hidden] float8_e4m3fn, scales [L, R*M, hidden / 128] float32)``, value times its block's
scale giving back the row; ``scale = max(|block|, 1e-4) / 448``. The scales are laid out
per expert column-major (a transposed view, as upstream: ``.contiguous()`` packs them).
combine takes the experts' outputs in a floating type other than fp8 (bf16 as upstream,
or any other), or, with ``zero_copy``, reads them from ``get_next_combine_buffer(handle)``.

Each call is two all-to-all exchanges (row counts, then rows) whose waits for peers
are bounded by ``timeout_us`` (-1: no bound of its own; the group's ``timeout_ms`` still
applies, so a dead rank is masked after that instead). A rank not heard from in time
is masked: its entry in ``active_ranks`` (int32, 1 = active; its first ``num_ranks``
entries are used, so a longer tensor, as upstream's test passes, works) is set to 0 in
place, the survivors agree on a membership without it, and the call is redone among
them, so it returns on every survivor. What is dropped:

- dispatch: no token goes to a masked rank (its experts receive nothing) and nothing
  from a masked rank is received (``recv_count`` counts no row of it);
- combine: ``combined_x[t] = sum of topk_weights[t, j] * expert_output`` over the
  choices ``j`` whose expert lives on a rank still active at the end of the combine;
  choices that are -1, or whose expert is on a masked rank, contribute nothing (the
  weights are not renormalized).

A rank set to 0 in ``active_ranks`` by the caller is treated the same way. Dropping
relies on the group's ``auto_deactivate_on_failure`` (the default): without it a failure
is raised. ``async_finish`` and ``return_recv_hook`` are accepted for upstream's
signature; calls complete before returning, so ``event.current_stream_wait()`` and the
hook (given with ``return_recv_hook``, else None) have nothing left to do.
"""

from types import SimpleNamespace

import torch

from . import pg

__all__ = ["Buffer", "EventOverlap", "get_active_ranks", "get_ep_buffer_size_hint"]

_TOKEN_BYTES = 8  # each dispatched row carries its source token index (int64)
_FP8 = torch.float8_e4m3fn
_FP8_MAX = 448.0  # largest finite float8_e4m3fn
_FP8_BLOCK = 128  # channels sharing one scale
_FP8_MIN_AMAX = 1e-4  # keeps an all-zero block's scale finite


def get_ep_buffer_size_hint(num_max_dispatch_tokens_per_rank, hidden, num_ranks, num_experts):
    """Upstream's EP buffer size: two buffers, each a send and a receive part of one
    signal int per expert plus ``num_max_dispatch_tokens_per_rank`` slots per expert of
    ``hidden`` bf16 values and two 16-byte headers: ``16 E + 4 E M (2 H + 32)`` bytes.
    ``num_ranks`` does not enter it (as upstream). This build sizes its buffers per call;
    a ``Buffer`` given a positive size refuses a dispatch whose hint exceeds it."""
    sizes = {"num_max_dispatch_tokens_per_rank": num_max_dispatch_tokens_per_rank,
             "hidden": hidden, "num_ranks": num_ranks, "num_experts": num_experts}
    for name, v in sizes.items():
        if int(v) < 0:
            raise ValueError(f"{name} must not be negative, not {v}")
    m, h, e = int(num_max_dispatch_tokens_per_rank), int(hidden), int(num_experts)
    return 16 * e + 4 * e * m * (2 * h + 32)


def get_active_ranks(backend=None):
    """The group's active-rank mask as an int32 tensor (``mooncake.pg.get_active_ranks``)."""
    return pg.get_active_ranks(backend)


class EventOverlap:
    """The ``event`` dispatch and combine return. Both calls are complete when they
    return, so there is no device event to wait for and ``current_stream_wait`` (also
    run on leaving a ``with`` block) returns at once; ``extra_tensors`` keeps what the
    caller asked to keep alive with ``async_finish``, as upstream."""

    def __init__(self, event=None, extra_tensors=None):
        self.event = event
        self.extra_tensors = extra_tensors

    def current_stream_wait(self):
        if self.event is not None:
            self.event.current_stream_wait()

    def __enter__(self):
        return self

    def __exit__(self, exc_type, exc, tb):
        self.current_stream_wait()


class _Handle(tuple):
    """dispatch's handle: upstream's 5-tuple, and in ``route`` what combine needs to send
    each row back (``send_pos``: for each row this rank sent, in send order, its position
    ``token * k + j`` in ``topk_idx``; ``send_rows[d]``: rows sent to rank d;
    ``recv_rows[s]``: rows received from rank s; ``recv_expert`` / ``recv_slot``: where
    each received row, in receive order, lies in ``recv_x``, slot -1 when dropped)."""

    def __new__(cls, items, route=None):  # copy/pickle rebuild it without, then set it
        handle = super().__new__(cls, items)
        handle.route = route
        return handle


def _route_of(handle):
    route = getattr(handle, "route", None)
    if not isinstance(route, SimpleNamespace):
        raise ValueError("handle must be the one dispatch returned")
    return route


def _check_mask(active_ranks, num_ranks, device):
    if not isinstance(active_ranks, torch.Tensor) or active_ranks.dtype != torch.int32 \
            or active_ranks.dim() != 1 or active_ranks.numel() < num_ranks \
            or active_ranks.device.type not in ("cpu", device.type):
        raise ValueError(f"active_ranks must be a 1-D int32 tensor of at least {num_ranks} "
                         f"entries on the CPU or {device}")


def _check_device(what, t):
    if t.device.type not in ("cpu", "cuda"):
        raise ValueError(f"{what} must be a CPU or CUDA tensor, not on {t.device}")


def _check_timeout(timeout_us):
    if int(timeout_us) != -1 and int(timeout_us) <= 0:
        raise ValueError(f"timeout_us must be positive, or -1 for no bound of its own, "
                         f"not {timeout_us}")


def _to_fp8(x):
    """``x`` [n, hidden] as float8_e4m3fn values and float32 scales [n, hidden / 128]:
    each block of 128 channels of a row divided by ``max(|block|, 1e-4) / 448``."""
    n, hidden = x.shape
    blocks = x.reshape(n, hidden // _FP8_BLOCK, _FP8_BLOCK).to(torch.float32)
    amax = blocks.abs().amax(dim=2).clamp(min=_FP8_MIN_AMAX)
    values = (blocks * (_FP8_MAX / amax).unsqueeze(2)).to(_FP8).reshape(n, hidden)
    return values, amax / _FP8_MAX


def _offsets(parts):
    """Byte offset of each part in a row (parts side by side, the token index after)
    and the bytes before the token index."""
    offsets, end = [], 0
    for part in parts:
        offsets.append(end)
        end += part.shape[1] * part.element_size()
    return offsets, end


def _part_of(buf, offset, like):
    """The elements of ``like``'s dtype and width at ``offset`` in each uint8 row of
    ``buf``, as a view: no copy. Every row's bytes and every offset are multiples of the
    parts' element sizes (each divides the 8-byte token index; fp8 scales start after
    ``hidden``, a multiple of 128, bytes), so the view is aligned."""
    return buf[:, offset:offset + like.shape[1] * like.element_size()].view(like.dtype)


def _mask(active_ranks, num_ranks):
    """The mask as host booleans (routing is computed on the host)."""
    return active_ranks[:num_ranks].to("cpu", torch.bool)


def _row_bytes(t):
    return t.shape[-1] * t.element_size()


class Buffer:
    """Expert-parallel dispatch/combine over one rank of a Mooncake PG group.

    ``num_ep_buffer_bytes``: when positive, dispatch refuses sizes whose
    ``get_ep_buffer_size_hint`` exceeds it (as upstream); 0, the default, sets no bound
    (this build sizes its buffers per call).
    """

    def __init__(self, group, num_ep_buffer_bytes=0, disable_p2p=False):
        # disable_p2p: upstream's switch off its intra-node GPU peer-to-peer path; this
        # build moves every row through the group's PG, so there is nothing to switch.
        self.disable_p2p = bool(disable_p2p)
        self.group = group
        self.backend = group  # what upstream hands to get_active_ranks
        self._handle = pg._handle(group)
        self.rank = self._handle.rank
        self.group_size = self._handle.world_size
        self.num_ranks = self.group_size
        if int(num_ep_buffer_bytes) < 0:
            raise ValueError(f"num_ep_buffer_bytes must not be negative, not "
                             f"{num_ep_buffer_bytes}")
        self.num_ep_buffer_bytes = int(num_ep_buffer_bytes)
        # Upstream's flag for running without its device kernels, which its tests read to
        # skip kernel profiling: this build never has them.
        self._use_fallback = True
        self._next_combine = None

    @staticmethod
    def get_ep_buffer_size_hint(num_max_dispatch_tokens_per_rank, hidden, num_ranks,
                                num_experts):
        """See the module-level ``get_ep_buffer_size_hint``."""
        return get_ep_buffer_size_hint(num_max_dispatch_tokens_per_rank, hidden, num_ranks,
                                       num_experts)

    def connect(self, is_update=False):
        """Upstream exchanges its device queues' addresses here (the constructor calls
        it; ``is_update`` after a membership change). Rows travel over the group's PG in
        this build, which is connected already: nothing to exchange."""

    def update_ep_member(self):
        """Upstream reconnects its device queues after ranks were activated or
        deactivated. Here every exchange runs over the group's current membership, so
        there is nothing to redo; read the mask with ``get_active_ranks``."""

    def get_next_combine_buffer(self, handle):
        """Where the next ``combine(..., zero_copy=True)`` with this handle reads the
        experts' outputs: ``[L, R*M, hidden]`` of the dispatched ``x``'s dtype."""
        route = _route_of(handle)
        shape = (handle[0].shape[0], handle[0].shape[1], handle[3])
        buf = self._next_combine
        if buf is None or buf.shape != shape or buf.dtype != route.dtype \
                or buf.device != route.device:
            self._next_combine = torch.empty(shape, dtype=route.dtype, device=route.device)
        return self._next_combine

    def _exchange(self, send_buf, send_rows, recv_buf, recv_rows, active_ranks, timeout_us):
        """One all-to-all of rows. On a failure the survivors reconcile membership (the
        new view leaves out the ranks that did not take part), ``active_ranks`` takes
        it and ``_Retry`` is raised."""
        sb, rb = _row_bytes(send_buf), _row_bytes(recv_buf)
        device = send_buf.device
        send = [int(n) * sb for n in send_rows]
        recv = [int(n) * rb for n in recv_rows]
        # Read before the call: one that entered a new view at its start and was refused
        # there (agree_on_new_view) is run again, not taken for a failure.
        epoch = self._handle.epoch()
        try:
            # The handle's memory setting is shared with the PG backend's threads: held
            # from the setting to the call.
            with self._handle.memory(pg._location(device)):
                if device.type == "cuda":
                    # The driver's copies do not follow torch's streams: finish the rows.
                    torch.cuda.current_stream(device).synchronize()
                if int(timeout_us) == -1:
                    self._handle.all_to_all(send_buf.data_ptr(), send, recv_buf.data_ptr(),
                                            recv)
                else:
                    self._handle.all_to_all_timeout(send_buf.data_ptr(), send,
                                                    recv_buf.data_ptr(), recv, timeout_us)
        except pg.MooncakeCollectiveError as e:
            # Which ranks are masked comes from the view the survivors agree on, not from
            # this exchange's hint: a rank that died between the two exchanges can leave
            # survivors in different exchanges, blaming a live peer for the mismatch.
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
                 num_experts, timeout_us, use_fp8=True, async_finish=False,
                 return_recv_hook=False):
        """Sends each token to the ranks owning its chosen experts.

        ``x`` [tokens, hidden], ``topk_idx`` [tokens, k] (-1: no expert). Returns
        ``(recv_x, recv_count, handle, event, hook)``: ``recv_x`` [L, R*M, hidden] of
        ``x``'s dtype, or with ``use_fp8`` the pair ``(float8 values, float32 scales)``;
        ``recv_count`` [L] int32; ``handle`` upstream's tuple; ``event`` an
        ``EventOverlap``; ``hook`` a no-op with ``return_recv_hook``, else None.
        """
        pg._drain(self.group)  # after the group's asynchronous operations, as elsewhere
        R, M = self.num_ranks, int(num_max_dispatch_tokens_per_rank)
        if not isinstance(x, torch.Tensor) or x.dim() != 2:
            raise ValueError("x must be a tensor [tokens, hidden]")
        _check_device("x", x)
        hidden = x.shape[1]
        if use_fp8 and (not x.is_floating_point() or x.dtype == _FP8
                        or hidden % _FP8_BLOCK):
            raise ValueError(f"use_fp8 needs a floating x (not fp8 already) whose hidden is "
                             f"a multiple of {_FP8_BLOCK}, not {x.dtype} [.., {hidden}]")
        if not isinstance(topk_idx, torch.Tensor) or topk_idx.dim() != 2 \
                or topk_idx.shape[0] != x.shape[0] \
                or topk_idx.dtype not in (torch.int32, torch.int64):
            raise ValueError("topk_idx must be an integer tensor [tokens, k] matching x")
        if M <= 0 or x.shape[0] > M:
            raise ValueError(f"{x.shape[0]} tokens exceed num_max_dispatch_tokens_per_rank {M}")
        if num_experts <= 0 or num_experts % R:
            raise ValueError(f"num_experts {num_experts} is not a positive multiple of "
                             f"num_ranks {R}")
        _check_mask(active_ranks, R, x.device)
        _check_timeout(timeout_us)
        L = num_experts // R
        topk_idx = topk_idx.cpu()
        flat = topk_idx.reshape(-1).to(torch.int64)
        if flat.numel() and (flat.min() < -1 or flat.max() >= num_experts):
            raise ValueError(f"topk_idx holds experts outside -1..{num_experts - 1}")
        chosen = topk_idx.to(torch.int64).sort(dim=1).values
        if ((chosen.diff(dim=1) == 0) & (chosen[:, 1:] >= 0)).any():
            raise ValueError("a token chooses the same expert twice")
        need = get_ep_buffer_size_hint(M, hidden, R, num_experts)
        if self.num_ep_buffer_bytes and need > self.num_ep_buffer_bytes:
            raise ValueError(f"these sizes need {need} bytes, more than num_ep_buffer_bytes "
                             f"{self.num_ep_buffer_bytes} (see get_ep_buffer_size_hint)")
        x = x.contiguous()
        if use_fp8:
            # fp8 rows travel as their bytes: index kernels for float8 are not on every
            # device.
            values, scales = _to_fp8(x)
            parts = [values.view(torch.uint8), scales]
        else:
            parts = [x]
        offsets, payload = _offsets(parts)
        k = topk_idx.shape[1]
        pos = torch.nonzero(flat >= 0).reshape(-1)
        experts = flat[pos]
        order = torch.argsort(experts, stable=True)  # by (rank, local expert, token)
        pos, experts = pos[order], experts[order]
        for _ in self._attempts():
            keep = _mask(active_ranks, R)[experts // L]
            send_pos, send_exp = pos[keep], experts[keep]
            send_counts = torch.bincount(send_exp, minlength=num_experts).reshape(R, L)
            recv_counts = torch.zeros(R, L, dtype=torch.int64)
            try:
                self._exchange(send_counts, [1] * R, recv_counts, [1] * R, active_ranks,
                               timeout_us)
            except _Retry:
                continue
            tokens = (send_pos // k).to(x.device)
            send_buf = torch.empty(send_pos.numel(), payload + _TOKEN_BYTES, dtype=torch.uint8,
                                   device=x.device)
            # Gathered straight into the rows' place (one copy of each row).
            for part, offset in zip(parts, offsets):
                torch.index_select(part, 0, tokens, out=_part_of(send_buf, offset, part))
            send_buf[:, payload:] = tokens.reshape(-1, 1).view(torch.uint8)
            recv_rows = recv_counts.sum(1)
            # Every byte is written: the counts name exactly what each active rank sends.
            recv_buf = torch.empty(int(recv_rows.sum()), payload + _TOKEN_BYTES,
                                   dtype=torch.uint8, device=x.device)
            try:
                self._exchange(send_buf, send_counts.sum(1), recv_buf, recv_rows,
                               active_ranks, timeout_us)
            except _Retry:
                continue
            recv_parts, recv_count, handle = self._place(
                x, parts, offsets, payload, recv_buf, recv_counts, send_pos,
                send_counts.sum(1), active_ranks, L, M, num_experts)
            recv_x = (recv_parts[0].view(_FP8), recv_parts[1]) if use_fp8 else recv_parts[0]
            event = EventOverlap(None, (x, topk_idx, *recv_parts, recv_count, handle[0],
                                        handle[1]) if async_finish else None)
            hook = (lambda: None) if return_recv_hook else None
            return recv_x, recv_count, handle, event, hook
        raise RuntimeError("dispatch: membership kept changing")

    def _place(self, x, parts, offsets, payload, recv_buf, recv_counts, send_pos, send_rows,
               active_ranks, L, M, num_experts):
        """Puts the received rows in their experts' slots; returns the filled parts (the
        values, with fp8 as bytes, and the scales), ``recv_count`` and the handle."""
        R, hidden, dev = self.num_ranks, x.shape[1], x.device
        n = recv_buf.shape[0]
        row_src = torch.repeat_interleave(torch.arange(R), recv_counts.sum(1))
        row_exp = torch.repeat_interleave(torch.arange(L).repeat(R), recv_counts.reshape(-1))
        src_kept = _mask(active_ranks, R)
        kept = src_kept[row_src]
        # Slot of each kept row within its expert: rows arrive by source then expert, so
        # a stable sort by expert keeps source (then token) order.
        slot = torch.full((n,), -1, dtype=torch.int64)
        kept_idx = torch.nonzero(kept).reshape(-1)
        by_exp = kept_idx[torch.argsort(row_exp[kept_idx], stable=True)]
        recv_count = torch.bincount(row_exp[kept_idx], minlength=L)
        starts = torch.cumsum(recv_count, 0) - recv_count
        slot[by_exp] = torch.arange(by_exp.numel()) - starts[row_exp[by_exp]]
        filled = [torch.empty(L, R * M, hidden, dtype=parts[0].dtype, device=dev)]
        if len(parts) > 1:  # fp8 scales: column-major per expert, as upstream lays them out
            filled.append(torch.empty(L, parts[1].shape[1], R * M, dtype=parts[1].dtype,
                                      device=dev).transpose(1, 2))
        every = kept_idx.numel() == n
        exp_d, slot_d = row_exp[kept_idx].to(dev), slot[kept_idx].to(dev)
        for part, offset, out in zip(parts, offsets, filled):
            rows = _part_of(recv_buf, offset, part)
            out[exp_d, slot_d] = rows if every else rows[kept_idx.to(dev)]
        tokens = recv_buf[:, payload:].contiguous().view(torch.int64).reshape(n).cpu()
        src_info = torch.full((L, R * M), -1, dtype=torch.int32)
        src_info[row_exp[kept_idx], slot[kept_idx]] = tokens[kept_idx].to(torch.int32)
        counts = recv_counts.t() * src_kept.to(torch.int64)  # [L, R], rows kept per source
        begins = torch.cumsum(counts, 1) - counts
        layout_range = (begins << 32) | counts
        route = SimpleNamespace(send_pos=send_pos, send_rows=send_rows,
                                recv_rows=recv_counts.sum(1), recv_expert=row_exp,
                                recv_slot=slot, num_tokens=x.shape[0], dtype=x.dtype,
                                device=dev)
        handle = _Handle((src_info.to(dev), layout_range.to(dev), M, hidden, num_experts),
                         route)
        return filled, recv_count.to(dev, torch.int32), handle

    def combine(self, x, topk_idx, topk_weights, active_ranks, timeout_us, handle,
                zero_copy=False, async_finish=False, return_recv_hook=False, out=None):
        """Returns each token's rows to its rank, weighted and summed.

        ``x``: the experts' outputs in ``recv_x``'s layout [L, R*M, hidden] (with
        ``zero_copy``, ``get_next_combine_buffer(handle)`` is read instead). Returns
        ``(combined_x, event, hook)``; ``combined_x`` [tokens, hidden] of the outputs'
        dtype (written into ``out`` when given) is the sum over the surviving choices
        (module docstring).
        """
        pg._drain(self.group)
        R = self.num_ranks
        route = _route_of(handle)
        if zero_copy:
            x = self._next_combine
            if x is None or x.dtype != route.dtype:
                raise ValueError("zero_copy reads get_next_combine_buffer(handle): call it "
                                 "and fill it first")
        shape = (handle[0].shape[0], handle[0].shape[1], handle[3])
        if not isinstance(x, torch.Tensor) or x.shape != shape:
            raise ValueError(f"x must be a tensor shaped as dispatch's recv_x, {list(shape)}")
        if not x.is_floating_point() or x.dtype == _FP8:
            raise ValueError(f"x must hold the experts' outputs in a floating type other "
                             f"than fp8, not {x.dtype}")
        _check_device("x", x)
        dev = x.device
        tokens = route.num_tokens
        if not isinstance(topk_idx, torch.Tensor) or not isinstance(topk_weights, torch.Tensor) \
                or topk_idx.dim() != 2 or topk_idx.shape[0] != tokens \
                or topk_weights.shape != topk_idx.shape:
            raise ValueError("topk_idx and topk_weights must be [tokens, k] as dispatched")
        _check_mask(active_ranks, R, dev)
        _check_timeout(timeout_us)
        if out is not None and (not isinstance(out, torch.Tensor)
                                or out.shape != (tokens, shape[2])):
            raise ValueError(f"out must be a tensor [{tokens}, {shape[2]}]")
        k = topk_idx.shape[1]
        slot = route.recv_slot
        kept = slot >= 0
        send_buf = x[route.recv_expert.to(dev), slot.clamp(min=0).to(dev)]
        if not bool(kept.all()):
            send_buf[(~kept).to(dev)] = 0  # rows of a masked source go back empty
        # Rows from ranks dropped meanwhile stay unwritten; they are masked out below.
        recv_buf = torch.empty(route.send_pos.numel(), shape[2], dtype=x.dtype, device=dev)
        for _ in self._attempts():
            try:
                self._exchange(send_buf, route.recv_rows, recv_buf, route.send_rows,
                               active_ranks, timeout_us)
            except _Retry:
                continue
            break
        else:
            raise RuntimeError("combine: membership kept changing")
        dest = torch.repeat_interleave(torch.arange(R), route.send_rows)
        use = _mask(active_ranks, R)[dest]
        pos, rows = route.send_pos, recv_buf
        if not bool(use.all()):
            pos, rows = pos[use], rows[use.to(dev)]
        pos = pos.to(dev)
        weights = topk_weights.reshape(-1).to(dev)[pos].to(torch.float32).reshape(-1, 1)
        acc = torch.zeros(tokens, shape[2], dtype=torch.float32, device=dev)
        acc.index_add_(0, pos // k, rows.to(torch.float32) * weights)
        combined = acc.to(x.dtype)
        if out is not None:
            out.copy_(combined)
            combined = out
        event = EventOverlap(None, (x, topk_idx, topk_weights, handle[0], handle[1], combined)
                             if async_finish else None)
        hook = (lambda: None) if return_recv_hook else None
        return combined, event, hook


class _Retry(Exception):
    """An exchange failed and the survivors reconciled: redo the call among them."""
