"""Checkpoints: the one interface the rest of the code uses (`from training import checkpoint`; checkpoint.save).

    <checkpoint.dir>/iter_0000010/   model, optimizer, scheduler, RNG states, iteration, consumed samples
                                     in the run's format; run.json (config, versions, layout) written last
    <checkpoint.dir>/latest          "iter_0000010": the newest complete checkpoint

Two formats sit behind it, chosen in saving.fmt and nowhere else: torch_dist.py (Megatron-Core
dist_checkpointing: DDP runs, plain or distributed optimizer; reshards across TP / PP / DP) and
fsdp_dtensor.py (Megatron-FSDP runs, torch DCP; reshards across DP). What both share (run directory,
run.json, layout record, the load-error wrapper, compatibility checks) is common.py; the RNG states rng.py;
loading runs no code from the files (safe_load.py). saving.py saves (every rank, in three agreed steps);
background.py is the training loop's `Saver`, which with checkpoint.async_save writes in the background.

Every rank writes its own shards. `run.json` and then `latest` are written (atomically: temp file +
rename) only after every rank finished, so a crash mid-save leaves the previous checkpoint as latest and
the half-written directory is recognisably incomplete. A save that fails on any rank is removed; every rank
learns which rank failed and why (agreement.py), or, for a rank failing alone inside the save's collectives,
that rank stops the run at once instead of leaving its peers waiting there until parallel.timeout_minutes.
"""

from __future__ import annotations

from training.checkpoint import fsdp_dtensor, torch_dist
from training.checkpoint.background import Saver
from training.checkpoint.common import (
    LATEST,
    RUN_FILE,
    CheckpointError,
    Start,
    TrainState,
    check_match,
    complete_checkpoints,
    is_complete,
    iter_dir,
    newest_complete,
    read_run,
    resolve_load_path,
    resolve_path,
    saved_model_config,
)
from training.checkpoint.saving import fmt, save
from training.config.schema import Config
from training.parallel import fsdp
from training.parallel.dist import print0

__all__ = ["LATEST", "RUN_FILE", "CheckpointError", "Start", "complete_checkpoints", "fsdp_weights_loader",
           "is_complete", "iter_dir", "maybe_load", "newest_complete", "read_run", "resolve_load_path", "resolve_path",
           "save", "saved_model_config", "Saver"]


def maybe_load(cfg: Config, state: TrainState, announce=print0) -> Start:
    """Load per checkpoint.load / checkpoint.finetune (weights only: the run starts at iteration 0);
    announce(message) says what was loaded (tools that print results on stdout pass a stderr printer)."""
    path, weights_only = resolve_load_path(cfg)
    if path is None:
        return Start()
    run = read_run(path)
    check_match(run, cfg, state.shape, path, weights_only)  # the tokenizer, the model, weights only
    return fmt(cfg, path).load(cfg, state, path, run, weights_only, announce)


def fsdp_weights_loader(cfg: Config):
    """For a Megatron-FSDP fine-tune from a torch_dist checkpoint's weights (an HF import, a DDP run): a
    `prepare` for build() that loads them into the bare chunks before FSDP takes them; else None."""
    if not fsdp.enabled(cfg):
        return None
    path, weights_only = resolve_load_path(cfg)
    if path is None or not weights_only or fsdp_dtensor.is_fsdp_checkpoint(path):
        return None
    return lambda chunks: torch_dist.load_weights(cfg, path, chunks)
