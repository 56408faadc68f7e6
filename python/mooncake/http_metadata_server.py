"""``python -m mooncake.http_metadata_server``: as the mooncake_http_metadata_server script
(the native server of the ``mooncake`` binary).

``KVBootstrapServer`` is upstream's in-process form of the same REST API, for programs
that embed one (``run()`` serves on a background thread, ``close()`` stops it):

  GET|PUT|DELETE /metadata?key=K   the value (404 if absent) | store it | remove it

A key is stripped of surrounding blanks and must not be empty (400); a key containing
``rpc_meta`` is written once (a second PUT is refused with 400). Built on the standard
library's asyncio (``mooncake._aio_http``).
"""

import asyncio
import enum
import logging
import threading

from ._aio_http import HttpServer, Response
from .cli import http_metadata_server_main as main

__all__ = ["main", "parse_args", "KVBootstrapServer", "KVPoll"]

logger = logging.getLogger("mooncake")

_STOP_TIMEOUT_S = 5


class KVPoll(enum.Enum):
    Failed = 0
    Bootstrapping = 1
    WaitingForInput = 2
    Transferring = 3
    Success = 4


def _answer(status, text):
    return Response(status=status, text=text, content_type="application/json")


class KVBootstrapServer:
    """An HTTP metadata server in this process; ``store`` holds the values by key."""

    def __init__(self, port, host="0.0.0.0"):
        self.port = port
        self.host = host
        self.store = {}
        self.lock = asyncio.Lock()
        self.thread = None
        self._loop = None
        self._server = HttpServer([(m, "/metadata", self._handle_metadata)
                                   for m in ("GET", "PUT", "DELETE", "POST", "PATCH")])
        self._ready = threading.Event()
        self._failed = None

    def run(self):
        """Starts serving on a background thread; returns the thread once listening
        (``port`` then holds the port bound, useful with 0)."""
        self.thread = threading.Thread(target=self._serve, name="mooncake-metadata",
                                       daemon=True)
        self.thread.start()
        self._ready.wait()
        if self._failed is not None:
            raise RuntimeError(f"HTTP metadata server on {self.host}:{self.port}: "
                               f"{self._failed}")
        logger.info("HTTP metadata server on %s:%d", self.host, self.port)
        return self.thread

    def _serve(self):
        loop = self._loop = asyncio.new_event_loop()
        try:
            try:
                self.port = loop.run_until_complete(self._server.start(self.host, self.port))
            except OSError as e:
                self._failed = e
                return
            finally:
                self._ready.set()
            loop.run_forever()
            loop.run_until_complete(self._server.stop())
        finally:
            loop.close()

    async def _handle_metadata(self, request):
        key = request.query.get("key", "").strip()
        if not key:
            return _answer(400, "metadata key is required")
        if request.method == "GET":
            async with self.lock:
                value = self.store.get(key)
            if value is None:
                return _answer(404, "metadata not found")
            return Response(status=200, body=value, content_type="application/json")
        if request.method == "PUT":
            data = await request.read()
            async with self.lock:
                if "rpc_meta" in key and key in self.store:
                    return _answer(400, "Duplicate rpc_meta key not allowed")
                self.store[key] = data
            return _answer(200, "metadata updated")
        if request.method == "DELETE":
            async with self.lock:
                if self.store.pop(key, None) is None:
                    return _answer(404, "metadata not found")
            return _answer(200, "metadata deleted")
        return _answer(405, "Method not allowed")

    def close(self):
        """Stops the server and its thread."""
        loop = self._loop
        if loop is not None and loop.is_running():
            loop.call_soon_threadsafe(loop.stop)
        if self.thread is not None:
            self.thread.join(timeout=_STOP_TIMEOUT_S)

    def poll(self):
        """KVPoll.Success while serving, else KVPoll.Failed."""
        alive = self.thread is not None and self.thread.is_alive()
        return KVPoll.Success if alive else KVPoll.Failed


def parse_args(argv=None):
    """Upstream's flags of this module: --port (8080), --host (0.0.0.0), --log-level."""
    import argparse

    parser = argparse.ArgumentParser(description="HTTP Metadata Server for Mooncake")
    parser.add_argument("--port", type=int, default=8080, help="port to listen on")
    parser.add_argument("--host", default="0.0.0.0", help="address to bind to")
    parser.add_argument("--log-level", default="INFO",
                        choices=["DEBUG", "INFO", "WARNING", "ERROR", "CRITICAL"])
    return parser.parse_args(argv)


if __name__ == "__main__":
    main()
