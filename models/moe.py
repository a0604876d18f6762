"""Mixture-of-experts MLP: Megatron-Core's MoELayer, a block like any other (models/spec.py: "moe").

    router (TopKRouter, [E, h], replicated) -> token dispatcher (alltoall over the expert-parallel group, or
    allgather) -> this rank's E/ep experts (SequentialMLP of models/linear.py's ColumnParallelLinear /
    RowParallelLinear over the expert-tensor-parallel group, so LoRA can ride on them; TE's TEGroupedMLP with
    model.moe.grouped_gemm) -> combine (+ shared expert)

ModelShape puts "moe" in the MLP of the layers model.moe chooses (model.moe.first_dense, layer_freq); the
rest keep model.mlp. Everything else is Megatron-Core's: expert parameters are marked allreduce=False, so
DDP gives them their own buffer reduced over the expert-data-parallel group and the optimizer becomes a
chain (dense + expert); the router attaches its load-balancing loss (and z-loss) to the activations with
its own gradient scale (MoEAuxLossAutoScaler). This file adds what the template reads: the parameter
count per GPU and the FLOPs of the active experts, the statistics for the logs (the router's losses and
the tokens each expert got, models/extra_losses.py), and the Hugging Face (Mixtral) weight mapping.
Megatron-Core's MoE layer needs sequence parallelism with TP > 1 (training/parallel/experts.py). With
model.add_bias_linear (gpt-oss) the router and every expert projection carry a bias; Megatron-Core's expert MLP
adds fc2's weighted by the token's routing probability, as gpt-oss does.
"""

from __future__ import annotations

from functools import partial

import torch
from megatron.core.models.gpt.moe_module_specs import get_moe_module_spec
from megatron.core.transformer.mlp import MLPSubmodules
from megatron.core.transformer.moe.moe_layer import MoELayer, MoESubmodules
from megatron.core.transformer.moe.router import TopKRouter
from megatron.core.transformer.transformer_config import TransformerConfig

from models.activations import ActivationContext
from models.extra_losses import Stat, record, record_mean
from models.linear import ColumnParallelLinear, RowParallelLinear
from models.shape import ModelShape, Split

AUX_LOSS, Z_LOSS, IMBALANCE = "load_balancing_loss", "z_loss", "moe_load_imbalance"


class Router(TopKRouter):
    """Megatron-Core's TopKRouter, recording for the logs (once per training micro-batch: only with grad
    enabled, as the router applies its losses) its losses, unscaled, and the tokens routed to each expert."""

    def attach_and_log_load_balancing_loss(self, activation, aux_loss_coeff, aux_loss, aux_loss_name,
                                           reduce_group, needs_dp_avg=True, valid_token_count=None):
        # Under SP each TP rank's aux_loss is its sequence shard's part of the micro-batch's loss (the expert
        # loads are TP-global, the scores local): the shards sum to it. Times the group size, the token mean
        # over the TP ranks that the logs take is that sum.
        tokens = valid_token_count if valid_token_count is not None else activation.shape[0]
        record_mean(aux_loss_name, aux_loss / aux_loss_coeff * reduce_group.size(), int(tokens))
        return super().attach_and_log_load_balancing_loss(activation, aux_loss_coeff, aux_loss, aux_loss_name,
                                                          reduce_group, needs_dp_avg, valid_token_count)

    def apply_z_loss(self, logits, padding_mask=None):  # logits [tokens, E]
        if self.config.moe_z_loss_coeff is not None and self.training and torch.is_grad_enabled():
            record_mean(Z_LOSS, torch.logsumexp(logits.float(), dim=-1).square().mean(), logits.shape[0])
        return super().apply_z_loss(logits, padding_mask)

    def routing(self, logits, padding_mask=None):
        probs, routing_map = super().routing(logits, padding_mask)  # routing_map [tokens, E] bool
        if self.training and torch.is_grad_enabled():
            load = torch.zeros(self.config.num_layers, self.num_experts, device=routing_map.device)
            load[self.layer_number - 1] = routing_map.sum(dim=0)  # this layer's tokens per expert
            record(IMBALANCE, load)
        return probs, routing_map


