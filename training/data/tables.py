"""The pyarrow readers of a table file (training/data/sources.py streams their record batches): an Arrow IPC file
or stream, a CSV or TSV with a header row."""

from __future__ import annotations


def open_csv(f, path: str, text_key: str | None, block_size: int):
    """A CSV (a TSV by its name) with a header row, batch by batch; the text column as strings (numbers too)."""
    import pyarrow as pa
    import pyarrow.csv as csv

    delimiter = "\t" if path.lower().endswith(".tsv") else ","
    return csv.open_csv(f, read_options=csv.ReadOptions(block_size=block_size),  # a batch per block
                        parse_options=csv.ParseOptions(delimiter=delimiter, newlines_in_values=True),
                        convert_options=csv.ConvertOptions(column_types={text_key: pa.string()} if text_key else None))


def open_arrow(pa, f):
    """An Arrow IPC file (ARROW1 ...) or stream (what `datasets` writes), read batch by batch."""
    magic = f.read(6)
    f.seek(0)
    return pa.ipc.open_file(f) if magic == b"ARROW1" else pa.ipc.open_stream(f)
