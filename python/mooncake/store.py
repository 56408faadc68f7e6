"""``mooncake.store``: Mooncake Store's Python API over libmooncake's C ABI.

Conventions (Mooncake 0.3.x): int results are 0 or a negative Mooncake error code (see
``ErrorCode``); sizes/bytes read are >= 0 or negative; data-returning calls give ``b""`` /
``None`` on a miss; batch calls return one result per key, in order. Calls before
``setup`` return INVALID_PARAMS (-600) (``get`` gives ``b""``, ``health_check`` 1) rather
than crashing. Wrong argument types raise TypeError; parallel lists of different lengths
fail the call with INVALID_PARAMS (per key for calls that return lists), as upstream's do,
and nothing is sent.

Zero-copy calls (``put_from``, ``get_into``, ``batch_*_into/from``, multi-buffer and range
forms) take addresses that must lie inside a buffer passed to ``register_buffer`` on this
store; any other address fails its key with INVALID_PARAMS (-600) without being sent
(this binding's choice, checked in Python against its table of registered buffers).
Keys are str (or UTF-8 bytes) of 1 to 4096 bytes; anything else fails its key with
INVALID_KEY (-400).
"""

import array
import ctypes
import enum
import json
import logging
import mmap
import operator
import os
import threading

from . import _native as N
from ._common import (
    HARDWARE_PROTOCOLS,
    JUST_INT,
    U64_MAX,
    ErrorCode,
    Registered,
    bind_address_for,
    buffer_address,
    check_int,
    check_str,
    int_list,
    lengths_match,
    metadata_connection,
    new_config,
    repeated_u64,
    split_host_port,
    start_native,
    store_client_ports,
    transfer_timeout_ms,
    u64_array,
)
from . import _tensor_layout
from ._replicate import (  # noqa: F401  (_bool and _strs: for _dummy)
    ObjectDataType,
    ReplicateConfig,
    SoftPinAction,
    _bool,
    _config,
    SAME_NODE_ONE_REPLICA,
    SAME_NODE_REFUSED,
    _refusal,
    _strs,
    _u64,
)
from ._tensor_layout import ParallelAxis, ReadTarget, TensorParallelism
from ._tensor_read import tensor_in
from ._engram import EngramStore, EngramStoreConfig
from ._host_memory import bind_to_numa_node, get_alloc_func_addr, get_free_func_addr
from ._spdk_nof import MooncakeDistributedNoFRegister
from ._store_surface import QueryTaskResponse, StoreSurfaceMixin, TaskStatus, TaskType
from ._tensor_store import TensorStoreMixin, _host_tensor
from .mooncake_config import bool_word, parse_size, port_number

__all__ = [
    "MooncakeDistributedStore",
    "ReplicateConfig",
    "SoftPinAction",
    "ObjectDataType",
    "Descriptor",
    "MooncakeDistributedNoFRegister",
    "EngramStore",
    "EngramStoreConfig",
    "bind_to_numa_node",
    "get_alloc_func_addr",
    "get_free_func_addr",
    "ReplicaStatus",
    "ErrorCode",
    "BufferHandle",
    "BufferDescriptor",
    "MemoryDescriptor",
    "DiskDescriptor",
    "ReplicaDescriptor",
    "MooncakeHostMemAllocator",
    "ParallelAxis",
    "TensorParallelism",
    "ReadTarget",
    "TaskType",
    "TaskStatus",
    "QueryTaskResponse",
]

logger = logging.getLogger("mooncake")


INVALID_PARAMS = int(ErrorCode.INVALID_PARAMS)
INVALID_KEY = int(ErrorCode.INVALID_KEY)
NO_AVAILABLE_HANDLE = int(ErrorCode.NO_AVAILABLE_HANDLE)


class ReplicaStatus(enum.IntEnum):
    UNDEFINED = 0
    INITIALIZED = 1
    PROCESSING = 2
    COMPLETE = 3
    REMOVED = 4
    FAILED = 5


def _dict_bool(value, name):
    """A config dict's boolean; as upstream's setup(dict), anything else keeps the default
    (False), with a warning."""
    parsed = bool_word(value)
    if parsed is None:
        logger.warning("mooncake: setup(config): %s=%r is not a boolean; using false",
                       name, value)
    return bool(parsed)


_per_thread = threading.local()


def _u64_spares():
    """This thread's spare u64 out-parameters, each (value, pointer to it). A zero-copy
    call takes one and gives it back, so it allocates none once warm, and a signal
    handler calling in between (on this thread) takes another."""
    try:
        return _per_thread.u64
    except AttributeError:
        _per_thread.u64 = []
        return _per_thread.u64


def _new_u64():
    v = ctypes.c_uint64(0)
    return v, ctypes.pointer(v)


def _encode_key(key, name="key", index=None):
    """The key's bytes, or None when it cannot be a key (not UTF-8, contains NUL). A
    non-str key is a TypeError naming it (``name[index]`` in a list)."""
    if isinstance(key, str):
        try:
            b = key.encode("utf-8")
        except UnicodeEncodeError:
            return None
    elif isinstance(key, bytes):
        b = key
    else:
        where = name if index is None else f"{name}[{index}]"
        raise TypeError(f"{where}: expected str, got {type(key).__name__}")
    if not b or len(b) > N.MC_STORE_MAX_KEY_LEN or b"\0" in b:
        return None
    return b


def _metadata_put_args(key, buffer_ptr, metadata_buffer_ptr, size, metadata_size, config):
    """put_from_with_metadata's checked arguments: the key, the addresses and lengths of
    its non-empty pieces (metadata first), and the config."""
    k = _encode_key(key)
    addr = check_int(buffer_ptr, "buffer_ptr")
    maddr = check_int(metadata_buffer_ptr, "metadata_buffer_ptr")
    n = check_int(size, "size")
    mn = check_int(metadata_size, "metadata_size")
    pieces = [(a, m) for a, m in ((maddr, mn), (addr, n)) if m > 0]
    return k, [a for a, _ in pieces], [m for _, m in pieces], _config(config)


def _key_list(keys, name="keys"):
    if isinstance(keys, (str, bytes)) or not hasattr(keys, "__iter__"):
        raise TypeError(f"{name}: expected a list of str, got {type(keys).__name__}")
    return list(keys)


_KEY_TYPES = (str, bytes)  # a key as given; _encode_key checks its content
# One zeroed result, repeated into a batch's results array (cheaper than from bytes).
_ZERO_I64 = array.array("q", [0])
# The library's batch_get_into in CPython's own convention, or None (see
# _native.python_function).
_FAST_BATCH_GET_INTO = N.python_function("batch_get_into")


def _keys(keys, name="keys"):
    """Encoded keys (None where a key is invalid); TypeError for non-str keys."""
    ks = _key_list(keys, name)
    # The common case at C speed: every key a str that encodes to 1..MAX bytes without
    # NUL (the join has exactly the separators' NULs). Anything else: key by key.
    try:
        enc = list(map(str.encode, ks))
    except (TypeError, UnicodeEncodeError):
        enc = None
    if enc is not None and (not enc or (
            min(map(len, enc)) > 0 and max(map(len, enc)) <= N.MC_STORE_MAX_KEY_LEN
            and b"\0".join(enc).count(0) == len(enc) - 1)):
        return enc
    return [_encode_key(k, name, i) for i, k in enumerate(ks)]


def _shown(key):
    """A key as logs show it, str or bytes alike."""
    return key.decode("utf-8", "replace") if isinstance(key, bytes) else key


class BufferHandle(bytearray):
    """The value of ``get_buffer``: a bytearray (so it exposes the buffer protocol) with
    upstream's ``ptr()`` and ``size()``. Once ``ptr()`` has given its address, the memory
    stays put for the object's life (the view behind it pins the bytearray)."""

    def __init__(self, size_or_data):
        super().__init__(size_or_data)
        self._view = None

    def ptr(self):
        if self._view is None and len(self):
            self._view = (ctypes.c_char * len(self)).from_buffer(self)
        return ctypes.addressof(self._view) if self._view is not None else 0

    def size(self):
        return len(self)


