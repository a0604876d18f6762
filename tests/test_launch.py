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
from runs import QUICK

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

    docker = dry_run("docker.sh", "launch/train.sh", "parallel.tp=2", NPROC="8", RUN_DIR="/shared/r1",
                     TORCH_NCCL_ENABLE_MONITORING="0", MAX_RESTARTS="1")
    for flag in ("--gpus all", "--ipc=host", "--ulimit memlock=-1", "--ulimit stack=67108864",
                 f"--user {os.getuid()}:{os.getgid()}", f"-v {ROOT}:/workspace/mcore-template",
                 "-v /shared/r1:/shared/r1", "-w /workspace/mcore-template", "-e NPROC=8",
                 "-e TORCH_NCCL_ENABLE_MONITORING=0", "-e MAX_RESTARTS=1", "-e RUN_DIR=/shared/r1"):
        assert flag in docker
    assert docker.endswith("launch/train.sh parallel.tp=2")

    slurm = dry_run("slurm.sbatch", "parallel.tp=2", SLURM_JOB_ID="4242", SLURM_NNODES="2",
                    MASTER_ADDR="node1")
    assert slurm == ("srun --nodes=2 --ntasks-per-node=1 --kill-on-bad-exit=1 --label launch/multinode.sh "
                     "parallel.tp=2")
    pyxis = dry_run("slurm.sbatch", "parallel.tp=2", SLURM_JOB_ID="4242", SLURM_NNODES="2", MASTER_ADDR="node1",
                    CONTAINER_IMAGE="/shared/mcore.sqsh", RUN_DIR="/shared/runs/a", DATA_DIR="/shared/data")
    assert pyxis == ("srun --nodes=2 --ntasks-per-node=1 --kill-on-bad-exit=1 --label "
                     "--container-image=/shared/mcore.sqsh --container-mounts="
                     f"{ROOT}:/workspace/mcore-template\\,/shared/data:/data\\,/shared/runs/a:/shared/runs/a "
                     "--container-workdir=/workspace/mcore-template --no-container-mount-home launch/multinode.sh "
                     "parallel.tp=2")


def test_multinode_needs_a_run_id_shared_by_all_nodes():
    done = subprocess.run([str(ROOT / "launch/multinode.sh")], env=launch_env(NNODES="2", DRY_RUN="1"),
                          capture_output=True, text=True, timeout=60)
    assert done.returncode == 2 and "set RUN_ID=" in done.stderr
    done = subprocess.run([str(ROOT / "launch/multinode.sh")], env=launch_env(NNODES="2", DRY_RUN="1", RUN_ID="x"),
                          capture_output=True, text=True, timeout=60)  # 127.0.0.1 would send each node to itself
    assert done.returncode == 2 and done.stderr.strip().splitlines()[-1] == (
        "error: set MASTER_ADDR=<node 0's address> (NNODES=2: every node must reach node 0)"), done.stderr


