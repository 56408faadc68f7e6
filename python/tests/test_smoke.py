"""Smoke tests of the mooncake package: import, a TransferEngine pair over P2PHANDSHAKE on
127.0.0.1, a store against a `mooncake master` child, config parsing, console scripts."""

import ctypes
import json
import os
import subprocess
import sys
import time
import urllib.request

import pytest

from mooncake import _native
from mooncake.engine import TransferEngine, TransferNotify, TransferOpcode
from mooncake.mooncake_config import MooncakeConfig, parse_size
from mooncake.store import (
    MooncakeDistributedStore,
    MooncakeHostMemAllocator,
    ReplicateConfig,
    SoftPinAction,
)

rev2 = pytest.mark.skipif(_native.ABI_REVISION < 2, reason="needs C ABI revision 2")


def test_import_surface():
    import mooncake
    import mooncake.engine as engine

    assert isinstance(mooncake.__version__, str)
    assert type(_native._cdll) is ctypes.CDLL  # CDLL releases the GIL in every call
    for flag in ("SUPPORT_CUDA", "SUPPORT_HIP", "SUPPORT_EFA", "SUPPORT_MNNVL"):
        assert isinstance(getattr(engine, flag), bool)
    assert (TransferOpcode.Read, TransferOpcode.Write) == (0, 1)
    n = TransferNotify("a", "b")
    assert (n.name, n.msg) == ("a", "b")


# ---------------------------------------------------------------- engine


@pytest.fixture
def engine_pair():
    a, b = TransferEngine(), TransferEngine()
    assert a.initialize("127.0.0.1", "P2PHANDSHAKE", "tcp", "") == 0
    assert b.initialize("127.0.0.1:0", "P2PHANDSHAKE", "tcp", "mlx5_0") == 0
    yield a, b
    a.close()
    b.close()


def test_engine_pair_transfers(engine_pair):
    a, b = engine_pair
    assert a.get_rpc_port() > 0 and b.get_rpc_port() > 0
    session_b = f"127.0.0.1:{b.get_rpc_port()}"
    assert b.get_session_id() == session_b
    size = 1 << 20
    src, dst = a.allocate_managed_buffer(size), b.allocate_managed_buffer(size)
    assert src and dst

    a.write_bytes_to_buffer(src, b"hello mooncake", 14)
    assert a.transfer_sync_write(session_b, src, dst, 14) == 0
    assert b.read_bytes_from_buffer(dst, 14) == b"hello mooncake"

    b.write_bytes_to_buffer(dst + 4096, b"from b", 6)
    assert a.transfer_sync_read(session_b, src + 4096, dst + 4096, 6) == 0
    assert a.read_bytes_from_buffer(src + 4096, 6) == b"from b"

    payload = os.urandom(3 * 8192)
    a.write_bytes_to_buffer(src, payload, len(payload))
    locals_ = [src, src + 8192, src + 16384]
    peers = [dst + 65536, dst + 131072, dst + 196608]
    assert a.batch_transfer_sync_write(session_b, locals_, peers, [8192] * 3) == 0
    got = b"".join(b.read_bytes_from_buffer(p, 8192) for p in peers)
    assert got == payload

    bid = a.batch_transfer_async_read(session_b, [src + 300000], [dst + 65536], [8192])
    assert bid != 0
    assert a.get_batch_transfer_status([bid]) == 0
    assert a.read_bytes_from_buffer(src + 300000, 8192) == payload[:8192]

    bid = a.transfer_submit_write(session_b, src, dst + 500000, 4096)
    deadline = time.time() + 30
    while (st := a.transfer_check_status(bid)) == 0 and time.time() < deadline:
        time.sleep(0.001)
    assert st == 1
    assert a.transfer_check_status(bid) == -1  # freed

    assert a.transfer_sync(session_b, src, dst, 8, TransferOpcode.Write,
                           TransferNotify("x", "block-7 ready")) == 0
    notes = b.get_notifies()
    assert [n.msg for n in notes] == ["block-7 ready"]
    assert notes[0].name == "x"  # the name the sender gave, as upstream delivers it
    assert b.get_notifies() == []

    assert a.send_probe(session_b) == 0
    assert a.free_managed_buffer(src, size) == 0
    assert b.free_managed_buffer(dst, size) == 0


