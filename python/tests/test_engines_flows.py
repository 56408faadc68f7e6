"""The call sequences of the three inference engines (docs/python.md, "How the engines
call it"), each across two processes: this test is one side, peers/peer.py (a child
started with sys.executable, spoken to by stdout/stdin lines) the other. Ports come from
the OS, everything stays on 127.0.0.1, bytes are checked end to end by SHA-256."""

import json
import os
import uuid

import pytest

from fixtures_extra import *  # noqa: F401,F403

pytest.importorskip("mooncake.store")
from mooncake.engine import TransferEngine  # noqa: E402
from mooncake.mooncake_config import MooncakeConfig  # noqa: E402
from mooncake.store import MooncakeDistributedStore, ReplicateConfig  # noqa: E402

NO_AVAILABLE_HANDLE = -200


def coalesce(src_blocks, dst_blocks):
    """vLLM's grouping of block ids into runs contiguous on both sides: [(src, dst, n)]."""
    runs = []
    for s, d in zip(src_blocks, dst_blocks):
        if runs and runs[-1][0] + runs[-1][2] == s and runs[-1][1] + runs[-1][2] == d:
            runs[-1][2] += 1
        else:
            runs.append([s, d, 1])
    return [tuple(r) for r in runs]


# ---------------------------------------------------------------- vLLM MooncakeConnector (P/D)


def test_vllm_pd_push_of_coalesced_block_runs():
    layers, blocks, bs = 3, 16, 16 * KiB
    size = blocks * bs
    decode, ready = start_peer("peer.py", "engine", what="decode peer")
    try:
        peer_session = ready[0]
        assert peer_session.startswith("127.0.0.1:")
        dst_kv = [int(x) for x in decode.ask("bufs %d %d %d" % (layers, size, -1000)).split()[1:]]
        assert len(dst_kv) == layers

        # prefill side, exactly as vLLM's connector does it
        engine = TransferEngine()
        assert engine.initialize("127.0.0.1", "P2PHANDSHAKE", "tcp", "") == 0
        session = "127.0.0.1:%d" % engine.get_rpc_port()
        assert session != peer_session
        kv = [Buf(size, content=pattern(size, 500 + l)) for l in range(layers)]
        assert engine.batch_register_memory([b.addr for b in kv], [size] * layers) == 0

        src_blocks = [1, 2, 3, 7, 8, 12, 13, 14, 0]
        dst_blocks = [4, 5, 6, 0, 1, 9, 10, 11, 15]
        runs = coalesce(src_blocks, dst_blocks)
        assert len(runs) == 4
        src_ptrs, dst_ptrs, lengths = [], [], []
        for l in range(layers):
            for s, d, n in runs:
                src_ptrs.append(kv[l].addr + s * bs)
                dst_ptrs.append(dst_kv[l] + d * bs)
                lengths.append(n * bs)
        assert engine.batch_transfer_sync_write(peer_session, src_ptrs, dst_ptrs, lengths) == 0

        for l in range(layers):
            want = bytearray(size)
            src = pattern(size, 500 + l)
            for s, d in zip(src_blocks, dst_blocks):
                want[d * bs : (d + 1) * bs] = src[s * bs : (s + 1) * bs]
            assert peer_digest(decode, dst_kv[l], size) == digest(want), "layer %d at the decode side" % l

        # the decode side's blocks read back (a pull) match too
        back = Buf(len(src_blocks) * bs)
        assert engine.register_memory(back.addr, back.size) == 0
        assert (
            engine.batch_transfer_sync_read(
                peer_session,
                [back.addr + i * bs for i in range(len(dst_blocks))],
                [dst_kv[2] + d * bs for d in dst_blocks],
                [bs] * len(dst_blocks),
            )
            == 0
        )
        src = pattern(size, 502)
        assert back.raw == b"".join(src[s * bs : (s + 1) * bs] for s in src_blocks)

        # SGLang PD: send_probe says whether the peer is there
        assert engine.send_probe(peer_session) == 0
        decode.close()
        wait_until(lambda: engine.send_probe(peer_session) != 0, "send_probe to fail once the peer exited")
        assert engine.batch_transfer_sync_write(peer_session, src_ptrs[:1], dst_ptrs[:1], lengths[:1]) < 0
    finally:
        decode.kill()


