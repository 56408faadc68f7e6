"""Loads ``libmooncake.so`` and declares its C ABI (``c_include/mooncake.h``) with ctypes.

Private to the package. Every function is called through ``ctypes.CDLL``, which releases
the GIL for the duration of each foreign call, so blocking calls (transfers, store round
trips) never stall other Python threads.

Where the library is looked for, in order:
  1. ``libmooncake.so`` next to this file (the copy a wheel installs);
  2. the path in the environment variable ``MOONCAKE_LIB``.

The library must implement every function declared here, at this package's ABI revision:
the package bundles the library it was built with, so another one (an older build named by
``MOONCAKE_LIB``) is refused at import, naming what it lacks, rather than failing later in
whichever method first needs a newer function.
"""

import array
import ctypes
import logging
import operator
import os
import sys
import sysconfig
from ctypes import (
    CFUNCTYPE,
    POINTER,
    Structure,
    c_char_p,
    c_int,
    c_int64,
    c_size_t,
    c_uint32,
    c_uint64,
    c_void_p,
)
from itertools import accumulate, chain, islice, repeat

__all__ = [
    "LIB",
    "LIB_PATH",
    "ABI_VERSION",
    "ABI_REVISION",
    "McRequest",
    "McTaskStatus",
    "McReplicateConfig",
    "McPutOptions",
    "ALLOC_FN",
    "error_string",
]

# The ABI version this binding is written against (MC_ABI_VERSION).
EXPECTED_ABI_VERSION = 1
EXPECTED_ABI_REVISION = 13

# ---------------------------------------------------------------- constants (mooncake.h)

MC_OK = 0
MC_ERR_INTERNAL = -1
MC_ERR_BUFFER_OVERFLOW = -10
MC_ERR_SEGMENT_NOT_FOUND = -101
MC_ERR_NO_AVAILABLE_HANDLE = -200
MC_ERR_INVALID_KEY = -400
MC_ERR_INVALID_PARAMS = -600
MC_ERR_OBJECT_NOT_FOUND = -704
MC_ERR_OBJECT_HAS_LEASE = -706
MC_ERR_TRANSFER_FAIL = -800
MC_ERR_RPC_FAIL = -900
MC_ERR_UNAVAILABLE_IN_CURRENT_STATUS = -1010
MC_ERR_NOT_SUPPORTED = -1012
MC_ERR_ADDRESS_NOT_REGISTERED = -1202
MC_ERR_BATCH_NOT_FOUND = -1203
MC_ERR_TIMEOUT = -1206
MC_ERR_IO = -1210

MC_OP_READ = 0
MC_OP_WRITE = 1

MC_TASK_WAITING = 0
MC_TASK_PENDING = 1
MC_TASK_INVALID = 2
MC_TASK_CANCELED = 3
MC_TASK_COMPLETED = 4
MC_TASK_TIMEOUT = 5
MC_TASK_FAILED = 6

MC_STORE_MAX_KEY_LEN = 4096


# ---------------------------------------------------------------- structs


class McRequest(Structure):
    _fields_ = [
        ("op", c_int),
        ("local", c_void_p),
        ("segment", c_uint64),
        ("remote_addr", c_uint64),
        ("len", c_uint64),
    ]


class McTaskStatus(Structure):
    _fields_ = [("state", c_int), ("bytes", c_uint64)]


class McReplicateConfig(Structure):
    _fields_ = [
        ("replica_num", c_uint32),
        ("hard_pin", c_int),
        ("soft_pin", c_int),
        ("soft_pin_ttl_ms", c_uint64),
        ("preferred_segments", POINTER(c_char_p)),
        ("preferred_segments_count", c_size_t),
        ("prefer_same_node", c_int),
    ]


class McPutOptions(Structure):
    _fields_ = [
        ("group_ids", POINTER(c_char_p)),
        ("group_ids_count", c_size_t),
        ("upsert", c_int),
    ]


