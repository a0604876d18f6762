"""Surviving faults: a killed rank restarts the job (MAX_RESTARTS) and resumes exactly; a NaN gradient on one
rank never reaches the weights (stop or skip, on every rank alike); a stalled rank is named by the watchdog
and no rank hangs; a save failing on one rank never becomes latest, and every rank names that rank; a checkpoint
whose pickles would run code is refused.
(Signals to the launcher, torchrun or the whole job, and a save failing on rank 0 alone mid-save:
tests/test_launch_summary.py; bad data: tests/test_data.py, tests/test_user_inputs.py.)"""

import json
import os
import re
import signal
import subprocess
import time
from pathlib import Path

import pytest
from harness import run_distributed
from runs import QUICK, assert_only_skipped_steps_leave_everything, losses, train_catching, train_watching_steps

ROOT = Path(__file__).resolve().parents[1]
FAULTY = ["model.mlp=blocks:FaultyMLP"]
# 4 training forwards of the MLP a step per rank (2 layers x 2 micro-batches at DP2): the 13th is in step 4
IN_STEP_4 = "13"


def launch(run_dir: Path, *overrides: str, **env) -> subprocess.Popen:
    environment = dict(os.environ, NPROC="2", RUN_DIR=str(run_dir), PYTHONPATH=str(ROOT / "tests"), **env)
    return subprocess.Popen(["launch/train.sh", *QUICK, *overrides], cwd=ROOT, env=environment, text=True,
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT)


def wait_for_lines(metrics: Path, count: int, timeout: float = 240) -> None:
    deadline = time.monotonic() + timeout
    while not (metrics.exists() and len(metrics.read_text().splitlines()) >= count):
        assert time.monotonic() < deadline, f"no {count} lines in {metrics}"
        time.sleep(0.2)


def workers(run_dir: Path) -> list[int]:
    import psutil

    return [p.pid for p in psutil.process_iter(["cmdline"])
            if (cmd := p.info["cmdline"] or []) and "-u" in cmd and f"hydra.run.dir={run_dir}" in cmd]


def last_losses(run_dir: Path) -> dict[int, float]:
    """The last logged loss of each iteration (a restarted run logs the iterations after its checkpoint again)."""
    out = {}
    for line in (run_dir / "metrics.jsonl").read_text().splitlines():
        record = json.loads(line)
        if "loss" in record:
            out[record["iteration"]] = record["loss"]
    return out


RESTART = ["train.iters=20", "train.save_interval=4", "checkpoint.keep=0"]


def test_a_killed_rank_restarts_the_job_which_resumes_exactly(tmp_path):
    full = launch(tmp_path / "full", *RESTART)
    killed = launch(tmp_path / "killed", *RESTART, MAX_RESTARTS="1")
    wait_for_lines(tmp_path / "killed" / "metrics.jsonl", 10)
    os.kill(max(workers(tmp_path / "killed")), signal.SIGKILL)  # one rank dies between checkpoints
    output, _ = killed.communicate(timeout=600)
    assert killed.returncode == 0, output[-3000:]
    assert full.wait(timeout=600) == 0
    records = [json.loads(line) for line in (tmp_path / "killed" / "metrics.jsonl").read_text().splitlines()]
    assert {r["restarts"] for r in records} == {0, 1}  # the restart count is in the metrics
    resumed_at = re.search(r"restart 1 \(launch MAX_RESTARTS\): resumed at iteration (\d+)", output)
    assert resumed_at and int(resumed_at.group(1)) % 4 == 0, output[-3000:]  # from the newest checkpoint
    resumed = last_losses(tmp_path / "killed")
    assert sorted(resumed) == list(range(1, 21)) and resumed == last_losses(tmp_path / "full")  # bit for bit


