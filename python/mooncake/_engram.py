"""Embedding tables for Engram-style N-gram embedding layers, kept in Mooncake Store
(``mooncake.store.EngramStoreConfig`` and ``mooncake.store.EngramStore``).

Only the storage side lives here: the caller decides the tables' sizes, computes row ids
(hashing, routing and the rest of the model stay with the caller), uploads one table per
head, and asks for rows by id.

Layout, shared with upstream's C++ backend so either side finds the other's tables:

* layer ``layer_id`` keeps head ``h``'s table under the key ``engram:l{layer_id}:h{h}``;
* a table's value is its rows back to back: row-major float32 ``[N_h, D]`` in native
  byte order, ``N_h * D * 4`` bytes.

``lookup`` reads only the rows it needs: per head it sorts the distinct row ids, turns
each run of consecutive ids into one byte range of the table, gathers every head's ranges
with a single ``get_into_ranges`` call into one registered staging array, and builds the
``[B, L, H, D]`` answer from that array with numpy indexing (so a repeated id is read
once, and a request covering a whole table reads it as one range).

numpy is imported only when a method needs it.
"""

import logging
import operator

from ._common import ErrorCode

logger = logging.getLogger("mooncake")

__all__ = ["EngramStoreConfig", "EngramStore"]

_OBJECT_NOT_FOUND = int(ErrorCode.OBJECT_NOT_FOUND)
_INVALID_PARAMS = int(ErrorCode.INVALID_PARAMS)
_INT_MIN, _INT_MAX = -(1 << 31), (1 << 31) - 1
_I64_MIN, _I64_MAX = -(1 << 63), (1 << 63) - 1
_ROW_BYTES_PER_VALUE = 4  # float32

# What EngramStore calls on its store (MooncakeDistributedStore has them all).
_STORE_METHODS = ("register_buffer", "unregister_buffer", "batch_put_from", "batch_is_exist",
                  "get_into_ranges", "remove")


def _c_int(value, what, lo, hi):
    """``value`` as a Python int in [lo, hi]; TypeError otherwise (floats included)."""
    if isinstance(value, float):
        raise TypeError(f"{what}: expected an int, got float")
    try:
        v = operator.index(value)
    except TypeError:
        raise TypeError(f"{what}: expected an int, got {type(value).__name__}") from None
    if not lo <= v <= hi:
        raise TypeError(f"{what}: {v} does not fit in a {hi.bit_length() + 1}-bit int")
    return v


def _int_list(value, what):
    """A list of int64 values from a sequence (list, tuple, numpy array); TypeError for
    anything else, strings and unordered collections included."""
    if isinstance(value, (str, bytes, bytearray, dict)) or \
            not hasattr(type(value), "__getitem__") or not hasattr(value, "__len__"):
        raise TypeError(f"{what}: expected a list of int, got {type(value).__name__}")
    return [_c_int(v, f"{what}[{i}]", _I64_MIN, _I64_MAX) for i, v in enumerate(value)]


def _numpy():
    try:
        import numpy
    except ImportError as e:  # pragma: no cover - depends on the environment
        raise ImportError("EngramStore needs numpy (pip install numpy)") from e
    return numpy


class EngramStoreConfig:
    """The physical layout of one layer's tables: ``table_vocab_sizes`` (rows per head's
    table, one entry per head; default ``[1024]``) and ``embedding_dim`` (floats per row;
    default 64). Values are checked when an EngramStore is built from the config."""

    __slots__ = ("_table_vocab_sizes", "_embedding_dim")

    def __init__(self):
        self._table_vocab_sizes = [1024]
        self._embedding_dim = 64

    @property
    def table_vocab_sizes(self):
        """Rows of each head's table (a copy: assign a new list to change it)."""
        return list(self._table_vocab_sizes)

    @table_vocab_sizes.setter
    def table_vocab_sizes(self, value):
        self._table_vocab_sizes = _int_list(value, "EngramStoreConfig.table_vocab_sizes")

    @property
    def embedding_dim(self):
        """Width D of every row, in float32 values."""
        return self._embedding_dim

    @embedding_dim.setter
    def embedding_dim(self, value):
        self._embedding_dim = _c_int(value, "EngramStoreConfig.embedding_dim", _INT_MIN,
                                     _INT_MAX)


