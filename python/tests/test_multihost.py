"""Mooncake across simulated hosts, launched the way upstream's users launch it.

Six network namespaces on a bridge (netns.py) stand in for six machines, each with only
its own address:

  host 1  mooncake_http_metadata_server --port 8080, mooncake_master (no flags), etcd
  host 2  a store client lending memory; an engine whose memory host 3 writes and reads
  host 3  a store client lending memory; the engine that writes and reads host 2
  host 4  the client that puts and gets (it lends nothing, so every byte crosses hosts)
  host 5  mooncake_master --enable_ha=true --etcd_endpoints=<host 1>:2379
  host 6  the same: one of the two leads, the other stands by

In the HA test the clients on hosts 2 and 4 find the leader through etcd, as upstream's
do (master_server_addr "etcd://<host 1>:2379"), and the leader is killed under them.

Every process passes its own address where upstream's users pass theirs and relies on
the products' defaults for the rest (ports 8080 and 50051, all interfaces), which is
why the fixed ports are fine here: each namespace has its own. Readiness is "another
host can connect", so a server bound to loopback only fails the test, with its stderr.
Bytes are checked end to end by SHA-256. Skipped when not root or without `ip netns`.
"""

import json
import os
import shutil
import sys

import pytest

import netns
from fixtures_extra import (KiB, MiB, digest, pattern, peer_buf, peer_call, peer_digest,
                            peer_fill, unique, wait_until)

pytest.importorskip("mooncake.store")

METADATA_HOST, LENDERS, CLIENT_HOST, HA_HOSTS = 1, (2, 3), 4, (5, 6)
MASTER_PORT, METADATA_PORT, ETCD_PORT = 50051, 8080, 2379
# etcd's key naming the leading master (upstream's layout, default cluster id).
MASTER_VIEW_KEY = "mooncake-store/mooncake_cluster/master_view"
# A failover waits out the dead leader's lease (5 s by default) and a client's ping.
FAILOVER_TIMEOUT_S = 45.0


def console_script(name, function):
    """How to run our console script `name`: from the venv's bin next to this Python
    (pip-installed, as in CI), else through mooncake.cli.`function` with this Python
    (a checkout on PYTHONPATH)."""
    installed = os.path.join(os.path.dirname(sys.executable), name)
    if os.path.isfile(installed) and os.access(installed, os.X_OK):
        return [installed]
    return [sys.executable, "-c", "from mooncake.cli import %s; %s()" % (function, function)]


MOONCAKE_MASTER = console_script("mooncake_master", "master_main")
METADATA_SERVER = console_script("mooncake_http_metadata_server", "http_metadata_server_main")


@pytest.fixture(scope="module")
def network():
    """Six simulated hosts for the module (torn down after it, also on failure)."""
    why_not = netns.unavailable()
    if why_not:
        pytest.skip(why_not)
    try:
        simulated = netns.Hosts(6)
    except netns.NetnsUnavailable as e:
        pytest.skip("cannot simulate hosts: %s" % e)
    with simulated:
        yield simulated


@pytest.fixture
def hosts(network):
    """The simulated hosts, for one test: what it starts there is stopped after it."""
    with network.scoped():
        yield network


@pytest.fixture(scope="module")
def metadata_url(network):
    server = network.start(METADATA_HOST, "mooncake_http_metadata_server",
                           METADATA_SERVER + ["--port", METADATA_PORT])
    netns.wait_listening(network, CLIENT_HOST, server, network.ip(METADATA_HOST),
                         METADATA_PORT)
    return "http://%s:%d/metadata" % (network.ip(METADATA_HOST), METADATA_PORT)


@pytest.fixture(scope="module")
def master_address(network, metadata_url):
    """mooncake_master with no flags, next to the metadata server (started first, so a
    master that still embeds one on 8080 fails here, saying so)."""
    server = network.start(METADATA_HOST, "mooncake_master", MOONCAKE_MASTER)
    netns.wait_listening(network, CLIENT_HOST, server, network.ip(METADATA_HOST),
                         MASTER_PORT)
    return "%s:%d" % (network.ip(METADATA_HOST), MASTER_PORT)


