"""A tool's `run(args)` in this process, under torchrun, or on N local processes of its own (`--nproc N`).

    return run_local(run, args, args.nproc)      # tools/generate.py, tools/evaluate.py

Under torchrun (RANK set) or with one process it runs here (one process gets a free local port); otherwise
it spawns N workers on a free port, each with torchrun's environment. A user error is one line and exit 2
(training.errors.exit_on_error) in whichever process hits it; the exit code comes back.
"""

from __future__ import annotations

import os

from training.errors import exit_on_error


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

    try:
        mp.start_processes(_worker, args=(nproc, free_port(), run, args), nprocs=nproc, start_method="spawn")
    except mp.ProcessExitedException as error:  # a worker's SystemExit (its error is printed already)
        return error.exit_code or 1
    return 0