EngramStoreConfig.__module__ = "mooncake.store"


def _force_flag(force):
    """remove_from_store's ``force`` as a bool: None and anything with a truth value of
    its own (bool, int, float, numpy scalars) are taken; other objects are a TypeError."""
    if force is None:
        return False
    if isinstance(force, (str, bytes)) or not hasattr(type(force), "__bool__"):
        raise TypeError(f"remove_from_store(): force must be a bool, got "
                        f"{type(force).__name__}")
    return bool(force)


def _merged_spans(spans):
    """The (address, size) spans joined where they overlap, so each byte is registered
    once even when two heads share memory."""
    out = []
    for addr, size in sorted(spans):
        if out and addr < out[-1][0] + out[-1][1]:
            start, n = out[-1]
            out[-1] = (start, max(n, addr + size - start))
        else:
            out.append((addr, size))
    return out


class EngramStore:
    """One layer's embedding tables in Mooncake Store, one float32 ``[N_h, D]`` table per
    head under ``engram:l{layer_id}:h{h}``.

    ``store`` is a set-up ``MooncakeDistributedStore`` (or an object with the same
    ``register_buffer``, ``unregister_buffer``, ``batch_put_from``, ``batch_is_exist``,
    ``get_into_ranges`` and ``remove``), or None for an object that only answers the
    metadata getters (populate, lookup and remove_from_store then raise RuntimeError).
    The config is copied: changing it afterwards changes nothing here.
    """

    __slots__ = ("_store", "_vocab", "_dim", "_keys")

    def __init__(self, layer_id, config, store=None):
        layer = _c_int(layer_id, "EngramStore(): layer_id", _INT_MIN, _INT_MAX)
        if not isinstance(config, EngramStoreConfig):
            raise TypeError(f"EngramStore(): config must be an EngramStoreConfig, got "
                            f"{type(config).__name__}")
        if store is not None:
            missing = [m for m in _STORE_METHODS if not callable(getattr(store, m, None))]
            if missing:
                raise RuntimeError(
                    "EngramStore store parameter must be a MooncakeDistributedStore (or "
                    f"None); {type(store).__name__} lacks {', '.join(missing)}")
        vocab = config.table_vocab_sizes
        dim = config.embedding_dim
        if not vocab:
            raise ValueError("EngramStoreConfig.table_vocab_sizes must not be empty")
        if dim <= 0:
            raise ValueError("EngramStoreConfig.embedding_dim must be positive")
        if any(n <= 0 for n in vocab):
            raise ValueError("EngramStoreConfig.table_vocab_sizes must contain only "
                             "positive values")
        self._store = store
        self._vocab = vocab
        self._dim = dim
        self._keys = [f"engram:l{layer}:h{h}" for h in range(len(vocab))]

    # ------------------------------------------------------------ metadata

    def get_table_vocab_sizes(self):
        """Rows of each head's table."""
        return list(self._vocab)

    def get_store_keys(self):
        """The store key of each head's table, head 0 first."""
        return list(self._keys)

    def get_num_heads(self):
        return len(self._vocab)

    def get_embedding_dim(self):
        return self._dim

    # ------------------------------------------------------------ helpers

    def _need_store(self, what):
        if self._store is None:
            raise RuntimeError(f"EngramStore {what} failed: this EngramStore was built "
                               "without a store (store=None)")
        return self._store

    def _table_bytes(self, h):
        return self._vocab[h] * self._dim * _ROW_BYTES_PER_VALUE

    # ------------------------------------------------------------ remove

    def remove_from_store(self, force=False):
        """Removes every head's table of this layer; the number removed. Tables that are
        not there are skipped; any other failure (after trying every key) raises
        RuntimeError with the first error code."""
        force = _force_flag(force)
        if self._store is None:
            raise RuntimeError(f"remove_from_store failed, rc={_INVALID_PARAMS} (this "
                               "EngramStore was built without a store)")
        removed, first_error = 0, 0
        for key in self._keys:
            rc = self._store.remove(key, force)
            if rc == 0:
                removed += 1
            elif rc != _OBJECT_NOT_FOUND and first_error == 0:
                first_error = rc
        if first_error:
            try:
                name = f" ({ErrorCode(first_error).name})"
            except ValueError:
                name = ""
            hint = "; a table being read is leased: force=True removes it anyway" \
                if name == " (OBJECT_HAS_LEASE)" else ""
            raise RuntimeError(f"remove_from_store failed, rc={first_error}{name} after "
                               f"removing {removed} of {len(self._keys)} tables{hint}")
        return removed

    # ------------------------------------------------------------ populate

    def _tables(self, embedding_buffers):
        """The checked tables as C-contiguous float32 arrays (converted copies where the
        input was another dtype or layout)."""
        np = _numpy()
        if not isinstance(embedding_buffers, list):
            raise TypeError("populate(): embedding_buffers must be a list of numpy arrays, "
                            f"got {type(embedding_buffers).__name__}")
        if len(embedding_buffers) != len(self._vocab):
            raise RuntimeError(f"embedding_buffers size must match num_heads (got "
                               f"{len(embedding_buffers)} tables for {len(self._vocab)} "
                               "heads)")
        tables = []
        for h, buf in enumerate(embedding_buffers):
            if not isinstance(buf, np.ndarray):
                raise RuntimeError(f"embedding_buffers must be NumPy arrays (entry {h} is "
                                   f"{type(buf).__name__})")
            try:
                if buf.dtype.kind not in "biufO":
                    raise ValueError(buf.dtype)
                arr = np.ascontiguousarray(buf, dtype=np.float32)
            except (TypeError, ValueError):
                raise RuntimeError(f"embedding_buffers must be float32 arrays (entry {h} "
                                   f"has dtype {buf.dtype})") from None
            if arr.ndim != 2:
                raise RuntimeError(f"each embedding buffer must be 2D [N_h, D] (entry {h} "
                                   f"has shape {tuple(arr.shape)})")
            want = (self._vocab[h], self._dim)
            if tuple(arr.shape) != want:
                raise RuntimeError(
                    "embedding buffer shape does not match get_table_vocab_sizes()/"
                    f"get_embedding_dim() (entry {h} has shape {tuple(arr.shape)}, "
                    f"expected {want})")
            tables.append(arr)
        return tables

    def _register(self, store, spans, what):
        """Registers the spans (merged) that the store does not cover yet; the addresses
        registered, for _unregister. RuntimeError when one is refused."""
        covered = getattr(store, "_zero_copy", None)
        done = []
        for addr, size in _merged_spans(spans):
            if covered is not None and covered(addr, size):
                continue
            rc = store.register_buffer(addr, size)
            if rc != 0:
                self._unregister(store, done)
                raise RuntimeError(f"EngramStore {what} failed: register_buffer of "
                                   f"{size} bytes at 0x{addr:x} returned {rc}")
            done.append(addr)
        return done

    @staticmethod
    def _unregister(store, addrs):
        """Unregisters every address; True when all went well."""
        ok = True
        for addr in addrs:
            if store.unregister_buffer(addr) != 0:
                ok = False
        return ok

    def populate(self, embedding_buffers):
        """Uploads one table per head: ``embedding_buffers[h]`` a numpy array of shape
        ``[N_h, D]`` (converted to float32 when it is another numeric dtype). Create-only:
        raises RuntimeError, storing nothing, when any of the layer's keys already exists
        (remove_from_store first). A failed upload removes what it had written."""
        tables = self._tables(embedding_buffers)
        store = self._need_store("populate")
        keys = self._keys
        exists = store.batch_is_exist(keys)
        if len(exists) != len(keys):
            raise RuntimeError("EngramStore populate failed: could not check whether the "
                               "layer's tables exist")
        for key, e in zip(keys, exists):
            if e < 0:
                raise RuntimeError(f"EngramStore populate failed: checking whether {key!r} "
                                   f"exists returned {e}")
            if e:
                raise RuntimeError(f"EngramStore populate failed: {key!r} already exists; "
                                   "remove the layer with remove_from_store() first")
        addrs = [t.ctypes.data for t in tables]
        sizes = [t.nbytes for t in tables]
        registered = self._register(store, list(zip(addrs, sizes)), "populate")
        try:
            results = store.batch_put_from(keys, addrs, sizes)
        finally:
            released = self._unregister(store, registered)
        complete = len(results) == len(keys)
        failed = [(k, r) for k, r in zip(keys, results) if r != 0] if complete else \
            [(k, None) for k in keys]
        if not failed and released:
            return None
        # Best effort: take back what this call wrote (not a key whose put failed: that
        # one may be another writer's), so a retry starts from nothing.
        for i, key in enumerate(keys):
            if complete and results[i] != 0:
                continue
            rc = store.remove(key, True)
            if rc not in (0, _OBJECT_NOT_FOUND):
                logger.error("mooncake: EngramStore populate: could not roll back %r (rc=%d)",
                             key, rc)
        if failed:
            detail = ", ".join(f"{k!r}: rc={r}" for k, r in failed)
            raise RuntimeError(f"EngramStore populate failed: storing tables failed ({detail})")
        raise RuntimeError("EngramStore populate failed: unregistering the tables' memory "
                           "failed after the upload (the upload was rolled back)")

    # ------------------------------------------------------------ lookup

    def _row_ids(self, row_ids):
        """row_ids as a C-contiguous int64 array [B, L, H], its shape checked."""
        np = _numpy()
        H = len(self._vocab)
        if isinstance(row_ids, np.ndarray):
            kind = row_ids.dtype.kind
            try:
                if kind in "biuf":
                    ids = row_ids.astype(np.int64, order="C", casting="unsafe")
                elif kind == "O":
                    ids = np.ascontiguousarray(row_ids.astype(np.int64))
                else:
                    raise ValueError(row_ids.dtype)
            except (TypeError, ValueError, OverflowError):
                raise RuntimeError("row_ids array must be convertible to int64 (got dtype "
                                   f"{row_ids.dtype})") from None
            if ids.ndim != 3:
                raise RuntimeError("row_ids array must have shape [B, L, H] (got shape "
                                   f"{tuple(ids.shape)})")
            if ids.shape[2] != H:
                raise RuntimeError(f"row_ids last dimension must match num_heads (got "
                                   f"{ids.shape[2]}, num_heads is {H})")
            if ids.shape[0] == 0 or ids.shape[1] == 0:
                raise RuntimeError("row_ids must not be empty")
            return ids
        ids = None
        if isinstance(row_ids, (list, tuple)) or hasattr(row_ids, "__array__"):
            # The common case at numpy speed: a rectangular nested list (or an array-like
            # such as a CPU tensor) of ints; anything else goes element by element.
            try:
                arr = np.array(row_ids)
            except (TypeError, ValueError, OverflowError):
                arr = None
            if arr is not None and arr.ndim == 3 and arr.dtype.kind in "bi":
                ids = arr.astype(np.int64, order="C")
        if ids is None:
            ids = self._nested_row_ids(row_ids, np)
        B = ids.shape[0]
        if B == 0 or ids.shape[1] == 0:
            raise RuntimeError("row_ids must not be empty")
        if ids.shape[2] != H:
            raise RuntimeError(f"EngramStore lookup failed: row_ids[0][0] has "
                               f"{ids.shape[2]} row ids; expected one per head ({H})")
        return ids

    def _nested_row_ids(self, row_ids, np):
        """Element by element: any iterable of iterables of iterables of ints."""
        H = len(self._vocab)
        rows = []
        for b, batch in enumerate(row_ids):
            tokens = []
            for l, token in enumerate(_iterate(batch, f"row_ids[{b}]")):
                heads = []
                for h, given in enumerate(_iterate(token, f"row_ids[{b}][{l}]")):
                    try:
                        if isinstance(given, float):
                            raise TypeError
                        v = operator.index(given)
                    except TypeError:
                        raise RuntimeError(f"row_ids[{b}][{l}][{h}]: expected an integer row "
                                           f"id, got {type(given).__name__}") from None
                    if not _I64_MIN <= v <= _I64_MAX:
                        raise RuntimeError(f"EngramStore lookup failed: row_ids[{b}][{l}][{h}]"
                                           f" = {v} does not fit in int64")
                    heads.append(v)
                tokens.append(heads)
            rows.append(tokens)
        if not rows or not rows[0]:
            raise RuntimeError("row_ids must not be empty")
        L = len(rows[0])
        for b, tokens in enumerate(rows):
            if len(tokens) != L:
                raise RuntimeError(f"EngramStore lookup failed: row_ids must have shape "
                                   f"[B, L, H]; row_ids[{b}] has {len(tokens)} tokens, "
                                   f"row_ids[0] has {L}")
            for l, heads in enumerate(tokens):
                if len(heads) != H:
                    raise RuntimeError(f"EngramStore lookup failed: row_ids[{b}][{l}] has "
                                       f"{len(heads)} row ids; expected one per head ({H})")
        return np.array(rows, dtype=np.int64).reshape(len(rows), L, H)

    def _check_bounds(self, ids, np):
        vocab = np.asarray(self._vocab, dtype=np.int64)
        bad = (ids < 0) | (ids >= vocab)
        if bad.any():
            b, l, h = (int(i) for i in np.argwhere(bad)[0])
            raise RuntimeError(f"EngramStore lookup failed: row_ids[{b}][{l}][{h}] = "
                               f"{int(ids[b, l, h])} is out of range for head {h} (table "
                               f"size {self._vocab[h]})")

    def lookup(self, row_ids):
        """The rows ``row_ids`` name: ``row_ids`` has shape ``[B, L, H]`` (H = the number
        of heads; a nested sequence of ints or a numpy array convertible to int64) and
        ``row_ids[b][l][h]`` is a row of head h's table; returns a new float32 numpy array
        ``[B, L, H, D]``. RuntimeError for a bad shape, an id out of range, a table not in
        the store, or a failed read."""
        np = _numpy()
        ids = self._row_ids(row_ids)
        self._check_bounds(ids, np)
        store = self._need_store("lookup")
        B, L, H = ids.shape
        D = self._dim
        row_bytes = D * _ROW_BYTES_PER_VALUE
        # Per head: the distinct rows (sorted), where each token's row sits among them,
        # and the runs of consecutive rows, each one ranged read.
        where = np.empty((B * L, H), dtype=np.int64)
        dsts, srcs, lens = [], [], []
        base = 0
        for h in range(H):
            uniq, inverse = np.unique(ids[:, :, h].reshape(-1), return_inverse=True)
            where[:, h] = inverse.reshape(-1) + base
            starts = np.flatnonzero(np.diff(uniq) != 1) + 1
            run_first = np.concatenate(([0], starts))
            run_len = np.diff(np.concatenate((run_first, [uniq.size])))
            dsts.append(((run_first + base) * row_bytes).tolist())
            srcs.append((uniq[run_first] * row_bytes).tolist())
            lens.append((run_len * row_bytes).tolist())
            base += uniq.size
        staging = np.empty((base, D), dtype=np.float32)
        addr = staging.ctypes.data
        registered = self._register(store, [(addr, staging.nbytes)], "lookup")
        try:
            results = store.get_into_ranges([addr], [list(self._keys)], [dsts], [srcs],
                                            [lens])
        finally:
            released = self._unregister(store, registered)
        got = results[0] if len(results) == 1 else []
        for h, key in enumerate(self._keys):
            per_range = got[h] if h < len(got) else [_INVALID_PARAMS]
            if list(per_range) != lens[h]:
                raise RuntimeError(self._read_failure(store, h, per_range))
        if not released:
            raise RuntimeError("EngramStore lookup failed: unregistering the output "
                               "buffer failed")
        return staging[where].reshape(B, L, H, D)

    def _read_failure(self, store, h, per_range):
        key = self._keys[h]
        codes = [r for r in per_range if r < 0]
        rc = codes[0] if codes else None
        missing = rc == _OBJECT_NOT_FOUND
        if not missing:
            try:
                missing = store.is_exist(key) == 0
            except Exception:  # only for the message
                missing = False
        if missing:
            return (f"EngramStore lookup failed: table {key!r} is not in the store "
                    "(populate() the layer first)")
        if rc == _INVALID_PARAMS:
            return (f"EngramStore lookup failed: reading {key!r} returned {rc} (is the "
                    f"stored table smaller than {self._table_bytes(h)} bytes, i.e. written "
                    "with another table_vocab_sizes/embedding_dim?)")
        return f"EngramStore lookup failed: reading {key!r} returned {rc}"


def _iterate(obj, what):
    try:
        return iter(obj)
    except TypeError:
        raise TypeError(f"{what}: expected a sequence, got {type(obj).__name__}") from None


EngramStore.__module__ = "mooncake.store"