_P = c_void_p  # opaque handles (mc_config *, mc_engine *, mc_store *) and raw addresses

# mc_alloc_fn: (ctx, index, size) -> the address of size bytes, or None.
ALLOC_FN = CFUNCTYPE(c_void_p, c_void_p, c_size_t, c_uint64)

# name: (restype, argtypes)
_SIGNATURES = {
    "mc_abi_version": (c_uint32, []),
    "mc_abi_revision": (c_uint32, []),
    "mc_error_string": (c_char_p, [c_int]),
    # configuration
    "mc_config_new": (_P, []),
    "mc_config_set": (c_int, [_P, c_char_p, c_char_p]),
    "mc_config_free": (None, [_P]),
    # engine
    "mc_engine_new": (c_int, [_P, POINTER(_P)]),
    "mc_engine_free": (None, [_P]),
    "mc_engine_segment_name": (c_int, [_P, _P, c_size_t]),
    "mc_register_memory": (c_int, [_P, _P, c_size_t, c_char_p]),
    "mc_register_memory_with_access": (c_int, [_P, _P, c_size_t, c_char_p, c_uint32]),
    "mc_unregister_memory": (c_int, [_P, _P]),
    "mc_allocate_buffer": (c_int, [_P, c_size_t, c_char_p, POINTER(_P)]),
    "mc_free_buffer": (c_int, [_P, _P]),
    "mc_host_memory_alloc": (_P, [c_size_t]),
    "mc_host_memory_free": (None, [_P]),
    "mc_open_segment": (c_int, [_P, c_char_p, POINTER(c_uint64)]),
    "mc_resync_segment": (c_int, [_P, c_uint64]),
    # transfers
    "mc_batch_new": (c_int, [_P, c_size_t, POINTER(c_uint64)]),
    "mc_submit": (c_int, [_P, c_uint64, POINTER(McRequest), c_size_t]),
    "mc_task_status": (c_int, [_P, c_uint64, c_size_t, POINTER(McTaskStatus)]),
    "mc_batch_wait": (c_int, [_P, c_uint64, c_int64]),
    "mc_batch_free": (c_int, [_P, c_uint64]),
    "mc_transfer_sync": (c_int, [_P, POINTER(McRequest), c_size_t]),
    # messages
    "mc_notify": (c_int, [_P, c_uint64, c_char_p]),
    "mc_take_notification": (c_int, [_P, _P, c_size_t, _P, c_size_t]),
    "mc_probe": (c_int, [_P, c_uint64]),
    "mc_notify_as": (c_int, [_P, c_uint64, c_char_p, c_char_p]),
    # introspection
    "mc_engine_rpc_port": (c_int, [_P]),
    "mc_segment_describe": (c_int, [_P, c_uint64, _P, c_size_t, POINTER(c_size_t)]),
    "mc_engine_stats": (c_int, [_P, _P, c_size_t, POINTER(c_size_t)]),
    # store
    "mc_replicate_config_init": (None, [POINTER(McReplicateConfig)]),
    "mc_store_new": (c_int, [_P, POINTER(_P)]),
    "mc_store_free": (None, [_P]),
    "mc_store_new_with_engine": (c_int, [_P, _P, POINTER(_P)]),
    "mc_store_put": (c_int, [_P, c_char_p, _P, c_size_t, POINTER(McReplicateConfig)]),
    "mc_store_put_from": (c_int, [_P, c_char_p, _P, c_size_t, POINTER(McReplicateConfig)]),
    "mc_store_get_into": (c_int, [_P, c_char_p, _P, c_size_t, POINTER(c_uint64)]),
    "mc_store_exists": (c_int, [_P, c_char_p]),
    "mc_store_size": (c_int, [_P, c_char_p, POINTER(c_uint64)]),
    "mc_store_get_buffer": (c_int, [_P, c_char_p, POINTER(_P), POINTER(c_uint64)]),
    "mc_store_buffer_free": (None, [_P, c_uint64]),
    "mc_store_batch_get_alloc": (
        c_int,
        [_P, POINTER(c_char_p), c_size_t, ALLOC_FN, _P, POINTER(c_int64)],
    ),
    "mc_store_remove": (c_int, [_P, c_char_p, c_int]),
    "mc_store_remove_all": (c_int, [_P, c_int, POINTER(c_uint64)]),
    "mc_store_remove_by_regex": (c_int, [_P, c_char_p, c_int, POINTER(c_uint64)]),
    "mc_store_register_buffer": (c_int, [_P, _P, c_size_t]),
    "mc_store_unregister_buffer": (c_int, [_P, _P]),
    "mc_store_hostname": (c_int, [_P, _P, c_size_t]),
    "mc_store_batch_put_from": (
        c_int,
        [_P, POINTER(c_char_p), POINTER(_P), POINTER(c_size_t), c_size_t,
         POINTER(McReplicateConfig), POINTER(c_int)],
    ),
    "mc_store_batch_get_into": (
        c_int,
        [_P, POINTER(c_char_p), POINTER(_P), POINTER(c_size_t), c_size_t, POINTER(c_int64)],
    ),
    "mc_store_batch_exists": (c_int, [_P, POINTER(c_char_p), c_size_t, POINTER(c_int)]),
    "mc_store_key_array": (c_int, [c_char_p, c_size_t, c_size_t, POINTER(c_char_p)]),
    # Arrays passed as addresses (an array.array's buffer_info()[0]).
    "mc_store_batch_get_into_packed": (
        c_int,
        [_P, c_char_p, c_size_t, c_size_t, _P, _P, _P, c_size_t, _P],
    ),
    "mc_python_function": (_P, [c_char_p]),
    # store
    "mc_put_options_init": (None, [POINTER(McPutOptions)]),
    "mc_store_batch_put_parts": (
        c_int,
        [_P, POINTER(c_char_p), c_size_t, POINTER(_P), POINTER(c_size_t), POINTER(c_size_t),
         POINTER(McReplicateConfig), POINTER(McPutOptions), POINTER(c_int)],
    ),
    "mc_store_batch_get_parts": (
        c_int,
        [_P, POINTER(c_char_p), c_size_t, POINTER(_P), POINTER(c_size_t), POINTER(c_size_t),
         POINTER(c_int64)],
    ),
    "mc_store_batch_get_ranges": (
        c_int,
        [_P, POINTER(c_char_p), c_size_t, POINTER(_P), POINTER(c_uint64), POINTER(c_uint64),
         POINTER(c_size_t), POINTER(c_int64)],
    ),
    "mc_store_batch_remove": (c_int, [_P, POINTER(c_char_p), c_size_t, c_int, POINTER(c_int)]),
    "mc_store_batch_replica_clear": (
        c_int, [_P, POINTER(c_char_p), c_size_t, c_char_p, POINTER(c_int)]),
    "mc_store_replica_desc": (c_int, [_P, c_char_p, _P, c_size_t, POINTER(c_size_t)]),
    "mc_store_health": (c_int, [_P]),
    # store sessions, extra segments, disk tier and tasks
    "mc_store_put_session_start": (
        c_int,
        [_P, POINTER(c_char_p), c_size_t, POINTER(c_uint64), POINTER(McReplicateConfig),
         POINTER(McPutOptions), POINTER(c_int)],
    ),
    "mc_store_put_session_write": (
        c_int,
        [_P, POINTER(c_char_p), c_size_t, POINTER(_P), POINTER(c_uint64), POINTER(c_uint64),
         POINTER(c_size_t), POINTER(c_int64)],
    ),
    "mc_store_put_session_end": (c_int, [_P, POINTER(c_char_p), c_size_t, POINTER(c_int)]),
    "mc_store_put_session_revoke": (
        c_int, [_P, POINTER(c_char_p), c_size_t, POINTER(c_int)]),
    "mc_store_get_session_start": (
        c_int, [_P, POINTER(c_char_p), c_size_t, POINTER(c_int)]),
    "mc_store_get_session_read": (
        c_int,
        [_P, POINTER(c_char_p), c_size_t, POINTER(_P), POINTER(c_uint64), POINTER(c_uint64),
         POINTER(c_size_t), POINTER(c_int64)],
    ),
    "mc_store_get_session_end": (c_int, [_P, POINTER(c_char_p), c_size_t]),
    "mc_store_allocate_segment": (
        c_int, [_P, c_uint64, c_char_p, _P, c_size_t, POINTER(c_uint64)]),
    "mc_store_mount_file_segment": (
        c_int, [_P, c_char_p, c_uint64, c_uint64, c_char_p, _P, c_size_t]),
    "mc_store_unmount_file_segment": (c_int, [_P, c_char_p, c_uint64]),
    "mc_store_unmount_allocated_segment": (c_int, [_P, c_char_p, c_uint64]),
    "mc_store_drain_disk_tier": (c_int, [_P, c_uint64]),
    "mc_store_create_copy_task": (
        c_int, [_P, c_char_p, POINTER(c_char_p), c_size_t, POINTER(c_uint64)]),
    "mc_store_create_move_task": (
        c_int, [_P, c_char_p, c_char_p, c_char_p, POINTER(c_uint64)]),
    "mc_store_query_task": (
        c_int, [_P, c_uint64, c_uint64, _P, c_size_t, POINTER(c_size_t)]),
    "mc_store_disk_read_count": (c_int, [_P, POINTER(c_uint64)]),
    # Mooncake PG
    "mc_pg_new": (c_int, [c_int, c_int, c_char_p, POINTER(_P)]),
    "mc_pg_free": (None, [_P]),
    "mc_pg_address": (c_int, [_P, _P, c_size_t, POINTER(c_size_t)]),
    "mc_pg_connect": (c_int, [_P, POINTER(c_char_p), c_size_t]),
    "mc_pg_join": (c_int, [_P, c_uint32]),
    "mc_pg_set_memory": (c_int, [_P, c_char_p]),
    "mc_pg_all_reduce": (c_int, [_P, _P, c_size_t, c_int, c_int]),
    "mc_pg_reduce": (c_int, [_P, _P, c_size_t, c_int, c_int, c_int]),
    "mc_pg_broadcast": (c_int, [_P, _P, c_size_t, c_int]),
    "mc_pg_all_gather": (c_int, [_P, _P, _P, POINTER(c_size_t)]),
    "mc_pg_reduce_scatter": (c_int, [_P, _P, _P, POINTER(c_size_t), c_int, c_int]),
    "mc_pg_all_to_all": (c_int, [_P, _P, POINTER(c_size_t), _P, POINTER(c_size_t)]),
    "mc_pg_all_to_all_timeout": (
        c_int, [_P, _P, POINTER(c_size_t), _P, POINTER(c_size_t), c_uint64]),
    "mc_pg_gather": (c_int, [_P, _P, _P, POINTER(c_size_t), c_int]),
    "mc_pg_scatter": (c_int, [_P, _P, _P, POINTER(c_size_t), c_int]),
    "mc_pg_barrier": (c_int, [_P]),
    "mc_pg_send_recv": (c_int, [_P, _P, c_size_t, _P, c_size_t]),
    "mc_pg_failed_ranks": (c_int, [_P, _P, c_size_t, POINTER(c_size_t)]),
    "mc_pg_active_ranks": (c_int, [_P, _P, c_size_t]),
    "mc_pg_epoch": (c_int, [_P, POINTER(c_uint64)]),
    "mc_pg_refresh": (c_int, [_P]),
    "mc_pg_agree_max": (c_int, [_P, c_uint64, POINTER(c_uint64)]),
    "mc_pg_peer_state": (c_int, [_P, _P, c_size_t, _P]),
    "mc_pg_propose": (
        c_int,
        [_P, c_int, _P, c_size_t, POINTER(c_int), POINTER(c_uint64), _P, c_size_t,
         POINTER(c_size_t), _P, c_size_t],
    ),
    "mc_pg_sync_after_failure": (c_int, [_P, POINTER(c_int)]),
}


