"""How launch/train.sh ends, as the user sees it (docs/faults.md): a user's error found while training (a NaN
with train.nan_policy=stop) ends with that `error:` line and one summary line naming the rank that failed first,
the run dir given by hydra.run.dir and the checkpoint to resume from, exit 2; a SIGTERM to the launch script, to
torchrun alone, or to every process of the job at once (what SLURM does on preemption or scancel), stops with a
checkpoint, one line naming it, exit 0. Never torchrun's ChildFailedError report or a traceback. The jobs run at
once (a 2-core machine starts them about as fast as one after another) and each waits on files, never on a fixed sleep.
Two fast cases feed the launcher a recorded torchrun report from a stand-in: the races a real run cannot force
(a rank's error followed by a peer's traceback; a killed rank that torchrun did not see fail first).
"""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import psutil
import pytest
from runs import QUICK, losses

ROOT = Path(__file__).resolve().parents[1]
DEADLINE = 300  # seconds for a job to start training, and again to end: generous on a loaded 2-core machine
FAULTY_NAN = dict(FAULT="nan", FAULT_AT="5")  # tests/blocks.py: a NaN gradient in step 2 (4 MLP forwards a step)
NAN_STOP = ["model.mlp=blocks:FaultyMLP", "train.nan_policy=stop", "train.iters=3", "train.save_interval=1"]
ENDLESS = ["train.iters=100000"]
AGENT = "W1202 07:12:25.561000 29926 torch/distributed/elastic/multiprocessing/api.py"
TORCHRUN_TRACEBACK = """Traceback (most recent call last):
  File "<frozen runpy>", line 198, in _run_module_as_main
  File "<frozen runpy>", line 88, in _run_code
  File "/venv/lib/python3.12/site-packages/torch/distributed/run.py", line 1142, in <module>
    main()
  File "/venv/lib/python3.12/site-packages/torch/distributed/launcher/api.py", line 386, in launch_agent
    raise ChildFailedError(
torch.distributed.elastic.multiprocessing.errors.ChildFailedError: 
============================================================
train.py FAILED
------------------------------------------------------------
Failures:
[1]:
  time      : 2026-12-02_07:12:25
  host      : localhost
  rank      : {other} (local_rank: {other})
  exitcode  : {other_code} (pid: 30076) {other_signal}
  error_file: <N/A>
  traceback : Signal 15 (SIGTERM) received by PID 30076
------------------------------------------------------------
Root Cause (first observed failure):
[0]:
  time      : 2026-12-02_07:12:25
  host      : localhost
  rank      : {root} (local_rank: {root})
  exitcode  : {root_code} (pid: 30075)
  error_file: <N/A>
  traceback : To enable traceback see: https://pytorch.org/docs/stable/elastic/errors.html
============================================================
"""  # torch 2.14's report when a rank failed, as its output has it


WORKER_TRACEBACK = """Traceback (most recent call last):
  File "/work/main/train.py", line 37, in <module>
    main()
RuntimeError: [../third_party/gloo/gloo/transport/tcp/pair.cc:534] Connection closed by peer [127.0.0.1]:51814
"""


def fake_torchrun(tmp_path: Path, stdout: str, stderr: str, status: int) -> subprocess.CompletedProcess:
    """launch/common.sh's run_or_print around a stand-in for torchrun that prints what torchrun and its ranks
    printed and exits with torchrun's status: the summary from a known report, in a second."""
    (tmp_path / "out").write_text(stdout)
    (tmp_path / "err").write_text(stderr)
    script = 'source launch/common.sh; run_or_print bash -c \'cat "$OUT"; cat "$ERR" >&2; exit "$STATUS"\''
    env = dict(os.environ, OUT=str(tmp_path / "out"), ERR=str(tmp_path / "err"), STATUS=str(status),
               RUN_DIR=str(tmp_path / "default"), RESUME_CMD="launch/train.sh x=1")
    return subprocess.run(["bash", "-c", script], cwd=ROOT, env=env, capture_output=True, text=True, timeout=60)


