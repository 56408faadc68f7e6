"""Bundles: named byte payloads stored as chunked store objects under one manifest (the
layer under ``mooncake.structured_object_store``).

Keys, under ``<prefix>/<partition>/<uuid>`` (the object id):
  .../manifest                 JSON: {"version": 1, "layout": "bundle", "object_id",
                               "meta": spec, "buffers": {name: spec},
                               ["buffer_object_ids": [...], "cleanup_keys": [...]]}
  .../meta, .../buffer/<name>  a payload: one object, or .../chunk/<i> when larger than
                               the chunk size
A payload spec is {"key", "bytes", "chunks": [{"key", "bytes"}, ...]}. A manifest made
by merging others (a DataProto append) may name payloads of other object ids
(``buffer_object_ids``) and extra keys to remove with it (``cleanup_keys``); every key a
manifest names must lie under one of its object ids, so a forged manifest cannot make
``remove`` delete unrelated objects.

``StoreIO`` holds the store calls: writes by ``put`` (copy), through a BufferPool lease
and ``batch_put_from``, or from the caller's memory registered for the call
(``zero_copy``); reads of byte ranges by ``get_into_ranges`` into registered memory, or
by ``get`` when the store or the destination cannot do that.
"""

import copy
import ctypes
import json
import uuid
from concurrent.futures import ThreadPoolExecutor

MISSING_OBJECT_ERROR = -704  # remove() of an object already gone
INVALID_PARAMS = -600
DEFAULT_BUNDLE_CHUNK_BYTES = 64 * 1024 ** 2
AUTO_PARALLEL_MIN_BYTES = DEFAULT_BUNDLE_CHUNK_BYTES
AUTO_PARALLEL_MIN_CHUNKS = 8
PUT_MODES = ("auto", "batch", "parallel")
COPY_MODES = ("auto", "zero_copy", "copy")


class ZeroCopySource:
    """``size`` bytes at ``ptr`` inside memory registered with the store, put with
    ``put_from`` as one object; ``owner`` keeps that memory alive."""

    __slots__ = ("ptr", "size", "owner")

    def __init__(self, ptr, size, owner=None):
        self.ptr = int(ptr)
        self.size = int(size)
        self.owner = owner


def check_status(status, operation, key):
    if status not in (None, 0):
        raise RuntimeError(f"{operation} failed for {key}: {status}")


def check_key_segment(value, what):
    """A name used inside keys: non-empty, no '/', no control characters."""
    if not isinstance(value, str) or not value or "/" in value or \
            any(ord(c) < 32 for c in value):
        raise ValueError(f"invalid bundle {what}: {value!r}")
    return value


def byte_view(value, what):
    """A flat unsigned-byte memoryview of a bytes-like value (copied if not contiguous,
    or read-only in a format memoryview cannot recast, such as ctypes' "<c")."""
    try:
        view = memoryview(value)
    except TypeError:
        raise TypeError(f"{what} must be bytes-like, got {type(value).__name__}") from None
    if not view.contiguous:
        view = memoryview(view.tobytes())
    if view.format == "B" and view.ndim == 1:
        return view
    try:
        return view.cast("B")
    except (NotImplementedError, TypeError, ValueError):
        pass
    if not view.readonly:
        return memoryview((ctypes.c_uint8 * view.nbytes).from_buffer(view)).cast("B")
    return memoryview(view.tobytes())


def address_of(view):
    """(address, keepalive) of a writable contiguous memoryview, or (None, None)."""
    if view.readonly or len(view) == 0:
        return None, None
    anchor = ctypes.c_char.from_buffer(view)
    return ctypes.addressof(anchor), anchor


def _call(fn, *args, config=None):
    """``fn(*args)``, with ``config=`` when one is given; one write here is one key, so a
    config's group id given as a bare string becomes the one-entry list stores take."""
    if config is None:
        return fn(*args)
    if isinstance(getattr(config, "group_ids", None), str):
        config = copy.copy(config)
        config.group_ids = [config.group_ids]
    return fn(*args, config=config)


