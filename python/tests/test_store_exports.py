"""The names upstream's ``mooncake.store`` exports besides the store class itself: enums
and their module-level values, ``Descriptor``, ReplicateConfig's NVMe-oF, DFS and data
type fields (and what puts with configs upstream refuses get here), the allocator
callbacks, NUMA binding, the NVMe-oF registration class and the buffer pool's classes."""

import ctypes
import pickle
import textwrap

import pytest

from fixtures_extra import *  # noqa: F401,F403

pytest.importorskip("mooncake.store")
import mooncake.store as S  # noqa: E402

INVALID_PARAMS = -600
NO_AVAILABLE_HANDLE = -200
OBJECT_NOT_FOUND = -704
DFS_SERVICE_UNAVAILABLE = -1601


# Every public name of the 0.3.13.post1 wheel's mooncake.store (its dir(), underscored
# helpers aside). Left out: _get_pyclient_from_wrapper, a handle to upstream's C++ client.
UPSTREAM_NAMES = """
ACTIVATION BufferHandle BufferLease BufferLeaseView BufferPool COMPLETE Descriptor
DiskDescriptor EngramStore EngramStoreConfig FAILED GENERAL GRADIENT INITIALIZED KVCACHE
METADATA MemoryDescriptor MooncakeDistributedNoFRegister MooncakeDistributedStore
MooncakeHostMemAllocator OPTIMIZER_STATE ObjectDataType PENDING PROCESSING ParallelAxis
QueryTaskResponse REMOVED REPLICA_COPY REPLICA_MOVE ReadTarget RegisteredBufferLease
RegisteredBufferLeaseView RegisteredBufferPool ReplicaDescriptor ReplicaStatus
ReplicateConfig SAMPLE SUCCESS SoftPinAction TENSOR TaskStatus TaskType TensorParallelism
UNDEFINED UNKNOWN WEIGHT _deserialize_tensor _serialize_tensor _tensor_metadata_size
bind_to_numa_node get_alloc_func_addr get_free_func_addr
""".split()


def test_every_name_of_upstreams_module_is_here_and_listed():
    missing = [n for n in UPSTREAM_NAMES if not hasattr(S, n)]
    assert missing == []
    assert set(UPSTREAM_NAMES) <= set(dir(S))


# ------------------------------------------------------------------ enums and values


def test_object_data_type_has_upstreams_members_and_numbers():
    assert [(m.name, int(m)) for m in S.ObjectDataType] == [
        ("UNKNOWN", 0), ("KVCACHE", 1), ("TENSOR", 2), ("WEIGHT", 3), ("SAMPLE", 4),
        ("ACTIVATION", 5), ("GRADIENT", 6), ("OPTIMIZER_STATE", 7), ("METADATA", 8),
        ("GENERAL", 9)]


def test_enum_members_are_exported_at_module_level_as_upstream_does():
    for enum in (S.ObjectDataType, S.ReplicaStatus, S.TaskType):
        for member in enum:
            if member.name not in ("PROCESSING", "FAILED"):
                assert getattr(S, member.name) is member
    # Names two enums share are TaskStatus's (upstream registers it last).
    for member in S.TaskStatus:
        assert getattr(S, member.name) is member
    assert S.COMPLETE is S.ReplicaStatus.COMPLETE
    assert "SoftPinAction" in dir(S) and not hasattr(S, "PRESERVE")  # not exported


def test_buffer_pool_classes_are_reachable_and_listed():
    from mooncake import buffer_pool

    for name in ("BufferPool", "RegisteredBufferPool", "BufferLease", "RegisteredBufferLease",
                 "BufferLeaseView", "RegisteredBufferLeaseView"):
        assert getattr(S, name) is getattr(buffer_pool, name)
        assert name in dir(S)
    with pytest.raises(AttributeError):
        S.NoSuchName  # noqa: B018


# ------------------------------------------------------------------ Descriptor