class BufferDescriptor:
    """Where one piece of a memory replica lives."""

    __slots__ = ("size", "buffer_address", "protocol", "transport_endpoint")

    def __init__(self, size=0, buffer_address=0, protocol="", transport_endpoint=""):
        self.size = size
        self.buffer_address = buffer_address
        self.protocol = protocol
        self.transport_endpoint = transport_endpoint

    def __repr__(self):
        return (f"<BufferDescriptor size={self.size} buffer_address={self.buffer_address} "
                f"transport_endpoint={self.transport_endpoint}>")


class MemoryDescriptor:
    """``buffer_descriptor``: the first piece (upstream's field); ``buffer_descriptors``:
    every piece, which concatenate to the value."""

    __slots__ = ("buffer_descriptor", "buffer_descriptors")

    def __init__(self, pieces):
        self.buffer_descriptors = pieces
        self.buffer_descriptor = pieces[0] if pieces else BufferDescriptor()


class DiskDescriptor:
    __slots__ = ("file_path", "object_size")

    def __init__(self, file_path="", object_size=0):
        self.file_path = file_path
        self.object_size = object_size


class Descriptor:
    """Upstream's descriptor of an allocated buffer (memory only): ``size``,
    ``buffer_address`` and ``transport_endpoint``, read/write, built empty."""

    __slots__ = ("_size", "_buffer_address", "_transport_endpoint")

    def __init__(self):
        self._size = 0
        self._buffer_address = 0
        self._transport_endpoint = ""

    # Upstream's typed fields: any bad value, out of range included, is a TypeError.
    size = property(lambda self: self._size,
                    lambda self, v: setattr(self, "_size", _u64(v, "size")))
    buffer_address = property(
        lambda self: self._buffer_address,
        lambda self, v: setattr(self, "_buffer_address", _u64(v, "buffer_address")))
    transport_endpoint = property(
        lambda self: self._transport_endpoint,
        lambda self, v: setattr(self, "_transport_endpoint",
                                check_str(v, "transport_endpoint")))

    def __repr__(self):
        return (f"<Descriptor size={self._size} buffer_address={self._buffer_address} "
                f"transport_endpoint={self._transport_endpoint}>")


_STATUS = {s.name.lower(): s for s in ReplicaStatus}


class ReplicaDescriptor:
    """One replica of an object (from mc_store_replica_desc)."""

    __slots__ = ("status", "kind", "size", "_memory", "_disk")

    def __init__(self, obj, size):
        self.kind = str(obj.get("kind", "memory"))
        self.status = _STATUS.get(str(obj.get("status", "")).lower(), ReplicaStatus.UNDEFINED)
        self.size = size
        pieces = [
            BufferDescriptor(int(p.get("len", 0)), int(p.get("addr", 0)),
                             str(p.get("protocol", "")), str(p.get("segment", "")))
            for p in obj.get("pieces") or []
        ]
        self._memory = MemoryDescriptor(pieces) if self.kind == "memory" else None
        # "local_disk": a copy in a node's disk tier (upstream's LOCAL_DISK replica);
        # "disk": upstream's shared-file-system replica.
        self._disk = (DiskDescriptor(str(obj.get("file_path", obj.get("path", ""))),
                                     int(obj.get("object_size", size)))
                      if self.kind == "disk" else None)

    def is_memory_replica(self):
        return self._memory is not None

    def is_disk_replica(self):
        return self._disk is not None

    def is_local_disk_replica(self):
        return self.kind == "local_disk"

    def get_memory_descriptor(self):
        if self._memory is None:
            raise RuntimeError("not a memory replica")
        return self._memory

    def get_disk_descriptor(self):
        if self._disk is None:
            raise RuntimeError("not a disk replica")
        return self._disk

    def __repr__(self):
        return f"<ReplicaDescriptor kind={self.kind} status={self.status.name} size={self.size}>"


# setup()'s settings beyond the seven positional ones, with their defaults (upstream's).
_SETUP_OPTIONS = {
    "enable_ssd_offload": False,
    "ssd_offload_path": "",
    "tenant_id": "default",
    "enable_client_http_server": False,
    "client_http_port": 9300,
    "ipc_socket_path": "",
}
# Our extension: the cluster secret (docs/security.md), as the secret or a file holding it.
_SECRET_KEYS = ("cluster_secret", "cluster_secret_file")
_DICT_KEYS = {
    "local_hostname": "local_hostname",
    "metadata_server": "metadata_server",
    "global_segment_size": "global_segment_size",
    "local_buffer_size": "local_buffer_size",
    "protocol": "protocol",
    "rdma_devices": "rdma_devices",
    "device_name": "rdma_devices",
    "master_server_addr": "master_server_addr",
    "master_server_address": "master_server_addr",
}
# A config dict's defaults for what it leaves out (upstream's setup(dict)).
_DICT_DEFAULTS = {
    "global_segment_size": 16 << 20,
    "local_buffer_size": 16 << 20,
    "protocol": "tcp",
    "rdma_devices": "",
    "master_server_addr": "127.0.0.1:50051",
}
# Upstream's bounds on a config dict's sizes: 0, or 1 KiB up (the local buffer: to 1 TiB).
_MIN_SEGMENT = 1 << 10
_MAX_LOCAL_BUFFER = 1 << 40
_MISSING = object()


def _by_group(config, idx):
    """The keys at ``idx`` split by the group upstream's per-key ``group_ids`` give each
    (config.group_ids[i]; "" for none), as (indices, encoded groups for all of them): the
    C ABI's put options name groups for a whole batch. Order within a group is kept."""
    if config.group_ids is None:
        return [(idx, ())]
    batches = {}
    for i in idx:
        batches.setdefault(config.group_ids[i], []).append(i)
    return [(members, (g.encode(),) if g else ()) for g, members in batches.items()]


def _triage(keys, items):
    """Per-key results pre-filled with INVALID_KEY for keys that failed to encode (None)
    and INVALID_PARAMS for items that failed their checks (None), 0 elsewhere; and the
    indexes of the keys left to ask the library about."""
    results = [0] * len(keys)
    if None not in keys and None not in items:
        return results, list(range(len(keys)))
    idx = []
    for i, (k, item) in enumerate(zip(keys, items)):
        if k is None:
            results[i] = INVALID_KEY
        elif item is None:
            results[i] = INVALID_PARAMS
        else:
            idx.append(i)
    return results, idx


