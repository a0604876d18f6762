"""When to stop early (train.exit_interval, train.exit_duration_minutes, SIGTERM / SIGUSR1) and when a
save is due (train.save_interval, train.save_interval_minutes).

A signal only sets a flag (SLURM sends SIGUSR1 before the time limit, schedulers send SIGTERM on
preemption, Ctrl-C sends SIGINT to a terminal's foreground processes: `python train.py`, or torchrun started
by hand, which relays it to its ranks); at the next step boundary every rank agrees (MAX all-reduce of the
flag), the loop saves a checkpoint and exits 0. A second signal, also one arriving during that save, only
sets the flag again: the save finishes and `latest` names it (SIGKILL stops at once; `latest` then still
names the previous complete checkpoint). Clocks differ across ranks, so a timed save is decided the same way.
A launcher that knows when the job will be killed (launch/slurm.sbatch: the job's end time less EXIT_MARGIN)
exports that moment as LAUNCH_DEADLINE (seconds since the epoch): the run stops and saves once it passed.
"""

from __future__ import annotations

import os
import signal
import time

import torch
import torch.distributed as dist

from training.config.schema import Config
from training.errors import LaunchError

DEADLINE = "LAUNCH_DEADLINE"  # the job's end less a margin, as time.time() (launch/slurm.sbatch)
HANDLED_SIGNALS = (signal.SIGTERM, signal.SIGINT, signal.SIGUSR1)


def _any_rank(local: int) -> int:
    """The MAX of `local` over every rank (every rank calls it at the same point)."""
    flag = torch.tensor([local], dtype=torch.int32, device="cuda" if torch.cuda.is_available() else "cpu")
    if dist.is_initialized():
        dist.all_reduce(flag, op=dist.ReduceOp.MAX)
    return int(flag.item())


class SaveClock:
    """A periodic save every train.save_interval iterations, or once train.save_interval_minutes passed
    since the last save (or the start): what an elastic restart or a crash loses at most."""

    def __init__(self, cfg: Config):
        self.enabled = cfg.checkpoint.dir is not None
        self.interval, self.seconds = cfg.train.save_interval, 60 * cfg.train.save_interval_minutes
        self.last = time.monotonic()

    def due(self, iteration: int) -> bool:
        if not self.enabled:
            return False
        periodic = self.interval > 0 and iteration % self.interval == 0
        timed = self.seconds > 0 and bool(_any_rank(int(time.monotonic() - self.last >= self.seconds)))
        return periodic or timed

    def saved(self) -> None:
        self.last = time.monotonic()


def _launch_deadline() -> float | None:
    value = os.environ.get(DEADLINE, "")
    try:
        return float(value) if value else None
    except ValueError:
        raise LaunchError(f"{DEADLINE}={value} must be a time in seconds since the epoch (launch/slurm.sbatch sets "
                          f"it; unset it otherwise)") from None


class Stopper:
    def __init__(self, cfg: Config):
        self.exit_interval = cfg.train.exit_interval
        self.deadline = time.monotonic() + 60 * cfg.train.exit_duration_minutes \
            if cfg.train.exit_duration_minutes > 0 else None
        self.job_deadline = _launch_deadline()
        self.received: int | None = None
        self.reason = ""
        for sig in HANDLED_SIGNALS:
            signal.signal(sig, self._on_signal)

    def _on_signal(self, signum, frame) -> None:
        self.received = self.received or signum  # the first names the stop, as in the launcher's summary

    def should_stop(self, iteration: int) -> bool:
        local = 0
        if self.received is not None:
            local, self.reason = 3, f"received {signal.Signals(self.received).name}"
        elif self.deadline is not None and time.monotonic() > self.deadline:
            local, self.reason = 2, "train.exit_duration_minutes reached"
        elif self.job_deadline is not None and time.time() > self.job_deadline:
            local, self.reason = 2, f"the job's time limit is near ({DEADLINE}, the launcher's EXIT_MARGIN)"
        elif self.exit_interval and iteration % self.exit_interval == 0:
            local, self.reason = 1, f"train.exit_interval={self.exit_interval}"
        flag = _any_rank(local)
        if flag and not self.reason:
            self.reason = {3: "a peer rank received a stop signal", 2: "a peer rank hit the time limit",
                           1: "exit interval"}[flag]
        return bool(flag)
