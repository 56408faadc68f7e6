"""The values that travel between the layers of ``mooncake.structured_object_store``:
payload forms a member can take on its way to the store, destinations a read can fill,
pool-backed read results, and the write-config and removal helpers every layer shares.

Payload forms (upstream's names in brackets, as the public module re-exports them):
  TensorPayload [_TensorPayload]                a torch tensor, put with the store's
                                                tensor calls or serialized
  TensorObjectBuffer [_TensorObjectBufferPayload]  bytes in registered memory, put
                                                with put_from as one object
  MultiBufferPayload [_MultiBufferPayload]      byte views written back to back
                                                (``dtype``/``shape``: read back as an
                                                ndarray)
  DirectCopyPayload [_DirectCopyPayload]        ndarrays copied straight into pool
                                                leases at put time (fast-copy)
  RawDestination [_RawDestinationBuffer]        memory a read fills

numpy and torch are imported only when a value needs them.
"""

import copy
import ctypes
import importlib
import sys
import types
from dataclasses import dataclass
from typing import Any, Optional

MISSING_OBJECT_ERROR = -704  # remove() of an object already gone
DUPLICATE_REGISTRATION = -600  # register_buffer() of memory registered already


# ---------------------------------------------------------------- lazy imports


def numpy():
    try:
        import numpy as np
    except ImportError:
        raise ImportError("mooncake.structured_object_store needs numpy for array values "
                          "(pip install numpy)") from None
    return np


def torch_module():
    try:
        import torch
    except ImportError:
        raise ImportError("mooncake.structured_object_store needs torch for tensor values "
                          "(pip install torch)") from None
    return torch


def is_tensor(value):
    torch = sys.modules.get("torch")
    return torch is not None and isinstance(value, torch.Tensor)


def is_ndarray(value):
    np = sys.modules.get("numpy")
    return np is not None and isinstance(value, np.ndarray)


def facade(name):
    """``mooncake.structured_object_store.<name>``, looked up at each use: the public
    module holds the replaceable hooks (``_concat_arrays_into``,
    ``_has_tensor_codec_helpers``) that callers and tests may swap."""
    return getattr(importlib.import_module("mooncake.structured_object_store"), name)


# ---------------------------------------------------------------- payload forms


@dataclass(frozen=True)
class TensorPayload:
    tensor: Any


@dataclass(frozen=True)
class TensorObjectBuffer:
    ptr: int
    size: int
    owner: Any
    batch_size: Optional[int] = None

    def __len__(self):
        if self.batch_size is None:
            raise TypeError("tensor object buffer requires batch_size for DataProto use")
        return self.batch_size


@dataclass(frozen=True)
class MultiBufferPayload:
    buffers: tuple
    owners: tuple = ()
    dtype: Optional[str] = None
    shape: Optional[tuple] = None

    @property
    def nbytes(self):
        return sum(len(b) for b in self.buffers)


@dataclass(frozen=True)
class DirectCopyPayload:
    arrays: list
    total_bytes: int
    dtype: Optional[str] = None
    shape: Optional[tuple] = None

    @property
    def nbytes(self):
        return self.total_bytes

    @staticmethod
    def from_flat_arrays(flat_arrays, dtype, total_elems):
        return DirectCopyPayload(list(flat_arrays), sum(a.nbytes for a in flat_arrays),
                                 numpy().dtype(dtype).str, (int(total_elems),))


@dataclass(frozen=True)
class RawDestination:
    ptr: int
    size: int
    owner: Any = None
    pre_registered: bool = False


def byte_view(value, what):
    """A flat unsigned-byte memoryview of a bytes-like value (copied when it is not
    contiguous)."""
    try:
        view = memoryview(value)
    except TypeError:
        raise TypeError(f"{what} must be bytes-like, got {type(value).__name__}") from None
    if not view.contiguous:
        view = memoryview(view.tobytes())
    return view.cast("B")


def address_of(buffer):
    """The address of a writable bytearray, numpy array or memoryview."""
    if is_ndarray(buffer):
        return int(buffer.ctypes.data)
    return ctypes.addressof(ctypes.c_char.from_buffer(buffer))


def nbytes_of(buffer):
    return int(buffer.nbytes) if is_ndarray(buffer) else len(buffer)


# ---------------------------------------------------------------- pool-backed results


class PoolLeaseOwner:
    """Gives a BufferPool lease back once: on ``release`` or when collected."""

    def __init__(self, lease):
        self.lease = lease
        self.released = False

    def release(self):
        if not self.released:
            self.released = True
            self.lease.release()

    def __del__(self):
        try:
            self.release()
        except Exception:
            pass


_array_types = {}


def _owner_array_type(name):
    """An ndarray subclass whose views share their base's ``_mooncake_pool_owner``."""
    cls = _array_types.get(name)
    if cls is None:
        np = numpy()

        def finalize(self, obj):
            if obj is not None:
                self._mooncake_pool_owner = getattr(obj, "_mooncake_pool_owner", None)

        members = {"__array_finalize__": finalize}
        if name == "object":
            def tolist(self):
                values = np.ndarray.tolist(self)
                owner = getattr(self, "_mooncake_pool_owner", None)
                return values if owner is None else OwnerBackedList(values, owner)

            members["tolist"] = tolist
        cls = _array_types[name] = type(f"_PoolBacked{name.title()}Array", (np.ndarray,),
                                        members)
    return cls


