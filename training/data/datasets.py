"""Data: Megatron-Core indexed datasets -> GPTDataset (blended, split), or conversations packed for fine-tuning
(data.format=sft, training/data/sft.py); training/data/streams.py turns either into this DP rank's micro-batches.
GPTDataset builds as many samples as the run needs, reshuffling documents for each new epoch from the seed.

The embedded default corpus is the Python Language Reference text that ships with every CPython
(`pydoc_data.topics`, PSF licence): real English prose, ~0.5 MB, no download. It is written into the
indexed format the first time and cached.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import sys
from pathlib import Path

import numpy as np
import torch.distributed as dist

from training.config.paths import format_problem, prefix_meta, prefix_problem
from training.config.schema import Config
from training.errors import ConfigError

REPO_ROOT = Path(__file__).resolve().parents[2]
EMBEDDED_NAME = "python-reference"


def cache_dir(cfg: Config) -> Path:
    return Path(cfg.data.cache_dir) if cfg.data.cache_dir else REPO_ROOT / ".cache"


@contextlib.contextmanager
def written_atomically(prefix: str | Path, suffixes: tuple[str, ...] = (".bin", ".idx", ".json")):
    """Yields a temporary prefix to write PREFIX.bin/.idx/.json (or `suffixes`: conversations add .mask.bin/.idx,
    training/data/sft_write.py) under; renamed to `prefix` in that order when the block ends, removed if it raises: a
    crash never leaves a half dataset and never litters the output folder."""
    prefix = Path(prefix)
    prefix.parent.mkdir(parents=True, exist_ok=True)
    tmp = prefix.with_name(f"{prefix.name}.tmp{os.getpid()}")
    try:
        yield tmp
        for suffix in suffixes:
            os.replace(f"{tmp}{suffix}", f"{prefix}{suffix}")
    except BaseException:
        for suffix in suffixes:
            Path(f"{tmp}{suffix}").unlink(missing_ok=True)
        raise


def write_indexed(prefix: str | Path, documents, tokenizer) -> int:
    """Write token-id documents (EOD appended to each) as prefix.bin/.idx + prefix.json metadata.

    `documents` is any iterable of token-id sequences (lists or integer arrays), consumed once in order:
    a list, a generator, or a worker pool's `imap` (tools/preprocess_data.py). Empty documents are
    skipped. Files are written under temporary names and renamed only when complete, and the temporary
    files are removed if anything fails (the iterable included), so a crash never leaves a half dataset
    and never litters the output folder. Returns the number of documents."""
    with written_atomically(prefix) as tmp:
        count, tokens = _write_bin_idx(tmp, documents, tokenizer)
        if count == 0:
            raise ConfigError(f"no documents to write for {prefix} (the input is empty)")
        meta = {"tokenizer": tokenizer.name, "vocab_size": tokenizer.vocab_size, "eod": tokenizer.eod,
                "documents": count, "tokens": tokens}
        Path(f"{tmp}.json").write_text(json.dumps(meta, indent=1) + "\n")
    return count


def _write_bin_idx(tmp: Path, documents, tokenizer) -> tuple[int, int]:
    """tmp.bin + tmp.idx, one sequence per document; returns (documents, tokens incl. EOD)."""
    from megatron.core.datasets.indexed_dataset import DType, IndexedDatasetBuilder

    builder = IndexedDatasetBuilder(f"{tmp}.bin", dtype=DType.optimal_dtype(tokenizer.vocab_size))
    count = tokens = 0
    try:
        for ids in documents:
            if len(ids) == 0:
                continue
            builder.add_document(np.append(np.asarray(ids, dtype=np.int64), tokenizer.eod), [len(ids) + 1])
            count, tokens = count + 1, tokens + len(ids) + 1
    except BaseException:
        builder.data_file.close()
        raise
    builder.finalize(f"{tmp}.idx")
    return count, tokens


def embedded_documents():
    """The Python Language Reference topics, one document each, in a fixed order."""
    from pydoc_data.topics import topics

    return [topics[name] for name in sorted(topics)]


def embedded_prefix(cfg: Config, tokenizer) -> Path:
    """Keyed by tokenizer and Python version: each CPython release ships a slightly different text, and a
    cache shared by two interpreters must not serve one the other's corpus."""
    tag = "byte" if tokenizer.name == "byte" else "hf-" + hashlib.sha1(tokenizer.name.encode()).hexdigest()[:10]
    return cache_dir(cfg) / "embedded" / f"{EMBEDDED_NAME}-py{sys.version_info[0]}.{sys.version_info[1]}-{tag}"


