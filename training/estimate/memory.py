"""Per-GPU memory of a training layout, estimated before anything is allocated (tools/plan.py ranks
layouts with it; training/estimate/preflight.py stops a run that cannot fit).

    est = estimate(cfg, shape, Layout.of(cfg, dp), num_microbatches)     # shape: models/shape.py
    est.mem_gb()   # {"weights_and_optimizer": ..., "activations": ..., "total": ...}

Weights + gradients + optimizer state, per parameter on one GPU: bf16 params, fp32 gradients
(bridge.ddp_config sets grad_reduce_in_fp32) and Adam's fp32 main params, exp_avg and exp_avg_sq:
2 + 4 + 12 = 18 bytes; the distributed optimizer shards the 12 over DP: 6 + 12/dp. fp32 runs have no
separate main copy: 4 + 4 + 8 = 16, or 8 + 8/dp. Megatron-FSDP (parallel.fsdp) keeps the model weights
(bf16 or fp32, p bytes), fp32 main weights, fp32 gradients and Adam's moments in buffers sharded over DP:
ZeRO-2 (optim_grads) p + 16/dp, ZeRO-3 (optim_grads_params) (p + 16)/dp, plus p for every weight outside
the FSDP units (embedding, final norm, untied output layer: the root unit stays gathered); while a layer
runs, its unit and the next (prefetched) are unsharded too: 2 layers' weights x p, counted with the
activations (training/engine/bridge.py keeps Megatron-FSDP from gathering every unit after the optimizer step).
Measured on the tiny model at dp 2 in bf16: ZeRO-3 0.51x of DDP's 18 bytes. Parameters are counted from the real shapes of models/
(models.gpt.num_params: each block declares its own count, and a test checks the sum against the built
model for every preset).

Activations follow Korthikanti et al. 2022, "Reducing Activation Recomputation in Large Transformer
Models" (arXiv:2205.05198, Table 2: sbh(34 + 5as/h) bytes per layer with 2-byte activations), term by
term for this repo's layers: GQA shrinks K and V, SwiGLU keeps 4 ffn-wide tensors instead of GELU's 2,
unfused RoPE keeps rotated copies of Q and K, dropout masks exist only when dropout > 0 (torch skips
p=0), and the s x s attention scores exist only without flash attention. The first pipeline stage holds
pp micro-batches in 1F1B, times (1 + (pp-1)/(pp*vpp)) when interleaved. Context parallelism (cp) divides
every sequence-long tensor by cp and adds the full-length K and V each layer gathers (models/
context_parallel.py) and its [s/cp, s] causal mask (one per rank); the distributed optimizer shards over
DP x CP.

Not counted (keep headroom with train.max_memory_fraction): the CUDA context and NCCL buffers (~1 GB),
allocator fragmentation, pipeline send/receive buffers, flash attention's O(s) softmax statistics.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

from models.shape import ModelShape, Split
from models.spec import layer_spec
from training.config.schema import Config

GB = 1e9  # decimal gigabytes, as metrics.jsonl's mem_gb


@dataclass(frozen=True)
class Layout:
    tp: int
    pp: int
    vpp: int | None  # virtual stages per pipeline rank; None = plain 1F1B
    dp: int
    sp: bool
    dist_opt: bool
    recompute: str  # none | selective | full
    ep: int = 1  # expert parallel (MoE)
    etp: int = 1  # expert tensor parallel (MoE)
    cp: int = 1  # context parallel: each rank holds seq/cp tokens of every sequence
    fsdp: str = "none"  # Megatron-FSDP: none | optim_grads (ZeRO-2) | optim_grads_params (ZeRO-3)

    @classmethod
    def of(cls, cfg: Config, dp: int) -> Layout:
        p = cfg.parallel
        return cls(p.tp, p.pp, p.vpp, dp, p.sp, p.dist_opt, str(cfg.model.recompute), p.ep, p.etp, p.cp,
                   str(p.fsdp))

    @property
    def edp(self) -> int:
        """Expert data parallel: the ranks holding the same experts (world / (pp * ep * etp))."""
        return self.tp * self.cp * self.dp // (self.ep * self.etp)

    def describe(self) -> str:
        experts = f" ep {self.ep} etp {self.etp}" if self.ep * self.etp > 1 else ""
        context = f" cp {self.cp}" if self.cp > 1 else ""
        sharding = f"fsdp {self.fsdp}" if self.fsdp != "none" else f"dist_opt {'on' if self.dist_opt else 'off'}"
        return (f"tp {self.tp} pp {self.pp} vpp {self.vpp or '-'}{context} dp {self.dp}{experts} "
                f"sp {'on' if self.sp else 'off'} {sharding} "
                f"recompute {self.recompute}")


@dataclass(frozen=True)
class Estimate:
    layout: Layout
    params_total: int  # the whole model, every weight once (a tied embedding once)
    params_per_gpu: int  # one TP shard of the most-loaded pipeline stage
    stage: int  # pipeline rank of the most-loaded stage
    weights_and_optimizer: float  # bytes on that GPU
    activations: float  # bytes on that GPU at the peak of the step

    @property
    def total(self) -> float:
        return self.weights_and_optimizer + self.activations

    def mem_gb(self) -> dict:
        return {"weights_and_optimizer": round(self.weights_and_optimizer / GB, 3),
                "activations": round(self.activations / GB, 3), "total": round(self.total / GB, 3)}

    def summary(self) -> str:
        g = self.mem_gb()
        return (f"memory estimate per GPU ({self.layout.describe()}): {g['total']:.2f} GB = weights+grads+optimizer "
                f"{g['weights_and_optimizer']:.2f} + activations {g['activations']:.2f} on pipeline stage "
                f"{self.stage} ({self.params_per_gpu / 1e6:,.1f} M of {self.params_total / 1e6:,.1f} M parameters)")


def bytes_per_param(precision: str, dist_opt: bool, dp: int, fsdp: str = "none") -> float:
    if fsdp != "none":  # model weights p, fp32 main weights, grads and moments: 4 + 4 + 8, sharded (module doc)
        p = 2 if precision == "bf16" else 4
        return p + 16 / dp if fsdp == "optim_grads" else (p + 16) / dp
    param, grad, optimizer = (2, 4, 12) if precision == "bf16" else (4, 4, 8)
    return param + grad + optimizer / (dp if dist_opt else 1)


def mlp_activations(cfg: Config, shape: ModelShape, lay: Layout, moe: bool) -> float:
    """Bytes a layer's MLP keeps: GELU its input and output, SwiGLU the fc1 output (gate|up), SiLU(gate) and
    the product. A MoE MLP (balanced routing: each rank's experts get k x its tokens) keeps that for its
    experts' FFN width, the permuted copies of the tokens going in and out, the router's fp32 logits and
    probabilities, and the shared expert's like a dense MLP."""
    s, b, h, t = shape.seq_length // lay.cp, cfg.train.micro_batch_size, shape.hidden_size, lay.tp
    e = 2 if cfg.train.precision == "bf16" else 4
    width = 4 if shape.gated else 2
    if not moe:
        return e * s * b * shape.ffn_hidden_size * width / t
    tokens = s * b / (t if lay.sp else 1)
    k, ffn = shape.moe_top_k, shape.moe_ffn_hidden_size
    routed = e * tokens * k * (2 * h + ffn * width / lay.etp)
    router = 2 * 4 * tokens * shape.num_experts
    shared = e * s * b * (shape.moe_shared_ffn_hidden_size or 0) * width / t
    return routed + router + shared


def layer_activations(cfg: Config, shape: ModelShape, lay: Layout, flash_attention: bool,
                      moe: bool = False) -> float:
    """Bytes one layer (with a MoE MLP when moe) keeps for backward, for one micro-batch, on one GPU
    (Korthikanti Table 2, term by term)."""
    m = cfg.model
    s, b, h, t = shape.seq_length // lay.cp, cfg.train.micro_batch_size, shape.hidden_size, lay.tp  # CP: s/cp
    e = 2 if cfg.train.precision == "bf16" else 4  # bytes per activation element
    seq_split = t if lay.sp else 1  # SP shards the TP-replicated tensors along the sequence
    if lay.recompute == "full":  # only the layer's input survives; the rest is recomputed in backward
        return e * s * b * h / seq_split
    q, kv = shape.q_width, shape.kv_width
    mask = 1 if m.hidden_dropout > 0 else 0  # dropout masks: one byte per element
    # 2 norm inputs, the inputs of QKV and fc1 (kept sequence-sharded under SP), 2 hidden-dropout masks
    out = s * b * h * (4 * e + 2 * mask) / seq_split
    # TP-sharded: Q and K (for q k^T), V, and the attention output (the projection's input)
    out += e * s * b * (2 * q + 2 * kv) / t
    if shape.position_embedding == "rope":  # unfused RoPE: rotated copies of Q and K (QKV's output stays as V)
        out += e * s * b * (q + kv) / t
    out += mlp_activations(cfg, shape, lay, moe)
    if lay.cp > 1:  # K and V gathered to full length for attention (saved for its backward)
        out += e * shape.seq_length * b * 2 * kv / t
    if lay.recompute == "none" and not flash_attention:  # materialised s x s scores: softmax output,
        dropout = 1 + e if m.attention_dropout > 0 else 0  # + dropout mask and dropout output
        out += (e + dropout) * shape.num_attention_heads * s * shape.seq_length * b / t  # [s/cp, s] under CP
    return out


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
    in_flight = layers_in_flight(shape.num_layers, lay, num_microbatches, stage)
    moe_share = len(shape.moe_layer_numbers) / shape.num_layers  # MoE layers spread evenly over the stages

    def layer(lay: Layout) -> float:
        dense = layer_activations(cfg, shape, lay, flash_attention)
        return dense if not moe_share else \
            (1 - moe_share) * dense + moe_share * layer_activations(cfg, shape, lay, flash_attention, moe=True)

    out = layer(lay) * in_flight
    if lay.recompute == "full":  # backward recomputes one layer at a time: its activations live once
        out += layer(replace(lay, recompute="none"))
    if lay.cp > 1:  # the causal mask of context-parallel attention, [s/cp, s] booleans, shared by the layers
        out += shape.seq_length // lay.cp * shape.seq_length
    if stage == lay.pp - 1:  # final norm and output-layer inputs; logits and cross-entropy's fp32 softmax
        e = 2 if cfg.train.precision == "bf16" else 4
        s, b = shape.seq_length // lay.cp, cfg.train.micro_batch_size
        out += 2 * e * s * b * shape.hidden_size / (lay.tp if lay.sp else 1)
        out += (e + 4) * s * b * shape.padded_vocab(lay.tp) / lay.tp
    return out


def estimate(cfg: Config, shape: ModelShape, lay: Layout, num_microbatches: int,
             flash_attention: bool = True) -> Estimate:
    """The most-loaded pipeline stage (first or last) of `lay`. flash_attention=True by default because
    models/attention.py calls scaled_dot_product_attention, whose GPU kernels keep no s x s scores."""
    from models.gpt import num_params

    precision = str(cfg.train.precision)
    worst = None
    for stage in sorted({0, lay.pp - 1}):
        params = num_params(shape, lay.tp, lay.pp, stage, lay.vpp, lay.ep, lay.etp)
        experts = num_params(shape, lay.tp, lay.pp, stage, lay.vpp, lay.ep, lay.etp, experts_only=True)
        # the distributed optimizer shards dense state over DP x CP, expert state over the expert-DP group
        weights = (params - experts) * bytes_per_param(precision, lay.dist_opt, lay.dp * lay.cp, lay.fsdp) + \
            experts * bytes_per_param(precision, lay.dist_opt, lay.edp)
        activations = stage_activations(cfg, shape, lay, num_microbatches, stage, flash_attention)
        if lay.fsdp == "optim_grads_params":  # unsharded: the root unit always, two layers' units in flight
            p = 2 if precision == "bf16" else 4
            layer = sum(block.num_params(shape, Split(lay.tp, lay.ep, lay.etp))
                        for _, block in layer_spec(shape, 1).items())
            weights += p * (params - shape.num_layers * layer)
            activations += p * min(2, shape.num_layers) * layer
        candidate = Estimate(lay, num_params(shape), params, stage, weights, activations)
        if worst is None or candidate.total > worst.total:
            worst = candidate
    return worst
