"""tools/preprocess_data.py's inputs -> documents: find and check every input, then stream it in ~1 MB chunks.

    sources = resolve(["shards/*.parquet", "web.jsonl.zst"], text_key="text")  # all checked before any work
    for chunk in chunks(sources, "text"):  # in input order, read in the parent with bounded memory
        decode.texts(chunk)                # its documents (str), decoded where the worker pool runs
                                           # (training/data/decode.py)
text_key=None reads whole records instead (--format sft: conversations): JSON lines, or Parquet/Arrow's "messages"
column (else "prompt" and "completion", or Alpaca's "instruction", "input" and "output", with "system" where there is
one), decode.records(chunk) in the workers.

What is read (the kind comes from the name; the first bytes must agree, else one line says what the file is):
  any name but those below      plain text, one document per line (blank lines skipped)
  NAME.jsonl / NAME.json        one JSON object per line, the document in its `text_key` field
  NAME.<those>.gz / .zst        either, gzip- or zstd-compressed (zstd: the `zstandard` package)
  NAME.parquet                  the `text_key` column, one record batch (~1 MB of text) at a time
  NAME.csv / NAME.tsv           the same from a table with a header row (quoted values may span lines)
  NAME.arrow                    the same from an Arrow IPC stream or file (what `datasets` writes)
  a folder                      a Hugging Face `datasets` folder from `save_to_disk`: the .arrow files its
                                state.json lists, in that order (read with pyarrow; `datasets` is not needed)
Parquet, Arrow and CSV need `pyarrow` (pip install -e '.[data]'). Empty and null documents are skipped.
"""

from __future__ import annotations

import codecs
import glob
import json
import math
import os
from pathlib import Path
from typing import NamedTuple

from training.data import compressed
from training.data.tables import open_arrow, open_csv
from training.errors import ConfigError

CHUNK_BYTES = 1 << 20  # text per worker task: amortises inter-process pickling, keeps progress smooth
SUPPORTED = ("supported: plain text (a document per line), .jsonl/.json (a JSON object per line), either "
             "compressed as .gz or .zst, .parquet, .arrow, .csv/.tsv, or a `datasets` save_to_disk folder")
MAGIC = {"gzip": (b"\x1f\x8b",), "zstd": (b"\x28\xb5\x2f\xfd",), "parquet": (b"PAR1",),
         "arrow": (b"ARROW1", b"\xff\xff\xff\xff")}
WHAT = {"gzip": "gzip data", "zstd": "zstd data", "parquet": "Parquet data", "arrow": "Arrow data",
        "text": "plain text", "jsonl": "JSON lines", "csv": "CSV", "empty": "nothing (an empty file)"}
TABLES = ("parquet", "arrow", "csv")  # read with pyarrow, a column at a time
RENAME = {"gzip": ".gz", "zstd": ".zst", "parquet": ".parquet", "arrow": ".arrow"}
OTHER_MAGIC = {b"PK\x03\x04": "a zip archive", b"BZh": "bzip2 data", b"\xfd7zXZ\x00": "xz data"}


class Source(NamedTuple):
    path: str
    kind: str                # text | jsonl | parquet | arrow | csv
    compression: str | None  # None | gzip | zstd (text and jsonl only)
    size: int                # bytes on disk: what progress and its ETA count


class Chunk(NamedTuple):
    index: int       # the source's position in the input list
    path: str
    first: int       # the first item's line (text, jsonl) or row (parquet, arrow), from 1
    kind: str
    text_key: str | None  # the document's field or column; None: whole records (--format sft)
    items: list      # raw lines (bytes) for text and jsonl; str or None (a dict: records) for parquet and arrow
    disk_bytes: int  # input bytes on disk this chunk accounts for (a source's chunks sum to its size)
    text_bytes: int  # bytes of text: the (decompressed) lines, the strings' UTF-8


# ------------------------------------------------------------------------------------ finding and checking

def resolve(patterns: list[str], text_key: str | None) -> list[Source]:
    """Every input: files in the order given, a glob's matches sorted, a save_to_disk folder as its files."""
    sources = []
    for pattern in patterns:
        is_glob = glob.escape(pattern) != pattern
        matches = sorted(glob.glob(pattern, recursive=True))
        if not matches:
            raise ConfigError(f"--input {pattern}: no file matches")
        found = []
        for match in matches:
            if os.path.isfile(match):
                found.append(file_source(match, text_key))
            elif os.path.isdir(match) and not (is_glob and not _is_saved_dataset(match)):  # skip a glob's folders
                found += saved_dataset(match, text_key)
        if not found:
            raise ConfigError(f"--input {pattern}: matches only folders; {SUPPORTED}")
        sources += found
    return sources


