"""Mooncake's ``RpcInterface`` (also ``CoroRPCInterface``): send byte strings and tensors
to a peer's server, which hands them to Python callbacks.

Upstream runs this over coro_rpc; here it is a small framed TCP protocol between
processes using this package (standard library only), so peers must both be this
implementation. The Python API is upstream's: ``send_*`` return 0 or -1, the ``*_async``
forms return an asyncio future completed on the loop given, the data callback receives
``{"source": "ip:port", "data": bytes}`` and the tensor callback a ``ReceivedTensor``.

Frame (network byte order): kind (1 byte: 1 data, 2 tensor), the length of the tensor
header (4 bytes), the payload length (8 bytes); then the tensor header (JSON: dtype and
shape) and the payload. The receiver answers each frame with one status byte (0 taken).
"""

import json
import logging
import socket
import struct
import threading

from . import _forked
from ._common import split_host_port

__all__ = ["RpcInterface", "CoroRPCInterface", "ReceivedData", "ReceivedTensor",
           "create_rpc_client", "create_rpc_server"]

logger = logging.getLogger("mooncake")

_FRAME = struct.Struct("!BIQ")
_DATA, _TENSOR = 1, 2
_MAX_TENSOR_HEADER = 1 << 16
_ACCEPTED = b"\x00"
_REFUSED = b"\x01"


class ReceivedData:
    """Bytes received from ``source_address``."""

    __slots__ = ("source_address", "data_size", "_data")

    def __init__(self, source_address, data):
        self.source_address = source_address
        self._data = bytes(data)
        self.data_size = len(self._data)

    def get_bytes(self):
        return self._data

    def get_memory_view(self):
        return memoryview(self._data)


class ReceivedTensor:
    """A tensor's bytes with its ``shape`` (list of ints) and ``dtype`` name (e.g.
    "float32")."""

    __slots__ = ("source_address", "shape", "dtype", "total_bytes", "_data")

    def __init__(self, source_address, data, shape, dtype):
        self.source_address = source_address
        self._data = bytes(data)
        self.shape = list(shape)
        self.dtype = dtype
        self.total_bytes = len(self._data)

    def get_data_size(self):
        return len(self._data)

    def get_data_as_bytes(self):
        return self._data

    def get_memory_view(self):
        return memoryview(self._data)


def _recv_exact(sock, n):
    chunks = []
    while n:
        chunk = sock.recv(min(n, 1 << 20))
        if not chunk:
            raise ConnectionError("peer closed the connection")
        chunks.append(chunk)
        n -= len(chunk)
    return b"".join(chunks)


def _tensor_parts(tensor):
    """(header dict, payload bytes) of a CPU tensor-like object (torch or numpy)."""
    import ctypes

    if hasattr(tensor, "data_ptr") and hasattr(tensor, "element_size"):
        if getattr(getattr(tensor, "device", None), "type", "cpu") != "cpu":
            raise ValueError("send_tensor: only CPU tensors can be sent")
        tensor = tensor.contiguous()
        nbytes = int(tensor.numel()) * int(tensor.element_size())
        payload = ctypes.string_at(tensor.data_ptr(), nbytes) if nbytes else b""
        dtype = str(tensor.dtype).replace("torch.", "")
        return {"dtype": dtype, "shape": [int(d) for d in tensor.shape]}, payload
    if hasattr(tensor, "tobytes") and hasattr(tensor, "dtype") and hasattr(tensor, "shape"):
        return {"dtype": str(tensor.dtype), "shape": [int(d) for d in tensor.shape]}, \
            tensor.tobytes()
    raise TypeError(f"send_tensor: expected a tensor, got {type(tensor).__name__}")


def _as_bytes(data):
    if isinstance(data, str):
        return data.encode()
    return bytes(memoryview(data))