def test_without_restarts_the_failure_names_the_dead_rank(tmp_path):
    """The rank killed is one that saved: its helper processes (dist_checkpointing's write-results Manager and the
    resource tracker, training/shims/upstream_fixes.py fix 4) die with it, and the launcher's output ends."""
    import psutil

    job = launch(tmp_path, "train.iters=100000", "train.save_interval=2")
    wait_for_lines(tmp_path / "metrics.jsonl", 3)
    assert (tmp_path / "checkpoints" / "latest").exists()  # iteration 2's save ended before iteration 3 was logged
    helpers = {pid: psutil.Process(pid).children() for pid in workers(tmp_path)}
    writer = next(pid for pid, children in helpers.items() if children)  # the rank that wrote shards
    os.kill(writer, signal.SIGKILL)
    _, alive = psutil.wait_procs(helpers[writer], timeout=60)
    left = [" ".join(process.cmdline())[:100] for process in alive]
    for process in alive:
        process.kill()
    assert not left, f"the killed rank's helpers outlived it: {left}"
    output, _ = job.communicate(timeout=300)
    assert job.returncode != 0
    summary = output.strip().splitlines()[-1]
    where = re.escape(str(tmp_path))
    assert re.fullmatch(rf"error: training failed: rank [01] exited with code -9 \(killed by signal 9: kill -9, or the "
                        rf"kernel's out-of-memory killer, which dmesg names\), the first to fail, after 0 of "
                        rf"MAX_RESTARTS=0 restart\(s\); run dir {where}; the newest checkpoint: "
                        rf"{where}/checkpoints/iter_\d+; resume with: .*", summary), summary


NAN = FAULTY + ["train.iters=6", "train.save_interval=2", "checkpoint.keep=0"]


@pytest.mark.parametrize("policy", ["stop", "skip"])
def test_a_nan_gradient_on_one_rank_never_reaches_the_weights(policy, tmp_path, monkeypatch):
    monkeypatch.setenv("FAULT", "nan")
    monkeypatch.setenv("FAULT_AT", IN_STEP_4)
    ranks = run_distributed(train_watching_steps, 2, (QUICK + NAN + [f"train.nan_policy={policy}"], str(tmp_path)),
                            timeout=300)
    results = [result for result, _ in ranks]
    checkpoints = tmp_path / "checkpoints"
    records = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    if policy == "stop":
        assert results[0] == results[1] and results[0].startswith(
            "error: the gradients are not finite (NaN/Inf) on ranks 0, 1"), results  # spread by the DP all-reduce
        assert "at this step: stopping (train.nan_policy=stop) before the update" in results[0]
        assert [r["iteration"] for r in records] == [1, 2, 3]
        assert (checkpoints / "latest").read_text().strip() == "iter_0000002"  # nothing saved after it
        assert sorted(p.name for p in checkpoints.glob("iter_*")) == ["iter_0000002"]
    else:
        assert results == ["finished", "finished"]
        assert [r["iteration"] for r in records] == [1, 2, 3, 4, 5, 6]
        assert records[3]["grad_norm"] is None and records[3]["skipped"] == 1  # step 4: no update anywhere
        for _, steps in ranks:  # step 4 leaves the weights, Adam's state and the lr schedule bit-identical
            assert [s["skipped"] for s in steps] == [False, False, False, True, False, False]
            assert_only_skipped_steps_leave_everything(steps)
        assert all(r["grad_norm"] is not None and r["grad_norm"] == r["grad_norm"] for i, r in enumerate(records)
                   if i != 3)
        assert all(0 < r["loss"] < 10 for r in records)  # finite: the weights never took the NaN
        assert (checkpoints / "latest").read_text().strip() == "iter_0000006"


def test_a_stalled_rank_is_named_and_no_rank_hangs(tmp_path):
    start = time.monotonic()
    job = launch(tmp_path, *FAULTY, "train.iters=100000", "train.watchdog_factor=3", "train.watchdog_min_seconds=3",
                 FAULT="stall", FAULT_AT=IN_STEP_4)
    output, _ = job.communicate(timeout=300)
    assert job.returncode != 0 and time.monotonic() - start < 240
    assert re.search(r"watchdog: rank 1 stalled in the step of step 4: [0-9.]+ s, over its limit of 3.0 s", output)
    assert re.search(r"watchdog: rank 0 stalled in the step of step 4", output)  # waiting for rank 1
    # rank 1's stacks, in its file (the console's copy may be cut short when torchrun stops the other ranks)
    stacks = (tmp_path / "watchdog" / "rank1.txt").read_text()
    assert re.search(r'File ".*tests/blocks.py", line \d+ in forward', stacks), stacks
    assert "exited with code 3" in output.strip().splitlines()[-1]


