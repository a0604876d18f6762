"""A progress bar for conversions (tools/convert_hf.py import / export): tensors, bytes, rate and ETA on stderr
(tqdm; a line every 10 s where stderr is not a terminal, e.g. a log file), and the summary of the files written."""

from __future__ import annotations

import sys
from pathlib import Path


class Progress:
    """Progress(what, total bytes); call with the bytes done so far (one call per tensor); close() at the end."""

    def __init__(self, what: str, total: int):
        from tqdm import tqdm

        self.bar = tqdm(total=total, desc=what, unit="B", unit_scale=True, unit_divisor=1024, file=sys.stderr,
                        mininterval=0.5 if sys.stderr.isatty() else 10.0, dynamic_ncols=True, leave=True,
                        postfix={"tensors": 0})
        self.tensors = 0

    def __call__(self, done: int) -> None:
        self.tensors += 1
        self.bar.set_postfix(tensors=self.tensors, refresh=False)
        self.bar.update(done - self.bar.n)

    def close(self) -> None:
        if not self.bar.disable:
            self.bar.close()


def files_summary(directory: Path) -> str:
    """'N files, X GiB: name (size), ...' of a directory's files (the largest first, at most 6 named)."""
    files = sorted((f for f in directory.rglob("*") if f.is_file()), key=lambda f: -f.stat().st_size)
    total = sum(f.stat().st_size for f in files)
    named = ", ".join(f"{f.relative_to(directory)} ({_size(f.stat().st_size)})" for f in files[:6])
    return f"{len(files)} files, {_size(total)}: {named}" + (", ..." if len(files) > 6 else "")


def _size(n: int) -> str:
    for unit in ("B", "KiB", "MiB", "GiB"):
        if n < 1024 or unit == "GiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.2f} {unit}"
        n /= 1024
