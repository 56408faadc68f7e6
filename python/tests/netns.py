"""Simulated hosts for the multi-host tests: Linux network namespaces on one bridge.

`Hosts(n)` creates a bridge in the root namespace (without an address of its own) and
n namespaces, each joined to it by a veth pair: host i has only SUBNET.i/24 on its
eth0, plus lo, and a default route like a real machine's, via GATEWAY, an address no
one holds (a server bound to all interfaces finds its routable address as it would on
a real host, yet nothing can leave the bridge). The hosts reach each other through the
bridge and nothing else, so processes in them see one another as separate machines
would, and fixed ports (8080, 50051, 2379) inside one never clash with the machine or
with a parallel run. Names carry this process's id and a random tag, so parallel runs
never share a namespace.

Processes run in a namespace through `ip netns exec`, as `Child`ren (fixtures_extra)
that `Hosts.close()` stops, whatever happened; then it kills anything still inside its
namespaces (only this run's processes can be there), deletes them and the bridge.

Needs root and iproute2's `ip`: `unavailable()` says why a machine cannot, and
`Hosts(n)` raises NetnsUnavailable when the kernel refuses, so tests can skip.
"""

import contextlib
import os
import queue
import shutil
import signal
import subprocess
import sys
import time

import pytest

from fixtures_extra import PEERS, STEP, Child

# Private addresses that exist only on interfaces inside this run's namespaces; no
# traffic ever leaves them.
SUBNET = "10.213.0"
GATEWAY = SUBNET + ".254"
# How long a server may take to accept connections from another host.
LISTEN_TIMEOUT_S = 20.0


class NetnsUnavailable(Exception):
    """This machine cannot create the simulated network (the message says why)."""


def unavailable():
    """Why this process cannot create network namespaces, or None when it can try."""
    if not sys.platform.startswith("linux"):
        return "network namespaces are Linux only"
    if os.geteuid() != 0:
        return "creating network namespaces needs root"
    if shutil.which("ip") is None:
        return "iproute2's `ip` is not installed (Debian: apt-get install iproute2)"
    return None


def _ip(*args):
    """Runs `ip ARGS`; NetnsUnavailable with ip's own message when it fails."""
    p = subprocess.run(["ip", *args], stdin=subprocess.DEVNULL, capture_output=True,
                       text=True, timeout=30)
    if p.returncode != 0:
        raise NetnsUnavailable("`ip %s` failed: %s" % (" ".join(args), p.stderr.strip()))
    return p.stdout


class HostChild(Child):
    """A Child on a simulated host. A server (no stdin protocol) stops on SIGTERM; a
    peer script stops on stdin EOF."""

    def __init__(self, what, argv, env, server):
        super().__init__(what, argv, env=env)
        self.server = server

    def check_running(self, why="it was needed"):
        """Fails the test, with this process's stderr, if it has exited."""
        if self.proc.poll() is not None:
            pytest.fail("%s exited (status %r) before %s; stderr:\n%s"
                        % (self.what, self.proc.returncode, why, self.stderr_text()))

    def stop(self):
        if self.server and self.proc.poll() is None:
            self.proc.terminate()
        return self.close(timeout=5.0 if self.server else 10.0)


