"""Shared fixtures for the mooncake Python package tests.

  mooncake_bin     path of the ``mooncake`` binary (session)
  master_factory   start(*extra_flags) -> Master; every master started is stopped after
                   the test
  master           one ``mooncake master`` child process (.rpc "host:port", .metadata URL)
  free_port        a function returning a free TCP port on 127.0.0.1

The package is imported from site-packages (``pip install ./python``) or, in a checkout,
from ``python/`` with ``MOONCAKE_LIB`` (and optionally ``MOONCAKE_BIN``) set, e.g.
``MOONCAKE_LIB=target/release/libmooncake.so pytest python/tests``.
"""

import os
import queue
import socket
import subprocess
import threading

import pytest

from fixtures_extra import tracked, wait_or_kill

_HERE = os.path.dirname(os.path.abspath(__file__))
_CHECKOUT = os.path.dirname(os.path.dirname(_HERE))


def _find_binary():
    try:
        from mooncake.cli import binary_path

        return binary_path()
    except (ImportError, FileNotFoundError):
        pass
    target = os.environ.get("CARGO_TARGET_DIR") or os.path.join(_CHECKOUT, "target")
    for profile in ("release", "debug"):
        path = os.path.join(target, profile, "mooncake")
        if os.path.isfile(path) and os.access(path, os.X_OK):
            return path
    return None


@pytest.fixture(scope="session")
def mooncake_bin():
    path = _find_binary()
    if path is None:
        pytest.skip("no mooncake binary (pip install ./python, or set MOONCAKE_BIN)")
    return path


class Master:
    """A ``mooncake master`` child: ``.rpc`` ("127.0.0.1:port"), ``.metadata`` (URL of its
    embedded HTTP metadata server), ``.proc``. Stopped by closing its stdin."""

    def __init__(self, binary, *extra, timeout=30):
        cmd = [binary, "master", "--bind", "127.0.0.1", "--rpc-port", "0", "--metadata-port", "0",
               "--metrics-port", "off", *extra, "--until-stdin-eof"]
        self.proc = subprocess.Popen(cmd, stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                     text=True)
        lines = queue.Queue()

        def pump():
            for line in self.proc.stdout:
                lines.put(line)
            lines.put(None)

        threading.Thread(target=pump, daemon=True).start()
        try:
            line = lines.get(timeout=timeout)
        except queue.Empty:
            line = None
        if not line or not line.startswith("ready "):
            self.stop()
            raise RuntimeError(f"mooncake master did not start ({' '.join(cmd)}): {line!r}")
        fields = dict(kv.split("=", 1) for kv in line.split()[1:] if "=" in kv)
        self.rpc = fields["rpc"]
        self.metadata = fields.get("metadata", "")
        self.metrics = fields.get("metrics", "")

    def stop(self, timeout=15):
        if self.proc.poll() is None:
            try:
                self.proc.stdin.close()
            except OSError:
                pass
            wait_or_kill(self.proc, timeout)
        return self.proc.returncode


@pytest.fixture
def master_factory(mooncake_bin):
    yield from tracked(lambda *extra: Master(mooncake_bin, *extra), Master.stop)


@pytest.fixture
def master(master_factory):
    return master_factory()


@pytest.fixture
def free_port():
    def pick(host="127.0.0.1"):
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
            s.bind((host, 0))
            return s.getsockname()[1]

    return pick
