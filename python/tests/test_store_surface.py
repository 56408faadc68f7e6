"""MooncakeDistributedStore's sessions (ranged multi-buffer puts and gets), copy and move
tasks, extra segments, init_all, alloc_from_mem_pool and the offload read count, against
a real master (upstream's argument forms and return conventions)."""

import copy
import ctypes
import pickle

import pytest

from fixtures_extra import *  # noqa: F401,F403

pytest.importorskip("mooncake.store")
from mooncake.store import (  # noqa: E402
    MooncakeDistributedStore,
    QueryTaskResponse,
    ReplicateConfig,
    TaskStatus,
    TaskType,
)

INVALID_PARAMS = -600
INVALID_KEY = -400
SEGMENT_NOT_FOUND = -101
NO_AVAILABLE_HANDLE = -200
OBJECT_NOT_FOUND = -704
OBJECT_ALREADY_EXISTS = -705
FILE_NOT_FOUND = -1100
TASK_NOT_FOUND = -1400


def registered(store, size, content=None):
    b = Buf(size, content=content)
    assert store.register_buffer(b.addr, size) == 0
    return b


def segments_of(store, key):
    """The set of segments each replica of ``key`` lies on."""
    return sorted(
        sorted({p.transport_endpoint for p in r.get_memory_descriptor().buffer_descriptors})
        for r in store.get_replica_desc(key))


def test_a_config_changed_between_puts_is_followed(master, store_factory):
    """A config's C form is built once per state and reused: a change made between two
    puts, in place on its list too, must still reach the second put."""
    a = store_factory(master, 8 * MiB, 4 * MiB)
    b = store_factory(master, 8 * MiB, 4 * MiB)
    buf = ctypes.create_string_buffer(b"x" * 4096)
    addr = ctypes.addressof(buf)
    assert a.register_buffer(addr, 4096) == 0
    cfg = ReplicateConfig()
    cfg.preferred_segments = [a.get_hostname()]
    first, second, third = unique(), unique(), unique()
    assert a.put_from(first, addr, 4096, cfg) == 0
    cfg.preferred_segments = [b.get_hostname()]
    assert a.put_from(second, addr, 4096, cfg) == 0
    cfg.preferred_segments[0] = a.get_hostname()
    assert a.put_from(third, addr, 4096, cfg) == 0
    assert segments_of(a, first) == [[a.get_hostname()]]
    assert segments_of(a, second) == [[b.get_hostname()]]
    assert segments_of(a, third) == [[a.get_hostname()]]
    # A put given no config twice stores both the default way.
    for k in (unique(), unique()):
        assert a.put_from(k, addr, 4096) == 0
        assert a.is_exist(k) == 1
    # A config used in puts still copies and pickles (its C form stays behind), and the
    # copies work.
    for twin in (copy.copy(cfg), copy.deepcopy(cfg), pickle.loads(pickle.dumps(cfg))):
        assert repr(twin) == repr(cfg)
        k = unique()
        assert a.put_from(k, addr, 4096, twin) == 0
        assert segments_of(a, k) == [[a.get_hostname()]]


def finished(store, task_id):
    """Polls ``task_id`` until it is final; its QueryTaskResponse."""
    final = (TaskStatus.SUCCESS, TaskStatus.FAILED)
    wait_until(lambda: store.query_task(task_id)[0].status in final, "task to finish",
               timeout=30)
    resp, rc = store.query_task(task_id)
    assert rc == 0
    return resp


# ------------------------------------------------------------------ sessions


def test_put_session_is_visible_only_after_its_end(master_factory, store_factory):
    m = master_factory()
    s = store_factory(m, segment=32 * MiB)
    page, layers = 4096, 4
    keys = [unique("sess"), unique("sess")]
    src = [registered(s, page, pattern(page, 10 + i)) for i in range(layers)]
    assert s.batch_put_session_start(keys, [page * layers] * 2) == [0, 0]
    assert s.batch_is_exist(keys) == [0, 0]
    assert s.batch_put_session_start(keys[:1], [page]) == [INVALID_PARAMS], "open already"
    # Layers in reverse order; each key gets every layer.
    for layer in reversed(range(layers)):
        rcs = s.batch_put_from_multi_buffer_ranges(
            keys, [[src[layer].addr]] * 2, [[page]] * 2, [[layer * page]] * 2)
        assert rcs == [page, page]
    assert s.batch_is_exist(keys) == [0, 0], "still invisible"
    assert s.batch_put_session_end(keys) == [0, 0]
    whole = b"".join(b.raw for b in src)
    assert [s.get(k) for k in keys] == [whole, whole]
    # Ended: no more writes; a second end finds no session.
    assert s.batch_put_from_multi_buffer_ranges(keys[:1], [[src[0].addr]], [[page]],
                                                [[0]]) == [INVALID_PARAMS]
    assert s.batch_put_session_end(keys[:1]) == [INVALID_PARAMS]
    # An existing key cannot be reserved again.
    assert s.batch_put_session_start(keys[:1], [page]) == [OBJECT_ALREADY_EXISTS]