class Hosts:
    """`count` simulated hosts, numbered 1..count (see the module docstring)."""

    def __init__(self, count):
        assert 1 <= count < 254
        tag = "mc%d%s" % (os.getpid(), os.urandom(1).hex())
        self.bridge = tag + "br"
        self._namespaces = ["%sh%d" % (tag, i) for i in range(1, count + 1)]
        self._veths = ["%sv%d" % (tag, i) for i in range(1, count + 1)]
        self._children = []
        self._created = []  # (kind, name) in creation order, for teardown
        try:
            self._build()
        except BaseException:
            self.close()
            raise

    def _build(self):
        _ip("link", "add", self.bridge, "type", "bridge")
        self._created.append(("link", self.bridge))
        _ip("link", "set", self.bridge, "up")
        for i, (ns, veth) in enumerate(zip(self._namespaces, self._veths), start=1):
            _ip("netns", "add", ns)
            self._created.append(("netns", ns))
            _ip("link", "add", veth, "type", "veth", "peer", "name", "eth0", "netns", ns)
            _ip("link", "set", veth, "master", self.bridge, "up")
            _ip("-n", ns, "addr", "add", "%s/24" % self.ip(i), "dev", "eth0")
            _ip("-n", ns, "link", "set", "eth0", "up")
            _ip("-n", ns, "link", "set", "lo", "up")
            _ip("-n", ns, "route", "add", "default", "via", GATEWAY)

    def ip(self, host):
        """Host `host`'s only address besides loopback."""
        return "%s.%d" % (SUBNET, host)

    def netns(self, host):
        return self._namespaces[host - 1]

    def start(self, host, what, argv, env=None, server=True):
        """Starts `argv` on `host`; stopped by close() if not before."""
        argv = ["ip", "netns", "exec", self.netns(host)] + [str(a) for a in argv]
        child = HostChild("%s on host %d" % (what, host), argv, env, server)
        self._children.append(child)
        return child

    def start_peer(self, host, script, *args, what, env=None):
        """peers/<script> with this interpreter on `host`: (child, words of its `ready`
        line)."""
        argv = [sys.executable, os.path.join(PEERS, script), *args]
        child = self.start(host, what, argv, env=env, server=False)
        ready = child.line(STEP)
        if not ready.startswith("ready"):
            pytest.fail("%s said %r; stderr:\n%s" % (child.what, ready, child.stderr_text()))
        return child, ready.split()[1:]

    @contextlib.contextmanager
    def scoped(self):
        """Processes started inside the block are stopped when it ends (a test's own,
        while module-wide servers live on)."""
        first = len(self._children)
        try:
            yield self
        finally:
            self._stop_from(first)

    def _stop_from(self, first):
        """Stops the processes started since the `first`-th, newest first."""
        for child in reversed(self._children[first:]):
            try:
                child.stop()
            except Exception:
                child.kill()
        del self._children[first:]

    def close(self):
        """Stops every process this run started, then removes its namespaces and bridge
        (also after a failed setup; safe to call twice)."""
        self._stop_from(0)
        for kind, name in reversed(self._created):
            if kind == "netns":
                self._kill_inside(name)
                subprocess.run(["ip", "netns", "del", name], capture_output=True)
            else:
                subprocess.run(["ip", "link", "del", name], capture_output=True)
        self._created.clear()

    @staticmethod
    def _kill_inside(ns):
        """Kills what is left in namespace `ns`: only this run's processes can be there."""
        p = subprocess.run(["ip", "netns", "pids", ns], capture_output=True, text=True)
        for pid in p.stdout.split():
            try:
                os.kill(int(pid), signal.SIGKILL)
            except (ValueError, ProcessLookupError):
                pass

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()


def wait_listening(hosts, from_host, server, ip, port, timeout=LISTEN_TIMEOUT_S):
    """Waits until ip:port accepts a connection from `from_host` (another simulated
    host, so a server bound to loopback only never passes), failing at once with the
    server's stderr if the server exits first. A probe of its own asks, so no stale
    answer can outlive a failure."""
    probe, _ = hosts.start_peer(from_host, "probe.py", what="probe")
    try:
        probe.send("reach %s %d %g" % (ip, port, timeout))
        deadline = time.monotonic() + timeout + STEP
        while time.monotonic() < deadline:
            server.check_running("%s:%d accepted connections" % (ip, port))
            try:
                answer = probe.lines.get(timeout=0.1)
            except queue.Empty:
                continue
            if answer == "ok":
                return
            if answer is None:
                pytest.fail("%s ended; stderr:\n%s" % (probe.what, probe.stderr_text()))
            pytest.fail("%s: %s (seen from host %d); its stderr:\n%s"
                        % (server.what, answer, from_host, server.stderr_text()))
        pytest.fail("%s gave no answer about %s:%d" % (probe.what, ip, port))
    finally:
        probe.kill()
