"""A catalog of logical DataProto rows: which stored fragment holds each field of each
row (upstream's ``mooncake.dataproto_catalog``).

A *partition* holds rows by *key*; each row has a *tag* (a dict, merged on update) and,
per field, a location ``(fragment id, row in the fragment)``. A fragment is one stored
DataProto of exactly one stage (a handle from ``structured_object_store.export_ref``;
its id is that stage's manifest key). ``update`` places the rows of a fragment under
keys; ``resolve`` turns an ordered read of keys and fields into fragment locations,
grouping fields that live in the same fragments:

    {"keys", "tags", "fields", "field_groups": [{"fields", "locations"}], "handles":
     {fragment id: handle}, "meta_info"}

Fragments published through ``DataProtoCatalogTransfer`` (``publish``) are *managed*:
once no key points at them and no pinned read (``resolve(pin=True)``, then
``release_read``) uses them, they are *retired*, and every answer lists the retired
handles (``retired_handles``) until ``ack_retired`` says their objects were removed.
Publications are idempotent per operation id, so a retried call does not publish twice.
The catalog itself does not lock: its host serializes calls.
"""

import copy
import logging
import threading
import uuid
from collections.abc import Mapping

__all__ = ["DataProtoCatalog", "DataProtoCatalogTransfer"]

logger = logging.getLogger("mooncake")


def _nonempty(value, name):
    if not isinstance(value, str) or not value:
        raise ValueError(f"{name} must be a non-empty string")
    return value


def _names(values, label):
    """A tuple of unique non-empty strings."""
    if isinstance(values, str):
        raise ValueError(f"{label} must be a sequence of non-empty strings")
    names = tuple(values)
    if not names or any(not isinstance(v, str) or not v for v in names):
        raise ValueError(f"{label} must be non-empty strings")
    if len(names) != len(set(names)):
        raise ValueError(f"{label} must be unique")
    return names


def _tags(tags, count):
    if tags is None:
        return None
    if len(tags) != count:
        raise ValueError("tags must have the same length as keys")
    if any(not isinstance(t, Mapping) for t in tags):
        raise TypeError("tags must be mappings")
    return [copy.deepcopy(dict(t)) for t in tags]


def _normalized(handle):
    """(ref, canonical handle) of a DataProto handle."""
    from .structured_object_store import export_dataproto_ref, import_dataproto_ref

    ref = import_dataproto_ref(handle)
    return ref, export_dataproto_ref(ref)


def _fragment(handle, rows):
    """(fragment id, canonical handle, field names) of a one-stage handle of ``rows``."""
    ref, canonical = _normalized(handle)
    if len(ref.stage_refs) != 1:
        raise ValueError("catalog fragments must contain exactly one DataProto stage")
    fragment_id = _nonempty(next(iter(ref.stage_refs.values())).manifest_key, "manifest_key")
    if ref.batch_size != rows:
        raise ValueError(f"DataProto batch size {ref.batch_size!r} does not match {rows} "
                         "logical keys")
    fields = _names(ref.field_index, "field names")
    return fragment_id, canonical, fields


def _field_union(entries, keys):
    return list(dict.fromkeys(f for k in keys for f in entries[k]["fields"]))


