"""Helpers shared by the engine and store modules (private)."""

import array
import bisect
import enum
import ctypes
import ipaddress
import logging
import os
import random
import socket
import threading

from . import _native as N

logger = logging.getLogger("mooncake")

U64_MAX = (1 << 64) - 1


class ErrorCode(enum.IntEnum):
    """Mooncake Store's error numbers (what the int-returning calls give)."""

    OK = 0
    INTERNAL_ERROR = -1
    BUFFER_OVERFLOW = -10
    SEGMENT_NOT_FOUND = -101
    SEGMENT_ALREADY_EXISTS = -102
    CLIENT_NOT_FOUND = -103
    NO_AVAILABLE_HANDLE = -200
    INVALID_VERSION = -300
    INVALID_KEY = -400
    WRITE_FAIL = -500
    INVALID_PARAMS = -600
    ILLEGAL_CLIENT = -601
    INVALID_WRITE = -700
    INVALID_READ = -701
    INVALID_REPLICA = -702
    REPLICA_IS_NOT_READY = -703
    OBJECT_NOT_FOUND = -704
    OBJECT_ALREADY_EXISTS = -705
    OBJECT_HAS_LEASE = -706
    LEASE_EXPIRED = -707
    TRANSFER_FAIL = -800
    CHECKSUM_MISMATCH = -801
    RPC_FAIL = -900
    RPC_TIMEOUT = -901
    ETCD_OPERATION_ERROR = -1000
    UNAVAILABLE_IN_CURRENT_STATUS = -1010
    NOT_SUPPORTED = -1012
    FILE_NOT_FOUND = -1100
    FILE_OPEN_FAIL = -1101
    FILE_READ_FAIL = -1102
    FILE_WRITE_FAIL = -1103
    DFS_SERVICE_UNAVAILABLE = -1601


ErrorCode.__module__ = "mooncake.store"  # exported there, where it was first defined


def check_int(value, name, lo=0, hi=U64_MAX):
    """An int argument in [lo, hi]; bool and other types raise TypeError, out of range
    ValueError."""
    if isinstance(value, bool) or not isinstance(value, int):
        # numpy integers and the like
        if hasattr(value, "__index__") and not isinstance(value, bool):
            value = value.__index__()
        else:
            raise TypeError(f"{name}: expected int, got {type(value).__name__}")
    if not lo <= value <= hi:
        raise ValueError(f"{name}: {value} is out of range [{lo}, {hi}]")
    return value


def check_str(value, name):
    if not isinstance(value, str):
        raise TypeError(f"{name}: expected str, got {type(value).__name__}")
    return value


def int_list(values, name, lo=0, hi=U64_MAX):
    if isinstance(values, (str, bytes)) or not hasattr(values, "__iter__"):
        raise TypeError(f"{name}: expected a list of int, got {type(values).__name__}")
    out = list(values)
    # The common case checked at C speed (a batch call's lists run to thousands): all
    # plain ints, all in range. bool is not int's type, so it takes the loop below.
    if not out or (set(map(type, out)) == JUST_INT and lo <= min(out) and max(out) <= hi):
        return out
    for i, v in enumerate(out):
        # Plain ints in range pass as they are; the rest (numpy integers, errors) go through
        # check_int, which names the element (the name is made only then).
        if type(v) is not int or not lo <= v <= hi:
            out[i] = check_int(v, f"{name}[{i}]", lo, hi)
    return out


# The set of types of a list of plain ints (bool is not one).
JUST_INT = {int}


def u64_array(values):
    """``values`` as an ``array("Q")``, converted at C speed, when it is a non-empty list
    of plain ints in [0, U64_MAX] (bool is not one); None otherwise."""
    if type(values) is not list or set(map(type, values)) != JUST_INT:
        return None
    try:
        return array.array("Q", values)
    except OverflowError:
        return None


