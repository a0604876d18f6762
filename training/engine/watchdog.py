"""A hang watchdog: a thread on every rank that notices a step running far past its recent median (or any
phase past the collective timeout), says which rank, step and phase, dumps the rank's Python stacks and
exits the process non-zero.

    watchdog = Watchdog.of(cfg)
    with watchdog.phase("step", iteration + 1):
        train_step(...)

The stacks also go to <run dir>/watchdog/rank<N>.txt (the console's copy may be cut short when the launcher
stops the other ranks). A stalled rank trips its own watchdog; its peers, waiting for it inside a collective,
trip theirs, so every rank exits (code 3) and the launcher reports the failure (and restarts the job with
MAX_RESTARTS). The limit of a step is max(train.watchdog_factor x the median of the last 20 steps,
train.watchdog_min_seconds) once 3 steps are done; before that, and for evaluation and saving,
parallel.timeout_minutes. GPUs: NCCL's own watchdog (TORCH_NCCL_ASYNC_ERROR_HANDLING, launch/common.sh) aborts a
collective past that timeout too.
"""

from __future__ import annotations

import contextlib
import faulthandler
import os
import statistics
import sys
import threading
import time
from collections import deque

EXIT_CODE = 3


class Watchdog:
    def __init__(self, factor: float, min_seconds: float, timeout_seconds: float, rank: int, poll: float = 0.5,
                 run_dir: str | os.PathLike | None = None):
        self.factor, self.min_seconds, self.timeout, self.rank = factor, min_seconds, timeout_seconds, rank
        self.dump = os.path.join(run_dir, "watchdog", f"rank{rank}.txt") if run_dir is not None else None
        self.steps: deque[float] = deque(maxlen=20)
        self.current: tuple[str, int, float] | None = None  # (phase, step, started)
        self._stop = threading.Event()
        self._thread = None
        if factor > 0:
            self._thread = threading.Thread(target=self._watch, args=(poll,), name="watchdog", daemon=True)
            self._thread.start()

    @classmethod
    def of(cls, cfg, run_dir: str | os.PathLike | None = None) -> Watchdog:
        import torch.distributed as dist

        return cls(cfg.train.watchdog_factor, cfg.train.watchdog_min_seconds, cfg.parallel.timeout_minutes * 60,
                   dist.get_rank() if dist.is_initialized() else 0, run_dir=run_dir)

    def limit(self, phase: str) -> float:
        if phase != "step" or len(self.steps) < 3:
            return self.timeout
        return min(self.timeout, max(self.factor * statistics.median(self.steps), self.min_seconds))

    @contextlib.contextmanager
    def phase(self, name: str, step: int):
        self.current = (name, step, time.monotonic())
        try:
            yield
        finally:
            if name == "step":
                self.steps.append(time.monotonic() - self.current[2])
            self.current = None

    def _watch(self, poll: float) -> None:
        while not self._stop.wait(poll):
            current = self.current
            if current is None:
                continue
            name, step, started = current
            elapsed, limit = time.monotonic() - started, self.limit(name)
            if elapsed > limit:
                median = f"{statistics.median(self.steps):.2f} s" if self.steps else "none yet"
                where = self._write_stacks()
                sys.stderr.write(f"watchdog: rank {self.rank} stalled in the {name} of step {step}: {elapsed:.1f} s, "
                                 f"over its limit of {limit:.1f} s (median step {median}; train.watchdog_factor="
                                 f"{self.factor:g}, train.watchdog_min_seconds={self.min_seconds:g}); its Python "
                                 f"stacks{where}:\n")  # one write (training/errors.py: peers share the pipe)
                sys.stderr.flush()
                faulthandler.dump_traceback(file=sys.stderr, all_threads=True)
                sys.stderr.flush()
                os._exit(EXIT_CODE)  # a hung collective never returns: leave without cleanup

    def _write_stacks(self) -> str:
        """Every thread's stack into the run dir's watchdog/rank<N>.txt first (the console's copy may be cut
        short when the launcher stops the other ranks): " (also in <file>)", or "" without a file."""
        if self.dump is None:
            return ""
        try:
            os.makedirs(os.path.dirname(self.dump), exist_ok=True)
            with open(self.dump, "w") as out:
                faulthandler.dump_traceback(file=out, all_threads=True)
        except OSError:
            return ""
        return f" (also in {self.dump})"

    def close(self) -> None:
        self._stop.set()
