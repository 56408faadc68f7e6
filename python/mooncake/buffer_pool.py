"""``BufferPool``: leases of memory registered with a store, for its zero-copy calls
(``put_from``, ``get_into`` and their batch forms).

    pool = BufferPool(store)                  # store: a set-up MooncakeDistributedStore
    with pool.acquire(n) as lease:            # lease.ptr, lease.size, lease.buffer
        lease.buffer[:n] = data
        store.put_from(key, lease.ptr, n)
    pool.close()

Leases come first from the pool's local region, as large as the store's
``local_buffer_size`` and registered with the store once; when it is full they overflow
into separately mapped buffers (``alignment``-aligned) registered for the lease's
lifetime. The pool holds at most ``max_bytes`` (0: twice the local region; never less
than it) and, with ``max_regions``, at most that many leases at once. An ``acquire`` that
does not fit waits for a release (``block_on_exhaustion``/``block``, up to ``timeout``
seconds or ``default_timeout``) or raises RuntimeError. Errors are RuntimeError with
upstream's messages. ``RegisteredBufferPool`` is the same class (upstream's alias).
"""

import ctypes
import mmap
import threading
import time
import weakref

__all__ = ["BufferPool", "RegisteredBufferPool", "BufferLease", "RegisteredBufferLease",
           "BufferLeaseView", "RegisteredBufferLeaseView"]

_LOCAL_ALIGNMENT = 64  # what the local region's allocations are aligned to


def _positive_int(value, name, allow_zero=False):
    if isinstance(value, bool) or not isinstance(value, int):
        raise TypeError(f"{name}: expected an int, got {type(value).__name__}")
    if value < 0 or (value == 0 and not allow_zero):
        raise RuntimeError(f"{name} must be {'non-negative' if allow_zero else 'positive'}")
    return value


def _optional_seconds(value, name):
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise TypeError(f"{name}: expected seconds (a number) or None")
    if value < 0:
        raise RuntimeError("timeout must be non-negative")
    return float(value)


