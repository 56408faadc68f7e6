"""A hardware protocol whose backend is unavailable here (serving engines ask for "rdma"
by default): TransferEngine and the store start over TCP, with one warning from the
library, as Mooncake's wheel does; MC_STRICT_PROTOCOL=1 restores the refusal.

Naming a NIC no host has makes RDMA unavailable on every machine, whatever its NICs."""

import os

import pytest

from mooncake.engine import TransferEngine
from mooncake.store import MooncakeDistributedStore

MiB = 1 << 20
NO_SUCH_NIC = "mc_no_such_nic0"


@pytest.fixture
def engines():
    """Makes started TransferEngines; every one is closed after the test."""
    made = []

    def start(protocol, device=""):
        e = TransferEngine()
        made.append(e)
        assert e.initialize("127.0.0.1", "P2PHANDSHAKE", protocol, device) == 0, protocol
        return e

    yield start
    for e in made:
        e.close()


def round_trip(a, b):
    """a writes into b's buffer and reads it back."""
    session_b = f"127.0.0.1:{b.get_rpc_port()}"
    size = 64 * 1024
    src, dst = a.allocate_managed_buffer(size), b.allocate_managed_buffer(size)
    assert src and dst
    payload = os.urandom(size)
    a.write_bytes_to_buffer(src, payload, size)
    assert a.transfer_sync_write(session_b, src, dst, size) == 0
    assert b.read_bytes_from_buffer(dst, size) == payload
    a.write_bytes_to_buffer(src, bytes(size), size)
    assert a.transfer_sync_read(session_b, src, dst, size) == 0
    assert a.read_bytes_from_buffer(src, size) == payload


def test_rdma_as_serving_engines_ask_for_it(engines):
    # On a host without RDMA both run over TCP; on one with RDMA, over RDMA.
    a, b = engines("rdma"), engines("rdma")
    round_trip(a, b)
    round_trip(b, a)


@pytest.mark.parametrize("protocol,device", [("rdma", NO_SUCH_NIC), ("nvlink", "")])
def test_an_unavailable_protocol_falls_back_to_tcp_with_one_warning(
        engines, capfd, protocol, device):
    capfd.readouterr()
    fellback = engines(protocol, device)
    warnings = [line for line in capfd.readouterr().err.splitlines() if "WARN" in line]
    assert len(warnings) == 1, warnings
    assert f"protocol {protocol} requested" in warnings[0]
    assert "using tcp instead" in warnings[0]
    assert (device in warnings[0]) if device else ("device_name" not in warnings[0])
    # It speaks TCP: a plain TCP engine and it reach each other both ways.
    tcp = engines("tcp")
    round_trip(fellback, tcp)
    round_trip(tcp, fellback)


@pytest.mark.parametrize("protocol,device", [("rdma", NO_SUCH_NIC), ("nvlink", "")])
def test_strict_protocol_refuses(monkeypatch, protocol, device):
    monkeypatch.setenv("MC_STRICT_PROTOCOL", "1")
    e = TransferEngine()
    assert e.initialize("127.0.0.1", "P2PHANDSHAKE", protocol, device) == -1
    assert e.get_rpc_port() == -1


def setup_store(master, rdma_devices):
    s = MooncakeDistributedStore()
    rc = s.setup("127.0.0.1", master.metadata, 16 * MiB, 16 * MiB, "rdma", rdma_devices,
                 master.rpc)
    return s, rc


@pytest.mark.parametrize("rdma_devices", ["", NO_SUCH_NIC])
def test_store_with_protocol_rdma_works(master, rdma_devices):
    s, rc = setup_store(master, rdma_devices)
    try:
        assert rc == 0
        value = os.urandom(3 * MiB + 17)
        assert s.put("fallback-key", value) == 0
        assert s.get("fallback-key") == value
    finally:
        s.close()


def test_strict_store_with_unavailable_rdma_refuses(master, monkeypatch):
    monkeypatch.setenv("MC_STRICT_PROTOCOL", "1")
    s, rc = setup_store(master, NO_SUCH_NIC)
    try:
        assert rc != 0
        assert s.health_check() != 0
    finally:
        s.close()


def test_the_config_module_knows_the_protocols_the_engine_takes():
    # mooncake_config warns on names outside KNOWN_PROTOCOLS; the engine's list is in
    # crates/engine/src/engine/config.rs. One list must not drift from the other.
    from mooncake import _native as N
    from mooncake._common import new_config
    from mooncake.mooncake_config import KNOWN_PROTOCOLS

    for name in sorted(KNOWN_PROTOCOLS):
        cfg, rc = new_config({"protocol": name})
        assert cfg is not None, f"the engine refuses protocol {name!r} ({rc})"
        N.LIB.mc_config_free(cfg)
    cfg, rc = new_config({"protocol": "rpc_only"})
    assert cfg is None and rc == N.MC_ERR_INVALID_PARAMS
