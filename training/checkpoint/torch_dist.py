"""The torch_dist format: Megatron-Core's dist_checkpointing, for DDP runs (plain or distributed optimizer);
it reshards across layouts.

An iter_* directory holds the model (one entry per chunk: common.model_keys), the optimizer, the scheduler,
the iteration, the consumed samples and one RNG state per (pp, tp) rank as sharded tensors and objects;
every rank writes its own shards, rank 0 the metadata (`metadata.json`, `.metadata`, `integrity.json`,
checked on load). The distributed optimizer is saved `fully_reshardable`, so TP / PP / DP may change on
load and Adam's moments follow the parameters; the RNG states are restored only at the saved TP and PP.
A LoRA fine-tune from a base checkpoint saves the adapters (and peft.trainable) only, the base named in
run.json (training/config/checkpoint_match.py lora_base): loading one fills the rest from that base first.
Saving, run.json and `latest` are the package's (training/checkpoint/__init__.py); loading goes through
common.loading (restricted unpicklers: training/checkpoint/safe_load.py).
"""

from __future__ import annotations

import fnmatch
from pathlib import Path

from megatron.core import dist_checkpointing, parallel_state
from megatron.core.dist_checkpointing.mapping import ShardedObject
from megatron.core.dist_checkpointing.strategies.nvrx import has_nvrx_async_support

from models.lora import is_adapter
from training.checkpoint import rng
from training.checkpoint.common import Start, TrainState, check_same_optimizer, loading, model_keys, same_tp_pp
from training.config.checkpoint_match import lora_base
from training.config.schema import Config
from training.parallel.dist import print0
from training.parallel.wrap import unwrap
from training.shims import upstream_fixes

# Background writes: nvidia-resiliency-ext's implementation where installed (NGC containers), else Megatron-Core's
# own ("mcore": a forked writer per save; deprecated upstream in favour of nvrx, still the one the synchronous
# save runs through)
ASYNC_STRATEGY = "nvrx" if has_nvrx_async_support() else "mcore"


def sharded_metadata(cfg: Config) -> dict:
    meta = {"singleton_local_shards": False, "chained_optim_avoid_prefix": True}
    if cfg.parallel.dist_opt:
        meta["distrib_optim_sharding_type"] = "fully_reshardable"
        meta["distrib_optim_fully_reshardable_mem_efficient"] = True  # the other path calls .cuda()
    return meta


def model_state_dict(cfg: Config, chunks: list) -> dict:
    """The model chunks' sharded state dicts (DDP does not forward sharded_state_dict: the unwrapped model's
    is the same, with the same keys)."""
    meta = sharded_metadata(cfg)
    return {key: unwrap(chunk).sharded_state_dict(metadata=meta) for key, chunk in zip(model_keys(chunks), chunks)}


def adapter_names(trainable) -> callable:
    """Which of a model's state-dict names an adapters-only checkpoint holds: the adapters and what the
    peft.trainable patterns name (the rest is the base's, frozen)."""
    patterns = list(trainable)
    return lambda name: is_adapter(name) or any(fnmatch.fnmatchcase(name, p) for p in patterns)


def select(sharded: dict, chunks: list, keep) -> dict:
    """The model chunks' entries whose names keep(name) accepts (the other entries as they are)."""
    return {key: {n: t for n, t in part.items() if keep(n)} if key in model_keys(chunks) else part
            for key, part in sharded.items()}


def state_dict(cfg: Config, state: TrainState, is_loading: bool, with_rng: bool = True,
               model_only: bool = False, adapters_only: bool = False) -> dict:
    """The sharded state dict dist_checkpointing saves / fills; adapters_only: of the model, only what
    adapter_names keeps (the optimizer holds nothing else)."""
    sharded = model_state_dict(cfg, state.model)
    if adapters_only:
        sharded = select(sharded, state.model, adapter_names(cfg.peft.trainable))
    if model_only:
        return sharded
    upstream_fixes.before_optimizer_state_dict(state.optimizer)
    sharded["optimizer"] = state.optimizer.sharded_state_dict(sharded, is_loading=is_loading,
                                                              metadata=sharded_metadata(cfg))
    sharded["scheduler"] = state.scheduler.state_dict()
    if with_rng:
        pp, tp = parallel_state.get_pipeline_model_parallel_rank(), parallel_state.get_tensor_model_parallel_rank()
        sharded["rng_state"] = ShardedObject(
            "rng_state", rng.get_state(),
            (parallel_state.get_pipeline_model_parallel_world_size(),
             parallel_state.get_tensor_model_parallel_world_size()),
            (pp, tp), replica_id=parallel_state.get_data_parallel_rank(with_context_parallel=True))
    return sharded


