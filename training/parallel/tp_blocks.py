"""Minimal tensor parallelism (parallel.tp_blocks): tp splits only the named sub-blocks (attention, mlp, vocab);
the others run whole on every rank of the TP group, as on one GPU, with no TP communication.

The model side is models/tp_blocks.py (replicated sub-blocks are built from a one-TP-rank config; their
parameters are TP duplicates, like the norms'); the memory estimate and the planner count a replicated block
whole (models/shape.py's Split.of); checkpoints hold the same global tensors either way and reshard between
full TP, partial TP and one process. Here: the rules, checked before any process group.

Sequence parallelism is refused with a replicated sub-block: SP keeps the residual stream sharded along the
sequence, and a whole attention (or output layer) would have to gather it back, which is TP communication again.
"""

from __future__ import annotations

from models.tp_blocks import TP_BLOCKS


def problems(cfg, layout) -> list[str]:
    given = [str(b) for b in cfg.parallel.tp_blocks]
    shown = f"[{','.join(given)}]"
    if not given:
        return [f"parallel.tp_blocks={shown} is empty: name the sub-blocks tp splits ({', '.join(TP_BLOCKS)}), "
                f"or use parallel.tp=1"]
    if len(set(given)) != len(given):
        return [f"parallel.tp_blocks={shown} names a sub-block twice"]
    if not layout.partial_tp:
        return []
    out = []
    if layout.sp:
        out.append(f"parallel.sp=true with parallel.tp_blocks={shown} is not supported: sequence parallelism "
                   f"shards the activations a replicated sub-block needs whole; use parallel.sp=false")
    if layout.fsdp_enabled:
        out.append(f"parallel.fsdp={layout.fsdp} with parallel.tp_blocks={shown} is not supported here: use "
                   f"parallel.fsdp=none (DDP, parallel.dist_opt=true shards the optimizer state)")
    if cfg.model.moe.num_experts and "mlp" not in given:
        out.append(f"parallel.tp_blocks={shown} leaves out mlp in a mixture of experts: its MoE layers split "
                   f"over tp (expert TP); add mlp")
    return out