def test_engine_registered_user_memory_and_failures(engine_pair, free_port):
    a, b = engine_pair
    session_b = f"127.0.0.1:{b.get_rpc_port()}"
    target = ctypes.create_string_buffer(8192)
    assert b.register_memory(ctypes.addressof(target), 8192) == 0
    src = ctypes.create_string_buffer(b"user memory", 64)
    # Local memory must be registered too (as upstream's RDMA path requires).
    assert a.transfer_sync_write(session_b, ctypes.addressof(src),
                                 ctypes.addressof(target) + 100, 11) == -1
    assert a.register_memory(ctypes.addressof(src), 64) == 0
    assert a.transfer_sync_write(session_b, ctypes.addressof(src),
                                 ctypes.addressof(target) + 100, 11) == 0
    assert target.raw[100:111] == b"user memory"
    assert b.unregister_memory(ctypes.addressof(target)) == 0
    # Unregistered peer memory, an unknown segment: codes, not exceptions.
    assert a.transfer_sync_write(session_b, ctypes.addressof(src),
                                 ctypes.addressof(target), 11) == -1
    nowhere = f"127.0.0.1:{free_port()}"
    assert a.batch_transfer_async_write(nowhere, [ctypes.addressof(src)], [0x1000], [8]) == 0
    assert a.send_probe(nowhere) < 0
    with pytest.raises(ValueError):
        a.batch_transfer_sync_write(session_b, [1, 2], [3], [4, 5])
    with pytest.raises(TypeError):
        a.transfer_sync_write(session_b, "addr", 0, 1)


def test_engine_refusals():
    e = TransferEngine()
    assert e.get_rpc_port() == -1
    assert e.transfer_sync_write("127.0.0.1:1", 0x1000, 0x1000, 8) == -1
    assert e.initialize("127.0.0.1", "etcd://127.0.0.1:2379", "tcp", "") == -1
    assert e.initialize("127.0.0.1", "127.0.0.1:2379", "tcp", "") == -1  # bare = etcd
    assert e.initialize("127.0.0.1", "P2PHANDSHAKE", "carrier-pigeon", "") == -1


@rev2
def test_engine_introspection(engine_pair):
    a, b = engine_pair
    assert isinstance(json.loads(a.get_local_topology()), dict)
    addr = b.allocate_managed_buffer(4096)
    assert a.get_first_buffer_address(f"127.0.0.1:{b.get_rpc_port()}") == addr


# ---------------------------------------------------------------- store


@pytest.fixture
def store(master):
    s = MooncakeDistributedStore()
    rc = s.setup("localhost", master.metadata, 64 << 20, 16 << 20, "tcp", "", master.rpc)
    assert rc == 0
    yield s
    s.close()


def test_store_before_setup_returns_codes():
    s = MooncakeDistributedStore()
    assert s.health_check() == 1
    assert s.put("k", b"v") == -600
    assert s.get("k") == b""
    assert s.get_buffer("k") is None
    assert s.is_exist("k") == -600
    assert s.batch_is_exist(["a", "b"]) == [-600, -600]
    assert s.get_hostname() == ""
    assert s.close() == 0


def test_store_copying_api(store):
    assert store.health_check() == 0
    host, port = store.get_hostname().rsplit(":", 1)
    assert host == "localhost" and int(port) > 0
    assert store.put("k1", b"value-1") == 0
    assert store.put("k1", b"other") == 0  # immutable: first value kept
    assert store.get("k1") == b"value-1"
    assert store.is_exist("k1") == 1 and store.is_exist("missing") == 0
    assert store.get_size("k1") == 7
    assert store.get("missing") == b""
    assert store.put_parts("k2", b"ab", bytearray(b"cd"), memoryview(b"ef")) == 0
    assert store.get("k2") == b"abcdef"
    assert store.put_batch(["b1", "b2"], [b"x" * 10, b"y" * 5000]) == 0
    assert store.get_batch(["b1", "missing", "b2"]) == [b"x" * 10, b"", b"y" * 5000]
    assert store.batch_is_exist(["b1", "missing"]) == [1, 0]
    buf = store.get_buffer("b2")
    assert len(buf) == buf.size() == 5000 and buf.ptr() != 0
    assert bytes(memoryview(buf)) == b"y" * 5000
    assert store.batch_get_buffer(["b1", "missing"])[1] is None
    # Key limits: per key, no exception.
    assert store.put("x" * 5000, b"v") == -400
    assert store.batch_is_exist(["ok", "x" * 5000]) == [0, -400]
    assert store.put("k", b"v" * (17 << 20)) == -200  # larger than local_buffer_size
    assert store.remove("k1", force=True) == 0
    assert store.is_exist("k1") == 0
    assert store.remove_all(force=True) >= 3


