"""A proxy for vLLM v1 prefill/decode disaggregation with the Mooncake connector
(upstream's ``vllm_v1_proxy_server``, same flags and routes).

    python -m mooncake.vllm_v1_proxy_server --port 8000 \\
        --prefiller-hosts 10.0.0.1 --prefiller-ports 8100 \\
        --decoder-hosts 10.0.0.2 --decoder-ports 8200

Each ``POST /v1/completions`` or ``/v1/chat/completions`` goes first to a prefill
instance (round robin) as a one-token, non-streamed request asking for remote decode
(``kv_transfer_params.do_remote_decode``); the ``kv_transfer_params`` it answers with
are added to the original request, which goes to a decode instance (round robin) whose
answer is streamed back as it comes. ``GET /healthcheck`` reports the instance counts.
``OPENAI_API_KEY``, when set, is sent as the bearer token.

Upstream builds this on FastAPI, httpx and uvicorn; here it is the standard library's
asyncio (``mooncake._aio_http``), so it needs neither those nor vLLM.
"""

import argparse
import asyncio
import contextlib
import itertools
import json
import logging
import os
import sys
import types
import uuid

from ._aio_http import HttpServer, StreamResponse, json_response, open_request

__all__ = ["app", "lifespan", "parse_args", "get_next_client", "send_request_to_service",
           "stream_service_response", "handle_completions", "handle_chat_completions",
           "healthcheck", "build_server", "main"]

logger = logging.getLogger("mooncake")

global_args = None  # set by main() (upstream's module global)
_API_PREFIX = "/v1"


class _App:
    """What the handlers share: ``state.prefill_clients`` and ``state.decode_clients``
    ({"host", "port", "id"} each) and their round-robin iterators."""

    def __init__(self):
        self.state = types.SimpleNamespace(prefill_clients=[], decode_clients=[],
                                           prefill_iterator=None, decode_iterator=None)


app = _App()


def _clients(instances):
    return [{"host": host, "port": int(port), "id": i} for i, (host, port) in
            enumerate(instances)]


@contextlib.asynccontextmanager
async def lifespan(application):
    """Fills ``application.state`` from ``global_args`` for the server's lifetime."""
    state = application.state
    state.prefill_clients = _clients(global_args.prefiller_instances)
    state.decode_clients = _clients(global_args.decoder_instances)
    state.prefill_iterator = itertools.cycle(range(len(state.prefill_clients)))
    state.decode_iterator = itertools.cycle(range(len(state.decode_clients)))
    print(f"Initialized {len(state.prefill_clients)} prefill clients and "
          f"{len(state.decode_clients)} decode clients.")
    try:
        yield
    finally:
        state.prefill_clients, state.decode_clients = [], []


def parse_args(argv=None):
    parser = argparse.ArgumentParser(prog="vllm_v1_proxy_server")
    parser.add_argument("--port", type=int, default=8000)
    # 127.0.0.1, not localhost: localhost may resolve to IPv6, blocked on some CI hosts.
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--prefiller-hosts", "--prefiller-host", nargs="+",
                        default=["localhost"])
    parser.add_argument("--prefiller-ports", "--prefiller-port", type=int, nargs="+",
                        default=[8100])
    parser.add_argument("--decoder-hosts", "--decoder-host", nargs="+", default=["localhost"])
    parser.add_argument("--decoder-ports", "--decoder-port", type=int, nargs="+",
                        default=[8200])
    args = parser.parse_args(argv)
    if len(args.prefiller_hosts) != len(args.prefiller_ports):
        raise ValueError("Number of prefiller hosts must match number of prefiller ports")
    if len(args.decoder_hosts) != len(args.decoder_ports):
        raise ValueError("Number of decoder hosts must match number of decoder ports")
    args.prefiller_instances = list(zip(args.prefiller_hosts, args.prefiller_ports))
    args.decoder_instances = list(zip(args.decoder_hosts, args.decoder_ports))
    return args


def get_next_client(application, service_type):
    """The next instance of ``service_type`` ("prefill" or "decode"), round robin."""
    state = application.state
    if service_type == "prefill":
        return state.prefill_clients[next(state.prefill_iterator)]
    if service_type == "decode":
        return state.decode_clients[next(state.decode_iterator)]
    raise ValueError(f"Unknown service type: {service_type}")


def _headers(request_id):
    headers = {"X-Request-Id": request_id}
    if os.environ.get("OPENAI_API_KEY"):
        headers["Authorization"] = f"Bearer {os.environ['OPENAI_API_KEY']}"
    return headers