def file_source(path: str, text_key: str | None) -> Source:
    name = path.lower()
    compression = compressed.SUFFIXES.get(Path(name).suffix)
    inner = Path(name.removesuffix(Path(name).suffix) if compression else name).suffix
    kind = {".parquet": "parquet", ".arrow": "arrow", ".jsonl": "jsonl", ".json": "jsonl", ".csv": "csv",
            ".tsv": "csv"}.get(inner, "text")
    with open(path, "rb") as f:
        head = f.read(4096)
    found = _content(head)
    expected = compression or kind
    if found != expected and not (found in ("text", "empty") and expected in ("text", "jsonl", "csv")):
        hint = f" (name it {RENAME[found]})" if found in RENAME and expected in ("text", "jsonl") else ""
        raise ConfigError(f"{path}: holds {WHAT.get(found, found)}, but its name says {WHAT[expected]}{hint}; "
                          f"{SUPPORTED}")
    if compression and kind in TABLES:
        raise ConfigError(f"{path}: compressed {WHAT[kind]} (decompress it first); {SUPPORTED}")
    if kind in ("text", "csv") and text_key is None:
        raise ConfigError(f"{path}: {WHAT[kind]} holds no conversations: --format sft reads JSON lines (.jsonl: "
                          f"\"messages\", or \"prompt\" and \"completion\"), Parquet, Arrow or a save_to_disk folder")
    if kind in TABLES:
        _check_column(path, _schema(path, kind, text_key), text_key)
    return Source(path, kind, compression, os.path.getsize(path))


def _content(head: bytes) -> str:
    """What the first bytes of a file say it is: a key of MAGIC, "text", "empty", or a description."""
    if not head:
        return "empty"
    for kind, magics in MAGIC.items():
        if head.startswith(magics):
            return kind
    for magic, what in OTHER_MAGIC.items():
        if head.startswith(magic):
            return what
    if b"\0" in head:
        return f"binary data (a NUL byte at offset {head.index(b'\0')})"
    return "text"


def _is_saved_dataset(folder: str) -> bool:
    return any(os.path.isfile(os.path.join(folder, f)) for f in ("state.json", "dataset_dict.json"))


def saved_dataset(folder: str, text_key: str | None) -> list[Source]:
    """A `datasets` save_to_disk folder: state.json's `_data_files` (Arrow IPC streams), in their order."""
    root = Path(folder)
    if (root / "dataset_dict.json").is_file():
        splits = _json(root / "dataset_dict.json").get("splits") or []
        raise ConfigError(f"{folder}: a `datasets` DatasetDict with splits {', '.join(map(str, splits))}: give one "
                          f"split's folder, e.g. {root / str(splits[0] if splits else 'train')}")
    if not (root / "state.json").is_file():
        raise ConfigError(f"{folder}: a folder without state.json, so not a `datasets` save_to_disk folder: give "
                          f"its files or a glob, e.g. '{root / '*.parquet'}'; {SUPPORTED}")
    files = [entry.get("filename") for entry in _json(root / "state.json").get("_data_files") or []]
    if not files or not all(isinstance(f, str) for f in files):
        raise ConfigError(f"{root / 'state.json'}: lists no data files (`_data_files`): not a save_to_disk folder")
    for file in files:
        if not (root / file).is_file():
            raise ConfigError(f"{root / 'state.json'} lists {file}, which is missing: an incomplete copy?")
    return [file_source(str(root / file), text_key) for file in files]


def _json(path: Path) -> dict:
    try:
        value = json.loads(path.read_text(encoding="utf-8"))
    except (ValueError, UnicodeDecodeError) as err:
        raise ConfigError(f"{path}: not valid JSON ({err})") from None
    return value if isinstance(value, dict) else {}


def _pyarrow(path: str):
    try:
        import pyarrow
    except ImportError:
        raise ConfigError(f"{path}: reading Parquet and Arrow needs the `pyarrow` package: "
                          f"pip install -e '.[data]'") from None
    return pyarrow


def _damaged(path: str, kind: str, err: Exception) -> ConfigError:
    reason = (str(err) or type(err).__name__).splitlines()[0]
    return ConfigError(f"{path}: damaged {WHAT[kind]} ({reason}); {SUPPORTED}")


def _schema(path: str, kind: str, text_key: str | None = None):
    pa = _pyarrow(path)
    try:
        if kind == "parquet":
            import pyarrow.parquet as pq
            return pq.read_schema(path)
        if kind == "csv":
            with pa.OSFile(path) as f:
                return open_csv(f, path, text_key, CHUNK_BYTES).schema
        with pa.OSFile(path) as f, open_arrow(pa, f) as reader:
            return reader.schema
    except (pa.ArrowException, OSError) as err:
        if isinstance(err, OSError) and err.errno is not None:
            raise
        raise _damaged(path, kind, err) from None


def _check_column(path: str, schema, text_key: str | None) -> None:
    import pyarrow as pa

    if text_key is None:
        record_columns(path, schema.names)
        return
    columns = ", ".join(schema.names)
    if text_key not in schema.names:
        raise ConfigError(f"{path}: no column \"{text_key}\" (its columns: {columns}): choose one with --text-key")
    kind = schema.field(text_key).type
    if not (pa.types.is_string(kind) or pa.types.is_large_string(kind) or pa.types.is_string_view(kind)):
        raise ConfigError(f"{path}: column \"{text_key}\" holds {kind}, not text: choose a string column with "
                          f"--text-key (its columns: {columns})")