def repeated_u64(values):
    """A non-empty list whose elements all equal its first, a plain int in [2, U64_MAX]
    (one size for every key, as engines pass it), as an ``array("Q")``; None for any
    other. Checked at C speed: ``count`` finds the equal elements, and the sum's type
    rules out floats and the other numbers that compare equal to an int. (An element
    that only equals it, such as an ``IntEnum`` member, passes, as ``array("Q")`` takes
    it.)"""
    first = values[0] if values else None
    if type(first) is not int or not 2 <= first <= U64_MAX:
        return None
    try:
        # (The elements' own == and + run here: whatever they raise, the caller's
        # careful path answers.)
        if values.count(first) != len(values) or type(sum(values)) is not int:
            return None
    except Exception:
        return None
    return array.array("Q", (first,)) * len(values)


def str_list(values, name):
    if isinstance(values, (str, bytes)) or not hasattr(values, "__iter__"):
        raise TypeError(f"{name}: expected a list of str, got {type(values).__name__}")
    out = list(values)
    for i, v in enumerate(out):
        if not isinstance(v, str):
            raise TypeError(f"{name}[{i}]: expected str, got {type(v).__name__}")
    return out


def _length_mismatch(lists):
    """None when the lists have one length, else a description of their lengths."""
    first = None
    for v in lists.values():
        if first is None:
            first = len(v)
        elif len(v) != first:
            break
    else:
        return None
    lengths = {k: len(v) for k, v in lists.items()}
    if len(set(lengths.values())) <= 1:
        return None
    return ", ".join(f"{k}={n}" for k, n in lengths.items())


def same_length(**lists):
    mismatch = _length_mismatch(lists)
    if mismatch:
        raise ValueError(f"lists of different lengths: {mismatch}")


def lengths_match(what, **lists):
    """Whether the parallel lists have one length; if not, logs why. Upstream's store batch
    calls answer such a call with INVALID_PARAMS (per key where they return a list) instead
    of raising, and so do ours."""
    mismatch = _length_mismatch(lists)
    if mismatch:
        logger.error("mooncake: %s: lists of different lengths (%s); nothing done", what,
                     mismatch)
    return mismatch is None


def split_host_port(hostname):
    """("host", port or None) from "host", "host:port", "[v6]:port" or a bare IPv6."""
    s = hostname.strip()
    if not s:
        raise ValueError("local_hostname: empty")
    port = None
    if s.startswith("["):
        host, _, rest = s[1:].partition("]")
        if rest.startswith(":"):
            port = rest[1:]
        elif rest:
            raise ValueError(f"local_hostname: malformed {hostname!r}")
    elif s.count(":") == 1:
        host, port = s.split(":")
    else:
        host = s
    if port is not None:
        if not port.isdigit() or not 0 <= int(port) <= 65535:
            raise ValueError(f"local_hostname: bad port in {hostname!r}")
        port = int(port)
    return host, port


def join_host_port(host, port):
    return f"[{host}]:{port}" if ":" in host else f"{host}:{port}"


def bind_address_for(host):
    """The IP an engine should listen on for a local_hostname host part."""
    try:
        return str(ipaddress.ip_address(host))
    except ValueError:
        pass
    if host.lower() in ("localhost", "localhost.localdomain"):
        return "127.0.0.1"
    return "0.0.0.0"


def free_port(bind):
    family = socket.AF_INET6 if ":" in bind else socket.AF_INET
    with socket.socket(family, socket.SOCK_STREAM) as s:
        s.bind((bind, 0))
        return s.getsockname()[1]


def metadata_connection(metadata_server, metadata_type=None):
    """The mc_config "metadata" value for Mooncake's metadata_server string, or None (after
    logging why) for a backend this build lacks."""
    s = metadata_server.strip()
    if s.upper() == "P2PHANDSHAKE":
        return "P2PHANDSHAKE"
    if "://" not in s:
        # Upstream: a bare host:port means etcd (or initialize_ext's metadata_type).
        s = f"{(metadata_type or 'etcd').strip()}://{s}"
    scheme = s.split("://", 1)[0].lower()
    if scheme in ("http", "etcd", "redis"):
        return s
    if scheme == "https":
        logger.error(
            "mooncake: metadata server %r: https is not supported; use http://, etcd://, "
            "redis:// or P2PHANDSHAKE", metadata_server)
        return None
    logger.error("mooncake: unknown metadata server %r (P2PHANDSHAKE, http://, etcd:// or "
                 "redis://)", metadata_server)
    return None