class ServiceReply:
    """A prefill instance's answer: ``status``, ``body`` (bytes), ``json()``."""

    def __init__(self, status, body):
        self.status = status
        self.body = body

    def json(self):
        return json.loads(self.body)


class ServiceError(RuntimeError):
    """An instance answered with an error status."""


async def send_request_to_service(client_info, endpoint, req_data, request_id):
    """The prefill step: ``req_data`` as a one-token, non-streamed request asking for
    remote decode; its reply (ServiceError for an error status)."""
    prefill = dict(req_data)
    prefill["kv_transfer_params"] = {
        "do_remote_decode": True, "do_remote_prefill": False, "remote_engine_id": None,
        "remote_block_ids": None, "remote_host": None, "remote_port": None,
    }
    prefill["stream"] = False
    prefill["max_tokens"] = 1
    if "max_completion_tokens" in prefill:
        prefill["max_completion_tokens"] = 1
    prefill.pop("stream_options", None)
    response = await open_request("POST", client_info["host"], client_info["port"],
                                  _API_PREFIX + endpoint, json_body=prefill,
                                  headers=_headers(request_id))
    body = await response.read()
    if response.status >= 400:
        raise ServiceError(f"prefill {client_info['host']}:{client_info['port']} answered "
                           f"{response.status}: {body[:200]!r}")
    return ServiceReply(response.status, body)


async def stream_service_response(client_info, endpoint, req_data, request_id):
    """The decode step: ``req_data`` sent as is; its answer's bytes as they arrive."""
    response = await open_request("POST", client_info["host"], client_info["port"],
                                  _API_PREFIX + endpoint, json_body=req_data,
                                  headers=_headers(request_id))
    if response.status >= 400:
        body = await response.read()
        raise ServiceError(f"decode {client_info['host']}:{client_info['port']} answered "
                           f"{response.status}: {body[:200]!r}")
    async for chunk in response.iter_chunks():
        yield chunk


async def _handle_completions(api, request):
    req_data = await request.json()
    request_id = str(uuid.uuid4())
    application = request.app or app
    prefill_client = get_next_client(application, "prefill")
    reply = await send_request_to_service(prefill_client, api, req_data, request_id)
    kv_transfer_params = reply.json().get("kv_transfer_params") or {}
    if kv_transfer_params:
        req_data["kv_transfer_params"] = kv_transfer_params
    decode_client = get_next_client(application, "decode")
    logger.debug("proxy %s: prefill %s, decode %s", request_id, prefill_client, decode_client)
    # Start the decode request now, so its error status becomes this request's error.
    stream = stream_service_response(decode_client, api, req_data, request_id)
    try:
        first = await stream.__anext__()
    except StopAsyncIteration:
        first = b""

    async def rest():
        yield first
        async for chunk in stream:
            yield chunk

    return StreamResponse(rest(), content_type="application/json")


async def _proxied(api, request):
    try:
        return await _handle_completions(api, request)
    except (ServiceError, OSError, asyncio.TimeoutError) as e:
        logger.error("disaggregated prefill proxy: %s endpoint failed: %s", api, e)
        return json_response({"error": str(e)}, 502)


async def handle_completions(request):
    return await _proxied("/completions", request)


async def handle_chat_completions(request):
    return await _proxied("/chat/completions", request)


async def healthcheck(request=None):
    """{"status": "ok", "prefill_instances": n, "decode_instances": m}."""
    state = app.state if request is None or request.app is None else request.app.state
    return {"status": "ok", "prefill_instances": len(state.prefill_clients),
            "decode_instances": len(state.decode_clients)}


async def _healthcheck_route(request):
    return json_response(await healthcheck(request))


def build_server(application=app):
    """The HTTP server of the proxy's routes, sharing ``application``."""
    return HttpServer([
        ("POST", "/v1/completions", handle_completions),
        ("POST", "/v1/chat/completions", handle_chat_completions),
        ("GET", "/healthcheck", _healthcheck_route),
    ], state=application)


async def serve(host, port, ready=None):
    """Runs the proxy until cancelled; ``ready(port)`` is called once it listens."""
    async with lifespan(app):
        server = build_server(app)
        bound = await server.start(host, port)
        if ready is not None:
            ready(bound)
        try:
            await asyncio.Event().wait()
        finally:
            await server.stop()


def main(argv=None):
    global global_args
    logging.basicConfig(level=logging.INFO)
    try:
        global_args = parse_args(argv)
    except ValueError as e:
        print(f"vllm_v1_proxy_server: {e}", file=sys.stderr)
        return 2
    try:
        asyncio.run(serve(global_args.host, global_args.port))
    except KeyboardInterrupt:
        pass
    return 0


if __name__ == "__main__":
    sys.exit(main())