def test_store_zero_copy(store):
    size = 1 << 16
    buf = ctypes.create_string_buffer(size)
    addr = ctypes.addressof(buf)
    ctypes.memmove(addr, b"0123456789", 10)
    assert store.put_from("z", addr, 10) == -600  # never registered
    assert store.register_buffer(addr, size) == 0
    assert store.put_from("z", addr, 10) == 0
    assert store.get_into("z", addr + 1000, 100) == 10
    assert buf.raw[1000:1010] == b"0123456789"
    assert store.get_into("z", addr + size - 4, 10) == -600  # runs past the registration
    assert store.get_into("z", addr + 2000, 4) == -10  # too small
    assert store.batch_put_from(["z1", "z2"], [addr, addr + 5], [5, 5]) == [0, 0]
    assert store.batch_get_into(["z1", "z2", "nope"], [addr + 3000, addr + 4000, addr + 5000],
                                [16, 16, 16]) == [5, 5, -704]
    assert buf.raw[3000:3005] == b"01234" and buf.raw[4000:4005] == b"56789"
    assert store.batch_put_from(["a", "b"], [addr], [1, 1]) == [-600, -600]
    assert store.is_exist("a") == 0  # nothing was sent
    assert store.unregister_buffer(addr) == 0
    assert store.get_into("z", addr, 10) == -600


@rev2
def test_store_revision2(store):
    size = 1 << 16
    buf = ctypes.create_string_buffer(size)
    addr = ctypes.addressof(buf)
    ctypes.memmove(addr, b"AAAABBBBCCCC", 12)
    assert store.register_buffer(addr, size) == 0
    assert store.batch_put_from_multi_buffers(
        ["m1", "m2"], [[addr, addr + 8], [addr + 4]], [[4, 4], [8]]) == [0, 0]
    assert store.batch_get_into_multi_buffers(
        ["m1", "m2"], [[addr + 100, addr + 200], [addr + 300]], [[2, 6], [8]]) == [8, 8]
    assert buf.raw[100:102] + buf.raw[200:206] == b"AAAACCCC"
    assert buf.raw[300:308] == b"BBBBCCCC"
    res = store.get_into_ranges([addr + 1000], [["m2"]], [[[0, 10]]], [[[4, 0]]], [[[4, 2]]])
    assert res == [[[4, 2]]]
    assert buf.raw[1000:1004] == b"CCCC" and buf.raw[1010:1012] == b"BB"
    assert store.upsert("u", b"one") == 0 and store.upsert("u", b"two!") == 0
    assert store.get("u") == b"two!"
    desc = store.get_replica_desc("m1")
    assert len(desc) == 1 and desc[0].is_memory_replica() and not desc[0].is_disk_replica()
    assert desc[0].get_memory_descriptor().buffer_descriptor.transport_endpoint == \
        store.get_hostname()
    assert set(store.batch_get_replica_desc(["m1", "m2", "nope"])) == {"m1", "m2"}
    assert store.batch_remove(["m1", "nope"], force=True) == [0, -704]
    assert store.batch_replica_clear(["m2"]) in ([], ["m2"])  # leased by the reads above


def test_replicate_config_types():
    c = ReplicateConfig()
    assert (c.replica_num, c.with_soft_pin, c.with_hard_pin, c.soft_pin_ttl_ms) == (1, False, False, None)
    assert (c.preferred_segment, c.preferred_segments, c.group_ids) == ("", [], None)
    c.soft_pin_ttl_ms = 0
    c.soft_pin_ttl_ms = (1 << 64) - 1
    c.soft_pin_ttl_ms = None
    for bad in (True, -1, 1 << 64, 1.5, "10"):
        with pytest.raises(TypeError):
            c.soft_pin_ttl_ms = bad
    with pytest.raises(TypeError):
        c.with_hard_pin = 1
    with pytest.raises(TypeError):
        c.preferred_segments = "seg"
    c.with_soft_pin = True
    assert c.soft_pin_action == SoftPinAction.ENABLE
    with pytest.raises(TypeError):
        MooncakeDistributedStore().put("k", b"v", config="not a config")