def test_pd_push_from_a_child_into_this_process():
    """The other direction: the child pushes into buffers registered here."""
    bs = 8 * KiB
    engine = TransferEngine()
    assert engine.initialize("127.0.0.1", "P2PHANDSHAKE", "tcp", "") == 0
    session = "127.0.0.1:%d" % engine.get_rpc_port()
    dst = Buf(8 * bs)
    assert engine.batch_register_memory([dst.addr], [dst.size]) == 0
    prefill, _ = start_peer("peer.py", "engine", what="prefill peer")
    try:
        src = int(prefill.ask("bufs 1 %d 77" % (8 * bs)).split()[1])
        runs = coalesce([0, 1, 2, 5], [3, 4, 5, 0])
        res = peer_call(
            prefill,
            "batch_transfer_sync_write",
            session,
            [src + s * bs for s, d, n in runs],
            [dst.addr + d * bs for s, d, n in runs],
            [n * bs for s, d, n in runs],
        )
        assert res == 0
        data = pattern(8 * bs, 77)
        want = bytearray(8 * bs)
        for s, d in zip([0, 1, 2, 5], [3, 4, 5, 0]):
            want[d * bs : (d + 1) * bs] = data[s * bs : (s + 1) * bs]
        assert dst.raw == bytes(want)
    finally:
        prefill.kill()


# ---------------------------------------------------------------- vLLM MooncakeStoreConnector


def _vllm_config(tmp_path, name, master, segment="4MB", local_buffer="8MB"):
    path = tmp_path / name
    path.write_text(
        json.dumps(
            {
                "local_hostname": "127.0.0.1",
                "metadata_server": master.metadata,
                "global_segment_size": segment,
                "local_buffer_size": local_buffer,
                "protocol": "tcp",
                "device_name": "",
                "master_server_address": master.rpc,
            }
        )
    )
    return str(path)


