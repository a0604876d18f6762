"""How launch/train.sh ends, as the user sees it (docs/faults.md): a user's error found while training (a NaN
with train.nan_policy=stop) ends with that `error:` line and one summary line naming the rank that failed first,
the run dir given by hydra.run.dir and the checkpoint to resume from, exit 2; a SIGTERM to torchrun alone, or to
every process of the job at once (what SLURM does on preemption or scancel), or Ctrl-C (SIGINT to the launch
script's process group) followed by a second signal to every process during the save at the stop, stops with a
checkpoint, one line naming it, exit 0. Never torchrun's ChildFailedError report or a traceback. A
save failing on rank 0 alone, between the save's collectives (its .metadata write: a full disk), stops every rank
within a minute (not parallel.timeout_minutes), names the rank and the error, exit 2, `latest` unchanged and
intact. The jobs run at once (a 2-core machine starts them about as fast as one after another) and each waits on
files, never on a fixed sleep; tests/fixtures/save_faults makes fsync fail or wait. The races a real run cannot
force: tests/test_launch_filter.py.
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
SAVE_FAULTS = ROOT / "tests" / "fixtures" / "save_faults"  # its sitecustomize.py: SAVE_FAULT=<fail|hold>:<rank>:<glob>
SAVE_FAILS = ["train.iters=6", "train.save_interval=2", "parallel.timeout_minutes=2"]  # before: stuck for 2 minutes
METADATA_4 = "fail:0:*/iter_0000004/.metadata*"  # rank 0's .metadata of iteration 4, written between collectives
ENOSPC = "OSError: [Errno 28] No space left on device"


def interruptible() -> None:
    """Ctrl-C's default disposition, as a terminal's foreground job has: a test run started in the background of a
    non-interactive shell (`make test &`) inherits SIGINT ignored, and a bash script cannot trap a signal ignored
    on entry (the launch script's Ctrl-C relay would never run)."""
    signal.signal(signal.SIGINT, signal.SIG_DFL)


def launch(tmp_path: Path, name: str, overrides: list[str], **env: str) -> tuple[subprocess.Popen, Path, Path]:
    """launch/train.sh with RUN_DIR=<tmp>/default but hydra.run.dir=<tmp>/<name>: the override must win."""
    run_dir, log = tmp_path / name, tmp_path / f"{name}.log"
    environment = {k: v for k, v in os.environ.items() if not k.startswith(("SLURM_", "RUN_", "MASTER_", "NPROC"))}
    environment.update(PYTHON=sys.executable, NPROC="2", RUN_DIR=str(tmp_path / "default"),
                       PYTHONPATH=str(ROOT / "tests"))
    environment.update(env)
    with log.open("w") as out:  # a file, not a pipe: nothing blocks however much the job prints
        job = subprocess.Popen(["launch/train.sh", *QUICK, *overrides, f"hydra.run.dir={run_dir}"], cwd=ROOT,
                               env=environment, stdout=out, stderr=subprocess.STDOUT, text=True,
                               start_new_session=True,  # its own process group, as a batch job step has
                               preexec_fn=interruptible)
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


def signal_every_process(job: subprocess.Popen, sig: int) -> None:
    """The launch script's process group, then every process of the job (SLURM's preemption or scancel)."""
    tree = psutil.Process(job.pid).children(recursive=True)
    os.killpg(job.pid, sig)
    for process in tree:
        try:
            process.send_signal(sig)
        except psutil.NoSuchProcess:
            pass


def wait_for(path: Path, job: subprocess.Popen, log: Path) -> None:
    deadline = time.monotonic() + DEADLINE
    while not path.exists():
        assert job.poll() is None and time.monotonic() < deadline, log.read_text()[-3000:]
        time.sleep(0.2)


def finish(started: dict) -> dict[str, tuple[int, str, float]]:
    """{case: (exit code, output, the time.time() it ended: its log's last write, the summary line; a job may end
    long before this starts waiting)}, waiting for every job at once."""
    ended, deadline = {}, time.monotonic() + DEADLINE
    while len(ended) < len(started) and time.monotonic() < deadline:
        for case, (job, _, log) in started.items():
            if case not in ended and job.poll() is not None:
                ended[case] = log.stat().st_mtime
        time.sleep(0.2)
    for job, _, _ in started.values():
        if job.poll() is None:
            os.killpg(job.pid, signal.SIGKILL)
    return {case: (job.wait(), log.read_text(), ended.get(case, float("inf")))
            for case, (job, _, log) in started.items()}


def save_fault(tmp: Path, name: str, fault: str) -> dict[str, str]:
    return dict(PYTHONPATH=f"{SAVE_FAULTS}:{ROOT / 'tests'}", SAVE_FAULT=fault,
                SAVE_FAULT_MARKER=str(tmp / f"{name}.fault"))


@pytest.fixture(scope="module")
def jobs(tmp_path_factory):
    """{case: (exit code, output, run dir, the launch command's overrides, the time it ended)} of the five jobs,
    run at once."""
    tmp = tmp_path_factory.mktemp("summary")
    overrides = {"error": NAN_STOP, "torchrun": ENDLESS, "job": ENDLESS, "ctrlc": ENDLESS, "savefail": SAVE_FAILS}
    env = {"error": FAULTY_NAN, "ctrlc": save_fault(tmp, "ctrlc", "hold:0:*/.metadata*"),  # hold the save at the stop
           "savefail": save_fault(tmp, "savefail", METADATA_4)}
    started = {case: launch(tmp, case, overrides[case], **env.get(case, {})) for case in overrides}
    try:
        for case in ("torchrun", "job", "ctrlc"):
            wait_until_training(*started[case])
        torchrun_of(started["torchrun"][0]).send_signal(signal.SIGTERM)  # torchrun alone
        signal_every_process(started["job"][0], signal.SIGTERM)
        ctrlc, _, ctrlc_log = started["ctrlc"]
        os.killpg(ctrlc.pid, signal.SIGINT)  # Ctrl-C: the terminal signals its foreground process group, the launch
        # script and its filters (torchrun runs in its own session); the launch script relays it to the ranks
        wait_for(tmp / "ctrlc.fault", ctrlc, ctrlc_log)  # rank 0 is inside the save at the stop (its shards written)
        signal_every_process(ctrlc, signal.SIGTERM)  # a second signal, to every process, during that save
        (tmp / "ctrlc.fault.release").touch()  # (sent before: pending when the save next looks for this file)
        ended = finish(started)
    finally:
        for job, _, _ in started.values():
            if job.poll() is None:
                os.killpg(job.pid, signal.SIGKILL)
    results = {case: (code, output, started[case][1], overrides[case], end)
               for case, (code, output, end) in ended.items()}
    return results, tmp


def resume_command(run_dir: Path, overrides: list[str]) -> str:
    return f"RUN_DIR={run_dir} launch/train.sh {' '.join([*QUICK, *overrides, f'hydra.run.dir={run_dir}'])}"


def assert_no_torchrun_report(output: str, tmp: Path) -> None:
    for noise in ("Traceback", "ChildFailedError", "SignalException", "closing signal", "exited with code -15",
                  str(tmp / "default")):  # nor the RUN_DIR that hydra.run.dir overrode
        assert noise not in output, output[-4000:]


def test_a_users_error_while_training_is_the_last_word_exit_2(jobs):
    results, tmp = jobs
    code, output, run_dir, overrides, _ = results["error"]
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


@pytest.mark.parametrize("case", ["ctrlc", "torchrun", "job"])
def test_a_signal_to_the_launcher_torchrun_or_the_whole_job_stops_with_a_checkpoint_exit_0(jobs, case):
    """`ctrlc`: SIGINT to the launch script's process group (Ctrl-C; it relays a stop to the ranks, as for a
    SIGTERM to the launch script alone), then, while rank 0 is inside the save at the stop, SIGTERM to every
    process; `torchrun`: SIGTERM to torchrun alone; `job`: to the launch script's process group and to every
    process of the job at once, torchrun and the ranks included (SLURM's preemption). The checkpoint is at the
    last iteration trained, complete, and `latest` names it."""
    results, tmp = jobs
    code, output, run_dir, overrides, _ = results[case]
    assert code == 0, output[-4000:]
    latest = (run_dir / "checkpoints" / "latest").read_text().strip()
    stopped_at = int(latest.removeprefix("iter_"))
    assert stopped_at == max(losses(run_dir))  # the checkpoint is at the last iteration trained
    assert {"run.json", "metadata.json"} <= {p.name for p in (run_dir / "checkpoints" / latest).iterdir()}  # complete
    first = "SIGINT" if case == "ctrlc" else "SIGTERM"  # the summary names the first signal
    assert re.search(rf"^stopping at iteration {stopped_at}: (received {first}|a peer rank received a stop "
                     rf"signal)$", output, re.M), output[-4000:]
    assert ("SIGTERM" if case == "ctrlc" else "SIGINT") not in output, output[-4000:]  # one signal name a stop
    assert output.strip().splitlines()[-1] == (f"stopped by {first} at iteration {stopped_at}: checkpoint "
                                               f"{run_dir}/checkpoints/{latest} saved; resume with: "
                                               f"{resume_command(run_dir, overrides)}")
    assert_no_torchrun_report(output, tmp)
    if case == "ctrlc":  # the second signal came while the save waited in rank 0's fsync of .metadata
        assert (tmp / "ctrlc.fault").read_text().split()[1] == f"{run_dir}/checkpoints/{latest}/.metadata.tmp"


def test_a_save_failing_on_rank_0_alone_stops_every_rank_within_a_minute(jobs):
    """Rank 0's .metadata write of iteration 4 fails (ENOSPC) while rank 1 waits in the save's next collective.
    Every rank stops within 60 s of the failure (it used to wait parallel.timeout_minutes), the last lines are
    rank 0's error and the summary, exit 2; `latest` stays iter_0000002, complete and intact (Megatron-Core's
    integrity manifest: every file's hash as saved; a complete, intact checkpoint loads: tests/test_checkpoint.py)."""
    from megatron.core.dist_checkpointing.validation import verify_integrity_manifest

    results, tmp = jobs
    code, output, run_dir, overrides, ended = results["savefail"]
    checkpoints = run_dir / "checkpoints"
    ((failed_at, path),) = [line.split() for line in (tmp / "savefail.fault").read_text().splitlines()]
    assert path == f"{checkpoints}/iter_0000004/.metadata.tmp", output[-4000:]
    assert ended - float(failed_at) < 60, output[-4000:]  # loosely: the old behaviour took 120 s or more
    assert code == 2, output[-4000:]
    assert output.strip().splitlines()[-2:] == [
        f"error: saving checkpoint {checkpoints}/iter_0000004 failed on rank 0 ({ENOSPC}); latest stays "
        f"iter_0000002: every rank stops (a failure on one rank inside the save's collectives cannot wait for "
        f"checkpoint.on_save_error=warn)",
        f"error: training failed: rank 0 exited with code 2 (the user's error, above), the first to fail, after 0 "
        f"of MAX_RESTARTS=0 restart(s); run dir {run_dir}; the newest checkpoint: {checkpoints}/iter_0000002; "
        f"resume with: {resume_command(run_dir, overrides)}"]
    assert (checkpoints / "latest").read_text().strip() == "iter_0000002"
    assert sorted(p.name for p in checkpoints.glob("iter_*")) == ["iter_0000002"]  # the failed save removed
    assert {"run.json", "metadata.json"} <= {p.name for p in (checkpoints / "iter_0000002").iterdir()}
    verify_integrity_manifest(str(checkpoints / "iter_0000002"))
    for noise in ("ChildFailedError", "SignalException", "closing signal"):
        assert noise not in output, output[-4000:]
