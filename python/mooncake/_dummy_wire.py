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
#
# Both directions run on each side of every dummy request, so the common shapes take
# the short way: exact types are tested first and a list's plain items (ints that fit,
# strs, bytes) are handled in its own loop; anything else takes the general path. The
# bytes and the errors are the same either way.

_I64_MIN, _I64_END, _U64_END = -(1 << 63), 1 << 63, 1 << 64
_pack_u32 = _U32.pack
_pack_i64 = _I64.pack


def encode(value):
    out = []
    _put(value, out, 0)
    return b"".join(out)


def _put(v, out, depth):
    if depth > MAX_DEPTH:
        raise ValueError("value nested too deeply")
    t = type(v)
    if t is list or t is tuple:
        out.append(b"l" + _pack_u32(len(v)))
        if depth >= MAX_DEPTH:  # the items are too deep: the general path says so
            for item in v:
                _put(item, out, depth + 1)
            return
        for item in v:
            t = type(item)
            if t is int and _I64_MIN <= item < _I64_END:
                out.append(b"i" + _pack_i64(item))
            elif t is str:
                data = item.encode("utf-8")
                out.append(b"s" + _pack_u32(len(data)) + data)
            elif t is bytes:
                out.append(b"b" + _pack_u32(len(item)) + item)
            else:
                _put(item, out, depth + 1)
    elif v is None:
        out.append(b"N")
    elif v is True:
        out.append(b"T")
    elif v is False:
        out.append(b"F")
    elif isinstance(v, int):  # a subclass: packed by its value, as struct does
        if _I64_MIN <= v < _I64_END:
            out.append(b"i" + _pack_i64(v))
        elif 0 <= v < _U64_END:
            out.append(b"u" + _U64.pack(v))
        else:
            raise ValueError(f"integer {v} does not fit in 64 bits")
    elif isinstance(v, str):
        data = str.encode(v, "utf-8")  # not str(v): a subclass may say something else
        out.append(b"s" + _pack_u32(len(data)) + data)
    elif isinstance(v, (bytes, bytearray, memoryview)):
        data = bytes(v)
        out.append(b"b" + _pack_u32(len(data)) + data)
    elif isinstance(v, (list, tuple)):
        _put(list(v), out, depth)
    else:
        raise TypeError(f"cannot encode {type(v).__name__}")


def frame(kind, value):
    body = encode(value)
    return HEADER.pack(MAGIC, VERSION, kind, 0, len(body)) + body


# ---------------------------------------------------------------- decoding

_TAG_N, _TAG_T, _TAG_F, _TAG_I, _TAG_U, _TAG_S, _TAG_B, _TAG_L = b"NTFiusbl"
_i64_at = _I64.unpack_from
_u64_at = _U64.unpack_from
_u32_at = _U32.unpack_from


def decode(body):
    """The one value of a frame body; BodyError unless the body is exactly one
    well-formed value."""
    data = bytes(body)
    try:
        v, pos = _value(data, 0, 0)
    except struct.error:  # a fixed-width field past the end
        raise BodyError("truncated value") from None
    if pos != len(data):
        raise BodyError("trailing bytes after the value")
    return v


def _value(data, pos, depth):
    """(value, position after it) of the value at ``pos``."""
    if depth > MAX_DEPTH:
        raise BodyError("value nested too deeply")
    if pos >= len(data):
        raise BodyError("truncated value")
    tag = data[pos]
    pos += 1
    if tag == _TAG_L:
        n = _u32_at(data, pos)[0]
        pos += 4
        size = len(data)
        # Every item takes at least one byte: a count beyond what is left is a lie.
        if n > size - pos:
            raise BodyError("list count exceeds the body")
        items = []
        append = items.append
        plain = depth < MAX_DEPTH  # items one level down may be read here
        for _ in range(n):
            tag = data[pos] if plain and pos < size else None
            if tag == _TAG_I:
                append(_i64_at(data, pos + 1)[0])
                pos += 9
            elif tag == _TAG_S or tag == _TAG_B:
                end = pos + 5 + _u32_at(data, pos + 1)[0]
                if end > size:
                    raise BodyError("truncated value")
                if tag == _TAG_B:
                    append(data[pos + 5:end])
                else:
                    try:
                        append(data[pos + 5:end].decode("utf-8"))
                    except UnicodeDecodeError:
                        raise BodyError("string is not UTF-8") from None
                pos = end
            elif tag == _TAG_T or tag == _TAG_F or tag == _TAG_N:
                append(True if tag == _TAG_T else False if tag == _TAG_F else None)
                pos += 1
            else:
                v, pos = _value(data, pos, depth + 1)
                append(v)
        return items, pos
    if tag == _TAG_I:
        return _i64_at(data, pos)[0], pos + 8
    if tag == _TAG_S or tag == _TAG_B:
        end = pos + 4 + _u32_at(data, pos)[0]
        if end > len(data):
            raise BodyError("truncated value")
        chunk = data[pos + 4:end]
        if tag == _TAG_B:
            return chunk, end
        try:
            return chunk.decode("utf-8"), end
        except UnicodeDecodeError:
            raise BodyError("string is not UTF-8") from None
    if tag == _TAG_N:
        return None, pos
    if tag == _TAG_T:
        return True, pos
    if tag == _TAG_F:
        return False, pos
    if tag == _TAG_U:
        v = _u64_at(data, pos)[0]
        if v < _I64_END:
            raise BodyError("non-canonical uint64")
        return v, pos + 8
    raise BodyError(f"unknown tag {bytes([tag])!r}")


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
        if len(self._buf) >= need:
            return True
        deadline = None if timeout is None else time.monotonic() + timeout
        while len(self._buf) < need:
            self._wait_at_most(deadline)
            try:
                chunk = self.sock.recv(min(max(need - len(self._buf), _READ_AHEAD), _CHUNK))
            except socket.timeout:
                if deadline - time.monotonic() > 0:
                    continue  # woken a little early (see _wait_at_most)
                raise
            if not chunk:
                return False
            self._buf += chunk
        return True

    def _wait_at_most(self, deadline):
        """Sets the socket's timeout so a wait ends by ``deadline`` (None: never). Each
        ``settimeout`` is a system call, so a timeout a little shorter than what is
        left is kept as it is: a recv then at worst wakes early and waits again."""
        current = self.sock.gettimeout()
        if deadline is None:
            if current is not None:
                self.sock.settimeout(None)
            return
        remaining = deadline - time.monotonic()
        if remaining <= 0:
            raise socket.timeout
        if current is None or not 0.9 * remaining <= current <= remaining:
            self.sock.settimeout(0.95 * remaining)

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
        buf = self._buf
        if len(buf) >= HEADER.size:  # the usual case: the whole frame came at once
            kind, length = parse_header(bytes(buf[:HEADER.size]), max_body)
            end = HEADER.size + length
            if len(buf) < end:
                self._rest(end, time.monotonic() + frame_timeout)
        else:
            deadline = time.monotonic() + frame_timeout
            self._rest(HEADER.size, deadline)
            kind, length = parse_header(bytes(buf[:HEADER.size]), max_body)
            end = HEADER.size + length
            self._rest(end, deadline)
        body = bytes(buf[HEADER.size:end])
        del buf[:end]
        return kind, decode(body)

    def _rest(self, need, deadline):
        """The rest of a frame begun: ``need`` bytes buffered by ``deadline``."""
        try:
            if not self._fill(need, max(deadline - time.monotonic(), 0.0)):
                raise FrameError("connection closed")
        except socket.timeout:
            raise FrameError("timed out inside a frame") from None