def test_launch_refuses_what_would_misfire_on_a_cluster(tmp_path):
    """Each one line, exit 2: docker inside a SLURM job (outside its cgroup), the old CONTAINER=1, a job whose
    scontrol names no host; the submit shell's NODE_RANK and MASTER_ADDR do not reach the nodes; NPROC follows
    SLURM's GPU binding."""
    def run(script: str, *args: str, **env: str) -> subprocess.CompletedProcess:
        return subprocess.run([str(ROOT / "launch" / script), *args], env=launch_env(**{"DRY_RUN": "1", **env}),
                              capture_output=True, text=True, timeout=120)

    def refused(done: subprocess.CompletedProcess, start: str) -> None:
        assert done.returncode == 2 and done.stderr.strip().splitlines() == [done.stderr.strip()], done.stderr
        assert done.stderr.startswith(f"error: {start}"), done.stderr

    refused(run("docker.sh", SLURM_JOB_ID="9"), "inside SLURM job 9 docker runs outside")
    refused(run("slurm.sbatch", SLURM_JOB_ID="9", SLURM_NNODES="2", MASTER_ADDR="n1", CONTAINER="1"),
            "CONTAINER=1 (docker on every node) is gone")
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    scontrol = bin_dir / "scontrol"  # a batch node that names no host, then one that does
    scontrol.write_text('#!/usr/bin/env bash\n[ -z "$FAKE_HOST" ] || echo "$FAKE_HOST"\n')
    scontrol.chmod(0o755)
    path = f"{bin_dir}:{os.environ['PATH']}"
    job = dict(SLURM_JOB_ID="9", SLURM_NNODES="2", SLURM_JOB_NODELIST="gpu[1-2]", PATH=path)
    refused(run("slurm.sbatch", **job, FAKE_HOST=""), "no rendezvous host: 'scontrol show hostnames gpu[1-2]'")
    # srun stands in: it prints what each node's multinode.sh would run
    srun = bin_dir / "srun"
    srun.write_text('#!/usr/bin/env bash\nwhile [[ $1 == --* ]]; do shift; done\nSLURM_NODEID=1 DRY_RUN=1 exec "$@"\n')
    srun.chmod(0o755)
    done = run("slurm.sbatch", "train.global_batch_size=32", **job, FAKE_HOST="gpu1", MASTER_ADDR="login7",
               NODE_RANK="0", SLURM_GPUS_ON_NODE="4", DRY_RUN="0")
    assert done.returncode == 0, done.stderr
    assert "--nnodes 2 --nproc-per-node 4 " in done.stdout and "--rdzv-endpoint gpu1:" in done.stdout
    assert "is_host=0" in done.stdout  # node 1 (SLURM_NODEID), not the submit shell's NODE_RANK=0


def test_the_launch_environment_keeps_the_users_settings():
    """launch/common.sh's defaults: torch's own NCCL error handling (3), and the allocator setting only when the
    user set neither of its names (torch reads PYTORCH_CUDA_ALLOC_CONF first: setting it would hide theirs)."""
    show = "source launch/common.sh; echo $TORCH_NCCL_ASYNC_ERROR_HANDLING ${PYTORCH_CUDA_ALLOC_CONF:-unset}"

    def shown(**env: str) -> str:
        return subprocess.run(["bash", "-c", show], cwd=ROOT, env=launch_env(**env), capture_output=True, text=True,
                              check=True).stdout.strip()

    base = {k: v for k, v in os.environ.items() if not k.startswith(("PYTORCH_", "TORCH_NCCL_"))}
    assert shown(**base) == "3 expandable_segments:True"
    assert shown(**base, PYTORCH_ALLOC_CONF="backend:cudaMallocAsync") == "3 unset"
    assert shown(**base, TORCH_NCCL_ASYNC_ERROR_HANDLING="1", PYTORCH_CUDA_ALLOC_CONF="x") == "1 x"


