"""Checkpoints in Megatron-Core's dist_checkpointing format (torch_dist), resharding across layouts.

    <checkpoint.dir>/iter_0000010/   model (+ optimizer, scheduler, RNG, iteration, consumed samples)
                                     as sharded tensors; run.json (config, versions) written last
    <checkpoint.dir>/latest          "iter_0000010": the newest complete checkpoint

Every rank writes its own shards; rank 0 writes the metadata. `run.json` and then `latest` are written
(atomically: temp file + rename) only after every rank finished, so a crash mid-save leaves the
previous checkpoint as latest and the half-written directory is recognisably incomplete.
The distributed optimizer is saved `fully_reshardable`, so TP / PP / DP may change on load and Adam's
moments follow the parameters.
"""

from __future__ import annotations

import json
import os
import random
import shutil
import subprocess
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch
import torch.distributed as dist
from megatron.core import dist_checkpointing, parallel_state, tensor_parallel
from megatron.core.dist_checkpointing.mapping import ShardedObject
from torch.distributed.checkpoint.api import CheckpointException

from models.shape import WEIGHTS, ModelShape
from training.checkpoint import fsdp_dtensor as fsdp_checkpoint
from training.checkpoint.safe_load import UnsafeCheckpoint, safe_unpickling
from training.config.schema import Config, ModelConfig, to_config
from training.engine.bridge import uses_fsdp
from training.engine.build import TrainState, unwrap
from training.errors import TemplateError
from training.parallel.dist import print0
from training.shims import upstream_fixes

LATEST = "latest"
RUN_FILE = "run.json"


class CheckpointError(TemplateError):
    pass


@dataclass(frozen=True)
class Start:
    """Where a run starts: from scratch, from this run's checkpoint (resumed), or from weights."""

    iteration: int = 0
    consumed_samples: int = 0
    resumed: bool = False  # a checkpoint of this run was loaded (it is already on disk)
    train_samples: int | None = None  # the train dataset size the checkpointed run was built with


def iter_dir(root: str | Path, iteration: int) -> Path:
    return Path(root) / f"iter_{iteration:07d}"


def is_complete(path: Path) -> bool:
    return (path / RUN_FILE).is_file() and (path / "metadata.json").is_file()


def complete_checkpoints(root: Path) -> list[Path]:
    """Complete iter_* directories, newest first."""
    if not root.is_dir():
        return []
    found = [p for p in root.glob("iter_*") if p.is_dir() and is_complete(p)]
    return sorted(found, key=lambda p: p.name, reverse=True)


def _atomic_write(path: Path, text: str) -> None:
    tmp = path.with_name(f".{path.name}.tmp{os.getpid()}")
    tmp.write_text(text)
    os.replace(tmp, path)


def _versions() -> dict:
    from importlib.metadata import version

    try:
        commit = subprocess.run(["git", "rev-parse", "HEAD"], cwd=Path(__file__).parent, capture_output=True,
                                text=True, timeout=5).stdout.strip() or "unknown"
    except (OSError, subprocess.SubprocessError):
        commit = "unknown"
    return {"torch": torch.__version__, "megatron-core": version("megatron-core"), "template_commit": commit}


def _layout() -> dict:
    return {"tp": parallel_state.get_tensor_model_parallel_world_size(),
            "pp": parallel_state.get_pipeline_model_parallel_world_size(),
            "dp": parallel_state.get_data_parallel_world_size(),
            "cp": parallel_state.get_context_parallel_world_size()}


def _rng_state() -> dict:
    return {"random": random.getstate(), "numpy": np.random.get_state(), "torch": torch.get_rng_state(),
            "cuda": torch.cuda.get_rng_state() if torch.cuda.is_available() else None,
            "tracker": tensor_parallel.get_cuda_rng_tracker().get_states()}


def _set_rng_state(state: dict) -> None:
    random.setstate(state["random"])
    np.random.set_state(state["numpy"])
    torch.set_rng_state(state["torch"])
    if state["cuda"] is not None and torch.cuda.is_available():
        torch.cuda.set_rng_state(state["cuda"])
    tensor_parallel.get_cuda_rng_tracker().set_states(state["tracker"])


def sharded_metadata(cfg: Config) -> dict:
    meta = {"singleton_local_shards": False, "chained_optim_avoid_prefix": True}
    if cfg.parallel.dist_opt:
        meta["distrib_optim_sharding_type"] = "fully_reshardable"
        meta["distrib_optim_fully_reshardable_mem_efficient"] = True  # the other path calls .cuda()
    return meta


def model_keys(state: TrainState) -> list[str]:
    return ["model"] if len(state.model) == 1 else [f"model{i}" for i in range(len(state.model))]


