"""Helpers and fixtures shared by the spec tests (test_engine, test_store, ...).

Import with `from fixtures_extra import *` (pytest puts this folder on sys.path).

Everything here starts processes only through `Child`/`start_master`, which always close
stdin, terminate, wait and kill in `finally`; every read from a child has a deadline, so a
hung child fails a test instead of hanging the suite. Ports come from the OS (port 0) and
everything listens on 127.0.0.1.
"""

import contextlib
import ctypes
import hashlib
import os
import queue
import random
import re
import socket
import subprocess
import sys
import threading
import time

import pytest

__all__ = [
    "HERE",
    "PEERS",
    "KiB",
    "MiB",
    "STEP",
    "Buf",
    "Child",
    "terminate",
    "tracked",
    "wait_or_kill",
    "MasterProc",
    "digest",
    "pattern",
    "free_port",
    "port_is_open",
    "start_master",
    "start_peer",
    "start_etcd",
    "wait_until",
    "unique",
    "new_store",
    "store_factory",
    "private_master",
    "lease_master",
    "module_master",
    "engine_factory",
    "run_isolated",
    "peer_call",
    "peer_buf",
    "peer_digest",
    "peer_fill",
    "rc_arg",
    "RealClient",
    "real_clients",
    "dummies",
    "served",
]

HERE = os.path.dirname(os.path.abspath(__file__))
PEERS = os.path.join(HERE, "peers")
KiB = 1 << 10
MiB = 1 << 20
# Deadline for one step of a child (start-up, one command).
STEP = 30.0


# ---------------------------------------------------------------------------- bytes


def pattern(n, seed):
    """n deterministic pseudo-random bytes (not periodic, so offset bugs show)."""
    if n == 0:
        return b""
    return random.Random(seed).getrandbits(8 * n).to_bytes(n, "little")


def digest(data):
    return hashlib.sha256(bytes(data)).hexdigest()


# Every Buf's memory lives until the session ends: a store or engine that outlives a
# test may still hold a registration of it, and a freed range handed out again would
# overlap that stale registration.
_KEEP_ALIVE = []


class Buf:
    """A ctypes buffer with its address; `.raw`/`.read()` give its bytes."""

    def __init__(self, size, fill=b"\0", content=None):
        self.size = size
        self.c = (ctypes.c_char * size)()
        _KEEP_ALIVE.append(self.c)
        self.addr = ctypes.addressof(self.c)
        if content is not None:
            assert len(content) == size
            ctypes.memmove(self.addr, content, size)
        elif fill != b"\0":
            ctypes.memset(self.addr, fill[0], size)

    def read(self, off=0, n=None):
        n = self.size - off if n is None else n
        assert 0 <= off and off + n <= self.size
        return ctypes.string_at(self.addr + off, n)

    def write(self, off, data):
        assert off + len(data) <= self.size
        ctypes.memmove(self.addr + off, data, len(data))

    @property
    def raw(self):
        return self.read()


def unique(prefix="k"):
    """A key no other test (or earlier run against the same master) uses."""
    return "%s-%d-%s" % (prefix, os.getpid(), os.urandom(6).hex())


# ---------------------------------------------------------------------------- ports


