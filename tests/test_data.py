"""Data path: exact, resumable sampling across DP sizes; deterministic GPT datasets; preprocessing round
trip; blend weights; the errors users hit; the embedded corpus. CPU only, no process group needed.

Megatron-Core's dataset builder runs without torch.distributed (it then acts as rank 0), so every test
here is a direct call except the one that runs tools/preprocess_data.py as a user would.
"""

import importlib.util
import json
import os
import subprocess
import sys
from collections import Counter
from pathlib import Path

import numpy as np
import pytest
import torch

from training.config.schema import Config
from training.data.datasets import (
    MicroBatches,
    build_datasets,
    check_prefix,
    embedded_documents,
    embedded_prefix,
    prepare_embedded,
    resolve_vocab_size,
    write_indexed,
)
from training.data.tokenizer import ByteTokenizer, build_tokenizer
from training.errors import ConfigError

ROOT = Path(__file__).resolve().parents[1]
TOOL = ROOT / "tools" / "preprocess_data.py"
BYTE = ByteTokenizer()

# Expected here: Megatron-Core guesses rank 0 without torch.distributed, and falls back from TE/Apex.
pytestmark = [pytest.mark.filterwarnings("ignore:Could not determine rank:UserWarning"),
              pytest.mark.filterwarnings("ignore:Transformer Engine and Apex are not installed:UserWarning")]


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


def config(tmp_path, paths, **data) -> Config:
    cfg = Config()
    cfg.model.seq_length = 16  # short samples: many per small corpus, several documents per sample
    cfg.data.paths, cfg.data.cache_dir = [str(p) for p in paths], str(tmp_path / "cache")
    for key, value in data.items():
        setattr(cfg.data, key, value)
    return cfg


def corpus(prefix, count=40, seed=0) -> list[str]:
    """`count` distinct documents of varied length (7..121 characters), written with the byte tokenizer."""
    rng = np.random.default_rng(seed)
    docs = [f"doc {i}: " + " ".join(rng.choice(["alpha", "beta", "gamma", "delta"], rng.integers(0, 20)))
            for i in range(count)]
    write_indexed(prefix, (BYTE.encode(d) for d in docs), BYTE)
    return docs


def decoded(prefix, tokenizer=BYTE) -> list[str]:
    """Every document of an indexed dataset, decoded, after checking it ends with exactly one EOD."""
    from megatron.core.datasets.indexed_dataset import IndexedDataset

    dataset = IndexedDataset(str(prefix))
    assert len(dataset) == len(dataset.document_indices) - 1  # one sequence per document
    docs = [dataset[i] for i in range(len(dataset))]
    assert all(d[-1] == tokenizer.eod and tokenizer.eod not in d[:-1] for d in docs)
    return [tokenizer.decode(d[:-1]) for d in docs]


def samples(dataset, count) -> list[list[int]]:
    return [dataset[i]["tokens"].tolist() for i in range(count)]


def load_tool():
    """tools/preprocess_data.py as a module, to call main() in-process (no ~10 s interpreter start)."""
    spec = importlib.util.spec_from_file_location("preprocess_data", TOOL)
    module = importlib.util.module_from_spec(spec)
    sys.modules["preprocess_data"] = module  # worker processes unpickle encode_chunk by this name
    spec.loader.exec_module(module)
    return module


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


# ----------------------------------------------------------------------------------------- preprocessing

TEXT_DOCS = ["Plain ASCII line.", "  leading spaces and a\ttab kept",
             "Ünïcödé: naïve café, 中文, Ελληνικά", "emoji 😀 and \"quotes\" and \\backslash"]
JSON_DOCS = ["a JSON document\nspanning lines\n", "ß → ∑ ∞ 🚀", "{\"nested\": \"json-looking text\"}", "x"]


def test_preprocess_round_trip_text_and_jsonl(tmp_path):
    # 1.3 MB of text: more than one 1 MB task, so 2 workers finish out of order and imap must restore it.
    bulk = [f"line {i} " + "word " * (i % 40) for i in range(12000)]
    text_docs = TEXT_DOCS + bulk
    lines = text_docs[:2] + ["", "   "] + text_docs[2:]  # blank and whitespace-only lines are skipped
    (tmp_path / "docs.txt").write_text("\n".join(lines) + "\n", encoding="utf-8")
    records = [json.dumps({"text": d, "id": i}, ensure_ascii=i % 2 == 0) for i, d in enumerate(JSON_DOCS)]
    (tmp_path / "docs.jsonl").write_text("\n".join(records) + "\n", encoding="utf-8")  # \\u escapes and raw UTF-8
    out = tmp_path / "out"
    command = [sys.executable, str(TOOL), "--input", str(tmp_path / "docs.txt"), str(tmp_path / "*.jsonl"),
               "--output-prefix", str(out / "rt"), "--tokenizer", "byte", "--workers", "2"]
    run = subprocess.run(command, capture_output=True, text=True, timeout=120)
    assert run.returncode == 0, run.stderr
    assert "wrote" in run.stdout and "documents/s" in run.stdout and "MB/s" in run.stdout
    assert decoded(out / "rt") == text_docs + JSON_DOCS
    assert sorted(os.listdir(out)) == ["rt.bin", "rt.idx", "rt.json"]  # no temporary files left
    meta = json.loads((out / "rt.json").read_text())
    assert (meta["tokenizer"], meta["documents"]) == ("byte", len(text_docs) + len(JSON_DOCS))
    check_prefix(str(out / "rt"), BYTE)  # readable for training with the same tokenizer