def start_store(hosts, tmp_path, host, metadata, master, segment):
    """A store client on `host`, set up like vLLM's connector does it: a JSON config read
    by MooncakeConfig.from_file, then setup() with the seven positional settings, its
    own address as local_hostname. Returns the peer; its segment must carry that
    address."""
    config = tmp_path / ("store-host%d-%s.json" % (host, unique("c")))
    config.write_text(json.dumps({
        "local_hostname": hosts.ip(host),
        "metadata_server": metadata,
        "global_segment_size": segment,
        "local_buffer_size": 32 * MiB,
        "protocol": "tcp",
        "device_name": "",
        "master_server_address": master,
    }))
    child, ready = hosts.start_peer(host, "peer.py", "store", str(config), "file",
                                    what="store client")
    assert ready[0].startswith(hosts.ip(host) + ":"), \
        "the store client on host %d names itself %r, not by its own address" % (host, ready[0])
    return child


def put_from(peer, key, size, seed):
    """peer registers a buffer holding pattern(size, seed) and puts it under `key`;
    returns put_from's code."""
    addr = peer_buf(peer, size, seed)
    return peer_call(peer, "put_from", key, addr, size)


def expected(size, seed):
    """What `get` of pattern(size, seed) answers through a peer."""
    return {"sha256": digest(pattern(size, seed)), "len": size}


def test_objects_put_on_one_host_are_read_byte_exact_on_others(hosts, metadata_url,
                                                               master_address, tmp_path):
    readers = [start_store(hosts, tmp_path, h, metadata_url, master_address, 64 * MiB)
               for h in LENDERS]
    writer = start_store(hosts, tmp_path, CLIENT_HOST, metadata_url, master_address, 0)

    singles = {unique("one-byte"): (1, 11), unique("odd"): (4 * KiB + 3, 12),
               unique("mib"): (MiB, 13), unique("multi-mib"): (5 * MiB + 7, 14)}
    for key, (size, seed) in singles.items():
        assert put_from(writer, key, size, seed) == 0, key
    batch = {unique("batch-%d" % i): (64 * KiB + i, 100 + i) for i in range(8)}
    addrs = [peer_buf(writer, size, seed) for size, seed in batch.values()]
    sizes = [size for size, _ in batch.values()]
    assert peer_call(writer, "batch_put_from", list(batch), addrs, sizes) == [0] * len(batch)

    for reader in readers:
        for key, (size, seed) in {**singles, **batch}.items():
            assert peer_call(reader, "get", key) == expected(size, seed), (reader.what, key)
    assert peer_call(readers[0], "get_batch", list(batch)) == \
        [expected(size, seed) for size, seed in batch.values()]


def test_an_engine_writes_and_reads_memory_another_host_registered(hosts, metadata_url):
    def engine(host):
        env = {"MC_PEER_METADATA": metadata_url, "MC_PEER_HOST": hosts.ip(host)}
        return hosts.start_peer(host, "peer.py", "engine", what="TransferEngine", env=env)

    target, ready = engine(LENDERS[0])
    session = ready[0]
    assert session.split(":")[0] == hosts.ip(LENDERS[0]), session
    initiator, _ = engine(LENDERS[1])
    size = 4 * MiB + 13
    remote = peer_buf(target, size)  # zeros, registered with the engine

    local = peer_buf(initiator, size, 31)
    assert peer_call(initiator, "transfer_sync_write", session, local, remote, size) == 0
    assert peer_digest(target, remote, size) == digest(pattern(size, 31))

    peer_fill(target, remote, size, 32)
    back = peer_buf(initiator, size)
    assert peer_call(initiator, "transfer_sync_read", session, back, remote, size) == 0
    assert peer_digest(initiator, back, size) == digest(pattern(size, 32))