def test_setup_dict_and_errors(master):
    s = MooncakeDistributedStore()
    # As upstream's setup(dict): a value it cannot read answers INVALID_PARAMS.
    assert s.setup({"local_hostname": "localhost", "metadata_server": "P2PHANDSHAKE",
                    "global_segment_size": "10%"}) == -600
    assert s.health_check() == 1
    with pytest.raises(TypeError):
        s.setup("localhost", "P2PHANDSHAKE", 0, 0, "tcp", "", master.rpc, no_such_option=1)
    assert s.setup({"local_hostname": "127.0.0.1", "metadata_server": "P2PHANDSHAKE",
                    "global_segment_size": "32MB", "local_buffer_size": "1.5m",
                    "protocol": "tcp", "master_server_addr": master.rpc}) == 0
    assert s.put("dict-form", b"ok") == 0 and s.get("dict-form") == b"ok"
    assert s.close() == 0 and s.health_check() == 1
    # After close the segment is gone: a new client does not see the object.
    t = MooncakeDistributedStore()
    assert t.setup("127.0.0.1", "P2PHANDSHAKE", 0, 16 << 20, "tcp", "", master.rpc) == 0
    assert t.is_exist("dict-form") == 0 and t.get("dict-form") == b""
    t.close()


def test_host_mem_allocator():
    alloc = MooncakeHostMemAllocator()
    addr = alloc.alloc(4096)
    assert addr
    ctypes.memmove(addr, b"shared", 6)
    assert ctypes.string_at(addr, 6) == b"shared"
    assert alloc.free(addr) == 0 and alloc.free(addr) == -1


# ---------------------------------------------------------------- config


def test_sizes_and_env(tmp_path, monkeypatch):
    assert parse_size(123) == 123
    assert parse_size("4GB") == 4 << 30
    assert parse_size("512mb") == 512 << 20
    assert parse_size("1.5g") == int(1.5 * (1 << 30))
    assert parse_size("64K") == 64 << 10 and parse_size("2t") == 2 << 40
    for bad in ("10%", "abc", "", "-1", "1.2.3"):
        with pytest.raises(ValueError):
            parse_size(bad)
    monkeypatch.delenv("MOONCAKE_CONFIG_PATH", raising=False)
    monkeypatch.delenv("MOONCAKE_MASTER", raising=False)
    with pytest.raises(ValueError):
        MooncakeConfig.load_from_env()
    monkeypatch.setenv("MOONCAKE_MASTER", "10.0.0.1:50051")
    monkeypatch.setenv("MOONCAKE_GLOBAL_SEGMENT_SIZE", "2gb")
    cfg = MooncakeConfig.load_from_env()
    assert (cfg.master_server_address, cfg.metadata_server, cfg.protocol) == (
        "10.0.0.1:50051", "P2PHANDSHAKE", "tcp")
    assert cfg.global_segment_size == 2 << 30
    path = tmp_path / "mooncake.json"
    path.write_text(json.dumps({"local_hostname": "h", "metadata_server": "P2PHANDSHAKE",
                                "master_server_address": "m:1", "local_buffer_size": "1GB"}))
    monkeypatch.setenv("MOONCAKE_CONFIG_PATH", str(path))
    cfg = MooncakeConfig.load_from_env()
    assert cfg.local_hostname == "h" and cfg.local_buffer_size == 1 << 30


# ---------------------------------------------------------------- console scripts


def _ready_line(cmd, env=None):
    p = subprocess.Popen(cmd, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, env=env)
    try:
        return p, p.stdout.readline()
    except Exception:
        p.kill()
        raise


def test_console_scripts(mooncake_bin, free_port):
    env = dict(os.environ, MOONCAKE_BIN=mooncake_bin)
    code = "from mooncake.cli import master_main; master_main()"
    p, line = _ready_line([sys.executable, "-c", code, "--rpc_address=127.0.0.1", "--port=0",
                           "--http_metadata_server_port=0", "--metrics_port=off",
                           "--default_kv_lease_ttl=5000", "--until-stdin-eof"], env)
    try:
        assert line.startswith("ready rpc="), line
    finally:
        p.stdin.close()
        assert p.wait(15) == 0
    port = free_port()
    code = "from mooncake.cli import http_metadata_server_main as m; m()"
    p = subprocess.Popen([sys.executable, "-c", code, "--port", str(port), "--host", "127.0.0.1"],
                         stdout=subprocess.PIPE, text=True, env=env)
    try:
        line = p.stdout.readline()
        assert str(port) in line, line
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=10) as r:
            assert r.status == 200
    finally:
        p.terminate()
        p.wait(15)