def new_config(settings):
    """An mc_config pointer with ``settings`` applied, or (None, code) after logging."""
    cfg = N.LIB.mc_config_new()
    if not cfg:
        return None, N.MC_ERR_INTERNAL
    for key, value in settings.items():
        rc = N.LIB.mc_config_set(cfg, key.encode(), str(value).encode())
        if rc != N.MC_OK:
            logger.error("mooncake: setting %s=%r refused: %s (%d)", key, value,
                         N.error_string(rc), rc)
            N.LIB.mc_config_free(cfg)
            return None, rc
    return cfg, N.MC_OK


def store_client_ports():
    """Upstream's range for a store client's port when its local_hostname has none:
    [MC_STORE_CLIENT_MIN_PORT, MC_STORE_CLIENT_MAX_PORT] (default 12300-14300; an unusable
    range falls back to the default with a warning), and how many ports to try
    (MC_STORE_CLIENT_SETUP_RETRIES, default 20)."""
    def env_int(name, default):
        raw = os.environ.get(name)
        if raw is None or not raw.strip():
            return default
        try:
            return int(raw)
        except ValueError:
            logger.warning("mooncake: ignoring %s=%r (an integer expected)", name, raw)
            return default
    lo = env_int("MC_STORE_CLIENT_MIN_PORT", 12300)
    hi = env_int("MC_STORE_CLIENT_MAX_PORT", 14300)
    if not 1 <= lo <= hi <= 65535:
        logger.warning("mooncake: store client port range %d-%d is unusable; using "
                       "12300-14300", lo, hi)
        lo, hi = 12300, 14300
    tries = max(1, env_int("MC_STORE_CLIENT_SETUP_RETRIES", 20))
    return PortRange(lo, hi, tries)


class PortRange:
    """Ports to offer a server that was given none: random free ones in [lo, hi]."""

    def __init__(self, lo, hi, tries):
        self.lo, self.hi, self.tries = lo, hi, tries

    def pick(self, bind):
        """A port in the range that ``bind`` can take now, or None after a bounded search."""
        family = socket.AF_INET6 if ":" in bind else socket.AF_INET
        span = self.hi - self.lo + 1
        start = random.randrange(span)
        for i in range(min(span, 256)):
            port = self.lo + (start + i) % span
            with socket.socket(family, socket.SOCK_STREAM) as s:
                try:
                    s.bind((bind, port))
                except OSError:
                    continue
            return port
        return None


def start_native(new_fn, settings, host, port, p2p, name_key, port_range=None):
    """Creates an engine or store with ``new_fn(cfg, &out)`` from ``settings`` (updated in
    place with what was used); returns (code, handle or None).

    Without a port: a ``port_range`` (a store client's) names the segment host:port with a
    free port of that range, trying another on a bind failure; else a P2PHANDSHAKE segment
    is named after the RPC port the engine binds, and with a metadata server a free port
    is picked (a few tries). A specific non-loopback IP that cannot be bound (NAT, a name
    for another interface) is retried on the wildcard address, keeping the name."""
    bind = settings["bind_address"]
    binds = [bind]
    try:
        ip = ipaddress.ip_address(bind)
        if not ip.is_loopback and not ip.is_unspecified:
            binds.append("::" if ip.version == 6 else "0.0.0.0")
    except ValueError:
        pass
    if port is not None:
        tries = 1
    elif port_range is not None:
        tries = port_range.tries
    else:
        tries = 1 if p2p else 3
    rc = N.MC_ERR_INTERNAL
    for b in binds:
        settings["bind_address"] = b
        for _ in range(tries):
            if port is not None:
                settings["rpc_port"], settings[name_key] = port, join_host_port(host, port)
            elif port_range is not None:
                picked = port_range.pick(b)
                if picked is None:
                    rc = N.MC_ERR_INTERNAL
                    break
                settings["rpc_port"], settings[name_key] = picked, join_host_port(host, picked)
            elif p2p:
                settings["rpc_port"], settings[name_key] = 0, host
            else:
                picked = free_port(b)
                settings["rpc_port"], settings[name_key] = picked, join_host_port(host, picked)
            cfg, rc = new_config(settings)
            if cfg is None:
                return rc, None
            out = ctypes.c_void_p()
            try:
                rc = new_fn(cfg, ctypes.byref(out))
            finally:
                N.LIB.mc_config_free(cfg)
            if rc == N.MC_OK:
                return rc, out.value
            if rc != N.MC_ERR_IO:
                return rc, None
    return rc, None