def test_revoked_put_session_leaves_nothing(master_factory, store_factory):
    m = master_factory()
    s = store_factory(m, segment=16 * MiB)
    k = unique("rev")
    b = registered(s, 8192, pattern(8192, 3))
    assert s.batch_put_session_start([k], [8192]) == [0]
    assert s.batch_put_from_multi_buffer_ranges([k], [[b.addr]], [[8192]], [[0]]) == [8192]
    assert s.batch_put_session_revoke([k, unique("none")]) == [0, INVALID_PARAMS]
    assert s.is_exist(k) == 0
    assert s.get(k) == b""
    assert s.batch_put_session_revoke([k]) == [INVALID_PARAMS], "gone with the revoke"
    # The key is free again.
    assert s.put(k, b.raw) == 0


def test_multi_buffer_ranges_roundtrip_byte_exact(master_factory, store_factory):
    m = master_factory()
    s = store_factory(m, segment=32 * MiB)
    size = 10_000
    data = pattern(size, 7)
    # Uneven pieces from three buffers, written out of order and with one overlap
    # (the end then reads the object back for its checksum).
    a, b, c = (registered(s, 6000, data[:6000]), registered(s, 3000, data[6000:9000]),
               registered(s, 1000, data[9000:]))
    k1, k2 = unique("mb"), unique("mb")
    assert s.batch_put_session_start([k1, k2], [size, size]) == [0, 0]
    rcs = s.batch_put_from_multi_buffer_ranges(
        [k1, k2],
        [[c.addr, a.addr, b.addr], [a.addr, a.addr + 100, b.addr, c.addr]],
        [[1000, 6000, 3000], [6000, 50, 3000, 1000]],
        [[9000, 0, 6000], [0, 100, 6000, 9000]])
    assert rcs == [size, size + 50]
    assert s.batch_put_session_end([k1, k2]) == [0, 0]
    assert s.get(k1) == data and s.get(k2) == data
    # A get session reads ranges into several buffers, byte for byte.
    out = [registered(s, 4000), registered(s, 5000), registered(s, 1000)]
    assert s.batch_get_session_start([k1, unique("missing")]) == [0, OBJECT_NOT_FOUND]
    rcs = s.batch_get_into_multi_buffer_ranges(
        [k1], [[o.addr for o in out]], [[4000, 5000, 1000]], [[6000, 1000, 0]])
    assert rcs == [size]
    assert out[0].raw == data[6000:]
    assert out[1].raw == data[1000:6000]
    assert out[2].raw == data[:1000]
    # A range past the end fails its key alone.
    rcs = s.batch_get_into_multi_buffer_ranges(
        [k1, k1], [[out[2].addr], [out[2].addr]], [[1000], [10]], [[9500], [0]])
    assert rcs == [INVALID_PARAMS, 10]
    assert s.batch_get_session_end([k1]) == 0
    assert s.batch_get_into_multi_buffer_ranges(
        [k1], [[out[2].addr]], [[10]], [[0]]) == [INVALID_PARAMS], "session ended"


def test_bad_session_arguments_change_nothing(master_factory, store_factory):
    m = master_factory()
    s = store_factory(m, segment=16 * MiB)
    k = unique("bad")
    b = registered(s, 4096, pattern(4096, 1))
    with pytest.raises(TypeError):
        s.batch_put_session_start(k, [10])
    with pytest.raises(TypeError):
        s.batch_put_session_start([k], ["10"])
    with pytest.raises(TypeError):
        s.batch_put_session_start([k], [10], config="x")
    with pytest.raises(TypeError):
        s.batch_put_from_multi_buffer_ranges([k], [[b.addr]], [["1"]], [[0]])
    assert s.batch_put_session_start([k, unique()], [10]) == [INVALID_PARAMS] * 2
    assert s.batch_put_session_start([""], [10]) == [INVALID_KEY]
    assert s.batch_put_session_start([k], [0]) == [INVALID_PARAMS]
    assert s.is_exist(k) == 0
    assert s.batch_put_session_start([k], [4096]) == [0]
    # Unregistered memory, lists that disagree, a range past the end: refused per key.
    loose = Buf(64)
    assert s.batch_put_from_multi_buffer_ranges([k], [[loose.addr]], [[64]], [[0]]) \
        == [INVALID_PARAMS]
    assert s.batch_put_from_multi_buffer_ranges([k], [[b.addr]], [[10, 20]], [[0]]) \
        == [INVALID_PARAMS]
    assert s.batch_put_from_multi_buffer_ranges([k, k], [[b.addr]], [[10]], [[0]]) \
        == [INVALID_PARAMS] * 2
    assert s.batch_put_from_multi_buffer_ranges([k], [[b.addr]], [[100]], [[4000]]) \
        == [INVALID_PARAMS]
    assert s.batch_put_from_multi_buffer_ranges([k], [[b.addr]], [[4096]], [[0]]) == [4096]
    assert s.batch_put_session_end([k]) == [0]
    assert s.get(k) == b.raw


