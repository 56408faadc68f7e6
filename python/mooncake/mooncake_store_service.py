"""``mc_store_rest_server``: a store client (it can lend memory to the pool) with a REST
API for its objects and for switching the memory it lends (upstream's service, same
routes, JSON shapes and flags).

    mc_store_rest_server [--config mooncake.json] [-Dkey=value ...] [--port 8080]
                         [--max-wait-time 60]

The configuration is MooncakeConfig's (``--config`` file, else MOONCAKE_* environment
variables), each ``-D`` overriding one field. The store is set up with retries for up to
``--max-wait-time`` seconds, then the API listens on all interfaces:

  PUT    /api/put             {"key": k, "value": "text"}          -> {"status": "success"}
  GET    /api/get/{key}       the bytes (404 {"error": "Key not found"})
  GET    /api/exist/{key}     {"exists": true|false}
  DELETE /api/remove/{key}    {"status": "success"}
  DELETE /api/remove_all      {"status": "success removed N keys"}
  POST   /api/mount           {"size": n, "protocol"?, "location"?}
                              -> {"status", "segment_ids", "allocated_size"}
  POST   /api/unmount         {"segment_ids": [...] | "id", "grace_period_seconds"?}
  POST   /api/mount_shm       {"name": shm name, "size": n, "offset"?, "protocol"?, "location"?}
  POST   /api/unmount_shm     {"segment_ids": [...] | "id", "grace_period_seconds"?}
  POST   /api/reconfigure     {"mode": "decode", "path", "size", ...} | {"mode": "prefill"}
  POST   /api/unmount_local_disk  {"grace_period_seconds"?: 0..3600}

Errors answer ``{"error": "..."}`` with 400 (bad request), 404, 500 (the store failed)
or 501 (the store object lacks the call a route needs). Decode-mode reconfiguration is
make-before-break: the new segment is mounted before the old ones are unmounted, and a
failed mount keeps the old ones serving. SIGINT/SIGTERM stop the service and close the
store. The HTTP server is the standard library's asyncio (``mooncake._aio_http``).
"""

import argparse
import asyncio
import json
import logging
import signal
import sys
import time

from ._aio_http import HttpServer, Response
from .mooncake_config import MooncakeConfig, parse_defines
from .store import MooncakeDistributedStore

__all__ = ["MooncakeStoreService", "parse_arguments", "main", "sync_main"]

logger = logging.getLogger("mooncake")

# A preStop hook's grace period is capped so a value in the wrong unit (milliseconds)
# holds it for an hour at most.
_MAX_UNMOUNT_LOCAL_DISK_GRACE_PERIOD_SECONDS = 3600
_RETRY_INTERVAL_S = 1.0
_MAX_BODY = 100 << 20
_SHM_DIR = "/dev/shm/"


def _shm_name_to_path(name):
    """/dev/shm/<name> for a POSIX shm name ("name" or "/name"); None for anything that
    is not one plain file name."""
    if not isinstance(name, str) or not name:
        return None
    bare = name[1:] if name.startswith("/") else name
    if not bare or "/" in bare or bare in (".", ".."):
        return None
    return _SHM_DIR + bare


def _unblock_shutdown_signals():
    try:
        signal.pthread_sigmask(signal.SIG_UNBLOCK, {signal.SIGINT, signal.SIGTERM})
    except AttributeError:  # no pthread_sigmask on this platform
        pass


def _install_shutdown_signal_handlers(loop, shutdown_event):
    """SIGINT and SIGTERM set ``shutdown_event`` (through the loop)."""

    def request_shutdown(signum):
        logger.info("received signal %s, shutting down", signum)
        shutdown_event.set()

    for sig in (signal.SIGINT, signal.SIGTERM):
        try:
            loop.add_signal_handler(sig, request_shutdown, sig)
        except (NotImplementedError, RuntimeError):
            signal.signal(sig, lambda signum, _frame:
                          loop.call_soon_threadsafe(request_shutdown, signum))


def _json(http_status, **fields):
    return Response(status=http_status, text=json.dumps(fields),
                    content_type="application/json")


def _error(http_status, message, **fields):
    return _json(http_status, error=message, **fields)