def state_dict(cfg: Config, state: TrainState, is_loading: bool, with_rng: bool = True,
               model_only: bool = False) -> dict:
    """The sharded state dict dist_checkpointing saves / fills (DDP does not forward sharded_state_dict:
    the unwrapped model's is the same, with the same keys)."""
    meta = sharded_metadata(cfg)
    sharded = {key: unwrap(chunk).sharded_state_dict(metadata=meta)
               for key, chunk in zip(model_keys(state), state.model)}
    if model_only:
        return sharded
    upstream_fixes.before_optimizer_state_dict(state.optimizer)
    sharded["optimizer"] = state.optimizer.sharded_state_dict(sharded, is_loading=is_loading, metadata=meta)
    sharded["scheduler"] = state.scheduler.state_dict()
    if with_rng:
        pp, tp = parallel_state.get_pipeline_model_parallel_rank(), parallel_state.get_tensor_model_parallel_rank()
        sharded["rng_state"] = ShardedObject(
            "rng_state", _rng_state(),
            (parallel_state.get_pipeline_model_parallel_world_size(),
             parallel_state.get_tensor_model_parallel_world_size()),
            (pp, tp), replica_id=parallel_state.get_data_parallel_rank(with_context_parallel=True))
    return sharded


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
        if uses_fsdp(cfg):  # Megatron-FSDP's DTensors: the fsdp_dtensor layout through torch DCP
            fsdp_checkpoint.save(state, path, _rng_state(), {"iteration": iteration,
                                                             "consumed_samples": consumed_samples})
        else:
            sharded = state_dict(cfg, state, is_loading=False, with_rng=not model_only, model_only=model_only)
            sharded["iteration"], sharded["consumed_samples"] = iteration, consumed_samples
            dist_checkpointing.save(sharded, str(path), verify_integrity=True)
    except (Exception, CheckpointException) as err:  # noqa: BLE001 - OSError (ENOSPC, EIO) or DCP's wrapper
        failure = f"{type(err).__name__}: {str(err).splitlines()[0] if str(err) else ''}"
    failed = torch.tensor([float(failure is not None)])
    dist.all_reduce(failed)  # every rank's shards are on disk, or everyone knows they are not
    if failed.item():
        _save_failed(cfg, root, path, failure, int(failed.item()))
        return None
    if rank0:
        from omegaconf import OmegaConf

        run = {"iteration": iteration, "consumed_samples": consumed_samples, "layout": _layout(),
               "train_samples": train_samples, "weights_only": model_only,
               "vocab_size": state.shape.vocab_size,
               "config": OmegaConf.to_container(OmegaConf.structured(cfg)), "versions": _versions(),
               "run_dir": str(run_dir) if run_dir else None}
        _atomic_write(path / RUN_FILE, json.dumps(run, indent=1) + "\n")
        _atomic_write(root / LATEST, path.name + "\n")
        _prune(root, cfg.checkpoint.keep)
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


def _prune(root: Path, keep: int) -> None:
    if keep <= 0:
        return
    for old in complete_checkpoints(root)[keep:]:
        shutil.rmtree(old, ignore_errors=True)


def newest_complete(root: Path) -> Path | None:
    """The checkpoint `latest` names if it is complete, else the newest complete one, else None."""
    candidates = complete_checkpoints(root)
    latest = root / LATEST
    if latest.is_file():
        named = root / latest.read_text().strip()
        if not is_complete(named):
            print0(f"warning: {latest} names {named}, which is incomplete; using the newest complete one")
        elif named in candidates:
            return named
    return candidates[0] if candidates else None


def resolve_load_path(cfg: Config) -> tuple[Path | None, bool]:
    """checkpoint.load -> (the iter_* directory to load or None to start fresh, weights only?).

    With checkpoint.finetune the weights of checkpoint.load start the run, unless checkpoint.dir
    already holds this run's own checkpoint: then a restarted (requeued) fine-tune resumes itself."""
    spec, own = cfg.checkpoint.load, None
    if cfg.checkpoint.dir is not None:
        own = newest_complete(Path(cfg.checkpoint.dir))
    if cfg.checkpoint.finetune:
        return (own, False) if own is not None else (resolve_path(spec), True)
    if spec is None:
        return None, False
    if spec == "auto":
        return own, False
    return resolve_path(spec), False


def resolve_path(spec: str | Path) -> Path:
    """A checkpoint path: an iter_* directory, or a checkpoint.dir (its `latest`); must be complete."""
    path = Path(spec)
    if (path / LATEST).is_file():
        path = path / (path / LATEST).read_text().strip()
    if not is_complete(path):
        raise CheckpointError(f"checkpoint {path} is incomplete or not a checkpoint (no {RUN_FILE} / "
                              f"metadata.json: an interrupted save?); point checkpoint.load at a complete one")
    return path


