"""checkpoint.async_save through the launcher: training goes on while a checkpoint is written, `latest` moves only
once every rank's write is complete, and a kill -9 of the whole job during the write leaves `latest` at the
previous checkpoint, which loads. (Same losses as a synchronous save and a bit-identical resume from an async
checkpoint: tests/test_checkpoint.py.)"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import psutil
from runs import QUICK, train

ROOT = Path(__file__).resolve().parents[1]
SAVE_FAULTS = ROOT / "tests" / "fixtures" / "save_faults"  # its sitecustomize.py: SAVE_FAULT=<fail|hold>:<rank>:<glob>
DEADLINE = 300  # seconds: generous on a loaded 2-core machine; the test waits on files, never on a fixed sleep


def _wait_for(predicate, what: str) -> None:
    deadline = time.monotonic() + DEADLINE
    while not predicate():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.05)


def _iterations(run_dir: Path) -> list[int]:
    metrics = run_dir / "metrics.jsonl"
    lines = metrics.read_text().splitlines() if metrics.is_file() else []
    return [json.loads(line)["iteration"] for line in lines if '"loss"' in line]


def test_training_overlaps_the_write_and_kill_9_mid_write_keeps_latest(tmp_path):
    run_dir, marker = tmp_path / "run", tmp_path / "held"
    ckpts = run_dir / "checkpoints"
    env = {k: v for k, v in os.environ.items() if not k.startswith(("SLURM_", "RUN_", "MASTER_", "NPROC"))}
    env.update(PYTHON=sys.executable, NPROC="2", RUN_DIR=str(run_dir),
               PYTHONPATH=os.pathsep.join([str(SAVE_FAULTS), str(ROOT / "tests")]),
               SAVE_FAULT="hold:0:*/iter_0000004/*.distcp", SAVE_FAULT_MARKER=str(marker))
    overrides = ["train.iters=100000", "train.save_interval=2", "checkpoint.keep=0", "checkpoint.async_save=true"]
    with (tmp_path / "job.log").open("w") as log:
        job = subprocess.Popen(["launch/train.sh", *QUICK, *overrides], cwd=ROOT, env=env, stdout=log,
                               stderr=subprocess.STDOUT, start_new_session=True)
    try:
        _wait_for(marker.exists, "rank 0's writer inside the write of iteration 4")
        # the write of iteration 4 is held in rank 0's writer process; the ranks train on
        _wait_for(lambda: max(_iterations(run_dir), default=0) >= 5, "iteration 5 while iteration 4 is written")
        assert (ckpts / "latest").read_text().strip() == "iter_0000002"
        assert not (ckpts / "iter_0000004" / "run.json").exists()
        assert job.poll() is None
    finally:  # kill -9 of every process of the job: torchrun runs in its own session, the ranks and their writers
        tree = psutil.Process(job.pid).children(recursive=True)  # in theirs: the launcher's group is not enough
        os.killpg(job.pid, signal.SIGKILL)
        for process in tree:
            with contextlib.suppress(psutil.NoSuchProcess):
                process.kill()
        job.wait(timeout=60)
        psutil.wait_procs(tree, timeout=60)
    log_text = (tmp_path / "job.log").read_text()
    assert "saving checkpoint" in log_text and "in the background" in log_text, log_text[-2000:]
    assert (ckpts / "latest").read_text().strip() == "iter_0000002"
    assert (ckpts / "iter_0000002" / "run.json").is_file()
    assert not (ckpts / "iter_0000004" / "run.json").exists(), "the interrupted write must never complete"
    resumed = train([f"checkpoint.dir={ckpts}", "train.iters=3"], 2, tmp_path / "resume")
    assert list(resumed) == [3]
