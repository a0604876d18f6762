"""The user's mistakes with files: one `error:` line naming the path, exit code 2, nothing lost.

Before any process starts (training/config/paths.py, run by tools/check_config.py before torchrun and by train.py
on every rank): a missing data prefix, tokenizer or checkpoint. During training (training/data/batch_check.py):
a .bin damaged after preprocessing stops the step that would read it, before its forward, on every rank alike.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
from corpora import BYTE, EXPECTED_WARNINGS
from harness import run_distributed
from runs import QUICK, train_catching

from training.config.paths import path_problems
from training.config.schema import Config

ROOT = Path(__file__).resolve().parents[1]
pytestmark = EXPECTED_WARNINGS  # Megatron-Core's dataset builder without torch.distributed (damage_a_document...)


def check_config(capsys, *overrides: str) -> tuple[int, list[str]]:
    """tools/check_config.py in this process (as the launch scripts run it): exit code, stderr lines."""
    from tools.check_config import main

    code = main(list(overrides))
    return code, capsys.readouterr().err.splitlines()


def fake_checkpoint(root: Path, iteration: int, complete: bool = True) -> Path:
    path = root / f"iter_{iteration:07d}"
    path.mkdir(parents=True)
    for name in ("run.json", "metadata.json")[:2 if complete else 1]:
        (path / name).write_text("{}")
    return path


# --- before any process starts -------------------------------------------------------------------------------

@pytest.mark.fast
def test_the_launcher_refuses_a_missing_dataset_before_torchrun(tmp_path):
    run_dir, prefix = tmp_path / "run", tmp_path / "data" / "nonexistent"
    env = {k: v for k, v in os.environ.items() if not k.startswith(("MASTER_", "RUN_", "NPROC", "DRY_RUN"))}
    done = subprocess.run([str(ROOT / "launch" / "train.sh"), f"data.paths=[{prefix}]"], capture_output=True,
                          text=True, timeout=120, env=dict(env, NPROC="2", RUN_DIR=str(run_dir), PYTHON=sys.executable))
    assert done.returncode == 2, done.stderr
    assert done.stderr.splitlines() == [
        f"error: data.paths: no dataset at prefix {prefix} (expected {prefix}.bin and {prefix}.idx; create them with "
        f"tools/preprocess_data.py)"], done.stderr
    assert done.stdout == ""
    assert not run_dir.exists()  # rank 0 of train.py creates it: torchrun never started


@pytest.mark.fast
def test_check_config_names_each_missing_tokenizer_and_checkpoint(tmp_path, capsys):
    tokenizer, absent = tmp_path / "tok" / "tokenizer.json", tmp_path / "absent"
    code, lines = check_config(capsys, f"data.tokenizer={tokenizer}", f"checkpoint.load={absent}")
    assert code == 2
    assert lines == [f"error: checkpoint.load={absent} does not exist (use auto, null, or an existing checkpoint "
                     f"path)"]  # validate's rules first: a missing load is theirs
    code, lines = check_config(capsys, f"data.tokenizer={tokenizer}", f"checkpoint.load={tmp_path}")
    assert code == 2
    assert lines == [
        f"error: data.tokenizer={tokenizer}: no such file (give `byte`, a local tokenizer.json or a directory "
        f"holding one)",
        f"error: checkpoint.load={tmp_path} is not a checkpoint (no run.json / metadata.json; no `latest` file, no "
        f"complete iter_* directory)"]
    # conversations (data.format=sft): the loss mask's files are named too
    for suffix in (".bin", ".idx"):
        (tmp_path / f"chats{suffix}").write_bytes(b"x")
    code, lines = check_config(capsys, "data.format=sft", f"data.paths=[{tmp_path / 'chats'}]")
    assert code == 2 and lines == [f"error: data.paths: no dataset at prefix {tmp_path / 'chats'}.mask (expected "
                                   f"{tmp_path / 'chats'}.mask.bin and {tmp_path / 'chats'}.mask.idx; create them with "
                                   f"tools/preprocess_data.py) (the conversations' loss mask: "
                                   f"tools/preprocess_data.py --format sft writes it)"], lines
    # its own options apart from the overrides (was `LexerNoViableAltException: --nproc`)
    assert check_config(capsys, "--nproc", "2", "parallel.tp=2")[0] == 0
    code, lines = check_config(capsys, "--nproc", "3", "parallel.tp=2")
    assert code == 2 and len(lines) == 1 and lines[0].startswith("error: world size 3 is not divisible"), lines
    code, lines = check_config(capsys, "--bogus", "parallel.tp=2")
    assert code == 2 and lines == ["error: unknown option --bogus: tools/check_config.py takes --nproc, --port and "
                                   "--run-dir; the other arguments are Hydra overrides (key=value)"], lines


@pytest.mark.fast
def test_checkpoint_load_must_be_a_complete_checkpoint(tmp_path):
    """The launch-time check refuses exactly what the load would (training/checkpoint/common.py resolve_path)."""
    from training.checkpoint.common import CheckpointError, resolve_path

    def problems(load) -> list[str]:
        cfg = Config()
        cfg.checkpoint.load = None if load is None else str(load)
        found = path_problems(cfg)
        if load not in (None, "auto"):
            try:
                resolve_path(load)
                assert found == [], found
            except (CheckpointError, FileNotFoundError, NotADirectoryError):
                assert len(found) == 1, load
        return found

    root = tmp_path / "checkpoints"
    fake_checkpoint(root, 2)
    assert problems(root) == [f"checkpoint.load={root} is not a checkpoint (no run.json / metadata.json; it holds "
                              f"iter_0000002 but no `latest` file: point checkpoint.load at one of them)"]
    assert problems(root / "iter_0000002") == []
    (root / "latest").write_text("iter_0000004\n")
    assert problems(root) == [f"checkpoint.load={root}: {root}/latest names {root}/iter_0000004, which is missing "
                              f"or incomplete (no run.json / metadata.json: an interrupted save?); point "
                              f"checkpoint.load at a complete iter_*"]
    fake_checkpoint(root, 4, complete=False)
    assert len(problems(root)) == 1
    (root / "latest").write_text("iter_0000002\n")
    assert problems(root) == problems("auto") == problems(None) == []
    (tmp_path / "file").write_text("")
    assert problems(tmp_path / "file")[0].endswith("is a file, not a checkpoint directory (an iter_* directory or a "
                                                   "checkpoint.dir)")


@pytest.mark.fast
def test_data_paths_relative_to_the_working_directory_and_blends(tmp_path, monkeypatch):
    def problems(**data) -> list[str]:
        cfg = Config()
        for key, value in data.items():
            setattr(cfg.data, key, value)
        return path_problems(cfg)

    monkeypatch.chdir(tmp_path)
    (tmp_path / "data").mkdir()
    for suffix in (".bin", ".idx"):
        (tmp_path / "data" / f"a{suffix}").write_bytes(b"x")
    (tmp_path / "data" / "b.bin").write_bytes(b"x")
    (tmp_path / "data" / "c.bin").write_bytes(b"")
    (tmp_path / "data" / "c.idx").write_bytes(b"x")
    assert problems(paths=["data/a"], weights=[1.0]) == []
    assert problems(paths=["0.3", "data/a", "0.7", "data/b", "data/c"]) == [
        "data.paths: 0.3 is a number, not a dataset prefix: give blend weights in data.weights (one per path)",
        "data.paths: 0.7 is a number, not a dataset prefix: give blend weights in data.weights (one per path)",
        "data.paths: data/b.bin exists but data/b.idx is missing (an interrupted preprocessing run?): re-run "
        "tools/preprocess_data.py",
        "data.paths: data/c.bin is empty: re-run tools/preprocess_data.py"]
    assert problems(paths=["data/missing"], mock=True) == []  # mock data reads no file
    (tmp_path / "tok").mkdir()
    assert problems(tokenizer="tok") == ["data.tokenizer=tok: no tokenizer.json in this directory"]
    (tmp_path / "tok" / "tokenizer.json").write_text("{}")
    assert problems(tokenizer="tok") == problems(tokenizer="tok/tokenizer.json") == []


def test_train_py_alone_refuses_missing_files(tmp_path):
    tokenizer = tmp_path / "tokenizer.json"
    done = subprocess.run([sys.executable, "train.py", f"data.tokenizer={tokenizer}",
                           f"checkpoint.load={tmp_path}", f"hydra.run.dir={tmp_path / 'run'}"],
                          cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert done.returncode == 2, done.stderr
    assert done.stderr.splitlines() == [
        f"error: data.tokenizer={tokenizer}: no such file (give `byte`, a local tokenizer.json or a directory "
        f"holding one)",
        f"error: checkpoint.load={tmp_path} is not a checkpoint (no run.json / metadata.json; no `latest` file, no "
        f"complete iter_* directory)"], done.stderr


# --- damaged data, caught per step ---------------------------------------------------------------------------

@pytest.mark.fast
def test_a_bad_token_id_names_its_sample_and_the_stream_loses_nothing():
    import torch

    from training.data.batch_check import DamagedData, check_token_ids
    from training.data.streams import MicroBatches

    def sample(i: int) -> dict:
        labels = torch.tensor([i, {14: 300, 19: -1}.get(i, 0)])  # sample 14: beyond a vocabulary of 257; 19: < 0
        return {"tokens": torch.tensor([i, i]), "labels": labels, "loss_mask": torch.ones(2)}

    stream = MicroBatches([sample(i) for i in range(32)], 0, 2, 2, 1)  # DP rank 1 of 2, micro-batches of 2
    check_token_ids(stream, 2, 257, torch.device("cpu"))  # step 1: samples 2, 3 | 6, 7
    assert [next(stream)["tokens"][:, 0].tolist() for _ in range(2)] == [[2, 3], [6, 7]]  # read ahead, then taken
    with pytest.raises(DamagedData) as err:  # step 2: 10, 11 | 14, 15
        check_token_ids(stream, 2, 257, torch.device("cpu"))
    assert str(err.value) == ("data: sample 14 holds token id 300 outside the model's vocabulary (257 ids). Stopped "
                              "before this step's forward: the weights are untouched")
    assert [next(stream)["tokens"][:, 0].tolist() for _ in range(2)] == [[10, 11], [14, 15]]
    with pytest.raises(DamagedData, match="sample 19 holds token id -1"):  # step 3: 18, 19 | 22, 23
        check_token_ids(stream, 2, 257, torch.device("cpu"))


def damage_a_document_of_rank_1(prefix: Path, cfg: Config, samples: int) -> int:
    """Write a corpus whose document d is the byte d + 1 repeated (a sample's ids name its documents), then
    overwrite, after preprocessing, the ids of one document that first appears in step 2 or later in a sample DP
    rank 1 of 2 reads (micro-batches of 2, global batch 8) with 300 (vocabulary 257), the .idx and .json intact.
    Returns that sample's index."""
    from training.data.datasets import build_datasets, write_indexed

    write_indexed(prefix, ([d + 1] * (5 + 7 * d % 50) for d in range(40)), BYTE)
    train, _ = build_datasets(cfg, BYTE, (samples, 0), True)  # what the run builds (the same index cache)
    seen, first = set(), {}
    for i in range(samples):
        docs = {int(t) - 1 for key in ("tokens", "labels") for t in train[i][key] if t != BYTE.eod}
        first.update({d: i for d in docs - seen})
        seen |= docs
    doc, sample = next((d, i) for d, i in first.items() if i >= 8 and i % 4 // 2 == 1)
    ids = np.memmap(f"{prefix}.bin", dtype=np.uint16, mode="r+")  # the byte tokenizer's ids are 16-bit
    ids[ids == doc + 1] = BYTE.vocab_size + 43
    ids.flush()
    return sample


def train_watching_the_last_step(overrides: list[str], run_dir: str) -> tuple[str, list[dict]]:
    """train_catching, and per train_step: the error it raised (or None), and whether the weights, the optimizer's
    tensors and the lr schedule are bit-identical after it."""
    import torch

    from training.engine import loop

    steps, train_step = [], loop.train_step

    def snapshot(state) -> tuple[list, int]:
        inner = [o.optimizer for o in getattr(state.optimizer, "chained_optimizers", [state.optimizer])]
        tensors = [p for chunk in state.model for p in chunk.parameters()] + [
            t for adam in inner for group in adam.param_groups for p in group["params"]
            for t in (p, *adam.state.get(p, {}).values()) if torch.is_tensor(t)]
        return [t.detach().clone() for t in tensors], state.scheduler.num_steps

    def watched(state, *args, **kwargs):
        before, raised = snapshot(state), None
        try:
            return train_step(state, *args, **kwargs)
        except Exception as err:
            raised = type(err).__name__
            raise
        finally:
            after = snapshot(state)
            steps.append(dict(raised=raised, schedule=(before[1], after[1]),
                              same=all(torch.equal(a, b) for a, b in zip(before[0], after[0], strict=True))))

    loop.train_step = watched  # the loop looks its train_step up at each call
    return train_catching(overrides, run_dir), steps


def test_damaged_data_stops_every_rank_before_the_update(tmp_path):
    from training.config.compose import compose

    prefix, iters = tmp_path / "damaged", 4
    overrides = QUICK + [f"data.paths=[{prefix}]", f"data.cache_dir={tmp_path / 'cache'}", f"train.iters={iters}"]
    sample = damage_a_document_of_rank_1(prefix, compose(overrides), iters * 8)
    ranks = run_distributed(train_watching_the_last_step, 2, (overrides, str(tmp_path / "run")), timeout=300)
    line = (f"error: data: {prefix}.bin holds token id 300 in its train sample {sample}, outside the model's "
            f"vocabulary (257 ids): the file was damaged after preprocessing (its .json is intact); re-create it "
            f"with tools/preprocess_data.py. Stopped before this step's forward: the weights are untouched")
    for result, steps in ranks:  # rank 0 never read the sample, and stops with the same line (which it prints)
        assert result == line
        assert [s["raised"] for s in steps] == [None] * (sample // 8) + ["DamagedData"]
        assert not any(s["same"] for s in steps[:-1])  # the steps before it trained
        assert steps[-1]["same"] and steps[-1]["schedule"] == (sample // 8,) * 2  # the last: nothing applied