class DataProtoCatalog:
    """See the module docstring."""

    def __init__(self):
        self._partitions = {}  # partition -> key -> {"tag": {...}, "fields": {f: (frag, row)}}
        self._fragments = {}  # fragment id -> canonical handle
        self._refcounts = {}  # fragment id -> locations pointing at it
        self._managed = set()
        self._readers = {}  # fragment id -> pinned reads using it
        self._pins = {}  # read token -> fragment ids
        self._next_token = 0
        self._retired = {}  # fragment id -> handle awaiting removal
        self._publications = {}  # operation id -> answer given
        self._drained = False

    # ------------------------------------------------------------ writes

    def update(self, partition, keys, *, tags=None, handle=None):
        """Merges ``tags`` into the rows of ``keys`` and/or places the fields of the
        fragment ``handle`` (row i under keys[i])."""
        return self._update(partition, keys, tags, handle, managed=False)

    def publish(self, operation_id, partition, keys, *, tags=None, handle=None):
        """As update, for a managed fragment; idempotent per ``operation_id``."""
        operation_id = _nonempty(operation_id, "operation_id")
        if operation_id in self._publications:
            return copy.deepcopy(self._publications[operation_id])
        answer = self._update(partition, keys, tags, handle, managed=handle is not None)
        self._publications[operation_id] = copy.deepcopy(answer)
        return answer

    def ack_publication(self, operation_id):
        self._publications.pop(_nonempty(operation_id, "operation_id"), None)

    def _update(self, partition, keys, tags, handle, managed):
        if self._drained:
            raise RuntimeError("DataProto catalog is drained")
        partition = _nonempty(partition, "partition")
        keys = _names(keys, "keys")
        tags = _tags(tags, len(keys))
        fragment = _fragment(handle, len(keys)) if handle is not None else None
        if tags is None and fragment is None:
            raise ValueError("catalog update requires tags or a DataProto handle")
        if fragment is not None:
            self._check_new_fragment(*fragment[:2], managed)
        # Everything is checked: now change state.
        entries = self._partitions.setdefault(partition, {})
        answer_tags = []
        for row, key in enumerate(keys):
            entry = entries.setdefault(key, {"tag": {}, "fields": {}})
            if tags is not None:
                entry["tag"].update(tags[row])
            answer_tags.append(copy.deepcopy(entry["tag"]))
        if fragment is not None:
            fragment_id, canonical, fields = fragment
            self._fragments.setdefault(fragment_id, canonical)
            self._refcounts.setdefault(fragment_id, 0)
            if managed:
                self._managed.add(fragment_id)
            for row, key in enumerate(keys):
                self._place(entries[key], fields, (fragment_id, row))
        return {"keys": list(keys), "tags": answer_tags, "fields": _field_union(entries, keys),
                **self._retired_answer()}

    def _check_new_fragment(self, fragment_id, canonical, managed):
        known = self._fragments.get(fragment_id)
        if known is not None and known != canonical:
            raise ValueError(f"DataProto fragment id collision: {fragment_id!r}")
        if known is not None and (fragment_id in self._managed) != managed:
            raise ValueError(f"DataProto fragment management mismatch: {fragment_id!r}")
        if fragment_id in self._retired:
            raise ValueError(f"DataProto fragment id is pending retirement: {fragment_id!r}")

    def _place(self, entry, fields, location):
        """Points ``fields`` of one row at ``location``, releasing what they pointed at."""
        for name in fields:
            old = entry["fields"].get(name)
            if old == location:
                continue
            entry["fields"][name] = location
            if old is not None and old[0] == location[0]:
                continue  # another row of the same fragment: the count is unchanged
            if old is not None:
                self._drop_reference(old[0])
            self._refcounts[location[0]] += 1

    def publish_append(self, operation_id, fragment_id, partition, keys, *, previous_handle,
                       handle):
        """Replaces managed fragment ``fragment_id`` (now ``previous_handle``) by its
        appended form ``handle`` for ``keys``; idempotent per ``operation_id``. A stale or
        inconsistent append is answered ``{"append_rejected": why}``."""
        operation_id = _nonempty(operation_id, "operation_id")
        if operation_id in self._publications:
            return copy.deepcopy(self._publications[operation_id])
        if self._drained:
            return self._reject(operation_id, "DataProto catalog is drained")
        fragment_id = _nonempty(fragment_id, "fragment_id")
        partition = _nonempty(partition, "partition")
        keys = _names(keys, "keys")
        old_ref, old_canonical = _normalized(previous_handle)
        ref, canonical = _normalized(handle)
        if fragment_id not in self._managed or self._fragments.get(fragment_id) != old_canonical:
            return self._reject(operation_id, f"stale DataProto append handle: {fragment_id!r}")
        if not (ref.batch_size == old_ref.batch_size == len(keys)) or \
                not (ref.partition == old_ref.partition == partition) or \
                ref._storage_group_id != old_ref._storage_group_id:
            return self._reject(operation_id,
                                "appended DataProto handle changed fragment identity")
        if any(ref.field_index.get(n) != loc for n, loc in old_ref.field_index.items()):
            return self._reject(operation_id, "appended DataProto handle changed existing fields")
        entries = self._partitions.get(partition, {})
        missing = [k for k in keys if k not in entries]
        if missing:
            return self._reject(operation_id,
                                f"keys not found in partition {partition!r}: {missing}")
        added = [n for n in ref.field_index if n not in old_ref.field_index]
        for row, key in enumerate(keys):
            self._place(entries[key], added, (fragment_id, row))
        self._fragments[fragment_id] = canonical
        answer = {"keys": list(keys), "tags": [copy.deepcopy(entries[k]["tag"]) for k in keys],
                  "fields": _field_union(entries, keys), **self._retired_answer()}
        self._publications[operation_id] = copy.deepcopy(answer)
        return answer

    def _reject(self, operation_id, why):
        answer = {"append_rejected": why}
        self._publications[operation_id] = copy.deepcopy(answer)
        return answer

    # ------------------------------------------------------------ reads

    def resolve(self, partition, keys, fields=None, *, pin=False):
        """Where ``fields`` (default: every field of the keys) of ``keys`` are, in key
        order; ValueError when a key is unknown or lacks a field. ``pin`` keeps the
        fragments from retiring until ``release_read(answer["read_token"])``."""
        partition = _nonempty(partition, "partition")
        keys = _names(keys, "keys")
        entries = self._partitions.get(partition, {})
        missing = [k for k in keys if k not in entries]
        if missing:
            raise ValueError(f"keys were not found in partition {partition!r}: {missing}")
        selected = list(_names(fields, "field names")) if fields is not None \
            else _field_union(entries, keys)
        if not selected:
            raise ValueError("requested keys do not contain any fields")
        for key in keys:
            absent = [f for f in selected if f not in entries[key]["fields"]]
            if absent:
                raise ValueError(f"fields are not ready for key {key!r}: {absent}")
        groups = {}
        for name in selected:
            locations = tuple(entries[k]["fields"][name] for k in keys)
            groups.setdefault(locations, []).append(name)
        used = {fid for locations in groups for fid, _ in locations}
        handles = {fid: copy.deepcopy(self._fragments[fid]) for fid in used}
        meta_info = {}
        for handle in handles.values():
            for name, value in handle.get("meta_info", {}).items():
                if name in meta_info and meta_info[name] != value:
                    raise ValueError(f"conflicting DataProto meta_info value for {name!r}")
                meta_info[name] = copy.deepcopy(value)
        answer = {"keys": list(keys), "tags": [copy.deepcopy(entries[k]["tag"]) for k in keys],
                  "fields": selected,
                  "field_groups": [{"fields": names, "locations": list(locations)}
                                   for locations, names in groups.items()],
                  "handles": handles, "meta_info": meta_info}
        if pin:
            self._next_token += 1
            self._pins[self._next_token] = tuple(used)
            for fid in used:
                self._readers[fid] = self._readers.get(fid, 0) + 1
            answer["read_token"] = self._next_token
        return answer

    def release_read(self, token):
        """Ends a pinned read (again: nothing happens)."""
        for fid in self._pins.pop(token, ()):
            self._readers[fid] -= 1
            if self._readers[fid] == 0:
                del self._readers[fid]
                if fid not in self._refcounts:
                    self._retire(fid)
        return self._retired_answer()

    def list(self, partition=None):
        """{partition: {key: tag}} (one partition, or all)."""
        if partition is not None:
            partition = _nonempty(partition, "partition")
            names = [partition] if partition in self._partitions else []
        else:
            names = list(self._partitions)
        return {p: {k: copy.deepcopy(e["tag"]) for k, e in self._partitions[p].items()}
                for p in names}

    # ------------------------------------------------------------ removal

    def remove(self, partition, keys):
        """Forgets rows (their writers are done); fragments no longer used retire."""
        partition = _nonempty(partition, "partition")
        keys = _names(keys, "keys")
        entries = self._partitions.get(partition)
        if entries is None:
            return self._retired_answer()
        for key in keys:
            entry = entries.pop(key, None)
            for fid, _ in (entry or {"fields": {}})["fields"].values():
                self._drop_reference(fid)
        if not entries:
            del self._partitions[partition]
        return self._retired_answer()

    def drain(self):
        """Retires every managed fragment and refuses further updates; RuntimeError while
        pinned reads are open."""
        if self._pins:
            raise RuntimeError(f"cannot drain DataProto catalog with {len(self._pins)} active "
                               "read(s)")
        for fid in self._managed:
            self._retired[fid] = self._fragments[fid]
        for table in (self._partitions, self._fragments, self._refcounts, self._readers,
                      self._publications):
            table.clear()
        self._managed.clear()
        self._drained = True
        return self._retired_answer()

    def ack_retired(self, handles):
        """Forgets retired handles whose store objects were removed."""
        for handle in handles:
            ref, canonical = _normalized(handle)
            fid = next((f for f, h in self._retired.items() if h == canonical), None)
            if fid is not None:
                del self._retired[fid]
            elif len(ref.stage_refs) == 1:
                fid = next(iter(ref.stage_refs.values())).manifest_key
                if fid in self._retired:
                    raise ValueError(f"retired DataProto fragment mismatch: {fid!r}")
        return self._retired_answer()

    def _drop_reference(self, fid):
        self._refcounts[fid] -= 1
        if self._refcounts[fid]:
            return
        del self._refcounts[fid]
        if not self._readers.get(fid):
            self._retire(fid)

    def _retire(self, fid):
        handle = self._fragments.pop(fid)
        if fid in self._managed:
            self._managed.remove(fid)
            self._retired[fid] = handle

    def _retired_answer(self):
        return {"retired_handles": [copy.deepcopy(h) for h in self._retired.values()]}


