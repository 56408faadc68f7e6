"""setup() as upstream's store client does it: a port picked from upstream's range when
local_hostname has none, config dicts whose bad values answer INVALID_PARAMS instead of
raising, and the optional settings a dict may carry."""

import logging
import socket

import pytest

from fixtures_extra import tracked
from mooncake.store import MooncakeDistributedStore

INVALID_PARAMS = -600
MiB = 1 << 20


@pytest.fixture
def stores():
    yield from tracked(MooncakeDistributedStore, MooncakeDistributedStore.close)


def config(master, **extra):
    cfg = {"local_hostname": "127.0.0.1", "metadata_server": master.metadata,
           "global_segment_size": 16 * MiB, "local_buffer_size": 16 * MiB,
           "protocol": "tcp", "master_server_addr": master.rpc}
    cfg.update(extra)
    return cfg


def port_of(hostname):
    host, _, port = hostname.rpartition(":")
    assert host == "127.0.0.1", hostname
    return int(port)


def test_a_host_without_port_gets_one_from_upstreams_range(master, stores):
    a, b = stores(), stores()
    assert a.setup("127.0.0.1", master.metadata, 16 * MiB, 16 * MiB, "tcp", "",
                   master.rpc) == 0
    assert b.setup(config(master)) == 0
    ports = {port_of(a.get_hostname()), port_of(b.get_hostname())}
    assert len(ports) == 2
    assert all(12300 <= p <= 14300 for p in ports)
    assert a.put("range-key", b"x" * 4096) == 0
    assert b.get("range-key") == b"x" * 4096


def test_the_dict_form_is_also_taken_by_keyword(master, stores):
    s = stores()
    with pytest.raises(TypeError):
        s.setup("127.0.0.1", config=config(master))  # both forms at once
    with pytest.raises(TypeError):
        s.setup(config=[("local_hostname", "127.0.0.1")])
    assert s.setup(config=config(master)) == 0
    assert s.put("by-keyword", b"k" * 64) == 0 and s.get("by-keyword") == b"k" * 64


def test_the_range_comes_from_the_environment(master, stores, monkeypatch):
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        free = probe.getsockname()[1]
    monkeypatch.setenv("MC_STORE_CLIENT_MIN_PORT", str(free))
    monkeypatch.setenv("MC_STORE_CLIENT_MAX_PORT", str(free))
    s = stores()
    assert s.setup(config(master)) == 0
    assert port_of(s.get_hostname()) == free


def test_a_range_with_every_port_taken_fails_with_a_code(master, stores, monkeypatch):
    with socket.socket() as held:
        held.bind(("127.0.0.1", 0))
        held.listen()
        port = held.getsockname()[1]
        monkeypatch.setenv("MC_STORE_CLIENT_MIN_PORT", str(port))
        monkeypatch.setenv("MC_STORE_CLIENT_MAX_PORT", str(port))
        monkeypatch.setenv("MC_STORE_CLIENT_SETUP_RETRIES", "2")
        s = stores()
        assert s.setup(config(master)) < 0
        assert s.get_hostname() == ""


def test_an_explicit_port_is_kept(master, stores):
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    s = stores()
    assert s.setup(config(master, local_hostname=f"127.0.0.1:{port}")) == 0
    assert s.get_hostname() == f"127.0.0.1:{port}"


@pytest.mark.parametrize("bad", [
    {"global_segment_size": "50%"},
    {"local_buffer_size": "lots"},
    {"global_segment_size": -1},
    {"global_segment_size": 100},  # under upstream's 1 KiB minimum
    {"client_http_port": "http"},
    {"local_hostname": ""},
    {"metadata_server": None},
])
def test_a_dict_with_a_bad_value_answers_invalid_params(master, stores, bad):
    s = stores()
    assert s.setup(config(master, **bad)) == INVALID_PARAMS
    assert s.get_hostname() == ""
    assert s.put("after-bad-setup", b"v") == INVALID_PARAMS  # nothing was set up


def test_a_dict_may_leave_sizes_out_and_name_unknown_keys(master, stores, caplog):
    cfg = config(master, typo_key=1, enable_client_http_server="true",
                 client_http_port="9300", tenant_id="default")
    del cfg["global_segment_size"], cfg["local_buffer_size"]
    s = stores()
    with caplog.at_level(logging.WARNING, logger="mooncake"):
        assert s.setup(cfg) == 0
    assert "typo_key" in caplog.text
    assert s.put("defaults", b"d" * 100) == 0
    assert s.get("defaults") == b"d" * 100


def test_positional_setup_takes_upstreams_trailing_arguments(master, stores):
    s = stores()
    assert s.setup("127.0.0.1", master.metadata, 16 * MiB, 16 * MiB, "tcp", "", master.rpc,
                   None, False, "", "default", False, 9300) == 0
    with pytest.raises(TypeError):
        stores().setup("127.0.0.1", master.metadata, 16 * MiB, 16 * MiB, "tcp", "",
                       master.rpc, None, "yes")
