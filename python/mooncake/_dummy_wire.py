"""The dummy-client wire format: what a ``setup_dummy`` store and ``mooncake_client`` say
to each other (private; both ends use only this module to encode and decode).

A frame is a 12-byte header followed by a body::

    magic "MCDM" | version u8 (1) | kind u8 | flags u16 (0) | body length u32

(little-endian). The body is one value in a small tagged encoding:

    "N" None   "T" True   "F" False
    "i" int64  "u" uint64 (only for values >= 2**63)
    "s" str    (u32 length, UTF-8)   "b" bytes (u32 length)
    "l" list   (u32 count, then the items)

Kinds: REQUEST ``[op, [args...]]`` and its REPLY ``[status, result]`` (status 0, or the
negative Mooncake error code that refused the whole call, result None) on the TCP
connection; REGISTER ``[token, dummy_base, size, is_local]`` with a memfd attached
(SCM_RIGHTS) on the real client's local unix socket, answered by a REPLY; FAULT ``code``
just before a side closes a connection whose stream it can no longer trust.

Decoding checks every length against the bytes actually present, caps nesting, and
insists the body is consumed exactly: anything else is a :class:`BodyError` (the frame
was read whole, so the connection can go on). A bad header is a :class:`FrameError` (the
stream has lost its framing). No pickle: the TCP port is reachable from the network.
"""

import socket
import struct
import time

VERSION = 1
MAGIC = b"MCDM"

REQUEST = 1
REPLY = 2
REGISTER = 3
FAULT = 4
_KINDS = (REQUEST, REPLY, REGISTER, FAULT)

HEADER = struct.Struct("<4sBBHI")
_U32 = struct.Struct("<I")
_I64 = struct.Struct("<q")
_U64 = struct.Struct("<Q")
MAX_DEPTH = 8
_CHUNK = 1 << 20
_READ_AHEAD = 64 << 10


class FrameError(Exception):
    """The byte stream cannot be trusted any more (bad header, short read, timeout)."""


class Closed(FrameError):
    """The peer closed the connection between frames (an orderly end)."""


class BodyError(Exception):
    """One frame's body is malformed; the stream itself is still in step."""


# ---------------------------------------------------------------- encoding


def encode(value):
    out = []
    _put(value, out, 0)
    return b"".join(out)


def _put(v, out, depth):
    if depth > MAX_DEPTH:
        raise ValueError("value nested too deeply")
    if v is None:
        out.append(b"N")
    elif v is True:
        out.append(b"T")
    elif v is False:
        out.append(b"F")
    elif isinstance(v, int):
        if -(1 << 63) <= v < (1 << 63):
            out.append(b"i" + _I64.pack(v))
        elif v < (1 << 64):
            out.append(b"u" + _U64.pack(v))
        else:
            raise ValueError(f"integer {v} does not fit in 64 bits")
    elif isinstance(v, str):
        data = v.encode("utf-8")
        out.append(b"s" + _U32.pack(len(data)) + data)
    elif isinstance(v, (bytes, bytearray, memoryview)):
        data = bytes(v)
        out.append(b"b" + _U32.pack(len(data)) + data)
    elif isinstance(v, (list, tuple)):
        out.append(b"l" + _U32.pack(len(v)))
        for item in v:
            _put(item, out, depth + 1)
    else:
        raise TypeError(f"cannot encode {type(v).__name__}")


def frame(kind, value):
    body = encode(value)
    return HEADER.pack(MAGIC, VERSION, kind, 0, len(body)) + body


# ---------------------------------------------------------------- decoding


