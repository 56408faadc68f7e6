"""Torch-facing helper for host memory shared by the ranks of a group on one machine.

When every rank of a tensor-parallel group keeps the same KV blocks (MLA, for example),
offloading them per rank stores one copy per rank. ``create_shared_segment`` instead
allocates the memory once, in ``owner_rank``, maps it into every rank of the group and
hands out tensors that view it:

    from mooncake.shared_segment import create_shared_segment

    seg = create_shared_segment(
        "offload_kv",
        blocks={
            "k": dict(count=num_layers, shape=k_shape, dtype=torch.bfloat16),
            "v": dict(count=num_layers, shape=v_shape, dtype=torch.bfloat16),
        },
        world_size=tp_size,
        rank_id=tp_rank,
        comm_group=tp_group,      # a gloo group, or a vLLM GroupCoordinator
    )
    k_views = seg.tensors("k")    # CPU tensors over the shared pages

Built on ``mooncake.engine.SharedSegment`` (its two phases, create() and complete(),
wrap an all-gather over ``comm_group``). The byte layout is the one upstream Mooncake
uses, so ranks agree on it: blocks sorted by name, each entry padded to 4 KiB, entry
``i`` of every block grouped together. This build shares memory through POSIX shared
memory only; the device paths (``mmap=False`` VMM, ``host_register=True``) are reported
as unsupported by ``shared_segment_supported`` and refused by ``create_shared_segment``.
"""

from __future__ import annotations

import ctypes
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

try:
    import torch
    import torch.distributed as dist
except ImportError as _exc:  # pragma: no cover - depends on the environment
    raise ImportError(
        "mooncake.shared_segment needs PyTorch (pip install torch); the engine-level "
        "mooncake.engine.SharedSegment works without it"
    ) from _exc

# The class that mooncake.engine exports; imported from its own module so that this
# helper does not have to load libmooncake.so.
from ._shared_segment import SharedSegment as _EngineSegment

__all__ = [
    "SharedSegment",
    "SharedSegmentError",
    "create_shared_segment",
    "shared_segment_supported",
]

# Every entry starts on a page boundary (upstream's value: peers must agree on it).
_ALIGN = 4096

# Failures while creating or mapping that every rank must hear about, so that no rank
# is left waiting in the next collective.
_LOCAL_FAILURES = (RuntimeError, TypeError, ValueError, OSError)


class SharedSegmentError(RuntimeError):
    """A shared segment could not be declared, created, mapped or viewed."""


# --------------------------------------------------------------------------- public API


def create_shared_segment(
    name: str,
    blocks: Mapping[str, Mapping[str, Any]],
    world_size: int,
    rank_id: int,
    owner_rank: int = 0,
    device_id: int | None = None,
    comm_group: Any = None,
    mmap: bool = True,
    host_register: bool = False,
    *,
    tp_group: Any = None,
) -> SharedSegment:
    """Collectively creates one shared segment and returns this rank's handle.

    Every rank of the group calls this with the same ``name`` and ``blocks``; each entry
    of ``blocks`` maps a block name to ``count``, ``shape`` and ``dtype``. A rank whose
    declaration differs makes every rank raise ``SharedSegmentError``, as does a failure
    on any one rank. ``comm_group`` (a gloo process group, or an object with a
    ``cpu_group`` attribute such as vLLM's GroupCoordinator) carries the exchange and may
    be left out only when ``world_size`` is 1; ``tp_group`` is an older name for it.
    ``device_id`` is recorded only (this build maps no device memory).
    """
    comm_group = _select_comm_group(comm_group, tp_group)
    _require_supported(mmap, host_register)
    _require_group(world_size, comm_group)

    segment, blob, layout, error = None, b"", None, ""
    try:
        layout = _Layout.from_blocks(blocks)
        segment, blob = _EngineSegment.create(
            f"{name}|{layout.tag}", layout.total, world_size, rank_id, owner_rank,
            _device_index(device_id), mmap, host_register)
    except (SharedSegmentError, *_LOCAL_FAILURES) as exc:
        # Reported through the collective below rather than raised here: peers whose
        # part succeeded would otherwise wait for this rank forever.
        error = str(exc)
    _agree_or_discard(segment, error, world_size, rank_id, comm_group, "create")

    error = ""
    try:
        blobs = [blob] if world_size == 1 else _all_gather_bytes(blob, world_size, comm_group)
        segment.complete(blobs)
    except (SharedSegmentError, *_LOCAL_FAILURES) as exc:
        error = str(exc)
    _agree_or_discard(segment, error, world_size, rank_id, comm_group, "complete")
    return SharedSegment(segment, layout, device_id)


