"""``mooncake.engine``: Mooncake's Transfer Engine Python API over libmooncake's C ABI.

Return conventions follow Mooncake 0.3.x: ``0`` success and ``-1`` (or a negative
Mooncake error code) failure for int-returning calls, batch ids ``0`` on failure. Every
call that can block (connecting, transferring, waiting) releases the GIL.
"""

import ctypes
import enum
import json
import logging
import threading

from . import _device
from . import _native as N
from ._common import (
    HARDWARE_PROTOCOLS,
    Registered,
    bind_address_for,
    check_int,
    check_str,
    int_list,
    metadata_connection,
    new_config,
    same_length,
    split_host_port,
    start_native,
    transfer_timeout_ms,
)
from ._rpc_interface import (
    CoroRPCInterface,
    ReceivedData,
    ReceivedTensor,
    RpcInterface,
    create_rpc_client,
    create_rpc_server,
)
from ._shared_segment import SharedSegment

__all__ = [
    "TransferEngine",
    "TransferOpcode",
    "TransferNotify",
    "SUPPORT_CUDA",
    "SUPPORT_HIP",
    "SUPPORT_EFA",
    "SUPPORT_RDMA",
    "SUPPORT_MNNVL",
    "SUPPORT_INTRA_NVLINK",
    "SUPPORT_MUSA",
    "SUPPORT_ASCEND",
    "SUPPORT_DETAILS",
    "InnerTransferEngine",
    "SharedSegment",
    "RpcInterface",
    "CoroRPCInterface",
    "ReceivedData",
    "ReceivedTensor",
    "create_rpc_client",
    "create_rpc_server",
]

logger = logging.getLogger("mooncake")

# What was found on this machine at import time (library paths or None). The SUPPORT_*
# flags say whether the corresponding runtime library exists; the engine itself decides
# at initialize() whether a backend really works (and says why not).
SUPPORT_DETAILS = dict(_device.FOUND)
SUPPORT_CUDA = bool(SUPPORT_DETAILS["cuda"])
SUPPORT_HIP = bool(SUPPORT_DETAILS["hip"])
SUPPORT_EFA = bool(SUPPORT_DETAILS["efa"])
SUPPORT_RDMA = bool(SUPPORT_DETAILS["rdma"])
SUPPORT_ASCEND = bool(SUPPORT_DETAILS["ascend"])
SUPPORT_MNNVL = False  # no multi-node NVLink transport in this build
SUPPORT_INTRA_NVLINK = False
SUPPORT_MUSA = False  # no Moore Threads transport in this build


class TransferOpcode(enum.IntEnum):
    Read = 0
    Write = 1


# Upstream's pybind11 enum exports its values at module level too.
Read = TransferOpcode.Read
Write = TransferOpcode.Write


class TransferNotify:
    """A notification: ``name`` (the sender, when received) and ``msg``."""

    __slots__ = ("name", "msg")

    def __init__(self, name="", msg=""):
        self.name = check_str(name, "name")
        self.msg = check_str(msg, "msg")

    def __repr__(self):
        return f"TransferNotify(name={self.name!r}, msg={self.msg!r})"

    def __eq__(self, other):
        return isinstance(other, TransferNotify) and (self.name, self.msg) == (other.name, other.msg)

    __hash__ = None


_FINAL_STATES = (N.MC_TASK_CANCELED, N.MC_TASK_COMPLETED, N.MC_TASK_TIMEOUT, N.MC_TASK_FAILED,
                 N.MC_TASK_INVALID)


# register_memory's access names and their MC_ACCESS_* values.
_ACCESS = {"read_write": 0, "read_only": 1, "local": 2}


def _location(location, addr):
    check_str(location, "location")
    if location in ("", "*"):
        return _device.location_of(addr)
    return location


