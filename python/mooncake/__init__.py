"""Mooncake (Rust implementation): KV-cache transfer engine and distributed store.

A drop-in for the ``mooncake`` package of Mooncake 0.3.x: ``mooncake.engine`` (Transfer
Engine) and ``mooncake.store`` (Mooncake Store client), bound with ctypes to
``libmooncake.so`` (see ``c_include/mooncake.h``). Submodules load the library on import.
"""

try:
    from ._version import __version__  # written by the wheel build
except ImportError:  # a source checkout
    __version__ = "0.0.0+source"

# Upstream exports the store's buffer pool at the top level (pure Python here: importing
# it does not load the library).
from .buffer_pool import BufferPool, RegisteredBufferPool  # noqa: E402

__all__ = ["engine", "store", "mooncake_config", "BufferPool", "RegisteredBufferPool",
           "__version__"]
