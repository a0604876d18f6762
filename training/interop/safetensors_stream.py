"""Safetensors shards written tensor by tensor: memory holds one tensor, not one shard.

safetensors' own `save_file` takes a whole dict (a shard of --max-shard-gb, 5 GB by default: an export of a
2 GB model held all of it, 1.4x the checkpoint's bytes at peak). Here each tensor's bytes go to the shard's data
file as they arrive; when the shard is full its header (names, dtypes, shapes, offsets: the format's
8-byte little-endian length + JSON, padded with spaces to 8 bytes, as safetensors writes it) is written to the
shard file and the data appended by the kernel (os.copy_file_range: no user-space buffer), in save_file's order
(by dtype, as safetensors ranks them, then by name): the files are byte for byte what save_file writes.
"""

from __future__ import annotations

import json
import os
import struct
from pathlib import Path

import torch

DTYPES = {torch.float64: "F64", torch.float32: "F32", torch.float16: "F16", torch.bfloat16: "BF16",
          torch.int64: "I64", torch.int32: "I32", torch.int16: "I16", torch.int8: "I8", torch.uint8: "U8",
          torch.bool: "BOOL", torch.float8_e4m3fn: "F8_E4M3", torch.float8_e5m2: "F8_E5M2"}
# the order of a file's tensors in safetensors' save_file: its Dtype enum descending (widest first), then the name
ORDER = ("U64", "I64", "F64", "C64", "F32", "U32", "I32", "BF16", "F16", "U16", "I16", "F8_E4M3", "F8_E5M2", "I8",
         "U8", "BOOL")


class Shard:
    """One shard being written: `add(name, tensor)` appends its bytes; `close()` writes the shard file."""

    def __init__(self, path: Path):
        self.path, self.data_path = path, path.with_suffix(".data")
        self.data = open(self.data_path, "wb")  # noqa: SIM115 - closed in close() / discard()
        self.header: dict = {}  # name -> dtype, shape, [start, end) in the data file (arrival order)
        self.size = 0

    def add(self, name: str, tensor: torch.Tensor) -> None:
        flat = tensor.detach().cpu().contiguous().reshape(-1).view(torch.uint8)  # the raw bytes, no copy when contiguous
        self.data.write(memoryview(flat.numpy()))
        self.header[name] = {"dtype": DTYPES[tensor.dtype], "shape": list(tensor.shape),
                             "data_offsets": [self.size, self.size + flat.numel()]}
        self.size += flat.numel()

    def close(self) -> None:
        self.data.close()
        names = sorted(self.header, key=lambda n: (ORDER.index(self.header[n]["dtype"]), n))  # save_file's order
        header, start = {"__metadata__": {"format": "pt"}}, 0
        for name in names:
            first, end = self.header[name]["data_offsets"]
            header[name] = {**self.header[name], "data_offsets": [start, start + end - first]}
            start += end - first
        header = json.dumps(header, separators=(",", ":")).encode()
        header += b" " * (-len(header) % 8)
        with open(self.path, "wb") as out, open(self.data_path, "rb") as data:
            out.write(struct.pack("<Q", len(header)) + header)
            out.flush()
            for name in names:  # each tensor's bytes from the data file to its place, by the kernel
                first, end = self.header[name]["data_offsets"]
                while first < end:
                    copied = os.copy_file_range(data.fileno(), out.fileno(), end - first, first)
                    if copied == 0:
                        raise OSError(f"{self.data_path}: ended {end - first} bytes early")
                    first += copied
        self.data_path.unlink()

    def discard(self) -> None:
        self.data.close()
        self.data_path.unlink(missing_ok=True)
        self.path.unlink(missing_ok=True)


def write(items, directory: Path, max_shard_bytes: int, progress=None) -> int:
    """(name, tensor) items -> model.safetensors, or shards of at most max_shard_bytes (a larger tensor alone) +
    model.safetensors.index.json. Shards are written under temporary names and renamed once all are (nothing
    half-written looks complete; the caller writes config.json last). progress(bytes so far) after each tensor.
    Returns the bytes written."""
    parts: list[tuple[Path, list[str]]] = []
    shard: Shard | None = None
    total = 0
    try:
        for name, tensor in items:
            if shard is not None and shard.header and shard.size + tensor.nbytes > max_shard_bytes:
                shard.close()
                shard = None
            if shard is None:
                shard = Shard(directory / f".part-{len(parts) + 1:05d}.safetensors.tmp")
                parts.append((shard.path, []))
            shard.add(name, tensor)
            parts[-1][1].append(name)
            total += tensor.nbytes
            if progress is not None:
                progress(total)
        if shard is None:  # no tensors: an empty file, as save_file({}) writes
            shard = Shard(directory / ".part-00001.safetensors.tmp")
            parts.append((shard.path, []))
        shard.close()
    except BaseException:
        if shard is not None:
            shard.discard()
        for part, _ in parts:
            part.unlink(missing_ok=True)
        raise
    if len(parts) == 1:
        parts[0][0].rename(directory / "model.safetensors")
        return total
    weight_map = {}
    for i, (part, names) in enumerate(parts):
        file = f"model-{i + 1:05d}-of-{len(parts):05d}.safetensors"
        part.rename(directory / file)
        weight_map.update(dict.fromkeys(names, file))
    (directory / "model.safetensors.index.json").write_text(
        json.dumps({"metadata": {"total_size": total}, "weight_map": weight_map}, indent=2) + "\n")
    return total
