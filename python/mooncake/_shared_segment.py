"""``SharedSegment``: one block of host memory shared by the processes of a group on one
machine (POSIX shared memory), set up in two phases around the caller's all-gather.

    seg, blob = SharedSegment.create(name, size, world_size, rank_id, owner_rank=0)
    blobs = all_gather(blob)          # the caller's collective, indexed by rank
    seg.complete(blobs)               # non-owners map the owner's pages
    seg.base_addr()                   # valid from create() on; ready() after complete()

The owner rank creates the memory; the others reserve an address window at create()
(so ``base_addr`` is known as early on every rank) and map the owner's pages into it at
complete(). Each rank maps the pages at its own address. The blob layout, the segment
fingerprint and the allocation granularity are upstream's (a 32-byte header: magic
"MCSS", version 1, backend 3 = mmap, rank, handle length, fingerprint, allocation size;
then 128 bytes holding the shm name), so ranks of either implementation agree on them.
Only the mmap backend exists here: ``mmap=False`` (a device VMM handle) and
``host_register=True`` (Ascend) are reported as unsupported.
"""

import atexit
import ctypes
import mmap as _mmap
import os
import secrets
import struct
import threading

__all__ = ["SharedSegment"]

_MAGIC = 0x4D435353  # "MCSS"
_VERSION = 1
_MMAP_BACKEND = 3
_HEADER = struct.Struct("=IHHIIQQ")
_MAX_HANDLE = 128
_BLOB_BYTES = _HEADER.size + _MAX_HANDLE
_MAX_SEGMENT_BYTES = 1 << 46
_FNV_OFFSET = 1469598103934665603
_FNV_PRIME = 1099511628211
_U64 = (1 << 64) - 1
_SHM_DIR = "/dev/shm"

_PROT_NONE, _PROT_RW = 0, _mmap.PROT_READ | _mmap.PROT_WRITE
_MAP_FIXED = 0x10
_MAP_FAILED = ctypes.c_void_p(-1).value

_libc = ctypes.CDLL(None, use_errno=True)
_libc.mmap.restype = ctypes.c_void_p
_libc.mmap.argtypes = (ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int, ctypes.c_int,
                       ctypes.c_int, ctypes.c_long)
_libc.munmap.restype = ctypes.c_int
_libc.munmap.argtypes = (ctypes.c_void_p, ctypes.c_size_t)


def _fnv(seed, data):
    h = seed
    for byte in data:
        h = ((h ^ byte) * _FNV_PRIME) & _U64
    return h


def _fingerprint(name, size, world_size, owner_rank, mmap, host_register):
    h = _fnv(_FNV_OFFSET, name.encode())
    for value in (size, world_size, owner_rank, int(mmap), int(host_register)):
        h = _fnv(h, struct.pack("=Q", value))
    return h


def _read_first_line(path):
    try:
        with open(path, encoding="ascii") as f:
            return f.readline()
    except OSError:
        return ""


def _granularity():
    """Upstream's: the PMD huge page size when shmem THP is on, else the page size."""
    line = _read_first_line("/sys/kernel/mm/transparent_hugepage/shmem_enabled")
    active = line[line.find("[") + 1:line.find("]")] if "[" in line and "]" in line else ""
    if active and active not in ("never", "deny"):
        try:
            size = int(_read_first_line("/sys/kernel/mm/transparent_hugepage/hpage_pmd_size"))
            if size > 0 and size & (size - 1) == 0:
                return size
        except ValueError:
            pass
        return 2 << 20
    return _mmap.PAGESIZE


def _map(addr, size, prot, flags, fd):
    out = _libc.mmap(addr, size, prot, flags, fd, 0)
    if out is None or out == _MAP_FAILED:
        err = ctypes.get_errno()
        raise RuntimeError(f"Shared segment mmap failed: {os.strerror(err)}")
    return out


