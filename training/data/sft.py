"""Chat fine-tuning data (data.format=sft): conversations -> packed sequences whose conversations never see
each other, the loss on the answers only.

    train, valid = build(cfg, tokenizer, (train_samples, valid_samples), needs_data)   # every rank
    train[i] -> {"tokens", "labels", "loss_mask", "position_ids", "segment_ids"}          # [s] each

tools/preprocess_data.py --format sft writes each conversation as two indexed sequences of one length
(training/data/chat.py): its token ids (PREFIX) and a 0/1 mask of its loss targets (PREFIX.mask: the
assistant's turns, end-of-turn included). A conversation of n tokens fills n - 1 positions of a sequence:
inputs t0..t(n-2), labels t1..t(n-1), loss mask m1..m(n-1), position ids 0..n-2 and one segment id (1, 2, ...
in the sequence; 0 is padding, which is never a target). The model (models/gpt.py) keeps every token's
attention inside its segment and rotates it by its own position, so a packed conversation computes exactly
what it would alone; the loss is the answer-token mean of the global batch (training/engine/losses.py).

Split: data.split's train and valid shares of each dataset's conversations, in file order (Megatron-Core's
rule for documents). Packing, per epoch: the split's conversations in a seeded random order, each into the
fullest sequence it fits (best fit; a new sequence when none does), then the sequences in a seeded random
order; epochs follow each other until the run has the samples it asks for. Everything follows from the seed
and the files: the same samples at every layout and after a resume. A conversation longer than the sequence
(n - 1 > seq_length) is cut to seq_length + 1 tokens or left out (data.overlong), counted in the log line.
"""

from __future__ import annotations

import bisect
from pathlib import Path

import numpy as np
import torch
import torch.distributed as dist

from training.config.paths import MASK_SUFFIX, prefix_problem
from training.config.schema import Config
from training.errors import ConfigError


class Conversations:
    """The conversations of some datasets' splits: lengths [n] and (ids, mask) of each, global index i."""

    def __init__(self, parts: list[tuple[object, object, range]]):  # (tokens, masks, doc range) per dataset
        self.parts = parts
        self.starts = np.cumsum([0] + [len(r) for _, _, r in parts])  # [datasets + 1]
        self.lengths = np.concatenate([t.sequence_lengths[r.start:r.stop] for t, _, r in parts]).astype(np.int64) \
            if parts else np.zeros(0, np.int64)

    def __len__(self) -> int:
        return int(self.starts[-1])

    def get(self, i: int, length: int) -> tuple[np.ndarray, np.ndarray]:
        """The first `length` token ids and mask values of conversation i."""
        part = int(np.searchsorted(self.starts, i, side="right")) - 1
        tokens, masks, docs = self.parts[part]
        doc = docs.start + i - int(self.starts[part])
        return tokens.get(doc, 0, length), masks.get(doc, 0, length)


def best_fit(lengths: np.ndarray, capacity: int) -> list[list[int]]:
    """Items (positions each, in the given order) into bins of `capacity`: each into the fullest open bin it fits,
    a new bin when none does. Open bins are kept by free space (a sorted list of the distinct free sizes, at
    most capacity + 1 of them), so an item costs O(log capacity)."""
    bins: list[list[int]] = []
    free_sizes: list[int] = []  # sorted distinct free sizes that have an open bin
    by_free: dict[int, list[int]] = {}  # free size -> open bins with it
    for item, need in enumerate(lengths.tolist()):
        at = bisect.bisect_left(free_sizes, need)
        if at < len(free_sizes):
            free = free_sizes[at]
            target = by_free[free].pop()
            if not by_free[free]:
                free_sizes.pop(at)
        else:
            free, target = capacity, len(bins)
            bins.append([])
        bins[target].append(item)
        left = free - need
        if left > 0:
            if not by_free.get(left):
                by_free[left] = []
                bisect.insort(free_sizes, left)
            by_free[left].append(target)
    return bins


