"""The worker side of tools/preprocess_data.py: a Chunk of raw input (read by training/data/sources.py in the
parent) -> its documents, or its records for --format sft (conversations: training/data/chat.py).

    texts(chunk)     # ["document", ...]: blank lines and empty or null documents skipped
    records(chunk)   # [(line or row from 1, record), ...]: a JSON object per line, a dict per Parquet/Arrow row
"""

from __future__ import annotations

import json

from training.errors import ConfigError


def texts(chunk) -> list[str]:
    """The chunk's documents: blank lines and empty or null documents skipped."""
    if chunk.kind in ("parquet", "arrow", "csv"):  # a column's values
        return [t for t in chunk.items if t]
    found = (line_text(chunk.path, n, line, chunk.kind == "jsonl", chunk.text_key)
             for n, line in enumerate(chunk.items, chunk.first))
    return [t for t in found if t]


def records(chunk) -> list[tuple[int, object]]:
    """The chunk's records with their line (JSON lines; blank lines skipped) or row (Parquet, Arrow: a dict of the
    conversation columns) number, from 1; what each holds is checked by training/data/chat.conversation."""
    if chunk.kind in ("parquet", "arrow"):
        return list(enumerate(chunk.items, chunk.first))
    found = ((n, _decoded(chunk.path, n, line)) for n, line in enumerate(chunk.items, chunk.first))
    return [(n, _parsed(chunk.path, n, text)) for n, text in found if text is not None]


def line_text(file: str, number: int, line: bytes, is_json: bool, text_key: str) -> str | None:
    """One input line -> its document text, or None for a blank line."""
    text = _decoded(file, number, line)
    if text is None or not is_json:
        return text
    record = _parsed(file, number, text)
    if not isinstance(record, dict):
        raise ConfigError(f"{file}:{number}: a JSON {type(record).__name__}, not an object with a \"{text_key}\" key")
    if text_key not in record:
        fields = ", ".join(list(record)[:12]) or "none"
        raise ConfigError(f"{file}:{number}: no \"{text_key}\" key (its keys: {fields}; choose the document's with "
                          f"--text-key)")
    if not isinstance(record[text_key], str):
        raise ConfigError(f"{file}:{number}: \"{text_key}\" is a {type(record[text_key]).__name__}, "
                          f"not a string")
    return record[text_key]


def _decoded(file: str, number: int, line: bytes) -> str | None:
    """A line's text without its line end, or None for a blank one."""
    try:
        text = line.decode("utf-8").removesuffix("\n").removesuffix("\r")
    except UnicodeDecodeError as err:
        raise ConfigError(f"{file}:{number}: not UTF-8 text (byte {err.start} of the line)") from None
    return text if text.strip() else None


def _parsed(file: str, number: int, text: str):
    try:
        return json.loads(text)
    except ValueError as err:
        raise ConfigError(f"{file}:{number}: not valid JSON ({err})") from None