def check_compatible(run: dict, shape: ModelShape) -> None:
    """Refuse, naming every differing field, a checkpoint whose weights' shapes differ from the config's
    (the shape fields tagged "weights", resolved: ffn_hidden_size=null and 4h are the same)."""
    saved = ModelShape.of(saved_model_config(run), run["vocab_size"]).fields_of(WEIGHTS)
    current = shape.fields_of(WEIGHTS)
    differ = [f"{k}: checkpoint {_brief(saved[k])} vs config {_brief(current[k])}"
              for k in current if saved[k] != current[k]]
    if differ:
        raise CheckpointError("the model in the config does not match the checkpoint's: " + "; ".join(differ))


def _chain(err: BaseException, seen: set | None = None):
    """err and its causes, also the per-rank failures DCP's CheckpointException wraps."""
    seen = set() if seen is None else seen
    while err is not None and id(err) not in seen:
        seen.add(id(err))
        yield err
        for failure in getattr(err, "failures", {}).values():  # rank -> (exception, its stack)
            failure = failure[0] if isinstance(failure, tuple) else failure
            if isinstance(failure, BaseException):
                yield from _chain(failure, seen)
        err = err.__cause__ or err.__context__


def saved_model_config(run: dict) -> ModelConfig:
    """A checkpoint's model config (run.json) on today's schema: fields added since take their defaults;
    fused_kernels, a run setting that was a string (auto/on/off) before it became a bool, is left out."""
    model = {k: v for k, v in run["config"]["model"].items() if k != "fused_kernels"}
    return to_config({"model": model}).model


def _brief(value):
    """A layer list shown by its distinct entries (it repeats one dict per layer)."""
    if isinstance(value, (list, tuple)):
        distinct = [dict(t) for t in dict.fromkeys(tuple(sorted(d.items())) for d in value)]
        return distinct[0] if len(distinct) == 1 else distinct
    return value


def check_same_optimizer(cfg: Config, run: dict, path: Path) -> None:
    """The distributed and the plain optimizer save different state layouts: resume with the same one."""
    saved = run["config"]["parallel"]["dist_opt"]
    if saved != cfg.parallel.dist_opt:
        raise CheckpointError(
            f"checkpoint {path} was saved with parallel.dist_opt={str(saved).lower()} but this run has "
            f"parallel.dist_opt={str(cfg.parallel.dist_opt).lower()}: resume with the same setting (TP, PP and "
            f"DP may change), or load the weights only with checkpoint.finetune=true")


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
    if uses_fsdp(cfg) or fsdp_checkpoint.is_fsdp_checkpoint(path):
        return fsdp_checkpoint.load_into_run(cfg, state, path, run, weights_only, announce)
    if not weights_only:
        check_same_optimizer(cfg, run, path)
    same_layout = {k: run["layout"][k] for k in ("tp", "pp")} == {k: _layout()[k] for k in ("tp", "pp")}
    template = state_dict(cfg, state, is_loading=True, with_rng=same_layout, model_only=weights_only)
    if not weights_only:
        template["iteration"], template["consumed_samples"] = 0, 0
    try:
        with safe_unpickling():  # a checkpoint from elsewhere runs no code here (training/checkpoint/safe_load.py)
            loaded = dist_checkpointing.load(template, str(path), verify_integrity=True)
    except (Exception, CheckpointException) as err:  # noqa: BLE001 - the files are not usable (DCP's exception
        # for a failure on some rank derives from BaseException, not Exception)
        cause = next((e for e in _chain(err) if isinstance(e, UnsafeCheckpoint)), err)
        raise CheckpointError(f"cannot load checkpoint {path}: {type(cause).__name__}: "
                              f"{str(cause).splitlines()[0] if str(cause) else ''}") from err
    for key, chunk in zip(model_keys(state), state.model):
        chunk.load_state_dict(loaded[key], strict=True)
    if weights_only:
        if state.optimizer is not None:
            state.optimizer.reload_model_params()  # fp32 main params (bf16, distributed optimizer) follow
        announce(f"fine-tuning from the weights of {path} (fresh optimizer, schedule and data order)"
                 if state.optimizer is not None else f"loaded the weights of {path}")
        return Start()
    state.optimizer.load_state_dict(loaded["optimizer"])
    upstream_fixes.after_optimizer_load(state.optimizer)
    state.scheduler.load_state_dict(loaded["scheduler"])
    if same_layout:
        _set_rng_state(loaded["rng_state"])
    else:
        print0(f"note: layout changed (saved tp/pp {run['layout']['tp']}/{run['layout']['pp']}); RNG "
               f"streams restart from the seed, weights and optimizer state are resharded")
    print0(f"loaded checkpoint {path} (iteration {loaded['iteration']})")
    return Start(int(loaded["iteration"]), int(loaded["consumed_samples"]), True, run.get("train_samples"))
