"""``MooncakeDistributedStoreAsync``: the store with an ``async_<name>`` coroutine for
every method ``<name>`` (``await store.async_get(key)``), run on the event loop's default
executor so the loop keeps serving while the call blocks. Everything else is the
synchronous ``MooncakeDistributedStore``."""

import asyncio
import functools

from .store import MooncakeDistributedStore

__all__ = ["MooncakeDistributedStoreAsync"]

_PREFIX = "async_"


class MooncakeDistributedStoreAsync(MooncakeDistributedStore):
    def __getattr__(self, name):
        # Only called for names not found normally: build async_<method> on first use.
        if not name.startswith(_PREFIX):
            raise AttributeError(f"{type(self).__name__!r} object has no attribute {name!r}")
        target = name[len(_PREFIX):]
        method = getattr(self, target, None)
        if method is None:
            raise AttributeError(f"{type(self).__name__!r} object has no attribute {name!r} "
                                 f"(nor {target!r})")
        if not callable(method):
            raise AttributeError(f"{target!r} is not callable")

        @functools.wraps(method)
        async def run_in_executor(*args, **kwargs):
            loop = asyncio.get_running_loop()
            return await loop.run_in_executor(None, functools.partial(method, *args, **kwargs))

        setattr(self, name, run_in_executor)
        return run_in_executor