class StoreIO:
    """The store calls of bundles, each with its plain fallback."""

    def __init__(self, store, buffer_pool=None):
        self.store = store
        self.buffer_pool = buffer_pool
        self._can_register = callable(getattr(store, "register_buffer", None)) and \
            callable(getattr(store, "unregister_buffer", None))

    # ------------------------------------------------------------ writes

    def put_chunks(self, keys, chunks, policy, config):
        """Writes chunk i (a memoryview) under keys[i]; on failure removes what it wrote
        and raises RuntimeError."""
        total = sum(len(c) for c in chunks)
        parallel = policy.max_inflight_put > 1 and len(keys) > 1 and (
            policy.put_mode == "parallel" or (
                policy.put_mode == "auto" and len(keys) >= AUTO_PARALLEL_MIN_CHUNKS
                and total >= AUTO_PARALLEL_MIN_BYTES))
        write = self._writer(policy)
        try:
            if not parallel:
                for key, chunk in zip(keys, chunks):
                    write(key, chunk, config)
                return
            workers = min(policy.max_inflight_put, len(keys))
            with ThreadPoolExecutor(max_workers=workers) as pool:
                for future in [pool.submit(write, k, c, config) for k, c in zip(keys, chunks)]:
                    future.result()
        except Exception:
            self.remove_keys(keys, strict=False)
            raise

    def _writer(self, policy):
        batch_put_from = getattr(self.store, "batch_put_from", None)
        if policy.copy_mode == "zero_copy":
            if not (callable(batch_put_from) and self._can_register):
                raise RuntimeError("copy_mode='zero_copy' needs a store with batch_put_from "
                                   "and register_buffer")
            return self._put_registered
        if policy.copy_mode == "auto" and self.buffer_pool is not None and \
                callable(batch_put_from):
            return self._put_through_pool
        return self._put_copy

    def _put_copy(self, key, chunk, config):
        check_status(_call(self.store.put, key, chunk, config=config),
                     "put", key)

    def _put_through_pool(self, key, chunk, config):
        lease = self.buffer_pool.acquire(len(chunk))
        try:
            if len(chunk):
                source, anchor = address_of(chunk)
                ctypes.memmove(lease.ptr, source if source else chunk.tobytes(), len(chunk))
                del anchor
            results = _call(self.store.batch_put_from, [key], [lease.ptr], [len(chunk)],
                            config=config)
            check_status(results[0] if len(results) == 1 else results, "batch_put_from", key)
        finally:
            lease.release()

    def _put_registered(self, key, chunk, config):
        ptr, anchor = address_of(chunk)
        if ptr is None:
            raise ValueError("copy_mode='zero_copy' needs writable buffers (bytearray, numpy "
                             "arrays, tensors); this payload is read-only")
        with self.registered(ptr, len(chunk)) as ok:
            if not ok:
                raise RuntimeError(f"register_buffer failed for the payload of {key}")
            results = _call(self.store.batch_put_from, [key], [ptr], [len(chunk)],
                            config=config)
        del anchor
        check_status(results[0] if len(results) == 1 else results, "batch_put_from", key)

    def put_zero_copy(self, key, source, config):
        """One object from registered memory (a tensor_object_buffer)."""
        put_from = getattr(self.store, "put_from", None)
        if not callable(put_from):
            raise RuntimeError("this store has no put_from")
        check_status(_call(put_from, key, source.ptr, source.size,
                           config=config), "put_from", key)

    # ------------------------------------------------------------ reads

    class _Registration:
        def __init__(self, io, ptr, size):
            self.io, self.ptr, self.size, self.done = io, ptr, size, False

        def __enter__(self):
            if self.size == 0:
                return True
            self.done = self.io.store.register_buffer(self.ptr, self.size) == 0
            return self.done

        def __exit__(self, *exc):
            if self.done:
                self.io.store.unregister_buffer(self.ptr)

    def registered(self, ptr, size):
        """Context: registers [ptr, ptr+size) for the block; yields whether it could."""
        return self._Registration(self, ptr, size)

    def read_ranges(self, spec, dest_ptr, dest_size, ranges, dest_registered=False):
        """Copies payload bytes [src, src+n) to dest_ptr + dst for each (src, dst, n) in
        ``ranges``; RuntimeError when an object is missing or of the wrong size."""
        ranges = [r for r in ranges if r[2]]
        if not ranges:
            return
        for src, dst, n in ranges:
            if src < 0 or src + n > int(spec["bytes"]) or dst < 0 or dst + n > dest_size:
                raise ValueError(f"read range ({src}, {dst}, {n}) is outside the payload or "
                                 "the destination")
        fragments = _fragments(spec["chunks"], ranges)
        get_into_ranges = getattr(self.store, "get_into_ranges", None)
        if callable(get_into_ranges) and (dest_registered or self._can_register):
            if dest_registered:
                if self._gather(get_into_ranges, fragments, dest_ptr):
                    return
            else:
                with self.registered(dest_ptr, dest_size) as ok:
                    if ok and self._gather(get_into_ranges, fragments, dest_ptr):
                        return
        self._copy_from_gets(fragments, dest_ptr)

    def _gather(self, get_into_ranges, fragments, dest_ptr):
        """Whether get_into_ranges delivered every fragment."""
        by_key = {}
        for key, _, chunk_off, dst, n in fragments:
            entry = by_key.setdefault(key, ([], [], []))
            entry[0].append(dst)
            entry[1].append(chunk_off)
            entry[2].append(n)
        keys = list(by_key)
        results = get_into_ranges([dest_ptr], [keys], [[by_key[k][0] for k in keys]],
                                  [[by_key[k][1] for k in keys]], [[by_key[k][2] for k in keys]])
        for key, got in zip(keys, results[0]):
            if list(got) == by_key[key][2]:
                continue
            failure = next((g for g in got if g < 0), None)
            if failure == INVALID_PARAMS:
                return False  # the destination was not accepted: read with get instead
            raise RuntimeError(f"get_into_ranges failed for {key}: {failure}")
        return True

    def _copy_from_gets(self, fragments, dest_ptr):
        fetched = {}
        for key, chunk_size, chunk_off, dst, n in fragments:
            data = fetched.get(key)
            if data is None:
                data = self.store.get(key)
                if data is None or len(data) != chunk_size:
                    got = "nothing" if data is None else f"{len(data)} bytes"
                    raise RuntimeError(f"get failed for {key}: expected {chunk_size} bytes, "
                                       f"got {got}")
                fetched[key] = data
            ctypes.memmove(dest_ptr + dst, bytes(memoryview(data)[chunk_off:chunk_off + n]), n)

    def read_bytes(self, spec, offset=0, length=None):
        """Payload bytes [offset, offset+length) (to the end by default)."""
        total = int(spec["bytes"])
        length = total - offset if length is None else length
        out = bytearray(length)
        if length:
            ptr, anchor = address_of(memoryview(out))
            self.read_ranges(spec, ptr, length, [(offset, 0, length)])
            del anchor
        return bytes(out)

    # ------------------------------------------------------------ removal

    def remove_keys(self, keys, strict):
        """Removes the objects (already missing is fine); with ``strict`` a failure
        raises RuntimeError, else it is ignored."""
        pending = list(dict.fromkeys(keys))
        if not pending:
            return
        batch_remove = getattr(self.store, "batch_remove", None)
        if callable(batch_remove):
            try:
                results = batch_remove(pending, True)
            except Exception:  # retried one by one below
                results = ()
            if len(results) == len(pending):
                pending = [k for k, rc in zip(pending, results)
                           if rc not in (None, 0, MISSING_OBJECT_ERROR)]
        failures = []
        for key in pending:
            try:
                rc = self.store.remove(key, True)
            except Exception as e:  # the store's own failure, reported below
                rc = e
            if rc not in (None, 0, MISSING_OBJECT_ERROR):
                failures.append((key, rc))
        if failures and strict:
            raise RuntimeError(f"failed to remove {len(failures)} Mooncake keys: {failures[:3]}")


