"""``mooncake.shared_segment`` (torch helper over SharedSegment) and
``mooncake.fabric_allocator_utils``.

Fabric utils run against libc (no build needed). The shared-segment tests need torch:
one process for the layout, views, lifetimes and refused declarations/options; two rank
processes (gloo over a FileStore in tmp_path) for one segment really shared, a declaration
mismatch and a bad spec on one rank, where both ranks must raise instead of hanging.
Every rank process is waited for with a deadline and killed at the end of its test.
"""

import ctypes
import ctypes.util
import gc
import hashlib
import inspect
import json
import logging
import os
import subprocess
import sys
import weakref

import pytest

from mooncake import fabric_allocator_utils as fau

STEP = 120  # seconds: bound on one rank process (torch import + gloo setup + the test)
PAGE = 4096


# ------------------------------------------------------------------------ fabric utils


def _libc():
    path = ctypes.util.find_library("c")
    if path is None:
        pytest.skip("no libc found by ctypes.util")
    return path


def test_fabric_public_api():
    assert inspect.signature(fau.get_mooncake_so_path).parameters.keys() == {
        "so_name", "import_error_message"}
    assert list(inspect.signature(fau.probe_allocator_backend).parameters) == [
        "so_path", "probe_symbol", "restype", "unsupported_value"]
    assert isinstance(fau.logger, logging.Logger)


def test_missing_library_raises_import_error_with_callers_message():
    message = "install the allocator extra to use this backend"
    with pytest.raises(ImportError) as info:
        fau.get_mooncake_so_path("libdefinitely_not_shipped_here.so", message)
    assert str(info.value) == message


def test_library_path_is_found_inside_the_package():
    import mooncake

    found = fau.get_mooncake_so_path("__init__.py", "not found")
    assert os.path.samefile(found, mooncake.__file__)


def test_probe_calls_the_symbol_with_zero():
    # sysconf(0) is sysconf(_SC_ARG_MAX) on Linux: a value only a real call produces.
    if os.sysconf_names.get("SC_ARG_MAX") != 0:
        pytest.skip("_SC_ARG_MAX is not 0 on this platform")
    got = fau.probe_allocator_backend(_libc(), "sysconf", ctypes.c_long, -1)
    assert got == os.sysconf("SC_ARG_MAX")
    assert fau.probe_allocator_backend(_libc(), "abs", ctypes.c_int, -1) == 0


def test_probe_of_a_library_without_the_symbol_is_unsupported(caplog):
    with caplog.at_level(logging.WARNING, logger=fau.logger.name):
        got = fau.probe_allocator_backend(_libc(), "mooncake_no_such_probe", ctypes.c_int,
                                          "unsupported")
    assert got == "unsupported"
    assert "mooncake_no_such_probe" in caplog.text


def test_probe_of_an_unloadable_library_is_unsupported(tmp_path, caplog):
    not_elf = tmp_path / "libbroken.so"
    not_elf.write_bytes(b"not a shared object")
    with caplog.at_level(logging.WARNING, logger=fau.logger.name):
        assert fau.probe_allocator_backend(str(not_elf), "abs", ctypes.c_int, -7) == -7
        assert fau.probe_allocator_backend(str(tmp_path / "absent.so"), "abs", ctypes.c_int,
                                           None) is None
    assert "libbroken.so" in caplog.text


# ------------------------------------------------------------------- shared segment, 1 rank


@pytest.fixture
def torch():
    return pytest.importorskip("torch", reason="torch is not installed")


@pytest.fixture
def ss(torch):
    from mooncake import shared_segment

    return shared_segment


def _blocks(torch):
    # Unsorted on purpose: the layout must sort by name.
    return {
        "v": dict(count=2, shape=(3,), dtype=torch.float32),
        "k": dict(count=3, shape=(5, 7), dtype=torch.bfloat16),
        "big": dict(count=1, shape=[2, PAGE], dtype=torch.uint8),
    }