def save(cfg: Config, state: TrainState, path: Path, extra: dict, model_only: bool, background: bool = False,
         strategy=None):
    """Write this rank's shards into `path` (every rank calls it); extra: iteration, consumed_samples.
    model_only: the weights alone (conversions). background: plan the save (its collectives run now) and
    return Megatron-Core's AsyncRequest, which writes the shards and then, finalized on every rank, the
    metadata (background.py schedules it). strategy: a TorchDistSaveShardedStrategy writing the shards (default:
    Megatron-Core's)."""
    sharded = state_dict(cfg, state, is_loading=False, with_rng=not model_only, model_only=model_only,
                         adapters_only=lora_base(cfg) is not None)  # a LoRA fine-tune: its base is on disk
    sharded.update(extra)
    upstream_fixes.results_queue_dies_with_the_rank()  # its helper processes die with this rank
    return dist_checkpointing.save(sharded, str(path), strategy, verify_integrity=True, async_sharded_save=background,
                                   async_strategy=ASYNC_STRATEGY)


def load_weights(cfg: Config, path: Path, chunks: list) -> None:
    """A checkpoint's weights into bare model chunks (before Megatron-FSDP wraps them: an FSDP fine-tune from
    an HF import or a DDP run's checkpoint)."""
    with loading(f"the weights of {path}", path):
        loaded = dist_checkpointing.load(model_state_dict(cfg, chunks), str(path), verify_integrity=True)
    for key, chunk in zip(model_keys(chunks), chunks):
        unwrap(chunk).load_state_dict(loaded[key], strict=True)


def load_part(cfg: Config, chunks: list, path: Path, keep, what: str) -> None:
    """The model entries keep(name) accepts, from checkpoint `path`, into the chunks (the others stay)."""
    template = select(model_state_dict(cfg, chunks), chunks, keep)
    with loading(f"{what} checkpoint {path}", path):
        loaded = dist_checkpointing.load(template, str(path), verify_integrity=True)
    for key, chunk in zip(model_keys(chunks), chunks):
        missing, unexpected = unwrap(chunk).load_state_dict(loaded[key], strict=False)
        assert not unexpected and not any(keep(n) for n in missing), (missing, unexpected)


def saved_adapters(run: dict) -> bool:
    """Whether the checkpoint holds LoRA adapters (a peft run's); a base model's (an import, a pretraining run)
    does not: a LoRA fine-tune from it draws fresh adapters (models/lora.py) and loads the rest."""
    return str(run.get("config", {}).get("peft", {}).get("method", "none")) != "none"


def load(cfg: Config, state: TrainState, path: Path, run: dict, weights_only: bool, announce) -> Start:
    """Fill the model (and, resuming, the optimizer, scheduler and RNG states) from `path`, at any TP / PP / DP
    with the same parallel.dist_opt; weights_only: the run starts at iteration 0."""
    if not weights_only:
        check_same_optimizer(cfg, run, path)
    same_layout = same_tp_pp(run)
    template = state_dict(cfg, state, is_loading=True, with_rng=same_layout, model_only=weights_only)
    if not weights_only:
        template["iteration"], template["consumed_samples"] = 0, 0
    fresh_adapters = weights_only and not saved_adapters(run)  # peft=lora on a base: its adapters start here
    base = run.get("peft_base")  # an adapters-only checkpoint: the frozen rest from its base first
    keep = lambda name: True  # noqa: E731 - which model entries `path` fills
    if base:
        keep = adapter_names(run["config"]["peft"].get("trainable", []))
        load_part(cfg, state.model, Path(base["path"]), lambda name: not keep(name), "the LoRA base")
    elif fresh_adapters:
        keep = lambda name: not is_adapter(name)  # noqa: E731
    template = select(template, state.model, keep)
    with loading(f"checkpoint {path}", path):
        loaded = dist_checkpointing.load(template, str(path), verify_integrity=True)
    for key, chunk in zip(model_keys(state.model), state.model):
        if fresh_adapters or base:  # the rest: drawn at build (fresh adapters), or the base's (loaded above)
            missing, unexpected = unwrap(chunk).load_state_dict(loaded[key], strict=False)
            assert not unexpected and not any(keep(n) for n in missing), (missing, unexpected)
        else:
            chunk.load_state_dict(loaded[key], strict=True)
    if weights_only:
        if state.optimizer is not None:
            state.optimizer.reload_model_params()  # fp32 main params (bf16, distributed optimizer) follow
        announce(f"fine-tuning from the weights of {path} (fresh optimizer, schedule and data order)"
                 if state.optimizer is not None else f"loaded the weights of {path}")
        return Start()
    upstream_fixes.saved_groups_at_current_lr(state.optimizer, loaded["optimizer"])
    state.optimizer.load_state_dict(loaded["optimizer"])
    upstream_fixes.after_optimizer_load(state.optimizer)
    state.scheduler.load_state_dict(loaded["scheduler"])
    if same_layout:
        rng.set_state(loaded["rng_state"])
    else:
        print0(f"note: layout changed (saved tp/pp {run['layout']['tp']}/{run['layout']['pp']}); RNG "
               f"streams restart from the seed, weights and optimizer state are resharded")
    print0(f"loaded checkpoint {path} (iteration {loaded['iteration']})")
    return Start(int(loaded["iteration"]), int(loaded["consumed_samples"]), True, run.get("train_samples"),
                 run.get("config"))