def test_a_ranks_error_is_the_last_word_before_one_line_naming_that_rank(tmp_path):
    """Rank 0 exits 2 with its error; torchrun stops rank 1 (-15) after its traceback (a broken connection)."""
    error = "error: sample 7 of data/x holds token id 9999, beyond the vocabulary (384)"
    stderr = (f"{error}\n{AGENT}:1028] Sending process 30076 closing signal SIGTERM\n{WORKER_TRACEBACK}"
              f"{AGENT}:1002] failed (exitcode: 2) local_rank: 0 (pid: 30075) of binary: python\n" +
              TORCHRUN_TRACEBACK.format(other=1, other_code=-15, other_signal=" (SIGTERM)", root=0, root_code=2))
    done = fake_torchrun(tmp_path, "", stderr, 1)
    assert done.returncode == 2, done.stderr
    assert done.stderr.splitlines()[-2:] == [
        error, f"error: training failed: rank 0 exited with code 2 (the user's error, above), the first to fail, "
               f"after 0 of MAX_RESTARTS=0 restart(s); run dir {tmp_path}/default; the newest checkpoint: none in "
               f"{tmp_path}/default/checkpoints"]  # no checkpoint: no command to resume
    assert WORKER_TRACEBACK in done.stderr  # a rank's own traceback is shown, torchrun's report is not
    for noise in ("ChildFailedError", "run.py", "closing signal", "failed (exitcode", "-15"):
        assert noise not in done.stderr


def test_a_killed_rank_is_blamed_not_the_peer_torchrun_saw_first(tmp_path):
    """torchrun's "first observed" is rank 0 (exit 1: its peer vanished); rank 1 was SIGKILLed (OOM killer)."""
    run_dir, checkpoints = tmp_path / "run", tmp_path / "elsewhere"
    checkpoints.mkdir()
    (checkpoints / "latest").write_text("iter_0000004")
    run_dir.mkdir()
    (run_dir / "config.yaml").write_text(f"model:\n  dir: x\ncheckpoint:\n  dir: {checkpoints}\n  load: auto\n")
    stderr = WORKER_TRACEBACK + TORCHRUN_TRACEBACK.format(other=1, other_code=-9, other_signal=" (SIGKILL)", root=0,
                                                          root_code=1)
    done = fake_torchrun(tmp_path, f"run dir: {run_dir}\n iter 5\n", stderr, 1)
    assert done.returncode == 1, done.stderr
    assert done.stderr.splitlines()[-1] == (
        f"error: training failed: rank 1 exited with code -9 (killed by signal 9), the first to fail, after 0 of "
        f"MAX_RESTARTS=0 restart(s); run dir {run_dir}; the newest checkpoint: {checkpoints}/iter_0000004; resume "
        f"with: RUN_DIR={run_dir} launch/train.sh x=1")  # the run dir rank 0 reported, the config's checkpoint.dir


def launch(tmp_path: Path, name: str, overrides: list[str], **env: str) -> tuple[subprocess.Popen, Path, Path]:
    """launch/train.sh with RUN_DIR=<tmp>/default but hydra.run.dir=<tmp>/<name>: the override must win."""
    run_dir, log = tmp_path / name, tmp_path / f"{name}.log"
    environment = {k: v for k, v in os.environ.items() if not k.startswith(("SLURM_", "RUN_", "MASTER_", "NPROC"))}
    environment.update(PYTHON=sys.executable, NPROC="2", RUN_DIR=str(tmp_path / "default"),
                       PYTHONPATH=str(ROOT / "tests"), **env)
    with log.open("w") as out:  # a file, not a pipe: nothing blocks however much the job prints
        job = subprocess.Popen(["launch/train.sh", *QUICK, *overrides, f"hydra.run.dir={run_dir}"], cwd=ROOT,
                               env=environment, stdout=out, stderr=subprocess.STDOUT, text=True,
                               start_new_session=True)  # its own process group, as a batch job step has
    return job, run_dir, log


def wait_until_training(job: subprocess.Popen, run_dir: Path, log: Path) -> None:
    """Until metrics.jsonl has a line: every rank has installed its stop handler by then."""
    metrics, deadline = run_dir / "metrics.jsonl", time.monotonic() + DEADLINE
    while not (metrics.exists() and metrics.read_text().strip()):
        assert job.poll() is None and time.monotonic() < deadline, log.read_text()[-3000:]
        time.sleep(0.5)


def torchrun_of(job: subprocess.Popen) -> psutil.Process:
    """The launch script's child that runs torch.distributed.run."""
    return next(p for p in psutil.Process(job.pid).children() if "torch.distributed.run" in p.cmdline())


def finish(job: subprocess.Popen, log: Path) -> tuple[int, str]:
    try:
        code = job.wait(timeout=DEADLINE)
    finally:
        if job.poll() is None:
            os.killpg(job.pid, signal.SIGKILL)
    return code, log.read_text()