def shared_segment_supported(mmap: bool = True, host_register: bool = False) -> bool:
    """Whether this build can create a segment with these options (POSIX shm only)."""
    return bool(_EngineSegment.supported(mmap, host_register))


class SharedSegment:
    """This rank's mapping of a shared segment; made by ``create_shared_segment``.

    The memory stays mapped while this object or any tensor from ``tensors()`` (or a
    view of one) is alive.
    """

    def __init__(self, segment: Any, layout: _Layout, device_id: int | None = None) -> None:
        self._segment = segment
        self._layout = layout
        self._device_id = device_id

    def tensors(self, block: str) -> list[torch.Tensor]:
        """CPU tensors over every entry of ``block``, in index order (no copies)."""
        spec = self._layout.specs.get(block)
        if spec is None:
            known = ", ".join(sorted(self._layout.specs))
            raise SharedSegmentError(f"Unknown shared segment block {block!r} (have: {known})")
        if int(self._segment.device_addr()):
            # The engine never maps device memory in this build; refuse rather than hand
            # out CPU tensors over an address the caller expects on a device.
            raise SharedSegmentError("Device-mapped shared segments are not supported")
        base = int(self._segment.base_addr())
        return [self._host_view(base + self._layout.entry_offset(block, index), spec)
                for index in range(spec.count)]

    def base_addr(self) -> int:
        """Address of the segment in this process (ranks may differ)."""
        return self._segment.base_addr()

    def total_size(self) -> int:
        """Bytes the layout spans: the per-entry stride times the largest count."""
        return self._segment.size()

    def _host_view(self, addr: int, spec: _BlockSpec) -> torch.Tensor:
        buffer = (ctypes.c_uint8 * spec.nbytes).from_address(addr)
        # torch.frombuffer keeps ``buffer`` alive for the storage's lifetime, and the
        # buffer keeps this handle (and so the mapping) alive: slices and views taken
        # from the tensor stay valid even after the handle itself is dropped.
        buffer._mooncake_segment = self
        view = torch.frombuffer(buffer, dtype=spec.dtype).view(spec.shape)
        view._mooncake_segment = self  # as upstream's tensors carry it
        return view


# ------------------------------------------------------------------------------ layout


@dataclass(frozen=True)
class _BlockSpec:
    count: int
    shape: tuple[int, ...]
    dtype: torch.dtype
    nbytes: int

    def tag(self, name: str) -> str:
        # Upstream's wording exactly: it ends up in the segment fingerprint.
        dims = "x".join(str(dim) for dim in self.shape)
        return f"{name}:{self.count}:{dims}:{self.dtype}:{self.nbytes}"


@dataclass(frozen=True)
class _Layout:
    specs: dict[str, _BlockSpec]
    offsets: dict[str, int]
    stride: int
    total: int
    tag: str

    @classmethod
    def from_blocks(cls, blocks: Mapping[str, Mapping[str, Any]]) -> _Layout:
        if not isinstance(blocks, Mapping):
            raise SharedSegmentError("blocks must map block names to count/shape/dtype")
        # Sorted, so that dict order on each rank cannot change the layout.
        names = sorted(blocks)
        if not names:
            raise SharedSegmentError("Shared segment needs at least one block")
        specs = {name: _parse_block(name, blocks[name]) for name in names}
        offsets, stride = {}, 0
        for name in names:
            offsets[name] = stride
            stride += _align_up(specs[name].nbytes)
        total = stride * max(spec.count for spec in specs.values())
        # The tag joins the segment name, so peers that disagree on any block are caught
        # by the engine's fingerprint check.
        tag = ";".join(specs[name].tag(name) for name in names)
        return cls(specs, offsets, stride, total, tag)

    def entry_offset(self, block: str, index: int) -> int:
        return self.offsets[block] + index * self.stride


