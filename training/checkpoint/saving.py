"""Saving a checkpoint: three steps, each ending with every rank knowing which ranks failed (agreement.py).

    rank 0 prepares iter_XXXXXXX/  ->  every rank writes its shards  ->  rank 0 writes run.json, then `latest`

`save` runs them in order (the training stalls for the whole write); background.py runs the middle step in
a writer process (checkpoint.async_save) and the last one once every rank's write is complete. A save that
fails is removed and never becomes `latest`; checkpoint.on_save_error then stops the run (CheckpointError,
the same line on every rank, naming the failed ranks and the cause) or warns (the next save tries again).
"""

from __future__ import annotations

import contextlib
import json
import shutil
import time
from pathlib import Path

import torch.distributed as dist

from training.checkpoint import agreement, fsdp_dtensor, torch_dist
from training.checkpoint.common import (
    LATEST,
    RUN_FILE,
    CheckpointError,
    TrainState,
    atomic_write,
    iter_dir,
    layout,
    prune,
    versions,
)
from training.config.checkpoint_match import lora_base
from training.config.schema import Config
from training.parallel import fsdp
from training.parallel.dist import print0


def fmt(cfg: Config, path: Path | None = None):
    """The format module: fsdp_dtensor for a Megatron-FSDP run or an fsdp_dtensor checkpoint (it refuses, in
    one line, the mixes it cannot load), torch_dist otherwise."""
    return fsdp_dtensor if fsdp.enabled(cfg) or (path is not None and fsdp_dtensor.is_fsdp_checkpoint(path)) \
        else torch_dist


def save(cfg: Config, state: TrainState, iteration: int, consumed_samples: int, run_dir: str | Path | None = None,
         train_samples: int | None = None, model_only: bool = False, strategy=None) -> Path | None:
    """Save a checkpoint and wait for it (every rank calls this); model_only: the weights alone (conversions),
    which only checkpoint.finetune=true loads; strategy: Megatron-Core's save strategy to write the shards with
    (torch_dist only: the streamed Hugging Face import's, training/interop/hf_stream.py). Returns its path, or None when it failed under
    checkpoint.on_save_error=warn. A rank that fails alone inside the save's collectives stops at once
    (agreement.write_shards)."""
    started = time.monotonic()
    path = iter_dir(cfg.checkpoint.dir, iteration)
    failures = prepare(path)
    if not failures:
        extra = {"iteration": iteration, "consumed_samples": consumed_samples}
        failures = agreement.agree(agreement.write_shards(
            lambda: fmt(cfg).save(cfg, state, path, extra, model_only, **({'strategy': strategy} if strategy else {})),
            path, latest_name(path.parent)))
    if not failures:
        failures = complete(cfg, state, path, run_record(iteration, consumed_samples, run_dir, train_samples,
                                                         model_only))
    if failures:
        return save_failed(cfg, path, failures)
    print0(f"saved checkpoint {path} (iteration {iteration}, {consumed_samples} samples consumed; training "
           f"paused {time.monotonic() - started:.2f} s)")
    return path


def run_record(iteration: int, consumed_samples: int, run_dir, train_samples, model_only: bool = False) -> dict:
    return {"iteration": iteration, "consumed_samples": consumed_samples, "train_samples": train_samples,
            "weights_only": model_only, "run_dir": str(run_dir) if run_dir else None}


def prepare(path: Path) -> dict[int, str]:
    """Rank 0 makes the empty directory (removing an earlier, interrupted save of this iteration: never the
    latest); every rank learns whether it could."""
    def make():
        if path.exists():
            shutil.rmtree(path)
        path.mkdir(parents=True)

    return agreement.agree(agreement.attempt(make) if dist.get_rank() == 0 else None)


def complete(cfg: Config, state: TrainState, path: Path, run: dict) -> dict[int, str]:
    """run.json, then `latest` (each atomic, rank 0): the checkpoint is complete, then it is the latest."""
    def write():
        from omegaconf import OmegaConf

        record = {**run, "layout": layout(), "vocab_size": state.shape.vocab_size,
                  "config": OmegaConf.to_container(OmegaConf.structured(cfg)), "versions": versions()}
        if base := lora_base(cfg):  # adapters only (torch_dist.save): the base they need, and the sizes
            record["peft_base"] = {**base, "bytes": dir_bytes(path), "base_bytes": dir_bytes(Path(base["path"]))}
            print(f"LoRA checkpoint {path}: the adapters and their optimizer state only, "
                  f"{record['peft_base']['bytes'] / 2**20:.2f} MiB against the base's "
                  f"{record['peft_base']['base_bytes'] / 2**20:.2f} MiB ({base['path']})", flush=True)
        atomic_write(path / RUN_FILE, json.dumps(record, indent=1) + "\n")
        atomic_write(path.parent / LATEST, path.name + "\n")
        with contextlib.suppress(OSError):  # `latest` moved: pruning is best effort
            prune(path.parent, cfg.checkpoint.keep)

    return agreement.agree(agreement.attempt(write) if dist.get_rank() == 0 else None)


def dir_bytes(path: Path) -> int:
    return sum(f.stat().st_size for f in path.rglob("*") if f.is_file())


def latest_name(root: Path) -> str:
    latest = root / LATEST
    return latest.read_text().strip() if latest.is_file() else "none yet"


def save_failed(cfg: Config, path: Path, failures: dict[int, str]) -> None:
    """Remove the failed save (rank 0); stop (CheckpointError) or warn per checkpoint.on_save_error."""
    if dist.get_rank() == 0:
        shutil.rmtree(path, ignore_errors=True)  # never complete, never latest; remove the partial files
    message = (f"saving checkpoint {path} failed on {agreement.on_ranks(failures)}; latest stays "
               f"{latest_name(path.parent)}")
    if cfg.checkpoint.on_save_error == "stop":
        raise CheckpointError(f"{message}: stopping (checkpoint.on_save_error=stop; =warn trains on)")
    print0(f"warning: {message}: training on (checkpoint.on_save_error=warn)")
    return None