class _Reader:
    def __init__(self, data):
        self.data = data
        self.pos = 0

    def take(self, n):
        end = self.pos + n
        if end > len(self.data):
            raise BodyError("truncated value")
        chunk = self.data[self.pos:end]
        self.pos = end
        return chunk

    def value(self, depth):
        if depth > MAX_DEPTH:
            raise BodyError("value nested too deeply")
        tag = self.take(1)
        if tag == b"N":
            return None
        if tag == b"T":
            return True
        if tag == b"F":
            return False
        if tag == b"i":
            return _I64.unpack(self.take(8))[0]
        if tag == b"u":
            v = _U64.unpack(self.take(8))[0]
            if v < (1 << 63):
                raise BodyError("non-canonical uint64")
            return v
        if tag in (b"s", b"b"):
            n = _U32.unpack(self.take(4))[0]
            data = bytes(self.take(n))
            if tag == b"b":
                return data
            try:
                return data.decode("utf-8")
            except UnicodeDecodeError:
                raise BodyError("string is not UTF-8") from None
        if tag == b"l":
            n = _U32.unpack(self.take(4))[0]
            # Every item takes at least one byte: a count beyond what is left is a lie.
            if n > len(self.data) - self.pos:
                raise BodyError("list count exceeds the body")
            return [self.value(depth + 1) for _ in range(n)]
        raise BodyError(f"unknown tag {tag!r}")


def decode(body):
    r = _Reader(memoryview(body))
    v = r.value(0)
    if r.pos != len(body):
        raise BodyError("trailing bytes after the value")
    return v


def parse_header(raw, max_body):
    """(kind, body length) from a 12-byte header; FrameError if it is not ours or the
    body would exceed ``max_body``."""
    magic, version, kind, flags, length = HEADER.unpack(raw)
    if magic != MAGIC:
        raise FrameError("not a Mooncake dummy-client frame")
    if version != VERSION:
        raise FrameError(f"protocol version {version} (this side speaks {VERSION})")
    if kind not in _KINDS or flags != 0:
        raise FrameError(f"unknown frame kind {kind} / flags {flags:#x}")
    if length > max_body:
        raise FrameError(f"frame body of {length} bytes exceeds the limit of {max_body}")
    return kind, length


# ---------------------------------------------------------------- sockets


def send_frame(sock, kind, value):
    sock.sendall(frame(kind, value))


class FrameReader:
    """The frames of one connection, read ahead: one ``recv`` usually brings a whole
    small frame (reading the first byte, the header and the body apart cost three, each
    with its own poll). What arrives past a frame waits for the next call."""

    def __init__(self, sock):
        self.sock = sock
        self._buf = bytearray()

    def pending(self):
        """Whether bytes past the last frame read have arrived already."""
        return bool(self._buf)

    def _fill(self, need, timeout):
        """Reads until ``need`` bytes are buffered, waiting ``timeout`` seconds in all
        (None: forever). Memory grows only with what the peer really sent."""
        deadline = None if timeout is None else time.monotonic() + timeout
        while len(self._buf) < need:
            if deadline is None:
                self.sock.settimeout(None)
            else:
                remaining = deadline - time.monotonic()
                if remaining <= 0:
                    raise socket.timeout
                self.sock.settimeout(remaining)
            chunk = self.sock.recv(min(max(need - len(self._buf), _READ_AHEAD), _CHUNK))
            if not chunk:
                return False
            self._buf += chunk
        return True

    def read(self, max_body, idle_timeout, frame_timeout):
        """(kind, value) of the next frame. Waits at most ``idle_timeout`` seconds
        (None: forever) for its first byte and ``frame_timeout`` for the rest.
        FrameError when the stream broke or went silent; BodyError (frame consumed)
        for a malformed body."""
        try:
            if not self._fill(1, idle_timeout):
                raise Closed("connection closed")
        except socket.timeout:
            raise FrameError("idle timeout") from None
        deadline = time.monotonic() + frame_timeout
        try:
            if not self._fill(HEADER.size, frame_timeout):
                raise FrameError("connection closed")
            kind, length = parse_header(bytes(self._buf[:HEADER.size]), max_body)
            end = HEADER.size + length
            if not self._fill(end, max(deadline - time.monotonic(), 0.0)):
                raise FrameError("connection closed")
        except socket.timeout:
            raise FrameError("timed out inside a frame") from None
        body = bytes(self._buf[HEADER.size:end])
        del self._buf[:end]
        return kind, decode(body)
