"""A small HTTP/1.1 server and client on asyncio streams (standard library only), for
the REST services of this package (``mooncake_store_service``, ``vllm_v1_proxy_server``).

Server: routes are (method, pattern, handler); a pattern's ``{name}`` matches one path
segment, given to the handler as ``request.match_info[name]`` (URL-decoded). Handlers
are coroutines taking a :class:`Request` and returning a :class:`Response` or a
:class:`StreamResponse` (sent chunked). Bodies come with Content-Length or chunked
encoding, up to ``max_body`` bytes (413 beyond); connections are kept alive unless a
side asks to close. A handler that raises answers 500 with ``{"error": "..."}``.

Client: :func:`open_request` sends one request on a fresh connection and returns a
:class:`ClientResponse` whose body is read whole (``read``) or as it arrives
(``iter_chunks``).
"""

import asyncio
import json
import logging
import re
import urllib.parse

__all__ = ["Request", "Response", "StreamResponse", "HttpServer", "HttpError",
           "ClientResponse", "open_request"]

logger = logging.getLogger("mooncake")

_MAX_HEAD = 64 << 10
_REASONS = {200: "OK", 204: "No Content", 400: "Bad Request", 404: "Not Found",
            405: "Method Not Allowed", 411: "Length Required", 413: "Payload Too Large",
            500: "Internal Server Error", 502: "Bad Gateway", 503: "Service Unavailable"}


class HttpError(Exception):
    """A malformed message; ``status`` is what the server answers with."""

    def __init__(self, status, message):
        super().__init__(message)
        self.status = status


class Request:
    """``method``, ``path``, ``query`` (first value of each name), ``headers`` (lower-case
    names), ``match_info``, ``body`` (bytes) and ``app`` (the server's shared state)."""

    def __init__(self, method, path, query, headers, body, match_info=None, app=None):
        self.method = method
        self.path = path
        self.query = query
        self.headers = headers
        self.body = body
        self.match_info = match_info or {}
        self.app = app

    async def read(self):
        return self.body

    async def text(self):
        return self.body.decode("utf-8")

    async def json(self):
        return json.loads(self.body)


class Response:
    """``text`` (str) or ``body`` (bytes), with a status and content type."""

    def __init__(self, status=200, text=None, body=None, content_type=None, headers=None):
        self.status = status
        self.text = text
        self.body = body if body is not None else (text or "").encode("utf-8")
        self.content_type = content_type or ("text/plain" if body is None else
                                             "application/octet-stream")
        self.headers = dict(headers or {})


def json_response(value, status=200):
    return Response(status=status, text=json.dumps(value), content_type="application/json")


class StreamResponse:
    """A body produced by an async iterator of bytes, sent as it comes (chunked)."""

    def __init__(self, chunks, status=200, content_type="application/octet-stream",
                 headers=None):
        self.chunks = chunks
        self.status = status
        self.content_type = content_type
        self.headers = dict(headers or {})


def _compile(pattern):
    parts = re.split(r"(\{\w+\})", pattern)
    regex = "".join(f"(?P<{p[1:-1]}>[^/]+)" if p.startswith("{") else re.escape(p)
                    for p in parts)
    return re.compile(f"^{regex}$")


async def _read_head(reader):
    try:
        head = await reader.readuntil(b"\r\n\r\n")
    except asyncio.IncompleteReadError as e:
        if not e.partial:
            return None  # the peer closed between messages
        raise HttpError(400, "truncated message head") from None
    except asyncio.LimitOverrunError:
        raise HttpError(400, "message head too long") from None
    lines = head.decode("latin-1").split("\r\n")
    headers = {}
    for line in lines[1:]:
        if not line:
            continue
        name, colon, value = line.partition(":")
        if not colon:
            raise HttpError(400, f"malformed header line {line!r}")
        headers[name.strip().lower()] = value.strip()
    return lines[0], headers


async def _read_chunked(reader, limit):
    body = bytearray()
    while True:
        size_line = await reader.readuntil(b"\r\n")
        try:
            size = int(size_line.split(b";")[0].strip(), 16)
        except ValueError:
            raise HttpError(400, "malformed chunk size") from None
        if size == 0:
            # Trailer fields, then the blank line.
            while (await reader.readuntil(b"\r\n")) != b"\r\n":
                pass
            return bytes(body)
        if len(body) + size > limit:
            raise HttpError(413, "body too large")
        body += await reader.readexactly(size)
        await reader.readexactly(2)


async def _read_body(reader, headers, limit, until_eof=False):
    if "chunked" in headers.get("transfer-encoding", "").lower():
        return await _read_chunked(reader, limit)
    length = headers.get("content-length")
    if length is None:
        return await reader.read(limit) if until_eof else b""
    if not length.isdigit():
        raise HttpError(400, "malformed Content-Length")
    if int(length) > limit:
        raise HttpError(413, "body too large")
    return await reader.readexactly(int(length))


def _head_bytes(status, content_type, extra, framing):
    reason = _REASONS.get(status, "Status")
    lines = [f"HTTP/1.1 {status} {reason}", f"Content-Type: {content_type}", framing]
    lines += [f"{k}: {v}" for k, v in extra.items()]
    return ("\r\n".join(lines) + "\r\n\r\n").encode("latin-1")