def test_vllm_store_connector_save_load_and_back_pressure(private_master, tmp_path):
    layers, blocks, bs = 2, 64, 32 * KiB
    size = blocks * bs
    obj = layers * bs
    conf = _vllm_config(tmp_path, "vllm.json", private_master)
    other, ready = start_peer("peer.py", "store", conf, "file", what="second vLLM instance")
    store = MooncakeDistributedStore()
    try:
        c = MooncakeConfig.from_file(conf)
        assert (c.global_segment_size, c.local_buffer_size) == (4 * MiB, 8 * MiB)
        rc = store.setup(
            c.local_hostname,
            c.metadata_server,
            c.global_segment_size,
            c.local_buffer_size,
            c.protocol,
            c.device_name,
            c.master_server_address,
        )
        assert rc == 0
        assert store.get_hostname() != ready[0]
        kv = [Buf(size, content=pattern(size, 600 + l)) for l in range(layers)]
        for b in kv:
            assert store.register_buffer(b.addr, size) == 0
        src = [pattern(size, 600 + l) for l in range(layers)]

        def block_bytes(b):
            return b"".join(src[l][b * bs : (b + 1) * bs] for l in range(layers))

        def keys_for(round_, blks):
            return ["vllm@model/%s/r%d/b%d" % (os.getpid(), round_, b) for b in blks]

        def save(keys, blks):
            exist = store.batch_is_exist(keys)
            missing = [(k, b) for k, b, e in zip(keys, blks, exist) if e != 1]
            res = store.batch_put_from_multi_buffers(
                [k for k, _ in missing],
                [[kv[l].addr + b * bs for l in range(layers)] for _, b in missing],
                [[bs] * layers for _ in missing],
                ReplicateConfig(),
            )
            assert len(res) == len(missing)
            return exist, res

        # first save: nothing stored yet, everything put
        blks0 = list(range(0, 16))
        keys0 = keys_for(0, blks0)
        exist, res = save(keys0, blks0)
        assert exist == [0] * 16 and res == [0] * 16
        # a second save of the same blocks skips them all
        exist, res = save(keys0, blks0)
        assert exist == [1] * 16 and res == []

        # the other instance loads them into other block slots, byte for byte
        dst_kv = [peer_buf(other, size) for _ in range(layers)]
        dst_blocks = [63 - b for b in blks0]
        missing_key = keys_for(99, [0])[0]
        res = peer_call(
            other,
            "batch_get_into_multi_buffers",
            keys0 + [missing_key],
            [[dst_kv[l] + d * bs for l in range(layers)] for d in dst_blocks + [40]],
            [[bs] * layers for _ in range(17)],
        )
        assert res[:16] == [obj] * 16 and res[16] < 0, res
        for l in range(layers):
            want = bytearray(size)
            for b, d in zip(blks0, dst_blocks):
                want[d * bs : (d + 1) * bs] = src[l][b * bs : (b + 1) * bs]
            assert peer_digest(other, dst_kv[l], size) == digest(want), "layer %d loaded by the other instance" % l

        # this instance loads them back too (into a scratch region of its own)
        scratch = Buf(16 * obj, fill=b"\x99")
        assert store.register_buffer(scratch.addr, scratch.size) == 0
        res = store.batch_get_into_multi_buffers(
            keys0,
            [[scratch.addr + i * obj + l * bs for l in range(layers)] for i in range(16)],
            [[bs] * layers for _ in range(16)],
        )
        assert res == [obj] * 16
        assert scratch.raw == b"".join(block_bytes(b) for b in blks0)

        # keep saving (and loading: loads hold leases) until the pool pushes back
        codes = []
        for r in range(1, 12):  # 8 MiB of pool; 11 rounds offer 11 MiB
            blks = [(r * 16 + i) % blocks for i in range(16)]
            keys = keys_for(r, blks)
            _, res = save(keys, blks)
            codes += res
            if NO_AVAILABLE_HANDLE in res:
                break
            got = store.batch_get_into_multi_buffers(
                keys,
                [[scratch.addr + i * obj + l * bs for l in range(layers)] for i in range(16)],
                [[bs] * layers for _ in range(16)],
            )
            assert got == [obj] * 16
            assert scratch.raw == b"".join(block_bytes(b) for b in blks)
        assert NO_AVAILABLE_HANDLE in codes, "the pool never answered -200: %r" % codes
        assert set(codes) <= {0, NO_AVAILABLE_HANDLE}, codes
    finally:
        store.close()
        other.kill()


# ---------------------------------------------------------------- SGLang HiCache


