"""Configuration surfaces: ReplicateConfig defaults, MooncakeConfig.from_file /
load_from_env, human sizes in setup's dict form, and the console scripts the package
ships (docs/python.md)."""

import json
import os
import shutil
import subprocess
import sys
import tempfile

import pytest

from fixtures_extra import *  # noqa: F401,F403

pytest.importorskip("mooncake.store")
from mooncake.engine import TransferEngine  # noqa: E402
from mooncake.mooncake_config import MooncakeConfig  # noqa: E402
from mooncake.store import MooncakeDistributedStore, ReplicateConfig  # noqa: E402

GiB = 1 << 30
BAD = (TypeError, ValueError)


# ------------------------------------------------------------------ ReplicateConfig


def test_replicate_config_defaults():
    c = ReplicateConfig()
    assert c.replica_num == 1
    assert c.with_soft_pin is False
    assert c.with_hard_pin is False
    assert c.soft_pin_ttl_ms is None or (isinstance(c.soft_pin_ttl_ms, int) and c.soft_pin_ttl_ms >= 0)
    assert c.preferred_segment == ""
    assert c.preferred_segments == []
    assert c.prefer_alloc_in_same_node is False
    assert c.group_ids is None  # upstream's default: no groups


def test_replicate_config_attributes_read_back():
    c = ReplicateConfig()
    c.replica_num = 3
    c.with_soft_pin = True
    c.with_hard_pin = True
    c.soft_pin_ttl_ms = 1234
    c.preferred_segment = "127.0.0.1:1"
    c.preferred_segments = ["a:1", "b:2"]
    c.prefer_alloc_in_same_node = True
    c.group_ids = ["g1", "g2"]
    assert (c.replica_num, c.with_soft_pin, c.with_hard_pin, c.soft_pin_ttl_ms) == (3, True, True, 1234)
    assert (c.preferred_segment, c.preferred_segments) == ("127.0.0.1:1", ["a:1", "b:2"])
    assert (c.prefer_alloc_in_same_node, c.group_ids) == (True, ["g1", "g2"])
    c.soft_pin_ttl_ms = None
    assert c.soft_pin_ttl_ms is None
    # configs are independent objects
    assert ReplicateConfig().group_ids is None


def test_soft_pin_action_enum_exists():
    from mooncake.store import SoftPinAction

    assert len(list(SoftPinAction.__members__)) >= 1


# ------------------------------------------------------------------ MooncakeConfig


def _write(tmp_path, conf, name="mooncake.json"):
    p = tmp_path / name
    p.write_text(json.dumps(conf))
    return str(p)


BASE = {
    "local_hostname": "node-1",
    "metadata_server": "P2PHANDSHAKE",
    "global_segment_size": 3355443200,
    "local_buffer_size": 1073741824,
    "protocol": "tcp",
    "device_name": "mlx5_0",
    "master_server_address": "127.0.0.1:50051",
}


def test_from_file(tmp_path):
    c = MooncakeConfig.from_file(_write(tmp_path, BASE))
    assert c.local_hostname == "node-1"
    assert c.metadata_server == "P2PHANDSHAKE"
    assert c.global_segment_size == 3355443200
    assert c.local_buffer_size == 1073741824
    assert c.protocol == "tcp"
    assert c.device_name == "mlx5_0"
    assert c.master_server_address == "127.0.0.1:50051"


