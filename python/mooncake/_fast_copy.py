"""``concat_arrays_into``: copy a run of numpy arrays back to back into raw memory.

Upstream ships this as a C extension; here it is ctypes.memmove, which releases the GIL
while it copies, so ``nthreads > 1`` splits the arrays among threads that copy at the
same time. Numpy is not imported here: an array is recognised through an already
imported numpy (no numpy, no ndarray to pass).
"""

import ctypes
import sys
import threading

__all__ = ["concat_arrays_into"]


def _sources(arrays, start, count):
    """[(address, nbytes)] of arrays[start:start+count]; TypeError/ValueError naming the
    first unusable one."""
    np = sys.modules.get("numpy")
    out = []
    for i in range(start, start + count):
        arr = arrays[i]
        if np is None or not isinstance(arr, np.ndarray):
            raise TypeError(f"arrays[{i}] is not an ndarray")
        if not arr.flags["C_CONTIGUOUS"]:
            raise ValueError(f"arrays[{i}] is not C-contiguous")
        out.append((arr.ctypes.data, int(arr.nbytes)))
    return out


def _copy_run(sources, dest):
    offset = 0
    for address, nbytes in sources:
        if nbytes:
            ctypes.memmove(dest + offset, address, nbytes)
            offset += nbytes


def concat_arrays_into(arrays, dest_ptr, dest_size, start=0, count=-1, nthreads=1):
    """Copies ``arrays[start:start+count]`` (a list of C-contiguous ndarrays; ``count``
    < 0 or past the end: to the end) one after another to ``dest_ptr``; returns the bytes
    copied. ValueError when they need more than ``dest_size`` bytes (nothing copied)."""
    if not isinstance(arrays, list):
        raise TypeError(f"arrays: expected a list, got {type(arrays).__name__}")
    for name, value in (("dest_ptr", dest_ptr), ("dest_size", dest_size), ("start", start),
                        ("count", count), ("nthreads", nthreads)):
        if isinstance(value, bool) or not isinstance(value, int):
            raise TypeError(f"{name}: expected an int, got {type(value).__name__}")
    start = min(max(start, 0), len(arrays))
    if count < 0 or start + count > len(arrays):
        count = len(arrays) - start
    if count == 0:
        return 0
    sources = _sources(arrays, start, count)
    total = sum(n for _, n in sources)
    if total > dest_size:
        raise ValueError(f"destination buffer too small: need {total} bytes, got {dest_size}")
    nthreads = max(1, min(nthreads, count))
    per_thread = -(-count // nthreads)
    runs, offset = [], 0
    for first in range(0, count, per_thread):
        run = sources[first:first + per_thread]
        runs.append((run, dest_ptr + offset))
        offset += sum(n for _, n in run)
    workers = [threading.Thread(target=_copy_run, args=run) for run in runs[1:]]
    for w in workers:
        w.start()
    _copy_run(*runs[0])
    for w in workers:
        w.join()
    return total
