"""Bundles: named payloads stored as chunked store objects under one JSON manifest (the
layer under ``mooncake.structured_object_store``; upstream's ``_BundleManifestStore``,
whose key layout and manifest this writes and reads byte for byte).

Keys, under ``<prefix>/<partition>/<uuid>`` (the object id):
  .../manifest                 {"version": 1, "layout": "bundle", "object_id", "meta":
                               spec, "buffers": {name: spec}, ["buffer_object_ids",
                               "cleanup_keys"]}
  .../meta, .../buffer/<name>  a payload: one object, or .../chunk/<i> when larger than
                               the chunk size
A payload spec is {"key", "bytes", "chunks": [{"key", "bytes"}, ...]}; a tensor put with
the store's tensor calls adds "kind": "tensor", "dtype", "shape", "metadata_bytes"; a
serialized tensor adds "metadata_bytes" (its header size) or "format": "torch_save".
A manifest made by merging others (``put_bundle_manifest``, a DataProto same-stage
append) names payloads of other object ids (``buffer_object_ids``) and keys to remove
with it (``cleanup_keys``); every key a manifest names must lie under one of its object
ids, so a forged manifest cannot make ``remove_bundle`` delete unrelated objects.
"""

import json
import uuid

from . import _structured_payloads as P
from ._structured_transport import AUTO_PARALLEL_MIN_BYTES, AUTO_PARALLEL_MIN_CHUNKS

PUT_MODES = ("auto", "batch", "parallel")
COPY_MODES = ("auto", "zero_copy", "copy")


def check_key_segment(value, what):
    """A name used inside keys: non-empty, no '/', no control characters."""
    if not isinstance(value, str) or not value or "/" in value or \
            any(ord(c) < 32 for c in value):
        raise ValueError(f"invalid bundle {what}: {value!r}")
    return value


def check_chunk_bytes(chunk_bytes):
    if isinstance(chunk_bytes, bool) or not isinstance(chunk_bytes, int) or chunk_bytes <= 0:
        raise ValueError("chunk_bytes must be positive")
    return chunk_bytes


def normalize_key_prefix(key_prefix):
    prefix = key_prefix.strip("/") if isinstance(key_prefix, str) else ""
    if not prefix or any(ord(c) < 32 for c in prefix):
        raise ValueError("key_prefix must be a non-empty key prefix")
    return prefix


def encode_json(value, what):
    try:
        return json.dumps(value, separators=(",", ":")).encode("utf-8")
    except (TypeError, ValueError) as e:
        raise TypeError(f"{what} must be JSON-serializable: {e}") from None


def decode_json(payload, what):
    if payload is None:
        raise KeyError(f"{what} not found")
    try:
        value = json.loads(bytes(payload).decode("utf-8"))
    except (UnicodeDecodeError, ValueError) as e:
        raise ValueError(f"malformed {what}: {e}") from None
    if not isinstance(value, dict):
        raise ValueError(f"{what} must decode to a dict")
    return value


def _split(view, chunk_bytes):
    return [view[i:i + chunk_bytes] for i in range(0, len(view), chunk_bytes)] or [view]


def _split_groups(buffers, chunk_bytes):
    """Byte views cut into chunk groups of ``chunk_bytes`` (the last may be shorter)."""
    groups, current, filled = [], [], 0
    for buffer in buffers:
        offset = 0
        while offset < len(buffer):
            part = buffer[offset:offset + chunk_bytes - filled]
            current.append(part)
            filled += len(part)
            offset += len(part)
            if filled == chunk_bytes:
                groups.append(current)
                current, filled = [], 0
    if current:
        groups.append(current)
    return groups


def _spec(key, total, keys, sizes):
    return {"key": key, "bytes": total,
            "chunks": [{"key": k, "bytes": s} for k, s in zip(keys, sizes)]}


def _chunk_keys(key, count):
    return [key] if count == 1 else [f"{key}/chunk/{i}" for i in range(count)]