class _NotSupported(Exception):
    """The store lacks a call the request needs (answered 501)."""


def _timed(name, handler):
    async def timed(request):
        start = time.perf_counter()
        try:
            return await handler(request)
        finally:
            logger.info("%s operation completed in %.2f ms", name,
                        (time.perf_counter() - start) * 1000)

    return timed


def _handler(name):
    """Turns what a handler raises into the JSON error upstream answers with."""

    def wrap(method):
        async def guarded(self, request):
            try:
                return await method(self, request)
            except _NotSupported as e:
                return _error(501, str(e))
            except Exception as e:  # the store's failure is the client's 500
                logger.error("%s error: %s", name, e)
                return _error(500, str(e))

        guarded.__name__ = method.__name__
        guarded.__doc__ = method.__doc__
        return guarded

    return wrap


def _segment_ids(data):
    ids = data.get("segment_ids", [])
    return [ids] if isinstance(ids, str) else list(ids or [])


class MooncakeStoreService:
    """The store and the REST API over it (see the module docstring)."""

    def __init__(self, config_path=None, cli_config=None):
        self.store = None
        self.current_mode = "prefill"  # or "decode" (a segment mounted by reconfigure)
        self.mounted_segment_ids = []
        self.last_mount_info = {}
        self._state_lock = asyncio.Lock()  # reconfigure/mount state changes, one at a time
        self._http = None
        self.config = MooncakeConfig.from_file(config_path) if config_path \
            else MooncakeConfig.load_from_env()
        for key, value in (cli_config or {}).items():
            if hasattr(self.config, key):
                setattr(self.config, key, value)
            else:
                logger.warning("ignoring -D%s: not a configuration field", key)

    # ------------------------------------------------------------ lifecycle

    def _setup_config(self):
        c = self.config
        return {
            "local_hostname": c.local_hostname,
            "metadata_server": c.metadata_server,
            "global_segment_size": c.global_segment_size,
            "local_buffer_size": c.local_buffer_size,
            "protocol": c.protocol,
            "rdma_devices": c.device_name,
            "master_server_addr": c.master_server_address,
            "enable_ssd_offload": getattr(c, "enable_ssd_offload", False),
            "ssd_offload_path": getattr(c, "ssd_offload_path", ""),
            "tenant_id": getattr(c, "tenant_id", "default"),
            "enable_client_http_server": getattr(c, "enable_client_http_server", False),
            "client_http_port": getattr(c, "client_http_port", 9300),
        }

    async def start_store_service(self, max_wait_time=60, shutdown_event=None):
        """Sets up the store, retrying every second for up to ``max_wait_time`` seconds;
        False when that ran out or ``shutdown_event`` was set (the store is then closed)."""
        start = time.perf_counter()
        attempt = 0
        if shutdown_event is not None:
            await asyncio.sleep(0)  # let a signal already queued set the event
        while True:
            if shutdown_event is not None and shutdown_event.is_set():
                logger.info("store startup cancelled by shutdown request")
                return False
            elapsed = time.perf_counter() - start
            if elapsed >= max_wait_time:
                logger.error("store startup failed: no success within %ss (%d attempts)",
                             max_wait_time, attempt)
                return False
            attempt += 1
            try:
                self.store = MooncakeDistributedStore()
                ret = self.store.setup(self._setup_config())
                if shutdown_event is not None:
                    await asyncio.sleep(0)  # setup blocked the loop: look for a signal
                    if shutdown_event.is_set():
                        logger.info("store startup cancelled by shutdown request")
                        await self.stop()
                        return False
                if ret != 0:
                    raise RuntimeError(f"store setup failed ({ret})")
                logger.info("store service started on %s", self.config.local_hostname)
                return True
            except Exception as e:  # any setup failure is retried until the deadline
                left = max_wait_time - (time.perf_counter() - start)
                pause = min(_RETRY_INTERVAL_S, left) if left > 0 else 0
                logger.warning("store startup failed (attempt %d): %s; retrying in %.1fs",
                               attempt, e, pause)
                if pause <= 0:
                    continue
                if shutdown_event is None:
                    await asyncio.sleep(pause)
                    continue
                try:
                    await asyncio.wait_for(shutdown_event.wait(), timeout=pause)
                    logger.info("store startup cancelled by shutdown request")
                    return False
                except asyncio.TimeoutError:
                    pass

    def routes(self):
        """(method, path, handler) of the API."""
        table = [
            ("POST", "/api/reconfigure", "RECONFIGURE", self.handle_reconfigure),
            ("POST", "/api/mount_shm", "MOUNT_SHM", self.handle_mount_shm),
            ("POST", "/api/unmount_shm", "UNMOUNT_SHM", self.handle_unmount_shm),
            ("POST", "/api/mount", "MOUNT", self.handle_mount),
            ("POST", "/api/unmount", "UNMOUNT", self.handle_unmount),
            ("POST", "/api/unmount_local_disk", "UNMOUNT_LOCAL_DISK",
             self.handle_unmount_local_disk),
            ("PUT", "/api/put", "PUT", self.handle_put),
            ("GET", "/api/get/{key}", "GET", self.handle_get),
            ("GET", "/api/exist/{key}", "EXIST", self.handle_exist),
            ("DELETE", "/api/remove/{key}", "REMOVE", self.handle_remove),
            ("DELETE", "/api/remove_all", "REMOVE_ALL", self.handle_remove_all),
        ]
        return [(method, path, _timed(name, handler)) for method, path, name, handler in table]

    async def start_http_service(self, port=8080, host="0.0.0.0"):
        """Starts the API; True. ``self.http_port`` is the port bound."""
        self._http = HttpServer(self.routes(), max_body=_MAX_BODY)
        self.http_port = await self._http.start(host, port)
        logger.info("REST API started on %s:%d", host, self.http_port)
        return True

    async def stop(self):
        """Stops the API and closes the store (a second call does nothing)."""
        http, self._http = getattr(self, "_http", None), None
        if http is not None:
            await http.stop()
        store, self.store = self.store, None
        if store is None:
            return
        ret = store.close()
        if ret != 0:
            logger.warning("Mooncake service close returned %s", ret)
        else:
            logger.info("Mooncake service stopped")

    def _store_call(self, name, *args):
        method = getattr(self.store, name, None)
        if method is None:
            raise _NotSupported(f"{name} is not supported by this build's store")
        return method(*args)

    # ------------------------------------------------------------ segments

    @_handler("RECONFIGURE")
    async def handle_reconfigure(self, request):
        data = await request.json()
        mode = str(data.get("mode", "")).lower()
        if mode == "decode":
            return await self._reconfigure_decode(data)
        if mode == "prefill":
            return await self._reconfigure_prefill()
        return _error(400, "Invalid mode. Use 'decode' or 'prefill'")

    async def _reconfigure_decode(self, data):
        path, size = data.get("path"), data.get("size")
        if not path or size is None:
            return _error(400, "Missing path or size for decode mode")
        mount = {"path": path, "offset": data.get("offset", 0), "size": size,
                 "protocol": data.get("protocol", self.config.protocol),
                 "location": data.get("location", "")}
        async with self._state_lock:
            previous = list(self.mounted_segment_ids)
            # Make before break: the new segment first; the old ones keep serving if it fails.
            result = self._store_call("mount_segment", mount["path"], mount["size"],
                                      mount["offset"], mount["protocol"], mount["location"])
            if result["ret"] != 0:
                if previous:
                    logger.warning("reconfigure decode: mounting %s failed (%s); keeping the "
                                   "previous decode segments", path, result["ret"])
                    return _error(500, f"Mount failed, ret={result['ret']}; keeping previous "
                                       "decode segments", mode=self.current_mode)
                self.current_mode = "prefill"
                self.mounted_segment_ids.clear()
                self.last_mount_info.clear()
                return _error(500, f"Mount failed, ret={result['ret']}; rolled back to prefill",
                              mode=self.current_mode)
            # One id at a time: a batch unmount reports only its first error, and only the
            # ids really left mounted must stay tracked.
            still_mounted = [sid for sid in previous
                             if self._store_call("unmount_segment", [sid]) != 0]
            if still_mounted:
                logger.warning("reconfigure decode: unmounting previous segments %s failed; "
                               "they stay tracked", still_mounted)
            self.mounted_segment_ids = list(result["segment_ids"]) + still_mounted
            self.current_mode = "decode"
            self.last_mount_info = mount
        return _json(200, status="success", mode=self.current_mode,
                     segment_ids=self.mounted_segment_ids)

    async def _reconfigure_prefill(self):
        async with self._state_lock:
            if self.mounted_segment_ids:
                ret = self._store_call("unmount_segment", self.mounted_segment_ids)
                if ret != 0:
                    return _error(500, f"Unmount failed, ret={ret}")
                self.mounted_segment_ids.clear()
            self.current_mode = "prefill"
            self.last_mount_info.clear()
        return _json(200, status="success", mode=self.current_mode)

    @_handler("MOUNT_SHM")
    async def handle_mount_shm(self, request):
        data = await request.json()
        path, size = _shm_name_to_path(data.get("name")), data.get("size")
        if not path or size is None:
            return _error(400, "Missing or invalid name or size")
        result = self._store_call("mount_segment", path, size, data.get("offset", 0),
                                  data.get("protocol", self.config.protocol),
                                  data.get("location", ""))
        if result["ret"] != 0:
            return _error(500, f"Mount failed, ret={result['ret']}")
        return _json(200, status="success", segment_ids=list(result["segment_ids"]))

    @_handler("UNMOUNT_SHM")
    async def handle_unmount_shm(self, request):
        data = await request.json()
        ids = _segment_ids(data)
        if not ids:
            return _error(400, "Missing segment_ids")
        grace = data.get("grace_period_seconds", 0)
        failed = []
        async with self._state_lock:
            for sid in ids:
                if self._store_call("unmount_segment", [sid], grace) != 0:
                    failed.append(sid)
                elif sid in self.mounted_segment_ids:
                    self.mounted_segment_ids.remove(sid)
            if not self.mounted_segment_ids:
                self.current_mode = "prefill"
        if failed:
            return _error(500, "Unmount failed for one or more segments",
                          failed_segment_ids=failed)
        return _json(200, status="success")

    @_handler("MOUNT")
    async def handle_mount(self, request):
        data = await request.json()
        size = data.get("size")
        if type(size) is not int or size <= 0:  # bool is not a size
            return _error(400, "Invalid size, must be a positive integer")
        result = self._store_call("allocate_and_mount_segment", size,
                                  data.get("protocol", self.config.protocol),
                                  data.get("location", ""))
        if result["ret"] != 0:
            return _error(500, f"Allocate and mount failed, ret={result['ret']}")
        return _json(200, status="success", segment_ids=list(result["segment_ids"]),
                     allocated_size=result["allocated_size"])

    @_handler("UNMOUNT")
    async def handle_unmount(self, request):
        data = await request.json()
        ids = _segment_ids(data)
        if not ids:
            return _error(400, "Missing segment_ids")
        ret = self._store_call("unmount_and_free_segment", ids,
                               data.get("grace_period_seconds", 0))
        if ret != 0:
            return _error(500, f"Unmount and free failed, ret={ret}")
        return _json(200, status="success")

    async def handle_unmount_local_disk(self, request):
        """Withdraws this store's disk tier (for a preStop hook): the master stops naming
        this store for its offloaded objects, then the call waits grace_period_seconds
        for reads already under way; off the event loop, as that wait is long."""
        try:
            data = await request.json()
        except Exception:  # any parse failure is the client's malformed body
            return _error(400, "Malformed JSON body")
        if not isinstance(data, dict):
            return _error(400, "Request body must be a JSON object")
        grace = data.get("grace_period_seconds", 0)
        if type(grace) is not int or not 0 <= grace <= _MAX_UNMOUNT_LOCAL_DISK_GRACE_PERIOD_SECONDS:
            return _error(400, "Invalid grace_period_seconds, must be a non-negative integer "
                               f"no greater than {_MAX_UNMOUNT_LOCAL_DISK_GRACE_PERIOD_SECONDS}")
        try:
            ret = await asyncio.to_thread(self._store_call, "unmount_local_disk_segment", grace)
        except _NotSupported as e:
            return _error(501, str(e))
        except Exception as e:  # the store's failure is the client's 500
            logger.error("UNMOUNT_LOCAL_DISK error: %s", e)
            return _error(500, str(e))
        if ret != 0:
            return _error(500, f"Unmount local disk failed, ret={ret}")
        return _json(200, status="success")

    # ------------------------------------------------------------ objects

    @_handler("PUT")
    async def handle_put(self, request):
        data = await request.json()
        key, value = data.get("key"), data.get("value")
        if not key or value is None:
            return _error(400, "Missing key or value")
        if not isinstance(key, str) or not isinstance(value, str):
            return _error(400, "key and value must be strings")
        if self.store.put(key, value.encode()) != 0:
            return _error(500, "PUT operation failed")
        return _json(200, status="success")

    def _missing_or_failed(self, key):
        """The 404/500 response when ``key`` is absent or its check fails, else None."""
        exists = self.store.is_exist(key)
        if exists == 0:
            return _error(404, "Key not found")
        if exists < 0:
            return _error(500, "Exist check failed")
        return None

    @_handler("GET")
    async def handle_get(self, request):
        key = request.match_info["key"]
        absent = self._missing_or_failed(key)
        if absent is not None:
            return absent
        value = self.store.get(key)
        if value is None:
            return _error(500, "GET operation failed")
        if value == b"":
            # An empty value, or the object went away after the check: ask again.
            absent = self._missing_or_failed(key)
            if absent is not None:
                return absent
        return Response(status=200, body=bytes(value), content_type="application/octet-stream")

    @_handler("EXIST")
    async def handle_exist(self, request):
        exists = self.store.is_exist(request.match_info["key"])
        if exists < 0:
            return _error(500, "Exist check failed")
        return _json(200, exists=exists > 0)

    @_handler("REMOVE")
    async def handle_remove(self, request):
        if self.store.remove(request.match_info["key"]) != 0:
            return _error(500, "Remove operation failed")
        return _json(200, status="success")

    @_handler("REMOVE_ALL")
    async def handle_remove_all(self, request):
        removed = self.store.remove_all()
        if removed < 0:
            return _error(500, "RemoveAll operation failed")
        return _json(200, status=f"success removed {removed} keys")


