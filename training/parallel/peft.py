"""peft=lora: low-rank adapters on the target linears (models/lora.py), every other weight frozen. Here: the rules,
checked before any process group, and the two steps the engine takes (training/engine/build.py):

    peft.adapt(cfg, chunks, record)    # while the model is built: adapters drawn by name like every weight
    peft.freeze(cfg, chunks)           # before DDP: only adapters (and peft.trainable) keep requires_grad

Frozen weights are then invisible to the training machinery by Megatron-Core's own rules: DDP allocates
gradient buffers for parameters with requires_grad only (so no main_grad, no DP reduction for the base), the
optimizer (plain or distributed: its shards are cut from those buffers) takes only those, and the TP layers run
the frozen-weight linear (`linear_with_frozen_weight`: no weight gradient computed). Adapters are dense
parameters: reduced over DP x CP, and summed over TP by finalize_model_grads where SP makes them partial; an
expert's are expert parameters (allreduce=False, as its weights): DDP's expert buffer, reduced over expert DP.
"""

from __future__ import annotations

import fnmatch

from training.errors import ConfigError

# models.lora and Megatron-Core are imported where the model is built: the rules run in tools/check_config.py
# before torchrun, which imports no Megatron-Core (seconds, and its import-time warnings)

# canonical LoRA (models/lora_split.py): a fused linear -> the targets of its parts, in its layout's order, each
# with its own A and B (Hugging Face PEFT's q_proj / k_proj / v_proj, gate_proj / up_proj)
SPLIT = {"linear_qkv": ("linear_q", "linear_k", "linear_v"), "linear_fc1": ("linear_fc1_gate", "linear_fc1_up")}


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
    for fused, split in SPLIT.items():
        if fused in p.targets and (named := [t for t in split if t in p.targets]):
            out.append(f"peft.targets names {fused} (one adapter, its A shared by {', '.join(split)}) and {named} "
                       f"(their own adapters): choose one form, [{fused}] or [{', '.join(split)}]")
    if str(cfg.model.activation) not in ("swiglu", "geglu_tanh", "clamped_swiglu") and \
            (gated := [t for t in SPLIT["linear_fc1"] if t in p.targets]):
        out.append(f"peft.targets={gated} need a gated MLP (gate|up fc1), not model.activation={cfg.model.activation}"
                   f": use linear_fc1")
    if layout.fsdp_enabled:
        out.append(f"peft.method=lora with parallel.fsdp={cfg.parallel.fsdp} is not supported: Megatron-FSDP "
                   f"shards frozen and trainable weights alike (untested here); use parallel.fsdp=none with "
                   f"parallel.dist_opt=true")
    out += _moe_problems(cfg)
    if cfg.model.compile:
        out.append("peft.method=lora with model.compile=true is not supported yet (not proven equal to eager with "
                   "adapters); set model.compile=false")
    return out


def _moe_problems(cfg) -> list[str]:
    """A mixture of experts: linear_fc1 / linear_fc2 adapt every routed expert's (each its own A and B, EP- and
    expert-TP-sharded as its weights: models/lora.py); what has no adapters yet is refused."""
    moe, out = cfg.model.moe, []
    if not moe.num_experts:
        return out
    if moe.grouped_gemm:
        out.append("peft.method=lora with model.moe.grouped_gemm=true is not supported: Transformer Engine's grouped "
                   "experts take no adapters; set model.moe.grouped_gemm=false")
    if moe.shared_expert_ffn_hidden_size:
        out.append(f"peft.method=lora with model.moe.shared_expert_ffn_hidden_size="
                   f"{moe.shared_expert_ffn_hidden_size} is not supported yet: the shared expert's linears take no "
                   f"adapters; use a model without a shared expert")
    if split := [t for t in SPLIT["linear_fc1"] if t in cfg.peft.targets]:
        out.append(f"peft.targets={split} (separate gate / up adapters) are not built for a mixture of experts' "
                   f"linears yet: use linear_fc1")
    return out


def adapt(cfg, chunks, record=None) -> None:
    """Add the adapters to every chunk (record: training/engine/init.py draws them by checkpoint key). A
    target that names no linear of the model is the user's error."""
    if not enabled(cfg):
        return
    from models.lora import adaptable_names, add_adapters
    from models.lora_split import add_split_adapters

    p, found = cfg.peft, {name: 0 for name in cfg.peft.targets}
    parts = {t for split in SPLIT.values() for t in split}
    for chunk in chunks:
        fused = [t for t in p.targets if t not in parts]
        for name, count in add_adapters(chunk, fused, p.rank, p.alpha, p.dropout, record).items():
            found[name] += count
        for linear, split in SPLIT.items():  # canonical: one adapter per named part of the fused linear
            if any(names := tuple(t if t in p.targets else None for t in split)):
                count = add_split_adapters(chunk, linear, names, p.rank, p.alpha, p.dropout, record)
                found.update({t: found[t] + count for t in names if t is not None})
    if missing := [name for name, count in found.items() if not count]:
        names = {n for chunk in chunks for n in adaptable_names(chunk)}
        known = sorted(names | {t for linear, split in SPLIT.items() if linear in names for t in split})
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