class HttpServer:
    """Serves ``routes`` [(method, pattern, handler)]; ``state`` is shared with handlers
    as ``request.app``."""

    def __init__(self, routes, max_body=100 << 20, state=None):
        self._routes = [(m.upper(), _compile(p), h) for m, p, h in routes]
        self._max_body = max_body
        self.state = state
        self._server = None

    async def start(self, host, port):
        """Listens; the port bound (useful with 0)."""
        self._server = await asyncio.start_server(self._serve, host, port, limit=_MAX_HEAD)
        return self._server.sockets[0].getsockname()[1]

    async def stop(self):
        if self._server is not None:
            self._server.close()
            await self._server.wait_closed()
            self._server = None

    def _route(self, method, path):
        """(handler, match_info), or a 404/405 Response."""
        allowed = False
        for m, regex, handler in self._routes:
            found = regex.match(path)
            if found is None:
                continue
            if m == method:
                return handler, {k: urllib.parse.unquote(v) for k, v in found.groupdict().items()}
            allowed = True
        if allowed:
            return json_response({"error": "method not allowed"}, 405), None
        return json_response({"error": "not found"}, 404), None

    async def _serve(self, reader, writer):
        try:
            while await self._one(reader, writer):
                pass
        except (ConnectionError, asyncio.IncompleteReadError):
            pass
        finally:
            writer.close()
            try:
                await writer.wait_closed()
            except (ConnectionError, OSError):
                pass

    async def _one(self, reader, writer):
        """Answers one request; whether the connection stays open."""
        try:
            head = await _read_head(reader)
            if head is None:
                return False
            request_line, headers = head
            parts = request_line.split(" ")
            if len(parts) != 3:
                raise HttpError(400, "malformed request line")
            method, target, version = parts
            if headers.get("expect", "").lower() == "100-continue":
                writer.write(b"HTTP/1.1 100 Continue\r\n\r\n")  # curl waits for it
            body = await _read_body(reader, headers, self._max_body)
        except HttpError as e:
            await self._send(writer, json_response({"error": str(e)}, e.status), close=True)
            return False
        url = urllib.parse.urlsplit(target)
        query = {k: v[0] for k, v in urllib.parse.parse_qs(url.query,
                                                           keep_blank_values=True).items()}
        keep_alive = version == "HTTP/1.1" and headers.get("connection", "").lower() != "close"
        handler, match_info = self._route(method.upper(), url.path)
        if match_info is None:
            response = handler
        else:
            request = Request(method.upper(), url.path, query, headers, body, match_info,
                              self.state)
            try:
                response = await handler(request)
            except Exception as e:  # the handler's failure is the client's 500
                logger.exception("mooncake: %s %s failed", method, url.path)
                response = json_response({"error": str(e)}, 500)
        return await self._send(writer, response, close=not keep_alive)

    async def _send(self, writer, response, close):
        extra = dict(response.headers)
        if close:
            extra["Connection"] = "close"
        if isinstance(response, StreamResponse):
            writer.write(_head_bytes(response.status, response.content_type, extra,
                                     "Transfer-Encoding: chunked"))
            try:
                async for chunk in response.chunks:
                    if chunk:
                        writer.write(b"%x\r\n%s\r\n" % (len(chunk), chunk))
                        await writer.drain()
            except Exception:  # the source failed mid-stream: cut the response short
                logger.exception("mooncake: streaming a response failed")
                return False
            writer.write(b"0\r\n\r\n")
        else:
            writer.write(_head_bytes(response.status, response.content_type, extra,
                                     f"Content-Length: {len(response.body)}"))
            writer.write(response.body)
        await writer.drain()
        return not close


class ClientResponse:
    """``status``, ``headers`` (lower-case names); the body through ``read`` or
    ``iter_chunks``; ``close`` ends the connection."""

    def __init__(self, status, headers, reader, writer, limit):
        self.status = status
        self.headers = headers
        self._reader = reader
        self._writer = writer
        self._limit = limit

    async def read(self):
        try:
            return await _read_body(self._reader, self.headers, self._limit, until_eof=True)
        finally:
            self.close()

    async def iter_chunks(self):
        """The body as it arrives."""
        reader = self._reader
        try:
            if "chunked" in self.headers.get("transfer-encoding", "").lower():
                while True:
                    size = int((await reader.readuntil(b"\r\n")).split(b";")[0].strip(), 16)
                    if size == 0:
                        break
                    yield await reader.readexactly(size)
                    await reader.readexactly(2)
            elif "content-length" in self.headers:
                left = int(self.headers["content-length"])
                while left:
                    chunk = await reader.read(min(left, 1 << 16))
                    if not chunk:
                        raise ConnectionError("response body cut short")
                    left -= len(chunk)
                    yield chunk
            else:
                while True:
                    chunk = await reader.read(1 << 16)
                    if not chunk:
                        break
                    yield chunk
        finally:
            self.close()

    def close(self):
        self._writer.close()


async def open_request(method, host, port, path, json_body=None, headers=None,
                       timeout=None, limit=100 << 20):
    """Sends one request (a JSON body when given) and returns the ClientResponse once its
    head arrived. ``timeout`` bounds connecting and the head (None: no bound)."""

    async def connect_and_send():
        reader, writer = await asyncio.open_connection(host, port, limit=_MAX_HEAD)
        body = b"" if json_body is None else json.dumps(json_body).encode()
        lines = [f"{method} {path} HTTP/1.1", f"Host: {host}:{port}", "Connection: close",
                 f"Content-Length: {len(body)}"]
        if json_body is not None:
            lines.append("Content-Type: application/json")
        lines += [f"{k}: {v}" for k, v in (headers or {}).items()]
        writer.write(("\r\n".join(lines) + "\r\n\r\n").encode("latin-1") + body)
        await writer.drain()
        head = await _read_head(reader)
        if head is None:
            writer.close()
            raise ConnectionError(f"{host}:{port} closed the connection without answering")
        status_line, response_headers = head
        try:
            status = int(status_line.split(" ")[1])
        except (IndexError, ValueError):
            writer.close()
            raise ConnectionError(f"{host}:{port}: malformed status line {status_line!r}")
        return ClientResponse(status, response_headers, reader, writer, limit)

    return await asyncio.wait_for(connect_and_send(), timeout)
