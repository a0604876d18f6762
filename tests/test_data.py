"""Data path: exact, resumable sampling across DP sizes; deterministic GPT datasets; blend weights; the errors
users hit with a dataset. CPU only, no process group needed (preprocessing, the embedded corpus and tokenizers:
tests/test_data_preprocess.py).

Megatron-Core's dataset builder runs without torch.distributed (it then acts as rank 0), so every test
here is a direct call.
"""

import json
from collections import Counter
from pathlib import Path

import numpy as np
import pytest
import torch
from corpora import BYTE, EXPECTED_WARNINGS, config, corpus

from training.data.datasets import build_datasets, resolve_vocab_size, write_indexed
from training.data.streams import MicroBatches
from training.errors import ConfigError

pytestmark = EXPECTED_WARNINGS


# ----------------------------------------------------------------------------------------------- helpers

class IndexDataset:
    """Sample i is the number i (tokens = labels = [i]): a batch shows exactly which samples it holds."""

    def __init__(self, size: int):
        self.size = size

    def __getitem__(self, i):
        if not 0 <= i < self.size:
            raise IndexError(f"sample {i} outside the epoch [0, {self.size})")
        t = torch.tensor([i])
        return {"tokens": t, "labels": t, "loss_mask": torch.ones(1)}


def read_steps(dataset, dp: int, micro: int, global_batch: int, steps: int, consumed: int = 0):
    """What each DP rank reads per step, as training/engine/loop.py drives it: one MicroBatches stream per rank,
    global_batch / (micro * dp) micro-batches per step. Returns [step][rank] -> sample indices in order."""
    streams = [MicroBatches(dataset, consumed, micro, dp, rank) for rank in range(dp)]
    per_step = global_batch // (micro * dp)
    batches = []
    for _ in range(steps):
        step = []
        for stream in streams:
            micro_batches = [next(stream)["tokens"][:, 0].tolist() for _ in range(per_step)]  # [per_step][micro]
            step.append([i for batch in micro_batches for i in batch])
        batches.append(step)
    return batches


def contents(steps) -> list[list[int]]:
    """Each global batch as the sorted sample indices of all ranks (the loss is their mean: order-free)."""
    return [sorted(i for rank in step for i in rank) for step in steps]


def samples(dataset, count) -> list[list[int]]:
    return [dataset[i]["tokens"].tolist() for i in range(count)]


# ------------------------------------------------------------------------------------ sampling and resume

EPOCH, MICRO, GLOBAL = 96, 2, 16  # 6 global batches per epoch; DP 4 reads 2 micro-batches per step


