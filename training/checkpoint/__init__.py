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
the half-written directory is recognisably incomplete. A save that fails on any rank is removed; every rank
learns which rank failed and why (agreement.py), or, for a rank failing alone inside the save's collectives,
that rank stops the run at once instead of leaving its peers waiting there until parallel.timeout_minutes.
"""

from __future__ import annotations

import contextlib
import json
import shutil
from pathlib import Path
from typing import TYPE_CHECKING

import torch.distributed as dist

from training.checkpoint import agreement, fsdp_dtensor, torch_dist
from training.checkpoint.common import (
    LATEST,
    RUN_FILE,
    CheckpointError,
    Start,
    atomic_write,
    check_compatible,
    complete_checkpoints,
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
    only checkpoint.finetune=true loads. Three steps, each ending with every rank knowing which ranks failed
    (agreement.py): rank 0 prepares the directory, every rank writes its shards, rank 0 writes run.json and
    then `latest`. A save that fails is removed and never becomes `latest`; checkpoint.on_save_error then
    stops the run (CheckpointError, the same line on every rank, naming the failed ranks and the cause) or
    warns and returns None (the next save tries again). A rank that fails alone inside the save's collectives
    stops at once (agreement.write_shards)."""
    root = Path(cfg.checkpoint.dir)
    path = iter_dir(root, iteration)
    rank0 = dist.get_rank() == 0
    failures = agreement.agree(agreement.attempt(_prepare, path) if rank0 else None)
    if not failures:
        extra = {"iteration": iteration, "consumed_samples": consumed_samples}
        failures = agreement.agree(agreement.write_shards(
            lambda: _format(cfg).save(cfg, state, path, extra, model_only), path, _latest(root)))
    if not failures:
        run = {"iteration": iteration, "consumed_samples": consumed_samples, "train_samples": train_samples,
               "weights_only": model_only, "run_dir": str(run_dir) if run_dir else None}
        failures = agreement.agree(agreement.attempt(_complete, cfg, state, path, run) if rank0 else None)
    if failures:
        _save_failed(cfg, root, path, failures)
        return None
    print0(f"saved checkpoint {path} (iteration {iteration}, {consumed_samples} samples consumed)")
    return path


def _prepare(path: Path) -> None:
    if path.exists():  # an earlier, interrupted save of this iteration (never the latest)
        shutil.rmtree(path)
    path.mkdir(parents=True)


def _complete(cfg: Config, state: TrainState, path: Path, run: dict) -> None:
    """run.json, then `latest` (each atomic): the checkpoint is complete, then it is the latest."""
    from omegaconf import OmegaConf

    run = {**run, "layout": layout(), "vocab_size": state.shape.vocab_size,
           "config": OmegaConf.to_container(OmegaConf.structured(cfg)), "versions": versions()}
    atomic_write(path / RUN_FILE, json.dumps(run, indent=1) + "\n")
    atomic_write(path.parent / LATEST, path.name + "\n")
    with contextlib.suppress(OSError):  # `latest` moved: pruning is best effort
        prune(path.parent, cfg.checkpoint.keep)


def _latest(root: Path) -> str:
    latest = root / LATEST
    return latest.read_text().strip() if latest.is_file() else "none yet"


def _save_failed(cfg: Config, root: Path, path: Path, failures: dict[int, str]) -> None:
    if dist.get_rank() == 0:
        shutil.rmtree(path, ignore_errors=True)  # never complete, never latest; remove the partial files
    message = f"saving checkpoint {path} failed on {agreement.on_ranks(failures)}; latest stays {_latest(root)}"
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