@pytest.mark.parametrize(
    "text,value",
    [
        ("4GB", 4 * GiB),
        ("512MB", 512 * MiB),
        ("1.5g", int(1.5 * GiB)),
        ("64k", 64 * KiB),
        ("64KB", 64 * KiB),
        ("2tb", 2 << 40),
        ("3m", 3 * MiB),
        ("0.5Gb", GiB // 2),
        ("100", 100),
        (4096, 4096),
    ],
)
def test_from_file_human_sizes(tmp_path, text, value):
    conf = dict(BASE, global_segment_size=text, local_buffer_size=text)
    c = MooncakeConfig.from_file(_write(tmp_path, conf))
    assert c.global_segment_size == value
    assert c.local_buffer_size == value


@pytest.mark.parametrize("text", ["10%", "abc", "GB", ""])
def test_from_file_rejects_bad_sizes(tmp_path, text):
    with pytest.raises(BAD):
        MooncakeConfig.from_file(_write(tmp_path, dict(BASE, global_segment_size=text)))


def test_from_file_defaults_and_required_fields(tmp_path):
    minimal = {k: BASE[k] for k in ("local_hostname", "metadata_server", "master_server_address")}
    c = MooncakeConfig.from_file(_write(tmp_path, minimal))
    assert c.protocol == "tcp"
    assert c.global_segment_size > 0 and c.local_buffer_size > 0
    for missing in ("local_hostname", "metadata_server", "master_server_address"):
        conf = dict(minimal)
        del conf[missing]
        with pytest.raises(BAD):
            MooncakeConfig.from_file(_write(tmp_path, conf, "m-%s.json" % missing))


ENV_KEYS = [
    "MOONCAKE_CONFIG_PATH",
    "MOONCAKE_MASTER",
    "MOONCAKE_LOCAL_HOSTNAME",
    "MOONCAKE_TE_META_DATA_SERVER",
    "MOONCAKE_GLOBAL_SEGMENT_SIZE",
    "MOONCAKE_LOCAL_BUFFER_SIZE",
    "MOONCAKE_ENABLE_CLIENT_HTTP_SERVER",
    "MOONCAKE_CLIENT_HTTP_PORT",
    "MOONCAKE_PROTOCOL",
    "MOONCAKE_DEVICE",
]


@pytest.fixture
def clean_env(monkeypatch):
    for k in ENV_KEYS:
        monkeypatch.delenv(k, raising=False)
    return monkeypatch


def test_load_from_env_needs_a_master_or_a_path(clean_env):
    with pytest.raises(ValueError):
        MooncakeConfig.load_from_env()


def test_load_from_env_variables(clean_env):
    clean_env.setenv("MOONCAKE_MASTER", "127.0.0.1:50051")
    c = MooncakeConfig.load_from_env()
    assert c.master_server_address == "127.0.0.1:50051"
    assert c.metadata_server == "P2PHANDSHAKE"
    assert c.protocol == "tcp"
    clean_env.setenv("MOONCAKE_LOCAL_HOSTNAME", "10.1.2.3")
    clean_env.setenv("MOONCAKE_TE_META_DATA_SERVER", "http://127.0.0.1:8080/metadata")
    clean_env.setenv("MOONCAKE_GLOBAL_SEGMENT_SIZE", "1.5g")
    clean_env.setenv("MOONCAKE_LOCAL_BUFFER_SIZE", "512MB")
    clean_env.setenv("MOONCAKE_PROTOCOL", "rdma")
    clean_env.setenv("MOONCAKE_DEVICE", "mlx5_1")
    c = MooncakeConfig.load_from_env()
    assert c.local_hostname == "10.1.2.3"
    assert c.metadata_server == "http://127.0.0.1:8080/metadata"
    assert c.global_segment_size == int(1.5 * GiB)
    assert c.local_buffer_size == 512 * MiB
    assert (c.protocol, c.device_name) == ("rdma", "mlx5_1")
    clean_env.setenv("MOONCAKE_GLOBAL_SEGMENT_SIZE", "10%")
    with pytest.raises(BAD):
        MooncakeConfig.load_from_env()


def test_load_from_env_config_path_wins(clean_env, tmp_path):
    clean_env.setenv("MOONCAKE_CONFIG_PATH", _write(tmp_path, dict(BASE, global_segment_size="2GB")))
    clean_env.setenv("MOONCAKE_MASTER", "127.0.0.9:1")
    c = MooncakeConfig.load_from_env()
    assert c.master_server_address == "127.0.0.1:50051"
    assert c.global_segment_size == 2 * GiB


# ------------------------------------------------------------------ setup(dict)


def _dict_conf(master, **over):
    conf = {
        "local_hostname": "127.0.0.1",
        "metadata_server": master.metadata,
        "global_segment_size": "4MB",
        "local_buffer_size": "8mb",
        "protocol": "tcp",
        "rdma_devices": "",
        "master_server_addr": master.rpc,
    }
    conf.update(over)
    return conf


def test_setup_dict_form_with_human_sizes(private_master):
    s = MooncakeDistributedStore()
    assert s.setup(_dict_conf(private_master)) == 0
    try:
        assert s.health_check() == 0
        k = unique()
        v = pattern(MiB, 1)
        assert s.put(k, v) == 0
        assert s.get(k) == v
        # "4MB" meant 4 MiB of pool: 5 MiB cannot fit (the staging buffer is 8 MiB)
        assert s.put(unique(), pattern(5 * MiB, 2)) == -200
    finally:
        s.close()


def test_setup_dict_form_with_decimal_and_int_sizes(private_master):
    s = MooncakeDistributedStore()
    assert s.setup(_dict_conf(private_master, global_segment_size="0.25g", local_buffer_size=4 * MiB)) == 0
    try:
        k = unique()
        assert s.put(k, b"dict form") == 0
        assert s.get(k) == b"dict form"
    finally:
        s.close()


# ------------------------------------------------------------------ console scripts


def _script(name):
    path = os.path.join(os.path.dirname(sys.executable), name)
    if os.path.exists(path):
        return path
    found = shutil.which(name)
    assert found, "the package ships no %s console script" % name
    return found


class Proc:
    """A console-script process; its stderr goes to a temporary file (a pipe nobody
    reads could fill up and stall it)."""

    def __init__(self, argv):
        self.err = tempfile.TemporaryFile()
        self.p = subprocess.Popen(argv, stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=self.err)

    def stop(self):
        if self.p.poll() is None:
            self.p.terminate()
            try:
                self.p.wait(10)
            except subprocess.TimeoutExpired:
                self.p.kill()
                self.p.wait()
        self.err.seek(0)
        return self.err.read().decode(errors="replace")[-2000:]


def test_mooncake_master_console_script_with_upstream_flags():
    rpc, meta, metrics = free_port(), free_port(), free_port()
    proc = Proc(
        [
            _script("mooncake_master"),
            "--rpc_address=127.0.0.1",
            "--rpc_port=%d" % rpc,
            "--default_kv_lease_ttl=5000",
            "--enable_http_metadata_server=true",
            "--http_metadata_server_host=127.0.0.1",
            "--metrics_host=127.0.0.1",
            "--http_metadata_server_port=%d" % meta,
            "--metrics_port=%d" % metrics,
        ]
    )
    err = ""
    try:
        wait_until(
            lambda: proc.p.poll() is not None or (port_is_open("127.0.0.1", rpc) and port_is_open("127.0.0.1", meta)),
            "mooncake_master to listen",
            timeout=30,
            interval=0.05,
        )
        assert proc.p.poll() is None, "mooncake_master exited with %r" % proc.p.returncode
        s = MooncakeDistributedStore()
        assert (
            s.setup(
                "127.0.0.1",
                "http://127.0.0.1:%d/metadata" % meta,
                4 * MiB,
                4 * MiB,
                "tcp",
                "",
                "127.0.0.1:%d" % rpc,
            )
            == 0
        )
        try:
            k = unique()
            assert s.put(k, b"via the console script") == 0
            assert s.get(k) == b"via the console script"
        finally:
            s.close()
    finally:
        err = proc.stop()
    assert proc.p.returncode is not None, err


def test_mooncake_http_metadata_server_console_script():
    port = free_port()
    proc = Proc([_script("mooncake_http_metadata_server"), "--port", str(port)])
    try:
        wait_until(
            lambda: proc.p.poll() is not None or port_is_open("127.0.0.1", port),
            "mooncake_http_metadata_server to listen",
            timeout=30,
            interval=0.05,
        )
        assert proc.p.poll() is None, "exited with %r" % proc.p.returncode
        url = "http://127.0.0.1:%d/metadata" % port
        ends = []
        for seed in (1, 2):
            e = TransferEngine()
            name = "127.0.0.1:%d" % free_port()
            assert e.initialize(name, url, "tcp", "") == 0
            b = Buf(4096, content=pattern(4096, seed))
            assert e.register_memory(b.addr, 4096) == 0
            ends.append((e, name, b))
        (ea, na, ba), (eb, nb, bb) = ends
        assert ea.transfer_sync_write(nb, ba.addr, bb.addr, 4096) == 0
        assert bb.raw == pattern(4096, 1)
    finally:
        proc.stop()


# ---------------------------------------------------------- MooncakeConfig checks

def _config(**changes):
    fields = dict(local_hostname="h", metadata_server="P2PHANDSHAKE",
                  global_segment_size=0, local_buffer_size=0, protocol="tcp",
                  device_name="", master_server_address="m:50051")
    fields.update(changes)
    return MooncakeConfig(**fields)


def test_protocol_is_lower_cased_and_an_unknown_one_only_warns(caplog):
    assert _config(protocol="  RDMA ").protocol == "rdma"
    with caplog.at_level("WARNING", logger="mooncake.mooncake_config"):
        assert _config(protocol="Udp").protocol == "udp"
    assert "Unrecognised protocol 'udp'" in caplog.text
    for bad in ("", "  ", None):
        with pytest.raises(ValueError, match="protocol"):
            _config(protocol=bad)


@pytest.mark.parametrize("field", ["local_hostname", "metadata_server",
                                   "master_server_address"])
def test_required_fields_must_be_non_empty(field):
    with pytest.raises(ValueError, match=field):
        _config(**{field: "  "})


def test_negative_sizes_are_refused_naming_the_field():
    with pytest.raises(ValueError, match="local_buffer_size"):
        _config(local_buffer_size=-1)


def test_client_http_settings_from_file_and_environment(tmp_path, clean_env):
    path = tmp_path / "c.json"
    path.write_text(json.dumps({"local_hostname": "h", "metadata_server": "P2PHANDSHAKE",
                                "master_server_address": "m:1",
                                "enable_client_http_server": "enable",
                                "client_http_port": "19444"}))
    cfg = MooncakeConfig.from_file(str(path))
    assert (cfg.enable_client_http_server, cfg.client_http_port) == (True, 19444)
    assert cfg.to_setup_dict()["client_http_port"] == 19444
    path.write_text(json.dumps({"local_hostname": "h", "metadata_server": "P2PHANDSHAKE",
                                "master_server_address": "m:1", "client_http_port": "x"}))
    with pytest.raises(ValueError, match="client_http_port"):
        MooncakeConfig.from_file(str(path))
    clean_env.setenv("MOONCAKE_MASTER", "m:1")
    clean_env.setenv("MOONCAKE_ENABLE_CLIENT_HTTP_SERVER", "true")
    clean_env.setenv("MOONCAKE_CLIENT_HTTP_PORT", "9400")
    env_cfg = MooncakeConfig.load_from_env()
    assert (env_cfg.enable_client_http_server, env_cfg.client_http_port) == (True, 9400)


def test_upstreams_size_parser_name_and_forms():
    from mooncake.mooncake_config import _parse_segment_size

    assert _parse_segment_size("1e9") == 10**9
    assert _parse_segment_size("  3 gb ") == 3 << 30
    assert _parse_segment_size(1.5) == 1
    for bad in ("", "gb", "50%"):
        with pytest.raises(ValueError):
            _parse_segment_size(bad)
