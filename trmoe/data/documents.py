"""Documents from local files: the one place that opens and validates a Parquet file of texts.

Both readers of Parquet go through `open_parquet`: the training stream (trmoe.data.fineweb, `data=fineweb`
with `data.path`) and the shard builder (trmoe.data.prepare). A file that cannot be read, lacks the text
column or holds something other than strings in it is refused with one line naming the file and the key.
"""

from __future__ import annotations

from pathlib import Path

from trmoe.errors import UserError


def first_line(exc: BaseException) -> str:
    """The first line of an exception's message (its type when it has none)."""
    text = str(exc).strip()
    return text.splitlines()[0] if text else type(exc).__name__


def open_parquet(path: Path, text_field: str, key: str):
    """A pyarrow ParquetFile whose `text_field` column holds strings (or only nulls). `key` names the option
    that chose the column (data.text_field, --text-field) in the error."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    try:
        handle = pq.ParquetFile(path)
        schema = handle.schema_arrow
    except (pa.ArrowException, OSError) as exc:
        raise UserError(f"parquet file {path}: unreadable ({first_line(exc)})") from None
    if text_field not in schema.names:
        raise UserError(
            f"parquet file {path}: no column {text_field!r} ({key}); allowed: {', '.join(schema.names)}"
        )
    kind = schema.field(text_field).type
    if not (pa.types.is_string(kind) or pa.types.is_large_string(kind) or pa.types.is_null(kind)):
        raise UserError(f"parquet file {path}: column {text_field!r} has type {kind}, not a string")
    return handle
