"""A user's data file, checked before anything is built from it: every refusal names the file, and the line, the
row or the column, and the fix (a :class:`~hf_dtrain.errors.DataError`).

:func:`check_file` reads the file once before ``datasets`` does: empty files, text that is not UTF-8 (``datasets``
would otherwise replace or drop the bytes), JSON lines that do not parse or are not objects, and CSV rows whose field
count differs from the header (``datasets`` would fail deep inside pandas, or shift the columns). :func:`load_file`
then loads it with ``datasets``, turning the library's errors into one naming the file; :func:`check_text_columns`
refuses missing, null and non-text values in the columns a job trains on.
"""

from __future__ import annotations

import codecs
import csv
import json
import os

import pyarrow as pa
from datasets import load_dataset

from hf_dtrain.errors import DataError

# the extensions hf_dtrain reads and the ``datasets`` builder for each
FILE_TYPES = {"jsonl": "json", "json": "json", "csv": "csv", "parquet": "parquet", "txt": "text"}
_CHUNK = 1 << 20


def file_type(path: str, flag: str = "--dataset") -> str:
    """The ``datasets`` builder for ``path``'s extension; a ``DataError`` naming the supported ones otherwise."""
    ext = os.path.splitext(path)[1].lower().lstrip(".")
    if ext not in FILE_TYPES:
        raise DataError(f"{flag} {path}: unsupported file type {ext!r}; use one of {', '.join(FILE_TYPES)}.")
    return FILE_TYPES[ext]


def _check_utf8(path: str, flag: str) -> None:
    decoder = codecs.getincrementaldecoder("utf-8")()
    line, offset = 1, 0
    with open(path, "rb") as f:
        while chunk := f.read(_CHUNK):
            try:
                decoder.decode(chunk)
            except UnicodeDecodeError as e:
                bad = chunk[e.start : e.start + 1]
                line += chunk[: e.start].count(b"\n")
                raise DataError(
                    f"{flag} {path}: line {line} (byte {offset + e.start}) holds 0x{bad.hex()}, which is not UTF-8: "
                    "the file is in another encoding (Latin-1 or cp1252 are common). Convert it to UTF-8, e.g. "
                    f"iconv -f latin1 -t utf-8 {path} > utf8.{path.rsplit('.', 1)[-1]}."
                ) from None
            line += chunk.count(b"\n")
            offset += len(chunk)
        try:
            decoder.decode(b"", final=True)
        except UnicodeDecodeError:
            raise DataError(
                f"{flag} {path}: the file ends inside a UTF-8 character (truncated?); re-export it as UTF-8."
            ) from None


def _check_json(path: str, flag: str) -> None:
    with open(path, encoding="utf-8") as f:
        text = f.read(_CHUNK)
        if text.lstrip().startswith("["):  # one JSON array of objects (datasets reads both forms)
            text += f.read()
            try:
                rows = json.loads(text)
            except json.JSONDecodeError as e:
                raise DataError(
                    f"{flag} {path}: not valid JSON at line {e.lineno}, column {e.colno}: {e.msg}."
                ) from None
            bad = next((i for i, r in enumerate(rows) if not isinstance(r, dict)), None)
            if bad is not None:
                raise DataError(f"{flag} {path}: element {bad} of the array is not an object ({{...}}).")
            if not rows:
                raise DataError(f"{flag} {path}: the JSON array is empty; give at least one row.")
            return
        f.seek(0)
        for n, raw in enumerate(f, start=1):
            if not raw.strip():
                continue
            try:
                row = json.loads(raw)
            except json.JSONDecodeError as e:
                raise DataError(
                    f"{flag} {path}: line {n} is not a JSON object ({e.msg} at column {e.colno}); JSON lines "
                    "need one object per line."
                ) from None
            if not isinstance(row, dict):
                raise DataError(
                    f"{flag} {path}: line {n} is a JSON {type(row).__name__}, not an object; JSON lines need one "
                    'object per line, e.g. {"text": "..."}.'
                )


def _check_csv(path: str, flag: str) -> None:
    with open(path, encoding="utf-8", newline="") as f:
        reader = csv.reader(f)
        header = next(reader, None)
        if not header or not any(h.strip() for h in header):
            raise DataError(f"{flag} {path}: the first line must be a header naming the columns.")
        for row in reader:
            if not row:
                continue
            if len(row) != len(header):
                raise DataError(
                    f"{flag} {path}: line {reader.line_num} has {len(row)} fields, the header {len(header)} "
                    f"({', '.join(header)}): quote fields that hold commas, or fix the row."
                )


