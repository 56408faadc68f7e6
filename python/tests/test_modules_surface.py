"""The modules and names upstream's wheel ships besides engine and store: that each
imports without optional packages, and what each does (stores against a real master)."""

import asyncio
import ctypes
import importlib
import json
import os
import subprocess
import sys
import textwrap
import threading

import pytest

from fixtures_extra import wait_until

MiB = 1 << 20

# Every module of upstream's wheel that this package provides too.
UPSTREAM_MODULES = [
    "async_store", "buffer_pool", "_fast_copy", "cli", "cli_bench", "cli_client",
    "dataproto_catalog", "ep", "fabric_allocator_utils", "http_metadata_server",
    "mooncake_config", "mooncake_connector_v1", "mooncake_ep_buffer", "mooncake_ssd_register",
    "mooncake_ssd_unregister", "mooncake_store_service", "pg", "shared_segment",
    "spdk_tgt_create", "structured_object_store", "transfer_engine_topology_dump",
    "vllm_v1_proxy_server",
]
# Modules that must import with the standard library alone.
STDLIB_ONLY = ["async_store", "buffer_pool", "_fast_copy", "cli_bench", "cli_client",
               "dataproto_catalog", "fabric_allocator_utils", "mooncake_connector_v1",
               "mooncake_ssd_register", "mooncake_ssd_unregister", "mooncake_store_service",
               "spdk_tgt_create", "structured_object_store", "transfer_engine_topology_dump",
               "vllm_v1_proxy_server"]


def make_store(master, local_buffer=4 * MiB):
    from mooncake.store import MooncakeDistributedStore

    store = MooncakeDistributedStore()
    assert store.setup("127.0.0.1", "P2PHANDSHAKE", 16 * MiB, local_buffer, "tcp", "",
                       master.rpc) == 0
    return store


@pytest.fixture
def store(master_factory):
    s = make_store(master_factory())
    yield s
    s.close()


# ------------------------------------------------------------------ imports


@pytest.mark.parametrize("name", UPSTREAM_MODULES)
def test_upstream_module_imports(name):
    importlib.import_module(f"mooncake.{name}")


def test_new_modules_import_without_numpy_torch_or_web_frameworks():
    blocked = ["numpy", "torch", "aiohttp", "fastapi", "httpx", "uvicorn", "msgpack", "zmq",
               "vllm", "paramiko"]
    code = textwrap.dedent(f"""
        import importlib, sys
        class Block:
            def find_spec(self, name, path=None, target=None):
                if name.split(".")[0] in {blocked!r}:
                    raise ImportError("blocked " + name)
        sys.meta_path.insert(0, Block())
        for name in {STDLIB_ONLY!r}:
            importlib.import_module("mooncake." + name)
        from mooncake import BufferPool, RegisteredBufferPool
        assert BufferPool is RegisteredBufferPool
        print("ok")
    """)
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          timeout=120, env=dict(os.environ))
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "ok"


def test_wheel_declares_every_upstream_console_script():
    sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "_build_backend"))
    try:
        import mooncake_build
    finally:
        sys.path.pop(0)
    scripts = dict(line.split(" = ") for line in mooncake_build.ENTRY_POINTS.splitlines()[1:])
    for name in ("mooncake_master", "mooncake_http_metadata_server", "mooncake_client",
                 "mc_store_rest_server", "transfer_engine_bench",
                 "transfer_engine_topology_dump"):
        module, _, func = scripts[name].partition(":")
        assert callable(getattr(importlib.import_module(module), func)), name


def test_vllm_classes_need_vllm_and_say_so():
    pytest.importorskip("mooncake.mooncake_connector_v1")
    if importlib.util.find_spec("vllm") is not None:
        pytest.skip("vLLM is installed here")
    import mooncake.mooncake_connector_v1 as connector

    with pytest.raises(ImportError, match="needs vLLM"):
        connector.MooncakeConnector  # noqa: B018


# ------------------------------------------------------------------ engine surface


def test_engine_surface_has_upstream_names():
    import mooncake.engine as engine

    assert engine.TransferEngine.TransferOpcode is engine.TransferOpcode
    assert [m.name for m in engine.TransferOpcode] == ["Read", "Write"]
    for name in ("InnerTransferEngine", "SharedSegment", "RpcInterface", "CoroRPCInterface",
                 "ReceivedData", "ReceivedTensor", "create_rpc_client", "create_rpc_server",
                 "SUPPORT_CUDA", "SUPPORT_EFA", "SUPPORT_HIP", "SUPPORT_MNNVL",
                 "SUPPORT_MUSA", "SUPPORT_INTRA_NVLINK"):
        assert hasattr(engine, name), name


