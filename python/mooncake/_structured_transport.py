"""How ``mooncake.structured_object_store`` moves payload bytes through a store: the
fast calls when the store has them, the plain ones otherwise (upstream's
``_MooncakePayloadTransport``, with its choice of calls, which stores are observed by).

Writes of chunks (each chunk: a group of byte views written back to back):
  copy_mode "zero_copy"  refused here (only tensor-object buffers are zero-copy)
  copy_mode "copy", or no BufferPool  one ``put`` per chunk
  otherwise  per chunk: acquire a pool lease, copy the group in, one-key
             ``batch_put_from``, release -- a chunk at a time, or in parallel groups
             ("parallel" put mode, or "auto" from 8 chunks and 64 MiB with more than
             one put in flight)
Reads:
  a whole payload   ``batch_get_into`` of all chunks into the registered destination,
                    else ``get`` per chunk
  a byte range      ``get_into`` when it is one whole chunk, else ``get_into_ranges``
                    into registered memory, else ``get`` and copy
  pool-backed read  a BufferPool lease filled by ``get_into_ranges``
A destination is registered for the call (memory registered already is tolerated) and
unregistered after, also on failure. A store without register/unregister gets no fast
read. No BufferPool is made unless the store can make one itself.
"""

import ctypes
from concurrent.futures import ThreadPoolExecutor, as_completed
from contextlib import contextmanager

from . import _structured_payloads as P

AUTO_PARALLEL_MIN_BYTES = 64 * 1024 ** 2
AUTO_PARALLEL_MIN_CHUNKS = 8


def group_nbytes(group):
    return sum(len(part) for part in group)


def range_fragments(chunks, byte_offset, byte_length, destination_offset=0):
    """[(chunk key, chunk size, destination offset, offset in chunk, size)] covering
    payload bytes [byte_offset, byte_offset + byte_length)."""
    out, start, end = [], 0, byte_offset + byte_length
    for chunk in chunks:
        size = int(chunk["bytes"])
        lo, hi = max(byte_offset, start), min(end, start + size)
        if lo < hi:
            out.append((chunk["key"], size, destination_offset + lo - byte_offset,
                        lo - start, hi - lo))
        start += size
    return out


def _copy_group_to_lease(group, lease):
    copy_from_buffers = getattr(lease, "copy_from_buffers", None)
    if callable(copy_from_buffers):
        copy_from_buffers(group)
        return
    view = lease.buffer
    try:
        target = view.cast("B") if view.format != "B" else view
        offset = 0
        for part in group:
            n = len(part)
            if n:
                target[offset:offset + n] = part.cast("B") if part.format != "B" else part
                offset += n
    finally:
        view.release()


