"""Checkpoints of Megatron-FSDP runs (parallel.fsdp): the fsdp_dtensor layout, written with torch DCP.

Megatron-FSDP keeps each parameter as a DTensor whose DP shards are slices of flat buffers (uneven: not
DTensor's own chunking), and its distributed optimizer only offers the `fsdp_dtensor` state dict for them,
so dist_checkpointing's torch_dist format (what DDP runs save: torch_dist.py) cannot hold them.
As Megatron-LM does for `--ckpt-format fsdp_dtensor`: the model part is MegatronFSDP.state_dict() (the fp32
main weights as DTensors), the optimizer part `sharded_state_dict(metadata={"distrib_optim_sharding_type":
"fsdp_dtensor"})` (Adam's moments per parameter name), each local shard tagged with its offsets
(`preprocess_state_dict_for_uneven_dtensor`), and `torch.distributed.checkpoint` saves and loads them in
place. DCP reshards by offsets, so a checkpoint loads at another DP size; TP and PP must stay (the fused
SwiGLU weight would need Megatron-LM's gate/up split). `metadata.json` marks the directory complete and
names the format, so the package sends it here and a DDP run refuses it in one line instead of misreading it.

Every rank writes its own shards; non-tensor objects (scheduler, iteration, each rank's RNG state) are
pickled by DCP and read back through common.loading (safe_load.py's restricted unpicklers). Saving, run.json
and `latest` are the package's (training/checkpoint/__init__.py).
"""

from __future__ import annotations

import json
from pathlib import Path

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from megatron.core.distributed.fsdp.src.megatron_fsdp.uneven_dtensor import preprocess_state_dict_for_uneven_dtensor
from torch.distributed.tensor import DTensor

from training.checkpoint import rng
from training.checkpoint.common import CheckpointError, Start, TrainState, layout, loading, same_tp_pp
from training.config.schema import Config
from training.parallel import fsdp
from training.parallel.wrap import unwrap
from training.shims import upstream_fixes

FORMAT = "fsdp_dtensor"
METADATA = {"sharded_backend": FORMAT, "writer": "torch.distributed.checkpoint"}


def _fill_empty_shards(state: TrainState) -> None:
    """Adam state for the parameters whose shard on this rank is empty. torch's Adam creates state only for
    parameters with a gradient, and Megatron-FSDP gives none to an empty shard (its dummy init before a load
    skips them too), so ranks would list different DTensors, and the per-DTensor collectives of the save and
    load would pair different tensors across ranks and hang. Empty moments are what such a rank holds."""
    for optimizer in getattr(state.optimizer, "chained_optimizers", [state.optimizer]):
        adam = optimizer.optimizer
        step = next((s["step"] for s in adam.state.values() if "step" in s), torch.zeros(()))
        for group in adam.param_groups:
            for param in group["params"]:
                if param not in adam.state and param.to_local().numel() == 0:
                    empty = DTensor.from_local(torch.zeros_like(param.to_local()), param.device_mesh,
                                               param.placements, shape=param.shape, stride=param.stride())
                    adam.state[param] = {"step": step.clone(), "exp_avg": empty, "exp_avg_sq": empty.clone()}


def _state_dict(state: TrainState, is_loading: bool, rng_state: dict | None) -> dict:
    _fill_empty_shards(state)
    (chunk,) = state.model  # FullyShardedDataParallel: one chunk (PP=1)
    model = chunk.module.state_dict()  # MegatronFSDP: {"module.<our name>": DTensor of main weights}
    optimizer = state.optimizer.sharded_state_dict(model, is_loading=is_loading,
                                                   metadata={"distrib_optim_sharding_type": FORMAT})
    out = {"model": model, "optimizer": optimizer, "scheduler": state.scheduler.state_dict()}
    if rng_state is not None:  # one entry per rank: DCP keeps every rank's object under its own key
        out[f"rng_state.rank{dist.get_rank()}"] = rng_state
    return out


def save(cfg: Config, state: TrainState, path: Path, extra: dict, model_only: bool) -> None:
    """Write this rank's shards into `path` (every rank calls it; extra: iteration, consumed_samples; always
    the whole state, model_only or not); then rank 0 marks the directory."""
    sd = {**_state_dict(state, is_loading=False, rng_state=rng.get_state()), **extra}
    preprocess_state_dict_for_uneven_dtensor(sd)
    dcp.save(sd, storage_writer=dcp.FileSystemWriter(str(path)))
    if dist.get_rank() == 0:
        (path / "metadata.json").write_text(json.dumps(METADATA) + "\n")


def is_fsdp_checkpoint(path: Path) -> bool:
    try:
        return json.loads((path / "metadata.json").read_text()).get("sharded_backend") == FORMAT
    except (OSError, ValueError):
        return False


