"""Mooncake (Rust implementation): KV-cache transfer engine and distributed store.

A drop-in for the ``mooncake`` package of Mooncake 0.3.x: ``mooncake.engine`` (Transfer
Engine) and ``mooncake.store`` (Mooncake Store client), bound with ctypes to
``libmooncake.so`` (see ``c_include/mooncake.h``). Submodules load the library on import.
"""

import importlib
from pkgutil import extend_path

# As upstream: other distributions may add modules to the mooncake namespace from
# another sys.path entry (upstream's mooncake-reshard does).
__path__ = extend_path(__path__, __name__)

try:
    from ._version import __version__  # written by the wheel build
except ImportError:  # a source checkout
    __version__ = "0.0.0+source"

# Upstream exports the store's buffer pool at the top level (pure Python here: importing
# it does not load the library).
from .buffer_pool import BufferPool, RegisteredBufferPool  # noqa: E402

__all__ = ["engine", "store", "mooncake_config", "BufferPool", "RegisteredBufferPool",
           "__version__"]

# Upstream's package imports its store at import time, so ``import mooncake`` alone makes
# ``mooncake.store`` (and ``engine``) reachable; here they load on first touch instead.
_LAZY_SUBMODULES = ("engine", "store")


def __getattr__(name):
    if name in _LAZY_SUBMODULES:
        return importlib.import_module(f".{name}", __name__)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
