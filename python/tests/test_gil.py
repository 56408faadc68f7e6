"""Every call that can block releases the GIL (docs/python.md, Conventions).

Four threads do 4 KiB reads in a loop while the main thread counts Python iterations.
The switch interval is raised to 30 s for the duration, so a thread gives the GIL up only
where it releases it itself: if a call held the GIL, a worker would run all of its calls
without the main thread ever running in between, and the main counter would not move
during the worker's calls. The assertions are about counts (the main thread advanced
while each worker was between its first and last call), never about time; the rate is
printed for information only."""

import sys
import threading
import time

import pytest

from fixtures_extra import *  # noqa: F401,F403

pytest.importorskip("mooncake.store")
from mooncake.engine import TransferEngine  # noqa: E402

THREADS = 4
OPS = 300
SIZE = 4096
# Bound on the main loop (it normally stops when the workers are done).
MAX_MAIN_ITERATIONS = 5_000_000


@pytest.fixture(autouse=True)
def reads_cross_sockets(monkeypatch):
    """Each read must wait long enough for the main thread to be scheduled in, as a
    loopback TCP round trip does; "tcp" would otherwise reach these same-host peers
    through shared memory, a copy of about a microsecond."""
    monkeypatch.setenv("MC_SAME_HOST_SHM", "0")


def probe(op, check):
    """Runs op(i) OPS times in each of THREADS threads; returns (main counter advance
    inside each worker's window, main total, elapsed)."""
    counter = [0]
    go = threading.Event()
    windows = [None] * THREADS
    results = [[] for _ in range(THREADS)]
    errors = []

    def worker(i):
        try:
            go.wait(60)
            first = None
            for n in range(OPS):
                if n == 1:
                    first = counter[0]
                results[i].append(op(i))
            windows[i] = counter[0] - first
        except BaseException as e:  # reported by the main thread
            errors.append(e)

    old = sys.getswitchinterval()
    threads = [threading.Thread(target=worker, args=(i,), daemon=True) for i in range(THREADS)]
    sys.setswitchinterval(30.0)
    try:
        for t in threads:
            t.start()
        t0 = time.perf_counter()
        go.set()
        while counter[0] < MAX_MAIN_ITERATIONS and any(t.is_alive() for t in threads):
            counter[0] += 1
            time.sleep(0)  # hands the GIL to whoever waits for it (not a synchronization)
        elapsed = time.perf_counter() - t0
    finally:
        sys.setswitchinterval(old)
    for t in threads:
        t.join(120)
        assert not t.is_alive(), "a worker thread did not finish"
    assert not errors, errors
    for i in range(THREADS):
        assert len(results[i]) == OPS
        check(i, results[i])
    return windows, counter[0], elapsed


def report(what, windows, total, elapsed):
    ops = THREADS * OPS
    print(
        "\n%s: %d ops in %.3fs (%.0f ops/s, for information); main-thread iterations %d, "
        "inside the workers' windows %r" % (what, ops, elapsed, ops / max(elapsed, 1e-9), total, windows)
    )


def test_store_get_into_releases_the_gil(master):
    # The object lives in another store's segment, so each read crosses loopback TCP as
    # in the engine test below: a copy out of the reader's own segment takes about a
    # microsecond, too short a window for the main thread to be scheduled in reliably.
    holder = new_store(master, 8 * MiB, 4 * MiB)
    s = new_store(master, 0, 4 * MiB)
    try:
        k = unique("gil")
        value = pattern(SIZE, 1)
        assert holder.put(k, value) == 0
        bufs = [Buf(SIZE) for _ in range(THREADS)]
        for b in bufs:
            assert s.register_buffer(b.addr, SIZE) == 0

        def op(i):
            return s.get_into(k, bufs[i].addr, SIZE)

        def check(i, res):
            assert res == [SIZE] * OPS
            assert bufs[i].raw == value

        windows, total, elapsed = probe(op, check)
        report("store.get_into", windows, total, elapsed)
        assert all(w > 0 for w in windows), "the main thread never ran during a worker's get_into calls: %r" % windows
        assert sum(windows) >= OPS, windows
    finally:
        s.close()
        holder.close()


def test_engine_transfer_sync_read_releases_the_gil():
    a, b = TransferEngine(), TransferEngine()
    for e in (a, b):
        assert e.initialize("127.0.0.1", "P2PHANDSHAKE", "tcp", "") == 0
    remote = Buf(SIZE, content=pattern(SIZE, 2))
    assert b.register_memory(remote.addr, SIZE) == 0
    target = "127.0.0.1:%d" % b.get_rpc_port()
    local = Buf(THREADS * SIZE)
    assert a.register_memory(local.addr, local.size) == 0

    def op(i):
        return a.transfer_sync_read(target, local.addr + i * SIZE, remote.addr, SIZE)

    def check(i, res):
        assert res == [0] * OPS
        assert local.read(i * SIZE, SIZE) == pattern(SIZE, 2)

    windows, total, elapsed = probe(op, check)
    report("engine.transfer_sync_read", windows, total, elapsed)
    assert all(w > 0 for w in windows), "the main thread never ran during a worker's transfers: %r" % windows
    assert sum(windows) >= OPS, windows