def _read(state: TrainState, path: Path, rng_template: dict | None, extra: dict) -> dict:
    """Fill the model, the optimizer and the scheduler from `path` in place; returns the loaded `extra`
    entries and `rng_state` (this rank's, when rng_template is given: the same layout)."""
    sd = {**_state_dict(state, is_loading=True, rng_state=rng_template), **extra}  # is_loading: Adam's state exists
    preprocess_state_dict_for_uneven_dtensor(sd)
    dcp.load(sd, storage_reader=dcp.FileSystemReader(str(path)))
    (chunk,) = state.model
    chunk.load_state_dict(sd["model"])  # the main weights were loaded in place; this installs the model copy
    upstream_fixes.saved_groups_at_current_lr(state.optimizer, sd["optimizer"])
    state.optimizer.load_state_dict(sd["optimizer"])
    state.scheduler.load_state_dict(sd["scheduler"])
    out = {key: sd[key] for key in extra}
    if rng_template is not None:
        out["rng_state"] = sd[f"rng_state.rank{dist.get_rank()}"]
    return out


def load(cfg: Config, state: TrainState, path: Path, run: dict, weights_only: bool, announce) -> Start:
    """An FSDP checkpoint into an FSDP run at the same TP and PP, any DP size and either sharding strategy;
    its weights alone into a run without FSDP at tp 1, pp 1. A torch_dist checkpoint's weights start an FSDP
    fine-tune (loaded before FSDP wrapped the model: the package's fsdp_weights_loader); nothing else crosses
    the formats (one line)."""
    saved = run["config"]["parallel"].get("fsdp", "none")
    if fsdp.enabled(cfg) and saved == "none" and weights_only:  # loaded already, by fsdp_weights_loader
        announce(f"fine-tuning from the weights of {path} (fresh optimizer, schedule and data order)")
        return Start()
    if saved != "none" and not fsdp.enabled(cfg) and weights_only and _single_rank_layout(run, layout()):
        load_full_weights(state, path)  # an export, generation, evaluation, or a DDP fine-tune at tp 1, pp 1
        announce(f"loaded the weights of {path} (parallel.fsdp={saved}, iteration {run['iteration']}) into "
                 f"parallel.fsdp=none")
        return Start()
    if not (fsdp.enabled(cfg) and saved != "none") or weights_only:
        how = ("parallel.fsdp=optim_grads or optim_grads_params (any DP size); its weights alone load without "
               "FSDP at tp 1 and pp 1 (checkpoint.finetune=true: fine-tune, export, generate, evaluate)"
               if saved != "none" else "parallel.fsdp=none (TP, PP and DP may change)")
        raise CheckpointError(f"checkpoint {path} was saved with parallel.fsdp={saved} but this run has "
                              f"parallel.fsdp={cfg.parallel.fsdp}{' and checkpoint.finetune' * weights_only}: "
                              f"the fsdp_dtensor and torch_dist formats do not cross here; resume with {how}")
    if not same_tp_pp(run):
        raise CheckpointError(f"checkpoint {path} (parallel.fsdp={saved}) was saved at tp {run['layout']['tp']} pp "
                              f"{run['layout']['pp']}: resume a Megatron-FSDP checkpoint at the same TP and PP "
                              f"(the DP size may change)")
    same_ranks = run["layout"] == layout()
    with loading(f"checkpoint {path}", path):
        loaded = _read(state, path, rng.get_state() if same_ranks else None, {"iteration": 0, "consumed_samples": 0})
    if same_ranks:
        rng.set_state(loaded["rng_state"])
    announce(f"loaded checkpoint {path} (iteration {loaded['iteration']}, parallel.fsdp={saved})")
    return Start(int(loaded["iteration"]), int(loaded["consumed_samples"]), True, run.get("train_samples"),
                 run.get("config"))


def _single_rank_layout(run: dict, now: dict) -> bool:
    """Saved at tp 1 and pp 1 (its DTensors are then whole tensors split over DP only) and loaded at tp 1, pp 1."""
    return all(sizes[k] == 1 for sizes in (run["layout"], now) for k in ("tp", "pp"))


def load_full_weights(state: TrainState, path: Path) -> None:
    """The weights of an fsdp_dtensor checkpoint (saved at tp 1, pp 1: its fp32 main weights, split over DP)
    into a model that Megatron-FSDP does not wrap, at tp 1 and pp 1: DCP reads every DP shard of each whole
    tensor by its offsets. A bf16 model rounds them; its optimizer's fp32 main weights are reloaded."""
    (chunk,) = state.model
    params = dict(unwrap(chunk).named_parameters())
    reader = dcp.FileSystemReader(str(path))
    with loading(f"the weights of {path}", path):  # the index (.metadata) is a pickle too
        saved = [k for k in reader.read_metadata().state_dict_metadata if k.startswith("model.")]
    anchor = next(iter(params))
    prefix = next((k[len("model."): -len(anchor)] for k in saved if k.endswith("." + anchor)), None)
    missing = [n for n in params if prefix is None or f"model.{prefix}{n}" not in saved]
    if missing:
        raise CheckpointError(f"checkpoint {path} has no saved weight for {missing[:3]} (of {len(missing)}): "
                              f"not this model's checkpoint")
    model = {prefix + n: torch.empty(p.shape, dtype=torch.float32, device=p.device)
             for n, p in params.items()}  # [full shape] fp32: the saved main weights
    with loading(f"the weights of {path}", path):
        dcp.load({"model": model}, storage_reader=reader)
    with torch.no_grad():
        for n, p in params.items():
            p.copy_(model[prefix + n])
    if state.optimizer is not None:
        state.optimizer.reload_model_params()