class DataProtoCatalogTransfer:
    """Stores DataProto fragments with a ``MooncakeBundleTransfer`` and publishes them
    in a catalog reached through ``catalog_call(method, *args, **kwargs)`` (a local
    DataProtoCatalog's bound methods, or an RPC to one). Failed publications and
    acknowledgements are retried on the next call; retired fragments are removed from
    the store when an answer lists them."""

    _RESULTS_ATTR = "_mooncake_catalog_results"

    def __init__(self, transfer, catalog_call):
        self.transfer = transfer
        self._catalog_call = catalog_call
        self._pending_publications = []
        self._pending_acks = []
        self._pending_results = []
        self._lock = threading.RLock()

    def put(self, data, *, partition, keys, tags=None, **put_kwargs):
        """Stores ``data`` (row i under keys[i]) as a fresh fragment and publishes it."""
        self._retry_acks()
        self._retry_publications(strict=True)
        partition = _nonempty(partition, "partition")
        keys = _names(keys, "keys")
        tags = _tags(tags, len(keys))
        if data is None and tags is None:
            raise ValueError("catalog update requires tags or DataProto data")
        handle = None
        if data is not None:
            if len(data) != len(keys):
                raise ValueError(f"DataProto batch size {len(data)} does not match {len(keys)} "
                                 "logical keys")
            from .structured_object_store import export_dataproto_ref

            handle = export_dataproto_ref(self.transfer.put(
                data, type="dataproto", partition=partition, **put_kwargs))
        return self._publish_twice({"operation_id": uuid.uuid4().hex, "method": "publish",
                                    "args": (partition, keys),
                                    "kwargs": {"tags": tags, "handle": handle}})

    def append(self, fragment_id, handle, data, *, partition, keys, stage, **append_kwargs):
        """Appends ``data``'s fields to a managed fragment and publishes the result."""
        self._retry_acks()
        self._retry_publications(strict=True)
        fragment_id = _nonempty(fragment_id, "fragment_id")
        partition = _nonempty(partition, "partition")
        keys = _names(keys, "keys")
        if append_kwargs.get("overwrite"):
            raise ValueError("catalog append does not support overwrite")
        if len(data) != len(keys):
            raise ValueError(f"DataProto batch size {len(data)} does not match {len(keys)} "
                             "logical keys")
        old_ref, old_handle = _normalized(handle)
        if old_ref.partition != partition:
            raise ValueError("DataProto handle partition does not match Catalog partition")
        plan = self._catalog_call("resolve", partition, keys, list(old_ref.field_index))
        if plan["handles"].get(fragment_id) != old_handle:
            raise ValueError(f"stale DataProto append handle: {fragment_id!r}")
        from .structured_object_store import export_dataproto_ref

        new_handle = export_dataproto_ref(self.transfer.append_dataproto_fields(
            old_handle, data, stage=stage, **append_kwargs))
        answer = self._publish_twice({
            "operation_id": uuid.uuid4().hex, "method": "publish_append",
            "args": (fragment_id, partition, keys),
            "kwargs": {"previous_handle": old_handle, "handle": new_handle}})
        if answer.get("append_rejected") is not None:
            raise ValueError(answer["append_rejected"])
        return answer

    def resolve(self, partition, keys, fields=None):
        """A pinned read plan; end it with ``release_read(plan["read_token"])``."""
        return self._catalog_call("resolve", partition, keys, fields, pin=True)

    def release_read(self, token):
        self._cleanup_retired(self._catalog_call("release_read", token))

    def attach_results(self, output, results):
        setattr(output, self._RESULTS_ATTR, list(results))

    def release_result(self, output):
        results = getattr(output, self._RESULTS_ATTR, ()) or ()
        setattr(output, self._RESULTS_ATTR, [])
        self.discard_results(results)

    def discard_results(self, results, *, strict=False):
        self._retry("_pending_results", results, self.transfer.release_result,
                    "release DataProto read buffer", attempts=2, strict=strict)

    def list(self, partition=None):
        return self._catalog_call("list", partition)

    def remove(self, partition, keys):
        self._cleanup_retired(self._catalog_call("remove", partition, keys))

    def drain(self):
        for attempt in range(2):
            try:
                self._retry_publications(strict=True)
                self._cleanup_retired(self._catalog_call("drain"), strict=True)
                return
            except Exception:  # one retry, then the failure is the caller's
                if attempt:
                    raise
                logger.exception("retrying DataProto Catalog drain")

    def close(self):
        self.discard_results((), strict=True)
        self._retry_publications(strict=True)
        self._retry_acks(strict=True)

    # ------------------------------------------------------------ internals

    def _publish_twice(self, publication):
        for attempt in range(2):
            try:
                return self._publish(publication)
            except Exception:  # one retry; then kept to retry on the next call
                if attempt:
                    with self._lock:
                        self._pending_publications.append(publication)
                    raise
                logger.exception("retrying DataProto Catalog publication")

    def _publish(self, publication):
        answer = self._catalog_call(publication["method"], publication["operation_id"],
                                    *publication["args"], **publication["kwargs"])
        if publication["method"] == "publish_append" and answer.get("append_rejected"):
            self.transfer.cleanup_dataproto_append(publication["kwargs"]["previous_handle"],
                                                   publication["kwargs"]["handle"])
        self._cleanup_retired(answer)
        try:
            self._catalog_call("ack_publication", publication["operation_id"])
        except Exception:  # kept to retry on the next call
            logger.exception("failed to acknowledge DataProto Catalog publication")
            with self._lock:
                if publication["operation_id"] not in self._pending_acks:
                    self._pending_acks.append(publication["operation_id"])
        return answer

    def _cleanup_retired(self, answer, *, strict=False):
        removed, failures = [], 0
        for handle in answer.get("retired_handles", ()):
            try:
                self.transfer.cleanup_dataproto(handle)
            except Exception:  # counted; the handle stays retired for a later try
                failures += 1
                logger.exception("failed to clean up retired DataProto fragment")
            else:
                removed.append(handle)
        if removed:
            try:
                self._catalog_call("ack_retired", removed)
            except Exception:
                logger.exception("failed to acknowledge retired DataProto fragments")
                if strict:
                    raise
        if strict and failures:
            raise RuntimeError(f"failed to clean up {failures} retired DataProto fragment(s)")

    def _retry_acks(self, *, strict=False):
        self._retry("_pending_acks", (),
                    lambda op: self._catalog_call("ack_publication", op),
                    "acknowledge DataProto Catalog publication", strict=strict)

    def _retry_publications(self, *, strict=False):
        self._retry("_pending_publications", (), self._publish,
                    "publish pending DataProto fragment", strict=strict)

    def _retry(self, attr, items, action, label, *, attempts=1, strict=False):
        with self._lock:
            pending = [*getattr(self, attr), *items]
            setattr(self, attr, [])
        for _ in range(attempts):
            failed = []
            for item in pending:
                try:
                    action(item)
                except Exception:  # kept for the next attempt
                    logger.exception("failed to %s", label)
                    failed.append(item)
            pending = failed
        with self._lock:
            getattr(self, attr).extend(pending)
            left = len(getattr(self, attr))
        if strict and left:
            raise RuntimeError(f"failed to {label} for {left} item(s)")