def check_file(path: str, flag: str = "--dataset") -> str:
    """Check a local data file before it is loaded; return its ``datasets`` builder (json, csv, parquet, text)."""
    if os.path.isdir(path):
        raise DataError(f"{flag} {path} is a directory; give a .{' / .'.join(FILE_TYPES)} file or a hub dataset id.")
    kind = file_type(path, flag)
    try:
        size = os.path.getsize(path)
        if kind != "parquet":
            _check_utf8(path, flag)
            with open(path, encoding="utf-8") as f:
                blank = not f.read(_CHUNK).strip() and not f.read(1)
        else:
            blank = size == 0
    except OSError as e:
        raise DataError(f"{flag} {path} cannot be read: {e.strerror or e}.") from None
    if size == 0 or blank:
        raise DataError(f"{flag} {path} is empty; give a file with at least one row.")
    if kind == "json":
        _check_json(path, flag)
    elif kind == "csv":
        _check_csv(path, flag)
    return kind


def load_file(path: str, flag: str = "--dataset", **kwargs):
    """``datasets.load_dataset`` on a local file checked by :func:`check_file`; the library's errors become a
    ``DataError`` naming the file (the original chained)."""
    kind = check_file(path, flag)
    try:
        return load_dataset(kind, data_files=path, **kwargs)
    except Exception as e:
        cause = e.__cause__ or e
        raise DataError(
            f"{flag} {path} could not be loaded by datasets' {kind} reader: {type(cause).__name__}: {cause}"
        ) from e


def load_hub(name: str, config: str | None, flag: str = "--dataset", **kwargs):
    """``datasets.load_dataset(name, config)``: a dataset that cannot be found or built is a ``DataError`` naming
    it."""
    try:
        return load_dataset(name, config, **kwargs)
    except Exception as e:
        raise DataError(
            f"{flag} {name!r} is not a local file and could not be loaded as a dataset ({type(e).__name__}: {e}); "
            "check the path or the dataset id."
        ) from e


def _where(path: str | None, i: int) -> str:
    """Row ``i`` (0-based) and, for a JSON lines or CSV file, the line it came from (blank lines not counted)."""
    if path and path.endswith((".jsonl", ".json")):
        return f"row {i} (line {i + 1} if the file has no blank lines)"
    if path and path.endswith(".csv"):
        return f"row {i} (line {i + 2})"
    return f"row {i}"


def check_text_columns(dataset, columns, source: str, path: str | None = None, flag: str = "--dataset") -> None:
    """Every value of ``columns`` is a non-null string (or, for ``messages`` / chat ``prompt`` / ``completion``, a
    list of ``{"role", "content"}`` messages): a missing column, a null or another type is a ``DataError`` naming
    ``source``, the column and the row."""
    names = dataset.column_names
    for column in columns:
        if column not in names:
            raise DataError(f"{flag} {source} has no column {column!r} (columns: {names}).")
        arrow = getattr(getattr(dataset, "data", None), "column", None)
        if arrow is not None and column != "messages":
            chunked = arrow(column)
            if (pa.types.is_string(chunked.type) or pa.types.is_large_string(chunked.type)) and not chunked.null_count:
                continue  # all text, no nulls: known from the arrow column without reading a row into Python
        values = dataset[column]
        for i, v in enumerate(values):
            if v is None:
                raise DataError(
                    f"{flag} {source}: {_where(path, i)} has no value in column {column!r} (null or missing): "
                    "fill it or drop the row; hf_dtrain does not train on a missing value."
                )
            if column == "messages" and not isinstance(v, list):
                raise DataError(
                    f"{flag} {source}: {_where(path, i)} column 'messages' holds {type(v).__name__} {v!r:.40}, not "
                    'a list of {"role": ..., "content": "..."} messages.'
                )
            if isinstance(v, list):
                bad = next(
                    (
                        m
                        for m in v
                        if not isinstance(m, dict)
                        or not isinstance(m.get("role"), str)
                        or not isinstance(m.get("content"), str)
                    ),
                    v if not v else None,
                )
                if bad is not None:
                    raise DataError(
                        f"{flag} {source}: {_where(path, i)} column {column!r} holds "
                        f"{json.dumps(bad, default=str)[:80]}"
                        ', not a list of {"role": ..., "content": "..."} messages with text content.'
                    )
            elif not isinstance(v, str):
                raise DataError(
                    f"{flag} {source}: {_where(path, i)} column {column!r} holds {type(v).__name__} {v!r:.40}, not "
                    "text: quote it in the file, or choose another column as the text."
                )


def check_enough(count: int, needed: int, what: str, source: str, fix: str, flag: str = "--dataset") -> None:
    """``count`` examples (or blocks) against the ``needed`` for one batch."""
    if count < needed:
        raise DataError(f"{flag} {source} gives {count} {what}, fewer than the {needed} that one batch needs: {fix}.")


__all__ = [
    "FILE_TYPES",
    "check_enough",
    "check_file",
    "check_text_columns",
    "file_type",
    "load_file",
    "load_hub",
]