def test_every_sample_once_and_global_batches_equal_across_dp():
    by_dp = {dp: read_steps(IndexDataset(EPOCH), dp, MICRO, GLOBAL, EPOCH // GLOBAL) for dp in (1, 2, 4)}
    for dp, steps in by_dp.items():
        read = Counter(i for step in steps for rank in step for i in rank)
        assert sorted(read) == list(range(EPOCH)) and set(read.values()) == {1}, f"DP={dp}: lost or repeated"
        # Global batch k is samples [k*G, (k+1)*G) whatever DP is: the same content at DP 1, 2 and 4.
        assert contents(steps) == contents(by_dp[1]), f"DP={dp} batches differ from DP=1"
        assert contents(steps) == [list(range(k * GLOBAL, (k + 1) * GLOBAL)) for k in range(EPOCH // GLOBAL)]
        # Rank r of D reads, for micro-batch j, samples k*G + j*m*D + r*m ... + m (Megatron's sampler).
        for k, step in enumerate(steps):
            for r, rank in enumerate(step):
                assert rank == [k * GLOBAL + j * MICRO * dp + r * MICRO + i
                                for j in range(GLOBAL // (MICRO * dp)) for i in range(MICRO)]


@pytest.mark.parametrize("resume_dp", [2, 4, 1])
def test_resume_at_consumed_samples_continues_exactly(resume_dp):
    dataset = IndexDataset(EPOCH)
    uninterrupted = read_steps(dataset, 2, MICRO, GLOBAL, 6)
    first = read_steps(dataset, 2, MICRO, GLOBAL, 3)
    consumed = 3 * GLOBAL  # what the checkpoint records after 3 steps
    resumed = read_steps(dataset, resume_dp, MICRO, GLOBAL, 3, consumed=consumed)
    assert first == uninterrupted[:3]
    assert contents(resumed) == contents(uninterrupted[3:])
    if resume_dp == 2:  # same layout: every rank reads the very same micro-batches, in order
        assert resumed == uninterrupted[3:]


# ------------------------------------------------------------------------------- real Megatron datasets

def test_gpt_dataset_is_deterministic_from_the_seed(tmp_path):
    corpus(tmp_path / "c")

    def build(cache: str, seed: int = 1234):  # a separate cache each time: really rebuilt, not reloaded
        cfg = config(tmp_path / cache, [tmp_path / "c"])
        cfg.train.seed = seed
        return build_datasets(cfg, BYTE, (100, 8), True)

    (train_a, valid_a), (train_b, valid_b) = build("a"), build("b")
    assert samples(train_a, 100) == samples(train_b, 100)
    assert samples(valid_a, 8) == samples(valid_b, 8)
    assert samples(build("c", seed=4321)[0], 100) != samples(train_a, 100)  # the seed decides the order


def test_multi_epoch_request_reshuffles_deterministically(tmp_path):
    docs = corpus(tmp_path / "c")
    cfg = config(tmp_path / "a", [tmp_path / "c"], split="100,0,0")
    per_epoch = (sum(len(d) + 1 for d in docs) - 1) // cfg.model.seq_length  # samples in one epoch
    train, _ = build_datasets(cfg, BYTE, (3 * per_epoch, 0), True)
    assert len(train) >= 3 * per_epoch
    # Every document is read the same number of times (3 epochs: 3 each) ...
    assert set(Counter(train.document_index.tolist()).values()) == {3}
    # ... but epoch 2 is not a replay of epoch 1 ...
    everything = samples(train, 3 * per_epoch)
    assert everything[:per_epoch] != everything[per_epoch:2 * per_epoch]
    # ... and the whole order is a function of the seed: a fresh build (new cache) gives the same samples.
    cfg = config(tmp_path / "b", [tmp_path / "c"], split="100,0,0")
    again, _ = build_datasets(cfg, BYTE, (3 * per_epoch, 0), True)
    assert samples(again, 3 * per_epoch) == everything


def test_blend_weights_are_respected(tmp_path):
    # Dataset A is all "a", B all "b": a sample's source is visible in its tokens.
    for name, byte in (("A", ord("a")), ("B", ord("b"))):
        write_indexed(tmp_path / name, ([byte] * (30 + i % 7) for i in range(30)), BYTE)
    cfg = config(tmp_path, [tmp_path / "A", tmp_path / "B"], weights=[0.8, 0.2])
    n = 1000
    train, _ = build_datasets(cfg, BYTE, (n, 8), True)

    def source(tokens: list[int]) -> int:
        (byte,) = set(tokens) - {BYTE.eod}  # documents never mix: each sample comes from one dataset
        return byte

    from_a = np.cumsum([source(s) == ord("a") for s in samples(train, n)])  # [n]: samples of A among the first n
    # Tolerance: Megatron's BlendedDataset is deterministic and greedy (each next sample comes from the
    # dataset furthest below its weight), so after every prefix of n samples each dataset's count is
    # within one sample of weight * n. Measured: max |count_A(n) - 0.8 n| = 0.6 over n <= 1000.
    assert np.abs(from_a - 0.8 * np.arange(1, n + 1)).max() <= 1.0
    assert abs(from_a[-1] / n - 0.8) <= 1 / n


# ----------------------------------------------------------------------------------------- clear errors

def _written_by_another_tokenizer(prefix: Path):
    meta = json.loads(Path(f"{prefix}.json").read_text())
    meta.update(tokenizer="hf:sha256-0123456789abcdef", vocab_size=50257, eod=50256)  # a GPT-2-sized vocab
    Path(f"{prefix}.json").write_text(json.dumps(meta))


def _truncated_bin(prefix: Path):
    data = Path(f"{prefix}.bin").read_bytes()
    Path(f"{prefix}.bin").write_bytes(data[:-7])  # a copy cut short


def _corrupt_idx(prefix: Path):
    idx = Path(f"{prefix}.idx")
    idx.write_bytes(b"not an index at all" + idx.read_bytes()[19:])


def _ids_beyond_the_vocabulary(prefix: Path):
    """Ids up to 300 (another tool's dataset, no PREFIX.json) for a model of the byte vocabulary (257)."""
    class Wide:  # what write_indexed needs of a tokenizer
        name, vocab_size, eod = "wide", 301, 300

    write_indexed(prefix, [[5, 6, 299, 7], [8, 9]] * 5, Wide())
    Path(f"{prefix}.json").unlink()


@pytest.mark.parametrize("prefix, damage, split, expected", [
    ("nope", None, "95,5,0", ["no dataset at prefix", "preprocess_data.py"]),
    ("c", _truncated_bin, "95,5,0", ["c.bin has", "bytes but", "c.idx describes", "truncated"]),
    ("c", _corrupt_idx, "95,5,0", ["c.idx is not a readable Megatron-Core index", "corrupt"]),
    ("c", _ids_beyond_the_vocabulary, "95,5,0", ["holds token id 300", "vocabulary (257 ids)"]),
    ("c", lambda c: Path(f"{c}.bin").write_bytes(b""), "95,5,0", ["c.bin is empty"]),
    ("c", lambda c: Path(f"{c}.idx").unlink(), "95,5,0", ["c.bin exists but", "c.idx is missing"]),
    ("c", _written_by_another_tokenizer, "95,5,0", ["vocab 50257", "byte (vocab 257",
                                                  "set data.tokenizer to the tokenizer it was written with"]),
    ("c", None, "99,1,0", ["valid split", "(10 documents)", "99,1,0"]),  # round(10 * 0.01) = 0 documents
])
def test_dataset_errors_name_the_file_and_numbers(tmp_path, prefix, damage, split, expected):
    corpus(tmp_path / "c", count=10)
    if damage:
        damage(tmp_path / "c")
    with pytest.raises(ConfigError) as err:  # the user's path: build_datasets checks before Megatron reads
        build_datasets(config(tmp_path, [tmp_path / prefix], split=split), BYTE, (10, 2), True)
    message = str(err.value)
    assert "\n" not in message and str(tmp_path / prefix) in message, message
    assert all(e in message for e in expected), (expected, message)


def test_vocab_smaller_than_the_tokenizer_is_refused(tmp_path):
    cfg = config(tmp_path, [])
    cfg.model.vocab_size = 200
    with pytest.raises(ConfigError, match=r"model.vocab_size=200 .*\(byte: 257\)"):
        resolve_vocab_size(cfg, BYTE)
