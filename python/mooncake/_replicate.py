"""``ReplicateConfig``: how an object is stored (upstream's ``mooncake.store`` class),
checked on every assignment, and its C form (``mc_replicate_config``), built once per
state of the config. ``mooncake.store`` re-exports what is public here."""

import ctypes
import enum
import logging

from . import _native as N
from ._common import ErrorCode, check_str

logger = logging.getLogger("mooncake")


class SoftPinAction(enum.IntEnum):
    PRESERVE = 0
    ENABLE = 1
    DISABLE = 2


class ObjectDataType(enum.IntEnum):
    """What an object holds, as the writer declares it (``ReplicateConfig.data_type``)."""

    UNKNOWN = 0
    KVCACHE = 1
    TENSOR = 2
    WEIGHT = 3
    SAMPLE = 4
    ACTIVATION = 5
    GRADIENT = 6
    OPTIMIZER_STATE = 7
    METADATA = 8
    GENERAL = 9


def _bool(value, name):
    if not isinstance(value, bool):
        raise TypeError(f"{name}: expected bool, got {type(value).__name__}")
    return value


def _strs(value, name):
    if isinstance(value, (str, bytes)) or not isinstance(value, (list, tuple)):
        raise TypeError(f"{name}: expected a list of str, got {type(value).__name__}")
    for i, v in enumerate(value):
        if not isinstance(v, str):
            raise TypeError(f"{name}[{i}]: expected str, got {type(v).__name__}")
    return list(value)


def _checked(name, check, slot=None):
    """A read/write attribute whose assignments pass through ``check(value, name)``."""
    slot = slot or "_" + name

    def get(self):
        return getattr(self, slot)

    def set(self, value):
        setattr(self, slot, check(value, name))

    return property(get, set)


def _strs_or_none(value, name):
    """A list of str, or None (upstream's unset group list)."""
    return None if value is None else _strs(value, name)


def _unsigned(bits):
    """A check taking ints in [0, 2**bits) only; anything else, out of range included,
    is a TypeError, as upstream's typed fields answer."""
    top = (1 << bits) - 1

    def check(value, name):
        if isinstance(value, bool) or not isinstance(value, int):
            raise TypeError(f"{name}: expected int, got {type(value).__name__}")
        if not 0 <= value <= top:
            raise TypeError(f"{name}: {value} is not in [0, 2**{bits})")
        return value

    return check


_u32 = _unsigned(32)
_u64 = _unsigned(64)


def _ttl(value, name):
    return None if value is None else _u64(value, name)


def _enum_of(kind):
    """A check that takes members of ``kind`` only (as upstream's typed fields do)."""

    def check(value, name):
        if not isinstance(value, kind):
            raise TypeError(f"{name}: expected {kind.__name__}, got {type(value).__name__}")
        return value

    return check


def _listed(values):
    return "[" + ", ".join(values) + "]"