def test_engine_pointer_is_the_native_handle_and_efa_warmup_is_a_no_op_elsewhere():
    from mooncake.engine import TransferEngine

    e = TransferEngine()
    assert e.get_engine_ptr() == 0
    assert e.initialize("127.0.0.1", "P2PHANDSHAKE", "tcp", "") == 0
    try:
        ptr = e.get_engine_ptr()
        assert isinstance(ptr, int) and ptr != 0
        assert ptr == e._engine  # the mc_engine* the C ABI takes
        assert e.warmup_efa_segment("127.0.0.1:1") == 0  # tcp engine: nothing to warm
        with pytest.raises(TypeError):
            e.warmup_efa_segment(5)
    finally:
        e.close()
    assert e.get_engine_ptr() == 0


def test_rpc_interface_delivers_data_and_tensors():
    from mooncake.engine import RpcInterface, create_rpc_client

    server = RpcInterface()
    assert server.initialize("127.0.0.1:0")
    got_data, got_tensors = [], []
    server.set_data_receive_callback(got_data.append)
    server.set_tensor_receive_callback(got_tensors.append)
    assert server.start_server_async()
    client = create_rpc_client()
    try:
        target = f"127.0.0.1:{server.listen_port}"
        assert client.send_data(target, b"hello") == 0
        assert client.send_data(target, b"x" * (1 << 20)) == 0
        np = pytest.importorskip("numpy")
        assert client.send_tensor(target, np.arange(6, dtype=np.int32).reshape(2, 3)) == 0
        wait_until(lambda: len(got_data) == 2 and len(got_tensors) == 1, "three deliveries")
        assert got_data[0]["data"] == b"hello" and len(got_data[1]["data"]) == 1 << 20
        assert got_data[0]["source"].startswith("127.0.0.1:")
        tensor = got_tensors[0]
        assert tensor.shape == [2, 3] and tensor.dtype == "int32"
        assert tensor.get_data_as_bytes() == np.arange(6, dtype=np.int32).tobytes()
        assert tensor.total_bytes == tensor.get_data_size() == 24

        async def send_async():
            loop = asyncio.get_running_loop()
            return await client.send_data_async(target, b"async", loop)

        assert asyncio.run(send_async()) == 0
        wait_until(lambda: len(got_data) == 3, "the async delivery")
        assert client.send_data("127.0.0.1:1", b"nobody") == -1
        assert client.send_tensor(target, object()) == -1
    finally:
        client.close()
        server.close()


def test_shared_segment_pages_are_shared_between_processes():
    from mooncake.engine import SharedSegment

    assert SharedSegment.supported() and not SharedSegment.supported(mmap=False)
    owner, owner_blob = SharedSegment.create("kv", 10000, world_size=2, rank_id=0)
    try:
        assert owner.base_addr() and owner.size() == 10000
        ctypes.memmove(owner.base_addr(), b"from the owner", 14)
        code = textwrap.dedent("""
            import ctypes, sys
            from mooncake.engine import SharedSegment
            owner_blob = bytes.fromhex(sys.stdin.readline().strip())
            seg, blob = SharedSegment.create("kv", 10000, world_size=2, rank_id=1)
            seg.complete([owner_blob, blob])
            print(ctypes.string_at(seg.base_addr(), 14).decode(), flush=True)
            ctypes.memmove(seg.base_addr() + 100, b"from rank 1", 11)
            print(blob.hex(), flush=True)
        """)
        peer = subprocess.run([sys.executable, "-c", code], input=owner_blob.hex() + "\n",
                              capture_output=True, text=True, timeout=60)
        assert peer.returncode == 0, peer.stderr
        text, peer_blob = peer.stdout.splitlines()
        assert text == "from the owner"
        owner.complete([owner_blob, bytes.fromhex(peer_blob)])
        assert owner.ready()
        assert ctypes.string_at(owner.base_addr() + 100, 11) == b"from rank 1"
        with pytest.raises(RuntimeError, match="already"):
            owner.complete([owner_blob, bytes.fromhex(peer_blob)])
    finally:
        owner.close()
    with pytest.raises(RuntimeError, match="below world_size"):
        SharedSegment.create("kv", 1, world_size=2, rank_id=2)
    other, blob = SharedSegment.create("other", 10000, world_size=2, rank_id=1)
    try:
        with pytest.raises(RuntimeError, match="differs"):
            other.complete([owner_blob, blob])  # a blob of another segment
    finally:
        other.close()


