"""Buffer access (``register_memory(..., access=...)``) and the cluster secret through
Python (docs/security.md): engines in this process over TCP on 127.0.0.1 with
``MC_CLUSTER_SECRET``, and a store against a ``mooncake master --cluster-secret-file``
with the secret in its JSON config."""

import json

import pytest

from fixtures_extra import *  # noqa: F401,F403

pytest.importorskip("mooncake.engine")
from mooncake.engine import TransferEngine  # noqa: E402

SECRET = "a python test cluster secret"


def engine():
    e = TransferEngine()
    assert e.initialize("127.0.0.1", "P2PHANDSHAKE", "tcp", "") == 0
    return e, "127.0.0.1:%d" % e.get_rpc_port()


def test_read_only_and_local_buffers_limit_what_peers_do():
    owner, owner_name = engine()
    peer, _ = engine()
    ro = Buf(4096, content=pattern(4096, 1))
    local = Buf(4096, content=pattern(4096, 2))
    assert owner.register_memory(ro.addr, ro.size, access="read_only") == 0
    assert owner.register_memory(local.addr, local.size, access="local") == 0
    mine = Buf(4096)
    assert peer.register_memory(mine.addr, mine.size) == 0
    # Read-only: readable, not writable.
    assert peer.transfer_sync_read(owner_name, mine.addr, ro.addr, 4096) == 0
    assert mine.raw == pattern(4096, 1)
    mine.write(0, b"x" * 4096)
    assert peer.transfer_sync_write(owner_name, mine.addr, ro.addr, 4096) < 0
    assert ro.raw == pattern(4096, 1)
    # Local: neither.
    assert peer.transfer_sync_read(owner_name, mine.addr, local.addr, 4096) < 0
    assert peer.transfer_sync_write(owner_name, mine.addr, local.addr, 4096) < 0
    assert local.raw == pattern(4096, 2)
    for e, b in ((owner, ro), (owner, local), (peer, mine)):
        assert e.unregister_memory(b.addr) == 0


def test_an_unknown_access_is_refused_before_anything_registers():
    e, _ = engine()
    b = Buf(4096)
    with pytest.raises(ValueError):
        e.register_memory(b.addr, b.size, access="write_only")
    # Nothing was registered: a normal registration of the same range succeeds.
    assert e.register_memory(b.addr, b.size) == 0
    assert e.unregister_memory(b.addr) == 0


def test_engines_sharing_mc_cluster_secret_transfer_and_others_are_refused(monkeypatch):
    monkeypatch.setenv("MC_CLUSTER_SECRET", SECRET)
    owner, owner_name = engine()
    friend, _ = engine()
    target = Buf(4096, content=pattern(4096, 3))
    assert owner.register_memory(target.addr, target.size) == 0
    got = Buf(4096)
    assert friend.register_memory(got.addr, got.size) == 0
    assert friend.transfer_sync_read(owner_name, got.addr, target.addr, 4096) == 0
    assert got.raw == pattern(4096, 3)
    monkeypatch.delenv("MC_CLUSTER_SECRET")
    stranger, _ = engine()
    theirs = Buf(4096, content=b"y" * 4096)
    assert stranger.register_memory(theirs.addr, theirs.size) == 0
    assert stranger.transfer_sync_write(owner_name, theirs.addr, target.addr, 4096) < 0
    assert stranger.transfer_sync_read(owner_name, theirs.addr, target.addr, 4096) < 0
    assert target.raw == pattern(4096, 3)
    assert theirs.raw == b"y" * 4096


def test_a_store_reaches_a_master_with_the_secret_only_when_it_has_it(mooncake_bin, tmp_path,
                                                                      monkeypatch):
    from mooncake.mooncake_config import MooncakeConfig
    from mooncake.store import MooncakeDistributedStore

    monkeypatch.delenv("MC_CLUSTER_SECRET", raising=False)
    secret_file = tmp_path / "secret"
    secret_file.write_text(SECRET + "\n")
    with start_master(mooncake_bin, "--cluster-secret-file", str(secret_file)) as m:
        conf = tmp_path / "c.json"
        conf.write_text(json.dumps({
            "local_hostname": "127.0.0.1", "metadata_server": m.metadata,
            "global_segment_size": 16 * MiB, "local_buffer_size": 4 * MiB, "protocol": "tcp",
            "master_server_address": m.rpc, "cluster_secret_file": str(secret_file),
        }))
        node = MooncakeDistributedStore()
        assert node.setup(MooncakeConfig.from_file(str(conf)).to_setup_dict()) == 0
        value = pattern(100_000, 5)
        assert node.put("secret-k", value) == 0
        assert bytes(node.get("secret-k")) == value
        # Without it (or with another), a client gets nowhere and changes nothing.
        for other in ({}, {"cluster_secret": "not the cluster secret at all"}):
            stranger = MooncakeDistributedStore()
            cfg = {"local_hostname": "127.0.0.1", "metadata_server": m.metadata,
                   "global_segment_size": 0, "local_buffer_size": 4 * MiB, "protocol": "tcp",
                   "master_server_addr": m.rpc, **other}
            assert stranger.setup(cfg) != 0
        assert bytes(node.get("secret-k")) == value
        assert node.close() == 0