def _fragments(chunks, ranges):
    """[(chunk key, chunk size, offset in chunk, destination offset, length)] covering
    each payload range."""
    starts, pos = [], 0
    for chunk in chunks:
        starts.append(pos)
        pos += int(chunk["bytes"])
    out = []
    for src, dst, n in ranges:
        end = src + n
        for chunk, start in zip(chunks, starts):
            size = int(chunk["bytes"])
            lo, hi = max(src, start), min(end, start + size)
            if lo < hi:
                out.append((chunk["key"], size, lo - start, dst + lo - src, hi - lo))
    return out


def encode_json(value, what):
    try:
        return json.dumps(value, ensure_ascii=False, separators=(",", ":")).encode("utf-8")
    except (TypeError, ValueError) as e:
        raise TypeError(f"{what} must be JSON-serializable: {e}") from None


def decode_json(payload, what):
    try:
        value = json.loads(bytes(payload).decode("utf-8"))
    except (UnicodeDecodeError, ValueError) as e:
        raise ValueError(f"malformed {what}: {e}") from None
    if not isinstance(value, dict):
        raise ValueError(f"malformed {what}: not a JSON object")
    return value




class BundleStore:
    """Manifests and payloads of bundles in one store, under one key prefix."""

    def __init__(self, io, key_prefix, default_chunk_bytes):
        prefix = key_prefix.strip("/") if isinstance(key_prefix, str) else ""
        if not prefix or any(ord(c) < 32 for c in prefix):
            raise ValueError("key_prefix must be a non-empty key prefix")
        self.io = io
        self.prefix = prefix
        self.default_chunk_bytes = check_chunk_bytes(default_chunk_bytes)

    # ------------------------------------------------------------ writing

    def _new_object(self, partition):
        check_key_segment(partition, "partition")
        object_id = f"{partition}/{uuid.uuid4().hex}"
        return object_id, f"{self.prefix}/{object_id}"

    def _put_payload(self, key, value, chunk_bytes, policy, config):
        """(spec, keys written) of one payload."""
        if isinstance(value, ZeroCopySource):
            if value.size == 0:
                return {"key": key, "bytes": 0, "chunks": []}, []
            self.io.put_zero_copy(key, value, config)
            return {"key": key, "bytes": value.size,
                    "chunks": [{"key": key, "bytes": value.size}]}, [key]
        view = byte_view(value, "payload")
        if len(view) == 0:
            return {"key": key, "bytes": 0, "chunks": []}, []
        pieces = [view[i:i + chunk_bytes] for i in range(0, len(view), chunk_bytes)]
        keys = [key] if len(pieces) == 1 else [f"{key}/chunk/{i}" for i in range(len(pieces))]
        self.io.put_chunks(keys, pieces, policy, config)
        return {"key": key, "bytes": len(view),
                "chunks": [{"key": k, "bytes": len(p)} for k, p in zip(keys, pieces)]}, keys

    def put_bundle(self, meta, buffers, partition, chunk_bytes, policy, config,
                   buffer_specs=None, cleanup_keys=None, extra_object_ids=()):
        """Writes ``meta`` and each of ``buffers`` {name: bytes-like or ZeroCopySource},
        then the manifest (also naming ready ``buffer_specs`` of other bundles). Returns
        (manifest key, manifest); on failure removes what it wrote and raises."""
        chunk_bytes = check_chunk_bytes(self.default_chunk_bytes if chunk_bytes is None
                                        else chunk_bytes)
        object_id, base = self._new_object(partition)
        written = []
        try:
            meta_spec, keys = self._put_payload(f"{base}/meta", meta, chunk_bytes,
                                                policy.as_copy(), config)
            written += keys
            specs = dict(buffer_specs or {})
            for name, value in buffers.items():
                check_key_segment(name, "buffer name")
                if name in specs:
                    raise ValueError(f"structured members already exist: {[name]}")
                specs[name], keys = self._put_payload(f"{base}/buffer/{name}", value,
                                                      chunk_bytes, policy, config)
                written += keys
            manifest = {"version": 1, "layout": "bundle", "object_id": object_id,
                        "meta": meta_spec, "buffers": specs}
            owners = {self.object_id_of(spec["key"]) for spec in specs.values()}
            owners.update(extra_object_ids)
            owners.update(self.object_id_of(k) for k in cleanup_keys or ())
            owners.discard(None)
            if owners - {object_id}:
                manifest["buffer_object_ids"] = sorted(owners | {object_id})
            if cleanup_keys:
                manifest["cleanup_keys"] = list(dict.fromkeys(cleanup_keys))
            self.validate(manifest)
            manifest_key = f"{base}/manifest"
            check_status(_call(self.io.store.put, manifest_key,
                               encode_json(manifest, "bundle manifest"),
                               config=config), "put", manifest_key)
        except Exception:
            self.io.remove_keys(written, strict=False)
            raise
        return manifest_key, manifest

    # ------------------------------------------------------------ reading

    def load_manifest(self, manifest_key, embedded=None):
        manifest = embedded
        if not manifest:
            if not isinstance(manifest_key, str) or not manifest_key:
                raise ValueError("bundle ref must include manifest_key")
            data = self.io.store.get(manifest_key)
            if not data:
                raise KeyError(f"bundle manifest {manifest_key!r} not found")
            manifest = decode_json(data, "bundle manifest")
        self.validate(manifest)
        if manifest_key is not None and manifest_key != self.manifest_key_of(manifest):
            raise ValueError("bundle manifest_key does not match manifest object_id")
        return manifest

    def manifest_key_of(self, manifest):
        return f"{self.prefix}/{manifest['object_id']}/manifest"

    def object_id_of(self, key):
        """The object id a bundle key belongs to, or None for a key outside the prefix."""
        head = f"{self.prefix}/"
        if not isinstance(key, str) or not key.startswith(head):
            return None
        rest = key[len(head):]
        for tail in ("/manifest", "/meta"):
            if rest.endswith(tail):
                return rest[:-len(tail)]
        for marker in ("/meta/", "/buffer/"):
            cut = rest.find(marker)
            if cut > 0:
                return rest[:cut]
        return None

    def payload_keys(self, spec):
        return [chunk["key"] for chunk in spec["chunks"]]

    def all_keys(self, manifest):
        """Every key a manifest owns: payload chunks, cleanup keys, then itself."""
        keys = self.payload_keys(manifest["meta"])
        for spec in manifest["buffers"].values():
            keys += self.payload_keys(spec)
        keys += manifest.get("cleanup_keys", [])
        return keys

    # ------------------------------------------------------------ checks

    def validate(self, manifest):
        """ValueError unless ``manifest`` is a well-formed bundle manifest whose keys all
        lie under its object ids."""
        if not isinstance(manifest, dict) or manifest.get("version") != 1 or \
                manifest.get("layout") != "bundle":
            raise ValueError("invalid bundle manifest")
        object_id = manifest.get("object_id")
        if not isinstance(object_id, str) or not object_id:
            raise ValueError("bundle manifest object_id must be a string")
        owners = manifest.get("buffer_object_ids", [object_id])
        if not isinstance(owners, list) or not all(isinstance(o, str) and o for o in owners):
            raise ValueError("bundle manifest buffer_object_ids must be a list of strings")
        bases = [f"{self.prefix}/{o}" for o in owners]
        self._validate_spec(manifest.get("meta"), [f"{self.prefix}/{object_id}"])
        cleanup = manifest.get("cleanup_keys", [])
        if not isinstance(cleanup, list) or not all(
                isinstance(k, str) and any(k == f"{b}/manifest" or k.startswith(f"{b}/")
                                           for b in bases) for k in cleanup):
            raise ValueError("bundle manifest cleanup_keys are outside the bundle namespace")
        buffers = manifest.get("buffers")
        if not isinstance(buffers, dict):
            raise ValueError("bundle manifest buffers must be a dict")
        for name, spec in buffers.items():
            check_key_segment(name, "buffer name")
            self._validate_spec(spec, bases)

    @staticmethod
    def _validate_spec(spec, bases):
        if not isinstance(spec, dict):
            raise ValueError("bundle payload spec must be a dict")
        key = spec.get("key")
        if not isinstance(key, str) or not any(key.startswith(f"{b}/") for b in bases):
            raise ValueError("bundle payload key is outside the bundle namespace")
        total = spec.get("bytes")
        chunks = spec.get("chunks")
        if isinstance(total, bool) or not isinstance(total, int) or total < 0:
            raise ValueError("bundle payload bytes must be non-negative")
        if not isinstance(chunks, list) or (total and not chunks):
            raise ValueError("bundle payload chunks are invalid")
        seen, summed = set(), 0
        for chunk in chunks:
            if not isinstance(chunk, dict):
                raise ValueError("bundle chunk must be a dict")
            ckey, size = chunk.get("key"), chunk.get("bytes")
            if not isinstance(ckey, str) or (ckey != key and not ckey.startswith(f"{key}/")):
                raise ValueError("bundle chunk key is outside the payload namespace")
            if ckey in seen:
                raise ValueError("bundle chunk keys must be unique")
            if isinstance(size, bool) or not isinstance(size, int) or size < 0:
                raise ValueError("bundle chunk bytes must be non-negative")
            seen.add(ckey)
            summed += size
        if summed != total:
            raise ValueError(f"bundle payload chunks total {summed} bytes, expected {total}")


def check_chunk_bytes(chunk_bytes):
    if isinstance(chunk_bytes, bool) or not isinstance(chunk_bytes, int) or chunk_bytes <= 0:
        raise ValueError("chunk_bytes must be positive")
    return chunk_bytes

