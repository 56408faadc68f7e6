"""The batch calls' argument handling: the fast paths taken when every element is
ordinary must give what the element-by-element checks give, and hand anything else to
them. No library calls: only the marshalling."""

import ctypes

import pytest

from mooncake import _native as N
from mooncake._common import Registered, int_list
from mooncake.store import MooncakeDistributedStore, _encode_key, _keys, _triage


def test_keys_match_the_key_by_key_encoding():
    too_long = "k" * (N.MC_STORE_MAX_KEY_LEN + 1)
    longest = "k" * N.MC_STORE_MAX_KEY_LEN
    for keys in (
        ["a", "b/c", "ключ", longest],
        [],
        ["a", ""],
        ["a", "b\0c"],
        ["a", too_long],
        ["a", "\ud800"],  # a lone surrogate does not encode
        ["a", b"raw"],
    ):
        assert _keys(keys) == [_encode_key(k, "keys", i) for i, k in enumerate(keys)], keys
    with pytest.raises(TypeError, match=r"keys\[1\]"):
        _keys(["a", 7])


def test_int_lists_refuse_what_they_refused():
    assert int_list([1, 2, 3], "v") == [1, 2, 3]
    assert int_list((5,), "v") == [5]
    assert int_list([], "v") == []
    with pytest.raises(TypeError, match=r"v\[1\]"):
        int_list([1, True], "v")
    with pytest.raises(ValueError, match=r"v\[0\]"):
        int_list([-1, 2], "v")
    with pytest.raises(ValueError, match=r"v\[1\]"):
        int_list([1, 1 << 64], "v")
    assert int_list([2, 9], "v", lo=2, hi=9) == [2, 9]
    with pytest.raises(ValueError):
        int_list([1, 9], "v", lo=2, hi=9)


def test_c_strings_point_at_each_key_nul_terminated():
    arr = N.c_strings([b"ab", b"", b"xyz"])
    assert list(arr) == [b"ab", b"", b"xyz"]
    # NULL entries and the empty list keep ctypes' own conversion.
    assert list(N.c_strings([b"ab", None])) == [b"ab", None]
    assert len(N.c_strings([])) == 1


def test_c_arrays_convert_as_ctypes_does():
    assert list(N.c_array(ctypes.c_size_t, [1, 2, 1 << 63])) == [1, 2, 1 << 63]
    assert list(N.c_array(ctypes.c_int64, [-5, 5])) == [-5, 5]
    assert list(N.c_array(ctypes.c_void_p, [None, 16])) == [None, 16]
    assert list(N.c_array(ctypes.c_size_t, [-1])) == [(1 << 64) - 1]
    assert len(N.c_array(ctypes.c_int, [])) == 1


def test_spans_partly_outside_registered_memory_are_refused_one_by_one():
    store = MooncakeDistributedStore()
    store._registered = Registered()
    store._registered.add(4096, 8192)
    store._registered.add(65536, 4096)
    inside = [(4096, 100), (8192, 4096)]
    assert store._checked_spans([a for a, _ in inside], [n for _, n in inside]) == inside
    # Each span is registered but the range between them is not: still accepted.
    assert store._checked_spans([4096, 65536], [10, 10]) == [(4096, 10), (65536, 10)]
    assert store._checked_spans([4096, 12288], [10, 10]) == [(4096, 10), None]
    assert store._checked_spans([], []) == []


def test_triage_marks_bad_keys_and_items():
    assert _triage([b"a", b"b"], [1, 2]) == ([0, 0], [0, 1])
    results, idx = _triage([b"a", None, b"c"], [1, 2, None])
    assert idx == [0]
    assert results[1] < 0 and results[2] < 0


