"""Indexed datasets preprocessed in parts -> one: Megatron-Core's `IndexedDatasetBuilder.add_index` (the parts'
tokens and document boundaries, in order), after checking every part and that one tokenizer wrote them all.

    merge_indexed(["data/part-0", "data/part-1"], "data/corpus")  # -> data/corpus.bin/.idx/.json
"""

from __future__ import annotations

import json
from pathlib import Path
from types import SimpleNamespace

from training.errors import ConfigError


def part_meta(prefix: str) -> dict:
    """PREFIX.json (the tokenizer, documents and tokens tools/preprocess_data.py recorded), or one line why not."""
    meta_file = Path(f"{prefix}.json")
    if not meta_file.is_file():
        raise ConfigError(f"{prefix}: no {meta_file.name}, so the tokenizer it was written with is unknown: merge "
                          f"parts written by tools/preprocess_data.py")
    try:
        meta = json.loads(meta_file.read_text())
    except ValueError as err:
        raise ConfigError(f"{meta_file}: not valid JSON ({err})") from None
    if not isinstance(meta, dict) or not {"tokenizer", "vocab_size", "eod"} <= set(meta):
        raise ConfigError(f"{meta_file}: no tokenizer, vocab_size and eod: not written by tools/preprocess_data.py")
    return meta


def merge_indexed(parts: list[str], prefix: str) -> dict:
    """Write PREFIX.bin/.idx/.json holding every part in order; returns the merged PREFIX.json's content.

    Written under temporary names and renamed when complete (nothing half-written on failure), like
    training.data.datasets.write_indexed."""
    from megatron.core.datasets.indexed_dataset import DType, IndexedDatasetBuilder

    from training.config.paths import prefix_problem
    from training.data.datasets import check_prefix, written_atomically

    for part in parts:  # missing, partial or empty: said before anything about its PREFIX.json
        if problem := prefix_problem(part):
            raise ConfigError(problem.removeprefix("data.paths: "))
    metas = [part_meta(p) for p in parts]
    tokenizer = SimpleNamespace(name=metas[0]["tokenizer"], vocab_size=metas[0]["vocab_size"], eod=metas[0]["eod"])
    for part, meta in zip(parts, metas):
        if (meta["tokenizer"], meta["vocab_size"], meta["eod"]) != (tokenizer.name, tokenizer.vocab_size,
                                                                     tokenizer.eod):
            raise ConfigError(f"{part} was written with tokenizer {meta['tokenizer']} (vocab {meta['vocab_size']}, "
                              f"eod {meta['eod']}) but {parts[0]} with {tokenizer.name} (vocab {tokenizer.vocab_size}"
                              f", eod {tokenizer.eod}): preprocess every part with the same --tokenizer")
        try:
            check_prefix(part, tokenizer)  # a truncated .bin or a corrupt .idx
        except ConfigError as err:
            raise ConfigError(str(err).removeprefix("data.paths: ")) from None
    with written_atomically(prefix) as tmp:
        builder = IndexedDatasetBuilder(f"{tmp}.bin", dtype=DType.optimal_dtype(tokenizer.vocab_size))
        try:
            for part in parts:
                builder.add_index(part)
        finally:
            builder.data_file.close()  # finalize closes it too; here also when a part fails
        builder.finalize(f"{tmp}.idx")
        merged = {"tokenizer": tokenizer.name, "vocab_size": tokenizer.vocab_size, "eod": tokenizer.eod,
                  "documents": sum(m.get("documents", 0) for m in metas),
                  "tokens": sum(m.get("tokens", 0) for m in metas), "merged_from": [str(p) for p in parts]}
        Path(f"{tmp}.json").write_text(json.dumps(merged, indent=1) + "\n")
    return merged