def free_port():
    """A port the OS handed out and that is free right now (small reuse race only)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def port_is_open(host, port, timeout=2.0):
    try:
        with socket.create_connection((host, int(port)), timeout=timeout):
            return True
    except OSError:
        return False


def wait_until(pred, what, timeout=15.0, interval=0.02):
    """Polls `pred` (bounded by `timeout`) until it returns a truthy value, which is
    returned. Fails the test naming `what` otherwise. The pause between polls only
    paces the loop; the condition is what synchronizes."""
    deadline = time.monotonic() + timeout
    last = None
    while True:
        last = pred()
        if last:
            return last
        if time.monotonic() > deadline:
            pytest.fail("timed out after %.0fs waiting for %s (last: %r)" % (timeout, what, last))
        time.sleep(interval)


# ---------------------------------------------------------------------------- children


def wait_or_kill(proc, timeout):
    """Waits up to `timeout` s for `proc` to end, else kills it; its exit code."""
    try:
        proc.wait(timeout=timeout)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()
    return proc.returncode


def terminate(proc, timeout):
    """Stops `proc` with SIGTERM (if it still runs), killing it after `timeout` s; its
    exit code."""
    if proc.poll() is None:
        proc.terminate()
        wait_or_kill(proc, timeout)
    return proc.returncode


def tracked(make, finish):
    """The body of a factory fixture (`yield from tracked(make, finish)`): it yields a
    `make` that remembers what it made, and at teardown runs `finish` on each, in order."""
    made = []

    def make_tracked(*args, **kwargs):
        thing = make(*args, **kwargs)
        made.append(thing)
        return thing

    yield make_tracked
    for thing in made:
        finish(thing)


class Child:
    """A child process spoken to by lines: commands on stdin, answers on stdout.

    stdout is read by a thread into a queue so every read has a deadline; stderr is kept
    for failure messages. `close()` (also on context exit) closes stdin, terminates,
    waits and kills: every child a test starts is stopped by it."""

    def __init__(self, what, argv, env=None, cwd=None):
        self.what = what
        full_env = dict(os.environ)
        full_env["PYTHONUNBUFFERED"] = "1"
        if env:
            full_env.update(env)
        self.proc = subprocess.Popen(
            argv,
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            env=full_env,
            cwd=cwd,
            text=True,
            bufsize=1,
        )
        self.lines = queue.Queue()
        self.err = []
        self._t_out = threading.Thread(target=self._pump_out, daemon=True)
        self._t_err = threading.Thread(target=self._pump_err, daemon=True)
        self._t_out.start()
        self._t_err.start()

    def _pump_out(self):
        for line in self.proc.stdout:
            self.lines.put(line.rstrip("\n"))
        self.lines.put(None)

    def _pump_err(self):
        for line in self.proc.stderr:
            self.err.append(line)

    def stderr_text(self, last=40):
        return "".join(self.err[-last:])

    def line(self, timeout=STEP):
        try:
            l = self.lines.get(timeout=timeout)
        except queue.Empty:
            pytest.fail("%s: no output within %.0fs; stderr:\n%s" % (self.what, timeout, self.stderr_text()))
        if l is None:
            self.lines.put(None)
            rc = self.proc.poll()
            pytest.fail("%s: output ended (exit %r); stderr:\n%s" % (self.what, rc, self.stderr_text()))
        return l

    def send(self, line):
        try:
            self.proc.stdin.write(line + "\n")
            self.proc.stdin.flush()
        except (BrokenPipeError, OSError) as e:
            pytest.fail("%s: writing %r: %s; stderr:\n%s" % (self.what, line, e, self.stderr_text()))

    def ask(self, line, timeout=STEP):
        """Sends one command and returns its one-line answer; an `error ...` answer fails."""
        self.send(line)
        ans = self.line(timeout)
        if ans.startswith("error"):
            pytest.fail("%s: %r answered %r; stderr:\n%s" % (self.what, line, ans, self.stderr_text()))
        return ans

    def close(self, timeout=10.0):
        p = self.proc
        try:
            if p.stdin and not p.stdin.closed:
                p.stdin.close()
        except OSError:
            pass
        try:
            p.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            p.terminate()
            wait_or_kill(p, 5)
        return p.returncode

    def kill(self):
        if self.proc.poll() is None:
            self.proc.kill()
        self.proc.wait()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()


def start_peer(script, *args, python=None, what=None, env=None, ready_timeout=STEP):
    """Starts peers/<script> with this interpreter (or `python`) and returns (child,
    words of its `ready ...` line)."""
    argv = [python or sys.executable, os.path.join(PEERS, script)] + [str(a) for a in args]
    child = Child(what or script, argv, env=env)
    try:
        ready = child.line(ready_timeout)
        if not ready.startswith("ready"):
            pytest.fail("%s said %r; stderr:\n%s" % (child.what, ready, child.stderr_text()))
        return child, ready.split()[1:]
    except BaseException:
        child.kill()
        raise


def _ok_rest(ans):
    assert ans.startswith("ok"), ans
    return ans[2:].strip()


def peer_call(child, method, *args, **kwargs):
    """Calls `method` on the peer's engine/store object; returns the JSON-decoded result."""
    import json

    req = {"m": method, "a": list(args), "k": kwargs}
    return json.loads(_ok_rest(child.ask("call " + json.dumps(req))))


