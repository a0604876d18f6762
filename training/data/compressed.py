"""Lines of a gzip- or zstd-compressed file (training/data/sources.py's .gz and .zst inputs), read in blocks.

A truncated stream raises EOFError, never ends quietly: gzip does that itself; zstandard's stream_reader does not
(it returns what it has at a cut frame), so zstd frames are decoded here one after another with decompressobj.
"""

from __future__ import annotations

import gzip
import zlib

from training.errors import ConfigError

SUFFIXES = {".gz": "gzip", ".zst": "zstd", ".zstd": "zstd"}
try:
    import zstandard
except ImportError:  # the `data` extra is absent: a .zst input says so when it is read
    zstandard = None
ERRORS = (zlib.error, *((zstandard.ZstdError,) if zstandard else ()))  # damaged data, besides OSError/EOFError


def lines(raw, compression: str | None, path: str):
    """The lines (bytes, each ending in b"\\n" but perhaps the last) of the open binary file `raw`."""
    if compression == "gzip":
        return gzip.GzipFile(fileobj=raw, mode="rb")
    if compression == "zstd":
        return _lines_of(_zstd_blocks(raw, path))
    return raw


def _zstd_blocks(raw, path: str):
    """Decompressed blocks of every zstd frame in turn (parallel compressors write several)."""
    try:
        import zstandard
    except ImportError:
        raise ConfigError(f"{path}: reading .zst needs the `zstandard` package: pip install -e '.[data]'") from None
    context = zstandard.ZstdDecompressor()
    frame, started = context.decompressobj(), False
    while block := raw.read(1 << 20):
        while block:
            yield frame.decompress(block)
            started, block = True, b""
            if frame.eof:  # the frame ended inside this block: the rest starts the next frame
                block, frame, started = frame.unused_data, context.decompressobj(), False
    if started:
        raise EOFError("the file ends inside a zstd frame (truncated)")


def _lines_of(blocks):
    """Lines, split as a binary file's are (at b"\\n" only), from a stream of byte blocks."""
    rest = b""
    for block in blocks:
        *found, rest = (rest + block).split(b"\n")
        yield from (line + b"\n" for line in found)
    if rest:
        yield rest
