"""Upstream's ``mooncake.store`` functions about host memory:

- ``bind_to_numa_node``: the calling thread onto one NUMA node's CPUs, and its future
  allocations preferring that node's memory (through sysfs, ``sched_setaffinity`` and
  ``set_mempolicy`` instead of libnuma). Like upstream, every failure is a warning and
  the call returns: binding is advice, and a process that cannot follow it still works,
  only slower.
- ``get_alloc_func_addr`` / ``get_free_func_addr``: the addresses of the C ABI's
  allocator pair (``mc_host_memory_alloc`` / ``_free``), for callers that take
  allocation callbacks.
"""

import ctypes
import logging
import os
import platform

from . import _native as N

logger = logging.getLogger("mooncake")

_NODES = "/sys/devices/system/node"
_MPOL_PREFERRED = 1
# set_mempolicy has no glibc wrapper: its system call number, per architecture.
_SET_MEMPOLICY = {"x86_64": 238, "aarch64": 237, "ppc64le": 261, "s390x": 270}


def _node_ids():
    try:
        names = os.listdir(_NODES)
    except OSError:
        return []
    return sorted(int(n[4:]) for n in names if n.startswith("node") and n[4:].isdigit())


def _parse_cpulist(text):
    """CPU numbers of a sysfs list such as "0-3,8,10-11"."""
    cpus = set()
    for part in text.strip().split(","):
        if not part:
            continue
        lo, _, hi = part.partition("-")
        cpus.update(range(int(lo), int(hi or lo) + 1))
    return cpus


def _prefer_memory_of(node):
    number = _SET_MEMPOLICY.get(platform.machine())
    if number is None:
        logger.warning("mooncake: bind_to_numa_node: memory preference not set "
                       "(unknown system call number on %s)", platform.machine())
        return
    bits = 8 * ctypes.sizeof(ctypes.c_ulong)
    mask = (ctypes.c_ulong * (node // bits + 1))()
    mask[node // bits] = 1 << (node % bits)
    libc = ctypes.CDLL(None, use_errno=True)
    if libc.syscall(number, _MPOL_PREFERRED, mask, ctypes.c_ulong(len(mask) * bits + 1)) != 0:
        logger.warning("mooncake: bind_to_numa_node: set_mempolicy(node %d): %s", node,
                       os.strerror(ctypes.get_errno()))


def bind_to_numa_node(node):
    """Runs the calling thread on NUMA node ``node``'s CPUs and makes that node its
    preferred source of memory (other nodes still serve when it is full)."""
    if isinstance(node, bool) or not isinstance(node, int):
        raise TypeError(f"node: expected int, got {type(node).__name__}")
    nodes = _node_ids()
    if not nodes:
        logger.warning("mooncake: NUMA is not available on this system; binding skipped")
        return
    if node not in nodes:
        logger.warning("mooncake: invalid NUMA node %d (this machine has %s); binding "
                       "skipped", node, ", ".join(map(str, nodes)))
        return
    try:
        with open(f"{_NODES}/node{node}/cpulist") as f:
            cpus = _parse_cpulist(f.read())
        os.sched_setaffinity(0, cpus)  # 0: the calling thread
    except (OSError, ValueError) as e:
        logger.warning("mooncake: bind_to_numa_node: running on node %d: %s", node, e)
    _prefer_memory_of(node)


def get_alloc_func_addr():
    """Address of a C ``void *alloc(size_t)`` handing out page-aligned, zeroed host
    memory (huge pages advised), for callers that take allocator callbacks (LMCache's
    Mooncake allocator); NULL on failure. Upstream's build without NVMe-oF answers NULL
    to every call; this one allocates."""
    return ctypes.cast(N.LIB.mc_host_memory_alloc, ctypes.c_void_p).value


def get_free_func_addr():
    """Address of the C ``void free(void *)`` releasing what ``get_alloc_func_addr``'s
    function gave (NULL and unknown addresses are ignored)."""
    return ctypes.cast(N.LIB.mc_host_memory_free, ctypes.c_void_p).value
