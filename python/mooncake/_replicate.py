"""``ReplicateConfig``: how an object is stored (upstream's ``mooncake.store`` class),
checked on every assignment, and its C form (``mc_replicate_config``), built once per
state of the config. ``mooncake.store`` re-exports what is public here."""

import ctypes
import enum
import logging

from . import _native as N
from ._common import U64_MAX, check_str

logger = logging.getLogger("mooncake")


class SoftPinAction(enum.IntEnum):
    PRESERVE = 0
    ENABLE = 1
    DISABLE = 2


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


def _u32(value, name):
    if isinstance(value, bool) or not isinstance(value, int):
        raise TypeError(f"{name}: expected int, got {type(value).__name__}")
    if not 0 <= value <= 0xFFFFFFFF:
        raise TypeError(f"{name}: {value} is out of range")
    return value


def _ttl(value, name):
    if value is not None:
        if isinstance(value, bool) or not isinstance(value, int):
            raise TypeError(f"{name}: expected None or int, got {type(value).__name__}")
        if not 0 <= value <= U64_MAX:
            raise TypeError(f"{name}: {value} is not in [0, 2**64)")
    return value


def _soft_pin_action(value, name):
    if not isinstance(value, SoftPinAction):
        raise TypeError(f"{name}: expected SoftPinAction, got {type(value).__name__}")
    return value


class ReplicateConfig:
    """How an object is stored. Attributes (read/write, type-checked):
    replica_num (1), with_soft_pin (False), with_hard_pin (False), soft_pin_ttl_ms (None:
    the default 30 min; else an int in [0, 2**64)), soft_pin_action (SoftPinAction,
    tracks with_soft_pin), preferred_segment (""), preferred_segments ([]),
    prefer_alloc_in_same_node (False), group_ids ([]; None unsets it, as upstream)."""

    __slots__ = ("_replica_num", "_with_hard_pin", "_soft_pin_action", "_soft_pin_ttl_ms",
                 "_preferred_segment", "_preferred_segments", "_prefer_same_node", "_group_ids",
                 "_c_cache")

    def __init__(self):
        self._replica_num = 1
        self._with_hard_pin = False
        self._soft_pin_action = SoftPinAction.PRESERVE
        self._soft_pin_ttl_ms = None
        self._preferred_segment = ""
        self._preferred_segments = []
        self._prefer_same_node = False
        self._group_ids = []
        self._c_cache = None

    replica_num = _checked("replica_num", _u32)
    with_hard_pin = _checked("with_hard_pin", _bool)
    soft_pin_action = _checked("soft_pin_action", _soft_pin_action)
    soft_pin_ttl_ms = _checked("soft_pin_ttl_ms", _ttl)
    preferred_segment = _checked("preferred_segment", check_str)
    preferred_segments = _checked("preferred_segments", _strs)
    prefer_alloc_in_same_node = _checked("prefer_alloc_in_same_node", _bool, "_prefer_same_node")
    group_ids = _checked("group_ids", _strs_or_none)

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
        self._c_cache = None
        for name, value in state.items():
            setattr(self, name, value)

    def __repr__(self):
        return (f"ReplicateConfig(replica_num={self._replica_num}, "
                f"with_soft_pin={self.with_soft_pin}, with_hard_pin={self._with_hard_pin}, "
                f"soft_pin_ttl_ms={self._soft_pin_ttl_ms}, "
                f"preferred_segment={self._preferred_segment!r}, "
                f"preferred_segments={self._preferred_segments!r}, "
                f"prefer_alloc_in_same_node={self._prefer_same_node}, "
                f"group_ids={self._group_ids!r})")

    __str__ = __repr__

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


def _refused(config):
    """Whether upstream's master would refuse ``config`` (logged): a soft-pin TTL only goes
    with soft_pin_action ENABLE. Puts given such a config answer INVALID_PARAMS."""
    if config.soft_pin_ttl_ms is not None and config.soft_pin_action != SoftPinAction.ENABLE:
        logger.error("mooncake: soft_pin_ttl_ms=%d needs soft_pin_action ENABLE (is %s)",
                     config.soft_pin_ttl_ms, config.soft_pin_action.name)
        return True
    return False


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
ReplicateConfig.__module__ = "mooncake.store"