def _candidates():
    here = os.path.dirname(os.path.abspath(__file__))
    yield "the copy installed with the package", os.path.join(here, "libmooncake.so")
    env = os.environ.get("MOONCAKE_LIB")
    if env:
        yield "MOONCAKE_LIB", env


def _load():
    tried = []
    for why, path in _candidates():
        if not os.path.exists(path):
            tried.append(f"{path} ({why}): not found")
            continue
        try:
            # CDLL (not PyDLL): every call releases the GIL.
            return ctypes.CDLL(path), path
        except OSError as e:
            tried.append(f"{path} ({why}): {e}")
    if not os.environ.get("MOONCAKE_LIB"):
        tried.append("MOONCAKE_LIB: not set (point it at a libmooncake.so, e.g. "
                     "target/release/libmooncake.so of a `cargo build --release`)")
    raise ImportError(
        "mooncake: cannot load libmooncake.so; tried:\n  " + "\n  ".join(tried)
        + "\nInstall the package with `pip install ./python` from a checkout (it builds "
        "and bundles the library) or set MOONCAKE_LIB."
    )


class _Lib:
    """The bound functions as attributes; refuses a library that lacks any of them."""

    def __init__(self, cdll, path):
        self.path = path
        missing = [name for name in _SIGNATURES if not hasattr(cdll, name)]
        if missing:
            raise ImportError(
                f"mooncake: {path} lacks {len(missing)} function(s) of the C ABI this "
                f"package binds ({', '.join(missing[:5])}{', ...' if len(missing) > 5 else ''}): "
                "it is not the library this package was built with. Reinstall the package "
                "(`pip install ./python`) or point MOONCAKE_LIB at a current build.")
        for name, (restype, argtypes) in _SIGNATURES.items():
            fn = getattr(cdll, name)
            fn.restype = restype
            fn.argtypes = argtypes
            setattr(self, name, fn)


