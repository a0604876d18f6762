"""Run a function on N gloo processes, as torchrun would, and report every rank's failure.

    results = run_distributed(fn, world_size=4, args=(...,), timeout=120)

`fn` must be importable by name (a module-level function). Each process gets RANK / WORLD_SIZE /
LOCAL_RANK / MASTER_ADDR / MASTER_PORT (a free port) in its environment; `fn(*args)` runs there and its
return value (picklable) comes back in rank order. If any rank raises, hangs past `timeout`, or dies,
the remaining ranks are killed and the test fails with each failing rank's traceback.

The processes come from a fork server that imported torch, Megatron-Core and the engine once per test session
(PRELOAD): a fresh process each time, without the ~5 s of imports a spawned one pays. They get the caller's
environment as it is at the call (monkeypatch.setenv reaches them), not the server's.
"""

from __future__ import annotations

import faulthandler
import io
import os
import queue
import re
import shutil
import tempfile
import time
import traceback

import torch
import torch.multiprocessing as mp

from training.parallel.spawn import free_port

# Collective timeout inside the workers: short, so a hang shows up as an error, not a 30-minute wait.
WORKER_COLLECTIVE_TIMEOUT_MIN = 2.0


# Workers start from a fork server that has already imported torch, Megatron-Core and the engine (~5 s per
# process under spawn, the suite's largest fixed cost): each worker is still a fresh process (forked from a server
# that ran nothing but the imports), with the caller's environment of the moment (below).
PRELOAD = ["torch", "megatron.core", "megatron.core.parallel_state", "training.config.compose",
           "training.engine.loop", "training.parallel.dist", "harness", "runs", "layouts"]


def _context():
    ctx = mp.get_context("forkserver")
    ctx.set_forkserver_preload(PRELOAD)
    return ctx


def _worker(rank, world_size, port, fn, args, results, crash_dir, env):
    os.environ.clear()
    os.environ.update(env)  # the fork server's environment is the one it started with
    # a rank killed by a signal (SIGSEGV, SIGABRT) leaves its Python stacks here for the parent's report
    crash_log = open(os.path.join(crash_dir, f"rank{rank}.txt"), "w")  # noqa: SIM115 - open until the process ends
    faulthandler.enable(crash_log, all_threads=True)
    os.environ.update(
        RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=str(world_size), LOCAL_WORLD_SIZE=str(world_size),
        MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), OMP_NUM_THREADS="1",
    )
    torch.set_num_threads(1)  # torch read the thread count at import, before the line above
    try:
        # Results travel as torch.save bytes: tensors sent through the queue as shared memory would be
        # lost when this process exits before the parent reads them.
        buffer = io.BytesIO()
        torch.save(fn(*args), buffer)
        results.put((rank, True, buffer.getvalue()))
    except BaseException:  # noqa: BLE001 - everything goes back to the parent
        results.put((rank, False, traceback.format_exc()))


def _crash_stacks(crash_dir: str, rank: int) -> str:
    try:
        with open(os.path.join(crash_dir, f"rank{rank}.txt")) as f:
            return f.read()[-20000:]
    except OSError:
        return ""


def run_distributed(fn, world_size: int, args: tuple = (), timeout: float = 180.0) -> list:
    ctx = _context()
    results = ctx.Queue()
    port = free_port()
    crash_dir = tempfile.mkdtemp(prefix="harness-")
    # not daemonic: dist_checkpointing.save starts a multiprocessing manager (a child process)
    env = dict(os.environ)
    procs = [ctx.Process(target=_worker, args=(r, world_size, port, fn, args, results, crash_dir, env), daemon=False)
             for r in range(world_size)]
    for p in procs:
        p.start()
    outcomes: dict[int, tuple[bool, object]] = {}
    deadline = time.monotonic() + timeout
    try:
        while len(outcomes) < world_size:
            try:
                rank, ok, value = results.get(timeout=1.0)
                outcomes[rank] = (ok, value)
                if not ok:  # give the peers a moment to fail too, then stop waiting
                    deadline = min(deadline, time.monotonic() + 10.0)
            except queue.Empty:
                dead = [r for r, p in enumerate(procs) if not p.is_alive() and r not in outcomes
                        and p.exitcode not in (None, 0)]
                for r in dead:
                    outcomes[r] = (False, f"rank {r} died with exit code {procs[r].exitcode}\n"
                                          + _crash_stacks(crash_dir, r))
            if time.monotonic() > deadline:
                break
    finally:
        for p in procs:
            p.join(timeout=5.0)
            if p.is_alive():
                p.kill()
                p.join()
    shutil.rmtree(crash_dir, ignore_errors=True)
    failures = [f"--- rank {r} ---\n{v}" for r, (ok, v) in sorted(outcomes.items()) if not ok]
    missing = [r for r in range(world_size) if r not in outcomes]
    if missing:
        failures.append(f"ranks {missing} did not finish within {timeout:.0f} s (hang or deadlock)")
    if failures:
        raise AssertionError(f"{fn.__name__} failed on {world_size} processes:\n" + "\n".join(failures))
    return [torch.load(io.BytesIO(outcomes[r][1]), weights_only=False) for r in range(world_size)]


# A Python warning's line or a torch glog-style log line: what the tools must not print (training/shims/noise.py)
TOOL_NOISE = re.compile(r"\w+Warning: |^[WEI]\d{4} \d\d:\d\d:\d\d", re.MULTILINE)