def test_the_pytorchjob_manifest_renders_for_the_run():
    import yaml

    env = launch_env(IMAGE="registry.example.com/mcore:1", PVC="runs", NNODES="3", NPROC="2", RUN_ID="l7b-a")
    overrides = ["parallel.tp=2", "model.name=a b", "train.global_batch_size=12"]
    done = subprocess.run([str(ROOT / "launch/kubernetes.sh"), *overrides], env=env,
                          capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    assert "world 6 = tp 2" in done.stderr  # the config was checked for 3 pods x 2 processes
    job = yaml.safe_load(done.stdout)
    assert (job["apiVersion"], job["kind"], job["metadata"]["name"]) == ("kubeflow.org/v1", "PyTorchJob", "l7b-a")
    specs = job["spec"]["pytorchReplicaSpecs"]
    assert {name: spec["replicas"] for name, spec in specs.items()} == {"Master": 1, "Worker": 2}
    for spec in specs.values():
        pod = spec["template"]["spec"]
        (container,) = pod["containers"]
        assert container["name"] == "pytorch" and container["image"] == "registry.example.com/mcore:1"
        env_vars = {e["name"]: e["value"] for e in container["env"]}
        assert all(isinstance(v, str) for v in env_vars.values())  # Kubernetes wants strings
        assert env_vars["NNODES"] == "3" and env_vars["NPROC"] == "2" and env_vars["RUN_DIR"] == "/shared/runs/l7b-a"
        assert container["resources"]["limits"]["nvidia.com/gpu"] == "2"
        # what the pod runs: multinode.sh with the operator's RANK as NODE_RANK, the overrides as given
        command = container["command"] + container["args"]
        script = (ROOT / "launch/multinode.sh").read_text()
        assert all(f"${{{name}:-" in script for name in env_vars if name != "PYTHON")  # knobs it reads
        knobs = {k: v for k, v in env_vars.items() if k != "PYTHON"}  # the image's; here this venv's
        fake = subprocess.run(command, env=launch_env(**knobs, RANK="2", MASTER_ADDR="master-0", MASTER_PORT="23456",
                                                      DRY_RUN="1"),
                              cwd=ROOT, capture_output=True, text=True, timeout=120)
        assert fake.returncode == 0, fake.stderr
        assert "--nnodes 3 --nproc-per-node 2" in fake.stdout and "--rdzv-endpoint master-0:23456" in fake.stdout
        assert fake.stdout.strip().endswith(
            r"hydra.run.dir=/shared/runs/l7b-a parallel.tp=2 model.name=a\ b train.global_batch_size=12")
        mounts = {m["name"]: m["mountPath"] for m in container["volumeMounts"]}
        assert mounts == {"shared": "/shared", "shm": "/dev/shm"}
        assert pod["volumes"][0]["persistentVolumeClaim"]["claimName"] == "runs"
    refusal = subprocess.run([str(ROOT / "launch/kubernetes.sh")], env=launch_env(PVC="runs"), capture_output=True,
                             text=True, timeout=60)
    assert refusal.returncode == 2 and refusal.stderr.startswith("error: set IMAGE="), refusal.stderr


def test_image_tag_is_the_same_in_dockerfile_and_docker_sh():
    dockerfile = re.search(r"^ARG NGC_TAG=(\S+)$", (ROOT / "Dockerfile").read_text(), re.M).group(1)
    script = re.search(r'^NGC_TAG="\$\{NGC_TAG:-(\S+)\}"$', (ROOT / "launch/docker.sh").read_text(), re.M).group(1)
    assert dockerfile == script


@pytest.mark.skipif(shutil.which("shellcheck") is None,
                    reason="shellcheck not installed (apt-get install shellcheck)")
def test_shellcheck_is_clean():
    scripts = sorted(str(p) for p in (ROOT / "launch").iterdir() if p.suffix in (".sh", ".sbatch"))
    scripts += sorted(str(p) for p in ROOT.glob("tools/*.sh"))
    done = subprocess.run(["shellcheck", "-S", "warning", "-x", *scripts], cwd=ROOT, capture_output=True, text=True)
    assert done.returncode == 0, done.stdout


def two_nodes(args: list[str], env: dict, extra=lambda rank: {}) -> tuple[list[int], list[str]]:
    """`args` as node 0 and node 1 at once (env, NODE_RANK and extra(rank)): their exit codes and outputs."""
    nodes = [subprocess.Popen(args, env={**env, "NODE_RANK": str(rank), **extra(rank)}, stdout=subprocess.PIPE,
                              stderr=subprocess.STDOUT, text=True) for rank in (0, 1)]
    try:
        outputs = [node.communicate(timeout=300)[0] for node in nodes]
    finally:
        for node in nodes:
            node.kill()
    return [node.returncode for node in nodes], outputs


@pytest.mark.slow
def test_two_nodes_on_one_machine_train_together(tmp_path):
    """Two launch/multinode.sh processes (NPROC=1 each) meet at a c10d rendezvous and train as dp=2."""
    env = launch_env(NNODES="2", MASTER_ADDR="127.0.0.1", MASTER_PORT=str(free_port()), NPROC="1",
                     RUN_DIR=str(tmp_path / "run"), LOCAL_ADDR="127.0.0.1")
    args = [str(ROOT / "launch/multinode.sh"), "train.iters=4", "checkpoint=none", *TINY_RUN]
    codes, outputs = two_nodes(args, env)
    assert codes == [0, 0], "\n".join(outputs)
    assert "world 2 = tp 1 x pp 1 x dp 2" in "".join(outputs)
    assert len((tmp_path / "run/metrics.jsonl").read_text().splitlines()) == 4
    # each node's own log holds what it printed once its config check passed (rank 0 may be on either node)
    logs = [(tmp_path / f"run/logs/node{rank}.log").read_text() for rank in (0, 1)]
    assert all(output.endswith(log) for output, log in zip(outputs, logs))
    assert sum(log.count("\n iter ") for log in logs) == 4, logs
    assert (tmp_path / "run/flight_recorder").is_dir()  # NCCL's dumps on a timeout land beside the run

    # a node started with another NPROC (valid at both its world sizes): torchrun makes a world of 3 that no node
    # checked; every rank refuses it. Node 0 hosts the store: its exit ends node 1's torchrun too (whose ranks may
    # be stopped before their line on a loaded machine: then its summary says node 0's torchrun ended)
    env["MASTER_PORT"] = str(free_port())
    codes, outputs = two_nodes([*args, "train.global_batch_size=8"], env, lambda rank: {"NPROC": str(rank + 1)})
    assert codes[0] == 2 and codes[1] != 0, "\n".join(outputs)
    for rank, output in enumerate(outputs):
        assert (f"the job has 3 processes but the launcher checked the config for {2 * (rank + 1)} (NNODES x NPROC; "
                f"this node runs {rank + 1}): start every node with the same NPROC") in output or (
            rank == 1 and "node 0's torchrun ended" in output), output


SLURM_FAKES = ROOT / "tests" / "fixtures" / "fake_slurm"  # srun, scancel (every process of the step), scontrol, squeue
SAVE_FAULTS = ROOT / "tests" / "fixtures" / "save_faults"  # SAVE_FAULT=hold:<rank>:<glob>: the save waits for a file
SLURM_RUN = [*QUICK, "train.iters=4", "train.save_interval=1"]


def slurm_job(tmp_path: Path, env: dict, name: str, **extra: str) -> tuple[int, str]:
    """launch/slurm.sbatch under the fake SLURM (job 77, one node, NPROC=1), to the end: (exit code, output)."""
    with (tmp_path / f"{name}.log").open("w+") as log:
        job = subprocess.Popen([str(ROOT / "launch/slurm.sbatch"), *SLURM_RUN], env={**env, **extra}, stdout=log,
                               stderr=subprocess.STDOUT, text=True)
        if name == "signalled":  # rank 0 inside the save of iteration 2: the pre-timeout SIGUSR1 to the batch script,
            for path in (tmp_path / "hold", tmp_path / "scancel.log"):  # its scancel: to every process of the step
                deadline = time.monotonic() + 300
                while not path.exists():
                    assert job.poll() is None and time.monotonic() < deadline, Path(log.name).read_text()[-3000:]
                    time.sleep(0.2)
                job.send_signal(signal.SIGUSR1) if path.name == "hold" else (tmp_path / "hold.release").touch()
        code = job.wait(timeout=300)  # (released: the save goes on; the ranks stop after it)
        log.seek(0)
        return code, log.read()


@pytest.mark.slow
def test_slurm_stops_save_requeue_and_the_requeued_jobs_equal_an_uninterrupted_run(tmp_path):
    """Job 77 three times, as SLURM would run it: (1) the pre-timeout SIGUSR1 to the batch script (--signal=B:USR1)
    while rank 0 saves iteration 2; its scancel signals every process of the step (the launch script, its tee and
    filters, torchrun, the rank): the run stops after that save, exit 0, the job requeues; (2) the requeued job
    (same SLURM_JOB_ID, so the same RUN_DIR) resumes at 2 under a job end time within EXIT_MARGIN (squeue's): it
    trains iteration 3, stops at its save deadline, saves, and requeues itself; (3) resumes at 3, trains 4, ends:
    no requeue. The losses and grad norms of 1..4 equal an uninterrupted launch/train.sh run's, bit for bit."""
    reference = subprocess.Popen(["launch/train.sh", *SLURM_RUN], cwd=ROOT, stdout=subprocess.PIPE, text=True,
                                 stderr=subprocess.STDOUT, env=launch_env(NPROC="1", RUN_DIR=str(tmp_path / "ref")))
    env = launch_env(PATH=f"{SLURM_FAKES}:{os.environ['PATH']}", FAKE_SLURM=str(tmp_path), SLURM_JOB_ID="77",
                     SLURM_NNODES="1", SLURM_NODEID="0", SLURM_SUBMIT_DIR=str(ROOT), MASTER_ADDR="127.0.0.1",
                     MASTER_PORT=str(free_port()), NPROC="1", RUN_DIR=str(tmp_path / "run"), LOCAL_ADDR="127.0.0.1")
    try:
        code, out = slurm_job(tmp_path, env, "signalled", PYTHONPATH=f"{SAVE_FAULTS}:{ROOT / 'tests'}",
                              SAVE_FAULT="hold:0:*/iter_0000002/.metadata*", SAVE_FAULT_MARKER=str(tmp_path / "hold"))
        assert code == 0 and "stopping at iteration 2: received SIGUSR1" in out, out[-4000:]
        assert (tmp_path / "scontrol.log").read_text() == "requeue 77\n"
        now = time.strftime("%Y-%m-%dT%H:%M:%S")  # squeue's EndTime: the job ends now, within EXIT_MARGIN
        code, out = slurm_job(tmp_path, env, "deadline", FAKE_END_TIME=now)
        assert code == 0 and "start at iteration 2 " in out, out[-4000:]
        assert "warning: the job ends within EXIT_MARGIN=600 s: the run stops after one step" in out, out[-4000:]
        assert re.search(r"^stopping at iteration 3: the job's time limit is near", out, re.M), out[-4000:]
        assert (tmp_path / "scontrol.log").read_text() == "requeue 77\n" * 2  # requeued at the deadline
        code, out = slurm_job(tmp_path, env, "last")
        assert code == 0 and "start at iteration 3 " in out, out[-4000:]
        assert (tmp_path / "scontrol.log").read_text() == "requeue 77\n" * 2  # finished: no third requeue
        ref_out = reference.communicate(timeout=300)[0]
    finally:
        reference.kill()
    assert reference.returncode == 0, ref_out[-4000:]
    records, ref = ([json.loads(line) for line in (tmp_path / run / "metrics.jsonl").read_text().splitlines()]
                    for run in ("run", "ref"))
    assert [r["iteration"] for r in records] == [1, 2, 3, 4]  # each iteration trained once, across three jobs
    assert [(r["loss"], r["grad_norm"], r["lr"]) for r in records] == [(r["loss"], r["grad_norm"], r["lr"])
                                                                       for r in ref]
    assert sorted(p.name for p in (tmp_path / "run/checkpoints").glob("iter_*"))[-1] == "iter_0000004"


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the refusal without a GPU")
def test_gpu_check_refuses_without_a_gpu(tmp_path):
    done = subprocess.run(["tools/gpu_check.sh"], cwd=ROOT, capture_output=True, text=True, timeout=120,
                          env={**os.environ, "OUT": str(tmp_path / "check")})
    assert done.returncode == 2
    assert done.stderr.strip().startswith("error: no CUDA GPU is visible") and "make test" in done.stderr