def imbalance(load: torch.Tensor, num_layers: int, num_experts: int) -> float | None:
    """Tokens per expert summed over the step and every rank, [layers x E] -> the mean over MoE layers of
    (max / mean): 1.0 is perfectly balanced, E is every token on one expert."""
    per_layer = load.view(num_layers, num_experts)
    per_layer = per_layer[per_layer.sum(dim=1) > 0]
    if per_layer.numel() == 0:
        return None
    return (per_layer.max(dim=1).values / per_layer.mean(dim=1)).mean().item()


class MoE(MoELayer):
    extra_losses = (AUX_LOSS, Z_LOSS)  # recorded by Router when their coefficients are set

    def __init__(self, config: TransformerConfig, layer_number: int | None = None):
        grouped = config.moe_grouped_gemm  # TEGroupedMLP; else SequentialMLP over our linears (adaptable)
        spec = get_moe_module_spec(use_te=grouped, num_experts=config.num_moe_experts, moe_grouped_gemm=grouped)
        parts = spec.keywords["submodules"]
        experts = parts.experts
        if not grouped:  # Megatron-Core's linears' subclasses: the same weights and keys, plus LoRA (models/lora.py)
            mlp = experts.keywords["submodules"]
            experts = partial(experts.func, submodules=MLPSubmodules(ColumnParallelLinear, RowParallelLinear,
                                                                     mlp.activation_func))
        submodules = MoESubmodules(experts=experts, shared_experts=parts.shared_experts, router=Router)
        super().__init__(config, submodules=submodules, layer_number=layer_number)
        self.set_layer_number(layer_number)  # the router's too (its statistics are per layer)

    def forward(self, x: torch.Tensor):  # [s(/tp), b, h] -> ([s(/tp), b, h], None)
        return super().forward(x)

    @staticmethod
    def extra_stats(shape: ModelShape) -> dict[str, Stat]:
        rows, experts = shape.num_layers, shape.num_experts
        return {IMBALANCE: Stat(rows * experts, lambda load: imbalance(load, rows, experts))}

    @staticmethod
    def num_expert_params(shape: ModelShape, split: Split) -> int:
        """The routed experts on one GPU: E/ep of them, each split over etp (fc2's bias whole on each)."""
        h, ffn, fc1 = shape.hidden_size, shape.moe_ffn_hidden_size, 2 if shape.gated else 1
        bias = fc1 * ffn // split.etp + h if shape.add_bias_linear else 0
        return shape.num_experts // split.ep * ((h * fc1 * ffn + ffn * h) // split.etp + bias)

    @staticmethod
    def num_params(shape: ModelShape, split: Split) -> int:
        """On one GPU: the router (replicated), the routed experts, the shared expert split over tp; biases
        (model.add_bias_linear, gpt-oss): the router's and the experts'."""
        h, shared, fc1 = shape.hidden_size, shape.moe_shared_ffn_hidden_size or 0, 2 if shape.gated else 1
        router = shape.num_experts * (h + shape.add_bias_linear)
        shared_bias = fc1 * shared // split.tp + h if shape.add_bias_linear and shared else 0
        return router + MoE.num_expert_params(shape, split) + (h * fc1 * shared + shared * h) // split.tp + shared_bias

    @staticmethod
    def flops_per_token(shape: ModelShape) -> float:
        """The active experts' GEMMs (top-k of them) and the shared expert's, as Megatron-LM counts them (the
        router's E x h GEMM is not counted there either)."""
        gemms = 3 if shape.gated else 2
        ffn = shape.moe_top_k * shape.moe_ffn_hidden_size + (shape.moe_shared_ffn_hidden_size or 0)
        return 2 * shape.hidden_size * ffn * gemms

    @staticmethod
    def activation_bytes(shape: ModelShape, split: Split, act: ActivationContext) -> float:
        """What Megatron-Core 0.19.2's MoELayer keeps (SequentialMLP experts, balanced routing assumed; measured
        at tp 1, the expert-TP gather read in token_dispatcher.py): the input [s(/tp), b, h]; the permuted token
        copies this rank's experts take (k per token, gathered over expert TP) and per copy the expert's
        ffn/etp-wide tensors; the router's fp32 scores and routing indices; the shared expert's tensors (a
        Megatron-Core MLP on the whole micro-batch, ffn_shared/tp wide)."""
        e, h, k = act.bytes, shape.hidden_size, shape.moe_top_k
        tokens = act.tokens / act.seq_split(split)  # this rank's tokens (MoE with TP needs SP)
        copies = tokens * k * split.etp  # what this rank's experts compute (token_dispatcher gathers over ETP)
        # per copy, unfused SwiGLU: fc1 out (gate|up), SiLU(gate), up + offset (a copy), the product, x its
        # routing probability (fc2's input); fused (weighted_bias_swiglu_impl): fc1 out and fc2's input;
        # GELU: fc1 out, GELU out, x probability; gpt-oss's clamped SwiGLU unfused: fc1 out (2), min(gate, limit),
        # its sigmoid, the quick GELU, clamp(up) + 1, the product, x probability
        expert = 3 if not shape.gated or act.fused else 8 if shape.activation == "clamped_swiglu" else 6
        shared = (shape.moe_shared_ffn_hidden_size or 0) * (2 if not shape.gated else 3 if act.fused else 5)
        routing = tokens * (12 * shape.num_experts + 32 * k)  # fp32 scores, int64 sort index; 32 bytes per top-k slot
        return e * (tokens * h + copies * (h + expert * shape.moe_ffn_hidden_size / split.etp) +
                    act.tokens * shared / split.tp) + routing

    # ---- Hugging Face interop (Mixtral, Qwen3-MoE): this block's weights <-> HF's MoE block ------------------------
    # The router is `gate.weight` [E, h]; expert j's gate, up and down projections are Mixtral's w1, w3, w2 (under
    # `block_sparse_moe`) or Qwen3-MoE's gate_proj, up_proj, down_proj (under `mlp`; Qwen3 is the family with
    # QK-norm): our local_experts.j.linear_fc1 = [gate; up] ([2*ffn, h], as models/mlp.py's SwiGLU), linear_fc2 =
    # down. The full (ep=1) model holds every expert. transformers >= 5 keeps the experts fused in memory
    # (mlp.experts.gate_up_proj [E, 2*ffn, h], down_proj [E, h, ffn]) and converts this, the checkpoints' format.
    # gpt-oss (config.hf_family, set by training/interop/hf.py) keeps its experts fused on disk too, with biases and
    # gate / up interleaved: gate_up_proj [E, h, 2*ffn] (x @ W: transposed), columns 0::2 the gate, 1::2 the up;
    # gate_up_proj_bias [E, 2*ffn] the same; down_proj [E, ffn, h], down_proj_bias [E, h]; the router's bias.
    # DeepSeek-V3 (multi-latent attention: config.mla): Qwen3-MoE's names, the router's expert bias
    # `gate.e_score_correction_bias` (Megatron-Core's `expert_bias` buffer), the shared expert `shared_experts`.
    @staticmethod
    def hf_name(config: TransformerConfig) -> str:
        return "mlp" if config.qk_layernorm or _gpt_oss(config) or getattr(config, "mla", None) is not None \
            else "block_sparse_moe"

    @staticmethod
    def from_hf(get, config: TransformerConfig) -> dict[str, torch.Tensor]:
        if _gpt_oss(config):
            return _from_gpt_oss(get, config)
        gate, up, down = _hf_expert_names(config)
        out = {"router.weight": get("gate.weight"), **{ours: get(hf) for ours, hf in _deepseek(config)}}
        if config.moe_shared_expert_intermediate_size:  # [gate; up] as the experts'
            out["shared_experts.linear_fc1.weight"] = torch.cat([get(f"shared_experts.{gate}.weight"),
                                                                 get(f"shared_experts.{up}.weight")])
            out["shared_experts.linear_fc2.weight"] = get(f"shared_experts.{down}.weight")
        for j in range(config.num_moe_experts):
            ours = f"experts.local_experts.{j}."
            out[ours + "linear_fc1.weight"] = torch.cat([get(f"experts.{j}.{gate}.weight"),
                                                         get(f"experts.{j}.{up}.weight")])
            out[ours + "linear_fc2.weight"] = get(f"experts.{j}.{down}.weight")
        return out

    @staticmethod
    def to_hf(get, config: TransformerConfig) -> dict[str, torch.Tensor]:
        if _gpt_oss(config):
            return _to_gpt_oss(get, config)
        gate, up, down = _hf_expert_names(config)
        out = {"gate.weight": get("router.weight"), **{hf: get(ours) for ours, hf in _deepseek(config)}}
        if config.moe_shared_expert_intermediate_size:
            out[f"shared_experts.{gate}.weight"], out[f"shared_experts.{up}.weight"] = torch.chunk(
                get("shared_experts.linear_fc1.weight"), 2)
            out[f"shared_experts.{down}.weight"] = get("shared_experts.linear_fc2.weight")
        for j in range(config.num_moe_experts):
            ours = f"experts.local_experts.{j}."
            out[f"experts.{j}.{gate}.weight"], out[f"experts.{j}.{up}.weight"] = torch.chunk(
                get(ours + "linear_fc1.weight"), 2)  # [ffn, h] each
            out[f"experts.{j}.{down}.weight"] = get(ours + "linear_fc2.weight")
        return out