_cdll, LIB_PATH = _load()
LIB = _Lib(_cdll, LIB_PATH)

ABI_VERSION = int(LIB.mc_abi_version())
ABI_REVISION = int(LIB.mc_abi_revision())
if ABI_VERSION != EXPECTED_ABI_VERSION or ABI_REVISION < EXPECTED_ABI_REVISION:
    raise ImportError(
        f"mooncake: {LIB_PATH} implements C ABI version {ABI_VERSION} revision "
        f"{ABI_REVISION}; this package needs version {EXPECTED_ABI_VERSION}, revision "
        f"{EXPECTED_ABI_REVISION} or later")



def python_function(name):
    """The library's built-in function ``name``, called in CPython's own convention
    (``mc_python_function``: no ctypes conversion per call, the GIL given up by the
    function for its work); None where it cannot be had (another interpreter, a
    free-threaded build, a process whose C API the library does not find), and the
    caller keeps to ctypes."""
    if sys.implementation.name != "cpython" or sysconfig.get_config_var("Py_GIL_DISABLED"):
        return None
    definition = LIB.mc_python_function(name.encode())
    if not definition:
        return None
    try:
        # A private handle: the attribute's restype is ours to set.
        new = ctypes.PyDLL(None).PyCFunction_NewEx
    except (OSError, AttributeError) as e:
        logging.getLogger("mooncake").debug("mooncake: no fast %s: %s", name, e)
        return None
    new.restype = ctypes.py_object
    new.argtypes = [c_void_p, c_void_p, c_void_p]
    return new(definition, None, None)