class _Mapping:
    """Anonymous host memory of ``size`` bytes starting at an ``alignment``-aligned
    address (mapped with room to align, when the alignment exceeds a page)."""

    def __init__(self, size, alignment):
        extra = alignment if alignment > mmap.PAGESIZE else 0
        self._map = mmap.mmap(-1, size + extra, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
        self._anchor = ctypes.c_char.from_buffer(self._map)
        raw = ctypes.addressof(self._anchor)
        self.ptr = -(-raw // alignment) * alignment if extra else raw
        self.size = size

    def close(self):
        del self._anchor
        self._map.close()


class _Arena:
    """First-fit allocation of aligned blocks inside [base, base + size)."""

    def __init__(self, base, size):
        self._base = base
        self._free = [(0, size)]  # (offset, length), sorted, coalesced

    @staticmethod
    def _rounded(n):
        return -(-n // _LOCAL_ALIGNMENT) * _LOCAL_ALIGNMENT

    def allocate(self, n):
        n = self._rounded(n)
        for i, (offset, length) in enumerate(self._free):
            if length >= n:
                if length == n:
                    del self._free[i]
                else:
                    self._free[i] = (offset + n, length - n)
                return self._base + offset
        return None

    def release(self, ptr, n):
        offset, n = ptr - self._base, self._rounded(n)
        i = 0
        while i < len(self._free) and self._free[i][0] < offset:
            i += 1
        self._free.insert(i, (offset, n))
        # Merge with the following block, then with the preceding one.
        if i + 1 < len(self._free) and offset + n == self._free[i + 1][0]:
            self._free[i] = (offset, n + self._free.pop(i + 1)[1])
        if i > 0 and self._free[i - 1][0] + self._free[i - 1][1] == offset:
            prev_offset, prev_len = self._free[i - 1]
            self._free[i - 1] = (prev_offset, prev_len + self._free.pop(i)[1])


class BufferLease:
    """``size`` bytes at ``ptr`` until ``release()`` (or the end of a ``with`` block, or
    collection). ``buffer`` is a writable memoryview of them; release refuses while
    such views are alive."""

    def __init__(self, pool, region, size):
        self._pool = pool
        self._region = region
        self._size = size
        self._views = []  # weak references to the ctypes arrays behind handed-out views

    @property
    def ptr(self):
        if self._region is None:
            raise RuntimeError("buffer lease is closed")
        return self._region.ptr

    @property
    def size(self):
        return self._size

    @property
    def buffer(self):
        return BufferLeaseView(self).buffer

    def _track(self, array):
        self._views = [v for v in self._views if v() is not None]
        self._views.append(weakref.ref(array))

    def _exported(self):
        return any(v() is not None for v in self._views)

    def release(self):
        if self._region is None:
            return
        if self._exported():
            raise RuntimeError("cannot release buffer while exported views exist")
        self._give_back()

    def _give_back(self):
        region, self._region = self._region, None
        if region is not None:
            self._pool._release(region)

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.release()

    def __del__(self):
        try:
            self._give_back()
        except Exception:
            pass

    def __repr__(self):
        state = "released" if self._region is None else f"ptr=0x{self._region.ptr:x}"
        return f"BufferLease({state}, size={self._size})"


class BufferLeaseView:
    """The memory a lease's ``buffer`` exports, as one writable view: while any view of
    it lives, the lease (and so its memory) stays alive and ``release`` refuses."""

    __slots__ = ("_array",)

    def __init__(self, lease):
        if lease._region is None:
            raise RuntimeError("buffer lease is closed")
        array = (ctypes.c_uint8 * lease._size).from_address(lease._region.ptr)
        array.lease = lease  # what keeps the lease alive while a view is
        lease._track(array)
        self._array = array

    @property
    def buffer(self):
        return memoryview(self._array).cast("B")


class _Region:
    """One leased block: from the local arena, or an overflow mapping."""

    __slots__ = ("ptr", "size", "overflow")

    def __init__(self, ptr, size, overflow=None):
        self.ptr = ptr
        self.size = size
        self.overflow = overflow  # the _Mapping of an overflow lease


class BufferPool:
    """See the module docstring."""

    def __init__(self, store, max_bytes=0, min_size_class=64 * 1024, max_size_class=None,
                 alignment=8 * 1024 * 1024, block_on_exhaustion=True, default_timeout=None,
                 max_regions=None, prewarm_size=None, prewarm_count=0):
        if store is None or not getattr(store, "_store", None):
            raise RuntimeError("MooncakeDistributedStore is not initialized")
        _positive_int(max_bytes, "max_bytes", allow_zero=True)
        if min_size_class == 0 or alignment == 0:
            raise RuntimeError("min_size_class and alignment must be positive")
        _positive_int(min_size_class, "min_size_class")
        _positive_int(alignment, "alignment")
        if alignment < ctypes.sizeof(ctypes.c_void_p) or alignment & (alignment - 1):
            raise RuntimeError("alignment must be a power of two and at least sizeof(void*)")
        local = int(getattr(store, "_local_buffer_size", 0) or 0)
        if local <= 0:
            raise RuntimeError("BufferPool requires a store configured with a local buffer")
        self._store = store
        self._alignment = alignment
        self._block = bool(block_on_exhaustion)
        self._default_timeout = _optional_seconds(default_timeout, "default_timeout")
        self._max_regions = None if max_regions is None else \
            _positive_int(max_regions, "max_regions", allow_zero=True)
        self._max_bytes = 2 * local if max_bytes == 0 else max(max_bytes, local)
        self._max_size_class = self._max_bytes if max_size_class is None else \
            _positive_int(max_size_class, "max_size_class", allow_zero=True)
        self._cond = threading.Condition()
        self._leased = {}  # ptr -> _Region
        self._bytes = 0  # leased plus being allocated
        self._pending = 0  # allocations under way (outside the lock)
        self._closing = False
        self._closed = False
        self._local = _Mapping(local, _LOCAL_ALIGNMENT)
        rc = store.register_buffer(self._local.ptr, local)
        if rc != 0:
            self._local.close()
            raise RuntimeError(f"registering the pool's local buffer failed ({rc})")
        self._arena = _Arena(self._local.ptr, local)
        if prewarm_size is not None and prewarm_count > 0:
            self.prewarm(prewarm_size, prewarm_count)

    # ------------------------------------------------------------ leases

    def acquire(self, size, block=None, timeout=None):
        """A lease of ``size`` bytes (0 allowed). Waits or raises as the module
        docstring says."""
        _positive_int(size, "size", allow_zero=True)
        should_block = self._block if block is None else bool(block)
        wait_s = _optional_seconds(timeout, "timeout")
        if wait_s is None:
            wait_s = self._default_timeout
        needed = max(size, 1)
        if needed > self._max_bytes:
            raise RuntimeError("requested buffer size exceeds pool capacity")
        deadline = None if wait_s is None else time.monotonic() + wait_s
        with self._cond:
            while True:
                self._raise_unless_open()
                if self._has_room(needed):
                    break
                if not should_block:
                    raise RuntimeError("buffer pool is exhausted")
                left = None if deadline is None else deadline - time.monotonic()
                if left is not None and left <= 0:
                    raise RuntimeError("timed out waiting for buffer")
                self._cond.wait(left)
            self._bytes += needed
            self._pending += 1
            ptr = self._arena.allocate(needed)
        region = None
        try:
            region = _Region(ptr, needed) if ptr is not None else self._overflow(needed)
        finally:
            with self._cond:
                self._pending -= 1
                if region is None:
                    self._bytes -= needed
                else:
                    self._leased[region.ptr] = region
                self._cond.notify_all()
        return BufferLease(self, region, size)

    def buffer(self, size, block=None, timeout=None):
        """The same as acquire (upstream's second name)."""
        return self.acquire(size, block, timeout)

    def prewarm(self, size, count):
        """Accepted for upstream's API; nothing to do here (the local region is mapped
        and registered when the pool is made)."""
        _positive_int(size, "size", allow_zero=True)
        _positive_int(count, "count", allow_zero=True)

    def _has_room(self, needed):
        if self._bytes + needed > self._max_bytes:
            return False
        return self._max_regions is None or \
            len(self._leased) + self._pending < self._max_regions

    def _overflow(self, size):
        mapping = _Mapping(size, self._alignment)
        rc = self._store.register_buffer(mapping.ptr, size)
        if rc != 0:
            mapping.close()
            raise RuntimeError("overflow buffer registration failed")
        return _Region(mapping.ptr, size, mapping)

    def _release(self, region):
        with self._cond:
            if self._leased.pop(region.ptr, None) is None:
                raise RuntimeError("buffer lease is not active")
            self._bytes -= region.size
            if region.overflow is None:
                self._arena.release(region.ptr, region.size)
        if region.overflow is not None:
            self._store.unregister_buffer(region.ptr)
            region.overflow.close()
        with self._cond:
            self._cond.notify_all()

    # ------------------------------------------------------------ lifecycle

    def _raise_unless_open(self):
        if self._closed:
            raise RuntimeError("buffer pool is closed")
        if self._closing:
            raise RuntimeError("buffer pool is closing")

    def close(self):
        """Closes the pool; RuntimeError (the pool stays open) while leases are out.
        Waits for allocations under way to finish first."""
        with self._cond:
            if self._closed:
                return
            self._closing = True
            self._cond.wait_for(lambda: self._pending == 0)
            self._closing = False
            if self._leased:
                self._cond.notify_all()
                raise RuntimeError("cannot close buffer pool with active leases")
            self._closed = True
            self._cond.notify_all()
        self._store.unregister_buffer(self._local.ptr)
        self._local.close()

    def __del__(self):
        try:
            if not self._closed and not self._leased:
                self.close()
        except Exception:
            pass


RegisteredBufferPool = BufferPool
RegisteredBufferLease = BufferLease
RegisteredBufferLeaseView = BufferLeaseView