def test_calls_before_setup():
    s = MooncakeDistributedStore()
    assert s.batch_put_session_start(["a"], [1]) == [INVALID_PARAMS]
    assert s.batch_put_session_end(["a"]) == [INVALID_PARAMS]
    assert s.batch_get_session_end(["a"]) == INVALID_PARAMS
    assert s.create_copy_task("a", ["x"]) == ((0, 0), INVALID_PARAMS)
    assert s.query_task((1, 2)) == (None, INVALID_PARAMS)
    assert s.mount_segment("/dev/null", 4096) == {"ret": INVALID_PARAMS, "segment_ids": []}
    assert s.allocate_and_mount_segment(4096)["ret"] == INVALID_PARAMS
    assert s.unmount_segment(["1-2"]) == INVALID_PARAMS
    assert s.unmount_local_disk_segment() == INVALID_PARAMS
    assert s.alloc_from_mem_pool(4096) == 0
    assert s.get_offload_rpc_read_count() == 0


# ------------------------------------------------------------------ segments


def test_extra_segments_change_what_the_master_can_place_on(master_factory, store_factory, tmp_path):
    m = master_factory()
    s = store_factory(m, segment=0)
    v = pattern(50_000, 5)
    assert s.put(unique(), v) == NO_AVAILABLE_HANDLE, "no segment in the pool"
    got = s.allocate_and_mount_segment(5 * MiB)
    assert got["ret"] == 0 and got["allocated_size"] == 8 * MiB
    [seg] = got["segment_ids"]
    k = unique("x")
    assert s.put(k, v) == 0
    assert segments_of(s, k) == [[s.get_hostname()]]
    assert s.unmount_segment([seg]) == SEGMENT_NOT_FOUND, "not a mount_segment id"
    assert s.unmount_and_free_segment([seg]) == 0
    assert s.is_exist(k) == 0, "its only replica went with the segment"
    assert s.put(unique(), v) == NO_AVAILABLE_HANDLE
    assert s.unmount_and_free_segment([seg, "1-2"]) == SEGMENT_NOT_FOUND
    # A file mapped as a segment: stored bytes land in the file.
    path = tmp_path / "segment"
    path.write_bytes(b"\0" * (8 * MiB))
    got = s.mount_segment(str(path), 4 * MiB, offset=4096)
    assert got["ret"] == 0 and len(got["segment_ids"]) == 1
    k = unique("f")
    assert s.put(k, v) == 0
    assert v in path.read_bytes()
    assert s.get(k) == v
    assert s.unmount_segment(got["segment_ids"]) == 0
    assert s.is_exist(k) == 0


def test_bad_segment_arguments_change_nothing(master_factory, store_factory, tmp_path):
    m = master_factory()
    s = store_factory(m, segment=0)
    small = tmp_path / "small"
    small.write_bytes(b"\0" * 8192)
    assert s.mount_segment(str(tmp_path / "none"), 4096)["ret"] == FILE_NOT_FOUND
    assert s.mount_segment(str(small), 1 << 20)["ret"] == INVALID_PARAMS, "past the end"
    assert s.mount_segment(str(small), 4096, offset=100)["ret"] == INVALID_PARAMS
    assert s.allocate_and_mount_segment(0)["ret"] == INVALID_PARAMS
    assert s.allocate_and_mount_segment(4096, location="cuda:x")["ret"] == INVALID_PARAMS
    with pytest.raises(TypeError):
        s.mount_segment(b"/x", 4096)
    with pytest.raises(ValueError):
        s.mount_segment(str(small), -1)
    with pytest.raises(TypeError):
        s.unmount_segment("1-2")
    with pytest.raises(ValueError):
        s.unmount_segment(["1-2"], grace_period_seconds=-1)
    assert s.unmount_segment(["1-2"]) == SEGMENT_NOT_FOUND
    assert s.put(unique(), b"x" * 100) == NO_AVAILABLE_HANDLE, "nothing got mounted"
    # No disk tier: nothing to unmount (upstream answers 0 with a warning).
    assert s.unmount_local_disk_segment() == 0