def transfer_timeout_ms():
    """Upstream's MC_TRANSFER_TIMEOUT (seconds, at least 5) as transfer_timeout_ms."""
    v = os.environ.get("MC_TRANSFER_TIMEOUT")
    if not v:
        return None
    try:
        return max(5, int(v)) * 1000
    except ValueError:
        logger.warning("mooncake: ignoring MC_TRANSFER_TIMEOUT=%r (seconds expected)", v)
        return None


HARDWARE_PROTOCOLS = ("rdma", "efa")


def buffer_address(obj, name="value", writable=False):
    """(address, nbytes, keepalive) of a bytes-like object, without copying where the
    object allows it. Read-only buffers other than bytes are copied."""
    if isinstance(obj, bytes):
        p = ctypes.c_char_p(obj)
        return ctypes.cast(p, ctypes.c_void_p).value or 0, len(obj), (obj, p)
    try:
        mv = memoryview(obj)
    except TypeError:
        raise TypeError(f"{name}: expected a bytes-like object, got {type(obj).__name__}") from None
    if not mv.readonly and mv.c_contiguous:
        flat = mv.cast("B") if mv.format != "B" or mv.ndim != 1 else mv
        n = flat.nbytes
        if n == 0:
            return 0, 0, (mv,)
        arr = (ctypes.c_char * n).from_buffer(flat)
        return ctypes.addressof(arr), n, (mv, flat, arr)
    if writable:
        raise TypeError(f"{name}: expected a writable contiguous buffer")
    data = mv.tobytes()
    p = ctypes.c_char_p(data)
    return ctypes.cast(p, ctypes.c_void_p).value or 0, len(data), (data, p)


class Registered:
    """Memory registered with one store or engine: non-overlapping [start, end) ranges."""

    def __init__(self):
        self.starts = []
        self.ends = {}
        self.lock = threading.Lock()
        self._pairs = array.array("Q")

    def _changed(self):
        # Built again at the next pairs() (a thousand registrations in a row rebuild
        # nothing), and replaced, never changed in place: a call holding it keeps it.
        self._pairs = None

    def add(self, addr, size):
        with self.lock:
            if addr not in self.ends:
                bisect.insort(self.starts, addr)
            self.ends[addr] = addr + size
            self._changed()

    def remove(self, addr):
        with self.lock:
            if self.ends.pop(addr, None) is not None:
                self.starts.pop(bisect.bisect_left(self.starts, addr))
                self._changed()

    def covers(self, addr, size):
        with self.lock:
            i = bisect.bisect_right(self.starts, addr) - 1
            return i >= 0 and addr + size <= self.ends[self.starts[i]]

    def pairs(self):
        """The ranges as an ``array("Q")`` of start, end pairs in address order (not to
        be changed)."""
        pairs = self._pairs
        if pairs is None:
            with self.lock:
                pairs = array.array("Q", [v for a in self.starts for v in (a, self.ends[a])])
                self._pairs = pairs
        return pairs

    def clear(self):
        with self.lock:
            self.starts.clear()
            self.ends.clear()
            self._changed()