def test_an_owner_exiting_with_its_segment_alive_leaves_no_shm_name():
    """An object still alive at interpreter exit may never see __del__ (here: a leaked
    reference makes sure of it): the name goes anyway."""
    code = textwrap.dedent("""
        import ctypes
        from mooncake.engine import SharedSegment
        seg, blob = SharedSegment.create("kept", 10000, world_size=2, rank_id=0)
        ctypes.pythonapi.Py_IncRef(ctypes.py_object(seg))
        print(seg._shm_name, flush=True)
    """)
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          timeout=60)
    assert done.returncode == 0, done.stderr
    shm_name = done.stdout.strip()
    assert shm_name.startswith("/mcss_")
    assert not os.path.exists("/dev/shm" + shm_name)


def test_a_forked_child_exiting_leaves_its_parents_shm_name():
    code = textwrap.dedent("""
        import os, sys
        from mooncake.engine import SharedSegment
        seg, blob = SharedSegment.create("forked", 10000, world_size=2, rank_id=0)
        path = "/dev/shm" + seg._shm_name
        child = os.fork()
        if child == 0:
            sys.exit(0)  # a normal exit: atexit hooks run in the child
        os.waitpid(child, 0)
        print("kept" if os.path.exists(path) else "removed")
        seg.close()
        print("closed" if not os.path.exists(path) else "left")
    """)
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          timeout=60)
    assert done.returncode == 0, done.stderr
    assert done.stdout.split() == ["kept", "closed"]


def test_import_mooncake_alone_reaches_store_and_engine():
    """Upstream's package imports its store on import; scripts then use mooncake.store
    without importing it. Here both load on first touch, not before."""
    code = textwrap.dedent("""
        import sys
        import mooncake
        assert "mooncake.store" not in sys.modules
        assert mooncake.store.ObjectDataType.KVCACHE == 1
        assert mooncake.engine.TransferEngine is sys.modules["mooncake.engine"].TransferEngine
        try:
            mooncake.no_such_module
        except AttributeError:
            print("ok")
    """)
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          timeout=60)
    assert done.returncode == 0 and done.stdout.split() == ["ok"], done.stderr


# ------------------------------------------------------------------ small modules


def test_fast_copy_concatenates_a_run_of_arrays():
    np = pytest.importorskip("numpy")
    from mooncake._fast_copy import concat_arrays_into

    arrays = [np.full(n, n, dtype=np.uint8) for n in (3, 5, 7, 11)]
    dest = ctypes.create_string_buffer(64)
    assert concat_arrays_into(arrays, ctypes.addressof(dest), 64, 1, 2) == 12
    assert dest.raw[:12] == bytes([5] * 5 + [7] * 7)
    assert concat_arrays_into(arrays, ctypes.addressof(dest), 64, 0, -1, 3) == 26
    assert dest.raw[:26] == b"".join(a.tobytes() for a in arrays)
    with pytest.raises(ValueError, match="too small"):
        concat_arrays_into(arrays, ctypes.addressof(dest), 10)
    with pytest.raises(ValueError, match="C-contiguous"):
        concat_arrays_into([np.arange(8, dtype=np.uint8)[::2]], ctypes.addressof(dest), 64)
    with pytest.raises(TypeError, match="not an ndarray"):
        concat_arrays_into([b"bytes"], ctypes.addressof(dest), 64)


def test_async_store_runs_store_calls_off_the_loop(master_factory):
    from mooncake.async_store import MooncakeDistributedStoreAsync

    s = MooncakeDistributedStoreAsync()
    assert s.setup("127.0.0.1", "P2PHANDSHAKE", 16 * MiB, 4 * MiB, "tcp", "",
                   master_factory().rpc) == 0
    try:
        async def roundtrip():
            assert await s.async_put("async-key", b"value") == 0
            return await s.async_get("async-key"), await s.async_is_exist("missing-key")

        assert asyncio.run(roundtrip()) == (b"value", 0)
        with pytest.raises(AttributeError):
            s.async_no_such_method  # noqa: B018
        with pytest.raises(AttributeError):
            s.unknown_name  # noqa: B018
    finally:
        s.close()


