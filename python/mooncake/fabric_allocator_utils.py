"""Helpers for the fabric/device allocator shims: find a shared library that ships inside
the ``mooncake`` package, and ask it which allocator backend it supports.

    path = get_mooncake_so_path("libsome_allocator.so", "install mooncake with ...")
    kind = probe_allocator_backend(path, "probe_symbol", ctypes.c_int, -1)

Standard library only, so allocator modules can use it before torch or the engine is
loaded.
"""

import ctypes
import logging
import os
from importlib import resources
from typing import Any, TypeVar

logger = logging.getLogger(__name__)

# Whatever the probe returns (an int code, a bool...), or the caller's fallback value.
ProbeValue = TypeVar("ProbeValue")


def get_mooncake_so_path(so_name: str, import_error_message: str) -> str:
    """Path of ``so_name`` inside the installed ``mooncake`` package.

    Raises ImportError carrying ``import_error_message`` when the file is not there.
    """
    for candidate in (_resource_path, _package_dir_path):
        path = candidate(so_name)
        if path is not None:
            return path
    raise ImportError(import_error_message)


def probe_allocator_backend(
    so_path: str,
    probe_symbol: str,
    restype: Any,
    unsupported_value: ProbeValue,
) -> ProbeValue:
    """Loads ``so_path`` and returns ``probe_symbol(0)`` read as ``restype``.

    The probe is an ``int -> restype`` C function. A library that cannot be loaded, or
    that lacks the symbol (an older build), yields ``unsupported_value`` and a warning
    instead of an exception, so callers can fall back to another allocator.
    """
    try:
        probe = getattr(ctypes.CDLL(so_path), probe_symbol)
    except AttributeError:
        logger.warning("%s has no symbol %r; treating allocator probing as unsupported",
                       os.path.basename(so_path), probe_symbol)
        return unsupported_value
    except Exception as exc:  # noqa: BLE001 - any load failure means "unsupported"
        logger.warning("Cannot load %s to probe its allocator backend: %s",
                       os.path.basename(so_path), exc)
        return unsupported_value
    try:
        probe.argtypes = [ctypes.c_int]
        probe.restype = restype
        return probe(0)
    except Exception as exc:  # noqa: BLE001 - e.g. a restype ctypes rejects
        logger.warning("Probing the allocator backend of %s failed: %s",
                       os.path.basename(so_path), exc)
        return unsupported_value


def _resource_path(so_name: str) -> "str | None":
    # importlib.resources sees the package wherever it was imported from (zip included,
    # though a .so can only be loaded from a real file).
    try:
        path = resources.files("mooncake").joinpath(so_name)
        if isinstance(path, os.PathLike) and os.path.exists(path):
            return os.fspath(path)
    except (ImportError, FileNotFoundError, TypeError, ValueError):
        pass
    return None


def _package_dir_path(so_name: str) -> "str | None":
    # Fallback beside the package's __init__, as a plain filesystem lookup.
    try:
        import mooncake
    except ImportError:
        return None
    init = getattr(mooncake, "__file__", None)
    if not init:
        return None
    path = os.path.join(os.path.dirname(os.path.abspath(init)), so_name)
    return path if os.path.exists(path) else None