class ReplicateConfig:
    """How an object is stored. Attributes (read/write, type-checked):
    replica_num (1), with_soft_pin (False), with_hard_pin (False), soft_pin_ttl_ms (None:
    the default 30 min; else an int in [0, 2**64)), soft_pin_action (SoftPinAction,
    tracks with_soft_pin), preferred_segment (""), preferred_segments ([]),
    prefer_alloc_in_same_node (False), group_ids (None: no groups), data_type
    (ObjectDataType.UNKNOWN), nof_replica_num (0), dfs_replica_num (0),
    preferred_nof_segments ([]).

    This build has neither NVMe-oF nor DFS replicas: a put asking for them is answered as
    upstream's master without those backends answers it (see ``_refusal``). ``data_type``
    is the writer's declaration; nothing in the Python API reads it back."""

    __slots__ = ("_replica_num", "_with_hard_pin", "_soft_pin_action", "_soft_pin_ttl_ms",
                 "_preferred_segment", "_preferred_segments", "_prefer_same_node", "_group_ids",
                 "_data_type", "_nof_replica_num", "_dfs_replica_num", "_preferred_nof_segments",
                 "_c_cache")

    def __init__(self):
        self._replica_num = 1
        self._with_hard_pin = False
        self._soft_pin_action = SoftPinAction.PRESERVE
        self._soft_pin_ttl_ms = None
        self._preferred_segment = ""
        self._preferred_segments = []
        self._prefer_same_node = False
        self._group_ids = None
        self._data_type = ObjectDataType.UNKNOWN
        self._nof_replica_num = 0
        self._dfs_replica_num = 0
        self._preferred_nof_segments = []
        self._c_cache = None

    replica_num = _checked("replica_num", _u32)
    with_hard_pin = _checked("with_hard_pin", _bool)
    soft_pin_action = _checked("soft_pin_action", _enum_of(SoftPinAction))
    soft_pin_ttl_ms = _checked("soft_pin_ttl_ms", _ttl)
    preferred_segment = _checked("preferred_segment", check_str)
    preferred_segments = _checked("preferred_segments", _strs)
    prefer_alloc_in_same_node = _checked("prefer_alloc_in_same_node", _bool, "_prefer_same_node")
    group_ids = _checked("group_ids", _strs_or_none)
    data_type = _checked("data_type", _enum_of(ObjectDataType))
    nof_replica_num = _checked("nof_replica_num", _u64)
    dfs_replica_num = _checked("dfs_replica_num", _u64)
    preferred_nof_segments = _checked("preferred_nof_segments", _strs)

    @property
    def with_soft_pin(self):
        return self._soft_pin_action == SoftPinAction.ENABLE

    @with_soft_pin.setter
    def with_soft_pin(self, v):
        self._soft_pin_action = SoftPinAction.ENABLE if _bool(v, "with_soft_pin") \
            else SoftPinAction.PRESERVE

    def __getstate__(self):
        # The cached C form holds pointers: copies and pickles leave it out.
        return {name: getattr(self, name) for name in self.__slots__ if name != "_c_cache"}

    def __setstate__(self, state):
        ReplicateConfig.__init__(self)  # what a pickle of an older build lacks: defaults
        for name, value in state.items():
            setattr(self, name, value)

    def __repr__(self):
        return (f"ReplicateConfig(replica_num={self._replica_num}, "
                f"with_soft_pin={self.with_soft_pin}, with_hard_pin={self._with_hard_pin}, "
                f"soft_pin_ttl_ms={self._soft_pin_ttl_ms}, "
                f"preferred_segment={self._preferred_segment!r}, "
                f"preferred_segments={self._preferred_segments!r}, "
                f"prefer_alloc_in_same_node={self._prefer_same_node}, "
                f"group_ids={self._group_ids!r}, data_type={self._data_type.name}, "
                f"nof_replica_num={self._nof_replica_num}, "
                f"dfs_replica_num={self._dfs_replica_num}, "
                f"preferred_nof_segments={self._preferred_nof_segments!r})")

    def __str__(self):
        # Upstream's text, field for field: logs and tools that read it keep working.
        ttl = "default" if self._soft_pin_ttl_ms is None else self._soft_pin_ttl_ms
        text = (f"ReplicateConfig: {{ replica_num: {self._replica_num}, "
                f"nof_replica_num: {self._nof_replica_num}, "
                f"dfs_replica_num: {self._dfs_replica_num}, "
                f"soft_pin_action: {self._soft_pin_action.name}, soft_pin_ttl_ms: {ttl}, "
                f"with_hard_pin: {int(self._with_hard_pin)}, "
                f"preferred_segments: {_listed(self._preferred_segments)}")
        if self._preferred_segment:
            text += f", preferred_segment (deprecated): {self._preferred_segment}"
        text += (f", preferred_nof_segments: {_listed(self._preferred_nof_segments)}"
                 f", prefer_alloc_in_same_node: {int(self._prefer_same_node)}"
                 f", data_type: {self._data_type.name}")
        if self._group_ids is not None:
            text += f", group_ids: {_listed(self._group_ids)}"
        return text + " }"

    def _to_c(self):
        """(mc_replicate_config, keepalive), built once per state of this config: a put
        given the same config (or none) again reuses it."""
        segs = tuple(self._preferred_segments)
        if not segs and self._preferred_segment:
            segs = (self._preferred_segment,)
        state = (self._replica_num, self._with_hard_pin, self._soft_pin_action,
                 self._soft_pin_ttl_ms, segs, self._prefer_same_node)
        cached = self._c_cache
        if cached is None or cached[0] != state:
            cached = self._c_cache = (state,) + self._build_c(segs)
        return cached[1], cached[2]

    def _build_c(self, segs):
        c = N.McReplicateConfig()
        N.LIB.mc_replicate_config_init(ctypes.byref(c))
        c.replica_num = self._replica_num
        c.hard_pin = int(self._with_hard_pin)
        c.soft_pin = int(self.with_soft_pin)
        if self._soft_pin_ttl_ms is not None:
            c.soft_pin_ttl_ms = self._soft_pin_ttl_ms
        encoded = [s.encode() for s in segs]
        arr = N.c_strings(encoded)
        c.preferred_segments = ctypes.cast(arr, ctypes.POINTER(ctypes.c_char_p))
        c.preferred_segments_count = len(encoded)
        c.prefer_same_node = int(self._prefer_same_node)
        return c, (encoded, arr)


