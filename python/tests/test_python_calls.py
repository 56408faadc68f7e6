"""The library's functions called in CPython's own convention (``_native.python_function``,
``mc_python_function`` in mooncake.h): they give the GIL up while the store works, keep
no reference to what they were lent, decline what the ctypes path is to judge, and
refuse wrong arguments with TypeError rather than crash. That they answer as the ctypes
path does is test_store.py's (both routes of its regular-batch test)."""

import signal
import sys
import threading

import pytest

from fixtures_extra import *  # noqa: F401,F403

pytest.importorskip("mooncake.store")
from mooncake import _native as N  # noqa: E402
from mooncake import store as S  # noqa: E402

SIZE = 4096


@pytest.fixture
def fast():
    if S._FAST_BATCH_GET_INTO is None:
        pytest.skip("this interpreter has no CPython-convention call")
    return S._FAST_BATCH_GET_INTO


def call_args(st, keys, bufs, sizes):
    """The arguments store.py passes: its handle, the lists, its registered ranges."""
    allowed = st._allowed_ranges()
    return (st._store, keys, bufs, sizes, allowed.buffer_info()[0], len(allowed) // 2)


def test_a_batch_read_waiting_on_a_stopped_master_lets_other_threads_run(master):
    """With the master stopped, a batch read of keys its store never read waits for the
    master's answer. The switch interval is raised so the reading thread gives the GIL
    up only where the library does: if the read held it, the main thread could not
    resume the master, and the read would fail once the RPC timed out."""
    holder = new_store(master, 8 * MiB, 4 * MiB)
    reader = new_store(master, 0, 4 * MiB)
    try:
        src, dst = Buf(2 * SIZE, content=pattern(2 * SIZE, 5)), Buf(2 * SIZE)
        assert holder.register_buffer(src.addr, src.size) == 0
        assert reader.register_buffer(dst.addr, dst.size) == 0
        keys = [unique("stopped") for _ in range(2)]
        assert holder.batch_put_from(keys, [src.addr, src.addr + SIZE], [SIZE] * 2) == [0, 0]
        entered = threading.Event()
        got = []

        def read():
            entered.set()
            got.append(reader.batch_get_into(keys, [dst.addr, dst.addr + SIZE], [SIZE] * 2))

        old = sys.getswitchinterval()
        master.proc.send_signal(signal.SIGSTOP)
        try:
            sys.setswitchinterval(30.0)
            t = threading.Thread(target=read, daemon=True)
            t.start()
            assert entered.wait(30)
        finally:
            # Runs only once the reader gave the GIL up (or its read returned).
            master.proc.send_signal(signal.SIGCONT)
            sys.setswitchinterval(old)
        t.join(120)
        assert not t.is_alive()
        assert got == [[SIZE, SIZE]], "the read held the GIL while the master was away"
        assert dst.raw == src.raw
    finally:
        reader.close()
        holder.close()


def test_a_batch_keeps_no_reference_to_its_lists_and_hands_out_only_its_results(
        module_master, fast):
    st = new_store(module_master)
    try:
        buf = Buf(4 * SIZE, content=pattern(4 * SIZE, 6))
        assert st.register_buffer(buf.addr, buf.size) == 0
        keys = [unique("refs") for _ in range(4)]
        bufs = [buf.addr + i * SIZE for i in range(4)]
        sizes = [SIZE] * 4
        assert st.batch_put_from(keys, bufs, sizes) == [0] * 4
        args = call_args(st, keys, bufs, sizes)
        before = [sys.getrefcount(o) for o in (*keys, *bufs, sizes[0], keys, bufs, sizes)]
        for _ in range(50):
            got = fast(*args)
            assert got == [SIZE] * 4
            assert all(type(n) is int for n in got)
            # The caller's name and getrefcount's argument: no other holder.
            assert sys.getrefcount(got) == 2
        del got
        after = [sys.getrefcount(o) for o in (*keys, *bufs, sizes[0], keys, bufs, sizes)]
        assert after == before
        # Answers of different kinds side by side (missing, too small) are each their own.
        missing = unique("missing")
        mixed = call_args(st, [keys[0], missing, keys[1]], bufs[:3], [SIZE, SIZE, 100])
        got = fast(*mixed)
        assert got[0] == SIZE and got[1] < 0 and got[2] < 0 and got[1] != got[2]
    finally:
        st.close()


def test_what_the_ctypes_path_judges_is_declined_untouched(module_master, fast):
    st = new_store(module_master)
    try:
        buf = Buf(2 * SIZE)
        assert st.register_buffer(buf.addr, buf.size) == 0
        key = unique("declined")
        assert st.batch_put_from([key, key + "b"], [buf.addr, buf.addr + SIZE], [SIZE] * 2) \
            == [0, 0]
        bufs = [buf.addr, buf.addr + SIZE]
        for keys, addrs, sizes in (
            ((key, key + "b"), bufs, [SIZE] * 2),            # a tuple, not a list
            ([key, b"bytes"], bufs, [SIZE] * 2),             # a key that is no str
            ([key, "\ud800"], bufs, [SIZE] * 2),             # a str UTF-8 cannot carry
            ([key, "a\0b"], bufs, [SIZE] * 2),               # a key the store refuses
            ([key, key + "b"], bufs[:1], [SIZE] * 2),        # lists of other lengths
            ([key, key + "b"], [bufs[0], -1], [SIZE] * 2),   # a negative address
            ([key, key + "b"], [bufs[0], 1 << 64], [SIZE] * 2),
            ([key, key + "b"], bufs, [SIZE, 4096.0]),        # a float size
            ([key, key + "b"], bufs, [SIZE, True]),          # a bool size
            ([key, key + "b"], [bufs[0], Buf(SIZE).addr], [SIZE] * 2),  # unregistered
        ):
            buf.write(0, b"\x55" * 2 * SIZE)
            assert fast(*call_args(st, keys, addrs, sizes)) is None, (keys, addrs, sizes)
            assert buf.raw == b"\x55" * 2 * SIZE, "a declined batch wrote"
        # A store handle the package never had set up: declined too.
        assert fast(0, [key, key + "b"], bufs, [SIZE] * 2, 0, 0) is None
    finally:
        st.close()


def test_wrong_arguments_raise_type_error(fast):
    with pytest.raises(TypeError):
        fast()
    with pytest.raises(TypeError):
        fast(0, [], [], [], 0)
    with pytest.raises(TypeError):
        fast("store", [], [], [], 0, 0)
    with pytest.raises(TypeError):
        fast(0, [], [], [], -1, 0)


def test_an_unknown_function_is_none_and_the_package_keeps_to_ctypes():
    assert N.python_function("no_such_function") is None