def _deepseek(config: TransformerConfig) -> list[tuple[str, str]]:
    """(ours, HF's) router expert bias, when the router has one."""
    return [("router.expert_bias", "gate.e_score_correction_bias")] if config.moe_router_enable_expert_bias else []


def _hf_expert_names(config: TransformerConfig) -> tuple[str, str, str]:
    return ("gate_proj", "up_proj", "down_proj") if MoE.hf_name(config) == "mlp" else ("w1", "w3", "w2")


def _gpt_oss(config: TransformerConfig) -> bool:
    return getattr(config, "hf_family", None) == "gpt_oss"


def _from_gpt_oss(get, config: TransformerConfig) -> dict[str, torch.Tensor]:
    out = {"router.weight": get("router.weight"), "router.bias": get("router.bias")}
    gate_up, gate_up_bias = get("experts.gate_up_proj"), get("experts.gate_up_proj_bias")  # [E, h, 2*ffn], [E, 2*ffn]
    down, down_bias = get("experts.down_proj"), get("experts.down_proj_bias")  # [E, ffn, h], [E, h]
    for j in range(config.num_moe_experts):
        ours = f"experts.local_experts.{j}."
        w, b = gate_up[j].t(), gate_up_bias[j]  # [2*ffn, h] rows gate, up, gate, up, ...; [2*ffn]
        out[ours + "linear_fc1.weight"] = torch.cat([w[0::2], w[1::2]])  # [gate; up] [2*ffn, h]
        out[ours + "linear_fc1.bias"] = torch.cat([b[0::2], b[1::2]])
        out[ours + "linear_fc2.weight"] = down[j].t().contiguous()  # [h, ffn]
        out[ours + "linear_fc2.bias"] = down_bias[j]
    return out


def _to_gpt_oss(get, config: TransformerConfig) -> dict[str, torch.Tensor]:
    fc1, fc1_bias, fc2, fc2_bias = [], [], [], []
    for j in range(config.num_moe_experts):
        ours = f"experts.local_experts.{j}."
        gate, up = torch.chunk(get(ours + "linear_fc1.weight"), 2)  # [ffn, h] each
        fc1.append(torch.stack([gate, up], dim=1).flatten(0, 1).t())  # interleaved rows -> [h, 2*ffn]
        gate_b, up_b = torch.chunk(get(ours + "linear_fc1.bias"), 2)
        fc1_bias.append(torch.stack([gate_b, up_b], dim=1).flatten())  # [2*ffn]
        fc2.append(get(ours + "linear_fc2.weight").t())  # [ffn, h]
        fc2_bias.append(get(ours + "linear_fc2.bias"))
    return {"router.weight": get("router.weight"), "router.bias": get("router.bias"),
            "experts.gate_up_proj": torch.stack(fc1), "experts.gate_up_proj_bias": torch.stack(fc1_bias),
            "experts.down_proj": torch.stack(fc2), "experts.down_proj_bias": torch.stack(fc2_bias)}