class MooncakeDistributedStore(TensorStoreMixin, StoreSurfaceMixin):
    """A client of Mooncake Store (optionally lending memory to the pool). The tensor
    methods (put_tensor, get_tensor, ...) come from _tensor_store; sessions, copy and move
    tasks and extra segments from _store_surface."""

    def __init__(self):
        self._store = None
        self._registered = Registered()
        self._engine = None  # a TransferEngine shared through setup(engine=)
        self._local_buffer_size = 0
        self._protocol = "tcp"

    # ------------------------------------------------------------ lifecycle

    def setup(self, local_hostname=_MISSING, metadata_server=_MISSING,
              global_segment_size=_MISSING, local_buffer_size=_MISSING, protocol=_MISSING,
              rdma_devices=_MISSING, master_server_addr=_MISSING, engine=None,
              enable_ssd_offload=False, ssd_offload_path="", tenant_id="default",
              enable_client_http_server=False, client_http_port=9300, *,
              ipc_socket_path="", config=_MISSING):
        """Connects to the master and mounts ``global_segment_size`` bytes (0 = a pure
        client). 0 on success, else a negative error code.

        Either upstream's positional settings (``engine`` onward optional), or one dict
        with keys local_hostname and metadata_server (required), global_segment_size and
        local_buffer_size (ints or sizes like "4GB"; 16 MiB each when left out), protocol,
        rdma_devices, master_server_addr, enable_ssd_offload, ssd_offload_path,
        tenant_id, enable_client_http_server, client_http_port, and our cluster_secret or
        cluster_secret_file (docs/security.md; otherwise MC_CLUSTER_SECRET applies). As
        upstream, a dict whose values cannot be read gives INVALID_PARAMS (-600) instead of
        raising, and keys it does not know are ignored (with a warning naming them).

        A local_hostname without a port gets one in [MC_STORE_CLIENT_MIN_PORT,
        MC_STORE_CLIENT_MAX_PORT] (12300-14300), tried up to MC_STORE_CLIENT_SETUP_RETRIES
        (20) times; ``get_hostname()`` then reports host:port."""
        if config is not _MISSING:  # upstream's second form, by keyword
            if local_hostname is not _MISSING or not isinstance(config, dict):
                raise TypeError("setup(config=...): a dict, and the only argument")
            local_hostname = config
        if isinstance(local_hostname, dict):
            rest = (metadata_server, global_segment_size, local_buffer_size, protocol,
                    rdma_devices, master_server_addr)
            options = (enable_ssd_offload, ssd_offload_path, tenant_id,
                       enable_client_http_server, client_http_port, ipc_socket_path)
            if any(v is not _MISSING for v in rest) or engine is not None or \
                    options != tuple(_SETUP_OPTIONS.values()):
                raise TypeError("setup(config): a config dict is the only argument (its "
                                "keys carry the options)")
            args = self._from_dict(local_hostname)
            if args is None:
                return INVALID_PARAMS
        else:
            given = [local_hostname, metadata_server, global_segment_size, local_buffer_size,
                     protocol, rdma_devices, master_server_addr]
            names = ["local_hostname", "metadata_server", "global_segment_size",
                     "local_buffer_size", "protocol", "rdma_devices", "master_server_addr"]
            missing = [n for n, v in zip(names, given) if v is _MISSING]
            if missing:
                raise TypeError("setup() missing required arguments: " + ", ".join(missing))
            args = dict(zip(names, given))
            args.update(enable_ssd_offload=enable_ssd_offload,
                        ssd_offload_path=ssd_offload_path, tenant_id=tenant_id,
                        enable_client_http_server=enable_client_http_server,
                        client_http_port=client_http_port, ipc_socket_path=ipc_socket_path)
            self._check_setup_args(args)
        if engine is not None and not hasattr(engine, "get_session_id"):
            raise TypeError(f"engine: expected a TransferEngine (get_engine()), got "
                            f"{type(engine).__name__}")
        return self._setup(args, engine)

    @staticmethod
    def _check_setup_args(args):
        """Type-checks and normalizes ``args`` in place (raising TypeError/ValueError)."""
        for name in ("local_hostname", "metadata_server", "protocol", "master_server_addr",
                     "ssd_offload_path", "tenant_id", "ipc_socket_path"):
            check_str(args[name], name)
        if args["rdma_devices"] is None:
            args["rdma_devices"] = ""
        check_str(args["rdma_devices"], "rdma_devices")
        args["global_segment_size"] = parse_size(args["global_segment_size"],
                                                 "global_segment_size")
        args["local_buffer_size"] = parse_size(args["local_buffer_size"], "local_buffer_size")
        _bool(args["enable_ssd_offload"], "enable_ssd_offload")
        _bool(args["enable_client_http_server"], "enable_client_http_server")
        check_int(args["client_http_port"], "client_http_port", 0, 65535)

    def _setup(self, args, engine):
        gss, lbs = args["global_segment_size"], args["local_buffer_size"]
        ssd_path = args["ssd_offload_path"] or os.getenv("MOONCAKE_OFFLOAD_FILE_STORAGE_PATH", "")
        if args["enable_ssd_offload"] and not ssd_path:
            logger.warning("mooncake: enable_ssd_offload needs ssd_offload_path (or "
                           "MOONCAKE_OFFLOAD_FILE_STORAGE_PATH); no disk tier")
        if args["enable_client_http_server"]:
            logger.warning("mooncake: enable_client_http_server: this client serves no HTTP "
                           "endpoints (the master's metrics port reports the store)")
        if args["tenant_id"] != "default":
            logger.warning("mooncake: tenant_id %r: this build keeps one namespace for all "
                           "tenants (no isolation, no quota)", args["tenant_id"])
        if args["ipc_socket_path"]:
            logger.warning("mooncake: ipc_socket_path is not used: dummy clients reach "
                           "mooncake_client through its --port")
        shared = engine is not None and getattr(engine, "_engine", None)
        if engine is not None and not shared:
            logger.warning("mooncake: the engine given to setup() is not initialized: the "
                           "store starts its own")
        host, port = split_host_port(args["local_hostname"])
        conn = metadata_connection(args["metadata_server"])
        if conn is None:
            return -1
        if self._store is not None:
            self.close()
        proto = args["protocol"].strip().lower()
        settings = {
            "master_address": args["master_server_addr"],
            "metadata": conn,
            "upstream_protocol": proto,  # as TransferEngine.initialize passes it
            "bind_address": bind_address_for(host),
            "global_segment_size": gss,
            "local_buffer_size": lbs,
        }
        if args["enable_ssd_offload"] and ssd_path and gss > 0:
            settings["ssd_path"] = ssd_path
        if proto in HARDWARE_PROTOCOLS and args["rdma_devices"] and \
                args["rdma_devices"] != "auto-discovery":
            settings["device_name"] = args["rdma_devices"]
        timeout = transfer_timeout_ms()
        if timeout is not None:
            settings["transfer_timeout_ms"] = timeout
        for key in _SECRET_KEYS:
            if args.get(key):
                settings[key] = args[key]
        if shared:
            # The engine's identity, transports and memory serve the store.
            rc, handle = self._start_on(engine, {k: settings[k] for k in (
                "master_address", "global_segment_size", "local_buffer_size")})
        else:
            rc, handle = start_native(N.LIB.mc_store_new, settings, host, port,
                                      conn == "P2PHANDSHAKE", "local_hostname",
                                      port_range=store_client_ports())
        if rc != N.MC_OK:
            logger.error("mooncake: store setup (master %s, metadata %s) failed: %s (%d)",
                         args["master_server_addr"], args["metadata_server"],
                         N.error_string(rc), rc)
            return rc
        self._store = handle
        self._engine = engine if shared else None
        self._local_buffer_size = lbs
        self._protocol = proto
        return 0

    @staticmethod
    def _start_on(engine, settings):
        """A store on ``engine``'s native handle: (code, handle or None)."""
        cfg, rc = new_config(settings)
        if cfg is None:
            return rc, None
        out = ctypes.c_void_p()
        try:
            rc = N.LIB.mc_store_new_with_engine(cfg, engine._engine, ctypes.byref(out))
        finally:
            N.LIB.mc_config_free(cfg)
        return rc, (out.value if rc == N.MC_OK else None)

    @staticmethod
    def _from_dict(config):
        """setup()'s arguments from a config dict, or None (after logging why) when a value
        cannot be read: upstream's setup(dict) answers INVALID_PARAMS then."""
        args = dict(_DICT_DEFAULTS, **_SETUP_OPTIONS)
        ignored = []
        for key, value in config.items():
            if not isinstance(key, str):
                ignored.append(repr(key))
            elif key in _DICT_KEYS:
                args[_DICT_KEYS[key]] = value
            elif key in _SETUP_OPTIONS or key in _SECRET_KEYS:
                args[key] = value
            else:
                ignored.append(key)
        if ignored:
            logger.warning("mooncake: setup(config): ignoring unknown keys %s",
                           ", ".join(sorted(ignored)))
        for required in ("local_hostname", "metadata_server"):
            if not args.get(required):
                logger.error("mooncake: setup(config): %r is required", required)
                return None
        # Upstream reads every value as its string form; so do booleans and ports here. A
        # secret is taken only as given (a str), never as the text of some other object.
        for key in ("enable_ssd_offload", "enable_client_http_server"):
            args[key] = _dict_bool(args[key], key)
        try:
            for key in ("local_hostname", "metadata_server", "protocol", "rdma_devices",
                        "master_server_addr", "ssd_offload_path", "tenant_id",
                        "ipc_socket_path"):
                if not isinstance(args[key], str):
                    args[key] = "" if args[key] is None else str(args[key])
            for key in _SECRET_KEYS:
                if key in args:
                    check_str(args[key], key)
            args["client_http_port"] = port_number(args["client_http_port"],
                                                   "client_http_port")
            MooncakeDistributedStore._check_setup_args(args)
        except (TypeError, ValueError, OverflowError) as e:
            logger.error("mooncake: setup(config): %s", e)
            return None
        gss, lbs = args["global_segment_size"], args["local_buffer_size"]
        if 0 < gss < _MIN_SEGMENT or 0 < lbs < _MIN_SEGMENT or lbs > _MAX_LOCAL_BUFFER:
            logger.error("mooncake: setup(config): global_segment_size %d and "
                         "local_buffer_size %d must each be 0 or at least %d bytes (the "
                         "local buffer at most %d)", gss, lbs, _MIN_SEGMENT, _MAX_LOCAL_BUFFER)
            return None
        return args

    def setup_dummy(self, mem_pool_size, local_buffer_size, server_address):
        """Makes this store a dummy client of the ``mooncake_client`` at ``server_address``
        ("host:port", on this host): every call then runs there, bytes moving through
        shared memory (``local_buffer_size`` for copying calls, ``alloc_from_mem_pool``
        for zero-copy ones). 0, or a negative error code (see ``mooncake._dummy``)."""
        from . import _dummy

        return _dummy.attach(self, mem_pool_size, local_buffer_size, server_address)

    def close(self):
        """Unmounts this client's segment (objects only stored there are gone) and
        disconnects. 0 (also when not set up)."""
        store, self._store = self._store, None
        if store:
            N.LIB.mc_store_free(store)
        self._registered.clear()
        self._engine = None
        return 0

    def __del__(self):
        try:
            self.close()
        except Exception:
            pass

    def health_check(self):
        """0 healthy, 1 not set up, 2 master unreachable."""
        if not self._store:
            return 1
        return 0 if N.LIB.mc_store_health(self._store) == N.MC_OK else 2

    def get_hostname(self):
        """This client's segment name (host:port); "" before setup."""
        if not self._store:
            return ""
        rc, name = N.read_string(N.LIB.mc_store_hostname, self._store)
        return name if rc == N.MC_OK else ""

    # ------------------------------------------------------------ internals

    def _put_options(self, upsert, groups=()):
        """mc_put_options for a batch whose every key joins ``groups`` (encoded)."""
        opts = N.McPutOptions()
        N.LIB.mc_put_options_init(ctypes.byref(opts))
        arr = N.c_strings(list(groups))
        if groups:
            opts.group_ids = ctypes.cast(arr, ctypes.POINTER(ctypes.c_char_p))
        opts.group_ids_count = len(groups)
        opts.upsert = int(upsert)
        return opts, arr

    def _put_parts(self, keys, parts, config, upsert, what, same_node=SAME_NODE_REFUSED):
        """Puts key i from the (addr, len) pairs parts[i] with mc_store_batch_put_parts.
        ``keys`` are encoded (None = invalid key). Returns per-key results. ``same_node``:
        how this path takes prefer_alloc_in_same_node (see ``_replicate._refusal``)."""
        results, idx = _triage(keys, parts)
        if not idx:
            return results
        refusal = _refusal(config, len(keys), same_node)
        if refusal:
            for i in idx:
                results[i] = refusal
            return results
        cfg, keep = config._to_c()
        for members, groups in _by_group(config, idx):
            flat_addr, flat_len, counts = [], [], []
            for i in members:
                counts.append(len(parts[i]))
                for a, n in parts[i]:
                    flat_addr.append(a)
                    flat_len.append(n)
            opts, keep2 = self._put_options(upsert, groups)
            c_res = (ctypes.c_int * len(members))()
            rc = N.LIB.mc_store_batch_put_parts(
                self._store, N.c_strings([keys[i] for i in members]), len(members),
                N.c_array(ctypes.c_void_p, flat_addr), N.c_array(ctypes.c_size_t, flat_len),
                N.c_array(ctypes.c_size_t, counts), ctypes.byref(cfg), ctypes.byref(opts),
                c_res)
            for j, i in enumerate(members):
                results[i] = rc if rc != N.MC_OK else int(c_res[j])
        return results

    def _zero_copy(self, addr, size):
        # With a shared engine, what it registered is registered for the store too.
        return self._registered.covers(addr, size) or (
            self._engine is not None and self._engine._local.covers(addr, size))

    def _log_unregistered(self, addr, size):
        logger.error("mooncake: buffer [0x%x, +%d) is not inside a buffer registered with "
                     "register_buffer on this store; refused (-600)", addr, size)

    # ------------------------------------------------------------ copying API

    def _copy_put(self, key, value, config, upsert, what):
        k = _encode_key(key)
        config = _config(config)
        addr, n, keep = buffer_address(value)
        if not self._store:
            return INVALID_PARAMS
        if k is None:
            return INVALID_KEY
        if n > self._local_buffer_size:
            # Upstream stages copying puts through the local buffer.
            logger.error("mooncake: %s of %d bytes exceeds local_buffer_size (%d)", what, n,
                         self._local_buffer_size)
            return NO_AVAILABLE_HANDLE
        if upsert or config.group_ids:
            return self._put_parts([k], [[(addr, n)]], config, upsert, what)[0]
        refusal = _refusal(config)
        if refusal:
            return refusal
        cfg, keep2 = config._to_c()
        return N.LIB.mc_store_put(self._store, k, addr, n, ctypes.byref(cfg))

    def put(self, key, value, config=None):
        """Stores ``value`` (bytes-like) under ``key``; an existing key keeps its value (0)."""
        return self._copy_put(key, value, config, False, "put")

    def upsert(self, key, value, config=None):
        """As put, replacing an existing value (OBJECT_HAS_LEASE while a reader holds it)."""
        return self._copy_put(key, value, config, True, "upsert")

    def _copy_put_parts(self, key, parts, config, upsert, what):
        k = _encode_key(key)
        config = _config(config)
        bufs = [buffer_address(p, f"parts[{i}]") for i, p in enumerate(parts)]
        if not self._store:
            return INVALID_PARAMS
        if k is None:
            return INVALID_KEY
        total = sum(b[1] for b in bufs)
        if total > self._local_buffer_size:
            logger.error("mooncake: %s of %d bytes exceeds local_buffer_size (%d)", what, total,
                         self._local_buffer_size)
            return NO_AVAILABLE_HANDLE
        return self._put_parts([k], [[(a, n) for a, n, _ in bufs]], config, upsert, what)[0]

    def put_parts(self, key, *parts, config=None):
        """Stores the concatenation of ``parts`` under ``key``."""
        return self._copy_put_parts(key, parts, config, False, "put_parts")

    def upsert_parts(self, key, *parts, config=None):
        return self._copy_put_parts(key, parts, config, True, "upsert_parts")

    def _copy_put_batch(self, keys, values, config, upsert, what):
        ks = _keys(keys)
        vals = list(values) if not isinstance(values, (str, bytes)) else None
        if vals is None:
            raise TypeError("values: expected a list of bytes-like objects")
        if not lengths_match(what, keys=ks, values=vals):
            return INVALID_PARAMS
        config = _config(config)
        bufs = [buffer_address(v, f"values[{i}]") for i, v in enumerate(vals)]
        if not self._store:
            return INVALID_PARAMS
        if not ks:
            return 0
        results = [0] * len(ks)
        parts = []
        for i, (k, (a, n, _)) in enumerate(zip(ks, bufs)):
            if n > self._local_buffer_size:
                parts.append(None)
                results[i] = NO_AVAILABLE_HANDLE
            else:
                parts.append([(a, n)])
        if upsert or config.group_ids or self._protocol in HARDWARE_PROTOCOLS:
            if upsert or config.group_ids:
                res = self._put_parts(ks, parts, config, upsert, what)
            elif refusal := _refusal(config, len(ks)):
                res = [refusal] * len(ks)
            else:
                # RDMA moves bytes from registered memory only: mc_store_put stages them.
                cfg, keep = config._to_c()
                res = [(INVALID_KEY if ks[i] is None else
                        N.LIB.mc_store_put(self._store, ks[i], parts[i][0][0], parts[i][0][1],
                                           ctypes.byref(cfg)))
                       if parts[i] is not None else NO_AVAILABLE_HANDLE
                       for i in range(len(ks))]
        else:
            res = self._batch_put_from(ks, [p[0] if p else None for p in parts], config)
        for i, r in enumerate(res):
            if results[i] == 0:
                results[i] = r
        return next((r for r in results if r != 0), 0)

    def put_batch(self, keys, values, config=None):
        """Stores every key; 0 if all succeeded, else the first error."""
        return self._copy_put_batch(keys, values, config, False, "put_batch")

    def upsert_batch(self, keys, values, config=None):
        return self._copy_put_batch(keys, values, config, True, "upsert_batch")

    def get(self, key):
        """The value under ``key``, or b"" on a miss or error. The library reads it into
        memory of its own, copied out and released: for one key that costs less than
        the allocation callback a read straight into the result takes."""
        k = _encode_key(key)
        if not self._store or k is None:
            return b""
        size = _new_u64()
        buf = ctypes.c_void_p()
        rc = N.LIB.mc_store_get_buffer(self._store, k, ctypes.byref(buf), size[1])
        if rc != N.MC_OK:
            if rc != N.MC_ERR_OBJECT_NOT_FOUND:
                logger.debug("mooncake: read %s: %s (%d)", _shown(k), N.error_string(rc), rc)
            return b""
        try:
            return ctypes.string_at(buf.value or 0, size[0].value)
        finally:
            N.LIB.mc_store_buffer_free(buf, size[0].value)

    def get_buffer(self, key):
        """The value as a BufferHandle (buffer protocol, ptr(), size()), or None."""
        k = _encode_key(key)
        return None if k is None else self._read_values([k])[0]

    def _read_values(self, keys):
        """A BufferHandle of the value under each key, read straight into it: the library
        asks for the memory once it knows the size, with one master round trip for all
        keys. None for each miss, invalid key or error."""
        plain = self._plain_keys(keys)
        if plain is not None:
            return self._read_into_handles(keys, plain)
        ks = _keys(keys)
        out = [None] * len(ks)
        idx = [i for i, k in enumerate(ks) if k is not None]
        if self._store and idx:
            asked = [ks[i] for i in idx]
            got = self._read_into_handles(asked, N.c_strings(asked))
            for j, i in enumerate(idx):
                out[i] = got[j]
        return out

    def _read_into_handles(self, names, c_keys):
        """``_read_values`` of the keys in ``c_keys`` (``names``: the same, for logs)."""
        n = len(names)
        handles = [None] * n

        def place(_ctx, j, size):
            handles[j] = BufferHandle(size)
            return handles[j].ptr()

        res = (ctypes.c_int64 * n)()
        rc = N.LIB.mc_store_batch_get_alloc(self._store, c_keys, n, N.ALLOC_FN(place), None,
                                            res)
        if rc != N.MC_OK:
            logger.debug("mooncake: read: %s (%d)", N.error_string(rc), rc)
            return [None] * n
        for j in range(n):
            if res[j] < 0:
                handles[j] = None
                if res[j] != N.MC_ERR_OBJECT_NOT_FOUND:
                    logger.debug("mooncake: read %s: %s (%d)", _shown(names[j]),
                                 N.error_string(res[j]), res[j])
        return handles

    def get_batch(self, keys):
        """Values of ``keys`` (b"" for each miss)."""
        return [b"" if g is None else bytes(g) for g in self._read_values(keys)]

    def batch_get_buffer(self, keys):
        """BufferHandles (None for each miss)."""
        return self._read_values(keys)

    def _one_key(self, key):
        """(encoded key, 0), or (None, the code a single-key call returns): INVALID_PARAMS
        before setup, INVALID_KEY for a key that cannot be encoded."""
        k = _encode_key(key)
        if not self._store:
            return None, INVALID_PARAMS
        if k is None:
            return None, INVALID_KEY
        return k, 0

    # ------------------------------------------------------------ query / remove

    def is_exist(self, key):
        """1 if stored, 0 if not, negative on error. Takes no lease."""
        k, refused = self._one_key(key)
        if refused:
            return refused
        return N.LIB.mc_store_exists(self._store, k)

    def batch_is_exist(self, keys):
        plain = self._plain_keys(keys)
        if plain is not None:
            return self._c_batch_exists(len(keys), plain)
        ks = _keys(keys)
        if not self._store:
            return [INVALID_PARAMS] * len(ks)
        results = [INVALID_KEY] * len(ks)
        idx = [i for i, k in enumerate(ks) if k is not None]
        if idx:
            got = self._c_batch_exists(len(idx), N.c_strings([ks[i] for i in idx]))
            for j, i in enumerate(idx):
                results[i] = got[j]
        return results

    def _plain_keys(self, keys):
        """The C key array of a list of two or more str keys the store takes, on a store
        set up; None for anything else (the key-by-key path answers)."""
        return N.c_key_array(keys) if type(keys) is list and self._store else None

    def _c_batch_exists(self, n, c_keys):
        c_res = (ctypes.c_int * n)()
        rc = N.LIB.mc_store_batch_exists(self._store, c_keys, n, c_res)
        return c_res[:n] if rc == N.MC_OK else [rc] * n

    def get_size(self, key):
        """The object's size in bytes, or a negative error. Leases the object."""
        k, refused = self._one_key(key)
        if refused:
            return refused
        size = ctypes.c_uint64(0)
        rc = N.LIB.mc_store_size(self._store, k, ctypes.byref(size))
        return size.value if rc == N.MC_OK else rc

    def remove(self, key, force=False):
        k = _encode_key(key)
        _bool(force, "force")
        if not self._store:
            return INVALID_PARAMS
        if k is None:
            return INVALID_KEY
        return N.LIB.mc_store_remove(self._store, k, int(force))

    def remove_by_regex(self, regex_pattern, force=False):
        """The number of objects removed, or a negative error."""
        check_str(regex_pattern, "regex_pattern")
        _bool(force, "force")
        if not self._store:
            return INVALID_PARAMS
        n = ctypes.c_uint64(0)
        rc = N.LIB.mc_store_remove_by_regex(self._store, regex_pattern.encode(), int(force),
                                            ctypes.byref(n))
        return n.value if rc == N.MC_OK else rc

    def remove_all(self, force=False):
        """The number of objects removed (leased ones skipped unless ``force``)."""
        _bool(force, "force")
        if not self._store:
            return INVALID_PARAMS
        n = ctypes.c_uint64(0)
        rc = N.LIB.mc_store_remove_all(self._store, int(force), ctypes.byref(n))
        return n.value if rc == N.MC_OK else rc

    def batch_remove(self, keys, force=False):
        ks = _keys(keys)
        _bool(force, "force")
        if not self._store:
            return [INVALID_PARAMS] * len(ks)
        results = [INVALID_KEY] * len(ks)
        idx = [i for i, k in enumerate(ks) if k is not None]
        if not idx:
            return results
        c_keys = N.c_strings([ks[i] for i in idx])
        c_res = (ctypes.c_int * len(idx))()
        rc = N.LIB.mc_store_batch_remove(self._store, c_keys, len(idx), int(force), c_res)
        for j, i in enumerate(idx):
            results[i] = rc if rc != N.MC_OK else int(c_res[j])
        return results

    def _replica_desc(self, k):
        fn = N.LIB.mc_store_replica_desc
        rc, text = N.read_json_text(fn, self._store, k)
        if rc != N.MC_OK:
            return None
        try:
            obj = json.loads(text)
            size = int(obj.get("size", 0))
            return [ReplicaDescriptor(r, size) for r in obj.get("replicas") or []]
        except (ValueError, AttributeError, TypeError):
            logger.error("mooncake: malformed replica descriptor: %.200s", text)
            return None

    def get_replica_desc(self, key):
        """The object's replicas (ReplicaDescriptor list; [] on a miss). Leases it."""
        k = _encode_key(key)
        if not self._store or k is None:
            return []
        return self._replica_desc(k) or []

    def batch_get_replica_desc(self, keys):
        """{key: [ReplicaDescriptor, ...]} for the keys found."""
        keys = _key_list(keys)
        ks = _keys(keys)
        out = {}
        if not self._store:
            return out
        for key, k in zip(keys, ks):
            if k is None:
                continue
            desc = self._replica_desc(k)
            if desc is not None:
                out[key] = desc
        return out

    def batch_replica_clear(self, keys, segment_name=""):
        """Drops replicas (all, or those on ``segment_name``); the keys where something
        was dropped."""
        keys = _key_list(keys)
        ks = _keys(keys)
        check_str(segment_name, "segment_name")
        fn = N.LIB.mc_store_batch_replica_clear
        if not self._store:
            return []
        idx = [i for i, k in enumerate(ks) if k is not None]
        if not idx:
            return []
        c_keys = N.c_strings([ks[i] for i in idx])
        c_res = (ctypes.c_int * len(idx))()
        rc = fn(self._store, c_keys, len(idx), segment_name.encode(), c_res)
        if rc != N.MC_OK:
            return []
        return [keys[i] for j, i in enumerate(idx) if c_res[j] == 1]

    # ------------------------------------------------------------ zero-copy API

    def register_buffer(self, buffer_ptr, size):
        """Registers [buffer_ptr, buffer_ptr+size) for zero-copy puts and gets."""
        addr = check_int(buffer_ptr, "buffer_ptr")
        n = check_int(size, "size")
        if not self._store:
            return INVALID_PARAMS
        rc = N.LIB.mc_store_register_buffer(self._store, addr, n)
        if rc == N.MC_OK:
            self._registered.add(addr, n)
        else:
            logger.error("mooncake: register_buffer(0x%x, %d): %s (%d)", addr, n,
                         N.error_string(rc), rc)
        return rc

    def unregister_buffer(self, buffer_ptr):
        addr = check_int(buffer_ptr, "buffer_ptr")
        if not self._store:
            return INVALID_PARAMS
        rc = N.LIB.mc_store_unregister_buffer(self._store, addr)
        if rc == N.MC_OK:
            self._registered.remove(addr)
        return rc

    def _batch_put_from(self, ks, spans, config):
        """mc_store_batch_put_from over encoded keys and (addr, len) spans (None = fail
        with INVALID_PARAMS)."""
        results, idx = _triage(ks, spans)
        if not idx:
            return results
        refusal = _refusal(config, len(ks))
        if refusal:
            for i in idx:
                results[i] = refusal
            return results
        if len(idx) == 1:
            # One key (engines often batch one): the single call, no arrays to build.
            i = idx[0]
            cfg, _keep = config._to_c()
            results[i] = N.LIB.mc_store_put_from(self._store, ks[i], spans[i][0], spans[i][1],
                                                 ctypes.byref(cfg))
            return results
        every = len(idx) == len(ks)
        asked = spans if every else [spans[i] for i in idx]
        got = self._c_batch_put_from(
            config, len(idx), N.c_strings(ks if every else [ks[i] for i in idx]),
            N.c_array(ctypes.c_void_p, [a for a, _ in asked]),
            N.c_array(ctypes.c_size_t, [n for _, n in asked]))
        if every:
            return got
        for j, i in enumerate(idx):
            results[i] = got[j]
        return results

    def _c_batch_put_from(self, config, n, c_keys, c_bufs, c_lens):
        cfg, _keep = config._to_c()
        c_res = (ctypes.c_int * n)()
        rc = N.LIB.mc_store_batch_put_from(self._store, c_keys, c_bufs, c_lens, n,
                                           ctypes.byref(cfg), c_res)
        return c_res[:n] if rc == N.MC_OK else [rc] * n

    def _batch_get_into(self, ks, addrs, caps):
        n = len(ks)
        if n == 1:
            # One key (engines often batch one): the single call, no arrays to build.
            return [self._get_into_one(ks[0], addrs[0], caps[0])]
        return self._c_batch_get_into(n, N.c_strings(ks), N.c_array(ctypes.c_void_p, addrs),
                                      N.c_array(ctypes.c_size_t, caps))

    def _c_batch_get_into(self, n, c_keys, c_bufs, c_caps):
        c_res = (ctypes.c_int64 * max(n, 1))()
        rc = N.LIB.mc_store_batch_get_into(self._store, c_keys, c_bufs, c_caps, n, c_res)
        return c_res[:n] if rc == N.MC_OK else [rc] * n

    def _plain_lists(self, keys, buffer_ptrs, sizes):
        """The length of a batch call's three lists when they are plain lists of one
        length on a store set up (what the fast paths take); 0 for anything else."""
        if (type(keys) is list and type(buffer_ptrs) is list and type(sizes) is list
                and len(keys) == len(buffer_ptrs) == len(sizes) and self._store):
            return len(keys)
        return 0

    def _plain_batch(self, keys, buffer_ptrs, sizes):
        """(n, keys, addresses, sizes) as C arrays, built at C speed, for a batch of two or
        more str keys the store takes and plain int spans all inside registered memory
        (what engines pass); None for anything else, which the general path answers with
        the same results, errors and logs. Its per-element checks cost more than the
        call itself for a batch of small values."""
        if self._plain_lists(keys, buffer_ptrs, sizes) < 2:
            return None
        addrs, lens = u64_array(buffer_ptrs), u64_array(sizes)
        if addrs is None or lens is None:
            return None
        # An upper bound of the spans' end: past registered memory, the careful path.
        # (From the lists: their ints exist already, the arrays' would be made.)
        lo = min(buffer_ptrs)
        if not self._zero_copy(lo, max(buffer_ptrs) + max(sizes) - lo):
            return None
        c_keys = self._plain_keys(keys)
        if c_keys is None:
            return None
        n = len(keys)
        return (n, c_keys, (ctypes.c_void_p * n).from_buffer(addrs),
                (ctypes.c_size_t * n).from_buffer(lens))

    def _checked_spans(self, addrs, sizes):
        # The common case in one look: every span inside one registered buffer (the
        # lowest start to the highest end is).
        if addrs and len(addrs) == len(sizes):
            lo, hi = min(addrs), max(map(operator.add, addrs, sizes))
            if self._zero_copy(lo, hi - lo):
                return list(zip(addrs, sizes))
        spans = []
        for a, n in zip(addrs, sizes):
            if self._zero_copy(a, n):
                spans.append((a, n))
            else:
                self._log_unregistered(a, n)
                spans.append(None)
        return spans

    def _registered_run(self, addrs, sizes):
        """One key's (address, size) spans, or None when it has none or one lies outside
        registered memory."""
        spans = self._checked_spans(addrs, sizes)
        return spans if spans and None not in spans else None

    def put_from(self, key, buffer_ptr, size, config=None):
        """Stores ``size`` bytes at ``buffer_ptr`` (inside a registered buffer)."""
        k = _encode_key(key)
        addr = check_int(buffer_ptr, "buffer_ptr")
        n = check_int(size, "size")
        config = _config(config)
        if not self._store:
            return INVALID_PARAMS
        if k is None:
            return INVALID_KEY
        if not self._zero_copy(addr, n):
            self._log_unregistered(addr, n)
            return INVALID_PARAMS
        refusal = _refusal(config)
        if refusal:
            return refusal
        cfg, keep = config._to_c()
        return N.LIB.mc_store_put_from(self._store, k, addr, n, ctypes.byref(cfg))

    def upsert_from(self, key, buffer_ptr, size, config=None):
        k = _encode_key(key)
        addr = check_int(buffer_ptr, "buffer_ptr")
        n = check_int(size, "size")
        config = _config(config)
        if not self._store:
            return INVALID_PARAMS
        spans = self._checked_spans([addr], [n])
        return self._put_parts([k], [[spans[0]] if spans[0] else None], config, True,
                               "upsert_from")[0]

    def put_from_with_metadata(self, key, buffer_ptr, metadata_buffer_ptr, size,
                               metadata_size, config=None):
        """Stores metadata (``metadata_size`` bytes) followed by data (``size`` bytes)."""
        k, addrs, lens, config = _metadata_put_args(key, buffer_ptr, metadata_buffer_ptr,
                                                    size, metadata_size, config)
        if not self._store:
            return INVALID_PARAMS
        parts = self._registered_run(addrs, lens)
        return self._put_parts([k], [parts], config, False, "put_from_with_metadata")[0]

    def _zero_copy_batch_put(self, keys, buffer_ptrs, sizes, config, upsert, what):
        one = plain = None
        if not upsert:
            one = self._one_plain(keys, buffer_ptrs, sizes)
            plain = None if one is not None else self._plain_batch(keys, buffer_ptrs, sizes)
        if one is not None or plain is not None:
            config = _config(config)
            if one is not None and not config.group_ids:
                return self._batch_put_from([one[0]], [one[1:]], config)
            if plain is not None and not config.group_ids:
                refusal = _refusal(config, plain[0])
                if refusal:
                    return [refusal] * plain[0]
                return self._c_batch_put_from(config, *plain)
        ks = _keys(keys)
        addrs = int_list(buffer_ptrs, "buffer_ptrs")
        lens = int_list(sizes, "sizes")
        if not lengths_match(what, keys=ks, buffer_ptrs=addrs, sizes=lens):
            return [INVALID_PARAMS] * len(ks)
        config = _config(config)
        if not self._store:
            return [INVALID_PARAMS] * len(ks)
        spans = self._checked_spans(addrs, lens)
        if upsert or config.group_ids:
            return self._put_parts(ks, [[s] if s else None for s in spans], config, upsert, what)
        return self._batch_put_from(ks, spans, config)

    def batch_put_from(self, keys, buffer_ptrs, sizes, config=None):
        return self._zero_copy_batch_put(keys, buffer_ptrs, sizes, config, False,
                                         "batch_put_from")

    def batch_upsert_from(self, keys, buffer_ptrs, sizes, config=None):
        return self._zero_copy_batch_put(keys, buffer_ptrs, sizes, config, True,
                                         "batch_upsert_from")

    def get_into(self, key, buffer_ptr, size):
        """Reads the object into ``buffer_ptr`` (``size`` bytes, registered); the bytes
        read or a negative error (BUFFER_OVERFLOW -10 when the buffer is too small)."""
        k = _encode_key(key)
        addr = check_int(buffer_ptr, "buffer_ptr")
        n = check_int(size, "size")
        if not self._store:
            return INVALID_PARAMS
        if k is None:
            return INVALID_KEY
        if not self._zero_copy(addr, n):
            self._log_unregistered(addr, n)
            return INVALID_PARAMS
        return self._get_into_one(k, addr, n)

    def _get_into_one(self, k, addr, cap):
        """One checked read: the bytes read or a negative error."""
        spares = _u64_spares()
        out = spares.pop() if spares else _new_u64()
        try:
            rc = N.LIB.mc_store_get_into(self._store, k, addr, cap, out[1])
            return out[0].value if rc == N.MC_OK else rc
        finally:
            spares.append(out)

    def _one_plain(self, keys, buffer_ptrs, sizes):
        """(key bytes, address, size) of a batch call naming one key and one plain
        span inside registered memory, so it skips the list checks (an engine's batch
        is often one key); None for anything else, which the general path answers (the
        same results, errors and logs)."""
        if self._plain_lists(keys, buffer_ptrs, sizes) != 1:
            return None
        key, addr, n = keys[0], buffer_ptrs[0], sizes[0]
        if type(key) not in _KEY_TYPES or type(addr) is not int or type(n) is not int \
                or n < 0 or addr > U64_MAX:
            return None
        k = _encode_key(key)
        if k is None or not self._zero_copy(addr, n):
            return None
        return k, addr, n

    def _packed_get_into(self, n, keys, buffer_ptrs, sizes):
        """The results of a regular batch_get_into of ``n`` (two or more, as
        ``_plain_lists`` found) str keys the store takes and plain int spans each inside
        registered memory (what engines pass), its lists converted at C speed and checked
        by the library; None for anything else, which the careful path answers with the
        same results, errors and logs. For a batch of small values the careful path's
        per-element work costs more than the read."""
        if _FAST_BATCH_GET_INTO is not None:
            # The library reads the lists itself (no ctypes call, no conversions here);
            # None for what it leaves to the conversions below.
            allowed = self._allowed_ranges()
            # (A store closed by another thread since the caller looked is 0: the
            # library declines it, and the ctypes path answers as before.)
            got = _FAST_BATCH_GET_INTO(self._store or 0, keys, buffer_ptrs, sizes,
                                       allowed.buffer_info()[0], len(allowed) // 2)
            if got is not None:
                return got
        try:
            packed = ("\0".join(keys) + "\0").encode()
            addrs = array.array("Q", buffer_ptrs)
            lens = repeated_u64(sizes)
            if lens is None:
                lens = array.array("Q", sizes)
                # array("Q") takes a bool as 0 or 1, the careful path refuses it. (A
                # bool address lies outside registered memory, which the library
                # refuses.)
                if min(sizes) < 2 and set(map(type, sizes)) != JUST_INT:
                    return None
        except (TypeError, ValueError, OverflowError):
            return None
        allowed = self._allowed_ranges()
        results = _ZERO_I64 * n
        rc = N.LIB.mc_store_batch_get_into_packed(
            self._store, packed, len(packed), n, addrs.buffer_info()[0],
            lens.buffer_info()[0], allowed.buffer_info()[0], len(allowed) // 2,
            results.buffer_info()[0])
        return results.tolist() if rc == N.MC_OK else None

    def _allowed_ranges(self):
        """The memory a zero-copy call may name, as ``[start, end)`` pairs in an
        ``array("Q")``: what the store registered, and with a shared engine what the
        engine registered (registered for the store too)."""
        allowed = self._registered.pairs()
        if self._engine is not None:
            allowed = allowed + self._engine._local.pairs()
        return allowed

    def batch_get_into(self, keys, buffer_ptrs, sizes):
        n = self._plain_lists(keys, buffer_ptrs, sizes)
        if n >= 2:
            got = self._packed_get_into(n, keys, buffer_ptrs, sizes)
            if got is not None:
                return got
        elif n == 1:
            one = self._one_plain(keys, buffer_ptrs, sizes)
            if one is not None:
                return [self._get_into_one(*one)]
        ks = _keys(keys)
        addrs = int_list(buffer_ptrs, "buffer_ptrs")
        lens = int_list(sizes, "sizes")
        if not lengths_match("batch_get_into", keys=ks, buffer_ptrs=addrs, sizes=lens) \
                or not self._store:
            return [INVALID_PARAMS] * len(ks)
        spans = self._checked_spans(addrs, lens)
        results, idx = _triage(ks, spans)
        if len(idx) == len(ks):
            return self._batch_get_into(ks, addrs, lens)
        if idx:
            res = self._batch_get_into([ks[i] for i in idx], [addrs[i] for i in idx],
                                       [lens[i] for i in idx])
            for j, i in enumerate(idx):
                results[i] = res[j]
        return results

    @staticmethod
    def _nested(all_buffer_ptrs, all_sizes, n):
        """The per-key pointer and size lists, checked; None (logged) when their lengths
        disagree, which fails every key with INVALID_PARAMS as upstream."""
        if isinstance(all_buffer_ptrs, (str, bytes)) or isinstance(all_sizes, (str, bytes)):
            raise TypeError("expected lists of lists of int")
        ptrs = [int_list(p, f"all_buffer_ptrs[{i}]") for i, p in enumerate(all_buffer_ptrs)]
        sizes = [int_list(s, f"all_sizes[{i}]") for i, s in enumerate(all_sizes)]
        if not lengths_match("multi-buffer call", keys=range(n), all_buffer_ptrs=ptrs,
                             all_sizes=sizes):
            return None
        for i, (p, s) in enumerate(zip(ptrs, sizes)):
            if not lengths_match(f"key {i}", buffer_ptrs=p, sizes=s):
                return None
        return ptrs, sizes

    def batch_put_from_multi_buffers(self, keys, all_buffer_ptrs, all_sizes, config=None):
        """Stores key i as the concatenation of its buffers (zero-copy, registered)."""
        ks = _keys(keys)
        nested = self._nested(all_buffer_ptrs, all_sizes, len(ks))
        if nested is None:
            return [INVALID_PARAMS] * len(ks)
        ptrs, sizes = nested
        config = _config(config)
        if not self._store:
            return [INVALID_PARAMS] * len(ks)
        parts = [self._registered_run(p, s) for p, s in zip(ptrs, sizes)]
        return self._put_parts(ks, parts, config, False, "batch_put_from_multi_buffers",
                               SAME_NODE_ONE_REPLICA)

    def batch_get_into_multi_buffers(self, keys, all_buffer_ptrs, all_sizes,
                                     prefer_alloc_in_same_node=False):
        """Reads key i into its buffers, filled in order; bytes read per key or negative."""
        ks = _keys(keys)
        nested = self._nested(all_buffer_ptrs, all_sizes, len(ks))
        if nested is None:
            return [INVALID_PARAMS] * len(ks)
        ptrs, sizes = nested
        _bool(prefer_alloc_in_same_node, "prefer_alloc_in_same_node")
        fn = N.LIB.mc_store_batch_get_parts
        if not self._store:
            return [INVALID_PARAMS] * len(ks)
        results, idx = _triage(ks, [self._registered_run(p, s) for p, s in zip(ptrs, sizes)])
        if not idx:
            return results
        flat_a = [a for i in idx for a in ptrs[i]]
        flat_s = [n for i in idx for n in sizes[i]]
        c_keys = N.c_strings([ks[i] for i in idx])
        c_bufs = N.c_array(ctypes.c_void_p, flat_a)
        c_caps = N.c_array(ctypes.c_size_t, flat_s)
        c_counts = N.c_array(ctypes.c_size_t, [len(ptrs[i]) for i in idx])
        c_res = (ctypes.c_int64 * len(idx))()
        rc = fn(self._store, c_keys, len(idx), c_bufs, c_caps, c_counts, c_res)
        for j, i in enumerate(idx):
            results[i] = rc if rc != N.MC_OK else int(c_res[j])
        return results

    def get_into_ranges(self, buffer_ptrs, all_keys, all_dst_offsets, all_src_offsets,
                        all_sizes):
        """Fragment gather: for buffer b, key k of all_keys[b] and range r, copies the
        object's bytes [src, src+size) to buffer_ptrs[b] + dst. Returns
        results[b][k][r]: the range's size, or the key's negative error."""
        bufs = int_list(buffer_ptrs, "buffer_ptrs")
        nb = len(bufs)
        for name, v in (("all_keys", all_keys), ("all_dst_offsets", all_dst_offsets),
                        ("all_src_offsets", all_src_offsets), ("all_sizes", all_sizes)):
            if isinstance(v, (str, bytes)) or not hasattr(v, "__len__"):
                raise TypeError(f"{name}: expected a list")
            if len(v) != nb:
                raise ValueError(f"{name} has {len(v)} entries for {nb} buffers")
        entries = []  # (b, k, encoded key, dsts, srcs, sizes)
        # As upstream: a key whose lists disagree in length fails its ranges (one code per
        # destination offset) and the rest of the call goes on.
        results = [[[] for _ in range(len(all_keys[b]))] for b in range(nb)]
        for b in range(nb):
            keys_b = _keys(all_keys[b], f"all_keys[{b}]")
            d_b, s_b, z_b = all_dst_offsets[b], all_src_offsets[b], all_sizes[b]
            if not len(d_b) == len(s_b) == len(z_b) == len(keys_b):
                logger.error("mooncake: get_into_ranges: buffer %d: keys, offsets and sizes "
                             "differ in length", b)
                results[b] = [[INVALID_PARAMS] * (len(d_b[k]) if k < len(d_b) else 0)
                              for k in range(len(keys_b))]
                continue
            for k in range(len(keys_b)):
                d = int_list(d_b[k], f"all_dst_offsets[{b}][{k}]")
                s = int_list(s_b[k], f"all_src_offsets[{b}][{k}]")
                z = int_list(z_b[k], f"all_sizes[{b}][{k}]")
                if lengths_match("get_into_ranges", dst_offsets=d, src_offsets=s, sizes=z):
                    entries.append((b, k, keys_b[k], d, s, z))
                else:
                    results[b][k] = [INVALID_PARAMS] * len(d)
        fn = N.LIB.mc_store_batch_get_ranges
        if not self._store:
            for b, k, _, d, _, _ in entries:
                results[b][k] = [INVALID_PARAMS] * len(d)
            return results
        send = []
        for e in entries:
            b, k, key, d, s, z = e
            if key is None:
                results[b][k] = [INVALID_KEY] * len(d)
            elif not d or not all(self._zero_copy(bufs[b] + dd, zz) for dd, zz in zip(d, z)):
                if d:
                    self._log_unregistered(bufs[b], max(dd + zz for dd, zz in zip(d, z)))
                results[b][k] = [INVALID_PARAMS] * len(d)
            else:
                send.append(e)
        if not send:
            return results
        c_keys = N.c_strings([e[2] for e in send])
        c_bufs = N.c_array(ctypes.c_void_p, [bufs[e[0]] + dd for e in send for dd in e[3]])
        c_offs = N.c_array(ctypes.c_uint64, [ss for e in send for ss in e[4]])
        c_lens = N.c_array(ctypes.c_uint64, [zz for e in send for zz in e[5]])
        c_counts = N.c_array(ctypes.c_size_t, [len(e[3]) for e in send])
        c_res = (ctypes.c_int64 * len(send))()
        rc = fn(self._store, c_keys, len(send), c_bufs, c_offs, c_lens, c_counts, c_res)
        for j, (b, k, _, d, _, z) in enumerate(send):
            r = rc if rc != N.MC_OK else int(c_res[j])
            results[b][k] = list(z) if r >= 0 else [r] * len(d)
        return results


class MooncakeHostMemAllocator:
    """Shared (MAP_SHARED) host memory by address: ``alloc(size) -> int`` (0 on failure),
    ``free(addr) -> int`` (0, or -1 for an unknown address)."""

    def __init__(self):
        self._maps = {}
        self._lock = threading.Lock()

    def alloc(self, size):
        n = check_int(size, "size")
        if n == 0:
            return 0
        try:
            m = mmap.mmap(-1, n, flags=mmap.MAP_SHARED | mmap.MAP_ANONYMOUS)
        except (OSError, ValueError, OverflowError):
            return 0
        view = (ctypes.c_char * n).from_buffer(m)
        addr = ctypes.addressof(view)
        with self._lock:
            self._maps[addr] = (m, view)
        return addr

    def free(self, ptr):
        addr = check_int(ptr, "ptr")
        with self._lock:
            entry = self._maps.pop(addr, None)
        if entry is None:
            return -1
        m, view = entry
        del view, entry
        m.close()
        return 0


# Upstream's module-level tensor serialization helpers (mooncake.structured_object_store
# uses them): a tensor as a Mooncake tensor object's header plus its bytes, and back.


def _serialize_tensor(tensor):
    """(header bytes, data address, data bytes, owner keeping the data alive) of a
    tensor; ValueError for one Mooncake cannot store."""
    host = _host_tensor(tensor, "_serialize_tensor")
    if host is None:
        raise ValueError("unsupported tensor for Mooncake tensor serialization")
    header = _tensor_layout.TensorHeader(_tensor_layout.dtype_code(host.dtype), host.shape)
    return header.pack(), host.data_ptr(), header.data_bytes, host


def _tensor_metadata_size():
    return _tensor_layout.HEADER_SIZE


def _deserialize_tensor(data):
    """The tensor of a whole tensor object's bytes (a copy), or None when they are not
    one."""
    return tensor_in(bytearray(data), "_deserialize_tensor")


# Upstream exports these enums' members at module level too; PROCESSING and FAILED,
# which two of them share, are TaskStatus's there (registered last), so here too.
for _enum in (ObjectDataType, ReplicaStatus, TaskType, TaskStatus):
    globals().update(_enum.__members__)
del _enum

# Upstream's mooncake.store also exports the buffer pool's classes: loaded on first use,
# since buffer_pool builds on this module.
_FROM_BUFFER_POOL = ("BufferPool", "RegisteredBufferPool", "BufferLease",
                     "RegisteredBufferLease", "BufferLeaseView", "RegisteredBufferLeaseView")


def __getattr__(name):
    if name in _FROM_BUFFER_POOL:
        from . import buffer_pool

        return getattr(buffer_pool, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def __dir__():
    return sorted(set(globals()) | set(_FROM_BUFFER_POOL))