def _save_failing(overrides: list[str], run_dir: str) -> str:
    """Train with rank 1's shard writes failing as on a full disk (ENOSPC at fsync) from the second save on;
    rank 0's writes succeed."""
    import errno

    real = os.fsync

    def fsync(fd):
        path = os.readlink(f"/proc/self/fd/{fd if isinstance(fd, int) else fd.fileno()}")
        if os.environ["RANK"] == "1" and "/iter_" in path and "/iter_0000002/" not in path:
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
        return real(fd)

    os.fsync = fsync
    return train_catching(overrides, run_dir)


@pytest.mark.parametrize("policy", ["stop", "warn"])
def test_a_save_failing_on_one_rank_never_becomes_latest_and_names_the_rank(policy, tmp_path):
    """Megatron-Core's writer hides the cause of a failed shard write (it raises on every rank alike, only the
    failing rank logs why): every rank says the same line naming rank 1 and its error."""
    overrides = QUICK + ["parallel.tp=2", "train.iters=6", "train.save_interval=2",
                         f"checkpoint.on_save_error={policy}"]  # tp 2: rank 1 writes shards of its own
    results = run_distributed(_save_failing, 2, (overrides, str(tmp_path)), timeout=300)
    checkpoints = tmp_path / "checkpoints"
    assert (checkpoints / "latest").read_text().strip() == "iter_0000002"
    assert sorted(p.name for p in checkpoints.glob("iter_*")) == ["iter_0000002"]  # the failed ones removed
    if policy == "stop":
        assert results[0] == results[1] == (
            f"error: saving checkpoint {checkpoints}/iter_0000004 failed on rank 1 ([Errno 28] No space left on "
            f"device); latest stays iter_0000002: stopping (checkpoint.on_save_error=stop; =warn trains on)")
        assert max(losses(tmp_path)) == 4
    else:
        assert results == ["finished", "finished"] and max(losses(tmp_path)) == 6


class _Payload:
    """Unpickling this runs code: it writes a file (a stand-in for anything an attacker would run)."""

    def __init__(self, marker: str):
        self.marker = marker

    def __reduce__(self):
        return (Path.write_text, (Path(self.marker), "pwned"))


def _plant_and_load(run_dir: str, marker: str) -> str:
    """Save a checkpoint whose RNG state is a payload object, then resume from it."""
    from runs import _train

    from training.checkpoint import rng

    real = rng.get_state
    rng.get_state = lambda: {**real(), "payload": _Payload(marker)}
    _train(QUICK + ["train.iters=2"], run_dir)
    rng.get_state = real
    return train_catching(QUICK + ["train.iters=4"], run_dir)


def test_a_checkpoint_that_would_run_code_is_refused(tmp_path):
    marker = tmp_path / "pwned"
    (result,) = run_distributed(_plant_and_load, 1, (str(tmp_path / "run"), str(marker)), timeout=300)
    assert result.startswith(f"error: cannot load checkpoint {tmp_path}/run/checkpoints/iter_0000002: "
                             f"UnsafeCheckpoint: the checkpoint holds a pickled object that is not plain data"), result
    assert not marker.exists(), "loading the checkpoint ran its code"


def test_sigint_and_a_second_signal_only_set_the_stop_flag():
    """Ctrl-C to `python train.py` (or to torchrun started by hand, which relays it) stops like SIGTERM: at the
    next step boundary, with a checkpoint; a second signal (during the save at the stop) raises nothing."""
    from types import SimpleNamespace

    from training.engine.stopping import HANDLED_SIGNALS, Stopper

    before = {sig: signal.getsignal(sig) for sig in HANDLED_SIGNALS}
    try:
        stopper = Stopper(SimpleNamespace(train=SimpleNamespace(exit_interval=0, exit_duration_minutes=0)))
        os.kill(os.getpid(), signal.SIGINT)
        os.kill(os.getpid(), signal.SIGTERM)  # no KeyboardInterrupt, no death
        assert stopper.should_stop(7) and stopper.reason == "received SIGINT"  # the first names the stop
        os.kill(os.getpid(), signal.SIGTERM)
        assert stopper.should_stop(8) and stopper.reason == "received SIGINT"
    finally:
        for sig, handler in before.items():
            signal.signal(sig, handler)
