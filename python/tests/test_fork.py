"""A process forked after it set up a store, an engine or an RPC interface: the child
inherits the objects but none of their threads, and shares their connections with the
parent. The child's calls on them are refused at once with a clear code (not a hang, not
bytes read off the parent's connection), closing them there leaves the parent's segment,
sockets and connections alone, and what the child sets up itself works. The parent goes
on as before. Upstream's wheel has no such guard: its child hangs or talks over the
parent."""

import json
import os
import select
import signal
import time
import traceback

import pytest

from fixtures_extra import *  # noqa: F401,F403

pytest.importorskip("mooncake.store")

UNAVAILABLE = -1010  # MC_ERR_UNAVAILABLE_IN_CURRENT_STATUS
SIZE = 4096
# What the child may take in all; past it, the parent kills it and the test fails.
CHILD_DEADLINE_S = 60.0


def in_child(body):
    """Runs body() in a forked child; returns what it returned (JSON), or fails the test
    with how the child ended (its traceback, or that it hung). The child never
    outlives the call."""
    read_end, write_end = os.pipe()
    pid = os.fork()
    if pid == 0:
        code, answer = 1, json.dumps({"raised": "no answer"})
        try:
            os.close(read_end)
            # The default action ends a child stuck in a lock or a futex, whatever
            # handler the test runner installed.
            signal.signal(signal.SIGALRM, signal.SIG_DFL)
            signal.alarm(int(CHILD_DEADLINE_S))
            answer = json.dumps({"ok": body()})
            code = 0
        except BaseException:  # noqa: BLE001 - reported to the parent
            answer = json.dumps({"raised": traceback.format_exc()})
        finally:
            try:
                os.write(write_end, answer.encode())
            finally:
                os._exit(code)
    os.close(write_end)
    reaped = False
    try:
        chunks = []
        deadline = time.monotonic() + CHILD_DEADLINE_S + 10
        with os.fdopen(read_end, "rb") as r:
            while True:
                left = deadline - time.monotonic()
                if left <= 0 or not select.select([r], [], [], left)[0]:
                    pytest.fail("the child hung")
                chunk = os.read(r.fileno(), 1 << 16)
                if not chunk:
                    break
                chunks.append(chunk)
        _, status = os.waitpid(pid, 0)
        reaped = True
    finally:
        if not reaped:
            os.kill(pid, signal.SIGKILL)
            os.waitpid(pid, 0)
    if os.WIFSIGNALED(status):
        pytest.fail("the child was ended by signal %d (SIGALRM: it hung)" % os.WTERMSIG(status))
    answer = json.loads(b"".join(chunks))
    assert "raised" not in answer, answer.get("raised")
    return answer["ok"]


def test_a_forked_child_is_refused_the_parents_store_and_engine_and_leaves_them_be(
        master, engine_factory, store_factory):
    store = store_factory(master, 16 * MiB, 4 * MiB)
    src = Buf(2 * SIZE, content=pattern(2 * SIZE, 11))
    dst = Buf(2 * SIZE)
    assert store.register_buffer(dst.addr, dst.size) == 0
    kept = [unique("forked") for _ in range(2)]
    assert store.put(kept[0], src.read(0, SIZE)) == 0
    assert store.put(kept[1], src.read(SIZE, SIZE)) == 0

    engine, _ = engine_factory()
    target, target_name = engine_factory()
    peer = Buf(SIZE, content=pattern(SIZE, 12))
    assert target.register_memory(peer.addr, SIZE) == 0
    assert engine.register_memory(dst.addr, SIZE) == 0
    assert engine.transfer_sync_read(target_name, dst.addr, peer.addr, SIZE) == 0

    def child():
        mine = store_factory(master, 16 * MiB, 4 * MiB)
        own_key = unique("child")
        return {
            "get": store.get(kept[0]) == b"",
            "get_into": store.get_into(kept[0], dst.addr, SIZE),
            "put": store.put(unique("refused"), b"x" * 10),
            "is_exist": store.is_exist(kept[0]),
            # Two keys: the batch goes to the CPython-convention call first.
            "batch_get_into": store.batch_get_into(kept, [dst.addr, dst.addr + SIZE],
                                                   [SIZE, SIZE]),
            "read": engine.transfer_sync_read(target_name, dst.addr, peer.addr, SIZE),
            "close": store.close(),
            "own_put": mine.put(own_key, b"y" * 100),
            "own_get": mine.get(own_key) == b"y" * 100,
            "own_close": mine.close(),
        }

    assert in_child(child) == {
        "get": True,
        "get_into": UNAVAILABLE,
        "put": UNAVAILABLE,
        "is_exist": UNAVAILABLE,
        "batch_get_into": [UNAVAILABLE, UNAVAILABLE],
        "read": -1,
        "close": 0,
        "own_put": 0,
        "own_get": True,
        "own_close": 0,
    }

    # The parent's segment is still mounted and its connection still in step.
    dst.write(0, b"\0" * dst.size)
    assert store.batch_get_into(kept, [dst.addr, dst.addr + SIZE], [SIZE, SIZE]) == [SIZE] * 2
    assert dst.raw == src.raw
    after = unique("after")
    assert store.put(after, b"z" * 50) == 0
    assert store.is_exist(after) == 1
    assert store.get(after) == b"z" * 50
    assert engine.transfer_sync_read(target_name, dst.addr, peer.addr, SIZE) == 0
    assert dst.read(0, SIZE) == peer.raw