def test_descriptor_starts_empty_and_checks_its_fields():
    d = S.Descriptor()
    assert (d.size, d.buffer_address, d.transport_endpoint) == (0, 0, "")
    d.size, d.buffer_address, d.transport_endpoint = 7, 1 << 40, "10.0.0.1:1234"
    assert repr(d) == ("<Descriptor size=7 buffer_address=1099511627776 "
                       "transport_endpoint=10.0.0.1:1234>")
    for field, bad in (("size", -1), ("size", "7"), ("buffer_address", 1 << 64),
                       ("transport_endpoint", 3)):
        with pytest.raises(TypeError):
            setattr(d, field, bad)
    assert (d.size, d.buffer_address) == (7, 1 << 40)  # a refused value changes nothing
    with pytest.raises(TypeError):
        S.Descriptor(1)


# ------------------------------------------------------------------ ReplicateConfig


def test_new_config_fields_default_check_and_survive_a_pickle():
    c = S.ReplicateConfig()
    assert (c.data_type, c.nof_replica_num, c.dfs_replica_num, c.preferred_nof_segments,
            c.group_ids) == (S.ObjectDataType.UNKNOWN, 0, 0, [], None)
    for field, bad in (("data_type", 1), ("nof_replica_num", -1), ("nof_replica_num", True),
                       ("dfs_replica_num", "1"), ("preferred_nof_segments", "ab"),
                       ("preferred_nof_segments", [1])):
        with pytest.raises(TypeError):
            setattr(c, field, bad)
    c.data_type, c.nof_replica_num, c.dfs_replica_num = S.WEIGHT, 2, 1
    c.preferred_nof_segments = ["nvme-a"]
    back = pickle.loads(pickle.dumps(c))
    assert (back.data_type, back.nof_replica_num, back.dfs_replica_num,
            back.preferred_nof_segments) == (S.WEIGHT, 2, 1, ["nvme-a"])


def test_config_text_is_upstreams():
    c = S.ReplicateConfig()
    assert str(c) == (
        "ReplicateConfig: { replica_num: 1, nof_replica_num: 0, dfs_replica_num: 0, "
        "soft_pin_action: PRESERVE, soft_pin_ttl_ms: default, with_hard_pin: 0, "
        "preferred_segments: [], preferred_nof_segments: [], prefer_alloc_in_same_node: 0, "
        "data_type: UNKNOWN }")
    c.nof_replica_num, c.soft_pin_ttl_ms, c.with_hard_pin = 2, 5, True
    c.preferred_segment, c.preferred_nof_segments = "x", ["n1", "n2"]
    c.data_type, c.group_ids = S.KVCACHE, ["a", "b"]
    assert str(c) == (
        "ReplicateConfig: { replica_num: 1, nof_replica_num: 2, dfs_replica_num: 0, "
        "soft_pin_action: PRESERVE, soft_pin_ttl_ms: 5, with_hard_pin: 1, "
        "preferred_segments: [], preferred_segment (deprecated): x, "
        "preferred_nof_segments: [n1, n2], prefer_alloc_in_same_node: 0, data_type: KVCACHE, "
        "group_ids: [a, b] }")


def _config(**fields):
    c = S.ReplicateConfig()
    for name, value in fields.items():
        setattr(c, name, value)
    return c


# (fields, what a put answers): upstream's client and master without NVMe-oF and DFS
# backends, checked against the 0.3.13.post1 wheel's own master and client.
REFUSALS = [
    (dict(nof_replica_num=1), INVALID_PARAMS),  # the master's "nof_pool_disabled"
    (dict(nof_replica_num=2), INVALID_PARAMS),
    (dict(replica_num=0, nof_replica_num=1), INVALID_PARAMS),
    (dict(dfs_replica_num=1), DFS_SERVICE_UNAVAILABLE),
    (dict(dfs_replica_num=1, nof_replica_num=1), DFS_SERVICE_UNAVAILABLE),  # DFS first
    (dict(dfs_replica_num=1, soft_pin_ttl_ms=5), DFS_SERVICE_UNAVAILABLE),
    (dict(dfs_replica_num=2), INVALID_PARAMS),
    (dict(replica_num=0, dfs_replica_num=1), INVALID_PARAMS),
    (dict(prefer_alloc_in_same_node=True), INVALID_PARAMS),  # multi-buffer puts only
    (dict(group_ids=[]), INVALID_PARAMS),  # set, but not one per key
]


