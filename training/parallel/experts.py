"""Mixture of experts and expert parallelism (parallel.ep, parallel.etp): the rules Megatron-Core's MoE layer
sets beyond the sizes (those are training/parallel/layout.py's shape_problems: experts over ep, the expert
FFN over etp). The MoE block itself is models/moe.py; the optimizer-state fix that lets a checkpoint move
between EP sizes is training/shims/upstream_fixes.py (mark_expert_params)."""

from __future__ import annotations

import importlib.util


def problems(cfg, layout) -> list[str]:
    m, moe = cfg.model, cfg.model.moe
    if not moe.num_experts:
        if layout.ep_enabled:
            return [f"parallel.ep={layout.ep} / parallel.etp={layout.etp} split experts: they need a "
                    f"mixture-of-experts model (model.moe.num_experts, e.g. model=moe_tiny)"]
        return []
    out: list[str] = []

    def need(ok: bool, message: str) -> None:
        if not ok:
            out.append(message)

    need(moe.num_experts >= 1 and 1 <= moe.top_k <= moe.num_experts,
         f"model.moe.top_k={moe.top_k} must be between 1 and model.moe.num_experts={moe.num_experts}")
    need(layout.tp == 1 or layout.sp, f"a mixture of experts with parallel.tp={layout.tp} needs parallel.sp=true "
                                      f"(Megatron-Core's MoE layer takes sequence-parallel tokens under TP)")
    need(not m.add_bias_linear or layout.etp == 1,
         f"model.add_bias_linear=true (experts with biases, gpt-oss) with parallel.etp={layout.etp}: Megatron-Core's "
         f"MoE layer takes expert biases only at parallel.etp=1")
    need(moe.layer_freq >= 1 and 0 <= moe.first_dense < m.num_layers,
         f"model.moe.layer_freq={moe.layer_freq} must be >= 1 and model.moe.first_dense={moe.first_dense} below "
         f"model.num_layers={m.num_layers}: at least one layer must be MoE")
    need(moe.aux_loss_coeff >= 0 and (moe.z_loss_coeff is None or moe.z_loss_coeff >= 0),
         "model.moe.aux_loss_coeff and model.moe.z_loss_coeff must be >= 0")
    need(moe.capacity_factor is None or moe.capacity_factor > 0,
         f"model.moe.capacity_factor={moe.capacity_factor} must be > 0 (null: no token dropping)")
    need(not moe.grouped_gemm or importlib.util.find_spec("transformer_engine") is not None,
         "model.moe.grouped_gemm=true needs Transformer Engine (the NGC PyTorch container has it)")
    return out + router_problems(moe)


def router_problems(moe) -> list[str]:
    """DeepSeek-V3's routing options as Megatron-Core's TopKRouter reads them (its own asserts, as one line)."""
    out, groups, pick = [], moe.router_num_groups, moe.router_group_topk
    if moe.router_expert_bias and str(moe.score_function) != "sigmoid":
        out.append(f"model.moe.router_expert_bias=true needs model.moe.score_function=sigmoid (is "
                   f"{moe.score_function}): Megatron-Core's aux-loss-free routing biases sigmoid scores")
    if (groups is None) != (pick is None) or groups is not None and not (
            moe.num_experts % groups == 0 and 1 <= pick <= groups and moe.top_k % pick == 0
            and moe.top_k // pick <= moe.num_experts // groups):
        out.append(f"model.moe.router_num_groups={groups} and router_group_topk={pick}: both or neither; the "
                   f"{moe.num_experts} experts in equal groups, 1 <= group_topk <= groups, and top_k={moe.top_k} "
                   f"a multiple of group_topk with top_k / group_topk experts per group at most")
    return out