def test_a_forked_child_closing_an_rpc_interface_leaves_the_parents_server_up():
    from mooncake.engine import RpcInterface

    server, client, fresh = RpcInterface(), RpcInterface(), RpcInterface()
    try:
        assert server.initialize("127.0.0.1:0")
        assert client.initialize()
        got = []
        server.set_data_receive_callback(got.append)
        assert server.start_server_async()
        target = f"127.0.0.1:{server.listen_port}"
        assert client.send_data(target, b"before") == 0  # a cached connection now

        def child():
            # Its own connection, not the parent's cached one; then both objects go.
            sent = client.send_data(target, b"from the child")
            client.close()
            server.close()
            return sent

        assert in_child(child) == 0
        assert client.send_data(target, b"after") == 0
        # A new connection: the parent's server still accepts.
        assert fresh.initialize()
        assert fresh.send_data(target, b"fresh") == 0
        wait_until(lambda: len(got) == 4, "four deliveries")
        assert sorted(d["data"] for d in got) == [
            b"after", b"before", b"fresh", b"from the child"]
    finally:
        fresh.close()
        client.close()
        server.close()


def test_a_forked_childs_dummy_client_is_refused_and_leaves_the_session_be(served, dummies):
    import ctypes

    d = dummies(served.address)
    key = unique("dummy-forked")
    assert d.put(key, b"d" * 100) == 0
    staging = d._link.local
    before = ctypes.string_at(staging.base, 4096)

    def child():
        return {"put": d.put(unique("refused"), b"x" * 4096),
                "put_batch": d.put_batch([unique("refused"), unique("refused")],
                                         [b"y" * 10, b"z" * 10]),
                "get": d.get(key) == b"", "close": d.close()}

    assert in_child(child) == {"put": UNAVAILABLE, "put_batch": UNAVAILABLE,
                               "get": True, "close": 0}
    # The staging buffer is shared with the real client: the child wrote nothing there.
    assert ctypes.string_at(staging.base, 4096) == before
    assert d.get(key) == b"d" * 100
    assert d.put(unique("after"), b"a" * 10) == 0


def test_a_forked_child_finds_the_process_groups_queue_closed_and_empty():
    """A queue whose thread is busy at the fork: in the child nothing of it will ever
    run, so closing it (as destroy_process_group and the exit handler do) must return,
    and new work is refused naming the fork."""
    import threading

    from mooncake import pg

    queue = pg._AsyncQueue()
    running, release = threading.Event(), threading.Event()
    queue.submit(lambda: (running.set(), release.wait(60)))
    queue.submit(lambda: None)
    try:
        assert running.wait(30)

        def child():
            queue.close()
            pg._RESOLVERS.join()
            try:
                queue.submit(lambda: None)
            except RuntimeError as e:
                return str(e)
            return "accepted"

        refusal = in_child(child)
        assert "before it forked" in refusal, refusal
        assert not queue.idle(), "the parent's queue still holds its work"
    finally:
        release.set()
        queue.close()
    assert queue.idle()


def test_a_pending_collective_work_fails_in_a_forked_child():
    """A work the parent's queue thread would complete: waiting on it in the child
    raises at once instead of waiting for a thread that is not there."""
    pytest.importorskip("torch")
    from mooncake.pg import MooncakeWork

    pending = MooncakeWork(None, pending=True)
    done = MooncakeWork(None)

    def child():
        try:
            pending.wait()
        except RuntimeError as e:
            return [str(e), done.wait()]
        return ["no error", done.wait()]

    refusal, done_waited = in_child(child)
    assert "before it forked" in refusal, refusal
    assert done_waited is True
    assert not pending.is_completed(), "the parent's work is still pending"