def test_sglang_hicache(mooncake_bin, tmp_path):
    page = 4 * KiB
    pages = 256
    rank = 0
    with start_master(mooncake_bin, "--default_kv_lease_ttl=500") as m:
        dict_conf = tmp_path / "sglang.json"
        dict_conf.write_text(
            json.dumps(
                {
                    "local_hostname": "127.0.0.1",
                    "metadata_server": "P2PHANDSHAKE",
                    "global_segment_size": "8MB",
                    "local_buffer_size": "4mb",
                    "protocol": "tcp",
                    "rdma_devices": "",
                    "master_server_addr": m.rpc,
                }
            )
        )
        other, ready = start_peer("peer.py", "store", str(dict_conf), "dict", what="second SGLang rank")
        store = MooncakeDistributedStore()
        try:
            assert store.setup("127.0.0.1", "P2PHANDSHAKE", 8 * MiB, 16 * MiB, "tcp", "", m.rpc) == 0

            # warm-up
            warm_key = str(uuid.uuid4())
            warm = os.urandom(4096)
            assert store.put(warm_key, warm) == 0
            assert store.is_exist(warm_key) == 1
            assert store.get(warm_key) == warm
            assert peer_call(other, "is_exist", warm_key) == 1
            assert peer_call(other, "get", warm_key) == {"sha256": digest(warm), "len": 4096}

            # host KV pool: k pages then v pages, registered once
            pool = Buf(2 * pages * page, content=pattern(2 * pages * page, 700))
            assert store.register_buffer(pool.addr, pool.size) == 0
            data = pattern(2 * pages * page, 700)
            hashes = ["%016x" % (0xABC000 + i) for i in range(pages)]

            def kaddr(i):
                return pool.addr + i * page

            def vaddr(i):
                return pool.addr + (pages + i) * page

            total_objects = 1
            for start in (0, 128):  # at most 128 pages per call
                idx = list(range(start, start + 128))
                keys, ptrs = [], []
                for i in idx:
                    keys += ["%s_%d_k" % (hashes[i], rank), "%s_%d_v" % (hashes[i], rank)]
                    ptrs += [kaddr(i), vaddr(i)]
                exist = store.batch_is_exist(keys)
                assert exist == [0] * len(keys)
                cfg = ReplicateConfig()
                cfg.group_ids = ["req-%s" % uuid.uuid4()] * len(keys)  # one per key
                res = store.batch_put_from(keys, ptrs, [page] * len(keys), cfg)
                assert res == [0] * len(keys)
                total_objects += len(keys)
                assert store.batch_is_exist(keys) == [1] * len(keys)

            # MLA-style keys, one buffer per page through the multi-buffer form
            mla = ["%s__k" % hashes[i] for i in range(8)]
            res = store.batch_put_from_multi_buffers(mla, [[kaddr(i)] for i in range(8)], [[page] for _ in range(8)])
            assert res == [0] * 8
            total_objects += 8

            # the other rank reads 128 pages into its own registered pool
            other_pool = peer_buf(other, 2 * 128 * page)
            keys, ptrs = [], []
            for j, i in enumerate(range(64, 192)):
                keys += ["%s_%d_k" % (hashes[i], rank), "%s_%d_v" % (hashes[i], rank)]
                ptrs += [other_pool + (2 * j) * page, other_pool + (2 * j + 1) * page]
            res = peer_call(other, "batch_get_into", keys, ptrs, [page] * len(keys))
            assert len(res) == len(keys) and all(r > 0 for r in res), res
            want = b"".join(
                data[i * page : (i + 1) * page] + data[(pages + i) * page : (pages + i + 1) * page] for i in range(64, 192)
            )
            assert peer_digest(other, other_pool, len(want)) == digest(want)

            # and this rank reads pages back with the multi-buffer form (k and v per page)
            back = Buf(2 * 32 * page)
            assert store.register_buffer(back.addr, back.size) == 0
            res = store.batch_get_into_multi_buffers(
                ["%s_%d_k" % (hashes[i], rank) for i in range(32)],
                [[back.addr + i * page] for i in range(32)],
                [[page] for _ in range(32)],
            )
            assert all(r > 0 for r in res) and len(res) == 32
            assert back.read(0, 32 * page) == data[: 32 * page]
            res = store.batch_get_into(
                ["%s__k" % hashes[i] for i in range(8)], [back.addr + i * page for i in range(8)], [page] * 8
            )
            assert res == [page] * 8

            # clear: remove_all skips leased objects, so repeat until the 500 ms leases end
            removed = []

            def clear():
                removed.append(store.remove_all())
                assert removed[-1] >= 0, removed
                return sum(removed) >= total_objects

            wait_until(clear, "remove_all() to remove every object", timeout=15, interval=0.1)
            assert sum(removed) == total_objects, removed
            assert store.is_exist(warm_key) == 0
            assert peer_call(other, "is_exist", "%s_%d_k" % (hashes[0], rank)) == 0
            assert store.get("%s_%d_v" % (hashes[5], rank)) == b""
        finally:
            store.close()
            other.kill()
