"""A tool's `run(args)` in this process, under torchrun, or on N local processes of its own (`--nproc N`).

    return run_local(run, args, args.nproc)      # tools/generate.py, tools/evaluate.py

Under torchrun (RANK set) or with one process it runs here (one process gets a free local port); otherwise
it spawns N workers on a free port, each with torchrun's environment. A user error is one line and exit 2
(training.errors.exit_on_error) in whichever process hits it; the first failed worker's exit code comes back,
once every worker ended (wait_all).
"""

from __future__ import annotations

import os
import time

from training.errors import exit_on_error

PEER_GRACE = 60.0  # seconds the other workers get to end on their own after one failed


def _worker(rank: int, world: int, port: int, run, args) -> None:
    os.environ.update(RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=str(world), LOCAL_WORLD_SIZE=str(world),
                      MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    if code := exit_on_error(run, args):
        raise SystemExit(code)


def run_local(run, args, nproc: int) -> int:
    from training.parallel.spawn import free_port

    if "RANK" in os.environ:  # torchrun
        return exit_on_error(run, args)
    if nproc == 1:
        os.environ.update(RANK="0", LOCAL_RANK="0", WORLD_SIZE="1", MASTER_ADDR="127.0.0.1",
                          MASTER_PORT=str(free_port()))
        return exit_on_error(run, args)
    import torch.multiprocessing as mp

    context = mp.start_processes(_worker, args=(nproc, free_port(), run, args), nprocs=nproc,
                                 start_method="spawn", join=False)
    return wait_all(context.processes)


def wait_all(processes, grace: float = PEER_GRACE) -> int:
    """The first failed worker's exit code (0: all succeeded). Unlike torch's join, a failure does not terminate
    the peers at once: an error raised alike on every rank is printed by rank 0 alone, which may be the slower
    one (it would be killed before its line); the peers get `grace` seconds to end on their own (a peer left in
    a collective fails when the failed rank's connections close, or hangs), then are terminated."""
    from multiprocessing.connection import wait

    first, deadline = 0, None
    running = list(processes)
    while running:
        timeout = None if deadline is None else max(0.0, deadline - time.monotonic())
        ready = wait([p.sentinel for p in running], timeout)
        if not ready:  # the grace is over
            for process in running:
                process.terminate()
            for process in running:
                process.join()
            break
        for process in [p for p in running if p.sentinel in ready]:
            process.join()
            running.remove(process)
            if process.exitcode and not first:
                first, deadline = process.exitcode if process.exitcode > 0 else 1, time.monotonic() + grace
    return first
