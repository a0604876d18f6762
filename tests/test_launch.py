"""The launch scripts as a user runs them: DRY_RUN commands, shellcheck, the image tag in one place,
two torchrun "nodes" joined by the c10d rendezvous on 127.0.0.1, and slurm.sbatch under a stand-in
SLURM (srun/scancel/scontrol as small scripts): the pre-timeout SIGUSR1 checkpoints, exits 0,
requeues, and the requeued job resumes.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from harness import free_port

ROOT = Path(__file__).resolve().parents[1]
TINY_RUN = ["train.log_interval=1", "train.eval_interval=0", "train.micro_batch_size=2",
            "train.global_batch_size=4", "train.tensorboard=false"]


def launch_env(**extra: str) -> dict:
    env = {k: v for k, v in os.environ.items()
           if not k.startswith(("SLURM_", "NNODES", "NODE_RANK", "MASTER_", "RUN_", "NPROC", "DRY_RUN"))}
    env.update(PYTHON=sys.executable, **extra)
    return env


def dry_run(script: str, *args: str, **env: str) -> str:
    done = subprocess.run([str(ROOT / "launch" / script), *args], env=launch_env(DRY_RUN="1", **env),
                          capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    return done.stdout.strip().splitlines()[-1]  # the command is the last line (config check first)


def test_dry_run_prints_each_command_with_the_overrides():
    port = free_port()
    train = dry_run("train.sh", "parallel.tp=2", "train.iters=7", NPROC="2", MASTER_PORT=str(port),
                    RUN_DIR="/tmp/r", MAX_RESTARTS="2")
    assert "torch.distributed.run --nnodes 1 --nproc-per-node 2 --max-restarts 2" in train
    assert f"--rdzv-backend c10d --rdzv-endpoint 127.0.0.1:{port}" in train  # a fresh store per restart
    assert train.endswith("train.py hydra.run.dir=/tmp/r parallel.tp=2 train.iters=7")

    multi = dry_run("multinode.sh", "parallel.tp=2", "model.name=a b", NNODES="2", NODE_RANK="1",
                    MASTER_ADDR="10.0.0.1", MASTER_PORT="29600", NPROC="2", RUN_ID="exp7")
    assert "--nnodes 2 --nproc-per-node 2 --max-restarts 0 --rdzv-backend c10d --rdzv-endpoint 10.0.0.1:29600" in multi
    assert r"--rdzv-id exp7 --rdzv-conf is_host=0\,read_timeout=900" in multi  # node 0 hosts; the others wait 15 min
    assert multi.endswith(r"hydra.run.dir=outputs/run-exp7 parallel.tp=2 model.name=a\ b")

    docker = dry_run("docker.sh", "launch/train.sh", "parallel.tp=2", NPROC="8")
    for flag in ("--gpus all", "--ipc=host", "--ulimit memlock=-1", "--ulimit stack=67108864",
                 f"-v {ROOT}:/workspace/mcore-template", "-w /workspace/mcore-template", "-e NPROC=8"):
        assert flag in docker
    assert docker.endswith("launch/train.sh parallel.tp=2")

    slurm = dry_run("slurm.sbatch", "parallel.tp=2", SLURM_JOB_ID="4242", SLURM_NNODES="2",
                    MASTER_ADDR="node1")
    assert slurm == "srun --nodes=2 --ntasks-per-node=1 --kill-on-bad-exit=1 launch/multinode.sh parallel.tp=2"


def test_multinode_needs_a_run_id_shared_by_all_nodes():
    done = subprocess.run([str(ROOT / "launch/multinode.sh")], env=launch_env(NNODES="2", DRY_RUN="1"),
                          capture_output=True, text=True, timeout=60)
    assert done.returncode == 2 and "set RUN_ID=" in done.stderr
    done = subprocess.run([str(ROOT / "launch/multinode.sh")], env=launch_env(NNODES="2", DRY_RUN="1", RUN_ID="x"),
                          capture_output=True, text=True, timeout=60)  # 127.0.0.1 would send each node to itself
    assert done.returncode == 2 and done.stderr.strip().splitlines()[-1] == (
        "error: set MASTER_ADDR=<node 0's address> (NNODES=2: every node must reach node 0)"), done.stderr


def test_image_tag_is_the_same_in_dockerfile_and_docker_sh():
    dockerfile = re.search(r"^ARG NGC_TAG=(\S+)$", (ROOT / "Dockerfile").read_text(), re.M).group(1)
    script = re.search(r'^NGC_TAG="\$\{NGC_TAG:-(\S+)\}"$', (ROOT / "launch/docker.sh").read_text(), re.M).group(1)
    assert dockerfile == script


@pytest.mark.skipif(shutil.which("shellcheck") is None,
                    reason="shellcheck not installed (apt-get install shellcheck)")
def test_shellcheck_is_clean():
    scripts = sorted(str(p) for p in (ROOT / "launch").iterdir()) + sorted(str(p) for p in ROOT.glob("tools/*.sh"))
    done = subprocess.run(["shellcheck", "-S", "warning", "-x", *scripts], cwd=ROOT, capture_output=True, text=True)
    assert done.returncode == 0, done.stdout


@pytest.mark.slow
def test_two_nodes_on_one_machine_train_together(tmp_path):
    """Two launch/multinode.sh processes (NPROC=1 each) meet at a c10d rendezvous and train as dp=2."""
    env = launch_env(NNODES="2", MASTER_ADDR="127.0.0.1", MASTER_PORT=str(free_port()), NPROC="1",
                     RUN_DIR=str(tmp_path / "run"), LOCAL_ADDR="127.0.0.1")
    args = [str(ROOT / "launch/multinode.sh"), "train.iters=4", "checkpoint=none", *TINY_RUN]
    nodes = [subprocess.Popen(args, env={**env, "NODE_RANK": str(rank)}, stdout=subprocess.PIPE,
                              stderr=subprocess.STDOUT, text=True) for rank in (0, 1)]
    try:
        outputs = [node.communicate(timeout=300)[0] for node in nodes]
    finally:
        for node in nodes:
            node.kill()
    assert [node.returncode for node in nodes] == [0, 0], "\n".join(outputs)
    assert "world 2 = tp 1 x pp 1 x dp 2" in "".join(outputs)
    lines = (tmp_path / "run/metrics.jsonl").read_text().splitlines()
    assert len(lines) == 4


FAKE_SLURM = {  # just enough SLURM for launch/slurm.sbatch on one machine
    "srun": 'echo $$ > "$FAKE_SLURM/step.pid"; while [[ $1 == --* ]]; do shift; done; exec "$@"',
    "scancel": 'kill -USR1 "$(cat "$FAKE_SLURM/step.pid")"',  # to the step's launch script, which relays it
    "scontrol": 'echo "$*" >> "$FAKE_SLURM/scontrol.log"',
}


@pytest.mark.slow
def test_slurm_pre_timeout_signal_checkpoints_requeues_and_resumes(tmp_path):
    """SIGUSR1 to the batch script (--signal=B:USR1@120) goes through scancel to the step's launch
    script, on to the workers (torchrun ignores it): they save and exit 0, the job requeues itself, and
    the requeued job (same SLURM_JOB_ID, same RUN_DIR) starts from that checkpoint."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    for name, body in FAKE_SLURM.items():
        (bin_dir / name).write_text(f"#!/usr/bin/env bash\n{body}\n")
        (bin_dir / name).chmod(0o755)
    env = launch_env(PATH=f"{bin_dir}:{os.environ['PATH']}", FAKE_SLURM=str(tmp_path), SLURM_JOB_ID="77",
                     SLURM_NNODES="1", SLURM_NODEID="0", SLURM_SUBMIT_DIR=str(ROOT), MASTER_ADDR="127.0.0.1",
                     MASTER_PORT=str(free_port()), NPROC="1", RUN_DIR=str(tmp_path / "run"),
                     LOCAL_ADDR="127.0.0.1")
    job = [str(ROOT / "launch/slurm.sbatch"), *TINY_RUN]
    proc = subprocess.Popen([*job, "train.iters=1000"], env=env, stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True)
    seen, deadline = [], time.monotonic() + 240
    try:
        for line in proc.stdout:  # wait until training runs (the workers' handler is installed)
            seen.append(line)
            if line.startswith(" iter") or time.monotonic() > deadline:
                break
        proc.send_signal(signal.SIGUSR1)
        seen.append(proc.communicate(timeout=240)[0])
    finally:
        proc.kill()
    out = "".join(seen)
    assert proc.returncode == 0, out
    stopped = int(re.search(r"stopping at iteration (\d+): received SIGUSR1", out).group(1))
    assert (tmp_path / f"run/checkpoints/iter_{stopped:07d}").is_dir()
    assert (tmp_path / "scontrol.log").read_text() == "requeue 77\n"

    requeued = subprocess.run([*job, f"train.iters={stopped + 1}"], env=env, capture_output=True, text=True,
                              timeout=300)  # one more step than the first job reached: it must train it
    assert requeued.returncode == 0, requeued.stdout + requeued.stderr
    assert f"start at iteration {stopped} " in requeued.stdout
    records = [json.loads(line) for line in (tmp_path / "run/metrics.jsonl").read_text().splitlines()]
    assert records[-1]["iteration"] == stopped + 1 and 0 < records[-1]["loss"] < 20, records[-3:]
    assert (tmp_path / f"run/checkpoints/iter_{stopped + 1:07d}").is_dir()  # its end-of-run save
    assert (tmp_path / "scontrol.log").read_text() == "requeue 77\n"  # finished: no second requeue


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the refusal without a GPU")
def test_gpu_check_refuses_without_a_gpu(tmp_path):
    done = subprocess.run(["tools/gpu_check.sh"], cwd=ROOT, capture_output=True, text=True, timeout=120,
                          env={**os.environ, "OUT": str(tmp_path / "check")})
    assert done.returncode == 2
    assert done.stderr.strip().startswith("error: no CUDA GPU is visible") and "make test" in done.stderr
