"""Preference pairs (data.format=preference) -> packed sequences, each pair's chosen and rejected side by side.

    train, valid = build(cfg, tokenizer, (train_samples, valid_samples), needs_data)    # every rank
    train[i] -> {"tokens", "labels", "loss_mask", "position_ids", "segment_ids", "answer_ids"}   # [s] each
                + {"pair_index": [P], "ref_logps": [P, 2]}                                       # P = s // 2 slots

tools/preprocess_data.py --format preference writes each pair as two conversations of an SFT dataset (chosen at
2i, rejected at 2i + 1; the mask on the last answer). A pair of n_c and n_r tokens fills (n_c - 1) + (n_r - 1)
positions of a sequence as SFT packs a conversation: inputs, labels shifted by one, its own positions, and a
segment each (2k + 1 chosen, 2k + 2 rejected for the pair in slot k), so neither sees the other. `answer_ids`
says which answer a target token is in (2k chosen, 2k + 1 rejected, -1 elsewhere): the loss sums each answer's
log-probabilities from it (training/post/logps.py). `pair_index` is the global index of the pair in slot k (-1:
empty slot), `ref_logps` the reference's sums (filled by the reference's pass, training/post/reference.py).

Chosen and rejected of a pair are in the same sequence, so in the same micro-batch, on the same DP rank and
pipeline pass. Splits, packing (best fit, seeded, epochs) and the order are SFT's (training/data/sft.py); a pair
longer than the sequence is left out, counted in the log line.
"""

from __future__ import annotations

import numpy as np
import torch
import torch.distributed as dist

from training.config.schema import Config
from training.data.sft import Conversations, best_fit, open_checked, split_ranges
from training.errors import ConfigError


def slots(seq_length: int) -> int:
    """Pairs a sequence can hold: each fills at least two positions."""
    return max(seq_length // 2, 1)


class PackedPairs(torch.utils.data.Dataset):
    def __init__(self, conversations: Conversations, seq_length: int, seed: int, num_samples: int, eod: int,
                 name: str = "train"):
        self.conversations, self.seq, self.eod, self.slots = conversations, seq_length, eod, slots(seq_length)
        lengths = conversations.lengths.reshape(-1, 2) - 1  # [pairs, 2] positions of chosen, rejected
        self.lengths = lengths
        need = lengths.sum(axis=1)  # [pairs]
        self.kept = np.flatnonzero((lengths.min(axis=1) >= 1) & (need <= seq_length))
        self.dropped = len(lengths) - len(self.kept)
        if num_samples > 0 and len(self.kept) == 0:
            raise ConfigError(f"data: the {name} split has no preference pair that fits model.seq_length="
                              f"{seq_length} ({len(lengths)} pairs in it, the shortest {int(need.min()) + 2 if len(need) else 0} "
                              f"tokens): raise model.seq_length, or give the split more data")
        self.samples: list[np.ndarray] = []  # [pairs] global pair indices, one array per sequence
        epoch = 0
        while len(self.samples) < num_samples:
            rng = np.random.default_rng([seed, epoch, 3 if name == "train" else 4])
            order = rng.permutation(self.kept)
            bins = best_fit(need[order], seq_length)
            self.samples += [order[b] for b in (bins[i] for i in rng.permutation(len(bins)))]
            epoch += 1
        self.epochs = epoch
        self.reference: np.ndarray | None = None  # [pairs, 2] stored reference log-probs (training/post/stored.py)

    def __len__(self) -> int:
        return len(self.samples)

    def __getitem__(self, index: int) -> dict[str, torch.Tensor]:
        s = self.seq
        tokens, labels = np.full(s, self.eod, np.int64), np.full(s, self.eod, np.int64)
        loss_mask, segments, answers = np.zeros(s, np.float32), np.zeros(s, np.int64), np.full(s, -1, np.int64)
        positions, at = np.zeros(s, np.int64), 0
        pair_index, ref = np.full(self.slots, -1, np.int64), np.zeros((self.slots, 2))
        for k, pair in enumerate(self.samples[index].tolist()):
            pair_index[k] = pair
            if self.reference is not None:
                ref[k] = self.reference[pair]
            for side in (0, 1):  # chosen, rejected
                n = int(self.lengths[pair, side])
                ids, mask = self.conversations.get(2 * pair + side, n + 1)  # [n + 1] each
                tokens[at:at + n], labels[at:at + n], loss_mask[at:at + n] = ids[:-1], ids[1:], mask[1:]
                positions[at:at + n], segments[at:at + n] = np.arange(n), 2 * k + 1 + side
                answers[at:at + n] = np.where(mask[1:] > 0, 2 * k + side, -1)
                at += n
        positions[at:] = np.arange(s - at)  # padding: segment 0, no target
        return {"tokens": torch.from_numpy(tokens), "labels": torch.from_numpy(labels),
                "loss_mask": torch.from_numpy(loss_mask), "position_ids": torch.from_numpy(positions),
                "segment_ids": torch.from_numpy(segments), "answer_ids": torch.from_numpy(answers),
                "pair_index": torch.from_numpy(pair_index), "ref_logps": torch.from_numpy(ref)}

    def describe(self) -> str:
        filled = sum(int(self.lengths[p].sum()) for p in self.samples)
        out = f"{self.dropped} longer than the sequence left out" if self.dropped else "none left out"
        return (f"{len(self.kept)} pairs ({out}) packed into {len(self.samples)} sequences of {self.seq} over "
                f"{self.epochs} epoch(s), {100 * filled / max(len(self.samples) * self.seq, 1):.1f}% of positions filled")


def one_epoch(data: PackedPairs, multiple: int) -> tuple[PackedPairs, list[dict]]:
    """Every kept pair of `data`'s split once, packed, as rows padded with empty ones (no pair in them) to a
    multiple of `multiple` (micro batch x DP x micro-batches: whole global batches)."""
    epoch = PackedPairs(data.conversations, data.seq, 0, 1, data.eod, "epoch")
    rows = [epoch[i] for i in range(len(epoch))]
    empty = dict(rows[0], pair_index=torch.full_like(rows[0]["pair_index"], -1),
                 answer_ids=torch.full_like(rows[0]["answer_ids"], -1))
    return epoch, rows + [empty] * (-len(rows) % multiple)


def build(cfg: Config, tokenizer, num_samples: tuple[int, int], needs_data: bool):
    """(train, valid) PackedPairs of at least the given sizes; None, None where needs_data is False."""
    if (found := open_checked(cfg, tokenizer, needs_data, data_format="preference")) is None:
        return None, None
    opened, split_matrix = found
    out = []
    for k, (name, samples) in enumerate(zip(("train", "valid"), num_samples)):
        parts = []
        for t, m in opened:
            pairs = split_ranges(len(t.sequence_lengths) // 2, split_matrix)[k]  # the split's pairs, file order
            parts.append((t, m, range(2 * pairs.start, 2 * pairs.stop)))
        out.append(PackedPairs(Conversations(parts), cfg.model.seq_length, cfg.train.seed, samples, tokenizer.eod,
                               name) if samples else None)
    if not dist.is_initialized() or dist.get_rank() == 0:
        for name, data in zip(("train", "valid"), out):
            if data is not None:
                print(f"preference data ({name}): {data.describe()}", flush=True)
    return tuple(out)
