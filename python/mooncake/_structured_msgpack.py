"""The subset of MessagePack that msgpack_ragged rows use, in pure Python.

Upstream packs each row with ``msgpack.packb(value, use_bin_type=True,
strict_types=True)`` and reads them back with ``msgpack.Unpacker(raw=False)``; this
module writes and reads the same bytes without the msgpack package:

* nil, bool, int (-2**63 .. 2**64-1), float (float64), str (UTF-8, str formats), bytes
  and bytearray (bin formats), list (array formats), dict (map formats);
* types are strict, as with ``strict_types=True``: a tuple, a subclass of int/float/
  str/dict/list or a numpy scalar is refused with TypeError;
* reading accepts every format of those families (float32 too) and gives str for str,
  bytes for bin, list for arrays and dict for maps; extension types are refused.
"""

import struct

__all__ = ["packb", "unpack_all"]

_MAX_DEPTH = 512


def packb(value):
    """The MessagePack bytes of ``value``; TypeError for a value it cannot carry."""
    out = bytearray()
    _pack(value, out, 0)
    return bytes(out)


def _pack(value, out, depth):
    if depth > _MAX_DEPTH:
        raise ValueError("msgpack value is nested too deeply")
    kind = type(value)
    if value is None:
        out.append(0xC0)
    elif kind is bool:
        out.append(0xC3 if value else 0xC2)
    elif kind is int:
        _pack_int(value, out)
    elif kind is float:
        out += b"\xcb" + struct.pack(">d", value)
    elif kind is str:
        data = value.encode("utf-8")
        _pack_header(len(data), out, fix=(0xA0, 32), sizes=((0xD9, "B"), (0xDA, ">H"),
                                                              (0xDB, ">I")))
        out += data
    elif kind in (bytes, bytearray):
        _pack_header(len(value), out, fix=None, sizes=((0xC4, "B"), (0xC5, ">H"),
                                                       (0xC6, ">I")))
        out += value
    elif kind is list:
        _pack_header(len(value), out, fix=(0x90, 16), sizes=((0xDC, ">H"), (0xDD, ">I")))
        for item in value:
            _pack(item, out, depth + 1)
    elif kind is dict:
        _pack_header(len(value), out, fix=(0x80, 16), sizes=((0xDE, ">H"), (0xDF, ">I")))
        for key, item in value.items():
            _pack(key, out, depth + 1)
            _pack(item, out, depth + 1)
    else:
        raise TypeError(f"can not serialize {kind.__name__!r} object")


def _pack_int(value, out):
    if 0 <= value < 0x80:
        out.append(value)
    elif -32 <= value < 0:
        out += struct.pack("b", value)
    elif value >= 0:
        for code, fmt, limit in ((0xCC, "B", 1 << 8), (0xCD, ">H", 1 << 16),
                                 (0xCE, ">I", 1 << 32), (0xCF, ">Q", 1 << 64)):
            if value < limit:
                out += bytes((code,)) + struct.pack(fmt, value)
                return
        raise OverflowError("int too big to pack")
    else:
        for code, fmt, limit in ((0xD0, "b", 1 << 7), (0xD1, ">h", 1 << 15),
                                 (0xD2, ">i", 1 << 31), (0xD3, ">q", 1 << 63)):
            if value >= -limit:
                out += bytes((code,)) + struct.pack(fmt, value)
                return
        raise OverflowError("int too big to pack")


def _pack_header(length, out, fix, sizes):
    if fix is not None and length < fix[1]:
        out.append(fix[0] | length)
        return
    for code, fmt in sizes:
        if length < 1 << (8 * struct.calcsize(fmt)):
            out += bytes((code,)) + struct.pack(fmt, length)
            return
    raise ValueError("msgpack value is too large")


def unpack_all(data):
    """Every value packed back to back in ``data`` (bytes-like), in order; ValueError
    for bytes that are not MessagePack of the supported formats."""
    view = memoryview(data).cast("B")
    values, pos = [], 0
    while pos < len(view):
        value, pos = _unpack(view, pos, 0)
        values.append(value)
    return values


def _take(view, pos, n):
    end = pos + n
    if end > len(view):
        raise ValueError("truncated msgpack data")
    return view[pos:end], end


def _number(view, pos, fmt):
    raw, end = _take(view, pos, struct.calcsize(fmt))
    return struct.unpack(fmt, raw)[0], end


# lead byte -> struct format of a number that follows it
_NUMBERS = {0xCA: ">f", 0xCB: ">d", 0xCC: "B", 0xCD: ">H", 0xCE: ">I", 0xCF: ">Q",
            0xD0: "b", 0xD1: ">h", 0xD2: ">i", 0xD3: ">q"}
# lead byte -> (kind, struct format of its length)
_SIZED = {0xC4: ("bin", "B"), 0xC5: ("bin", ">H"), 0xC6: ("bin", ">I"),
          0xD9: ("str", "B"), 0xDA: ("str", ">H"), 0xDB: ("str", ">I"),
          0xDC: ("array", ">H"), 0xDD: ("array", ">I"),
          0xDE: ("map", ">H"), 0xDF: ("map", ">I")}


def _unpack(view, pos, depth):
    if depth > _MAX_DEPTH:
        raise ValueError("msgpack data is nested too deeply")
    lead, pos = view[pos], pos + 1
    if lead < 0x80:
        return lead, pos
    if lead >= 0xE0:
        return lead - 0x100, pos
    if lead in _NUMBERS:
        return _number(view, pos, _NUMBERS[lead])
    if lead in (0xC0, 0xC2, 0xC3):
        return {0xC0: None, 0xC2: False, 0xC3: True}[lead], pos
    if 0xA0 <= lead < 0xC0:
        kind, length = "str", lead & 0x1F
    elif 0x90 <= lead < 0xA0:
        kind, length = "array", lead & 0x0F
    elif 0x80 <= lead < 0x90:
        kind, length = "map", lead & 0x0F
    elif lead in _SIZED:
        kind, fmt = _SIZED[lead]
        length, pos = _number(view, pos, fmt)
    else:
        raise ValueError(f"unsupported msgpack format byte 0x{lead:02x}")
    if kind in ("str", "bin"):
        raw, pos = _take(view, pos, length)
        if kind == "bin":
            return bytes(raw), pos
        try:
            return bytes(raw).decode("utf-8"), pos
        except UnicodeDecodeError:
            raise ValueError("msgpack str is not valid UTF-8") from None
    if kind == "array":
        items = []
        for _ in range(length):
            item, pos = _unpack(view, pos, depth + 1)
            items.append(item)
        return items, pos
    mapping = {}
    for _ in range(length):
        key, pos = _unpack(view, pos, depth + 1)
        item, pos = _unpack(view, pos, depth + 1)
        try:
            mapping[key] = item
        except TypeError:
            raise ValueError("msgpack map key is not hashable") from None
    return mapping, pos