# ------------------------------------------------------------------ tasks


def test_copy_and_move_tasks_put_replicas_on_target_segments(master_factory, store_factory):
    m = master_factory()
    node = store_factory(m, segment=32 * MiB)
    s = store_factory(m, segment=0)
    assert s.allocate_and_mount_segment(16 * MiB)["ret"] == 0
    a, b = node.get_hostname(), s.get_hostname()
    cfg = ReplicateConfig()
    cfg.preferred_segment = a
    v = pattern(200_000, 9)
    k, mv = unique("copy"), unique("move")
    assert s.put(k, v, cfg) == 0 and s.put(mv, v, cfg) == 0
    assert segments_of(s, k) == [[a]]

    task, rc = s.create_copy_task(k, [b])
    assert rc == 0 and isinstance(task, tuple) and task != (0, 0)
    resp = finished(s, task)
    assert isinstance(resp, QueryTaskResponse)
    assert (resp.id, resp.type, resp.status) == (task, TaskType.REPLICA_COPY, TaskStatus.SUCCESS)
    assert resp.created_at_ms_epoch <= resp.last_updated_at_ms_epoch
    assert segments_of(s, k) == sorted([[a], [b]])
    assert node.get(k) == v

    task, rc = s.create_move_task(mv, a, b)
    assert rc == 0
    resp = finished(s, task)
    assert (resp.type, resp.status) == (TaskType.REPLICA_MOVE, TaskStatus.SUCCESS), resp
    assert segments_of(s, mv) == [[b]]
    assert node.get(mv) == v
    # Only the store that created a task knows it.
    assert node.query_task(task) == (None, TASK_NOT_FOUND)
    assert s.query_task((task[0], task[1] + 1000)) == (None, TASK_NOT_FOUND)


def test_refused_tasks_create_nothing(master_factory, store_factory):
    m = master_factory()
    node = store_factory(m, segment=16 * MiB)
    a = node.get_hostname()
    k = unique("t")
    assert node.put(k, b"y" * 5000) == 0
    assert node.create_copy_task(k, ["nowhere:1"]) == ((0, 0), INVALID_PARAMS)
    assert node.create_copy_task(k, []) == ((0, 0), INVALID_PARAMS)
    assert node.create_copy_task(unique("none"), [a]) == ((0, 0), OBJECT_NOT_FOUND)
    assert node.create_copy_task("", [a]) == ((0, 0), INVALID_KEY)
    assert node.create_move_task(k, a, a) == ((0, 0), INVALID_PARAMS)
    assert node.create_move_task(k, "nowhere:1", a) == ((0, 0), INVALID_PARAMS)
    with pytest.raises(TypeError):
        node.create_copy_task(k, a)
    with pytest.raises(TypeError):
        node.query_task("1-2")
    with pytest.raises(TypeError):
        node.create_move_task(k, a, None)
    assert segments_of(node, k) == [[a]]


# ------------------------------------------------------------------ the rest


def test_init_all_sets_up_from_the_environment(master_factory, store_factory, monkeypatch):
    m = master_factory()
    store_factory(m, segment=16 * MiB)  # a node for the objects
    monkeypatch.setenv("MOONCAKE_MASTER", m.rpc)
    monkeypatch.setenv("MOONCAKE_TE_META_DATA_SERVER", m.metadata)
    monkeypatch.setenv("MOONCAKE_LOCAL_HOSTNAME", "127.0.0.1")
    s = MooncakeDistributedStore()
    try:
        assert s.init_all("tcp", "", 16 * MiB) == 0
        k = unique("ia")
        assert s.put(k, b"z" * 1000) == 0 and s.get(k) == b"z" * 1000
        assert s.init_all("tcp", "") == INVALID_PARAMS, "set up already"
    finally:
        s.close()


def test_alloc_from_mem_pool_serves_zero_copy_calls(master_factory, store_factory):
    m = master_factory()
    s = store_factory(m, segment=16 * MiB)
    assert s.alloc_from_mem_pool(0) == 0
    addr = s.alloc_from_mem_pool(8192)
    assert addr != 0
    data = pattern(8192, 4)
    ctypes.memmove(addr, data, 8192)
    k = unique("pool")
    assert s.put_from(k, addr, 8192) == 0
    ctypes.memset(addr, 0, 8192)
    assert s.get_into(k, addr, 8192) == 8192
    assert ctypes.string_at(addr, 8192) == data
    assert s.get_offload_rpc_read_count() == 0, "no disk tier served a read"