def start_etcd(hosts, tmp_path):
    """etcd on host 1 at its default ports, serving every interface; returns its
    endpoint (host:port)."""
    if shutil.which("etcd") is None:
        pytest.skip("etcd is not installed (Debian: apt-get install etcd-server)")
    ip = hosts.ip(METADATA_HOST)
    client, peer = "http://%s:%d" % (ip, ETCD_PORT), "http://%s:%d" % (ip, ETCD_PORT + 1)
    server = hosts.start(METADATA_HOST, "etcd", [
        "etcd", "--name", "host1", "--data-dir", tmp_path / "etcd",
        "--listen-client-urls", "http://0.0.0.0:%d" % ETCD_PORT,
        "--advertise-client-urls", client,
        "--listen-peer-urls", peer, "--initial-advertise-peer-urls", peer,
        "--initial-cluster", "host1=" + peer])
    netns.wait_listening(hosts, CLIENT_HOST, server, ip, ETCD_PORT)
    return "%s:%d" % (ip, ETCD_PORT)


def test_an_ha_client_follows_the_new_leader_when_the_leader_dies(hosts, metadata_url,
                                                                  tmp_path):
    endpoint = start_etcd(hosts, tmp_path)
    masters = {h: hosts.start(h, "mooncake_master --enable_ha=true", MOONCAKE_MASTER + [
        "--enable_ha=true", "--etcd_endpoints=" + endpoint]) for h in HA_HOSTS}
    own_address = {"%s:%d" % (hosts.ip(h), MASTER_PORT): h for h in HA_HOSTS}
    observer, _ = hosts.start_peer(CLIENT_HOST, "probe.py", what="etcd observer")

    def leader():
        answer = observer.ask("etcd-get %s %s" % (endpoint, MASTER_VIEW_KEY))
        return answer[len("ok"):].strip()

    def any_leader():
        for m in masters.values():
            m.check_running("a master led")
        return leader()

    first = wait_until(any_leader, "a master to lead (etcd's master view)")
    assert first in own_address, \
        "etcd names the leader %r: it must advertise its own routable address (%s), " \
        "never 0.0.0.0 or 127.0.0.1" % (first, " or ".join(own_address))
    old, new = own_address[first], next(h for h in HA_HOSTS if h != own_address[first])
    netns.wait_listening(hosts, CLIENT_HOST, masters[old], hosts.ip(old), MASTER_PORT)

    master = "etcd://" + endpoint
    lender = start_store(hosts, tmp_path, LENDERS[0], metadata_url, master, 32 * MiB)
    client = start_store(hosts, tmp_path, CLIENT_HOST, metadata_url, master, 0)
    before = unique("before-failover")
    assert put_from(client, before, 2 * MiB + 1, 41) == 0
    assert peer_call(client, "get", before) == expected(2 * MiB + 1, 41)

    def next_leader():
        masters[new].check_running("the standby took over")
        view = leader()
        return view not in ("", first) and view

    masters[old].kill()
    second = wait_until(next_leader, "the standby on host %d to lead" % new,
                        timeout=FAILOVER_TIMEOUT_S, interval=0.1)
    assert second == "%s:%d" % (hosts.ip(new), MASTER_PORT)

    # The same clients, unchanged: the lender remounts on the new leader at its next
    # ping, so the first puts may fail; each try uses a fresh key.
    size, seed = 3 * MiB + 5, 42
    value = peer_buf(client, size, seed)

    def put_on_new_leader():
        key = unique("after-failover")
        return peer_call(client, "put_from", key, value, size) == 0 and key

    after = wait_until(put_on_new_leader, "a put to succeed through the new leader",
                       timeout=FAILOVER_TIMEOUT_S, interval=0.1)
    assert peer_call(client, "get", after) == expected(size, seed)
    assert peer_call(lender, "get", after) == expected(size, seed)
