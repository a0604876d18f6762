"""Checkpoints: the one interface the rest of the code uses (`from training import checkpoint`; checkpoint.save).

    <checkpoint.dir>/iter_0000010/   model, optimizer, scheduler, RNG states, iteration, consumed samples
                                     in the run's format; run.json (config, versions, layout) written last
    <checkpoint.dir>/latest          "iter_0000010": the newest complete checkpoint

Two formats sit behind it, chosen here (`_format`) and nowhere else: torch_dist.py (Megatron-Core
dist_checkpointing: DDP runs, plain or distributed optimizer; reshards across TP / PP / DP) and
fsdp_dtensor.py (Megatron-FSDP runs, torch DCP; reshards across DP). What both share (run directory,
run.json, layout record, the load-error wrapper, compatibility checks) is common.py; the RNG states rng.py;
loading runs no code from the files (safe_load.py).

Every rank writes its own shards. `run.json` and then `latest` are written (atomically: temp file +
rename) only after every rank finished, so a crash mid-save leaves the previous checkpoint as latest and
the half-written directory is recognisably incomplete. A save that fails on any rank is removed.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import TYPE_CHECKING

import torch
import torch.distributed as dist
from torch.distributed.checkpoint.api import CheckpointException

from training.checkpoint import fsdp_dtensor, torch_dist
from training.checkpoint.common import (
    LATEST,
    RUN_FILE,
    CheckpointError,
    Start,
    atomic_write,
    check_compatible,
    complete_checkpoints,
    describe,
    is_complete,
    iter_dir,
    layout,
    newest_complete,
    prune,
    resolve_load_path,
    resolve_path,
    saved_model_config,
    versions,
)
from training.config.schema import Config
from training.parallel import fsdp
from training.parallel.dist import print0

if TYPE_CHECKING:
    from training.engine.build import TrainState

__all__ = ["LATEST", "RUN_FILE", "CheckpointError", "Start", "complete_checkpoints", "fsdp_weights_loader",
           "is_complete", "iter_dir", "maybe_load", "newest_complete", "resolve_load_path", "resolve_path",
           "save", "saved_model_config"]


def _format(cfg: Config, path: Path | None = None):
    """The format module: fsdp_dtensor for a Megatron-FSDP run or an fsdp_dtensor checkpoint (it refuses, in
    one line, the mixes it cannot load), torch_dist otherwise."""
    return fsdp_dtensor if fsdp.enabled(cfg) or (path is not None and fsdp_dtensor.is_fsdp_checkpoint(path)) \
        else torch_dist


def save(cfg: Config, state: TrainState, iteration: int, consumed_samples: int, run_dir: str | Path | None = None,
         train_samples: int | None = None, model_only: bool = False) -> Path | None:
    """Save a checkpoint (every rank calls this); model_only: the weights alone (conversions), which
    only checkpoint.finetune=true loads. A save that fails on any rank (a full disk) is removed and never
    becomes `latest`; checkpoint.on_save_error then stops the run (CheckpointError) or warns and returns
    None (the next save tries again)."""
    root = Path(cfg.checkpoint.dir)
    path = iter_dir(root, iteration)
    rank0 = dist.get_rank() == 0
    failure = None
    try:
        if rank0:
            if path.exists():  # an earlier, interrupted save of this iteration (never the latest)
                shutil.rmtree(path)
            path.mkdir(parents=True)
        dist.barrier()
        _format(cfg).save(cfg, state, path, {"iteration": iteration, "consumed_samples": consumed_samples},
                          model_only)
    except (Exception, CheckpointException) as err:  # noqa: BLE001 - OSError (ENOSPC, EIO) or DCP's wrapper
        failure = describe(err)
    failed = torch.tensor([float(failure is not None)])
    dist.all_reduce(failed)  # every rank's shards are on disk, or everyone knows they are not
    if failed.item():
        _save_failed(cfg, root, path, failure, int(failed.item()))
        return None
    if rank0:
        from omegaconf import OmegaConf

        run = {"iteration": iteration, "consumed_samples": consumed_samples, "layout": layout(),
               "train_samples": train_samples, "weights_only": model_only,
               "vocab_size": state.shape.vocab_size,
               "config": OmegaConf.to_container(OmegaConf.structured(cfg)), "versions": versions(),
               "run_dir": str(run_dir) if run_dir else None}
        atomic_write(path / RUN_FILE, json.dumps(run, indent=1) + "\n")
        atomic_write(root / LATEST, path.name + "\n")
        prune(root, cfg.checkpoint.keep)
    dist.barrier()
    print0(f"saved checkpoint {path} (iteration {iteration}, {consumed_samples} samples consumed)")
    return path


def _save_failed(cfg: Config, root: Path, path: Path, failure: str | None, ranks: int) -> None:
    if dist.get_rank() == 0:
        shutil.rmtree(path, ignore_errors=True)  # never complete, never latest; remove the partial files
    latest = root / LATEST
    kept = latest.read_text().strip() if latest.is_file() else "none yet"
    message = (f"saving checkpoint {path} failed on {ranks} rank(s) ({failure or 'on another rank'}); latest "
               f"stays {kept}")
    dist.barrier()
    if cfg.checkpoint.on_save_error == "stop":
        raise CheckpointError(f"{message}: stopping (checkpoint.on_save_error=stop; =warn trains on)")
    print0(f"warning: {message}: training on (checkpoint.on_save_error=warn)")


def maybe_load(cfg: Config, state: TrainState, announce=print0) -> Start:
    """Load per checkpoint.load / checkpoint.finetune (weights only: the run starts at iteration 0);
    announce(message) says what was loaded (tools that print results on stdout pass a stderr printer)."""
    path, weights_only = resolve_load_path(cfg)
    if path is None:
        return Start()
    run = json.loads((path / RUN_FILE).read_text())
    check_compatible(run, state.shape)
    if not weights_only and run.get("weights_only"):
        raise CheckpointError(f"checkpoint {path} holds weights only (an import or conversion): load it with "
                              f"checkpoint.finetune=true")
    return _format(cfg, path).load(cfg, state, path, run, weights_only, announce)


def fsdp_weights_loader(cfg: Config):
    """For a Megatron-FSDP fine-tune from a torch_dist checkpoint's weights (an HF import, a DDP run): a
    `prepare` for build() that loads them into the bare chunks before FSDP takes them; else None."""
    if not fsdp.enabled(cfg):
        return None
    path, weights_only = resolve_load_path(cfg)
    if path is None or not weights_only or fsdp_dtensor.is_fsdp_checkpoint(path):
        return None
    return lambda chunks: torch_dist.load_weights(cfg, path, chunks)
