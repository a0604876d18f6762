"""Text or JSON lines -> a Megatron-Core indexed dataset: PREFIX.bin + PREFIX.idx + PREFIX.json.

    python tools/preprocess_data.py --input FILE_OR_GLOB [FILE_OR_GLOB ...] --output-prefix PREFIX \\
        --tokenizer byte|PATH [--json-key text] [--workers N]

    python tools/preprocess_data.py --input 'corpus/*.txt' --output-prefix data/corpus --tokenizer byte
    python tools/preprocess_data.py --input web.jsonl --output-prefix data/web --tokenizer tok/ --workers 8

Inputs (files in the order given, each glob's matches sorted): `.jsonl` / `.json` files hold one JSON
object per line with the document in its `text` field (--json-key); any other file is plain text with
one document per line. Blank lines are skipped. Each document ends with the tokenizer's end-of-document
token. PREFIX.json records the tokenizer, so training refuses to read the data with another one:
train with `data.paths=[PREFIX] data.tokenizer=<the same --tokenizer>`.

Progress (documents/s, MB/s of input) goes to stderr about once a second, a summary to stdout.
Problems are one line (`error: ...`, naming the file and line) and exit code 2.
"""

import argparse
import codecs
import contextlib
import glob
import json
import logging
import multiprocessing
import os
import sys
import time
import warnings
from pathlib import Path

import numpy as np

from training.data.tokenizer import build_tokenizer

# Light imports only: worker processes start before torch / Megatron-Core are imported (training.data.datasets).
from training.errors import ConfigError, TemplateError, exit_on_error

CHUNK_BYTES = 1 << 20  # input per worker task: amortises inter-process pickling, keeps progress smooth
JSON_SUFFIXES = (".jsonl", ".json")


def input_files(patterns: list[str]) -> list[str]:
    """Every pattern's matching files, in the order given (a glob's matches sorted, so runs repeat)."""
    files = []
    for pattern in patterns:
        matches = sorted(m for m in glob.glob(pattern, recursive=True) if os.path.isfile(m))
        if not matches:
            raise ConfigError(f"--input {pattern}: no file matches")
        files += matches
    return files


def chunks(files: list[str], json_key: str):
    """Tasks (file, first line number, is_json, json_key, raw lines) of about CHUNK_BYTES, in order.

    Lines stay bytes here (decoding happens in the workers) so the byte count for MB/s is exact."""
    for file in files:
        is_json = Path(file).suffix.lower() in JSON_SUFFIXES
        with open(file, "rb") as f:
            lines, size, first = [], 0, 1
            for number, line in enumerate(f, 1):
                lines.append(line.removeprefix(codecs.BOM_UTF8) if number == 1 else line)
                size += len(line)
                if size >= CHUNK_BYTES:
                    yield file, first, is_json, json_key, lines
                    lines, size, first = [], 0, number + 1
            if lines:
                yield file, first, is_json, json_key, lines


def document_text(file: str, number: int, line: bytes, is_json: bool, json_key: str) -> str | None:
    """One input line -> its document text, or None for a blank line."""
    try:
        text = line.decode("utf-8").removesuffix("\n").removesuffix("\r")
    except UnicodeDecodeError as err:
        raise ConfigError(f"{file}:{number}: not UTF-8 text (byte {err.start} of the line)") from None
    if not text.strip():
        return None
    if not is_json:
        return text
    try:
        record = json.loads(text)
    except ValueError as err:
        raise ConfigError(f"{file}:{number}: not valid JSON ({err})") from None
    if not isinstance(record, dict) or json_key not in record:
        raise ConfigError(f"{file}:{number}: no \"{json_key}\" key (choose the field with --json-key)")
    if not isinstance(record[json_key], str):
        raise ConfigError(f"{file}:{number}: \"{json_key}\" is a {type(record[json_key]).__name__}, "
                          f"not a string")
    return record[json_key]


_tokenizer = None  # one per worker process, built by init_worker (tokenizers need not pickle)


def init_worker(spec: str) -> None:
    global _tokenizer
    _tokenizer = build_tokenizer(spec)


def encode_chunk(task) -> tuple[list[np.ndarray], int]:
    """Worker: a chunk of raw lines -> (token ids per document, input bytes consumed).

    int32 arrays, not lists: they pickle back to the parent as one memory copy instead of one object
    per token (which made 2 workers slower than 1)."""
    file, first, is_json, json_key, lines = task
    texts = (document_text(file, n, line, is_json, json_key) for n, line in enumerate(lines, first))
    docs = [np.asarray(_tokenizer.encode(t), dtype=np.int32) for t in texts if t]  # None: blank line
    return docs, sum(map(len, lines))