def prepare_embedded(cfg: Config, tokenizer) -> Path:
    prefix = embedded_prefix(cfg, tokenizer)
    if not (Path(f"{prefix}.bin").exists() and Path(f"{prefix}.idx").exists()):
        write_indexed(prefix, (tokenizer.encode(text) for text in embedded_documents()), tokenizer)
    return prefix


def check_prefix(prefix: str, tokenizer, vocab_size: int | None = None, data_format: str = "text") -> None:
    """A clear error, naming the file, for a missing / partial / empty / truncated / corrupt dataset, one
    written with another tokenizer, or one whose token ids reach the model's vocabulary (vocab_size).

    The tokenizer check needs PREFIX.json (written by tools/preprocess_data.py); for datasets made by other
    tools, which have none, the token ids are scanned instead (a read of the whole .bin)."""
    bin_file, idx_file = Path(f"{prefix}.bin"), Path(f"{prefix}.idx")
    if problem := prefix_problem(prefix):  # missing, partial or empty (also checked before the launch)
        raise ConfigError(problem)
    index = _read_index(idx_file)
    expected = (int(index.sequence_pointers[-1]) + int(index.sequence_lengths[-1]) * index.dtype_size
                if index.sequence_count else 0)
    if bin_file.stat().st_size != expected:
        raise ConfigError(f"data.paths: {bin_file} has {bin_file.stat().st_size} bytes but {idx_file} describes "
                          f"{expected} ({index.sequence_count} sequences): a truncated or mismatched file; re-run "
                          f"tools/preprocess_data.py")
    if problem := format_problem(prefix, data_format):  # or PREFIX.json is not JSON (also checked before the launch)
        raise ConfigError(problem)
    meta = prefix_meta(prefix)
    if meta is None:
        if vocab_size is not None:
            _check_token_ids(bin_file, index.dtype, vocab_size)
        return
    written = (meta.get("tokenizer"), meta.get("vocab_size"), meta.get("eod"))
    if written != (tokenizer.name, tokenizer.vocab_size, tokenizer.eod):
        raise ConfigError(
            f"data.paths: {prefix} was written with tokenizer {written[0]} (vocab {written[1]}, eod "
            f"{written[2]}) but data.tokenizer is {tokenizer.name} (vocab {tokenizer.vocab_size}, eod "
            f"{tokenizer.eod}): " + ("set data.tokenizer=byte, or " if written[0] == "byte" else
                                     "set data.tokenizer to the tokenizer it was written with (its name is the "
                                     "hash of that tokenizer.json), or ") + "re-run tools/preprocess_data.py "
            "with data.tokenizer's")


def _read_index(idx_file: Path):
    """Megatron-Core's reader of PREFIX.idx, or a one-line error naming the file."""
    import logging

    from megatron.core.datasets.indexed_dataset import _IndexReader

    logging.getLogger("megatron.core.datasets.indexed_dataset").setLevel(logging.WARNING)
    try:
        return _IndexReader(str(idx_file), multimodal=False)
    except Exception as err:  # noqa: BLE001 - a bad header (AssertionError), short reads (struct / ValueError)
        reason = (str(err) or type(err).__name__).splitlines()[0]
        raise ConfigError(f"data.paths: {idx_file} is not a readable Megatron-Core index ({reason}): a corrupt "
                          f"file; re-run tools/preprocess_data.py") from err