@pytest.fixture(scope="module")
def jobs(tmp_path_factory):
    """{case: (exit code, output, run dir, the launch command's overrides)} of the four jobs, run at once."""
    tmp = tmp_path_factory.mktemp("summary")
    started = {"error": launch(tmp, "error", NAN_STOP, **FAULTY_NAN), "launcher": launch(tmp, "launcher", ENDLESS),
               "torchrun": launch(tmp, "torchrun", ENDLESS), "job": launch(tmp, "job", ENDLESS)}
    overrides = {"error": NAN_STOP, "launcher": ENDLESS, "torchrun": ENDLESS, "job": ENDLESS}
    try:
        for case in ("launcher", "torchrun", "job"):
            wait_until_training(*started[case])
        started["launcher"][0].send_signal(signal.SIGTERM)  # the launch script alone (a person, Kubernetes)
        torchrun_of(started["torchrun"][0]).send_signal(signal.SIGTERM)  # torchrun alone
        job = started["job"][0]
        tree = psutil.Process(job.pid).children(recursive=True)
        os.killpg(job.pid, signal.SIGTERM)  # the launch script's process group, then every process of the job
        for process in tree:
            try:
                process.send_signal(signal.SIGTERM)
            except psutil.NoSuchProcess:
                pass
        results = {case: (*finish(proc, log), run_dir, overrides[case])
                   for case, (proc, run_dir, log) in started.items()}
    finally:
        for job, _, _ in started.values():
            if job.poll() is None:
                os.killpg(job.pid, signal.SIGKILL)
    return results, tmp


def resume_command(run_dir: Path, overrides: list[str]) -> str:
    return f"RUN_DIR={run_dir} launch/train.sh {' '.join([*QUICK, *overrides, f'hydra.run.dir={run_dir}'])}"


def assert_no_torchrun_report(output: str, tmp: Path) -> None:
    for noise in ("Traceback", "ChildFailedError", "SignalException", "closing signal", "exited with code -15",
                  str(tmp / "default")):  # nor the RUN_DIR that hydra.run.dir overrode
        assert noise not in output, output[-4000:]


def test_a_users_error_while_training_is_the_last_word_exit_2(jobs):
    results, tmp = jobs
    code, output, run_dir, overrides = results["error"]
    assert code == 2, output[-4000:]
    lines = output.strip().splitlines()
    assert lines[-2].startswith("error: the gradients are not finite (NaN/Inf) on ranks 0, 1"), lines[-3:]
    assert "stopping (train.nan_policy=stop) before the update" in lines[-2]
    summary = re.fullmatch(r"error: training failed: rank ([01]) exited with code 2 \(the user's error, above\), the "
                           r"first to fail, after 0 of MAX_RESTARTS=0 restart\(s\); run dir (\S+); the newest "
                           r"checkpoint: (\S+); resume with: (.*)", lines[-1])
    assert summary, lines[-1]
    assert summary.group(2) == str(run_dir) and summary.group(3) == f"{run_dir}/checkpoints/iter_0000001"
    assert summary.group(4) == resume_command(run_dir, overrides)
    assert (run_dir / "checkpoints" / "latest").read_text().strip() == "iter_0000001"
    assert_no_torchrun_report(output, tmp)
    assert not (tmp / "default").exists()


@pytest.mark.parametrize("case", ["launcher", "torchrun", "job"])
def test_sigterm_to_torchrun_or_to_the_whole_job_stops_with_a_checkpoint_exit_0(jobs, case):
    """`launcher`: SIGTERM to the launch script alone (it relays it to the ranks); `torchrun`: to torchrun alone;
    `job`: to the launch script's process group and to every process of the job at once, torchrun and the ranks
    included (SLURM's preemption). The checkpoint is at the last iteration trained."""
    results, tmp = jobs
    code, output, run_dir, overrides = results[case]
    assert code == 0, output[-4000:]
    latest = (run_dir / "checkpoints" / "latest").read_text().strip()
    stopped_at = int(latest.removeprefix("iter_"))
    assert stopped_at == max(losses(run_dir))  # the checkpoint is at the last iteration trained
    assert re.search(rf"^stopping at iteration {stopped_at}: (received SIGTERM|a peer rank received a stop "
                     rf"signal)$", output, re.M), output[-4000:]
    assert output.strip().splitlines()[-1] == (f"stopped by SIGTERM at iteration {stopped_at}: checkpoint "
                                               f"{run_dir}/checkpoints/{latest} saved; resume with: "
                                               f"{resume_command(run_dir, overrides)}")
    assert_no_torchrun_report(output, tmp)