def parse_arguments(argv=None):
    parser = argparse.ArgumentParser(prog="mc_store_rest_server",
                                     description="Mooncake store service with a REST API")
    parser.add_argument("--config", help="Mooncake config file (JSON); default: MOONCAKE_* "
                                         "environment variables")
    parser.add_argument("-D", "--define", action="append", default=[],
                        help="override one configuration field, e.g. -Dlocal_hostname=host")
    parser.add_argument("--port", type=int, default=8080, help="HTTP API port (8080)")
    parser.add_argument("--max-wait-time", type=float, default=60,
                        help="seconds to keep retrying the store setup (60)")
    return parser.parse_args(argv)


async def main():
    args = parse_arguments()
    service = MooncakeStoreService(args.config, parse_defines(args.define))
    shutdown_event = asyncio.Event()
    _install_shutdown_signal_handlers(asyncio.get_running_loop(), shutdown_event)
    _unblock_shutdown_signals()
    try:
        if not await service.start_store_service(max_wait_time=args.max_wait_time,
                                                 shutdown_event=shutdown_event):
            if shutdown_event.is_set():
                return
            raise RuntimeError("Failed to start store service")
        await asyncio.sleep(0)
        if shutdown_event.is_set():
            return
        if not await service.start_http_service(args.port):
            raise RuntimeError("Failed to start HTTP service")
        logger.info("Mooncake Store Service is running")
        await shutdown_event.wait()
    finally:
        await service.stop()


def sync_main():
    """The ``mc_store_rest_server`` command."""
    logging.basicConfig(level=logging.INFO,
                        format="%(asctime)s - %(name)s - %(levelname)s - %(message)s")
    try:
        asyncio.run(main())
    except RuntimeError as e:
        logger.error("%s", e)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(sync_main())
