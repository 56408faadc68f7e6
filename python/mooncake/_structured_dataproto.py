"""The shapes of DataProto data in ``mooncake.structured_object_store``: splitting a
DataProto-like object, an envelope dict or a flat dict into (batch, non_tensor_batch,
meta_info), the batch size, FieldSchema sections, row selections and field selections,
and building results back (a flat dict, an envelope or ``data_cls``).

A flat dict (``put(type="dict")``) is placed field by field: FieldSchema
``metadata["section"]`` wins; else dense row-aligned arrays and tensors are batch
fields, row-aligned sequences non-tensor fields (unless a schema fixed the row count),
and everything else meta_info.
"""

import sys
from collections.abc import Mapping, Sequence

from ._structured_payloads import TensorObjectBuffer, is_ndarray, is_tensor

SECTIONS = ("batch", "non_tensor_batch", "meta_info")


def to_dict(value):
    if value is None:
        return {}
    if isinstance(value, Mapping):
        return dict(value)
    items = getattr(value, "items", None)
    if callable(items):
        return dict(items())
    raise TypeError(f"expected mapping-like value, got {type(value).__name__}")


def _is_envelope(data):
    return bool(data) and set(data) <= set(SECTIONS) and all(
        v is None or isinstance(v, Mapping) or callable(getattr(v, "items", None))
        for v in data.values())


def split_sections(data):
    """(batch, non_tensor_batch, meta_info) of a DataProto-like object or envelope."""
    if isinstance(data, Mapping):
        if _is_envelope(data):
            return tuple(to_dict(data.get(s)) for s in SECTIONS)
        return dict(data), {}, {}
    return tuple(to_dict(getattr(data, s, None)) for s in SECTIONS)


def _rows_of(value):
    if isinstance(value, TensorObjectBuffer):
        return len(value)  # its TypeError says a batch_size is needed
    try:
        return len(value)
    except TypeError:
        raise ValueError(f"DataProto field of type {type(value).__name__} has no batch size") \
            from None


def batch_size(batch, non_tensor):
    sizes = {_rows_of(v) for section in (batch, non_tensor) for v in section.values()}
    if len(sizes) > 1:
        raise ValueError(f"DataProto fields have inconsistent batch sizes: {sorted(sizes)}")
    return sizes.pop() if sizes else 0


def schema_section(name, schema):
    section = schema.metadata.get("section")
    if section is not None and section not in SECTIONS:
        raise ValueError(f"FieldSchema for {name!r} metadata['section'] must be one of "
                         f"{sorted(SECTIONS)}")
    return section


def check_schema_sections(sections, schemas):
    present = {}
    for section, fields in zip(SECTIONS, sections):
        for name in fields:
            present.setdefault(name, set()).add(section)
    for name, schema in (schemas or {}).items():
        declared = schema_section(name, schema)
        if declared and name in present and declared not in present[name]:
            raise ValueError(f"FieldSchema for {name!r} declares section {declared!r}, but "
                             f"data contains it in {', '.join(sorted(present[name]))}")


def _is_dense(value):
    if is_tensor(value):
        return value.dim() > 0
    return is_ndarray(value) and not value.dtype.hasobject and value.ndim > 0


def is_row_list(value):
    return isinstance(value, Sequence) and not isinstance(value, (str, bytes, bytearray))


def _flat_rows(data, schemas):
    """The row count of a flat dict: from schema-placed fields, else dense arrays, else
    row lists; ValueError when they disagree."""
    placed = {len(data[n]) for n, s in schemas.items()
              if n in data and schema_section(n, s) in ("batch", "non_tensor_batch")}
    if placed:
        if len(placed) > 1:
            raise ValueError(f"flat dict fields have inconsistent batch sizes: {sorted(placed)}")
        return placed.pop(), True
    meta = {n for n, s in schemas.items() if schema_section(n, s) == "meta_info"}
    dense = {len(v) for k, v in data.items() if k not in meta and _is_dense(v)}
    if len(dense) > 1:
        raise ValueError(f"flat dict dense fields have ambiguous batch sizes: {sorted(dense)}")
    if dense:
        return dense.pop(), False
    lists = {len(v) for k, v in data.items() if k not in meta and
             (is_row_list(v) or (is_ndarray(v) and v.ndim > 0))}
    if len(lists) > 1:
        raise ValueError(f"flat dict fields have ambiguous batch sizes: {sorted(lists)}; pass "
                         "FieldSchema metadata['section'] for list-valued metadata fields")
    return (lists.pop() if lists else 0), False


def _object_rows(name, value, rows):
    if is_ndarray(value):
        if len(value) != rows:
            raise ValueError(f"flat dict non_tensor_batch field {name!r} has batch size "
                             f"{len(value)}, expected {rows}")
        return value
    if not is_row_list(value):
        raise TypeError(f"flat dict non_tensor_batch field {name!r} must be an ndarray or "
                        "non-string sequence")
    if len(value) != rows:
        raise ValueError(f"flat dict non_tensor_batch field {name!r} has batch size "
                         f"{len(value)}, expected {rows}")
    return list(value)