class BundleManifestStore:
    def __init__(self, store, transport, key_prefix, default_chunk_bytes):
        self._store = store
        self._transport = transport
        self._key_prefix = key_prefix
        self._default_chunk_bytes = default_chunk_bytes

    # ------------------------------------------------------------ policy

    @staticmethod
    def _policy(policy, max_inflight_put=None):
        from .structured_object_store import BundleTransferPolicy
        result = policy or BundleTransferPolicy()
        if max_inflight_put is not None:
            result = BundleTransferPolicy(max_inflight_put, result.put_mode, result.copy_mode)
        if isinstance(result.max_inflight_put, bool) or \
                not isinstance(result.max_inflight_put, int) or result.max_inflight_put < 1:
            raise ValueError("max_inflight_put must be positive")
        if result.put_mode not in PUT_MODES:
            raise ValueError(f"unsupported put_mode: {result.put_mode}")
        if result.copy_mode not in COPY_MODES:
            raise ValueError(f"unsupported copy_mode: {result.copy_mode}")
        return result

    @staticmethod
    def _as_copy(policy):
        from .structured_object_store import BundleTransferPolicy
        return policy if policy.copy_mode == "copy" else \
            BundleTransferPolicy(policy.max_inflight_put, policy.put_mode, "copy")

    def _new_object(self, partition):
        check_key_segment(partition, "partition")
        object_id = f"{partition}/{uuid.uuid4().hex}"
        return object_id, f"{self._key_prefix}/{object_id}"

    # ------------------------------------------------------------ writing

    def put_bundle(self, meta, buffers, partition, chunk_bytes, policy, max_inflight_put,
                   config=None):
        """Writes ``meta`` and each of ``buffers`` (bytes-like or a payload form), then
        the manifest; on failure removes what it wrote and raises. Returns a
        RemoteBundleRef."""
        from .structured_object_store import RemoteBundleRef
        check_key_segment(partition, "partition")
        meta_view = P.byte_view(meta, "meta")
        chunk_bytes = check_chunk_bytes(self._default_chunk_bytes if chunk_bytes is None
                                        else chunk_bytes)
        policy = self._policy(policy, max_inflight_put)
        object_id, base = self._new_object(partition)
        written, specs = [], {}
        try:
            meta_spec, keys = self._put_payload(f"{base}/meta", meta_view, chunk_bytes,
                                                self._as_copy(policy), config)
            written += keys
            for name, value in buffers.items():
                check_key_segment(name, "buffer name")
                specs[name], keys = self._put_value(f"{base}/buffer/{name}", name, value,
                                                    chunk_bytes, policy, config)
                written += keys
            manifest = {"version": 1, "layout": "bundle", "object_id": object_id,
                        "meta": meta_spec, "buffers": specs}
            manifest_key = f"{base}/manifest"
            self._transport.put(manifest_key, encode_json(manifest, "bundle manifest"),
                                config)
        except Exception:
            P.remove_keys(self._store, written, strict=False)
            raise
        return RemoteBundleRef(manifest_key, manifest)

    def put_bundle_manifest(self, meta, buffers, *, partition, chunk_bytes, policy,
                            cleanup_keys=None, config=None):
        """A manifest over payload specs already stored (``buffers`` {name: spec}) with
        new ``meta``; it owns ``cleanup_keys`` too."""
        from .structured_object_store import RemoteBundleRef
        check_key_segment(partition, "partition")
        meta_view = P.byte_view(meta, "meta")
        chunk_bytes = check_chunk_bytes(self._default_chunk_bytes if chunk_bytes is None
                                        else chunk_bytes)
        policy = self._policy(policy)
        object_id, base = self._new_object(partition)
        written = []
        try:
            meta_spec, written = self._put_payload(f"{base}/meta", meta_view, chunk_bytes,
                                                   self._as_copy(policy), config)
            cleanup = list(dict.fromkeys(cleanup_keys or []))
            owners = {self._object_id_from_bundle_key(str(s["key"])) for s in buffers.values()}
            owners.update(self._object_id_from_bundle_key(k) for k in cleanup)
            manifest = {"version": 1, "layout": "bundle", "object_id": object_id,
                        "meta": meta_spec, "buffers": dict(buffers),
                        "buffer_object_ids": sorted(o for o in owners if o)}
            if cleanup:
                manifest["cleanup_keys"] = cleanup
            self._validate_manifest(manifest)
            manifest_key = f"{base}/manifest"
            self._transport.put(manifest_key, encode_json(manifest, "bundle manifest"),
                                config)
        except Exception:
            P.remove_keys(self._store, written, strict=False)
            raise
        return RemoteBundleRef(manifest_key, manifest)

    def _put_value(self, key, name, value, chunk_bytes, policy, config):
        if isinstance(value, (P.TensorPayload, P.TensorObjectBuffer)):
            return self._put_tensor_payload(key, value, policy, config)
        if isinstance(value, P.MultiBufferPayload):
            return self._put_multi_buffer_payload(key, value, chunk_bytes, policy, config)
        if isinstance(value, P.DirectCopyPayload):
            return self._put_direct_copy_payload(key, value, chunk_bytes, policy, config)
        return self._put_payload(key, P.byte_view(value, name), chunk_bytes, policy, config)

    def _put_payload(self, key, view, chunk_bytes, transfer_policy, config=None):
        """(spec, keys) of one byte view cut into chunks."""
        if len(view) == 0:
            return _spec(key, 0, [], []), []
        chunks = _split(view, chunk_bytes)
        keys = _chunk_keys(key, len(chunks))
        self._transport.put_chunk_groups(keys, [[c] for c in chunks], transfer_policy, config)
        return _spec(key, len(view), keys, [len(c) for c in chunks]), keys

    def _put_multi_buffer_payload(self, key, value, chunk_bytes, transfer_policy,
                                  config=None):
        if value.nbytes == 0:
            return _spec(key, 0, [], []), []
        buffers = [P.byte_view(b, "payload part") for b in value.buffers]
        if len(buffers) == 1:
            return self._put_payload(key, buffers[0], chunk_bytes, transfer_policy, config)
        groups = _split_groups(buffers, chunk_bytes)
        keys = _chunk_keys(key, len(groups))
        self._transport.put_chunk_groups(keys, groups, transfer_policy, config)
        return _spec(key, value.nbytes, keys, [sum(len(p) for p in g) for g in groups]), keys

    def _put_direct_copy_payload(self, key, value, chunk_bytes, transfer_policy,
                                 config=None):
        """Arrays copied by the fast-copy hook straight into one pool lease per chunk
        (a chunk holds whole arrays); one concatenated copy when there is no pool or an
        array is larger than a chunk."""
        if transfer_policy.copy_mode == "zero_copy":
            raise RuntimeError("zero-copy put requires tensor-object buffers")
        if value.total_bytes == 0:
            return _spec(key, 0, [], []), []
        np = P.numpy()
        arrays = value.arrays
        concatenated = (lambda: memoryview(np.concatenate(
            [a.reshape(-1).view(np.uint8) for a in arrays]).data).cast("B"))
        if len(arrays) == 1:
            return self._put_payload(key, memoryview(arrays[0].reshape(-1).view(np.uint8)),
                                     chunk_bytes, transfer_policy, config)
        pool = self._transport._ensure_buffer_pool()
        if pool is None or not callable(self._transport._batch_put_from) or \
                any(a.nbytes > chunk_bytes for a in arrays):
            return self._put_payload(key, concatenated(), chunk_bytes, transfer_policy,
                                     config)
        batches, start, filled = [], 0, 0  # (first array, count, bytes)
        for i, array in enumerate(arrays):
            if filled and filled + array.nbytes > chunk_bytes:
                batches.append((start, i - start, filled))
                start, filled = i, 0
            filled += array.nbytes
        batches.append((start, len(arrays) - start, filled))
        keys = _chunk_keys(key, len(batches))
        copy_into = P.facade("_concat_arrays_into")

        def put_batches(batch_keys, batch_list):
            for chunk_key, (first, count, size) in zip(batch_keys, batch_list):
                lease = pool.acquire(size)
                try:
                    copied = copy_into(arrays, lease.ptr, size, first, count)
                    if copied != size:
                        raise RuntimeError(f"native fast-copy wrote {copied} bytes, "
                                           f"expected {size}")
                    self._transport.batch_put_from([chunk_key], [lease.ptr], [size], config)
                finally:
                    lease.release()

        parallel = transfer_policy.put_mode != "batch" and \
            transfer_policy.max_inflight_put > 1 and len(batches) >= AUTO_PARALLEL_MIN_CHUNKS \
            and value.total_bytes >= AUTO_PARALLEL_MIN_BYTES
        try:
            if not parallel:
                put_batches(keys, batches)
            else:
                from concurrent.futures import ThreadPoolExecutor
                count = max(1, min(transfer_policy.max_inflight_put, len(batches)))
                size = -(-len(batches) // count)
                with ThreadPoolExecutor(max_workers=count) as executor:
                    futures = [executor.submit(put_batches, keys[i:i + size],
                                               batches[i:i + size])
                               for i in range(0, len(batches), size)]
                    for future in futures:
                        future.result()
        except Exception:
            P.remove_keys(self._store, keys, strict=False)
            raise
        return _spec(key, value.total_bytes, keys, [b[2] for b in batches]), keys

    def _put_tensor_payload(self, key, value, transfer_policy, config=None):
        from . import _structured_codecs as C
        if isinstance(value, P.TensorObjectBuffer):
            total = self._transport.put_tensor_object_buffer(key, value, config)
            return _spec(key, total, [key], [total]), [key]
        tensor = value.tensor
        if transfer_policy.copy_mode != "copy":
            if transfer_policy.copy_mode == "zero_copy":
                raise ValueError("zero-copy structured tensor fields require a BufferPool "
                                 "tensor-object buffer")
            spec = self._transport.put_tensor_direct(key, tensor, C.tensor_metadata_size(),
                                                     config)
            if spec is not None:
                return spec, [key]
            try:
                total = self._transport.put_serialized_from_pool(
                    key, *C.serialize_tensor(tensor), config)
                return _spec(key, total, [key], [total]), [key]
            except RuntimeError:
                pass  # no pool or no put_from: write the bytes below
        if not P.facade("_has_tensor_codec_helpers")() or tensor.dim() == 0:
            payload = C.torch_save_bytes(tensor)
            spec, keys = self._put_payload(key, memoryview(payload), len(payload) or 1,
                                           transfer_policy, config)
            spec["format"] = "torch_save"
            return spec, keys
        payload, header_bytes = C.serialized_tensor_bytes(tensor)
        spec, keys = self._put_payload(key, memoryview(payload), len(payload) or 1,
                                       transfer_policy, config)
        spec["metadata_bytes"] = header_bytes
        return spec, keys

    # ------------------------------------------------------------ reading

    def resolve_manifest(self, ref):
        """The validated manifest of a RemoteBundleRef or {"manifest_key"[, "manifest"]}."""
        if hasattr(ref, "manifest_key") and hasattr(ref, "manifest"):
            manifest = ref.manifest or self._load(ref.manifest_key)
        elif isinstance(ref, dict) or hasattr(ref, "get"):
            manifest = ref.get("manifest")
            if manifest is None:
                key = ref.get("manifest_key")
                if not isinstance(key, str):
                    raise ValueError("bundle ref must include manifest_key")
                manifest = self._load(key)
        else:
            raise TypeError(f"expected RemoteBundleRef or mapping, got {type(ref).__name__}")
        self._validate_manifest(manifest)
        return manifest

    def _load(self, manifest_key):
        return decode_json(self._store.get(manifest_key), "bundle manifest")

    def manifest_key(self, ref):
        return self._manifest_key(ref, self.resolve_manifest(ref))

    def _manifest_key(self, ref, manifest):
        expected = f"{self._key_prefix}/{manifest['object_id']}/manifest"
        key = getattr(ref, "manifest_key", None) if not isinstance(ref, dict) \
            else ref.get("manifest_key")
        if key is None:
            return expected
        if key != expected:
            raise ValueError("bundle manifest_key does not match manifest object_id")
        return key

    @staticmethod
    def payload_keys(spec):
        return [chunk["key"] for chunk in spec["chunks"]]

    def remove_bundle(self, ref):
        """Every payload chunk, cleanup key and the manifest, in one removal."""
        manifest = self.resolve_manifest(ref)
        keys = [k for spec in (manifest["meta"], *manifest["buffers"].values())
                for k in self.payload_keys(spec)]
        keys += manifest.get("cleanup_keys", [])
        keys.append(self._manifest_key(ref, manifest))
        P.remove_keys(self._store, keys, strict=True)

    def remove_keys(self, keys, *, strict):
        P.remove_keys(self._store, keys, strict)

    def read_payload(self, spec):
        return self._transport.read_payload(spec)

    # ------------------------------------------------------------ checks

    def _object_id_from_bundle_key(self, key):
        head = f"{self._key_prefix}/"
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

    def _validate_manifest(self, manifest):
        if not isinstance(manifest, dict) or manifest.get("version") != 1 or \
                manifest.get("layout") != "bundle":
            raise ValueError("invalid bundle manifest")
        object_id = manifest.get("object_id")
        if not isinstance(object_id, str):
            raise ValueError("bundle manifest object_id must be a string")
        owners = manifest.get("buffer_object_ids", [object_id])
        if not isinstance(owners, list) or not all(isinstance(o, str) for o in owners):
            raise ValueError("bundle manifest buffer_object_ids must be a list of strings")
        bases = [f"{self._key_prefix}/{o}" for o in owners]
        self._validate_payload_spec(manifest.get("meta"), [f"{self._key_prefix}/{object_id}"])
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
            self._validate_payload_spec(spec, bases)

    @staticmethod
    def _validate_payload_spec(spec, bases):
        if not isinstance(spec, dict):
            raise ValueError("bundle payload spec must be a dict")
        key = spec.get("key")
        if not isinstance(key, str) or not any(key.startswith(f"{b}/") for b in bases):
            raise ValueError("bundle payload key is outside the bundle namespace")
        total = _count(spec.get("bytes"), "bundle payload bytes must be non-negative")
        chunks = spec.get("chunks")
        if not isinstance(chunks, list) or (total and not chunks):
            raise ValueError("bundle payload chunks are invalid")
        seen, summed = set(), 0
        for chunk in chunks:
            if not isinstance(chunk, dict):
                raise ValueError("bundle chunk must be a dict")
            chunk_key = chunk.get("key")
            if not isinstance(chunk_key, str) or (chunk_key != key and
                                                  not chunk_key.startswith(f"{key}/")):
                raise ValueError("bundle chunk key is outside the payload namespace")
            if chunk_key in seen:
                raise ValueError("bundle chunk keys must be unique")
            seen.add(chunk_key)
            summed += _count(chunk.get("bytes"), "bundle chunk bytes must be non-negative")
        if summed != total:
            raise ValueError(f"bundle payload chunks total {summed} bytes, expected {total}")


def _count(value, message):
    if isinstance(value, bool) or not isinstance(value, int) or value < 0:
        raise ValueError(message)
    return value
