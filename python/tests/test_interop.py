"""Interop: our `mooncake.engine.TransferEngine` and the real Mooncake wheel's
(`mooncake-transfer-engine-non-cuda` 0.3.x) move bytes into each other's buffers over
P2PHANDSHAKE + tcp on 127.0.0.1 (the Python twin of tests/interop.rs).

The Mooncake side is peers/peer.py run by `$MC_INTEROP_PYTHON`, an interpreter (its own
venv) that imports the real wheel. Without it the tests skip, saying why, unless
`MC_INTEROP_REQUIRED=1`, which turns the skip into a failure.

Run: MC_INTEROP_PYTHON=/path/to/venv/bin/python python -m pytest python/tests/test_interop.py
"""

import os
import subprocess

import pytest

from fixtures_extra import *  # noqa: F401,F403

pytest.importorskip("mooncake.engine")
import mooncake  # noqa: E402
from mooncake.engine import TransferEngine  # noqa: E402

# Not a multiple of any slice size, and many slices long on both engines.
SIZE = (8 << 20) + 12345


def _skip_or_fail(reason):
    if os.environ.get("MC_INTEROP_REQUIRED") == "1":
        pytest.fail("MC_INTEROP_REQUIRED=1 but " + reason)
    pytest.skip("interop: " + reason)


@pytest.fixture(scope="module")
def mooncake_python():
    py = os.environ.get("MC_INTEROP_PYTHON")
    if not py:
        _skip_or_fail("MC_INTEROP_PYTHON is not set (an interpreter with mooncake-transfer-engine-non-cuda installed)")
    try:
        p = subprocess.run(
            [py, "-c", "import os, mooncake, mooncake.engine; print(os.path.realpath(mooncake.__file__))"],
            capture_output=True,
            text=True,
            timeout=60,
            stdin=subprocess.DEVNULL,
        )
    except (OSError, subprocess.TimeoutExpired) as e:
        _skip_or_fail("MC_INTEROP_PYTHON=%s cannot run: %s" % (py, e))
    if p.returncode != 0:
        last = (p.stderr.strip().splitlines() or ["no message"])[-1]
        _skip_or_fail("MC_INTEROP_PYTHON=%s cannot import mooncake.engine: %s" % (py, last))
    theirs = os.path.dirname(p.stdout.strip().splitlines()[-1])
    ours = os.path.dirname(os.path.realpath(mooncake.__file__))
    if theirs == ours:
        _skip_or_fail("MC_INTEROP_PYTHON=%s imports this package (%s), not Mooncake's wheel" % (py, ours))
    return py


def mooncake_peer(python):
    # Mooncake's non-CUDA build wants an explicit CPU location for registrations.
    return start_peer("peer.py", "engine", "cpu:0", python=python, what="Mooncake peer", ready_timeout=60)


def ours():
    e = TransferEngine()
    assert e.initialize("127.0.0.1", "P2PHANDSHAKE", "tcp", "") == 0
    return e, "127.0.0.1:%d" % e.get_rpc_port()


def test_our_engine_reads_and_writes_a_mooncake_segment(mooncake_python):
    peer, ready = mooncake_peer(mooncake_python)
    try:
        name = ready[0]
        assert name.startswith("127.0.0.1:"), ready
        remote = peer_buf(peer, SIZE, 1)
        e, _ = ours()
        assert e.get_first_buffer_address(name) == remote, "Mooncake's descriptor lists its buffer"
        local = Buf(SIZE)
        assert e.register_memory(local.addr, SIZE) == 0
        assert e.transfer_sync_read(name, local.addr, remote, SIZE) == 0
        assert local.raw == pattern(SIZE, 1), "bytes read from Mooncake"

        # two writes in one batch at odd offsets, the first spanning many slices
        regions = [(4099, 5_000_001, 90), (SIZE - 777, 777, 7)]
        src = Buf(sum(n for _, n, _ in regions))
        assert e.register_memory(src.addr, src.size) == 0
        locs, off = [], 0
        for _, n, seed in regions:
            src.write(off, pattern(n, seed))
            locs.append(src.addr + off)
            off += n
        rc = e.batch_transfer_sync_write(name, locs, [remote + o for o, _, _ in regions], [n for _, n, _ in regions])
        assert rc == 0
        want = bytearray(pattern(SIZE, 1))
        for o, n, seed in regions:
            want[o : o + n] = pattern(n, seed)
        assert peer_digest(peer, remote, SIZE) == digest(want), "Mooncake's buffer after our writes"
        # and read back through the engine, untouched bytes included
        assert e.transfer_sync_read(name, local.addr, remote, SIZE) == 0
        assert local.raw == bytes(want)
    finally:
        peer.kill()


