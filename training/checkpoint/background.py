"""The training loop's saves: synchronous, or written in the background (checkpoint.async_save).

    with Saver(cfg, run_dir) as saver:       # one per run; every rank calls every method at the same point
    saver.save(state, iteration, ...)        # at a save: with async_save the training pauses only to plan it
    saver.poll()                             # after each step: a finished background write becomes `latest`
    saver.close()                            # the end: waits for the write in flight and completes it

With async_save, Megatron-Core's dist_checkpointing plans the save (its collectives) at once and returns an
AsyncRequest; its AsyncCallsQueue runs the write in a forked writer process (a fork also snapshots CPU tensors,
which a spawned worker would share) while training goes on. `poll` asks every rank whether its writer is done
(one all-reduce); when all are, Megatron-Core finalizes (gathers the write results: a failed write on any rank
raises on every rank; rank 0 writes the metadata) and saving.complete writes run.json and then `latest`. Until
then `latest` names the previous checkpoint, so a kill -9 during the write loses nothing that was complete.
One write is in flight at a time: the next save first waits for the previous one. Megatron-FSDP runs save
synchronously (validate refuses async_save with parallel.fsdp).
"""

from __future__ import annotations

import time
from pathlib import Path

from megatron.core.dist_checkpointing.strategies.torch import get_async_strategy

from training.checkpoint import agreement, saving, torch_dist
from training.checkpoint.common import TrainState, iter_dir
from training.config.schema import Config
from training.parallel.dist import print0


class Saver:
    def __init__(self, cfg: Config, run_dir: str | Path | None = None, train_samples: int | None = None):
        self.cfg, self.run_dir, self.train_samples = cfg, run_dir, train_samples
        self.background = cfg.checkpoint.async_save
        self.queue = get_async_strategy(torch_dist.ASYNC_STRATEGY, "AsyncCallsQueue")[1](persistent=False) \
            if self.background else None
        self.pending: tuple | None = None  # (state, path, run record, when it started, iteration)

    def save(self, state: TrainState, iteration: int, consumed_samples: int) -> bool:
        """Save at `iteration`: True when it was written (synchronous) or its background write started."""
        if not self.background:
            return saving.save(self.cfg, state, iteration, consumed_samples, self.run_dir,
                               self.train_samples) is not None
        self.close()  # one write in flight at a time
        started = time.monotonic()
        path = iter_dir(self.cfg.checkpoint.dir, iteration)
        failures, request = saving.prepare(path), []
        if not failures:
            extra = {"iteration": iteration, "consumed_samples": consumed_samples}
            failures = agreement.agree(agreement.write_shards(
                lambda: request.append(torch_dist.save(self.cfg, state, path, extra, False, background=True)),
                path, saving.latest_name(path.parent)))
        if failures:
            saving.save_failed(self.cfg, path, failures)
            return False
        self.queue.schedule_async_request(request[0])
        run = saving.run_record(iteration, consumed_samples, self.run_dir, self.train_samples)
        self.pending = (state, path, run, started, iteration)
        print0(f"saving checkpoint {path} in the background (iteration {iteration}; training paused "
               f"{time.monotonic() - started:.2f} s)")
        return True

    def poll(self, blocking: bool = False) -> None:
        """Complete the background write if every rank's writer finished (blocking: wait for it)."""
        if self.pending is None:
            return
        state, path, run, started, iteration = self.pending
        finalized: list[int] = []
        outcome = agreement.write_shards(
            lambda: finalized.extend(self.queue.maybe_finalize_async_calls(blocking=blocking)), path,
            saving.latest_name(path.parent))
        if outcome is None and not finalized:
            return  # still writing on some rank (every rank got the same answer from the all-reduce)
        self.pending = None
        failures = agreement.agree(outcome)
        if not failures:
            failures = saving.complete(self.cfg, state, path, run)
        if failures:
            saving.save_failed(self.cfg, path, failures)
            return
        print0(f"saved checkpoint {path} (iteration {iteration}, {run['consumed_samples']} samples consumed; "
               f"written in the background in {time.monotonic() - started:.2f} s)")

    def close(self) -> None:
        """Wait for the background write in flight, if any, and complete it."""
        self.poll(blocking=True)

    def __enter__(self) -> Saver:
        return self

    def __exit__(self, kind, error, traceback) -> None:
        if kind is not None:
            self.abort()

    def abort(self) -> None:
        """The run failed: stop the writer (its checkpoint never becomes `latest`)."""
        if self.queue is not None and self.pending is not None:
            self.pending = None
            for call in self.queue.async_calls:  # AsyncCallsQueue.close(abort=True) kills only persistent workers
                call.async_caller.close(abort=True)
            self.queue.async_calls.clear()
