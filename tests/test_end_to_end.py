"""The path a user takes: launch/train.sh -> torchrun -> train.py -> a falling loss, metrics.jsonl,
TensorBoard scalars, the resolved config and a checkpoint in the run dir."""

import json
import math
import os
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
REQUIRED = {"iteration", "loss", "lr", "grad_norm", "tokens_per_s", "tflops_per_gpu", "mfu", "mem_gb"}


@pytest.mark.fast
def test_launch_two_steps_at_tp2(tmp_path):
    """The fast tier's launch check: launch/train.sh (config check, torchrun, 2 processes) trains the default
    model two steps at tp2, logs both and saves a checkpoint."""
    run_dir = tmp_path / "run"
    env = dict(os.environ, NPROC="2", RUN_DIR=str(run_dir))
    proc = subprocess.run(["launch/train.sh", "parallel.tp=2", "train.iters=2", "train.log_interval=1",
                           "train.eval_interval=0", "train.tensorboard=false"],
                          cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    lines = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert [r["iteration"] for r in lines] == [1, 2] and all(math.isfinite(r["loss"]) for r in lines)
    assert REQUIRED <= set(lines[-1])
    assert (run_dir / "checkpoints" / "latest").read_text().strip() == "iter_0000002"


def test_launch_train_sh_tp2_loss_falls_and_metrics_are_written(tmp_path):
    run_dir = tmp_path / "run"
    env = dict(os.environ, NPROC="2", RUN_DIR=str(run_dir))
    proc = subprocess.run(
        ["launch/train.sh", "parallel.tp=2", "train.iters=30", "train.log_interval=5", "train.eval_interval=15"],
        cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]

    lines = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    train = [r for r in lines if "loss" in r]
    evals = [r for r in lines if "val_loss" in r]
    assert [r["iteration"] for r in train] == [5, 10, 15, 20, 25, 30]
    assert [r["iteration"] for r in evals] == [15, 30]
    for record in train:
        assert REQUIRED <= set(record), set(record)
        assert record["mfu"] is None  # no known peak on CPU
        assert record["tokens_per_s"] > 0 and record["tflops_per_gpu"] > 0 and record["mem_gb"] > 0
    assert train[-1]["loss"] < 0.9 * train[0]["loss"], [r["loss"] for r in train]
    assert evals[-1]["val_loss"] < evals[0]["val_loss"]

    assert " iter     30/30 | loss " in proc.stdout  # the console line
    assert "world 2 = tp 2 x pp 1 x dp 1" in proc.stdout
    assert (run_dir / "config.yaml").is_file()
    assert list((run_dir / "tensorboard").glob("events.out.tfevents.*"))
    assert (run_dir / "checkpoints" / "latest").read_text().strip() == "iter_0000030"

    # resumed with train.iters and optim.lr changed: the schedule is rebuilt (cosine from the new lr 2e-3 at the end
    # of the 20 warmup iterations to 2e-4 at 40, no longer 30), the optimizer state still loads (Megatron-Core 0.19
    # pairs param groups by their lr: upstream_fixes 5), and the resume says so with the lr at iteration 30 both ways
    proc = subprocess.run(["launch/train.sh", "parallel.tp=2", "train.iters=40", "optim.lr=2e-3",
                           "train.log_interval=5", "train.eval_interval=0"],
                          cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    cosine = lambda i: 2e-4 + 0.5 * (2e-3 - 2e-4) * (1 + math.cos(math.pi * (i - 20) / (40 - 20)))  # noqa: E731
    note = (f"note: train.iters 30 -> 40, optim.lr 0.003 -> 0.002, optim.min_lr 0.0003 -> 0.0002 since the "
            f"checkpoint: the lr schedule is rebuilt from this config; lr at iteration 30: 0.0003 before, "
            f"{cosine(30):.3g} now")
    assert note in proc.stdout, proc.stdout[-3000:]
    resumed = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()][len(lines):]
    assert [(r["iteration"], round(r["lr"], 9)) for r in resumed] == [(i, round(cosine(i - 1), 9)) for i in (35, 40)]  # step i runs at lr(i - 1)


def test_preprocess_then_train_on_your_own_text(tmp_path):
    """tools/preprocess_data.py -> data.paths=[P] -> launch/train.sh trains with a falling loss, at minimal TP
    (parallel=tp2_mlp: only the MLP split over 2 ranks). The text (real prose) comes as users' corpora do: Parquet
    shards (a glob), a `datasets` save_to_disk folder, a .jsonl.zst."""
    import sys

    import zstandard
    from test_data_inputs import jsonl, save_to_disk, write_parquet

    from training.data.datasets import embedded_documents

    docs = embedded_documents()
    (tmp_path / "shards").mkdir()
    write_parquet(tmp_path / "shards" / "part-0.parquet", docs[:15])
    write_parquet(tmp_path / "shards" / "part-1.parquet", docs[15:30])
    save_to_disk(tmp_path / "saved", [docs[30:55]])
    (tmp_path / "rest.jsonl.zst").write_bytes(zstandard.ZstdCompressor().compress(jsonl(docs[55:])))
    prefix = tmp_path / "data" / "corpus"
    proc = subprocess.run([sys.executable, "tools/preprocess_data.py", "--input", str(tmp_path / "shards" / "*"),
                           str(tmp_path / "saved"), str(tmp_path / "rest.jsonl.zst"), "--output-prefix", str(prefix),
                           "--tokenizer", "byte"], cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert f"from 4 file(s): {len(docs)} documents" in proc.stdout, proc.stdout

    run_dir = tmp_path / "run"
    env = dict(os.environ, NPROC="2", RUN_DIR=str(run_dir))
    proc = subprocess.run(["launch/train.sh", "parallel=tp2_mlp", f"data.paths=[{prefix}]", "data.tokenizer=byte",
                           "train.iters=40",
                           f"data.cache_dir={tmp_path / 'cache'}", "train.eval_interval=0", "checkpoint=none"],
                          cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert "tp splits mlp only" in proc.stdout, proc.stdout[-3000:]
    train = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert [r["iteration"] for r in train] == [10, 20, 30, 40]
    assert train[-1]["loss"] < 0.9 * train[0]["loss"], [r["loss"] for r in train]


def test_four_launches_at_once_each_pick_a_port_and_train(tmp_path):
    """Four launch/train.sh jobs started together without MASTER_PORT (a CI box running several, a user's two
    terminals) each pick their own rendezvous port and train: the launcher's own pick never fails the run (it
    once failed as 'MASTER_PORT=38483 is not free' when another process took it between pick and check)."""
    env = {k: v for k, v in os.environ.items() if k != "MASTER_PORT"}
    procs = [subprocess.Popen(["launch/train.sh", "train.iters=1", "train.eval_interval=0", "train.tensorboard=false",
                               "checkpoint=none", "train.global_batch_size=8"],
                              cwd=ROOT, env=dict(env, NPROC="2", RUN_DIR=str(tmp_path / f"run{i}")),
                              stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True) for i in range(4)]
    outputs = [p.communicate(timeout=900)[0] for p in procs]
    for i, (proc, out) in enumerate(zip(procs, outputs)):
        assert proc.returncode == 0, f"job {i}: " + out[-3000:]
        assert [json.loads(line)["iteration"] for line in (tmp_path / f"run{i}" / "metrics.jsonl").open()] == [1]