class TransferEngine:
    """One transfer engine: a published segment that peers read and write, and a client
    of other engines' segments (named by their session name, ``host:port``)."""

    TransferOpcode = TransferOpcode  # upstream also exposes the enum on the class

    def __init__(self):
        self._engine = None
        self._lock = threading.Lock()
        self._segments = {}  # session name -> segment handle
        self._batches = {}  # batch id -> number of tasks
        self._local = Registered()  # registered local memory (transfer sources/targets)
        self._notify_bufs = (1024, 64 << 10)
        self._rpc_port = -1
        self._protocol = ""
        self._name = ""
        self._hostname = ""

    # ------------------------------------------------------------ lifecycle

    def initialize(self, local_hostname, metadata_server, protocol, device_name):
        """Starts the engine. ``local_hostname`` is an IP or host name, with or without a
        port (none: a free one); ``metadata_server`` "P2PHANDSHAKE", "http://h:p/metadata",
        "etcd://h:p[;h:p]" (or a bare "h:p"), "redis://h:p"; ``protocol`` "tcp", "rdma",
        "efa", "auto", ...; ``device_name`` is ignored for tcp. A hardware protocol whose
        backend is unavailable here runs over TCP (the library logs one warning; with
        MC_STRICT_PROTOCOL=1 this fails instead). 0 or -1."""
        check_str(metadata_server, "metadata_server")
        return self._initialize(local_hostname, metadata_server, protocol, device_name, None)

    def initialize_ext(self, local_hostname, metadata_server, protocol, device_name,
                       metadata_type):
        """As initialize; a ``metadata_server`` without a scheme is read as
        ``metadata_type://metadata_server``."""
        check_str(metadata_server, "metadata_server")
        check_str(metadata_type, "metadata_type")
        return self._initialize(local_hostname, metadata_server, protocol, device_name,
                                metadata_type)

    def _initialize(self, local_hostname, metadata_server, protocol, device_name, metadata_type):
        check_str(local_hostname, "local_hostname")
        check_str(protocol, "protocol")
        if device_name is None:
            device_name = ""
        check_str(device_name, "device_name")
        host, port = split_host_port(local_hostname)
        conn = metadata_connection(metadata_server, metadata_type)
        if conn is None:
            return -1
        if self._engine is not None:
            logger.info("mooncake: TransferEngine initialized again; the old engine stops")
            self._free()
        p2p = conn == "P2PHANDSHAKE"
        bind = bind_address_for(host)
        proto = protocol.strip().lower()
        settings = {
            "metadata": conn,
            # Upstream's names: its "tcp" reaches same-host peers through shared memory
            # (mooncake.h, upstream_protocol; MC_SAME_HOST_SHM=0 keeps it on sockets).
            "upstream_protocol": proto,
            "bind_address": bind,
        }
        if proto in HARDWARE_PROTOCOLS and device_name and device_name != "auto-discovery":
            settings["device_name"] = device_name
        timeout = transfer_timeout_ms()
        if timeout is not None:
            settings["transfer_timeout_ms"] = timeout
        rc, handle = start_native(N.LIB.mc_engine_new, settings, host, port, p2p,
                                  "local_server_name")
        if rc != N.MC_OK:
            logger.error("mooncake: TransferEngine.initialize(%r, %r, %r) failed: %s (%d)",
                         local_hostname, metadata_server, protocol, N.error_string(rc), rc)
            return -1
        self._engine = handle
        rc, self._name = N.read_string(N.LIB.mc_engine_segment_name, self._engine)
        self._hostname = host
        self._protocol = proto
        self._rpc_port = self._query_rpc_port(settings["rpc_port"])
        return 0

    def _query_rpc_port(self, configured):
        port = N.LIB.mc_engine_rpc_port(self._engine)
        if port > 0:
            return port
        if configured:
            return int(configured)
        # Revision-1 library: a P2P segment name ends with the bound RPC port.
        try:
            return split_host_port(self._name)[1] or -1
        except ValueError:
            return -1

    def _free(self):
        eng, self._engine = self._engine, None
        if eng:
            N.LIB.mc_engine_free(eng)
        with self._lock:
            self._batches.clear()
        self._local.clear()

    def close(self):
        """Stops the engine (not in upstream's API; the engine also stops when collected)."""
        self._free()
        return 0

    def __del__(self):
        try:
            self._free()
        except Exception:
            pass

    def get_rpc_port(self):
        """The port of this engine's handshake/RPC server (-1 before initialize)."""
        return self._rpc_port if self._engine else -1

    def get_stats(self):
        """This engine's counters as a dict (not in upstream's API): bytes moved per
        transport (``shm_bytes``, ``tcp_bytes``, ...), retries, failed slices,
        ``protocol`` (the protocol it runs) and ``same_host_shm`` (whether same-host
        peers are reached through shared memory); None before initialize or on error."""
        if not self._engine:
            return None
        rc, text = N.read_json_text(N.LIB.mc_engine_stats, self._engine, initial=1024)
        if rc != N.MC_OK:
            return None
        try:
            return json.loads(text)
        except ValueError:
            return None

    def get_engine(self):
        """A handle a store may be given (``MooncakeDistributedStore.setup(..., engine=)``)."""
        return self

    def get_engine_ptr(self):
        """The native engine as an integer, for code in other languages: the
        ``mc_engine *`` handle of libmooncake's C ABI (c_include/mooncake.h), valid until
        this engine is closed or collected; 0 before initialize. (Upstream returns its
        C++ ``TransferEngine *``; here it is the C handle, which the C ABI accepts.)"""
        return self._engine or 0

    def get_session_id(self):
        """This engine's segment name (what peers pass as ``target_hostname``)."""
        return self._name

    # ------------------------------------------------------------ topology

    def _describe(self, segment):
        fn = N.LIB.mc_segment_describe
        rc, text = N.read_json_text(fn, self._engine, segment)
        if rc != N.MC_OK:
            return rc, None
        try:
            return rc, json.loads(text)
        except ValueError:
            logger.error("mooncake: malformed segment descriptor: %.200s", text)
            return N.MC_ERR_INTERNAL, None

    def get_local_topology(self, device_name=None):
        """This machine's NIC priority matrix as JSON (``{"cpu:0": [[preferred NICs],
        [others]], ...}``); "{}" where no RDMA NIC exists."""
        if device_name is not None:
            check_str(device_name, "device_name")
        temp = None
        engine = self._engine
        if engine is None or device_name or self._protocol not in HARDWARE_PROTOCOLS:
            # Like upstream, discover the NICs with a throw-away engine: an RDMA one where
            # libibverbs exists (its descriptor carries the matrix), else a default one.
            attempts = [{"protocol": "rdma"}] if SUPPORT_RDMA and _device.rdma_devices() else []
            attempts.append({})
            for extra in attempts:
                settings = {"metadata": "P2PHANDSHAKE", "bind_address": "127.0.0.1", **extra}
                if device_name and extra:
                    settings["device_name"] = device_name
                cfg, rc = new_config(settings)
                if cfg is None:
                    continue
                out = ctypes.c_void_p()
                rc = N.LIB.mc_engine_new(cfg, ctypes.byref(out))
                N.LIB.mc_config_free(cfg)
                if rc == N.MC_OK:
                    engine = temp = out.value
                    break
            if temp is None:
                logger.error("mooncake: get_local_topology: no engine could start")
                return "{}"
        try:
            rc, text = N.read_json_text(N.LIB.mc_segment_describe, engine, 0)
        finally:
            if temp:
                N.LIB.mc_engine_free(temp)
        if rc != N.MC_OK:
            return "{}"
        try:
            matrix = json.loads(text).get("priority_matrix") or {}
        except (ValueError, AttributeError):
            matrix = {}
        return json.dumps(matrix)

    def get_first_buffer_address(self, segment_name):
        """The address of the first buffer a peer segment published (0 on failure)."""
        check_str(segment_name, "segment_name")
        if not self._engine:
            return 0
        seg = self._open(segment_name)
        if seg is None:
            return 0
        N.LIB.mc_resync_segment(self._engine, seg)
        rc, desc = self._describe(seg)
        if rc != N.MC_OK or not isinstance(desc, dict):
            return 0
        buffers = desc.get("buffers") or []
        if not buffers:
            return 0
        try:
            return int(buffers[0].get("addr", 0))
        except (TypeError, ValueError, AttributeError):
            return 0

    def warmup_efa_segment(self, segment_name):
        """Prepares EFA transfers to ``segment_name`` ahead of the first one: opens the
        segment and fetches its descriptor. 0 on success, a negative code otherwise; 0
        without doing anything when this engine does not use EFA (as upstream)."""
        check_str(segment_name, "segment_name")
        if self._protocol != "efa":
            return 0
        if not self._engine:
            return -1
        seg = self._open(segment_name)
        if seg is None:
            return -1
        rc = N.LIB.mc_resync_segment(self._engine, seg)
        return 0 if rc == N.MC_OK else rc

    # ------------------------------------------------------------ memory

    def register_memory(self, buffer_addr, capacity, location="*", access=None):
        """Publishes ``[buffer_addr, buffer_addr+capacity)`` to peers. ``location`` "*"
        (default) classifies the memory itself (CUDA device memory or host). ``access``
        (optional) limits what peers may do: "read_write" (the default), "read_only"
        (their writes are refused) or "local" (peers can neither read nor write it)."""
        addr = check_int(buffer_addr, "buffer_addr")
        size = check_int(capacity, "capacity")
        loc = _location(location, addr)
        if access is not None and access not in _ACCESS:
            raise ValueError(f"access: {access!r} (one of {', '.join(_ACCESS)})")
        if not self._engine:
            return -1
        if access is None:
            rc = N.LIB.mc_register_memory(self._engine, addr, size, loc.encode())
        else:
            register = N.LIB.mc_register_memory_with_access
            rc = register(self._engine, addr, size, loc.encode(), _ACCESS[access])
        if rc == N.MC_OK:
            self._local.add(addr, size)
        else:
            logger.error("mooncake: register_memory(0x%x, %d, %s): %s (%d)", addr, size, loc,
                         N.error_string(rc), rc)
        return rc

    def unregister_memory(self, buffer_addr):
        addr = check_int(buffer_addr, "buffer_addr")
        if not self._engine:
            return -1
        rc = N.LIB.mc_unregister_memory(self._engine, addr)
        if rc == N.MC_OK:
            self._local.remove(addr)
        else:
            logger.error("mooncake: unregister_memory(0x%x): %s (%d)", addr,
                         N.error_string(rc), rc)
        return rc

    def batch_register_memory(self, buffer_addresses, capacities, location="*"):
        """Registers every buffer, or none: on a failure those already registered are
        withdrawn and the error returned."""
        addrs = int_list(buffer_addresses, "buffer_addresses")
        sizes = int_list(capacities, "capacities")
        same_length(buffer_addresses=addrs, capacities=sizes)
        check_str(location, "location")
        if not self._engine:
            return -1
        done = []
        for a, n in zip(addrs, sizes):
            rc = self.register_memory(a, n, location)
            if rc != N.MC_OK:
                for d in done:
                    N.LIB.mc_unregister_memory(self._engine, d)
                    self._local.remove(d)
                return rc
            done.append(a)
        return 0

    def batch_unregister_memory(self, buffer_addresses):
        addrs = int_list(buffer_addresses, "buffer_addresses")
        if not self._engine:
            return -1
        first_error = 0
        for a in addrs:
            rc = self.unregister_memory(a)
            if rc != N.MC_OK and first_error == 0:
                first_error = rc
        return first_error

    def allocate_managed_buffer(self, length):
        """Engine-owned, registered, zeroed host memory; its address, or 0 on failure."""
        n = check_int(length, "length")
        if not self._engine or n == 0:
            return 0
        out = ctypes.c_void_p()
        rc = N.LIB.mc_allocate_buffer(self._engine, n, b"cpu:0", ctypes.byref(out))
        if rc != N.MC_OK:
            logger.error("mooncake: allocate_managed_buffer(%d): %s (%d)", n,
                         N.error_string(rc), rc)
            return 0
        self._local.add(out.value, n)
        return out.value or 0

    def free_managed_buffer(self, buffer_addr, length):
        addr = check_int(buffer_addr, "buffer_addr")
        check_int(length, "length")
        if not self._engine:
            return -1
        rc = N.LIB.mc_free_buffer(self._engine, addr)
        if rc == N.MC_OK:
            self._local.remove(addr)
        else:
            logger.error("mooncake: free_managed_buffer(0x%x): %s (%d)", addr,
                         N.error_string(rc), rc)
        return rc

    def write_bytes_to_buffer(self, buffer_addr, src_data, length):
        """Copies ``length`` bytes of ``src_data`` to ``buffer_addr`` (host memory inside a
        buffer registered with this engine or from allocate_managed_buffer); 0, or -1 for
        an address outside them."""
        addr = check_int(buffer_addr, "buffer_addr", lo=1)
        n = check_int(length, "length")
        if not isinstance(src_data, (bytes, bytearray, memoryview)):
            raise TypeError(f"src_data: expected bytes, got {type(src_data).__name__}")
        data = bytes(src_data)
        if n > len(data):
            raise ValueError(f"length {n} exceeds the {len(data)} bytes given")
        if not self._local.covers(addr, n):
            logger.error("mooncake: write_bytes_to_buffer: [0x%x, +%d) is not inside memory "
                         "registered with this engine; refused", addr, n)
            return -1
        ctypes.memmove(addr, data, n)
        return 0

    def read_bytes_from_buffer(self, buffer_addr, length):
        """``length`` bytes at ``buffer_addr`` (host memory registered with this engine)
        as bytes; ValueError for an address outside registered memory."""
        addr = check_int(buffer_addr, "buffer_addr", lo=1)
        n = check_int(length, "length")
        if not self._local.covers(addr, n):
            raise ValueError(f"read_bytes_from_buffer: [0x{addr:x}, +{n}) is not inside memory "
                             "registered with this engine (register_memory or "
                             "allocate_managed_buffer)")
        return ctypes.string_at(addr, n)

    # ------------------------------------------------------------ transfers

    def _open(self, target):
        # Segment handles never change for an engine (the library caches them too).
        seg = self._segments.get(target)
        if seg is not None:
            return seg
        out = ctypes.c_uint64(0)
        rc = N.LIB.mc_open_segment(self._engine, target.encode(), ctypes.byref(out))
        if rc != N.MC_OK:
            logger.error("mooncake: cannot open segment %r: %s (%d)", target,
                         N.error_string(rc), rc)
            return None
        self._segments[target] = out.value
        return out.value

    @staticmethod
    def _requests(target, buffers, peer_addresses, lengths, opcode):
        check_str(target, "target_hostname")
        locals_ = int_list(buffers, "buffers")
        peers = int_list(peer_addresses, "peer_buffer_addresses")
        lens = int_list(lengths, "lengths")
        same_length(buffers=locals_, peer_buffer_addresses=peers, lengths=lens)
        if isinstance(opcode, bool) or not isinstance(opcode, int):
            raise TypeError(f"opcode: expected TransferOpcode, got {type(opcode).__name__}")
        return locals_, peers, lens, int(TransferOpcode(opcode))

    def _prepare(self, target, buffers, peer_addresses, lengths, opcode):
        """Checks a transfer and builds its requests: (requests, count, segment); count 0
        when there is nothing to move; requests None after logging why it cannot run."""
        locals_, peers, lens, op = self._requests(target, buffers, peer_addresses, lengths, opcode)
        if not self._engine:
            return None, 0, None
        if not locals_:
            return (), 0, None
        for a, n in zip(locals_, lens):
            if not self._local.covers(a, n):
                logger.error("mooncake: local buffer [0x%x, +%d) is not inside memory registered "
                             "with register_memory or allocate_managed_buffer; transfer refused",
                             a, n)
                return None, 0, None
        seg = self._open(target)
        if seg is None:
            return None, 0, None
        n = len(locals_)
        reqs = (N.McRequest * n)()
        for i in range(n):
            reqs[i] = N.McRequest(op, locals_[i], seg, peers[i], lens[i])
        return reqs, n, seg

    def _retrying(self, seg, call):
        """``call()``, once more after refetching the peer's descriptor when the peer may
        have registered memory since it was cached."""
        rc = call()
        if rc in (N.MC_ERR_ADDRESS_NOT_REGISTERED, N.MC_ERR_SEGMENT_NOT_FOUND):
            if N.LIB.mc_resync_segment(self._engine, seg) == N.MC_OK:
                rc = call()
        return rc

    def _submit(self, target, buffers, peer_addresses, lengths, opcode):
        """Submits one batch; (batch id, segment) or (0, segment-or-None) after logging."""
        reqs, n, seg = self._prepare(target, buffers, peer_addresses, lengths, opcode)
        if not n:
            return 0, seg
        batch = ctypes.c_uint64(0)
        rc = N.LIB.mc_batch_new(self._engine, n, ctypes.byref(batch))
        if rc == N.MC_OK:
            rc = self._retrying(seg, lambda: N.LIB.mc_submit(self._engine, batch.value, reqs, n))
            if rc != N.MC_OK:
                N.LIB.mc_batch_free(self._engine, batch.value)
        if rc != N.MC_OK:
            logger.error("mooncake: transfer to %r refused: %s (%d)", target,
                         N.error_string(rc), rc)
            return 0, seg
        with self._lock:
            self._batches[batch.value] = n
        return batch.value, seg

    def _wait_free(self, batch):
        rc = N.LIB.mc_batch_wait(self._engine, batch, -1)
        N.LIB.mc_batch_free(self._engine, batch)
        with self._lock:
            self._batches.pop(batch, None)
        return rc

    def _sync(self, target, buffers, peers, lengths, opcode, notify):
        if notify is not None and not isinstance(notify, TransferNotify):
            raise TypeError(f"notify: expected TransferNotify or None, got {type(notify).__name__}")
        reqs, n, seg = self._prepare(target, buffers, peers, lengths, opcode)
        if reqs is None:
            return -1  # refused (logged)
        if not n:
            return 0  # nothing to move
        # One foreign call (GIL released) for submit, wait and free.
        rc = self._retrying(seg, lambda: N.LIB.mc_transfer_sync(self._engine, reqs, n))
        if rc != N.MC_OK:
            logger.error("mooncake: transfer to %r failed: %s (%d)", target,
                         N.error_string(rc), rc)
            # The peer may have restarted or withdrawn memory: refetch next time.
            N.LIB.mc_resync_segment(self._engine, seg)
            return -1
        if notify is not None:
            # Upstream delivers the name the application gave.
            rc = N.LIB.mc_notify_as(self._engine, seg, str(notify.name).encode(),
                                    str(notify.msg).encode())
            if rc != N.MC_OK:
                logger.error("mooncake: notify to %r failed: %s (%d)", target,
                             N.error_string(rc), rc)
                return -1
        return 0

    def _sync_one(self, target, buffer, peer, length, op):
        """One transfer with `_sync`'s checks and outcome, minus its lists: the path
        small synchronous reads and writes take, where Python's own cost shows."""
        check_str(target, "target_hostname")
        buffer = check_int(buffer, "buffer")
        peer = check_int(peer, "peer_buffer_address")
        length = check_int(length, "length")
        if not self._engine:
            return self._sync(target, [buffer], [peer], [length], op, None)
        if not self._local.covers(buffer, length):
            logger.error("mooncake: local buffer [0x%x, +%d) is not inside memory registered "
                         "with register_memory or allocate_managed_buffer; transfer refused",
                         buffer, length)
            return -1
        seg = self._open(target)
        if seg is None:
            return -1
        req = N.McRequest(op, buffer, seg, peer, length)
        rc = self._retrying(seg, lambda: N.LIB.mc_transfer_sync(self._engine, ctypes.byref(req), 1))
        if rc != N.MC_OK:
            logger.error("mooncake: transfer to %r failed: %s (%d)", target,
                         N.error_string(rc), rc)
            N.LIB.mc_resync_segment(self._engine, seg)
            return -1
        return 0

    def transfer_sync_write(self, target_hostname, buffer, peer_buffer_address, length,
                            transport_hint=""):
        return self._sync_one(target_hostname, buffer, peer_buffer_address, length, 1)

    def transfer_sync_read(self, target_hostname, buffer, peer_buffer_address, length,
                           transport_hint=""):
        return self._sync_one(target_hostname, buffer, peer_buffer_address, length, 0)

    def transfer_sync(self, target_hostname, buffer, peer_buffer_address, length, opcode,
                      notify=None, transport_hint=""):
        """One transfer; with ``notify`` its ``msg`` is sent to the peer once the bytes
        have moved (the peer sees this engine's session name as the sender)."""
        return self._sync(target_hostname, [buffer], [peer_buffer_address], [length], opcode,
                          notify)

    def batch_transfer_sync_write(self, target_hostname, buffers, peer_buffer_addresses,
                                  lengths, transport_hint=""):
        return self._sync(target_hostname, buffers, peer_buffer_addresses, lengths,
                          TransferOpcode.Write, None)

    def batch_transfer_sync_read(self, target_hostname, buffers, peer_buffer_addresses,
                                 lengths, transport_hint=""):
        return self._sync(target_hostname, buffers, peer_buffer_addresses, lengths,
                          TransferOpcode.Read, None)

    def batch_transfer_sync(self, target_hostname, buffers, peer_buffer_addresses, lengths,
                            opcode, notify=None, transport_hint=""):
        return self._sync(target_hostname, buffers, peer_buffer_addresses, lengths, opcode,
                          notify)

    def batch_transfer_async_write(self, target_hostname, buffers, peer_buffer_addresses,
                                   lengths, transport_hint=""):
        return self._submit(target_hostname, buffers, peer_buffer_addresses, lengths,
                            TransferOpcode.Write)[0]

    def batch_transfer_async_read(self, target_hostname, buffers, peer_buffer_addresses,
                                  lengths, transport_hint=""):
        return self._submit(target_hostname, buffers, peer_buffer_addresses, lengths,
                            TransferOpcode.Read)[0]

    def batch_transfer_async(self, target_hostname, buffers, peer_buffer_addresses, lengths,
                             opcode, transport_hint=""):
        """Submits and returns a batch id (0 on failure, e.g. an unknown segment)."""
        return self._submit(target_hostname, buffers, peer_buffer_addresses, lengths,
                            opcode)[0]

    def transfer_submit_write(self, target_hostname, buffer, peer_buffer_address, length,
                              transport_hint=""):
        """Submits one write; a batch id for transfer_check_status (0 on failure)."""
        return self._submit(target_hostname, [buffer], [peer_buffer_address], [length],
                            TransferOpcode.Write)[0]

    def get_batch_transfer_status(self, batch_ids):
        """Waits for every batch and frees them: 0 if all completed, else -1."""
        ids = int_list(batch_ids, "batch_ids")
        if not self._engine:
            return -1
        failed = False
        for b in ids:
            rc = self._wait_free(b)
            if rc != N.MC_OK:
                logger.error("mooncake: batch %d: %s (%d)", b, N.error_string(rc), rc)
                failed = True
        return -1 if failed else 0

    def transfer_check_status(self, batch_id):
        """1 completed (freed), 0 running, -1 failed (freed), -2 timed out (freed)."""
        b = check_int(batch_id, "batch_id")
        if not self._engine:
            return -1
        with self._lock:
            n = self._batches.get(b)
        if n is None:
            return -1
        st = N.McTaskStatus()
        states = []
        for task in range(n):
            rc = N.LIB.mc_task_status(self._engine, b, task, ctypes.byref(st))
            if rc != N.MC_OK:
                states.append(N.MC_TASK_FAILED)
                continue
            if st.state not in _FINAL_STATES:
                return 0
            states.append(st.state)
        N.LIB.mc_batch_free(self._engine, b)
        with self._lock:
            self._batches.pop(b, None)
        if all(s == N.MC_TASK_COMPLETED for s in states):
            return 1
        if any(s == N.MC_TASK_TIMEOUT for s in states) and not any(
                s in (N.MC_TASK_FAILED, N.MC_TASK_CANCELED, N.MC_TASK_INVALID) for s in states):
            return -2
        return -1

    # ------------------------------------------------------------ CUDA streams

    def _on_cuda(self, target, buffers, peers, lengths, opcode, stream_ptr):
        stream = check_int(stream_ptr, "stream_ptr")
        _device.stream_synchronize(stream)
        if self._sync(target, buffers, peers, lengths, opcode, None) != 0:
            raise RuntimeError(f"transfer to {target!r} failed")

    def transfer_write_on_cuda(self, target_hostname, buffer, peer_buffer_address, length,
                               stream_ptr=0, transport_hint=""):
        """Writes once the work queued on ``stream_ptr`` so far is done. This version
        waits for the stream and the transfer before returning (upstream queues a host
        callback); later work on the stream is therefore ordered after the transfer."""
        self._on_cuda(target_hostname, [buffer], [peer_buffer_address], [length],
                      TransferOpcode.Write, stream_ptr)

    def transfer_read_on_cuda(self, target_hostname, buffer, peer_buffer_address, length,
                              stream_ptr=0, transport_hint=""):
        self._on_cuda(target_hostname, [buffer], [peer_buffer_address], [length],
                      TransferOpcode.Read, stream_ptr)

    def batch_transfer_write_on_cuda(self, target_hostname, buffers, peer_buffer_addresses,
                                     lengths, stream_ptr=0, transport_hint=""):
        self._on_cuda(target_hostname, buffers, peer_buffer_addresses, lengths,
                      TransferOpcode.Write, stream_ptr)

    def batch_transfer_read_on_cuda(self, target_hostname, buffers, peer_buffer_addresses,
                                    lengths, stream_ptr=0, transport_hint=""):
        self._on_cuda(target_hostname, buffers, peer_buffer_addresses, lengths,
                      TransferOpcode.Read, stream_ptr)

    # ------------------------------------------------------------ notifications, health

    def get_notifies(self):
        """Every notification received since the last call, oldest first."""
        result = []
        if not self._engine:
            return result
        from_len, msg_len = self._notify_bufs
        while True:
            sender = ctypes.create_string_buffer(from_len)
            msg = ctypes.create_string_buffer(msg_len)
            rc = N.LIB.mc_take_notification(self._engine, sender, from_len, msg, msg_len)
            if rc == 1:
                result.append(TransferNotify(sender.value.decode("utf-8", "replace"),
                                             msg.value.decode("utf-8", "replace")))
                continue
            if rc == N.MC_ERR_BUFFER_OVERFLOW and msg_len < (256 << 20):
                from_len, msg_len = from_len * 4, msg_len * 4
                self._notify_bufs = (from_len, msg_len)
                continue
            if rc < 0:
                logger.error("mooncake: get_notifies: %s (%d)", N.error_string(rc), rc)
            return result

    def send_probe(self, peer_server_name):
        """0 if the peer engine answers, else a negative code."""
        check_str(peer_server_name, "peer_server_name")
        if not self._engine:
            return -1
        out = ctypes.c_uint64(0)
        rc = N.LIB.mc_open_segment(self._engine, peer_server_name.encode(), ctypes.byref(out))
        if rc != N.MC_OK:
            return rc
        rc = N.LIB.mc_probe(self._engine, out.value)
        if rc != N.MC_OK:
            # Refetch the descriptor when the peer is back (it may have restarted).
            N.LIB.mc_resync_segment(self._engine, out.value)
        return rc


# Upstream's get_engine() returns its C++ engine under this class name; here get_engine()
# returns the TransferEngine itself (what MooncakeDistributedStore.setup(engine=) takes).
InnerTransferEngine = TransferEngine