def rc_arg(**attrs):
    """A ReplicateConfig argument for peer_call."""
    return {"__rc__": attrs}


def peer_buf(child, size, seed=-1, how=None):
    return int(_ok_rest(child.ask("buf %d %d%s" % (size, seed, " " + how if how else ""))))


def peer_digest(child, addr, n):
    return _ok_rest(child.ask("digest %d %d" % (addr, n)))


def peer_fill(child, addr, n, seed):
    child.ask("fill %d %d %d" % (addr, n, seed))


def run_isolated(code, timeout=60.0):
    """Runs `code` in a fresh interpreter (for calls that could crash the process).
    Returns (returncode, stdout, stderr)."""
    p = subprocess.run(
        [sys.executable, "-c", code],
        stdin=subprocess.DEVNULL,
        capture_output=True,
        text=True,
        timeout=timeout,
        env=dict(os.environ, PYTHONUNBUFFERED="1"),
    )
    return p.returncode, p.stdout, p.stderr


# ---------------------------------------------------------------------------- masters


class MasterProc:
    def __init__(self, child, rpc, metadata):
        self.child = child
        self.rpc = rpc
        self.metadata = metadata

    def stop(self):
        self.child.close()


@contextlib.contextmanager
def start_master(mooncake_bin, *extra):
    """`mooncake master` on OS-chosen ports, stopped (stdin closed, then killed) on exit."""
    argv = [
        os.fspath(mooncake_bin),
        "master",
        "--bind",
        "127.0.0.1",
        "--rpc-port",
        "0",
        "--metadata-port",
        "0",
        "--metrics-port",
        "off",
        "--until-stdin-eof",
    ] + list(extra)
    child = Child("mooncake master", argv)
    try:
        ready = child.line(STEP)
        m_rpc = re.search(r"\brpc=(\S+)", ready)
        m_meta = re.search(r"\bmetadata=(\S+)", ready)
        if not ready.startswith("ready") or not m_rpc or not m_meta:
            pytest.fail("mooncake master said %r; stderr:\n%s" % (ready, child.stderr_text()))
        yield MasterProc(child, m_rpc.group(1), m_meta.group(1))
    finally:
        child.close()


@pytest.fixture
def private_master(mooncake_bin):
    """A master of this test alone (for pool-filling and remove_all tests)."""
    with start_master(mooncake_bin) as m:
        yield m


@pytest.fixture(scope="module")
def module_master(mooncake_bin):
    """A master shared by the tests of one module (keys are unique per test)."""
    with start_master(mooncake_bin) as m:
        yield m


@pytest.fixture(scope="module")
def lease_master(mooncake_bin):
    """A master whose read leases last 500 ms."""
    with start_master(mooncake_bin, "--default_kv_lease_ttl=500") as m:
        yield m


# ---------------------------------------------------------------------------- clients


def new_store(master, segment=16 * MiB, local_buffer=16 * MiB, host="127.0.0.1", metadata=None, **kw):
    """A MooncakeDistributedStore set up against `master`; setup must return 0."""
    from mooncake.store import MooncakeDistributedStore

    s = MooncakeDistributedStore()
    rc = s.setup(
        host,
        metadata if metadata is not None else master.metadata,
        segment,
        local_buffer,
        "tcp",
        "",
        master.rpc,
        **kw,
    )
    assert rc == 0, "setup returned %r" % (rc,)
    return s