def test_transfer_engine_bench_flags_become_mooncake_commands():
    from mooncake import cli_bench

    values, given = cli_bench.parse_flags(["--mode=target", "-buffer_size", "1048576",
                                           "--metadata_server=P2PHANDSHAKE",
                                           "--local_server_name=127.0.0.1:7000",
                                           "--noauto_discovery"])
    assert given == ["mode", "buffer_size", "metadata_server", "local_server_name",
                     "auto_discovery"]
    assert cli_bench.command_for(values) == [
        "target", "--size", "1048576", "--metadata", "P2PHANDSHAKE", "--protocol", "tcp",
        "--name", "127.0.0.1:7000"]
    values, _ = cli_bench.parse_flags(["--segment_id", "10.0.0.2:7000", "--operation=write",
                                       "--metadata_server", "10.0.0.1:2379", "--threads=2"])
    cmd = cli_bench.command_for(values)
    assert cmd[:2] == ["bench", "transfer"]
    assert cmd[cmd.index("--op") + 1] == "write"
    assert cmd[cmd.index("--metadata") + 1] == "etcd://10.0.0.1:2379"
    assert cmd[cmd.index("--segment") + 1] == "10.0.0.2:7000"
    for bad in (["--mode=initiator"], ["--bogus=1"], ["--threads=many"], ["--operation=copy",
                                                                          "--segment_id=x"]):
        with pytest.raises(cli_bench.FlagError):
            cli_bench.command_for(cli_bench.parse_flags(bad)[0])
    assert cli_bench.main(["--mode=sideways"]) == 2


def test_topology_dump_discovers_or_prints_a_custom_matrix(tmp_path, capsys):
    from mooncake import transfer_engine_topology_dump as dump

    assert dump.main(["--backend", "te"]) == 0
    line = capsys.readouterr().out.strip()
    assert line.startswith("Local topology [te/discover]: ")
    assert isinstance(json.loads(line.split(": ", 1)[1]), dict)
    custom = tmp_path / "topo.json"
    custom.write_text(json.dumps({"cpu:0": [["mlx5_0"], ["mlx5_1"]]}))
    assert dump.main(["--custom-topo-json", str(custom)]) == 0
    out = capsys.readouterr().out
    assert json.loads(out.split(": ", 1)[1]) == {"cpu:0": [["mlx5_0"], ["mlx5_1"]]}
    custom.write_text("[1, 2]")
    assert dump.main(["--custom-topo-json", str(custom)]) == 1
    assert "failed to dump topology" in capsys.readouterr().err


def test_topology_dump_handles_tent_configuration_overrides(tmp_path, capsys, monkeypatch):
    """Under TENT, a topology override inside MC_TENT_CONF is the custom topology for
    --use-custom-topo and is hidden from discovery (the engine sees a stripped copy,
    removed afterwards). A fake tent module records the configuration it was given."""
    import types

    from mooncake import transfer_engine_topology_dump as dump

    seen = []

    class FakeTent:
        def available(self):
            return True

        def get_local_topology(self):
            conf = os.environ["MC_TENT_CONF"]
            with open(conf) as f:
                seen.append((conf, json.load(f)))
            return "{}"

    monkeypatch.setitem(sys.modules, "tent", types.SimpleNamespace(TransferEngine=FakeTent))
    for name in ("MC_CUSTOM_TOPO_JSON", "MC_USE_TENT", "MC_USE_TEV1"):
        monkeypatch.setenv(name, "")  # recorded, so teardown restores what was there
        monkeypatch.delenv(name)
    conf = tmp_path / "tent.json"
    conf.write_text(json.dumps({"log": 1, "topology": {"priority_matrix": {"a": 1}, "keep": 2}}))
    monkeypatch.setenv("MC_TENT_CONF", str(conf))

    assert dump.main(["--backend", "tent"]) == 0
    assert capsys.readouterr().out.startswith("Local topology [tent/discover]: ")
    (scratch, given), = seen
    assert given == {"log": 1, "topology": {"keep": 2}} and not os.path.exists(scratch)
    assert os.environ["MC_USE_TENT"] == "1"

    monkeypatch.setenv("MC_TENT_CONF", str(conf))
    assert dump.main(["--backend", "tent", "--use-custom-topo"]) == 0
    assert "[tent/custom (MC_TENT_CONF topology)]" in capsys.readouterr().out
    assert seen[-1] == (str(conf), json.loads(conf.read_text()))  # the original, unchanged

    monkeypatch.setenv("MC_TENT_CONF", json.dumps({"topology": {}}))  # inline, no override
    assert dump.sanitize_tent_conf_for_discover() is None
    assert dump.main(["--backend", "tent", "--use-custom-topo"]) == 1
    assert "requires MC_CUSTOM_TOPO_JSON" in capsys.readouterr().err
    dump.apply_backend("te")
    assert "MC_USE_TENT" not in os.environ


