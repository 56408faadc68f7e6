"""Mooncake EP under upstream's import path: ``from mooncake.mooncake_ep_buffer import
Buffer``. The classes and functions are those of ``mooncake.ep``."""

from .ep import Buffer, EventOverlap, get_active_ranks, get_ep_buffer_size_hint

__all__ = ["Buffer", "EventOverlap", "get_active_ranks", "get_ep_buffer_size_hint"]