class PayloadTransport:
    def __init__(self, store, buffer_pool=None):
        self._store = store
        self._buffer_pool = buffer_pool
        self._batch_put_from = getattr(store, "batch_put_from", None)
        self._put_tensor_from = getattr(store, "put_tensor_from", None)
        self._batch_get_into = getattr(store, "batch_get_into", None)
        self._get_into = getattr(store, "get_into", None)
        self._get_into_ranges = getattr(store, "get_into_ranges", None)
        self._register_buffer = getattr(store, "register_buffer", None)
        self._unregister_buffer = getattr(store, "unregister_buffer", None)

    # ------------------------------------------------------------ the pool

    def _ensure_buffer_pool(self):
        """The BufferPool to stage copies in: the one given, else one the store can
        make for itself (upstream's stores expose ``_get_pyclient_capsule``), else
        None."""
        if self._buffer_pool is None:
            capsule = getattr(self._store, "_get_pyclient_capsule", None)
            try:
                can_make = callable(capsule) and capsule() is not None
            except Exception:
                can_make = False
            if not can_make:
                return None
            try:
                from .buffer_pool import BufferPool
                self._buffer_pool = BufferPool(self._store)
            except (ImportError, AttributeError, RuntimeError, TypeError):
                return None
        return self._buffer_pool

    def _has_registration(self):
        return callable(self._register_buffer) and callable(self._unregister_buffer)

    # ------------------------------------------------------------ writes

    def put_chunk_groups(self, keys, groups, policy, config=None):
        """Writes ``groups[i]`` (byte views, back to back) under ``keys[i]``."""
        if policy.copy_mode == "zero_copy":
            raise RuntimeError("zero-copy put requires tensor-object buffers")
        if policy.copy_mode == "copy" or self._ensure_buffer_pool() is None:
            self._put_chunks_direct(keys, [memoryview(b"".join(g)) for g in groups], config)
            return
        if all(len(g) == 1 for g in groups):
            self.batch_put_groups_from(keys, groups, config)
            return
        if not callable(self._batch_put_from):
            self._put_chunks_direct(keys, [memoryview(b"".join(g)) for g in groups], config)
            return
        if self._resolve_buffer_group_put_mode(groups, policy) == "batch":
            self.batch_put_groups_from(keys, groups, config)
        else:
            self._put_groups_parallel(list(keys), list(groups), policy.max_inflight_put,
                                      config)

    def _resolve_buffer_group_put_mode(self, groups, policy):
        """"batch" (one chunk after another) or "parallel" for these chunk groups."""
        if policy.put_mode in ("batch", "parallel"):
            return policy.put_mode
        if policy.max_inflight_put <= 1 or len(groups) < AUTO_PARALLEL_MIN_CHUNKS:
            return "batch"
        if sum(group_nbytes(g) for g in groups) < AUTO_PARALLEL_MIN_BYTES:
            return "batch"
        return "parallel"

    def batch_put_groups_from(self, keys, groups, config=None):
        """One pool lease per chunk: copy in, one-key batch_put_from, release; on a
        failure removes every key of the call and raises."""
        if not callable(self._batch_put_from):
            raise RuntimeError("batch_put_from is unavailable")
        pool = self._ensure_buffer_pool()
        for key, group in zip(keys, groups):
            size = group_nbytes(group)
            lease = pool.acquire(size)
            try:
                _copy_group_to_lease(group, lease)
                self.batch_put_from([key], [lease.ptr], [size], config)
            except Exception:
                P.remove_keys(self._store, keys, strict=False)
                raise
            finally:
                lease.release()

    def batch_put_from(self, keys, ptrs, sizes, config=None):
        results = P.call_with_config(self._batch_put_from, list(keys), list(ptrs),
                                     list(sizes),
                                     config=P.config_for_keys(config, len(keys)))
        if len(results) != len(keys):
            raise RuntimeError(f"batch_put_from returned {len(results)} results for "
                               f"{len(keys)} chunks")
        for key, status in zip(keys, results):
            P.check_status(status, "batch_put_from", key)

    def put(self, key, value, config=None):
        P.check_status(P.call_with_config(self._store.put, key, value,
                                          config=P.config_for_keys(config, 1)), "put", key)

    def _put_chunks_direct(self, keys, chunks, config):
        written = []
        try:
            for key, chunk in zip(keys, chunks):
                self.put(key, chunk, config)
                written.append(key)
        except Exception:
            P.remove_keys(self._store, written, strict=False)
            raise

    def _put_groups_parallel(self, keys, groups, max_inflight, config):
        count = max(1, min(max_inflight, len(groups)))
        size = -(-len(groups) // count)
        batches = [(keys[i:i + size], groups[i:i + size]) for i in range(0, len(groups), size)]
        futures = []
        try:
            with ThreadPoolExecutor(max_workers=len(batches)) as pool:
                futures = [pool.submit(self.batch_put_groups_from, k, g, config)
                           for k, g in batches]
                for future in as_completed(futures):
                    future.result()
        except Exception:
            for future in futures:
                future.cancel()
            P.remove_keys(self._store, keys, strict=False)
            raise

    def put_from(self, key, ptr, size, config=None):
        """One object from registered memory: put_tensor_from without a config, else
        put_from."""
        config = P.config_for_keys(config, 1)
        if config is None and callable(self._put_tensor_from):
            status = self._put_tensor_from(key, ptr, size)
        else:
            put_from = getattr(self._store, "put_from", None)
            if not callable(put_from):
                raise RuntimeError("put_from is unavailable")
            status = P.call_with_config(put_from, key, ptr, size, config=config)
        P.check_status(status, "put_from", key)

    def put_tensor_object_buffer(self, key, value, config=None):
        if not callable(self._put_tensor_from) and \
                not callable(getattr(self._store, "put_from", None)):
            raise RuntimeError("put_from is unavailable")
        self.put_from(key, value.ptr, value.size, config)
        return value.size

    def put_tensor_direct(self, key, tensor, metadata_bytes, config=None):
        """The payload spec of ``tensor`` put with the store's put_tensor (pub_tensor
        with a config), or None when the store has no such call."""
        put_tensor = getattr(self._store, "put_tensor" if config is None else "pub_tensor",
                             None)
        if not callable(put_tensor):
            return None
        total = metadata_bytes + int(getattr(tensor, "nbytes", 0))
        P.check_status(P.call_with_config(put_tensor, key, tensor,
                                          config=P.config_for_keys(config, 1)),
                       "put_tensor", key)
        return {"key": key, "kind": "tensor", "bytes": total, "dtype": str(tensor.dtype),
                "shape": list(tensor.shape), "chunks": [{"key": key, "bytes": total}],
                "metadata_bytes": metadata_bytes}

    def put_serialized_from_pool(self, key, header, data_ptr, nbytes, owner, config=None):
        """A serialized tensor (header + data) staged in a pool lease and put_from;
        RuntimeError when there is no pool or put_from."""
        if self._buffer_pool is None:
            raise RuntimeError("structured tensor zero-copy requires a BufferPool")
        if not callable(self._put_tensor_from) and \
                not callable(getattr(self._store, "put_from", None)):
            raise RuntimeError("put_from is unavailable")
        total = len(header) + nbytes
        lease = self._buffer_pool.acquire(total)
        try:
            ctypes.memmove(lease.ptr, header, len(header))
            if nbytes:
                ctypes.memmove(lease.ptr + len(header), data_ptr, nbytes)
            self.put_from(key, lease.ptr, total, config)
        finally:
            lease.release()
        del owner  # kept the source alive through the copy
        return total

    # ------------------------------------------------------------ registration

    @contextmanager
    def registered(self, buffer, pre_registered=False):
        """Registers ``buffer`` for the block (unless it is already); yields its
        address."""
        ptr = P.address_of(buffer)
        size = P.nbytes_of(buffer)
        if pre_registered or size == 0:
            yield ptr
            return
        if not self._has_registration():
            raise RuntimeError("register_buffer APIs are unavailable")
        status = self._register_buffer(ptr, size)
        if status != 0:
            if status != P.DUPLICATE_REGISTRATION:
                P.check_status(status, "register_buffer", "structured payload")
            yield ptr
            return
        ok = False
        try:
            yield ptr
            ok = True
        finally:
            status = self._unregister_buffer(ptr)
            if ok:
                P.check_status(status, "unregister_buffer", "structured payload")

    @contextmanager
    def _registered_for_call(self, ptr, size):
        """Registers caller memory that may or may not be registered already (a
        tensor_object_buffer): unregistered after when this registered it; a refused
        registration is left to the read itself to report."""
        done = self._has_registration() and size > 0 and self._register_buffer(ptr, size) == 0
        try:
            yield
        finally:
            if done:
                self._unregister_buffer(ptr)

    # ------------------------------------------------------------ reads

    def read_payload(self, spec):
        total = int(spec["bytes"])
        if total == 0:
            return b""
        data = bytearray(total)
        self.read_payload_into(spec, data)
        return bytes(data)

    def read_payload_into(self, spec, destination):
        chunks = spec["chunks"]
        offsets, pos = [], 0
        for chunk in chunks:
            offsets.append(pos)
            pos += int(chunk["bytes"])
        if callable(self._batch_get_into) and self._has_registration():
            with self.registered(destination) as base:
                keys = [c["key"] for c in chunks]
                sizes = [int(c["bytes"]) for c in chunks]
                got = self._batch_get_into(keys, [base + o for o in offsets], sizes)
                if len(got) != len(keys):
                    raise RuntimeError(f"batch_get_into returned {len(got)} results for "
                                       f"{len(keys)} chunks")
                for key, want, have in zip(keys, sizes, got):
                    if have != want:
                        raise RuntimeError(f"batch_get_into failed for {key}: expected "
                                           f"{want}, got {have}")
            return
        for offset, chunk in zip(offsets, chunks):
            size = int(chunk["bytes"])
            if size:
                destination[offset:offset + size] = self._get_chunk(chunk["key"], size)

    def _get_chunk(self, key, size):
        data = self._store.get(key)
        if data is None or len(data) != size:
            got = 0 if data is None else len(data)
            raise RuntimeError(f"get failed for {key}: expected {size} bytes, got {got}")
        return data

    def read_tensor(self, spec):
        get_tensor = getattr(self._store, "get_tensor", None)
        if not callable(get_tensor):
            raise RuntimeError("structured tensor payload does not support get_tensor")
        return get_tensor(spec["key"])

    def read_tensor_into(self, spec, destination):
        """A tensor payload into a tensor_object_buffer/raw destination: the store's
        get_tensor_into for a store tensor (the tensor over the destination returned;
        RuntimeError when it fails), else the serialized bytes (None returned)."""
        if spec.get("kind") == "tensor":
            get_tensor_into = getattr(self._store, "get_tensor_into", None)
            if not callable(get_tensor_into):
                raise RuntimeError("structured tensor payload does not support "
                                   "get_tensor_into")
            if getattr(destination, "pre_registered", False):
                tensor = get_tensor_into(spec["key"], destination.ptr, destination.size)
            else:
                with self._registered_for_call(destination.ptr, destination.size):
                    tensor = get_tensor_into(spec["key"], destination.ptr, destination.size)
            if tensor is None:
                raise RuntimeError(f"get_tensor_into failed for {spec['key']} (the "
                                   f"destination needs {spec['bytes']} bytes)")
            return tensor
        total = int(spec["bytes"])
        if destination.size < total:
            raise ValueError(f"tensor destination has {destination.size} bytes, expected "
                             f"at least {total}")
        if not self._ranges_into_raw(spec["chunks"], destination.ptr, [(0, 0, total)]):
            offset = 0
            for chunk in spec["chunks"]:
                size = int(chunk["bytes"])
                ctypes.memmove(destination.ptr + offset, self._get_chunk(chunk["key"], size),
                               size)
                offset += size
        return None

    def read_range(self, spec, byte_offset, byte_length):
        if byte_length == 0:
            return b""
        data = bytearray(byte_length)
        self.read_range_into(spec, data, byte_offset)
        return bytes(data)

    def read_range_into(self, spec, destination, byte_offset, pre_registered=False):
        """Fills ``destination`` (bytearray or ndarray) with payload bytes from
        ``byte_offset``."""
        length = P.nbytes_of(destination)
        if self._has_registration():
            with self.registered(destination, pre_registered) as base:
                if self._range_into_raw(spec["chunks"], base, byte_offset, length):
                    return
        self._copy_ranges(spec["chunks"], destination, [(byte_offset, 0, length)])

    def read_ranges_into(self, spec, destination, ranges):
        """(source offset, destination offset, length) ranges into a bytearray/ndarray."""
        if not ranges:
            return
        if self._has_registration():
            with self.registered(destination) as base:
                if self._ranges_into_raw(spec["chunks"], base, ranges):
                    return
        self._copy_ranges(spec["chunks"], destination, ranges)

    def read_ranges_into_raw(self, spec, ptr, ranges):
        """Ranges into memory at ``ptr`` the caller registered; False when the store has
        no ranged read."""
        return not ranges or self._ranges_into_raw(spec["chunks"], ptr, ranges)

    def read_range_into_pool_array(self, spec, dtype, shape, byte_offset):
        """An ndarray over a BufferPool lease holding payload bytes from
        ``byte_offset``; None when there is no pool (or no ranged read)."""
        np = P.numpy()
        count = 1
        for d in shape:
            count *= int(d)
        nbytes = count * np.dtype(dtype).itemsize
        if nbytes == 0:
            return np.empty(shape, dtype=dtype)
        pool = self._ensure_buffer_pool()
        if pool is None:
            return None
        try:
            lease = pool.acquire(nbytes)
        except RuntimeError:
            return None
        owner = P.PoolLeaseOwner(lease)
        try:
            if not self._range_into_raw(spec["chunks"], lease.ptr, byte_offset, nbytes,
                                        allow_get_into=False):
                owner.release()
                return None
            return P.pool_array(owner, dtype, shape)
        except Exception:
            owner.release()
            raise

    def _range_into_raw(self, chunks, base, byte_offset, byte_length, allow_get_into=True):
        if allow_get_into and len(chunks) == 1 and byte_offset == 0 and \
                callable(self._get_into) and int(chunks[0]["bytes"]) == byte_length:
            got = self._get_into(chunks[0]["key"], base, byte_length)
            if got != byte_length:
                raise RuntimeError(f"get_into failed for {chunks[0]['key']}: expected "
                                   f"{byte_length}, got {got}")
            return True
        return self._ranges_into_raw(chunks, base, [(byte_offset, 0, byte_length)])

    def _ranges_into_raw(self, chunks, base, ranges):
        """One get_into_ranges call for all fragments of ``ranges``; False without the
        call."""
        if not callable(self._get_into_ranges):
            return False
        fragments = [f for src, dst, n in ranges for f in range_fragments(chunks, src, n, dst)]
        if not fragments:
            return True
        keys = [f[0] for f in fragments]
        sizes = [[f[4]] for f in fragments]
        results = self._get_into_ranges([base], [keys], [[[f[2]] for f in fragments]],
                                        [[[f[3]] for f in fragments]], [sizes])
        if len(results) != 1 or len(results[0]) != len(keys):
            raise RuntimeError("get_into_ranges returned invalid ranged result shape for "
                               f"{len(keys)} chunks")
        for key, want, got in zip(keys, sizes, results[0]):
            if list(got) != want:
                raise RuntimeError(f"get_into_ranges failed for {key}: expected {want[0]}, "
                                   f"got {list(got)}")
        return True

    def _copy_ranges(self, chunks, destination, ranges):
        """The plain path: ``get`` each chunk a range touches and copy its part."""
        target = memoryview(destination).cast("B") if not P.is_ndarray(destination) \
            else memoryview(destination.reshape(-1).view("u1"))
        for src, dst, n in ranges:
            for key, size, out, inside, length in range_fragments(chunks, src, n, dst):
                data = self._get_chunk(key, size)
                target[out:out + length] = memoryview(data).cast("B")[inside:inside + length]