def _expected_layout(torch, blocks):
    """(offset of every entry by block, total size), computed independently."""
    names = sorted(blocks)
    sizes = {}
    for name in names:
        spec = blocks[name]
        nbytes = torch.empty((), dtype=spec["dtype"]).element_size()
        for dim in spec["shape"]:
            nbytes *= dim
        sizes[name] = -(-nbytes // PAGE) * PAGE
    stride = sum(sizes.values())
    offsets, start = {}, 0
    for name in names:
        offsets[name] = [start + i * stride for i in range(blocks[name]["count"])]
        start += sizes[name]
    return offsets, stride * max(spec["count"] for spec in blocks.values())


def _shm_names_of(pids):
    """Names in /dev/shm of the segments these processes own (the engine's naming)."""
    prefixes = tuple(f"mcss_{pid}_" for pid in pids)
    return {name for name in os.listdir("/dev/shm") if name.startswith(prefixes)}


def _my_shm_names():
    return _shm_names_of([os.getpid()])


def test_shared_segment_public_api(ss):
    assert sorted(ss.__all__) == ["SharedSegment", "SharedSegmentError",
                                  "create_shared_segment", "shared_segment_supported"]
    assert issubclass(ss.SharedSegmentError, RuntimeError)
    params = inspect.signature(ss.create_shared_segment).parameters
    assert list(params) == ["name", "blocks", "world_size", "rank_id", "owner_rank",
                            "device_id", "comm_group", "mmap", "host_register", "tp_group"]
    assert [params[p].default for p in ("owner_rank", "device_id", "comm_group", "mmap",
                                        "host_register", "tp_group")] == [
        0, None, None, True, False, None]
    assert params["tp_group"].kind is inspect.Parameter.KEYWORD_ONLY


def test_single_rank_layout_and_views(ss, torch):
    blocks = _blocks(torch)
    seg = ss.create_shared_segment("single", blocks, world_size=1, rank_id=0)
    offsets, total = _expected_layout(torch, blocks)
    assert seg.total_size() == total
    base = seg.base_addr()
    for name, spec in blocks.items():
        views = seg.tensors(name)
        assert [v.data_ptr() - base for v in views] == offsets[name]
        for view in views:
            assert view.device.type == "cpu"
            assert view.dtype is spec["dtype"] and tuple(view.shape) == tuple(spec["shape"])
            assert view.is_contiguous()
    # Written through one call's views, seen by the next call's and at the raw address.
    first = seg.tensors("v")[1]
    first.copy_(torch.tensor([1.5, -2.0, 3.25]))
    assert seg.tensors("v")[1].tolist() == [1.5, -2.0, 3.25]
    raw = ctypes.string_at(base + offsets["v"][1], 12)
    assert raw == bytes(first.view(torch.uint8).flatten().tolist())


def test_views_keep_the_mapping_alive_and_release_it_after(ss, torch):
    before = _my_shm_names()
    seg = ss.create_shared_segment("lifetime", _blocks(torch), world_size=1, rank_id=0)
    (mine,) = _my_shm_names() - before
    tail = seg.tensors("k")[2][1:]  # a view of a view: carries no attribute of its own
    handle = weakref.ref(seg)
    del seg
    gc.collect()
    assert handle() is not None
    tail.fill_(4.0)
    assert float(tail.sum()) == 4.0 * tail.numel()
    del tail
    gc.collect()
    assert handle() is None
    assert mine not in _my_shm_names()  # the owner removed its shm name


def test_a_failed_create_releases_the_memory_at_once(ss, torch, monkeypatch):
    def fail(self, blobs):
        raise RuntimeError("mapping refused")

    monkeypatch.setattr(ss._EngineSegment, "complete", fail)
    before = _my_shm_names()
    with pytest.raises(ss.SharedSegmentError, match="mapping refused") as info:
        ss.create_shared_segment("failing", _blocks(torch), world_size=1, rank_id=0)
    # Freed although the exception (and its traceback) is still held.
    assert info.value is not None
    assert not _my_shm_names() - before


def test_unknown_block(ss, torch):
    seg = ss.create_shared_segment("unknown", _blocks(torch), world_size=1, rank_id=0)
    with pytest.raises(ss.SharedSegmentError, match="'q'"):
        seg.tensors("q")


@pytest.mark.parametrize("spec, match", [
    (dict(count=1, shape=(4,)), "needs an integer count"),
    (dict(shape=(4,), dtype="f32"), "needs an integer count"),
    (dict(count="many", shape=(4,), dtype=None), "needs an integer count"),
    (dict(count=1, shape=4, dtype=None), "needs an integer count"),
    (dict(count=0, shape=(4,), dtype=None), "positive count"),
    (dict(count=1, shape=(), dtype=None), "positive shape"),
    (dict(count=1, shape=(4, 0), dtype=None), "positive shape"),
    (dict(count=1, shape=(4, -2), dtype=None), "positive shape"),
    (dict(count=1, shape=(4,), dtype="float32"), "torch.dtype"),
    ((1, (4,), None), "needs an integer count"),
])
def test_bad_block_specs_are_refused(ss, torch, spec, match):
    if isinstance(spec, dict) and "dtype" in spec and spec["dtype"] is None:
        spec = dict(spec, dtype=torch.float16)
    before = _my_shm_names()
    with pytest.raises(ss.SharedSegmentError, match=match) as info:
        ss.create_shared_segment("bad", {"blk": spec}, world_size=1, rank_id=0)
    assert "'blk'" in str(info.value)
    assert not _my_shm_names() - before  # nothing was allocated


@pytest.mark.parametrize("blocks, match", [
    ({}, "at least one block"),
    ([("k", {})], "blocks must map"),
])
def test_bad_block_tables_are_refused(ss, blocks, match):
    with pytest.raises(ss.SharedSegmentError, match=match):
        ss.create_shared_segment("bad", blocks, world_size=1, rank_id=0)


def test_unsupported_options(ss, torch):
    assert ss.shared_segment_supported() is True
    assert ss.shared_segment_supported(mmap=False) is False
    assert ss.shared_segment_supported(mmap=True, host_register=True) is False
    blocks = _blocks(torch)
    with pytest.raises(ss.SharedSegmentError, match="mmap=False"):
        ss.create_shared_segment("vmm", blocks, 1, 0, mmap=False)
    with pytest.raises(ss.SharedSegmentError, match="host_register=True"):
        ss.create_shared_segment("reg", blocks, 1, 0, host_register=True)
    with pytest.raises(ss.SharedSegmentError, match="requires mmap=True"):
        ss.create_shared_segment("both", blocks, 1, 0, mmap=False, host_register=True)


def test_group_arguments(ss, torch):
    blocks = _blocks(torch)
    # Refused before any collective, so these return instead of waiting for peers.
    with pytest.raises(ss.SharedSegmentError, match="comm_group is required"):
        ss.create_shared_segment("nogroup", blocks, world_size=2, rank_id=0)
    with pytest.raises(ss.SharedSegmentError, match="world_size"):
        ss.create_shared_segment("zero", blocks, world_size=0, rank_id=0)
    with pytest.raises(ss.SharedSegmentError, match="comm_group"):
        ss.create_shared_segment("twice", blocks, 1, 0, comm_group=object(),
                                 tp_group=object())
    with pytest.raises(ss.SharedSegmentError, match="rank"):
        ss.create_shared_segment("range", blocks, world_size=1, rank_id=1)
    # The older keyword alone is accepted.
    seg = ss.create_shared_segment("alias", blocks, world_size=1, rank_id=0, tp_group=object())
    assert seg.total_size() == _expected_layout(torch, blocks)[1]


# ------------------------------------------------------------------ shared segment, 2 ranks

_RANK_SCRIPT = r"""
import datetime, gc, hashlib, json, os, sys
import torch
import torch.distributed as dist
from mooncake.shared_segment import SharedSegmentError, create_shared_segment

rank, world = int(os.environ["SS_RANK"]), int(os.environ["SS_WORLD"])
scenario, owner = os.environ["SS_SCENARIO"], int(os.environ["SS_OWNER"])
store = dist.FileStore(os.environ["SS_STORE"], world)
dist.init_process_group("gloo", store=store, rank=rank, world_size=world,
                        timeout=datetime.timedelta(seconds=60))
group = dist.new_group(backend="gloo")

def report(**fields):
    print("RESULT " + json.dumps(fields), flush=True)

def digest(views):
    h = hashlib.sha256()
    for v in views:
        h.update(bytes(v.view(torch.uint8).flatten().tolist()))
    return h.hexdigest()

blocks = {"v": dict(count=2, shape=(3,), dtype=torch.float32),
          "k": dict(count=3, shape=(5, 7), dtype=torch.bfloat16)}
if scenario == "mismatch" and rank == 1:
    blocks["k"] = dict(count=3, shape=(7, 5), dtype=torch.bfloat16)
if scenario == "badspec" and rank == 1:
    blocks["v"] = dict(count=0, shape=(3,), dtype=torch.float32)

def finish():
    # Drop every view explicitly: objects still alive at interpreter exit are not
    # reliably finalized, and the owner's shm name goes only when its segment does.
    gc.collect()
    dist.destroy_process_group()

try:
    seg = create_shared_segment("pair", blocks, world_size=world, rank_id=rank,
                                owner_rank=owner, comm_group=group)
except SharedSegmentError as exc:
    error = str(exc)
else:
    error = None
if error is not None:
    report(error=error)
    finish()
    sys.exit(0)

def share(seg):
    # A function, so that no view outlives it in a module-level name.
    k, v = seg.tensors("k"), seg.tensors("v")
    layout = {name: [t.data_ptr() - seg.base_addr() for t in seg.tensors(name)]
              for name in blocks}
    if rank == owner:
        for i, t in enumerate(k):
            t.copy_(torch.arange(35, dtype=torch.float32).view(5, 7) * (i + 1) - 3)
    dist.barrier(group=group)
    seen_k = digest(k)
    if rank != owner:
        v[1].copy_(torch.tensor([0.5, 1.5, 2.5]))
    dist.barrier(group=group)
    return dict(layout=layout, total=seg.total_size(), k=seen_k, v1=v[1].tolist())

report(**share(seg))
dist.barrier(group=group)  # nobody unmaps before everyone has read
del seg
finish()
"""


def _gloo_env(tmp_path, rank, world, scenario, owner):
    env = dict(os.environ, SS_RANK=str(rank), SS_WORLD=str(world), SS_SCENARIO=scenario,
               SS_OWNER=str(owner), SS_STORE=str(tmp_path / "store"), OMP_NUM_THREADS="1")
    # Keep gloo on loopback whatever the host name resolves to.
    if "GLOO_SOCKET_IFNAME" not in env and os.path.exists("/sys/class/net/lo"):
        env["GLOO_SOCKET_IFNAME"] = "lo"
    env["PYTHONPATH"] = os.pathsep.join(p for p in sys.path if p)
    return env


def _run_ranks(tmp_path, scenario, owner=0, world=2):
    """Runs the rank script in ``world`` processes; returns each rank's RESULT fields."""
    procs = []
    try:
        for rank in range(world):
            procs.append(subprocess.Popen(
                [sys.executable, "-c", _RANK_SCRIPT],
                env=_gloo_env(tmp_path, rank, world, scenario, owner),
                stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                text=True))
        results = []
        for rank, proc in enumerate(procs):
            out, err = proc.communicate(timeout=STEP)
            assert proc.returncode == 0, f"rank {rank} exited {proc.returncode}:\n{err}"
            lines = [line for line in out.splitlines() if line.startswith("RESULT ")]
            assert len(lines) == 1, f"rank {rank} printed {out!r}\n{err}"
            results.append(json.loads(lines[0][len("RESULT "):]))
        # Success or failure, no rank may leave the owner's shm name behind.
        assert not _shm_names_of(proc.pid for proc in procs)
        return results
    finally:
        for proc in procs:
            if proc.poll() is None:
                proc.kill()
            proc.communicate(timeout=STEP)


@pytest.mark.parametrize("owner", [0, 1])
def test_two_ranks_share_one_segment(torch, tmp_path, owner):
    results = _run_ranks(tmp_path, "share", owner=owner)
    blocks = {"v": dict(count=2, shape=(3,), dtype=torch.float32),
              "k": dict(count=3, shape=(5, 7), dtype=torch.bfloat16)}
    offsets, total = _expected_layout(torch, blocks)
    expected_k = hashlib.sha256()
    for i in range(3):
        t = (torch.arange(35, dtype=torch.float32).view(5, 7) * (i + 1) - 3).to(torch.bfloat16)
        expected_k.update(bytes(t.view(torch.uint8).flatten().tolist()))
    for result in results:
        assert result["layout"] == offsets
        assert result["total"] == total
        # The non-owner read what the owner wrote, and the owner what the non-owner wrote.
        assert result["k"] == expected_k.hexdigest()
        assert result["v1"] == [0.5, 1.5, 2.5]


def test_ranks_that_disagree_on_the_layout_both_fail(torch, tmp_path):
    results = _run_ranks(tmp_path, "mismatch")
    for result in results:
        assert "error" in result, result
        assert "complete failed" in result["error"]
        assert "differs" in result["error"]


def test_a_bad_spec_on_one_rank_fails_every_rank(torch, tmp_path):
    results = _run_ranks(tmp_path, "badspec")
    for result in results:
        assert "error" in result, result
        assert "rank 1" in result["error"] and "positive count" in result["error"]
        assert "rank 0" not in result["error"]