@pytest.fixture
def store_factory():
    """make(master, ...) -> set-up store; every store made is closed at teardown."""
    made = []

    def make(master, *a, **kw):
        s = new_store(master, *a, **kw)
        made.append(s)
        return s

    yield make
    for s in reversed(made):
        try:
            s.close()
        except Exception:
            pass


@pytest.fixture
def engine_factory():
    """make(metadata="P2PHANDSHAKE", host="127.0.0.1") -> (engine, session name)."""
    from mooncake.engine import TransferEngine

    made = []

    def make(metadata="P2PHANDSHAKE", host="127.0.0.1", device=""):
        e = TransferEngine()
        rc = e.initialize(host, metadata, "tcp", device)
        assert rc == 0, "initialize(%r, %r) returned %r" % (host, metadata, rc)
        made.append(e)
        if metadata == "P2PHANDSHAKE":
            name = "%s:%d" % (host.split(":")[0], e.get_rpc_port())
        else:
            name = host
        return e, name

    yield make
    made.clear()


def start_etcd(tmp_path):
    """A one-member etcd on loopback ports the OS picked, as (Child, "127.0.0.1:PORT"),
    or pytest.skip when etcd is not installed. etcd logs to stderr; "serving client
    traffic" there means its client port is ready. The caller kills it."""
    import shutil

    if not shutil.which("etcd"):
        pytest.skip("etcd is not installed (Debian: apt-get install etcd-server)")
    client, peer = free_port(), free_port()
    curl, purl = "http://127.0.0.1:%d" % client, "http://127.0.0.1:%d" % peer
    argv = ["etcd", "--name", "t", "--data-dir", str(tmp_path / "etcd"),
            "--listen-client-urls", curl, "--advertise-client-urls", curl,
            "--listen-peer-urls", purl, "--initial-advertise-peer-urls", purl,
            "--initial-cluster", "t=" + purl, "--logger", "zap", "--log-outputs", "stdout"]
    child = Child("etcd", argv)
    try:
        for _ in range(500):
            if "serving client traffic" in child.line(30):
                return child, "127.0.0.1:%d" % client
        pytest.fail("etcd never said it serves clients")
    except BaseException:
        child.kill()
        raise


# ---------------------------------------------------------------------------- dummy clients


class RealClient:
    """A ``mooncake_client`` child on 127.0.0.1; ``.address`` is where dummies attach,
    ``.segment`` its store's segment name. ``stop()`` sends SIGTERM (then kills)."""

    def __init__(self, master, port=0, *extra):
        argv = [sys.executable, "-m", "mooncake.real_client", "--host=127.0.0.1",
                "--port", str(port), "--master_server_address=" + master.rpc,
                "--metadata_server", master.metadata, "--global_segment_size=64 MB",
                "--local_buffer_size", "0", "--enable_offload=false", *extra]
        self.child = Child("mooncake_client", argv)
        try:
            words = dict(w.split("=", 1) for w in self.child.line(STEP).split()[1:])
            self.address, self.segment = words["dummy"], words["segment"]
        except BaseException:
            self.stop()
            raise
        self.port = int(self.address.rpartition(":")[2])

    def stop(self):
        return terminate(self.child.proc, 15)

    def kill(self):
        self.child.kill()


@pytest.fixture
def real_clients():
    """start(master, port=0, *flags) -> RealClient; all are stopped at teardown."""
    yield from tracked(RealClient, RealClient.stop)


@pytest.fixture
def dummies():
    """attach(address, local_buffer=1 MiB) -> a dummy store; all are closed at teardown."""
    made = []

    from mooncake.store import MooncakeDistributedStore

    def attach(address, local_buffer=1 * MiB):
        d = MooncakeDistributedStore()
        made.append(d)
        assert d.setup_dummy(64 * MiB, local_buffer, address) == 0
        return d

    yield attach
    for d in made:
        d.close()


@pytest.fixture
def served(master_factory, real_clients):
    master = master_factory()
    return real_clients(master)