class PackedConversations(torch.utils.data.Dataset):
    """Sequences of seq_length positions, each packed with whole conversations (the module docstring)."""

    def __init__(self, conversations: Conversations, seq_length: int, seed: int, num_samples: int, eod: int,
                 overlong: str = "truncate", name: str = "train"):
        self.conversations, self.seq, self.eod = conversations, seq_length, eod
        positions = conversations.lengths - 1  # [n] what each conversation fills
        self.kept = np.flatnonzero((positions >= 1) & ((positions <= seq_length) | (overlong == "truncate")))
        self.positions = np.minimum(positions, seq_length)  # [n]
        self.truncated = int(np.sum(positions[self.kept] > seq_length))
        self.dropped = len(conversations) - len(self.kept)
        if num_samples > 0 and len(self.kept) == 0:
            raise ConfigError(f"data: the {name} split has no conversation of 2 to {seq_length + 1} tokens "
                              f"({len(conversations)} in it; data.overlong={overlong}): give it a larger share in "
                              f"data.split, or more data")
        self.samples: list[np.ndarray] = []  # [conversations] global indices, one array per sequence
        epoch = 0
        while len(self.samples) < num_samples:
            rng = np.random.default_rng([seed, epoch, 1 if name == "train" else 2])
            order = rng.permutation(self.kept)
            bins = best_fit(self.positions[order], seq_length)
            self.samples += [order[b] for b in (bins[i] for i in rng.permutation(len(bins)))]
            epoch += 1
        self.epochs = epoch

    def __len__(self) -> int:
        return len(self.samples)

    def __getitem__(self, index: int) -> dict[str, torch.Tensor]:
        s = self.seq
        tokens, labels = np.full(s, self.eod, np.int64), np.full(s, self.eod, np.int64)
        loss_mask, segments = np.zeros(s, np.float32), np.zeros(s, np.int64)
        positions, at = np.zeros(s, np.int64), 0
        for segment, conversation in enumerate(self.samples[index].tolist(), 1):
            n = int(self.positions[conversation])
            ids, mask = self.conversations.get(conversation, n + 1)  # [n + 1] each
            tokens[at:at + n], labels[at:at + n], loss_mask[at:at + n] = ids[:-1], ids[1:], mask[1:]
            positions[at:at + n], segments[at:at + n] = np.arange(n), segment
            at += n
        positions[at:] = np.arange(s - at)  # padding: segment 0, no target
        return {"tokens": torch.from_numpy(tokens), "labels": torch.from_numpy(labels),
                "loss_mask": torch.from_numpy(loss_mask), "position_ids": torch.from_numpy(positions),
                "segment_ids": torch.from_numpy(segments)}

    def describe(self) -> str:
        filled = sum(int(self.positions[c].sum()) for c in self.samples)
        cut = f"{self.truncated} cut to {self.seq + 1} tokens" if self.truncated else "none cut"
        out = f"{self.dropped} left out (over {self.seq + 1} tokens with data.overlong=drop, or under 2)" \
            if self.dropped else "none left out"
        return (f"{len(self.kept)} conversations ({cut}, {out}) packed into {len(self.samples)} sequences of "
                f"{self.seq} over {self.epochs} epoch(s), {100 * filled / max(len(self.samples) * self.seq, 1):.1f}% "
                f"of positions filled")


def check(prefix: str, tokenizer, vocab_size: int, data_format: str = "sft") -> None:
    """A conversations dataset: the token files as any dataset's (training/data/datasets.check_prefix), written by
    --format sft (or preference), and its mask files there with the same sequence lengths."""
    from training.data.datasets import _read_index, check_prefix

    check_prefix(prefix, tokenizer, vocab_size, data_format=data_format)
    masks = f"{prefix}{MASK_SUFFIX}"
    if problem := prefix_problem(masks):
        raise ConfigError(f"{problem} (the loss mask of the conversations at {prefix})")
    tokens, mask = _read_index(Path(f"{prefix}.idx")), _read_index(Path(f"{masks}.idx"))
    if not np.array_equal(tokens.sequence_lengths, mask.sequence_lengths):
        raise ConfigError(f"data.paths: {masks}.idx does not match {prefix}.idx ({mask.sequence_count} vs "
                          f"{tokens.sequence_count} conversations, or other lengths): re-run tools/preprocess_data.py "
                          f"--format {data_format}")


def split_ranges(count: int, split_matrix) -> list[range]:
    """The train, valid and test conversations of a dataset of `count`: data.split's shares, in file order."""
    return [range(0, 0) if bounds is None else range(int(round(bounds[0] * count)), int(round(bounds[1] * count)))
            for bounds in split_matrix]


def open_checked(cfg: Config, tokenizer, needs_data: bool, data_format: str = "sft"):
    """Every data.paths prefix checked (training/data/sft.py's check); then, where this rank reads data, the
    opened (tokens, mask) datasets and data.split's matrix, else None."""
    from megatron.core.datasets.blended_megatron_dataset_config import (
        convert_split_vector_to_split_matrix,
        parse_and_normalize_split,
    )
    from megatron.core.datasets.indexed_dataset import IndexedDataset

    from training.data.datasets import resolve_vocab_size

    vocab_size = resolve_vocab_size(cfg, tokenizer)
    for prefix in cfg.data.paths:
        check(prefix, tokenizer, vocab_size, data_format=data_format)
    if not needs_data:
        return None
    split_matrix = convert_split_vector_to_split_matrix(parse_and_normalize_split(cfg.data.split))
    return [(IndexedDataset(p), IndexedDataset(f"{p}{MASK_SUFFIX}")) for p in cfg.data.paths], split_matrix


def build(cfg: Config, tokenizer, num_samples: tuple[int, int], needs_data: bool):
    """(train, valid) PackedConversations of at least the given sizes; None, None where needs_data is False."""
    if (found := open_checked(cfg, tokenizer, needs_data)) is None:
        return None, None
    opened, split_matrix = found
    out = []
    for k, (name, samples) in enumerate(zip(("train", "valid"), num_samples)):
        parts = [(t, m, split_ranges(len(t.sequence_lengths), split_matrix)[k]) for t, m in opened]
        out.append(PackedConversations(Conversations(parts), cfg.model.seq_length, cfg.train.seed, samples,
                                       tokenizer.eod, str(cfg.data.overlong), name) if samples else None)
    if not dist.is_initialized() or dist.get_rank() == 0:
        for name, data in zip(("train", "valid"), out):
            if data is not None:
                print(f"sft data ({name}): {data.describe()}", flush=True)
    return tuple(out)