def error_string(code):
    """The library's description of an error code."""
    try:
        s = LIB.mc_error_string(int(code))
    except Exception:  # never let error reporting fail
        return f"error {code}"
    return s.decode("utf-8", "replace") if s else f"error {code}"


def read_string(fn, *args, initial=256, limit=1 << 26):
    """Calls ``fn(*args, buf, len)`` (a copy-out-a-string function), growing buf on
    MC_ERR_BUFFER_OVERFLOW. Returns (code, text)."""
    size = initial
    while True:
        buf = ctypes.create_string_buffer(size)
        rc = fn(*args, buf, size)
        if rc == MC_ERR_BUFFER_OVERFLOW and size < limit:
            size *= 4
            continue
        if rc != MC_OK:
            return rc, ""
        return rc, buf.value.decode("utf-8", "replace")


def read_json_text(fn, *args, initial=4096):
    """Calls a describe-style function ``fn(*args, buf, len, &needed)``; returns (code, text)."""
    size = initial
    for _ in range(4):
        buf = ctypes.create_string_buffer(size)
        needed = c_size_t(0)
        rc = fn(*args, buf, size, ctypes.byref(needed))
        if rc == MC_ERR_BUFFER_OVERFLOW and needed.value > size:
            size = needed.value
            continue
        if rc != MC_OK:
            return rc, ""
        return rc, buf.value.decode("utf-8", "replace")
    return MC_ERR_BUFFER_OVERFLOW, ""


