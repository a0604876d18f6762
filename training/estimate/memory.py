"""Per-GPU memory of a training layout, estimated before anything is allocated (tools/plan.py ranks
layouts with it; training/estimate/preflight.py stops a run that cannot fit).

    est = estimate(cfg, shape, Layout.of(cfg, world))     # models/shape.py; training/parallel/layout.py
    est.mem_gb()   # {"weights_and_optimizer": ..., "activations": ..., "total": ...}

Weights + gradients + optimizer state, per parameter on one GPU: bf16 params, fp32 gradients
(bridge.ddp_config sets grad_reduce_in_fp32) and Adam's fp32 main params, exp_avg and exp_avg_sq:
2 + 4 + 12 = 18 bytes; the distributed optimizer shards the 12 over DP: 6 + 12/dp. fp32 runs have no
separate main copy: 4 + 4 + 8 = 16, or 8 + 8/dp. Megatron-FSDP's terms (ZeRO-2 / ZeRO-3 shards, the
unsharded root unit and the layers in flight) are training/parallel/fsdp.py's; measured on the tiny model at
dp 2 in bf16: ZeRO-3 0.51x of DDP's 18 bytes. Parameters are counted from the real shapes of models/
(models.gpt.num_params: each block declares its own count, and a test checks the sum against the built
model for every preset).

Activations are what each layer's blocks declare (`activation_bytes(shape, split, act)`, models/spec.py; act:
models/activations.py's context of this config and layout), summed over the stage's layers; a test holds every
built-in block's declaration to the tensors its forward saves (tests/test_activation_bytes.py). The built-in
blocks follow Korthikanti et al. 2022, "Reducing Activation Recomputation in Large Transformer Models"
(arXiv:2205.05198, Table 2: sbh(34 + 5as/h) bytes per layer with 2-byte activations), term by term, as this
repo's code keeps them: GQA shrinks K and V, SwiGLU keeps 4 ffn-wide tensors (3 with the fused kernel) instead
of GELU's 2, RoPE keeps rotated copies of Q and K, dropout masks exist only when dropout > 0 (torch skips p=0),
the s x s attention scores only without flash attention, a MoE MLP keeps k permuted copies of each token and
its experts' tensors for each. The first pipeline stage holds pp micro-batches in 1F1B, times
(1 + (pp-1)/(pp*vpp)) when interleaved; full recomputation keeps each layer's input, plus the largest layer's
activations while backward recomputes it. Context parallelism (cp) divides every sequence-long tensor by cp;
the attention keeps the full-length K and V it gathers (models/context_parallel.py), and the stage one [s/cp, s]
additive causal mask in the activations' dtype, which every layer's attention kernel keeps (the same tensor; so
does a micro-batch of packed conversations, data.format=sft, its [b, 1, s, s] block-diagonal one);
the distributed optimizer shards over DP x CP. Minimal TP (parallel.tp_blocks): a sub-block that tp leaves
whole counts its parameters and activations as at tp 1 on every TP rank (models/shape.py's Split.of), the
vocabulary's logits too when it is whole.

peft=lora (training/estimate/lora.py): the frozen base keeps its weights only, in the training dtype (2 or 4
bytes; no gradient, main-grad buffer, fp32 copy or Adam state), the adapters the 18 (16) bytes above; the
adapters' rank-r activations (and their dropout's) are added to each layer's. A preference step (post=dpo) packs
both answers of a pair as tokens of the sequence: its activations are a token step's; post.reference=live adds the
frozen reference's weights in the training dtype, stored scores and the LoRA base add nothing.

Not counted (keep headroom with train.max_memory_fraction): the CUDA context and NCCL buffers (~1 GB),
allocator fragmentation, pipeline send/receive buffers, O(s) statistics (norms', flash attention's softmax).
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from functools import lru_cache

import torch

from models.activations import ActivationContext
from models.shape import ModelShape, Split
from models.spec import layer_spec
from training.config.schema import Config
from training.estimate import lora
from training.parallel import fsdp as fsdp_feature
from training.parallel.layout import Layout

GB = 1e9  # decimal gigabytes, as metrics.jsonl's mem_gb


@dataclass(frozen=True)
class Estimate:
    layout: Layout
    params_total: int  # the whole model, every weight once (a tied embedding once)
    params_per_gpu: int  # one TP shard of the most-loaded pipeline stage
    stage: int  # pipeline rank of the most-loaded stage
    weights_and_optimizer: float  # bytes on that GPU
    activations: float  # bytes on that GPU at the peak of the step
    recompute: str = "none"  # model.recompute the activations assume
    adapters: int = 0  # peft=lora: the trainable adapter elements on that GPU (params_per_gpu: the frozen base)
    reference: float = 0.0  # post.reference=live: the frozen reference's weights on that GPU (in weights_and_optimizer)

    @property
    def total(self) -> float:
        return self.weights_and_optimizer + self.activations

    def mem_gb(self) -> dict:
        return {"weights_and_optimizer": round(self.weights_and_optimizer / GB, 3),
                "activations": round(self.activations / GB, 3), "total": round(self.total / GB, 3)}

    def summary(self) -> str:
        g = self.mem_gb()
        return (f"memory estimate per GPU ({self.layout.name}, recompute {self.recompute}): {g['total']:.2f} GB = "
                f"weights+grads+optimizer {g['weights_and_optimizer']:.2f} + activations {g['activations']:.2f} on "
                f"pipeline stage {self.stage} ({self.params_per_gpu / 1e6:,.1f} M of {self.params_total / 1e6:,.1f} M "
                f"parameters{f'; LoRA: frozen, + {self.adapters / 1e6:,.2f} M adapter' if self.adapters else ''}"
                f"{f'; + a live reference {self.reference / GB:.2f} GB' if self.reference else ''})")


def live_reference(cfg: Config) -> bool:
    """post.reference=live holds a second model (stored scores, the LoRA base and SimPO hold none; the reference's
    forward-only pass frees its activations before the policy's pass: no activation term)."""
    return str(cfg.post.objective) != "none" and str(cfg.post.reference) == "live"


def bytes_per_param(precision: str, dist_opt: bool, dp: int, fsdp: str = "none") -> float:
    if fsdp != "none":  # the feature's own terms (training/parallel/fsdp.py)
        return fsdp_feature.bytes_per_param(precision, fsdp, dp)
    param, grad, optimizer = (2, 4, 12) if precision == "bf16" else (4, 4, 8)
    return param + grad + optimizer / (dp if dist_opt else 1)


def activation_context(cfg: Config, shape: ModelShape, lay: Layout, flash_attention: bool,
                       recompute: str | None = None) -> ActivationContext:
    """What the blocks' activation declarations read (models/activations.py); recompute: model.recompute's."""
    m = cfg.model
    fused = torch.cuda.is_available() if m.fused_kernels is None else bool(m.fused_kernels)  # bridge.fused_kernels
    return ActivationContext(micro_batch=cfg.train.micro_batch_size, seq=shape.seq_length // lay.cp,
                             bytes=2 if cfg.train.precision == "bf16" else 4, sp=lay.sp, cp=lay.cp,
                             hidden_dropout=m.hidden_dropout > 0, attention_dropout=m.attention_dropout > 0,
                             flash=flash_attention, fused=fused, recompute=str(recompute or m.recompute))


def flash_attention_on(cfg: Config, device_type: str) -> bool:
    """Whether SDPA keeps no s x s scores: its flash kernels on GPUs, and torch's CPU flash kernel without dropout;
    with model.attention_dropout > 0 on a CPU it falls back to the math path, which keeps the [b, np, s, s]
    softmax output, its dropout mask and the dropped probabilities (flash_attention=False counts them)."""
    return not (device_type == "cpu" and cfg.model.attention_dropout > 0)


def layer_activations(cfg: Config, shape: ModelShape, lay: Layout, flash_attention: bool, layer_number: int = 1,
                      recompute: str | None = None) -> float:
    """Bytes layer `layer_number` keeps for backward, for one micro-batch, on one GPU: what its blocks declare."""
    act = activation_context(cfg, shape, lay, flash_attention, recompute)
    return _layer_bytes(shape, split_of(lay), act, layer_number)


def split_of(lay: Layout) -> Split:
    """How the layout cuts one GPU's share of the weights (the blocks' declarations read it)."""
    return Split(lay.tp, lay.ep, lay.etp, lay.tp_blocks)


@lru_cache(maxsize=1 << 16)  # the planner asks the same layer for every optimizer and pipeline variant
def _layer_bytes(shape: ModelShape, split: Split, act: ActivationContext, layer_number: int) -> float:
    from models.layer import TransformerLayer

    if act.recompute == "full":  # only the layer's input survives; the rest is recomputed in backward
        return act.bytes * act.tokens * shape.hidden_size / act.seq_split(split)
    return TransformerLayer.activation_bytes(shape, layer_number, split, act)


def layers_in_flight(num_layers: int, lay: Layout, num_microbatches: int, stage: int) -> float:
    """(layer, micro-batch) activation sets alive at the peak on pipeline rank `stage`: 1F1B runs
    pp - stage forwards before the first backward; interleaved 1F1B 2(pp-stage-1) + (vpp-1)pp + 1 chunk
    forwards (Megatron-Core's warm-up), which for stage 0 is Korthikanti's L(1 + (pp-1)/(pp*vpp))."""
    per_stage = num_layers // lay.pp
    if lay.pp == 1:
        return per_stage
    if lay.vpp is None:
        return per_stage * min(lay.pp - stage, num_microbatches)
    chunks = min(num_microbatches * lay.vpp, 2 * (lay.pp - stage - 1) + (lay.vpp - 1) * lay.pp + 1)
    return per_stage // lay.vpp * chunks


def stage_activations(cfg: Config, shape: ModelShape, lay: Layout, num_microbatches: int, stage: int,
                      flash_attention: bool) -> float:
    from models.stack import stage_layer_numbers

    in_flight = layers_in_flight(shape.num_layers, lay, num_microbatches, stage)
    act, split = activation_context(cfg, shape, lay, flash_attention), split_of(lay)
    numbers = stage_layer_numbers(shape.num_layers, lay.pp, lay.vpp, stage)
    out = sum(_layer_bytes(shape, split, act, n) for n in numbers) / len(numbers) * in_flight  # its mean layer
    out += lora.adapter_activations(cfg, shape, lay, act, stage, split) * in_flight  # peft=lora's h (and dropout)
    if act.recompute == "full":  # backward recomputes one layer at a time: the largest one's activations live once
        out += max(_layer_bytes(shape, split, replace(act, recompute="none"), n) for n in numbers)
    if lay.cp > 1:  # the causal mask of context-parallel attention, [s/cp, s] additive, shared by the layers
        out += act.bytes * act.seq * shape.seq_length
    if shape.sliding_window:  # the sliding layers' band, [s/cp, s] additive, shared (models/core_attention.py)
        out += act.bytes * act.seq * shape.seq_length
    if str(cfg.data.format) in ("sft", "preference"):  # packed conversations: each micro-batch in flight keeps its [b, 1, s, s]
        masks = 2 if shape.sliding_window else 1  # additive mask (and it with the band)
        out += masks * act.bytes * act.micro_batch * act.seq ** 2 * in_flight / len(numbers)
    if stage == lay.pp - 1:  # final norm and output-layer inputs; cross entropy's fp32 softmax over the vocabulary
        e = 2 if cfg.train.precision == "bf16" else 4
        s, b = shape.seq_length // lay.cp, cfg.train.micro_batch_size
        out += 2 * e * s * b * shape.hidden_size / (lay.tp if lay.sp else 1)
        # only the fp32 softmax is kept (as in Megatron-LM's theoretical memory: 4 bytes a logit): fp32 logits
        # become it in place, bf16 ones are freed after the loss (measured: training/bench/measure.py)
        out += 4 * s * b * shape.padded_vocab(lay.tp) / split.of("vocab").tp
    return out


@lru_cache(maxsize=1 << 14)  # the planner asks the same weights for every recompute, optimizer and micro batch
def _params(shape: ModelShape, *args, experts_only: bool = False, tp_blocks: tuple[str, ...] = ()) -> int:
    from models.gpt import num_params

    return num_params(shape, *args, experts_only=experts_only, tp_blocks=tp_blocks) if args else num_params(shape)


def estimate(cfg: Config, shape: ModelShape, lay: Layout, flash_attention: bool = True) -> Estimate:
    """The most-loaded pipeline stage (first or last) of `lay`. flash_attention=True by default because
    models/attention.py calls scaled_dot_product_attention, whose GPU kernels keep no s x s scores."""
    precision = str(cfg.train.precision)
    worst = None
    for stage in sorted({0, lay.pp - 1}):
        cut = (lay.tp, lay.pp, stage, lay.vpp, lay.ep, lay.etp)
        params = _params(shape, *cut, tp_blocks=tuple(lay.tp_blocks))
        experts = _params(shape, *cut, experts_only=True, tp_blocks=tuple(lay.tp_blocks))
        # the distributed optimizer shards dense state over DP x CP, expert state over the expert-DP group
        weights = (params - experts) * bytes_per_param(precision, lay.dist_opt, lay.grad_group, lay.fsdp) + \
            experts * bytes_per_param(precision, lay.dist_opt, lay.edp)
        adapters = lora.adapter_params(cfg, shape, lay, stage, split_of(lay))
        if lora.enabled(cfg):  # a frozen base: its weights only, in the training dtype (training/estimate/lora.py)
            weights = params * (2 if precision == "bf16" else 4) + \
                adapters * bytes_per_param(precision, lay.dist_opt, lay.grad_group)
        reference = params * (2 if precision == "bf16" else 4) * live_reference(cfg)  # frozen: its weights only
        weights += reference
        activations = stage_activations(cfg, shape, lay, lay.num_microbatches, stage, flash_attention)
        if lay.fsdp_enabled:  # ZeRO-3's unsharded weights: the root unit always, two layers' units in flight
            layer = sum(block.num_params(shape, split_of(lay))
                        for _, block in layer_spec(shape, 1).items())
            root, in_flight = fsdp_feature.unsharded_bytes(precision, lay.fsdp, params, layer, shape.num_layers)
            weights, activations = weights + root, activations + in_flight
        candidate = Estimate(lay, _params(shape), params, stage, weights, activations,
                             str(cfg.model.recompute), adapters, reference)
        if worst is None or candidate.total > worst.total:
            worst = candidate
    return worst
