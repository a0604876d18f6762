"""peft=lora: low-rank adapters on the target linears (models/lora.py), every other weight frozen. Here: the rules,
checked before any process group, and the two steps the engine takes (training/engine/build.py):

    peft.adapt(cfg, chunks, record)    # while the model is built: adapters drawn by name like every weight
    peft.freeze(cfg, chunks)           # before DDP: only adapters (and peft.trainable) keep requires_grad

Frozen weights are then invisible to the training machinery by Megatron-Core's own rules: DDP allocates
gradient buffers for parameters with requires_grad only (so no main_grad, no DP reduction for the base), the
optimizer (plain or distributed: its shards are cut from those buffers) takes only those, and the TP layers run
the frozen-weight linear (`linear_with_frozen_weight`: no weight gradient computed). Adapters are dense
parameters: reduced over DP x CP, and summed over TP by finalize_model_grads where SP makes them partial.
"""

from __future__ import annotations

import fnmatch

from training.errors import ConfigError

# models.lora and Megatron-Core are imported where the model is built: the rules run in tools/check_config.py
# before torchrun, which imports no Megatron-Core (seconds, and its import-time warnings)


def enabled(cfg) -> bool:
    return str(cfg.peft.method) != "none"


def problems(cfg, layout) -> list[str]:
    if not enabled(cfg):
        return []
    p, out = cfg.peft, []
    if p.rank < 1:
        out.append(f"peft.rank={p.rank} must be >= 1")
    if p.alpha <= 0:
        out.append(f"peft.alpha={p.alpha} must be > 0 (the adapter's scale is alpha / rank)")
    if not 0.0 <= p.dropout < 1.0:
        out.append(f"peft.dropout={p.dropout} must be in [0, 1)")
    if not p.targets or len(set(p.targets)) != len(p.targets):
        out.append(f"peft.targets={list(p.targets)} must name each target linear once (e.g. [linear_qkv, "
                   f"linear_proj, linear_fc1, linear_fc2])")
    if layout.fsdp_enabled:
        out.append(f"peft.method=lora with parallel.fsdp={cfg.parallel.fsdp} is not supported: Megatron-FSDP "
                   f"shards frozen and trainable weights alike (untested here); use parallel.fsdp=none with "
                   f"parallel.dist_opt=true")
    if cfg.model.moe.num_experts:
        out.append(f"peft.method=lora with model.moe.num_experts={cfg.model.moe.num_experts} is not supported yet: "
                   f"the experts' linears take no adapters; use a dense model")
    if cfg.model.compile:
        out.append("peft.method=lora with model.compile=true is not supported yet (not proven equal to eager with "
                   "adapters); set model.compile=false")
    return out


def adapt(cfg, chunks, record=None) -> None:
    """Add the adapters to every chunk (record: training/engine/init.py draws them by checkpoint key). A
    target that names no linear of the model is the user's error."""
    if not enabled(cfg):
        return
    from models.lora import adaptable_names, add_adapters

    p, found = cfg.peft, {name: 0 for name in cfg.peft.targets}
    for chunk in chunks:
        for name, count in add_adapters(chunk, p.targets, p.rank, p.alpha, p.dropout, record).items():
            found[name] += count
    if missing := [name for name, count in found.items() if not count]:
        known = sorted({n for chunk in chunks for n in adaptable_names(chunk)})
        raise ConfigError(f"peft.targets: {missing} name no linear of this model; its linears are {known}")


def freeze(cfg, chunks) -> int:
    """requires_grad only on the adapters and the parameters peft.trainable names; returns how many
    parameter tensors train on this rank. A trainable pattern that matches nothing (checked where one rank
    holds every layer: pp = 1) is the user's error."""
    if not enabled(cfg):
        return sum(1 for chunk in chunks for _ in chunk.parameters())
    from megatron.core import parallel_state

    from models.lora import is_adapter

    patterns, matched, trainable = list(cfg.peft.trainable), set(), 0
    for chunk in chunks:
        for name, param in chunk.named_parameters():
            name = name.removeprefix("module.")  # Float16Module (bf16)
            hits = {pat for pat in patterns if fnmatch.fnmatchcase(name, pat)}
            matched |= hits
            param.requires_grad_(is_adapter(name) or bool(hits))
            trainable += param.requires_grad
    whole = parallel_state.get_pipeline_model_parallel_world_size() == 1  # a stage holds only its parameters
    if whole and (unmatched := [pat for pat in patterns if pat not in matched]):
        raise ConfigError(f"peft.trainable: {unmatched} match no parameter of the model (names look "
                          f"like decoder.layers.0.input_layernorm.weight; patterns are fnmatch's, e.g. "
                          f"'*layernorm*')")
    return trainable
