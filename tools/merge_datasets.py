"""Indexed datasets preprocessed in parts -> one dataset: PREFIX.bin + PREFIX.idx + PREFIX.json.

    .venv/bin/python tools/merge_datasets.py --input PREFIX_OR_GLOB [...] --output-prefix PREFIX

    # a big corpus, preprocessed a few shards at a time (on one machine or many), then joined
    .venv/bin/python tools/preprocess_data.py --input 'web/part-0*.parquet' --output-prefix data/parts/web-0 \
        --tokenizer tok/
    .venv/bin/python tools/preprocess_data.py --input 'web/part-1*.parquet' --output-prefix data/parts/web-1 \
        --tokenizer tok/
    .venv/bin/python tools/merge_datasets.py --input 'data/parts/web-*' --output-prefix data/web

Inputs are dataset prefixes (PREFIX.bin/.idx/.json, written by tools/preprocess_data.py) in the order given, or
globs (quote them) matching their files, each glob's datasets sorted by name. The merged dataset holds every part's
documents in that order, exactly as if the parts' inputs had been preprocessed together (Megatron-Core's
IndexedDatasetBuilder.add_index). Parts written with different tokenizers are refused (their PREFIX.json), as is a
missing, partial or damaged part; each problem is one line (`error: ...`) and exit code 2.
"""

import argparse
import glob
import logging
import sys
import time
import warnings
from pathlib import Path

from training.data.merge import merge_indexed
from training.errors import ConfigError, TemplateError, exit_on_error

SUFFIXES = (".bin", ".idx", ".json")


def input_prefixes(patterns: list[str]) -> list[str]:
    """Prefixes: a literal prefix as given (or with .bin/.idx/.json dropped); a glob's datasets sorted."""
    prefixes = []
    for pattern in patterns:
        if glob.escape(pattern) == pattern:  # no glob characters
            prefixes.append(pattern[:-len(Path(pattern).suffix)] if Path(pattern).suffix in SUFFIXES else pattern)
            continue
        found = sorted({m[:-len(Path(m).suffix)] for m in glob.glob(pattern, recursive=True)
                        if Path(m).suffix in SUFFIXES})
        if not found:
            raise ConfigError(f"--input {pattern}: matches no dataset (PREFIX.bin/.idx/.json files)")
        prefixes += found
    for prefix in prefixes:
        if prefixes.count(prefix) > 1:
            raise ConfigError(f"--input names {prefix} {prefixes.count(prefix)} times: give each part once")
    return prefixes


def parse_args(argv: list[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--input", nargs="+", required=True, help="dataset prefixes or globs (quote globs)")
    parser.add_argument("--output-prefix", required=True, help="writes PREFIX.bin, PREFIX.idx, PREFIX.json")
    return parser.parse_args(argv)


def run(argv: list[str]) -> int:
    args = parse_args(argv)
    out = args.output_prefix
    if Path(out).suffix in SUFFIXES:
        raise ConfigError(f"--output-prefix {out}: give the prefix, without {Path(out).suffix}")
    parts = input_prefixes(args.input)
    if any(Path(p).resolve() == Path(out).resolve() for p in parts):
        raise ConfigError(f"--output-prefix {out} is also an --input: write the merged dataset elsewhere")
    logging.getLogger("torch.utils.cpp_extension").setLevel(logging.ERROR)
    with warnings.catch_warnings():  # Megatron-Core's import-time notices say nothing about merging
        warnings.filterwarnings("ignore", module=r"megatron\.")
        from megatron.core.datasets import indexed_dataset  # noqa: F401 - imported here, under the filter

        from training.data import datasets  # noqa: F401 - (torch) likewise
    start = time.monotonic()
    try:
        meta = merge_indexed(parts, out)
    except OSError as err:  # an unreadable part, an unwritable output folder, a full disk
        raise TemplateError(f"{err.filename}: {err.strerror}" if err.filename else str(err)) from err
    print(f"wrote {out}.bin/.idx/.json ({meta['documents']} documents, {meta['tokens']} tokens, tokenizer "
          f"{meta['tokenizer']}) from {len(parts)} part(s) in {time.monotonic() - start:.1f} s")
    return 0


def main(argv: list[str]) -> int:
    """run(argv), with the user's errors as one line each and exit code 2."""
    return exit_on_error(run, argv)


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