def pool_array(owner, dtype, shape):
    """An ndarray of ``shape`` over ``owner``'s lease; it (and its views) keep the owner
    alive. Views must not outlive a ``release_result`` of the base."""
    np = numpy()
    dtype = np.dtype(dtype)
    count = 1
    for d in shape:
        count *= int(d)
    nbytes = count * dtype.itemsize
    raw = (ctypes.c_uint8 * max(nbytes, 1)).from_address(owner.lease.ptr)
    array = np.frombuffer(raw, np.uint8, nbytes).view(dtype).reshape(shape)
    array = array.view(_owner_array_type("data"))
    array._mooncake_pool_owner = owner
    return array


class OwnerBackedList(list):
    """Rows decoded as views of pool memory, holding the pool owner."""

    def __init__(self, values, owner):
        super().__init__(values)
        self._mooncake_pool_owner = owner


def object_array(values):
    """A 1-D object ndarray of ``values``; it holds their pool owner, if any."""
    np = numpy()
    array = np.empty(len(values), dtype=object)
    for i, v in enumerate(values):
        array[i] = v
    owner = getattr(values, "_mooncake_pool_owner", None) or next(
        (getattr(v, "_mooncake_pool_owner", None) for v in values if v is not None), None)
    if owner is None:
        return array
    array = array.view(_owner_array_type("object"))
    array._mooncake_pool_owner = owner
    return array


# ---------------------------------------------------------------- write configs

# What a config copy keeps when copy.copy refuses (upstream's list).
_CONFIG_FIELDS = ("data_type", "group_ids", "nof_replica_num", "prefer_alloc_in_same_node",
                  "preferred_nof_segments", "preferred_segment", "preferred_segments",
                  "replica_num", "with_hard_pin", "with_soft_pin")
ONE_GROUP_ERROR = ("structured object store config.group_ids must contain exactly one "
                   "logical group id; it is expanded across internal Mooncake keys")


def call_with_config(fn, *args, config=None):
    """``fn(*args)``, passing ``config=`` only when there is one (duck stores need not
    take it)."""
    return fn(*args) if config is None else fn(*args, config=config)


def copy_config(config):
    """A copy of a write config: copy.copy, else a default one given its known fields."""
    try:
        return copy.copy(config)
    except TypeError:
        pass
    try:
        copied = type(config)()
    except Exception as e:
        raise TypeError("structured object store config must be copyable or "
                        "default-constructible") from e
    for name in _CONFIG_FIELDS:
        try:
            value = getattr(config, name)
        except Exception:
            continue
        if isinstance(value, (list, tuple)):
            value = type(value)(value)
        try:
            setattr(copied, name, value)
        except Exception as e:
            raise TypeError(f"structured object store config field {name!r} is not "
                            "writable") from e
    return copied


def config_for_keys(config, key_count):
    """``config`` for a write of ``key_count`` keys: its one logical group id repeated
    per key (a copy; the caller's config is never changed), no group for an empty list,
    ValueError for several ids."""
    if config is None or key_count <= 0:
        return config
    group_ids = getattr(config, "group_ids", None)
    if group_ids is None:
        return config
    as_string = isinstance(group_ids, str)
    ids = [group_ids] if as_string else list(group_ids)
    if not ids:
        ungrouped = copy_config(config)
        ungrouped.group_ids = None
        return ungrouped
    if len(ids) != 1:
        raise ValueError(ONE_GROUP_ERROR)
    if key_count == 1 and not as_string:
        return config
    grouped = copy_config(config)
    grouped.group_ids = [ids[0]] * key_count
    return grouped


def config_with_group(config, group_id):
    """A copy of ``config`` (a fresh ReplicateConfig when None) writing into storage
    group ``group_id``; ValueError when ``config`` names another group."""
    named = getattr(config_for_keys(config, 1), "group_ids", None)
    if named and named[0] and named[0] != group_id:
        raise ValueError("config.group_ids conflicts with the DataProto storage group")
    if config is None:
        try:
            from .store import ReplicateConfig
            grouped = ReplicateConfig()
        except (ImportError, OSError):  # no native library: a plain record will do
            grouped = types.SimpleNamespace()
    else:
        grouped = copy_config(config)
    grouped.group_ids = [group_id]
    return grouped


# ---------------------------------------------------------------- statuses and removal


def check_status(status, operation, key):
    if status not in (None, 0):
        raise RuntimeError(f"{operation} failed for {key}: {status}")


def remove_keys(store, keys, strict):
    """Removes ``keys`` (already gone is fine): one forced batch_remove when the store
    has it, then remove() for what it did not delete. With ``strict`` a failure raises,
    else it is ignored."""
    pending = list(dict.fromkeys(keys))
    batch_remove = getattr(store, "batch_remove", None)
    if callable(batch_remove) and pending:
        try:
            try:
                results = batch_remove(pending, True)
            except TypeError:
                results = batch_remove(pending)
            if len(results) != len(pending):
                raise RuntimeError(f"batch_remove returned {len(results)} results for "
                                   f"{len(pending)} keys")
            pending = [k for k, rc in zip(pending, results)
                       if rc not in (None, 0, MISSING_OBJECT_ERROR)]
            if not pending:
                return
        except Exception:
            if strict:
                raise
    failures = []
    for key in pending:
        try:
            rc = store.remove(key, True)
        except KeyError:
            continue
        except Exception:
            if strict:
                raise
            continue
        if rc not in (None, 0, MISSING_OBJECT_ERROR):
            failures.append((key, rc))
    if failures and strict:
        raise RuntimeError(f"failed to remove {len(failures)} Mooncake keys: {failures[:3]}")