def c_key_array(keys):
    """A ``const char *[]`` of a list of two or more str keys, built by the library at C
    speed (``mc_store_key_array``); None when a key is not a str or not one the store
    takes (empty, too long, a NUL inside, not encodable): the caller then goes key by
    key and answers each as it would have."""
    n = len(keys)
    if n < 2:
        return None
    try:
        packed = ("\0".join(keys) + "\0").encode()
    except (TypeError, UnicodeEncodeError):
        return None
    out = (c_char_p * n)()
    if LIB.mc_store_key_array(packed, len(packed), n, out) != MC_OK:
        return None
    out.keep = packed  # the bytes the pointers point into
    return out


def c_strings(items):
    """A ``const char *[]`` for encoded strings (the caller keeps ``items`` alive).

    Batch calls pass thousands of keys: when every item is bytes they are laid end to
    end, NUL-terminated, in one buffer the array keeps, and the pointers are computed
    at C speed (ctypes converts item by item, about 0.3 us each)."""
    n = len(items)
    try:
        blob = b"\0".join(items) + b"\0" if n else None
    except TypeError:  # None (NULL) or str among them
        blob = None
    if blob is None:
        return (c_char_p * max(n, 1))(*items)
    base = ctypes.cast(c_char_p(blob), c_void_p).value
    steps = chain((base,), map(operator.add, map(len, items), repeat(1)))
    out = (c_char_p * n).from_buffer(array.array("Q", islice(accumulate(steps), n)))
    out.keep = blob  # the bytes the pointers point into
    return out


# ctypes integer types an array.array of the same width converts at C speed.
_WIDTH_TWIN = {
    t: code
    for t, code in ((c_void_p, "Q"), (c_size_t, "Q"), (c_uint64, "Q"), (c_int64, "q"),
                    (c_uint32, "I"), (c_int, "i"))
    if array.array(code).itemsize == ctypes.sizeof(t)
}


def c_array(ctype, values):
    """A ``ctype[]`` of ``values`` (at least one element)."""
    code = _WIDTH_TWIN.get(ctype)
    if code is not None and len(values):
        try:
            return (ctype * len(values)).from_buffer(array.array(code, values))
        except (TypeError, OverflowError):
            pass  # None, or out of the type's range: ctypes' own conversion decides
    return (ctype * max(len(values), 1))(*values)