def flat_to_envelope(data, schemas):
    """A flat dict as {batch, non_tensor_batch, meta_info}: dense row-aligned arrays are
    batch fields, row lists non-tensor fields, everything else meta_info (unless a
    FieldSchema places the field)."""
    if not isinstance(data, Mapping):
        raise TypeError("flat dict payload must be a mapping")
    schemas = schemas or {}
    rows, from_schema = _flat_rows(data, schemas)
    batch, non_tensor, meta = {}, {}, {}
    for name, value in data.items():
        section = schema_section(name, schemas[name]) if name in schemas else None
        if section is None:
            if rows and _is_dense(value) and len(value) == rows:
                section = "batch"
            elif not from_schema and rows and is_row_list(value) and len(value) == rows:
                section = "non_tensor_batch"
            else:
                section = "meta_info"
        if section == "batch":
            batch[name] = value
        elif section == "non_tensor_batch":
            non_tensor[name] = _object_rows(name, value, rows)
        else:
            meta[name] = value
    return {"batch": batch, "non_tensor_batch": non_tensor, "meta_info": meta}


def envelope_to_flat(result):
    sections = [to_dict(result.get(s)) for s in ("meta_info", "batch", "non_tensor_batch")]
    seen, overlap = set(), set()
    for section in sections:
        overlap |= seen & set(section)
        seen |= set(section)
    if overlap:
        raise ValueError(f"Duplicate keys found across DataProto sections: {sorted(overlap)}")
    flat = {}
    for section in sections:
        for name, value in section.items():
            if is_ndarray(value) and value.dtype.hasobject:
                value = value.tolist()
            flat[name] = value
    return flat


def build_result(batch, non_tensor, meta_info, data_cls):
    if data_cls is None or data_cls is dict:
        return {"batch": batch, "non_tensor_batch": non_tensor, "meta_info": meta_info}
    try:
        from_dict = getattr(data_cls, "from_dict", None)
        if callable(from_dict):
            return from_dict(batch, non_tensor, meta_info=meta_info)
        return data_cls(batch=batch, non_tensor_batch=non_tensor, meta_info=meta_info)
    except TypeError as e:
        raise TypeError(f"{getattr(data_cls, '__name__', data_cls)!r} cannot be constructed "
                        "from batch, non_tensor_batch, and meta_info") from e


def row_selection(rows, total):
    """None, a StructuredMemberSlice, or a tuple of row indices; plus the row count."""
    from .structured_object_store import StructuredMemberSlice
    if rows is None:
        return None, total
    if isinstance(rows, slice):
        start, end, step = rows.indices(total)
        if step <= 0:
            raise ValueError("DataProto row slicing step must be positive")
        rows = StructuredMemberSlice(0, start, end, step)
    if isinstance(rows, StructuredMemberSlice):
        if rows.axis != 0:
            raise ValueError("DataProto row slicing currently supports axis=0 only")
        if rows.step <= 0:
            raise ValueError("DataProto row slicing step must be positive")
        return rows, len(range(*slice(rows.start, rows.end, rows.step).indices(total)))
    if not is_row_list(rows) and not is_ndarray(rows):
        raise TypeError("DataProto rows must be a slice, StructuredMemberSlice, or row index "
                        "sequence")
    picked = []
    np = sys.modules.get("numpy")
    for index in rows:
        if isinstance(index, bool) or not (isinstance(index, int) or (
                np is not None and isinstance(index, np.integer))):
            raise TypeError("DataProto row indices must be integers")
        i = int(index) + (total if int(index) < 0 else 0)
        if not 0 <= i < total:
            raise IndexError(f"DataProto row index {index} out of range for {total} rows")
        picked.append(i)
    return tuple(picked), len(picked)


def selected_fields(ref, fields, batch_fields, non_tensor_fields):
    if fields is not None and (batch_fields is not None or non_tensor_fields is not None):
        raise ValueError("fields cannot be combined with batch_fields or non_tensor_fields")
    if fields is not None:
        names = list(fields)
    elif batch_fields is None and non_tensor_fields is None:
        names = list(ref.field_index)
    else:
        names = list(batch_fields or []) + list(non_tensor_fields or [])
    missing = [n for n in names if n not in ref.field_index]
    if missing:
        raise KeyError(f"unknown DataProto fields: {missing}")
    if fields is None and (batch_fields is not None or non_tensor_fields is not None):
        wrong = [n for n in batch_fields or [] if ref.field_index[n].section != "batch"] + \
            [n for n in non_tensor_fields or [] if ref.field_index[n].section == "batch"]
        if wrong:
            raise ValueError(f"DataProto fields are in the other section: {wrong}")
    return names
