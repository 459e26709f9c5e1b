"""A table's file, in the format its name asks for: Parquet (`.parquet`), CSV (`.csv`) or JSON Lines
(`.jsonl`, `.ndjson`), written whole or not at all (beside it, then renamed). Any other name is refused
before anything is computed; CSV, whose cells are flat, refuses a table with list columns (`--top`, `--kd`),
and writes a missing value (a sample without metadata) as an empty cell."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any, Iterator

from ..store.files import write_atomically

FORMATS = {".parquet": "parquet", ".csv": "csv", ".jsonl": "jsonl", ".ndjson": "jsonl"}


def table_format(path: str | Path) -> str:
    """The format `path`'s extension names: "parquet", "csv" or "jsonl".

    Raises:
        ValueError: another extension, or none (nothing is written).
    """
    suffix = Path(path).suffix.lower()
    if suffix not in FORMATS:
        raise ValueError(f"cannot tell which format to write {str(path)!r} in from its extension "
                         f"{suffix or '(none)'!r}: name the file .parquet (Parquet), .csv (CSV) or .jsonl (JSON Lines).")
    return FORMATS[suffix]


def write_table(target: Path, table_schema: Any, batches: Iterator[Any]) -> dict[str, int]:
    """Write pyarrow record batches to `target` as they come, in `table_format(target)`: whole or not at
    all. Returns `rows` and `bytes`.

    Raises:
        ValueError: an unknown extension, or CSV for a table with list or struct columns (before any batch
            is computed).
    """
    import pyarrow as pa

    kind = table_format(target)
    nested = [field.name for field in table_schema if pa.types.is_nested(field.type)]
    if kind == "csv" and nested:
        raise ValueError(f"a CSV cell holds one value, but this table's columns {nested} hold lists: write it as "
                         f"{str(target.with_suffix('.parquet'))!r} or {str(target.with_suffix('.jsonl'))!r}.")
    rows = 0

    def write(temporary: Path) -> None:
        nonlocal rows
        if kind == "parquet":
            import pyarrow.parquet as pq

            with pq.ParquetWriter(temporary, table_schema) as writer:
                for batch in batches:
                    writer.write_batch(batch)
                    rows += batch.num_rows
        elif kind == "csv":
            import pyarrow.csv as pcsv

            with pcsv.CSVWriter(temporary, table_schema) as writer:
                for batch in batches:
                    writer.write_batch(batch)
                    rows += batch.num_rows
        else:  # one JSON object a row; non-finite floats as Python's json writes them (NaN, -Infinity)
            with open(temporary, "w", encoding="utf-8") as file:
                for batch in batches:
                    for row in batch.to_pylist():
                        file.write(json.dumps(row, ensure_ascii=False) + "\n")
                    rows += batch.num_rows

    record = write_atomically(target, write)
    return {"rows": rows, "bytes": record["bytes"]}