def record_columns(path: str, names: list[str]) -> list[str]:
    """The columns of a conversation (--format sft): "messages" (or ShareGPT's "conversations"), else "prompt" and
    "completion", else Alpaca's "instruction" and "output" (and "input", "history"); each with "system" where there is
    one."""
    for key in ("messages", "conversations"):
        if key in names:
            return [key]
    for pair in (("prompt", "completion"), ("instruction", "output", "input", "history")):
        if pair[0] in names and pair[1] in names:
            return [c for c in (*pair, "system") if c in names]
    raise ConfigError(f"{path}: no \"messages\" (or \"conversations\") column, nor \"prompt\" and \"completion\", "
                      f"nor \"instruction\" and \"output\" (its columns: {', '.join(names)}): --format sft reads "
                      f"conversations")


# ---------------------------------------------------------------------------------------------- reading

def chunks(sources: list[Source], text_key: str | None):
    """Every source's Chunks in order; a file damaged past its first bytes is one line naming it."""
    for index, source in enumerate(sources):
        reader = _lines if source.kind in ("text", "jsonl") else _arrow_chunks
        try:
            yield from reader(index, source, text_key)
        except (OSError, EOFError, ValueError, *compressed.ERRORS) as err:
            if isinstance(err, OSError) and err.errno is not None:  # a real I/O error: the tool names the file
                raise
            raise _damaged(source.path, source.compression or source.kind, err) from None


def _lines(index: int, source: Source, text_key: str | None):
    with open(source.path, "rb") as raw:
        lines, text, first, done = [], 0, 1, 0
        for number, line in enumerate(compressed.lines(raw, source.compression, source.path), 1):
            lines.append(line.removeprefix(codecs.BOM_UTF8) if number == 1 else line)
            text += len(line)
            if text >= CHUNK_BYTES:
                position = min(raw.tell(), source.size)
                yield Chunk(index, source.path, first, source.kind, text_key, lines, position - done, text)
                lines, text, first, done = [], 0, number + 1, position
        yield Chunk(index, source.path, first, source.kind, text_key, lines, source.size - done, text)


def _arrow_chunks(index: int, source: Source, text_key: str | None):
    """The text column (or the record columns as dicts), ~CHUNK_BYTES of text a chunk: Parquet one record batch at
    a time (a batch sized from the footer's bytes per row), Arrow one IPC batch at a time, so memory stays at a row
    group, not the file."""
    import pyarrow as pa
    import pyarrow.compute as pc
    import pyarrow.parquet as pq

    with pa.OSFile(source.path) as f:
        if source.kind == "parquet":
            parquet = pq.ParquetFile(f, pre_buffer=False)  # pre_buffer (the default) keeps every row group read
            meta = parquet.metadata
            rows = max(meta.num_rows, 1)
            per_row = sum(meta.row_group(i).total_byte_size for i in range(meta.num_row_groups)) / rows
            batch = max(1, min(1 << 16, int(CHUNK_BYTES / max(per_row, 1))))  # all columns' bytes: an upper bound
            columns = [text_key] if text_key is not None else record_columns(source.path, parquet.schema_arrow.names)
            arrays = (b.column(0) if text_key is not None else b.to_struct_array()
                      for b in parquet.iter_batches(batch_size=batch, columns=columns))
            position = lambda row: round(source.size * row / rows)  # noqa: E731 - the footer gives no offsets
        else:
            reader = open_csv(f, source.path, text_key, CHUNK_BYTES) if source.kind == "csv" else open_arrow(pa, f)
            batches = reader if hasattr(reader, "read_next_batch") else map(reader.get_batch,
                                                                                 range(reader.num_record_batches))
            columns = [text_key] if text_key is not None else record_columns(source.path, reader.schema.names)
            arrays = (b.column(text_key) if text_key is not None else b.select(columns).to_struct_array()
                      for b in batches)
            position = lambda row: min(f.tell(), source.size)  # noqa: E731
        row = done = 0
        for array in arrays:
            total = _text_bytes(pc, array)
            step = math.ceil(len(array) / max(1, round(total / CHUNK_BYTES)))  # slices of ~CHUNK_BYTES
            for start in range(0, len(array), max(step, 1)):
                part = array.slice(start, step)
                text = _text_bytes(pc, part)
                at = position(row + start + len(part))
                yield Chunk(index, source.path, row + start + 1, source.kind, text_key, part.to_pylist(),
                            at - done, text)
                done = at
            row += len(array)
        yield Chunk(index, source.path, row + 1, source.kind, text_key, [], source.size - done, 0)


def _text_bytes(pc, array) -> int:
    """A string array's bytes of text; a record array's (--format sft) bytes in Arrow buffers."""
    return array.nbytes if array.type.num_fields else pc.sum(pc.binary_length(array)).as_py() or 0