def _check_token_ids(bin_file: Path, dtype, vocab_size: int, chunk: int = 1 << 26) -> None:
    ids = np.memmap(bin_file, dtype=dtype, mode="r")
    largest = max((int(ids[i:i + chunk].max()) for i in range(0, len(ids), chunk)), default=-1)
    if largest >= vocab_size:
        raise ConfigError(f"data.paths: {bin_file} holds token id {largest}, beyond the model's vocabulary "
                          f"({vocab_size} ids): preprocess it with the model's tokenizer, or raise model.vocab_size")


def resolve_vocab_size(cfg: Config, tokenizer) -> int:
    if cfg.model.vocab_size is None:
        return tokenizer.vocab_size
    if cfg.model.vocab_size < tokenizer.vocab_size:
        raise ConfigError(f"model.vocab_size={cfg.model.vocab_size} is smaller than the tokenizer's vocabulary "
                          f"({tokenizer.name}: {tokenizer.vocab_size}); set model.vocab_size=null")
    return cfg.model.vocab_size


def dataset_prefixes(cfg: Config, tokenizer) -> list[str]:
    """data.paths, or the embedded corpus (prepared by rank 0 while the other ranks wait)."""
    if cfg.data.paths:
        vocab_size = resolve_vocab_size(cfg, tokenizer)
        for prefix in cfg.data.paths:
            check_prefix(prefix, tokenizer, vocab_size)
        return list(cfg.data.paths)
    rank0 = not dist.is_initialized() or dist.get_rank() == 0
    if rank0:
        prepare_embedded(cfg, tokenizer)
    if dist.is_initialized():
        dist.barrier()
    return [str(embedded_prefix(cfg, tokenizer))]


def build_datasets(cfg: Config, tokenizer, num_samples: tuple[int, int], needs_data: bool):
    """(train, valid) GPT datasets of at least the given sizes, via Megatron-Core's builder.

    Every rank calls this (the builder synchronises: rank 0 writes the index caches first);
    ranks with `needs_data=False` (middle pipeline stages) get None."""
    from megatron.core.datasets.blended_megatron_dataset_builder import (
        BlendedMegatronDatasetBuilder,
    )
    from megatron.core.datasets.gpt_dataset import (
        GPTDataset,
        GPTDatasetConfig,
        MockGPTDataset,
    )

    d = cfg.data
    blend = None
    if not d.mock:
        blend = (dataset_prefixes(cfg, tokenizer), list(d.weights) if d.weights else None)
    config = GPTDatasetConfig(
        random_seed=cfg.train.seed, sequence_length=cfg.model.seq_length, blend=blend, split=d.split,
        tokenizer=tokenizer, reset_position_ids=False, reset_attention_mask=False,
        eod_mask_loss=d.eod_mask_loss, create_attention_mask=False,
        path_to_cache=str(cache_dir(cfg) / "index"), mid_level_dataset_surplus=0.005,
    )
    if blend is not None:
        check_splits(blend[0], config.split_matrix, d.split)
    cls = MockGPTDataset if d.mock else GPTDataset
    train, valid, _ = BlendedMegatronDatasetBuilder(
        cls, [num_samples[0], num_samples[1], 0], lambda: needs_data, config).build()
    return train, valid


def check_splits(prefixes: list[str], split_matrix, split: str) -> None:
    """Every non-empty split must get at least one document of every dataset (Megatron-Core 0.19.2
    loops forever building a split with no documents)."""
    from megatron.core.datasets.indexed_dataset import IndexedDataset

    for prefix in prefixes:
        documents = len(IndexedDataset(prefix).document_indices) - 1
        for name, bounds in zip(("train", "valid", "test"), split_matrix):
            if bounds is None or bounds[0] == bounds[1]:
                continue
            count = int(round(bounds[1] * documents)) - int(round(bounds[0] * documents))
            if count < 1:
                raise ConfigError(f"data.split={split} leaves the {name} split of {prefix} ({documents} "
                                  f"documents) empty: give it a larger share or 0 (e.g. 95,5,0)")