def _check_count(value, name, limit=(1 << 32) - 1):
    if isinstance(value, bool) or not isinstance(value, int) or not 0 <= value <= limit:
        raise TypeError(f"{name}: expected an int in [0, {limit}], got {value!r}")
    return value


# Shm names this process's owner segments created and still hold: removed at exit, so a
# segment still referenced when the interpreter ends (no __del__ runs then) leaves no
# file in /dev/shm. Ranks that mapped it keep their pages; the name is only a handle.
# Each name is kept with the pid that created it: a forked child inherits the set but
# must not remove its parent's names when it exits.
_OWNED_NAMES = {}
_OWNED_LOCK = threading.Lock()


def _forget_name(shm_name):
    with _OWNED_LOCK:
        creator = _OWNED_NAMES.pop(shm_name, None)
    if creator != os.getpid():
        return
    try:
        os.unlink(_SHM_DIR + shm_name)
    except OSError:
        pass


@atexit.register
def _remove_names_left():
    with _OWNED_LOCK:
        left = list(_OWNED_NAMES)
    for shm_name in left:
        _forget_name(shm_name)


class SharedSegment:
    """See the module docstring. Errors raise RuntimeError (as upstream's binding)."""

    def __init__(self):
        raise TypeError("SharedSegment: use SharedSegment.create(...)")

    @classmethod
    def _new(cls, name, size, options):
        self = object.__new__(cls)
        self._name = name
        self._size = size
        self._options = options
        self._fingerprint = _fingerprint(name, size, options["world_size"],
                                         options["owner_rank"], True, False)
        self._alloc_size = -(-size // _granularity()) * _granularity()
        self._base = 0
        self._shm_name = ""
        self._owner = options["rank_id"] == options["owner_rank"]
        self._ready = False
        self._lock = threading.Lock()
        return self

    @staticmethod
    def supported(mmap=True, host_register=False):
        """Whether this build can share memory across processes this way: POSIX shm
        (``mmap=True`` without ``host_register``) only."""
        return bool(mmap) and not host_register

    @classmethod
    def create(cls, name, size, world_size, rank_id, owner_rank=0, device_id=0, mmap=True,
               host_register=False):
        """Phase one: (segment, blob). The owner allocates; the others reserve."""
        if not isinstance(name, str):
            raise TypeError(f"name: expected str, got {type(name).__name__}")
        _check_count(size, "size", _U64)
        _check_count(world_size, "world_size")
        _check_count(rank_id, "rank_id")
        _check_count(owner_rank, "owner_rank")
        if world_size == 0:
            raise RuntimeError("Shared segment world_size must not be zero")
        if rank_id >= world_size or owner_rank >= world_size:
            raise RuntimeError("Shared segment rank_id and owner_rank must be below world_size")
        if host_register and not mmap:
            raise RuntimeError("Shared segment host_register requires mmap=true")
        if not mmap:
            raise RuntimeError("This build has no VMM backend for shared segments")
        if host_register:
            raise RuntimeError("Shared segment mmap needs Ascend for HostRegister")
        if size == 0 or size > _MAX_SEGMENT_BYTES:
            raise RuntimeError(f"Shared segment size must be in (0, {_MAX_SEGMENT_BYTES}]")
        options = {"world_size": world_size, "rank_id": rank_id, "owner_rank": owner_rank,
                   "device_id": device_id}
        seg = cls._new(name, size, options)
        if seg._owner:
            seg._create_owner()
        else:
            seg._base = _map(None, seg._alloc_size, _PROT_NONE,
                             _mmap.MAP_PRIVATE | _mmap.MAP_ANONYMOUS, -1)
        return seg, seg._blob()

    def _create_owner(self):
        # The pid tells owners on one host apart; the random part covers pid reuse.
        shm_name = f"/mcss_{os.getpid()}_{secrets.token_hex(8)}"
        path = _SHM_DIR + shm_name
        fd = os.open(path, os.O_CREAT | os.O_EXCL | os.O_RDWR, 0o600)
        try:
            os.ftruncate(fd, self._alloc_size)
            self._base = _map(None, self._alloc_size, _PROT_RW, _mmap.MAP_SHARED, fd)
        except (OSError, RuntimeError):
            os.unlink(path)
            raise
        finally:
            os.close(fd)
        self._shm_name = shm_name
        with _OWNED_LOCK:
            _OWNED_NAMES[shm_name] = os.getpid()

    def _blob(self):
        handle = self._shm_name.encode() if self._owner else b""
        header = _HEADER.pack(_MAGIC, _VERSION, _MMAP_BACKEND, self._options["rank_id"],
                              len(handle), self._fingerprint, self._alloc_size)
        return header + handle.ljust(_MAX_HANDLE, b"\0")

    def _owner_handle(self, blobs):
        if len(blobs) != self._options["world_size"]:
            raise RuntimeError(f"Shared segment expects one blob per rank, got {len(blobs)}")
        owner_handle = b""
        for rank, blob in enumerate(blobs):
            blob = bytes(blob)
            if len(blob) != _BLOB_BYTES:
                raise RuntimeError("Shared segment blob has an unexpected length")
            magic, version, backend, blob_rank, handle_len, fingerprint, alloc = \
                _HEADER.unpack_from(blob)
            if magic != _MAGIC:
                raise RuntimeError("Shared segment blob magic mismatch")
            if version != _VERSION:
                raise RuntimeError("Shared segment blob version mismatch, peers run "
                                   "different builds")
            if handle_len > _MAX_HANDLE:
                raise RuntimeError("Shared segment blob declares an oversized handle")
            if blob_rank != rank:
                raise RuntimeError(f"Shared segment blob of rank {rank} carries a different "
                                   "rank id")
            if backend != _MMAP_BACKEND:
                raise RuntimeError(f"Shared segment backend of rank {rank} differs")
            if fingerprint != self._fingerprint:
                raise RuntimeError(f"Shared segment declaration of rank {rank} differs from "
                                   "the local one")
            if alloc != self._alloc_size:
                raise RuntimeError(f"Shared segment allocation size of rank {rank} differs "
                                   "from the local one")
            if rank == self._options["owner_rank"]:
                owner_handle = blob[_HEADER.size:_HEADER.size + handle_len]
        if not owner_handle:
            raise RuntimeError("Shared segment owner rank did not export a handle")
        return owner_handle.decode()

    def complete(self, blobs):
        """Phase two: ``blobs`` indexed by rank (every rank's create() blob)."""
        with self._lock:
            if self._ready:
                raise RuntimeError("SharedSegment::Complete has already been called")
            shm_name = self._owner_handle(list(blobs))
            if not self._owner:
                if not shm_name.startswith("/") or "/" in shm_name[1:]:
                    raise RuntimeError("Shared segment owner handle is not a POSIX shm name")
                fd = os.open(_SHM_DIR + shm_name, os.O_RDWR)
                try:
                    _map(self._base, self._alloc_size, _PROT_RW,
                         _mmap.MAP_SHARED | _MAP_FIXED, fd)
                finally:
                    os.close(fd)
            self._ready = True

    def ready(self):
        return self._ready

    def base_addr(self):
        return self._base

    def device_addr(self):
        """0: the host address is the one to use (no separate device mapping here)."""
        return 0

    def size(self):
        return self._size

    def close(self):
        """Unmaps the memory (the owner also removes the shm name). Not in upstream's
        API, where this happens when the object is collected; so it does here too."""
        with self._lock:
            base, self._base = self._base, 0
            if base:
                _libc.munmap(base, self._alloc_size)
            if self._owner and self._shm_name:
                _forget_name(self._shm_name)
                self._shm_name = ""
            self._ready = False

    def __del__(self):
        try:
            self.close()
        except Exception:
            pass
