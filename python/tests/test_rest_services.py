"""The REST services: ``mc_store_rest_server`` (mooncake.mooncake_store_service) as a
process over a real master, and the vLLM disaggregation proxy in front of stand-in
prefill and decode servers."""

import asyncio
import http.client
import json
import os
import re
import signal
import subprocess
import sys

import pytest

from fixtures_extra import free_port, port_is_open, terminate, wait_until

MiB = 1 << 20


def request(port, method, path, body=None):
    """(status, body bytes) of one HTTP request to 127.0.0.1:port."""
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=30)
    try:
        payload = None if body is None else json.dumps(body)
        headers = {} if body is None else {"Content-Type": "application/json"}
        conn.request(method, path, body=payload, headers=headers)
        response = conn.getresponse()
        return response.status, response.read()
    finally:
        conn.close()


@pytest.fixture
def service(master_factory, tmp_path):
    """A running mc_store_rest_server process: its HTTP port."""
    master = master_factory()
    config = tmp_path / "mooncake.json"
    config.write_text(json.dumps({
        "local_hostname": "127.0.0.1", "metadata_server": "P2PHANDSHAKE",
        "global_segment_size": 16 * MiB, "local_buffer_size": 4 * MiB, "protocol": "tcp",
        "device_name": "", "master_server_address": master.rpc}))
    port = free_port()
    proc = subprocess.Popen(
        [sys.executable, "-m", "mooncake.mooncake_store_service", "--config", str(config),
         "--port", str(port), "--max-wait-time", "20"],
        stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE,
        env=dict(os.environ))
    try:
        wait_until(lambda: port_is_open("127.0.0.1", port) or proc.poll() is not None,
                   "the REST API to listen", timeout=60)
        assert proc.poll() is None, proc.stderr.read().decode()
        yield port, proc
    finally:
        terminate(proc, 30)
        proc.stderr.close()


def test_store_service_serves_objects_over_rest(service):
    port, proc = service
    assert request(port, "PUT", "/api/put", {"key": "k1", "value": "hello"}) == (
        200, b'{"status": "success"}')
    assert json.loads(request(port, "GET", "/api/exist/k1")[1]) == {"exists": True}
    assert request(port, "DELETE", "/api/remove/k1")[0] == 200
    assert json.loads(request(port, "GET", "/api/exist/k1")[1]) == {"exists": False}
    request(port, "PUT", "/api/put", {"key": "k2", "value": "read me"})
    assert request(port, "GET", "/api/get/k2") == (200, b"read me")
    status, body = request(port, "GET", "/api/get/missing")
    assert status == 404 and json.loads(body)["error"] == "Key not found"
    request(port, "PUT", "/api/put", {"key": "k3", "value": "x"})
    status, body = request(port, "DELETE", "/api/remove_all")
    # k2 may still be under the read lease of its get, and is then kept.
    assert status == 200 and re.fullmatch(r"success removed [12] keys",
                                          json.loads(body)["status"])
    assert json.loads(request(port, "GET", "/api/exist/k3")[1]) == {"exists": False}


def test_store_service_mounts_and_unmounts_extra_segments(service):
    from mooncake.store import MooncakeDistributedStore

    port, _ = service
    status, body = request(port, "POST", "/api/mount", {"size": 4 * MiB})
    if not hasattr(MooncakeDistributedStore, "allocate_and_mount_segment"):
        assert status == 501 and "not supported" in json.loads(body)["error"]
        return
    answer = json.loads(body)
    assert status == 200 and answer["status"] == "success" and answer["segment_ids"]
    assert answer["allocated_size"] >= 4 * MiB
    assert request(port, "POST", "/api/unmount", {"segment_ids": answer["segment_ids"]}) == (
        200, b'{"status": "success"}')


def test_store_service_rejects_bad_requests(service):
    port, proc = service
    status, body = request(port, "PUT", "/api/put", {"value": "v"})
    assert status == 400 and "Missing key or value" in json.loads(body)["error"]
    assert request(port, "POST", "/api/mount", {"size": 0})[0] == 400
    assert request(port, "POST", "/api/mount_shm", {"name": "../etc", "size": 1})[0] == 400
    assert request(port, "POST", "/api/unmount", {})[0] == 400
    assert request(port, "POST", "/api/unmount_local_disk",
                   {"grace_period_seconds": 3601})[0] == 400
    assert request(port, "POST", "/api/reconfigure", {"mode": "sideways"})[0] == 400
    assert request(port, "GET", "/api/nothing-here")[0] == 404
    assert request(port, "POST", "/api/get/k")[0] == 405
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=30)
    conn.request("PUT", "/api/put", body="{not json", headers={"Content-Type": "application/json"})
    assert conn.getresponse().status == 500
    conn.close()
    # Still serving, and SIGTERM stops it cleanly.
    assert request(port, "GET", "/api/exist/anything")[0] == 200
    proc.send_signal(signal.SIGTERM)
    assert proc.wait(timeout=30) == 0


def test_store_service_gives_up_when_no_master_answers(tmp_path):
    config = tmp_path / "mooncake.json"
    config.write_text(json.dumps({
        "local_hostname": "127.0.0.1", "metadata_server": "P2PHANDSHAKE",
        "global_segment_size": MiB, "local_buffer_size": MiB, "protocol": "tcp",
        "master_server_address": f"127.0.0.1:{free_port()}"}))
    done = subprocess.run(
        [sys.executable, "-m", "mooncake.mooncake_store_service", "--config", str(config),
         "--port", str(free_port()), "--max-wait-time", "1"],
        stdin=subprocess.DEVNULL, capture_output=True, text=True, timeout=120)
    assert done.returncode == 1
    assert "Failed to start store service" in done.stderr