def test_mooncake_reads_and_writes_our_segment(mooncake_python):
    e, session = ours()
    mine = Buf(SIZE, content=pattern(SIZE, 3))
    assert e.register_memory(mine.addr, SIZE) == 0
    peer, _ = mooncake_peer(mooncake_python)
    try:
        theirs = peer_buf(peer, SIZE, -1)
        assert peer_call(peer, "get_first_buffer_address", session) == mine.addr
        assert peer_call(peer, "transfer_sync_read", session, theirs, mine.addr, SIZE) == 0
        assert peer_digest(peer, theirs, SIZE) == digest(pattern(SIZE, 3)), "bytes Mooncake read from us"

        peer_fill(peer, theirs, SIZE, 201)
        assert peer_call(peer, "transfer_sync_write", session, theirs, mine.addr, SIZE) == 0
        assert mine.raw == pattern(SIZE, 201), "bytes Mooncake wrote into our buffer"

        # a batch of three runs, as vLLM pushes them
        rc = peer_call(
            peer,
            "batch_transfer_sync_write",
            session,
            [theirs, theirs + 100000, theirs + 3000000],
            [mine.addr + 11, mine.addr + 2000000, mine.addr + SIZE - 4096],
            [50000, 1_000_003, 4096],
        )
        assert rc == 0
        want = bytearray(pattern(SIZE, 201))
        src = pattern(SIZE, 201)
        want[11:50011] = src[0:50000]
        want[2000000:3000003] = src[100000:1100003]
        want[SIZE - 4096 :] = src[3000000:3004096]
        assert mine.raw == bytes(want)
    finally:
        peer.kill()


def test_our_engine_and_mooncakes_meet_through_etcd(mooncake_python, tmp_path):
    """Both engines publish to and look each other up in one etcd (Mooncake's keys and
    JSON), then move bytes both ways."""
    etcd, addr = start_etcd(tmp_path)
    try:
        metadata = "etcd://" + addr
        peer, ready = start_peer("peer.py", "engine", "cpu:0", python=mooncake_python, what="Mooncake peer",
                                 ready_timeout=60, env={"MC_PEER_METADATA": metadata})
        try:
            theirs_name = ready[0]
            remote = peer_buf(peer, SIZE, 5)
            e = TransferEngine()
            port = free_port()
            assert e.initialize("127.0.0.1:%d" % port, metadata, "tcp", "") == 0
            ours_name = "127.0.0.1:%d" % port
            assert e.get_first_buffer_address(theirs_name) == remote, "Mooncake's descriptor, read from etcd"
            local = Buf(SIZE)
            assert e.register_memory(local.addr, SIZE) == 0
            assert e.transfer_sync_read(theirs_name, local.addr, remote, SIZE) == 0
            assert local.raw == pattern(SIZE, 5), "bytes read from Mooncake"

            local.write(0, pattern(SIZE, 6))
            assert peer_call(peer, "get_first_buffer_address", ours_name) == local.addr, "ours, read by Mooncake"
            assert peer_call(peer, "transfer_sync_read", ours_name, remote, local.addr, SIZE) == 0
            assert peer_digest(peer, remote, SIZE) == digest(pattern(SIZE, 6)), "bytes Mooncake read from us"
        finally:
            peer.kill()
    finally:
        etcd.kill()