@pytest.mark.parametrize("fields,code", REFUSALS)
def test_puts_refused_as_upstream_refuses_them_store_nothing(
        master, store_factory, fields, code):
    store = store_factory(master)
    buf = Buf(4096, content=b"r" * 4096)
    assert store.register_buffer(buf.addr, 4096) == 0
    config = _config(**fields)
    keys = [unique() for _ in range(5)]
    assert store.put(keys[0], b"v" * 64, config) == code
    assert store.put_from(keys[1], buf.addr, 4096, config) == code
    assert store.upsert(keys[2], b"v" * 64, config) == code
    assert store.batch_put_from(keys[3:], [buf.addr] * 2, [4096] * 2, config) == [code] * 2
    for k in keys:
        assert store.is_exist(k) == 0


def test_group_ids_must_name_one_group_per_key(master, store_factory):
    store = store_factory(master)
    buf = Buf(4096, content=b"g" * 4096)
    assert store.register_buffer(buf.addr, 4096) == 0
    one, two = unique(), [unique(), unique()]
    assert store.put(one, b"x", _config(group_ids=["a", "b"])) == INVALID_PARAMS
    assert store.batch_put_from(two, [buf.addr] * 2, [4096] * 2,
                                _config(group_ids=["a"])) == [INVALID_PARAMS] * 2
    assert store.is_exist(one) == 0 and store.batch_is_exist(two) == [0, 0]
    assert store.put(one, b"x", _config(group_ids=["a"])) == 0
    assert store.batch_put_from(two, [buf.addr] * 2, [4096] * 2,
                                _config(group_ids=["a", ""])) == [0, 0]  # "": ungrouped


def test_each_key_joins_the_group_its_own_group_id_names(master, store_factory):
    """A read leases every member of the object's group (upstream's coalesced lease
    refresh), so a leased member refuses a plain remove: that shows who is grouped."""
    store = store_factory(master)
    buf = Buf(4096, content=b"p" * 4096)
    assert store.register_buffer(buf.addr, 4096) == 0
    a1, a2, b1, solo = (unique() for _ in range(4))
    config = _config(group_ids=["ga-" + a1, "gb-" + b1, "ga-" + a1, ""])
    assert store.batch_put_from([a1, b1, a2, solo], [buf.addr] * 4, [4096] * 4,
                                config) == [0, 0, 0, 0]
    assert store.get(a1) == b"p" * 4096
    OBJECT_HAS_LEASE = -706
    assert store.remove(a2) == OBJECT_HAS_LEASE  # a1's group: leased with it
    assert store.remove(b1) == 0  # another group, not read
    assert store.remove(solo) == 0  # "" is no group


def test_prefer_same_node_is_taken_by_multi_buffer_puts_with_one_replica(
        master, store_factory):
    store = store_factory(master)
    buf = Buf(8192, content=b"m" * 8192)
    assert store.register_buffer(buf.addr, 8192) == 0
    ptrs, sizes = [[buf.addr, buf.addr + 4096]], [[4096, 4096]]
    key = unique()
    assert store.batch_put_from_multi_buffers(
        [key], ptrs, sizes, _config(prefer_alloc_in_same_node=True, replica_num=2)) == [
            INVALID_PARAMS]
    assert store.is_exist(key) == 0
    assert store.batch_put_from_multi_buffers(
        [key], ptrs, sizes, _config(prefer_alloc_in_same_node=True)) == [0]
    assert store.get(key) == b"m" * 8192