def _align_up(value: int, alignment: int = _ALIGN) -> int:
    return -(-value // alignment) * alignment


def _parse_block(name: Any, spec: Any) -> _BlockSpec:
    if not isinstance(name, str):
        raise SharedSegmentError(f"Block names must be strings, got {name!r}")
    try:
        count = int(spec["count"])
        shape = tuple(int(dim) for dim in spec["shape"])
        dtype = spec["dtype"]
    except (KeyError, TypeError, ValueError) as exc:
        raise SharedSegmentError(
            f"Block {name!r} needs an integer count, a shape of integers and a dtype"
        ) from exc
    if count <= 0:
        raise SharedSegmentError(f"Block {name!r} needs a positive count, got {count}")
    if not shape or any(dim <= 0 for dim in shape):
        raise SharedSegmentError(f"Block {name!r} needs a non-empty positive shape, got {shape}")
    if not isinstance(dtype, torch.dtype):
        raise SharedSegmentError(f"Block {name!r} needs a torch.dtype, got {dtype!r}")
    nbytes = torch.empty((), dtype=dtype).element_size()
    for dim in shape:
        nbytes *= dim
    return _BlockSpec(count, shape, dtype, nbytes)


# --------------------------------------------------------------------- option checks


def _require_supported(mmap: bool, host_register: bool) -> None:
    if host_register and not mmap:
        raise SharedSegmentError("host_register=True requires mmap=True")
    if shared_segment_supported(mmap=mmap, host_register=host_register):
        return
    if not mmap:
        raise SharedSegmentError(
            "mmap=False (device VMM shared segments) is not supported by this mooncake "
            "build; it shares host memory through POSIX shm (mmap=True) only")
    if host_register:
        raise SharedSegmentError(
            "host_register=True (registering the pages with an Ascend device) is not "
            "supported by this mooncake build")
    raise SharedSegmentError("This mooncake build cannot create shared segments")


def _require_group(world_size: Any, comm_group: Any) -> None:
    # Checked before any collective: the exchange itself depends on both.
    if isinstance(world_size, bool) or not isinstance(world_size, int) or world_size < 1:
        raise SharedSegmentError(f"world_size must be a positive int, got {world_size!r}")
    if world_size == 1:
        return
    if comm_group is None:
        raise SharedSegmentError("comm_group is required when world_size > 1")
    if not dist.is_available():
        raise SharedSegmentError(
            "world_size > 1 needs torch.distributed, which this torch build lacks")


def _select_comm_group(comm_group: Any, tp_group: Any) -> Any:
    """Accepts the older ``tp_group`` keyword unless it contradicts ``comm_group``."""
    if tp_group is None:
        return comm_group
    if comm_group is None or comm_group is tp_group:
        return tp_group
    raise SharedSegmentError(
        "Pass the group once, as comm_group (tp_group is an older name for it)")


def _device_index(device_id: int | None) -> int:
    """The device to record; only asks torch when an accelerator is actually present."""
    if device_id is not None:
        return int(device_id)
    accelerator = getattr(torch, "accelerator", None)
    try:
        if accelerator is not None and accelerator.is_available():
            return int(accelerator.current_device_index())
    except (RuntimeError, AttributeError):
        pass
    return 0


# ------------------------------------------------------------------------ collectives


def _cpu_group(comm_group: Any) -> Any:
    # Blobs travel as CPU tensors, so use a coordinator's gloo group when it has one.
    cpu_group = getattr(comm_group, "cpu_group", None)
    return comm_group if cpu_group is None else cpu_group


def _agree_or_discard(segment: Any, error: str, world_size: int, rank_id: int,
                      comm_group: Any, phase: str) -> None:
    """``_raise_if_any_rank_failed``, releasing this rank's part when it raises.

    No tensor views exist yet, so closing is safe; it frees the memory (and the owner's
    shm name) now rather than whenever the exception's traceback is dropped.
    """
    try:
        _raise_if_any_rank_failed(error, world_size, rank_id, comm_group, phase)
    except Exception:
        if segment is not None:
            segment.close()
        raise


def _raise_if_any_rank_failed(
    error: str, world_size: int, rank_id: int, comm_group: Any, phase: str
) -> None:
    """Every rank leaves a phase the same way: all succeed, or all raise the same error."""
    if world_size == 1:
        if error:
            raise SharedSegmentError(error)
        return
    mine = f"rank {rank_id}: {error}".encode() if error else b""
    reports = _all_gather_bytes(mine, world_size, comm_group)
    failures = [report.decode(errors="replace") for report in reports if report]
    if failures:
        raise SharedSegmentError(f"Shared segment {phase} failed: {'; '.join(failures)}")


def _all_gather_bytes(data: bytes, world_size: int, comm_group: Any) -> list[bytes]:
    """All-gathers byte strings of any length as uint8 tensors, indexed by group rank.

    Plain tensor collectives rather than all_gather_object: that one needs numpy (and
    unpickles what peers send).
    """
    group = _cpu_group(comm_group)
    lengths = [torch.zeros(1, dtype=torch.int64) for _ in range(world_size)]
    dist.all_gather(lengths, torch.tensor([len(data)], dtype=torch.int64), group=group)
    sizes = [int(length.item()) for length in lengths]
    # Padded to the longest, since all_gather wants equal shapes; never empty.
    local = torch.zeros(max(max(sizes), 1), dtype=torch.uint8)
    local[:len(data)] = torch.tensor(list(data), dtype=torch.uint8)
    gathered = [torch.empty_like(local) for _ in range(world_size)]
    dist.all_gather(gathered, local, group=group)
    return [bytes(tensor[:size].tolist()) for tensor, size in zip(gathered, sizes)]