# ------------------------------------------------------------------ the vLLM proxy


def test_proxy_prefills_then_streams_the_decode_answer():
    from mooncake import vllm_v1_proxy_server as proxy
    from mooncake._aio_http import HttpServer, StreamResponse, json_response

    seen = {"prefill": [], "decode": []}

    async def prefill(request):
        seen["prefill"].append(await request.json())
        return json_response({"kv_transfer_params": {"remote_host": "10.0.0.1",
                                                     "remote_port": 6557,
                                                     "do_remote_prefill": True}})

    async def decode(request):
        seen["decode"].append((await request.json(), request.headers.get("x-request-id")))

        async def chunks():
            for part in (b'{"choices": ', b'[{"text": "hi"}]}'):
                yield part

        return StreamResponse(chunks(), content_type="application/json")

    async def broken(request):
        return json_response({"error": "down"}, 503)

    async def scenario():
        servers = [HttpServer([("POST", "/v1/completions", handler),
                               ("POST", "/v1/chat/completions", handler)])
                   for handler in (prefill, decode, broken)]
        ports = [await s.start("127.0.0.1", 0) for s in servers]
        proxy.global_args = proxy.parse_args([
            "--prefiller-hosts", "127.0.0.1", "127.0.0.1",
            "--prefiller-ports", str(ports[0]), str(ports[2]),
            "--decoder-host", "127.0.0.1", "--decoder-port", str(ports[1])])
        async with proxy.lifespan(proxy.app):
            front = proxy.build_server()
            port = await front.start("127.0.0.1", 0)
            try:
                health = await asyncio.to_thread(request, port, "GET", "/healthcheck")
                body = {"model": "m", "prompt": "p", "max_tokens": 50, "stream": True,
                        "stream_options": {"include_usage": True}}
                first = await asyncio.to_thread(request, port, "POST", "/v1/completions", body)
                second = await asyncio.to_thread(request, port, "POST",
                                                 "/v1/chat/completions", body)
            finally:
                await front.stop()
        for s in servers:
            await s.stop()
        return health, first, second

    health, first, second = asyncio.run(scenario())
    assert json.loads(health[1]) == {"status": "ok", "prefill_instances": 2,
                                     "decode_instances": 1}
    assert first == (200, b'{"choices": [{"text": "hi"}]}')
    (prefill_body,) = seen["prefill"]
    assert prefill_body["max_tokens"] == 1 and prefill_body["stream"] is False
    assert "stream_options" not in prefill_body
    assert prefill_body["kv_transfer_params"]["do_remote_decode"] is True
    (decode_body, request_id) = seen["decode"][0]
    assert decode_body["max_tokens"] == 50 and decode_body["stream"] is True
    assert decode_body["kv_transfer_params"]["remote_host"] == "10.0.0.1"
    assert request_id
    # Round robin: the second request went to the broken prefill instance.
    assert second[0] == 502 and "503" in json.loads(second[1])["error"]
    with pytest.raises(ValueError, match="prefiller"):
        proxy.parse_args(["--prefiller-hosts", "a", "b", "--prefiller-ports", "1"])


# ------------------------------------------------------------------ in-process metadata


def test_in_process_metadata_server_serves_transfer_engines():
    from mooncake.engine import TransferEngine
    from mooncake.http_metadata_server import KVBootstrapServer, KVPoll

    server = KVBootstrapServer(port=0, host="127.0.0.1")
    assert server.poll() == KVPoll.Failed
    server.run()
    engines = []
    try:
        assert server.poll() == KVPoll.Success
        port = server.port
        assert request(port, "GET", "/metadata?key=%20")[0] == 400
        assert request(port, "GET", "/metadata?key=absent")[0] == 404
        conn = http.client.HTTPConnection("127.0.0.1", port, timeout=30)
        conn.request("PUT", "/metadata?key=%20k%20", body=b"v1")
        assert conn.getresponse().read() == b"metadata updated"
        conn.close()
        assert server.store == {"k": b"v1"}
        assert request(port, "GET", "/metadata?key=k") == (200, b"v1")
        assert request(port, "DELETE", "/metadata?key=k")[0] == 200
        # Two engines find each other through it.
        url = f"http://127.0.0.1:{port}/metadata"
        for name in ("127.0.0.1:%d" % free_port(), "127.0.0.1:%d" % free_port()):
            e = TransferEngine()
            assert e.initialize(name, url, "tcp", "") == 0
            engines.append((e, name))
        (a, _), (b, b_name) = engines
        src, dst = a.allocate_managed_buffer(4096), b.allocate_managed_buffer(4096)
        assert a.write_bytes_to_buffer(src, b"through metadata", 16) == 0
        assert a.transfer_sync_write(b_name, src, dst, 16) == 0
        assert b.read_bytes_from_buffer(dst, 16) == b"through metadata"
        assert server.store  # the engines' descriptors live here
    finally:
        for e, _ in engines:
            e.close()
        server.close()
    assert server.poll() == KVPoll.Failed