# How a put path treats prefer_alloc_in_same_node (upstream's RealClient): refused (its
# single and batch puts), with one memory replica only (batch_put_from_multi_buffers), or
# passed on to the master (the put sessions).
SAME_NODE_REFUSED, SAME_NODE_ONE_REPLICA, SAME_NODE_PASSED = range(3)


def _refusal(config, key_count=1, same_node=SAME_NODE_REFUSED):
    """The error upstream answers a put of ``key_count`` keys with ``config`` with before
    anything is allocated, in a build without NVMe-oF and DFS replicas (logged); 0 when
    the put goes ahead. In upstream's order:

    - prefer_alloc_in_same_node where the path refuses it, or (batch_put_from_multi_
      buffers) beside anything but one memory replica: INVALID_PARAMS;
    - group_ids (when set) not one per key: INVALID_PARAMS;
    - more than one DFS replica, or one without a memory replica: INVALID_PARAMS; any
      DFS replica: DFS_SERVICE_UNAVAILABLE (no DFS here);
    - NVMe-oF replicas: INVALID_PARAMS (the master's "nof_pool_disabled");
    - a soft-pin TTL without soft_pin_action ENABLE: INVALID_PARAMS.
    """
    c = config
    if c is _DEFAULT_CONFIG or (  # most puts: nothing to look at (slots read directly)
            not c._prefer_same_node and c._group_ids is None and not c._dfs_replica_num
            and not c._nof_replica_num and c._soft_pin_ttl_ms is None):
        return 0
    invalid = ErrorCode.INVALID_PARAMS
    why = None
    if c._prefer_same_node and same_node == SAME_NODE_REFUSED:
        why = invalid, ("prefer_alloc_in_same_node is supported by "
                        "batch_put_from_multi_buffers (and put sessions) only")
    elif c._prefer_same_node and same_node == SAME_NODE_ONE_REPLICA and (
            c._nof_replica_num or c._replica_num != 1):
        why = invalid, "prefer_alloc_in_same_node needs replica_num 1 and no NVMe-oF replica"
    elif c._group_ids is not None and len(c._group_ids) != key_count:
        why = invalid, f"{len(c._group_ids)} group_ids for {key_count} key(s)"
    elif c._dfs_replica_num > 1 or (c._dfs_replica_num and not c._replica_num):
        why = invalid, (f"dfs_replica_num={c._dfs_replica_num} needs to be at most 1, "
                        f"beside a memory replica (replica_num={c._replica_num})")
    elif c._dfs_replica_num:
        why = ErrorCode.DFS_SERVICE_UNAVAILABLE, "no DFS replicas in this build"
    elif c._nof_replica_num:
        why = invalid, f"nof_replica_num={c._nof_replica_num}: no NVMe-oF pool in this build"
    elif c._soft_pin_ttl_ms is not None and c._soft_pin_action != SoftPinAction.ENABLE:
        why = invalid, (f"soft_pin_ttl_ms={c._soft_pin_ttl_ms} needs soft_pin_action ENABLE "
                        f"(is {c._soft_pin_action.name})")
    if why is None:
        return 0
    logger.error("mooncake: put refused: %s", why[1])
    return int(why[0])


# What a put given no config uses; never changed (so its C form is built once).
_DEFAULT_CONFIG = ReplicateConfig()


def _config(config):
    if config is None:
        return _DEFAULT_CONFIG
    if not isinstance(config, ReplicateConfig):
        raise TypeError(f"config: expected ReplicateConfig, got {type(config).__name__}")
    return config


# Upstream's classes live in mooncake.store: pickles and reprs name them there.
SoftPinAction.__module__ = "mooncake.store"
ObjectDataType.__module__ = "mooncake.store"
ReplicateConfig.__module__ = "mooncake.store"
