"""A process forked after it set up a store or an engine: the child inherits the
objects but none of their threads, and shares their connections with the parent. The
child's calls on them are refused at once with a clear code (not a hang, not bytes
read off the parent's connection), closing them there leaves the parent's segment and
connections alone, and a store the child sets up itself works. The parent goes on as
before. Upstream's wheel has no such guard: its child hangs or talks over the parent."""

import json
import os
import signal

import pytest

from fixtures_extra import *  # noqa: F401,F403

pytest.importorskip("mooncake.store")

UNAVAILABLE = -1010  # MC_ERR_UNAVAILABLE_IN_CURRENT_STATUS
SIZE = 4096
# The child is killed by SIGALRM if anything it does hangs.
CHILD_DEADLINE_S = 60


def in_child(body):
    """Runs body() in a forked child; returns what it returned (JSON), or fails the test
    with how the child ended."""
    read_end, write_end = os.pipe()
    pid = os.fork()
    if pid == 0:
        code = 1
        try:
            os.close(read_end)
            signal.alarm(CHILD_DEADLINE_S)
            answer = json.dumps(body()).encode()
            os.write(write_end, answer)
            code = 0
        finally:
            os._exit(code)
    os.close(write_end)
    with os.fdopen(read_end, "rb") as r:
        answer = r.read()
    _, status = os.waitpid(pid, 0)
    if os.WIFSIGNALED(status):
        pytest.fail("the child was ended by signal %d (SIGALRM: it hung)" % os.WTERMSIG(status))
    assert os.WEXITSTATUS(status) == 0, "the child raised"
    return json.loads(answer)


def test_a_forked_child_is_refused_the_parents_store_and_engine_and_leaves_them_be(
        master, engine_factory):
    from mooncake.engine import TransferEngine

    store = new_store(master, 16 * MiB, 4 * MiB)
    src = Buf(SIZE, content=pattern(SIZE, 11))
    dst = Buf(SIZE)
    assert store.register_buffer(dst.addr, dst.size) == 0
    kept = unique("forked")
    assert store.put(kept, src.raw) == 0
    assert store.get(kept) == src.raw

    engine, _ = engine_factory()
    target, target_name = engine_factory()
    peer = Buf(SIZE, content=pattern(SIZE, 12))
    assert target.register_memory(peer.addr, SIZE) == 0
    assert engine.register_memory(dst.addr, SIZE) == 0
    assert engine.transfer_sync_read(target_name, dst.addr, peer.addr, SIZE) == 0

    def child():
        mine = new_store(master, 16 * MiB, 4 * MiB)
        own_key = unique("child")
        got = {
            "get": store.get(kept) == b"",
            "get_into": store.get_into(kept, dst.addr, SIZE),
            "put": store.put(unique("refused"), b"x" * 10),
            "is_exist": store.is_exist(kept),
            "batch_get_into": store.batch_get_into([kept], [dst.addr], [SIZE]),
            "read": engine.transfer_sync_read(target_name, dst.addr, peer.addr, SIZE),
            "close": store.close(),
            "own_put": mine.put(own_key, b"y" * 100),
            "own_get": mine.get(own_key) == b"y" * 100,
            "own_close": mine.close(),
        }
        return got

    got = in_child(child)
    assert got == {
        "get": True,
        "get_into": UNAVAILABLE,
        "put": UNAVAILABLE,
        "is_exist": UNAVAILABLE,
        "batch_get_into": [UNAVAILABLE],
        "read": -1,
        "close": 0,
        "own_put": 0,
        "own_get": True,
        "own_close": 0,
    }

    # The parent's segment is still mounted and its connection still in step.
    dst.write(0, b"\0" * SIZE)
    assert store.get_into(kept, dst.addr, SIZE) == SIZE
    assert dst.raw == src.raw
    after = unique("after")
    assert store.put(after, b"z" * 50) == 0
    assert store.is_exist(after) == 1
    assert store.get(after) == b"z" * 50
    assert engine.transfer_sync_read(target_name, dst.addr, peer.addr, SIZE) == 0
    assert dst.raw == peer.raw
    assert isinstance(engine, TransferEngine)
    store.close()