class Progress:
    """Counts documents, tokens and input bytes; prints a rate line to stderr at most once per `every` s."""

    def __init__(self, every: float = 1.0):
        self.start = self.last = time.monotonic()
        self.every, self.documents, self.tokens, self.bytes = every, 0, 0, 0

    def update(self, documents: int, tokens: int, nbytes: int) -> None:
        self.documents += documents
        self.tokens += tokens
        self.bytes += nbytes
        if time.monotonic() - self.last >= self.every:
            self.last = time.monotonic()
            print(self.line(), file=sys.stderr, flush=True)

    def line(self) -> str:
        seconds = max(time.monotonic() - self.start, 1e-9)
        mb = self.bytes / 1e6
        return (f"{self.documents} documents, {mb:.1f} MB in {seconds:.1f} s "
                f"({self.documents / seconds:.0f} documents/s, {mb / seconds:.2f} MB/s)")


def documents(results, progress: Progress, files: list[str]):
    """Flatten (documents, bytes) chunk results into one document stream, counting as it goes; an input
    without documents is an error named by its files (raised inside write_indexed, which cleans up)."""
    for docs, nbytes in results:
        progress.update(len(docs), sum(len(d) + 1 for d in docs), nbytes)  # + 1: the EOD write_indexed adds
        yield from docs
    if progress.documents == 0:
        names = files[0] if len(files) == 1 else f"{len(files)} files ({files[0]}, ...)"
        raise ConfigError(f"no documents in {names}: empty, or only blank lines")


def preprocess(files: list[str], prefix: str, tokenizer, spec: str, json_key: str, workers: int) -> Progress:
    """Encode `files` on `workers` processes (imap: results in input order) and write the dataset."""
    global _tokenizer
    tasks = chunks(files, json_key)
    with contextlib.ExitStack() as stack:
        # The pool starts before training.data.datasets imports torch and Megatron-Core (~10 s on 2 cores): forking
        # a process without torch's threads is safe and cheap, and spawn-started workers import only this
        # light module.
        pool = stack.enter_context(multiprocessing.Pool(workers, init_worker, (spec,))) if workers > 1 else None
        write_indexed = import_write_indexed()
        progress = Progress()  # starts after the imports, so the rates measure encoding and writing
        if pool is None:
            _tokenizer = tokenizer
        results = pool.imap(encode_chunk, tasks) if pool else map(encode_chunk, tasks)
        write_indexed(prefix, documents(results, progress, files), tokenizer)
    return progress


def import_write_indexed():
    """training.data.datasets.write_indexed, without Megatron-Core's import-time notices (TE/Apex fallbacks, rank
    guesses, no CUDA runtime) that say nothing about writing a dataset."""
    logging.getLogger("torch.utils.cpp_extension").setLevel(logging.ERROR)
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", module=r"megatron\.")
        from megatron.core.datasets import indexed_dataset  # noqa: F401 - imported here, under the filter

        from training.data.datasets import write_indexed
    return write_indexed


def parse_args(argv: list[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--input", nargs="+", required=True, help="files or globs (quote globs)")
    parser.add_argument("--output-prefix", required=True, help="writes PREFIX.bin, PREFIX.idx, PREFIX.json")
    parser.add_argument("--tokenizer", required=True, help="byte, or a tokenizer.json (or its directory)")
    parser.add_argument("--json-key", default="text", help="the document field of .jsonl/.json lines")
    parser.add_argument("--workers", type=int, default=1, help="encoding processes (use the cores for big inputs)")
    return parser.parse_args(argv)


def run(argv: list[str]) -> int:
    args = parse_args(argv)
    if args.workers < 1:
        raise ConfigError(f"--workers={args.workers}: must be at least 1")
    if Path(args.output_prefix).suffix in (".bin", ".idx", ".json"):
        raise ConfigError(f"--output-prefix {args.output_prefix}: give the prefix, without "
                          f"{Path(args.output_prefix).suffix}")
    files = input_files(args.input)
    tokenizer = build_tokenizer(args.tokenizer)  # in the parent first: a bad path fails before any work
    try:
        progress = preprocess(files, args.output_prefix, tokenizer, args.tokenizer, args.json_key, args.workers)
    except OSError as err:  # an unreadable input, an unwritable output folder
        raise TemplateError(f"{err.filename}: {err.strerror}" if err.filename else str(err)) from err
    print(f"wrote {args.output_prefix}.bin/.idx/.json ({progress.tokens} tokens, tokenizer {tokenizer.name}) "
          f"from {len(files)} file(s): {progress.line()}")
    return 0


def main(argv: list[str]) -> int:
    """run(argv), with the user's errors as one line each and exit code 2."""
    return exit_on_error(run, argv)


if __name__ == "__main__":  # the guard also keeps spawn-started workers from re-running main
    sys.exit(main(sys.argv[1:]))