def test_preprocess_errors_are_one_line_naming_the_input(tmp_path, capsys):
    tool = load_tool()
    (tmp_path / "blank.txt").write_text("\n  \n\n")
    (tmp_path / "bad.jsonl").write_text('{"text": "ok"}\n\n{"body": "no text key"}\n')
    cases = [  # (arguments, what the error must name)
        (["--input", str(tmp_path / "none*.txt")], ["none*.txt", "no file matches"]),
        (["--input", str(tmp_path / "blank.txt")], ["blank.txt", "no documents"]),
        (["--input", str(tmp_path / "bad.jsonl"), "--workers", "2"], ["bad.jsonl:3", '"text"']),
        (["--input", str(tmp_path / "blank.txt"), "--tokenizer", str(tmp_path / "tok.json")], ["tok.json"]),
    ]
    for args, expected in cases:
        args = args + ["--tokenizer", "byte"] if "--tokenizer" not in args else args
        assert tool.main(args + ["--output-prefix", str(tmp_path / "out" / "x")]) == 2, args
        err = capsys.readouterr().err.strip()
        assert err.startswith("error: ") and "\n" not in err, err
        assert all(e in err for e in expected), (expected, err)
    assert not (tmp_path / "out").exists() or os.listdir(tmp_path / "out") == []  # nothing half-written


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
    ("c", _written_by_another_tokenizer, "95,5,0", ["vocab 50257", "byte (vocab 257"]),
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


# ------------------------------------------------------------------------------------ embedded + tokenizers

def test_embedded_corpus_round_trips_exactly(tmp_path):
    cfg = config(tmp_path, [])
    prefix = prepare_embedded(cfg, BYTE)
    assert prefix == embedded_prefix(cfg, BYTE)
    documents = embedded_documents()
    assert decoded(prefix) == documents
    assert 300_000 < sum(len(d.encode()) for d in documents) < 2_000_000  # "~0.5 MB of prose"
    stamp = os.stat(f"{prefix}.bin").st_mtime_ns
    train, valid = build_datasets(cfg, BYTE, (16, 4), True)  # data.paths=[]: the default run's data
    assert os.stat(f"{prefix}.bin").st_mtime_ns == stamp  # cached, not rewritten
    sample = bytes(t for t in train[0]["tokens"].tolist() if t != BYTE.eod)  # may cut a UTF-8 character
    assert sample in "".join(documents).encode() and len(valid) >= 4


def test_hf_tokenizer_json(tmp_path, capsys):
    tokenizers = pytest.importorskip("tokenizers")  # optional (the `hf` extra); CI installs only `.[dev]`
    vocab = {"<|endoftext|>": 0, "[UNK]": 1, "hello": 2, "world": 3, "again": 4}
    tok = tokenizers.Tokenizer(tokenizers.models.WordLevel(vocab, unk_token="[UNK]"))
    tok.pre_tokenizer = tokenizers.pre_tokenizers.Whitespace()
    tok.add_special_tokens(["<|endoftext|>"])  # as in real tokenizers: EOD is special, skipped by decode
    (tmp_path / "a").mkdir()
    tok.save(str(tmp_path / "a" / "tokenizer.json"))
    hf = build_tokenizer(str(tmp_path / "a"))  # a directory holding tokenizer.json
    assert (hf.vocab_size, hf.eod, hf.encode("hello world again")) == (5, 0, [2, 3, 4])
    assert hf.decode([2, 3, 0]) == "hello world"  # EOD is special: dropped when decoding
    # The name is the content's hash: a copy elsewhere is the same tokenizer, an edited file is not.
    (tmp_path / "b.json").write_bytes((tmp_path / "a" / "tokenizer.json").read_bytes())
    assert build_tokenizer(str(tmp_path / "b.json")).name == hf.name
    (tmp_path / "b.json").write_bytes((tmp_path / "a" / "tokenizer.json").read_bytes() + b"\n")
    assert build_tokenizer(str(tmp_path / "b.json")).name != hf.name
    (tmp_path / "a" / "tokenizer.json").replace(tmp_path / "b.json")
    (tmp_path / "broken.json").write_text("{")
    with pytest.raises(ConfigError, match="broken.json"):
        build_tokenizer(str(tmp_path / "broken.json"))
    # Preprocess with it, then read with the byte tokenizer: refused, naming both.
    (tmp_path / "in.txt").write_text("hello world\nworld again hello\n")
    assert load_tool().main(["--input", str(tmp_path / "in.txt"), "--output-prefix", str(tmp_path / "hf"),
                             "--tokenizer", str(tmp_path / "b.json")]) == 0
    capsys.readouterr()
    assert decoded(tmp_path / "hf", hf) == ["hello world", "world again hello"]
    check_prefix(str(tmp_path / "hf"), hf)
    with pytest.raises(ConfigError, match=f"{hf.name}.*byte"):
        check_prefix(str(tmp_path / "hf"), BYTE)


def test_hf_tokenizer_without_the_package_says_how_to_install(tmp_path, monkeypatch):
    (tmp_path / "tokenizer.json").write_text("{}")
    monkeypatch.setitem(sys.modules, "tokenizers", None)  # import fails, as where the `hf` extra is absent
    with pytest.raises(ConfigError, match=r"tokenizer\.json needs the `tokenizers` package: pip install"):
        build_tokenizer(str(tmp_path))