def test_a_refused_put_is_logged_once(master, store_factory, caplog):
    store = store_factory(master)
    with caplog.at_level("ERROR", logger="mooncake"):
        assert store.put_batch([unique(), unique()], [b"a", b"b"],
                               _config(nof_replica_num=1)) == INVALID_PARAMS
    assert caplog.text.count("put refused") == 1, caplog.text


# ------------------------------------------------------------------ allocator callbacks


def test_allocator_callbacks_hand_out_zeroed_writable_memory():
    alloc = ctypes.CFUNCTYPE(ctypes.c_void_p, ctypes.c_size_t)(S.get_alloc_func_addr())
    free = ctypes.CFUNCTYPE(None, ctypes.c_void_p)(S.get_free_func_addr())
    assert alloc(0) is None
    n = 3 * (1 << 20) + 5
    ptr = alloc(n)
    assert ptr and ptr % 4096 == 0
    view = (ctypes.c_uint8 * n).from_address(ptr)
    assert bytes(view[:4096]) == bytes(4096) and view[n - 1] == 0
    view[0], view[n - 1] = 0xAB, 0xCD
    assert (view[0], view[n - 1]) == (0xAB, 0xCD)
    del view
    free(ptr)
    free(None)  # ignored
    free(ptr)  # no longer ours: ignored, not unmapped twice


def test_freeing_an_address_the_allocator_never_gave_leaves_it_alone():
    free = ctypes.CFUNCTYPE(None, ctypes.c_void_p)(S.get_free_func_addr())
    keep = ctypes.create_string_buffer(b"still here", 4096)
    free(ctypes.addressof(keep))
    assert keep.value == b"still here"


# ------------------------------------------------------------------ NUMA binding


def test_bind_to_numa_node_binds_the_thread_or_warns(tmp_path):
    """In a child: node 0 (every Linux machine with sysfs has it) pins the thread to its
    CPUs and prefers its memory; a node that does not exist changes nothing."""
    code = textwrap.dedent("""
        import ctypes, os, platform
        from mooncake.store import bind_to_numa_node
        from mooncake._host_memory import _node_ids, _parse_cpulist
        before = os.sched_getaffinity(0)
        bind_to_numa_node(max(_node_ids() or [0]) + 1)
        assert os.sched_getaffinity(0) == before
        if not _node_ids():
            print("no-numa"); raise SystemExit
        bind_to_numa_node(0)
        with open("/sys/devices/system/node/node0/cpulist") as f:
            want = _parse_cpulist(f.read()) & before
        assert os.sched_getaffinity(0) == want, (os.sched_getaffinity(0), want)
        get_mempolicy = {"x86_64": 239, "aarch64": 236}.get(platform.machine())
        if get_mempolicy:
            mode = ctypes.c_int(-1)
            libc = ctypes.CDLL(None, use_errno=True)
            assert libc.syscall(get_mempolicy, ctypes.byref(mode), None, 0, None, 0) == 0
            assert mode.value == 1, mode.value  # MPOL_PREFERRED
        print("bound")
    """)
    rc, out, err = run_isolated(code)
    assert rc == 0, err
    assert out.split() in (["bound"], ["no-numa"])
    with pytest.raises(TypeError):
        S.bind_to_numa_node("0")


# ------------------------------------------------------------------ NVMe-oF registration


def test_nof_registration_answers_upstreams_failure_and_checks_arguments():
    r = S.MooncakeDistributedNoFRegister()
    assert r.real_register("nqn.x", 1, "10.0.0.9", 4420, 0, 1 << 30, "127.0.0.1:1") == -1
    assert r.real_unregister_by_endpoint("nqn.x", 1, "10.0.0.9", 4420, "127.0.0.1:1") == -1
    with pytest.raises(TypeError):
        r.real_register("nqn.x", "1", "10.0.0.9", 4420, 0, 1 << 30, "127.0.0.1:1")
    with pytest.raises(TypeError):
        r.real_unregister_by_endpoint("nqn.x", 1, None, 4420, "127.0.0.1:1")