def test_a_one_key_batch_skips_the_list_checks_only_when_they_would_pass():
    store = MooncakeDistributedStore()
    store._registered = Registered()
    store._registered.add(4096, 8192)
    store._store = object()  # set up, as far as the marshalling can tell
    plain = (["key"], [4096], [100])
    k, addr, n = store._one_plain(*plain)
    # What the general path would have made of the same call.
    assert [k] == _keys(plain[0]) and [(addr, n)] == store._checked_spans(plain[1], plain[2])
    assert store._one_plain(["key"], [4096], [8192]) is not None  # the whole buffer
    assert store._one_plain([b"key"], [4096], [100]) == (b"key", 4096, 100)
    for keys, addrs, sizes in (
        (("key",), [4096], [100]),  # not lists: the general path copes
        (["a", "b"], [4096, 4200], [10, 10]),
        (["k\0y"], [4096], [100]),
        ([""], [4096], [100]),
        (["k" * (N.MC_STORE_MAX_KEY_LEN + 1)], [4096], [100]),
        (["key"], [True], [100]),
        (["key"], [4096], [-1]),
        (["key"], [4096], [8193]),  # past the registered buffer
        (["key"], [0], [10]),
        (["key"], [4096.0], [100]),
        (["key"], [1 << 64], [0]),  # past any address, even were a buffer to end there
    ):
        assert store._one_plain(keys, addrs, sizes) is None, (keys, addrs, sizes)
    store._store = None
    assert store._one_plain(*plain) is None


def test_the_library_builds_key_arrays_only_of_keys_it_takes():
    too_long = "k" * (N.MC_STORE_MAX_KEY_LEN + 1)
    arr = N.c_key_array(["a", "ключ", "k" * N.MC_STORE_MAX_KEY_LEN])
    assert list(arr) == _keys(["a", "ключ", "k" * N.MC_STORE_MAX_KEY_LEN])
    for keys in (
        ["a"],  # one key: the single call's business
        ["a", ""],
        ["a", "b\0c"],
        ["a", too_long],
        ["a", "\ud800"],
        ["a", b"raw"],
        ["a", 7],
    ):
        assert N.c_key_array(keys) is None, keys


def test_a_plain_batch_is_built_at_c_speed_only_when_the_checks_would_pass():
    store = MooncakeDistributedStore()
    store._registered = Registered()
    store._registered.add(4096, 8192)
    store._store = object()  # set up, as far as the marshalling can tell
    keys, addrs, sizes = ["a", "b", "c"], [4096, 4200, 12000], [100, 10, 288]
    n, c_keys, c_bufs, c_lens = store._plain_batch(keys, addrs, sizes)
    # What the general path would have made of the same call.
    assert n == 3 and list(c_keys) == _keys(keys)
    assert list(zip(c_bufs, c_lens)) == store._checked_spans(addrs, sizes)
    for keys, addrs, sizes in (
        (["a", "b"], [4096], [10]),  # lengths differ: the general path says so
        (("a", "b"), [4096, 4200], [10, 10]),  # not lists
        (["a", "b"], (4096, 4200), [10, 10]),
        (["a", ""], [4096, 4200], [10, 10]),
        (["a", "b\0"], [4096, 4200], [10, 10]),
        (["a", "b"], [4096, True], [10, 10]),
        (["a", "b"], [4096, 4200], [10, -1]),
        (["a", "b"], [4096, 4200.0], [10, 10]),
        (["a", "b"], [4096, 1 << 64], [10, 0]),
        (["a", "b"], [4096, 12000], [10, 300]),  # past the registered buffer
        (["a", "b"], [0, 4096], [10, 10]),
        (["a"], [4096], [10]),  # one key: _one_plain's
    ):
        assert store._plain_batch(keys, addrs, sizes) is None, (keys, addrs, sizes)
    store._store = None
    assert store._plain_batch(["a", "b"], [4096, 4200], [10, 10]) is None


def test_registered_pairs_follow_every_change_in_address_order():
    r = Registered()
    assert list(r.pairs()) == []
    r.add(8192, 100)
    r.add(4096, 10)
    first = r.pairs()
    assert list(first) == [4096, 4106, 8192, 8292]
    assert r.pairs() is first, "built once until the next change"
    r.add(4096, 20)  # registered again, larger
    r.remove(8192)
    assert list(r.pairs()) == [4096, 4116]
    assert list(first) == [4096, 4106, 8192, 8292], "a caller's array is never changed"
    r.clear()
    assert list(r.pairs()) == []