def test_ssd_tools_parse_targets_and_report_missing_nof_support(caplog):
    from mooncake import _spdk_nof as nof
    from mooncake.mooncake_ssd_unregister import MooncakeNoFUnregister

    assert nof.parse_target_info("ip:10.0.0.5 path:/opt/spdk ns:2") == {
        "ip": "10.0.0.5", "path": "/opt/spdk", "ns": "2"}
    tool = MooncakeNoFUnregister(
        {"master_server_address": "127.0.0.1:1", "trsvcid": "4421"},
        ["ip:10.0.0.5 ns:2", "ip:10.0.0.5 ns:2", "ip:10.0.0.6 ns:3 nqn:nqn.x"])
    assert [(c["traddr"], c["nsid"], c["nqn"], c["trsvcid"]) for c in tool.config_list] == [
        ("10.0.0.5", 2, "nqn.2016-06.io.spdk:cnode1", 4421), ("10.0.0.6", 3, "nqn.x", 4421)]
    with caplog.at_level("ERROR", logger="mooncake"):
        assert tool.start_ssd_unregister_service() is False
    assert "not supported by this build" in caplog.text
    with pytest.raises(ValueError, match="ip"):
        MooncakeNoFUnregister({"master_server_address": "h:1"}, ["path:/x"])


def test_connector_helpers_without_vllm():
    from mooncake import mooncake_connector_v1 as c

    assert c.group_concurrent_contiguous([1, 2, 3, 7, 8], [5, 6, 9, 10, 11]) == (
        [[1, 2], [3], [7, 8]], [[5, 6], [9], [10, 11]])
    assert c.group_concurrent_contiguous([], []) == ([], [])
    with pytest.raises(ValueError):
        c.group_concurrent_contiguous([1], [])
    meta = c.MooncakeAgentMetadata("10.0.0.2", 17000, ["r1"], [4096, 8192], [[3, 4]])
    assert c.MooncakeAgentMetadata.decode(meta.encode()) == meta
    for bad in (b"not json", b'{"remote_hostname": 1}',
                json.dumps({"remote_hostname": "h", "remote_port": "x", "request_ids": [],
                            "kv_caches_base_addr": [], "block_ids": []}).encode()):
        with pytest.raises(ValueError, match="malformed"):
            c.MooncakeAgentMetadata.decode(bad)

    class Parallel:
        data_parallel_rank, tensor_parallel_size = 2, 4

    class Config:
        parallel_config = Parallel()

    assert c.get_mooncake_side_channel_port(Config()) == c.VLLM_MOONCAKE_SIDE_CHANNEL_PORT + 8


# ------------------------------------------------------------------ buffer pool


def test_buffer_pool_leases_registered_memory_for_zero_copy(store):
    from mooncake.buffer_pool import BufferPool

    pool = BufferPool(store, min_size_class=4096, alignment=4096)
    with pool.acquire(5000) as lease:
        lease.buffer[:5] = b"pool!"
        assert store.put_from("pooled", lease.ptr, 5) == 0
    with pool.acquire(5) as lease:
        assert store.get_into("pooled", lease.ptr, 5) == 5
        assert bytes(lease.buffer) == b"pool!"
    pool.close()


def test_buffer_pool_overflows_waits_and_refuses_clearly(store):
    from mooncake.buffer_pool import BufferPool

    with pytest.raises(RuntimeError, match="alignment"):
        BufferPool(store, alignment=3000)
    pool = BufferPool(store, max_regions=2, block_on_exhaustion=False)
    whole = pool.acquire(4 * MiB)  # the whole local region
    overflow = pool.acquire(100)  # a separately registered buffer
    assert store.put_from("overflow", overflow.ptr, 100) == 0
    with pytest.raises(RuntimeError, match="exhausted"):
        pool.acquire(1)
    got = []
    waiter = threading.Thread(target=lambda: got.append(pool.acquire(1, block=True, timeout=30)))
    waiter.start()
    overflow.release()
    waiter.join(timeout=30)
    assert not waiter.is_alive() and got[0].size == 1
    with pytest.raises(RuntimeError, match="timed out"):
        pool.acquire(1, block=True, timeout=0.05)
    view = got[0].buffer
    with pytest.raises(RuntimeError, match="exported views"):
        got[0].release()
    del view
    got[0].release()
    with pytest.raises(RuntimeError, match="active leases"):
        pool.close()
    whole.release()
    with pytest.raises(RuntimeError, match="capacity"):
        pool.acquire(1 << 40)
    pool.close()
    with pytest.raises(RuntimeError, match="closed"):
        pool.acquire(1)


def test_buffer_pool_needs_a_set_up_store():
    from mooncake.buffer_pool import BufferPool
    from mooncake.store import MooncakeDistributedStore

    with pytest.raises(RuntimeError, match="not initialized"):
        BufferPool(MooncakeDistributedStore())