class RpcInterface:
    """A client (``send_*``) and, when given a listen address, a server that passes
    what it receives to the callbacks set with ``set_*_receive_callback``."""

    def __init__(self):
        self._initialized = False
        self._listen = None  # (host, port) to serve on
        self._timeout = 30.0
        self._server = None  # listening socket while serving
        self._stopped = threading.Event()
        self._serve_thread = None
        self._data_callback = None
        self._tensor_callback = None
        self._conns = {}  # target address -> connected socket (client side)
        self._conns_lock = threading.Lock()
        self._forked = False
        _forked.track(self)

    def _after_fork_in_child(self):
        """The listening socket and the cached connections are the parent's too: their
        descriptors are closed here without a shutdown (which would end them for the
        parent too); the child's later sends open connections of its own."""
        self._forked = True
        server, self._server = self._server, None
        if server is not None:
            server.close()
        self._stopped = threading.Event()
        self._stopped.set()
        self._serve_thread = None
        self._conns_lock = threading.Lock()
        conns, self._conns = list(self._conns.values()), {}
        for sock in conns:
            sock.close()

    # ------------------------------------------------------------ setup

    def initialize(self, listen_address="", thread_count=0, timeout_seconds=30,
                   pool_size=100):
        """Prepares the client, and the server when ``listen_address`` ("host:port") is
        given. True on success. ``thread_count`` and ``pool_size`` are accepted for
        upstream's signature: here each connection has its thread, and each target one
        cached connection."""
        if listen_address:
            try:
                host, port = split_host_port(listen_address)
            except ValueError as e:
                logger.error("mooncake: RpcInterface listen address %r: %s", listen_address, e)
                return False
            self._listen = (host or "0.0.0.0", port or 0)
        self._timeout = float(timeout_seconds) if timeout_seconds else None
        self._initialized = True
        return True

    def initialize_client(self, pool_size=100, timeout_seconds=30):
        return self.initialize("", 0, timeout_seconds, pool_size)

    def initialize_server(self, listen_address, thread_count=8, timeout_seconds=30):
        return self.initialize(listen_address, thread_count, timeout_seconds, 100)

    @property
    def listen_port(self):
        """The port the server listens on (after a start; useful with port 0)."""
        return self._server.getsockname()[1] if self._server else None

    # ------------------------------------------------------------ server

    def _bind(self):
        if self._listen is None or self._server is not None:
            return self._server is not None
        try:
            family = socket.AF_INET6 if ":" in self._listen[0] else socket.AF_INET
            self._server = socket.create_server(self._listen, family=family)
        except OSError as e:
            logger.error("mooncake: RpcInterface cannot listen on %s:%d: %s", *self._listen, e)
            return False
        self._stopped.clear()
        return True

    def start_server(self):
        """Serves until ``stop_server`` (blocking, as upstream). False if it cannot
        listen."""
        if not self._bind():
            return False
        self._serve(self._server)
        return True

    def start_server_async(self):
        """Starts serving on a background thread; True once listening."""
        if not self._bind():
            return False
        self._serve_thread = threading.Thread(target=self._serve, args=(self._server,),
                                              name="mooncake-rpc-server", daemon=True)
        self._serve_thread.start()
        return True

    def stop_server(self):
        server, self._server = self._server, None
        self._stopped.set()
        if server is not None:
            try:
                server.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass
            server.close()
        thread, self._serve_thread = self._serve_thread, None
        if thread is not None and thread is not threading.current_thread():
            thread.join(timeout=5)

    def _serve(self, server):
        while not self._stopped.is_set():
            try:
                conn, addr = server.accept()
            except OSError:
                return  # closed by stop_server
            threading.Thread(target=self._handle_connection, args=(conn, addr),
                             name="mooncake-rpc-conn", daemon=True).start()

    def _handle_connection(self, conn, addr):
        source = f"{addr[0]}:{addr[1]}"
        with conn:
            while not self._stopped.is_set():
                try:
                    kind, header_len, size = _FRAME.unpack(_recv_exact(conn, _FRAME.size))
                    if header_len > _MAX_TENSOR_HEADER or kind not in (_DATA, _TENSOR):
                        conn.sendall(_REFUSED)
                        return
                    header = _recv_exact(conn, header_len) if header_len else b""
                    payload = _recv_exact(conn, size) if size else b""
                except (ConnectionError, OSError):
                    return
                accepted = self._deliver(kind, source, header, payload)
                if self._forked:
                    return  # a callback forked: the connection answers in the parent
                try:
                    conn.sendall(_ACCEPTED if accepted else _REFUSED)
                except OSError:
                    return

    def _deliver(self, kind, source, header, payload):
        try:
            if kind == _DATA:
                if self._data_callback is not None:
                    self._data_callback({"source": source, "data": payload})
                return True
            meta = json.loads(header)
            received = ReceivedTensor(source, payload, meta["shape"], meta["dtype"])
            if self._tensor_callback is not None:
                self._tensor_callback(received)
            return True
        except Exception:  # a failing callback must not take the server down
            logger.exception("mooncake: RpcInterface receive callback failed")
            return False

    def set_data_receive_callback(self, callback):
        self._data_callback = callback

    def set_tensor_receive_callback(self, callback):
        self._tensor_callback = callback

    # ------------------------------------------------------------ client

    def _connection(self, target):
        with self._conns_lock:
            sock = self._conns.pop(target, None)
        if sock is not None:
            return sock
        host, port = split_host_port(target)
        if not port:
            raise ValueError(f"target address {target!r} has no port")
        return socket.create_connection((host, port), timeout=self._timeout)

    def _send_frame(self, target, kind, header, payload):
        """0 when the peer took the frame, else -1 (logged)."""
        if not self._initialized:
            logger.error("mooncake: RpcInterface used before initialize")
            return -1
        frame = _FRAME.pack(kind, len(header), len(payload))
        for attempt in range(2):  # a cached connection may have been closed by the peer
            try:
                sock = self._connection(target)
            except (OSError, ValueError) as e:
                logger.error("mooncake: RpcInterface cannot reach %s: %s", target, e)
                return -1
            try:
                sock.sendall(frame + header)
                sock.sendall(payload)
                answer = _recv_exact(sock, 1)
            except (OSError, ConnectionError) as e:
                sock.close()
                if attempt == 0:
                    continue
                logger.error("mooncake: RpcInterface send to %s failed: %s", target, e)
                return -1
            with self._conns_lock:
                old = self._conns.setdefault(target, sock)
            if old is not sock:
                sock.close()
            return 0 if answer == _ACCEPTED else -1
        return -1

    def send_data(self, target_address, data):
        return self._send_frame(target_address, _DATA, b"", _as_bytes(data))

    def send_tensor(self, target_address, tensor):
        try:
            meta, payload = _tensor_parts(tensor)
        except (TypeError, ValueError) as e:
            logger.error("mooncake: %s", e)
            return -1
        return self._send_frame(target_address, _TENSOR, json.dumps(meta).encode(), payload)

    def _send_async(self, loop, send, *args):
        future = loop.create_future()

        def finish(rc):
            if future.done():
                return
            if rc >= 0:
                future.set_result(rc)
            else:
                future.set_exception(RuntimeError("send failed"))

        def run():
            rc = send(*args)
            loop.call_soon_threadsafe(finish, rc)

        threading.Thread(target=run, name="mooncake-rpc-send", daemon=True).start()
        return future

    def send_data_async(self, target_address, data, loop):
        """An asyncio future on ``loop``: 0, or RuntimeError when the send failed."""
        return self._send_async(loop, self.send_data, target_address, _as_bytes(data))

    def send_tensor_async(self, target_address, tensor, loop):
        return self._send_async(loop, self.send_tensor, target_address, tensor)

    def close(self):
        """Stops the server and closes cached client connections (not in upstream)."""
        self.stop_server()
        with self._conns_lock:
            conns, self._conns = list(self._conns.values()), {}
        for sock in conns:
            sock.close()

    def __del__(self):
        try:
            self.close()
        except Exception:
            pass


CoroRPCInterface = RpcInterface


def create_rpc_client(local_rank=0, world_size=1):
    """An initialized client."""
    client = RpcInterface()
    client.initialize("", 0, 30, 10)
    return client


def create_rpc_server(local_rank=0, world_size=1):
    """A server initialized on 0.0.0.0:8080 (upstream's default); call
    ``start_server_async``."""
    server = RpcInterface()
    server.initialize("0.0.0.0:8080", 0, 30, 10)
    return server

