"""Cheap, never-failing run-time probes for accelerator and fabric libraries.

``find_library`` only looks for files (LD_LIBRARY_PATH, the dynamic linker's cache and a few
standard directories); nothing is loaded at import time. The CUDA driver is loaded lazily,
the first time a buffer registered with location "*" must be classified.
"""

import ctypes
import logging
import os
import threading

logger = logging.getLogger("mooncake")

_STD_DIRS = (
    "/usr/lib/x86_64-linux-gnu",
    "/usr/lib/aarch64-linux-gnu",
    "/usr/lib64",
    "/usr/lib",
    "/lib/x86_64-linux-gnu",
    "/lib64",
    "/usr/local/lib",
    "/usr/local/cuda/lib64",
    "/usr/local/cuda/compat",
    "/opt/rocm/lib",
    "/opt/amazon/efa/lib",
    "/usr/lib/wsl/lib",
)

_cache_text = None


def _ld_cache():
    global _cache_text
    if _cache_text is None:
        try:
            with open("/etc/ld.so.cache", "rb") as f:
                _cache_text = f.read()
        except OSError:
            _cache_text = b""
    return _cache_text


def find_library(*names):
    """The path (or, when known only to the linker cache, the name) of the first of
    ``names`` found; None if none is. Never raises."""
    try:
        dirs = [d for d in os.environ.get("LD_LIBRARY_PATH", "").split(":") if d]
        dirs += list(_STD_DIRS)
        for name in names:
            for d in dirs:
                p = os.path.join(d, name)
                if os.path.exists(p):
                    return p
        cache = _ld_cache()
        for name in names:
            if name.encode() + b"\0" in cache:
                return name
    except Exception:  # a probe must never break the import
        pass
    return None


def rdma_devices():
    """Names of the RDMA devices the kernel exposes (empty when none)."""
    try:
        return sorted(os.listdir("/sys/class/infiniband"))
    except OSError:
        return []


def _probe():
    found = {
        "cuda": find_library("libcuda.so.1", "libcuda.so"),
        "hip": find_library("libamdhip64.so", "libamdhip64.so.6", "libamdhip64.so.5"),
        "rdma": find_library("libibverbs.so.1", "libibverbs.so"),
        "efa": None,
        "ascend": find_library("libascendcl.so"),
    }
    fabric = find_library("libfabric.so.1", "libfabric.so")
    has_efa_device = any(n.startswith(("efa", "rdmap")) for n in rdma_devices())
    if fabric and has_efa_device:
        found["efa"] = fabric
    return found


FOUND = _probe()

# ---------------------------------------------------------------- CUDA driver (lazy)

_cuda_lock = threading.Lock()
_cuda = None  # ctypes.CDLL, False when unusable


def _cuda_driver():
    global _cuda
    with _cuda_lock:
        if _cuda is None:
            _cuda = False
            if FOUND["cuda"]:
                try:
                    lib = ctypes.CDLL(FOUND["cuda"])
                    if lib.cuInit(0) == 0:
                        lib.cuPointerGetAttribute.argtypes = [
                            ctypes.c_void_p, ctypes.c_int, ctypes.c_uint64]
                        lib.cuStreamSynchronize.argtypes = [ctypes.c_void_p]
                        _cuda = lib
                except Exception as e:  # a broken driver install: treat memory as host
                    logger.debug("CUDA driver unusable: %s", e)
        return _cuda or None


_CU_POINTER_ATTRIBUTE_MEMORY_TYPE = 2
_CU_POINTER_ATTRIBUTE_DEVICE_ORDINAL = 9
_CU_MEMORYTYPE_DEVICE = 2


def location_of(addr):
    """The mooncake.h location of memory at ``addr``: "cuda:N" for CUDA device memory,
    else "cpu:0". Used for upstream's wildcard location "*"."""
    if not FOUND["cuda"] or not addr:
        return "cpu:0"
    lib = _cuda_driver()
    if lib is None:
        return "cpu:0"
    try:
        mem_type = ctypes.c_uint(0)
        rc = lib.cuPointerGetAttribute(
            ctypes.byref(mem_type), _CU_POINTER_ATTRIBUTE_MEMORY_TYPE, addr)
        if rc != 0 or mem_type.value != _CU_MEMORYTYPE_DEVICE:
            return "cpu:0"
        ordinal = ctypes.c_int(0)
        rc = lib.cuPointerGetAttribute(
            ctypes.byref(ordinal), _CU_POINTER_ATTRIBUTE_DEVICE_ORDINAL, addr)
        return f"cuda:{ordinal.value if rc == 0 else 0}"
    except Exception:
        return "cpu:0"


def stream_synchronize(stream):
    """Waits for a CUDA stream (cudaStream_t / CUstream as an int; 0 = legacy default)."""
    lib = _cuda_driver()
    if lib is None:
        raise RuntimeError("CUDA stream transfers need the CUDA driver (libcuda.so.1), "
                           "which was not found")
    rc = lib.cuStreamSynchronize(stream or None)
    if rc != 0:
        raise RuntimeError(f"cuStreamSynchronize failed with CUDA error {rc}")
