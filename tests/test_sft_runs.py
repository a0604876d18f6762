"""data.format=sft through the training loop, from files: a run resumed from its checkpoint continues bit for bit
(the packed sequences follow from the seed and the consumed samples), and conversations read as documents, or
documents as conversations, are refused in one line."""

from pathlib import Path

import numpy as np
import pytest
from corpora import BYTE, corpus
from harness import run_distributed
from runs import train, train_catching

from training.data.sft_write import write_sft

SFT = ["data.format=sft", "data.tokenizer=byte", "model.seq_length=64", "data.split='90,10,0'"]
SAVE_AT_4 = ["train.iters=8", "train.save_interval=4", "checkpoint.keep=0", "train.log_interval=1",
             "train.eval_interval=4", "train.eval_iters=1"]


class ByteChat:
    """The byte tokenizer as write_sft sees one (the chat template's hash: none here)."""

    name, vocab_size, eod, template_hash = BYTE.name, BYTE.vocab_size, BYTE.eod, "none"


def conversations(prefix: Path, count: int = 120, seed: int = 0) -> None:
    """`count` conversations of 10..90 tokens (some longer than a sequence: truncated), a prompt then an answer."""
    rng = np.random.default_rng(seed)
    pairs = []
    for _ in range(count):
        n, p = int(rng.integers(10, 90)), int(rng.integers(3, 9))
        ids = rng.integers(32, 127, n).astype(np.uint16)
        pairs.append((ids, np.r_[np.zeros(p, np.uint8), np.ones(n - p, np.uint8)]))
    write_sft(prefix, pairs, ByteChat())


@pytest.mark.slow
def test_resume_from_a_checkpoint_continues_bit_for_bit(tmp_path):
    conversations(tmp_path / "chats")
    data = SFT + [f"data.paths=[{tmp_path / 'chats'}]", "parallel.pp=2"]
    full = train(data + SAVE_AT_4, 2, tmp_path / "full")
    assert sorted(full) == list(range(1, 9)) and full[8] < full[1]
    resumed = train(data + SAVE_AT_4 + [f"checkpoint.load={tmp_path}/full/checkpoints/iter_0000004"], 2,
                    tmp_path / "resumed")
    assert resumed == {i: full[i] for i in range(5, 9)}  # exact float equality


def _refusals(root: str) -> list[str]:
    quick = ["train.iters=1", "checkpoint.dir=null", "data.tokenizer=byte", "model.seq_length=64"]
    return [train_catching(quick + ["data.format=sft", f"data.paths=[{root}/docs]"], f"{root}/a"),
            train_catching(quick + [f"data.paths=[{root}/chats]"], f"{root}/b")]


def test_the_wrong_format_is_refused_in_one_line(tmp_path):
    corpus(tmp_path / "docs")
    conversations(tmp_path / "chats", count=20)
    (errors,) = run_distributed(_refusals, 1, (str(tmp_path),), timeout=600)
    assert errors[0] == (f"error: data.paths: {tmp_path}/docs holds plain documents, but data.format=sft: set "
                         f"data.format=text, or preprocess the records again with --format sft")
    assert errors[1] == (f"error: data.paths: {tmp_path}/chats holds conversations (tools/preprocess_data.py "
                         f"--format sft), but data.format=text: set data.format=sft")
