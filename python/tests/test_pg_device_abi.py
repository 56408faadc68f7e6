"""Mooncake PG's C ABI with device memory, without torch: what the ``mooncake`` backend
does with a CUDA tensor's ``data_ptr()``, on the fake CUDA driver
(tests/emu/fake_cuda.c: device memory the CPU cannot touch). ``set_memory("cuda:N")``
then an all_reduce over device addresses, one copy in and one out per rank; a
``memory()`` block holding the handle against other threads' settings; and device
memory handed to the host path refused by the library.
"""

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

_FAKE_DEVICE = r"""
import ctypes, os, threading
from mooncake import pg

fake = ctypes.CDLL(os.environ["MC_CUDA_LIB"])
fake.fake_cuda_copies.restype = ctypes.c_ulong
assert fake.cuInit(0) == 0

def on_device(dev):
    ctx = ctypes.c_void_p()
    assert fake.cuDevicePrimaryCtxRetain(ctypes.byref(ctx), dev) == 0
    assert fake.cuCtxSetCurrent(ctx) == 0

def alloc(values):
    p = ctypes.c_uint64()
    src = (ctypes.c_int32 * len(values))(*values)
    assert fake.cuMemAlloc_v2(ctypes.byref(p), ctypes.sizeof(src)) == 0
    assert fake.cuMemcpyHtoD_v2(p, src, ctypes.sizeof(src)) == 0
    return p.value

def read(p, n):
    out = (ctypes.c_int32 * n)()
    assert fake.cuMemcpyDtoH_v2(out, ctypes.c_uint64(p), ctypes.sizeof(out)) == 0
    return list(out)

world, n = 2, 20000
handles = [pg.ProcessGroupHandle(r, world, pg.MooncakeBackendOptions(timeout_ms=20000))
           for r in range(world)]
for h in handles:
    h.connect([handles[r].address() for r in range(world)])
for bad in ("gpu:0", "cuda:x", "cuda:9"):
    try:
        handles[0].set_memory(bad)
        raise AssertionError(f"{bad} accepted")
    except ValueError as e:
        assert "invalid" in str(e).lower(), e
results, errors, pointers = [None] * world, [], [None] * world

def rank(r):
    try:
        on_device(r)
        p = pointers[r] = alloc([r * 1000 + i for i in range(n)])
        h = handles[r]
        with h.memory(f"cuda:{r}"):
            h.all_reduce(p, n, pg.DTYPE_I32, pg.OP_SUM)
        results[r] = read(p, n)
    except Exception as e:  # reported below, on the main thread
        errors.append(e)

before = fake.fake_cuda_copies()
threads = [threading.Thread(target=rank, args=(r,)) for r in range(world)]
for t in threads:
    t.start()
for t in threads:
    t.join(60)
assert not errors, errors
want = [1000 + 2 * i for i in range(n)]
assert results == [want, want], "device all_reduce"
# per rank: the test's own write and read, and the library's one copy in and one out
assert fake.fake_cuda_copies() - before == world * 4, fake.fake_cuda_copies() - before

# The setting is the handle's: a memory() block keeps other threads' settings out.
h = handles[0]
inside, release, tried = threading.Event(), threading.Event(), []

def holder():
    with h.memory("cuda:0"):
        inside.set()
        release.wait(30)

t = threading.Thread(target=holder)
t.start()
assert inside.wait(30)
other = threading.Thread(target=lambda: tried.append(h._lock.acquire(blocking=False)))
other.start()
other.join(30)
release.set()
t.join(30)
assert tried == [False], tried

# Device memory on the host path (a setting switched by another thread, say) is refused
# by the library before the CPU touches it (the fake would fault), and left as it was.
on_device(0)
h.set_memory("cpu:0")
try:
    h.all_reduce(pointers[0], n, pg.DTYPE_I32, pg.OP_SUM)
    raise AssertionError("device memory taken as host memory")
except pg.MooncakeCollectiveError as e:
    assert "invalid" in str(e).lower(), e
assert read(pointers[0], n) == want
for h in handles:
    h.close()
print("fake device ok", flush=True)
"""


def test_device_memory_through_the_c_abi_with_the_fake_cuda_driver(tmp_path):
    """The script above in a fresh process, its driver pointed at the fake (drivers
    load once per process)."""
    cc = shutil.which("cc")
    if cc is None:
        pytest.skip("no C compiler (cc) to build the fake CUDA driver")
    src = Path(__file__).resolve().parents[2] / "tests" / "emu" / "fake_cuda.c"
    lib = tmp_path / "libfake_cuda.so"
    subprocess.run([cc, "-O1", "-shared", "-fPIC", "-o", str(lib), str(src), "-lpthread"],
                   check=True, timeout=120)
    env = dict(os.environ, MC_CUDA_LIB=str(lib))
    out = subprocess.run([sys.executable, "-c", _FAKE_DEVICE], env=env, capture_output=True,
                         text=True, timeout=120)
    assert out.returncode == 0 and "fake device ok" in out.stdout, out.stdout + out.stderr
