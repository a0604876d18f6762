"""Causal self-attention: fused QKV ColumnParallelLinear -> (QK-norm) -> RoPE -> SDPA -> RowParallelLinear.
(Context parallel, parallel.cp > 1: the SDPA core gathers K and V over the CP group, models/context_parallel.py.)

Heads are split across TP ranks. With grouped-query attention (`num_query_groups` = ng < np heads) the
fused QKV weight is laid out per query group, as in Megatron-Core:
    [ng, (np/ng) * hn (q) + hn (k) + hn (v), h]
so a contiguous TP shard of its rows holds whole groups: ng/tp groups, np/tp query heads.
Options: biases on q, k and v only (`add_qkv_bias`, Qwen2); QK-norm (`qk_layernorm`, Qwen3): one norm over hn
for every query head and one for every key head, weights [hn] replicated on the TP ranks (each rank's heads
give a partial gradient: Megatron-Core's finalize_model_grads sums `q_layernorm` / `k_layernorm` over TP).
"""

import torch
from megatron.core import tensor_parallel
from megatron.core.models.common.embeddings.rope_utils import apply_rotary_pos_emb
from megatron.core.transformer.module import MegatronModule
from megatron.core.transformer.transformer_config import TransformerConfig
from megatron.core.utils import divide

from models.activations import ActivationContext
from models.context_parallel import AllGatherKVAttention
from models.core_attention import CoreAttention
from models.kv_cache import KVCache
from models.linear import ColumnParallelLinear, RowParallelLinear
from models.qk_norm import qk_norm_params, qk_norms
from models.shape import ModelShape, Split


class ApplyRope(torch.autograd.Function):
    """RoPE, non-interleaved, on q and k at once: t * cos + rotate_half(t) * sin, rotate_half(t) = [-t2, t1] on
    the halves.

    Written half by half into one output, without Megatron-Core's chunk / neg / cat copies and slice gradients:
    one product t * cos, then each half's sin term added in place (3 kernels a tensor, forward and backward; one
    autograd node for q and k). fp32: the sin terms as `addcmul_`, which may round the product-sum once where
    Megatron-Core's `apply_rotary_pos_emb` rounds twice: within 6e-8 relative of it (forward and gradient; the
    issue allows 1e-6), ~1.5x faster than the bit-identical form on CPU at the tiny preset (~0.4 against ~0.7 ms
    forward + backward a layer and micro-batch). bf16 / fp16: each product rounded as Megatron-Core rounds it
    (bit-identical). Each element goes through the same kernels on the same contiguous run of hn/2 values at any
    layout (TP splits heads, CP the sequence): identical across layouts (tests/test_bench.py).
    """

    @staticmethod
    def forward(ctx, q, k, cos, sin):  # q [s, b, np, hn], k [s, b, ng, hn]; cos [s, 1, 1, hn], sin [s, 1, 1, hn/2]
        ctx.save_for_backward(cos, sin)
        return _rotate(q, cos, sin, 1), _rotate(k, cos, sin, 1)

    @staticmethod
    def backward(ctx, grad_q, grad_k):  # the transposed rotation: [g1 cos + g2 sin, g2 cos - g1 sin]
        cos, sin = ctx.saved_tensors
        return _rotate(grad_q, cos, sin, -1), _rotate(grad_k, cos, sin, -1), None, None


def _rotate(t: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, sign: int) -> torch.Tensor:
    """[t1 cos - sign t2 sin, t2 cos + sign t1 sin] of t = [t1, t2] (last dim halves; cos [..., hn] with equal
    halves, sin [..., hn/2]): sign 1 rotates, -1 undoes. A new contiguous tensor like t."""
    h = t.shape[-1] // 2
    out = t * cos  # [..., hn]: t1 cos, t2 cos
    o1, o2, t1, t2 = out[..., :h], out[..., h:], t[..., :h], t[..., h:]
    if t.dtype == torch.float32:
        o1.addcmul_(t2, sin, value=-sign)
        o2.addcmul_(t1, sin, value=sign)
    elif sign > 0:  # round t2 sin before the sum, as Megatron-Core does (addcmul would round once: 1 ulp off)
        o1.sub_(t2 * sin)
        o2.add_(t1 * sin)
    else:
        o1.add_(t2 * sin)
        o2.sub_(t1 * sin)
    return out


class SelfAttention(MegatronModule):
    def __init__(self, config: TransformerConfig, layer_number: int | None = None):
        super().__init__(config=config)
        tp = config.tensor_model_parallel_size
        self.layer_number = layer_number  # its entry in a generation's KV cache
        self.head_dim = config.kv_channels
        self.heads_per_group = divide(config.num_attention_heads, config.num_query_groups)
        self.local_groups = divide(config.num_query_groups, tp)
        qkv_size = (config.num_attention_heads + 2 * config.num_query_groups) * self.head_dim
        self.linear_qkv = ColumnParallelLinear(
            config.hidden_size, qkv_size, config=config, init_method=config.init_method,
            bias=config.add_bias_linear or config.add_qkv_bias, gather_output=False,
        )
        # QK-norm per head (Qwen3; the names finalize_model_grads looks for) or over q and k (OLMo 2): qk_norm.py
        self.q_layernorm, self.k_layernorm = qk_norms(config)
        # this layer's window, scale, soft-cap and sinks (models/core_attention.py); parallel.cp > 1: K/V all-gathered
        core = CoreAttention if config.context_parallel_size == 1 else AllGatherKVAttention
        self.core_attention = core(config, layer_number or 1)
        self.selective_recompute = config.recompute_granularity == "selective"
        self._rope_cache = (None, None, None)  # (freqs, cos, sin): the last rotary table seen, and its cos, sin
        self.linear_proj = RowParallelLinear(
            config.num_attention_heads * self.head_dim, config.hidden_size, config=config,
            init_method=config.output_layer_init_method, bias=config.add_bias_linear,
            input_is_parallel=True, skip_bias_add=True,
        )

    def forward(self, x: torch.Tensor, rotary_freqs: torch.Tensor | None, cache: KVCache | None = None,
                attention_mask: torch.Tensor | None = None):
        """x [s(/tp), b, h]; rotary_freqs [s, 1, 1, hn] (or [s, b, 1, hn] with a cache or packed sequences: each
        token's own position); cache: generation's keys and values so far (models/kv_cache.py), None in training;
        attention_mask [b, 1, s, s]: packed sequences' (models/core_attention.packed_mask), None: causal."""
        qkv, _ = self.linear_qkv(x)  # [s, b, ng/tp * (np/ng + 2) * hn] (SP: gathered along s)
        s, b, _ = qkv.shape
        qkv = qkv.view(s, b, self.local_groups, (self.heads_per_group + 2) * self.head_dim)
        q, k, v = torch.split(qkv, [self.heads_per_group * self.head_dim, self.head_dim, self.head_dim],
                              dim=-1)  # [s, b, ng/tp, (np/ng)*hn], [s, b, ng/tp, hn] x 2
        q = q.reshape(s, b, -1, self.head_dim)  # [s, b, np/tp, hn]
        if self.q_layernorm is not None:  # each head over hn, before RoPE (and before the KV cache stores k)
            q, k = self.q_layernorm(q), self.k_layernorm(k)
        if rotary_freqs is not None:  # [s, 1, 1, hn]
            q, k = self._rope(q, k, rotary_freqs)
        if cache is not None:  # attend to every cached position too: k, v [length + s, b, ng/tp, hn]
            k, v = cache.store(self.layer_number, k, v)
            out = self.core_attention(q, k, v, mask=cache.mask(s))
        elif self.selective_recompute and self.training:  # keep only q, k, v; redo attention in backward
            out = tensor_parallel.checkpoint(self.core_attention, False, q, k, v, attention_mask)
        else:
            out = self.core_attention(q, k, v, mask=attention_mask)  # [s, b, np/tp * hn]
        return self.linear_proj(out)  # ([s(/tp), b, h], bias or None)

    rope_scale = 1.0  # yarn's / longrope's attention factor on cos and sin (models/rope.py); the GPT sets it

    def _rope(self, q: torch.Tensor, k: torch.Tensor, freqs: torch.Tensor):
        c, scale = self.config, self.rope_scale
        if c.apply_rope_fusion or c.rotary_interleaved:  # TE's fused kernel or interleaved RoPE: Megatron-Core's own
            return apply_rotary_pos_emb(q, freqs, c, mscale=scale), apply_rotary_pos_emb(k, freqs, c, mscale=scale)
        if self._rope_cache[0] is not freqs or self._rope_cache[1].dtype != q.dtype:  # RotaryTables caches freqs
            half = freqs[..., :freqs.shape[-1] // 2]  # RoPE's angles: both halves of freqs are equal
            cos, sin = torch.cos(freqs), torch.sin(half)  # [s, 1, 1, hn] (packed: [s, b, 1, hn]), [s, 1, 1, hn/2]
            if scale != 1.0:  # in fp32, then rounded: transformers' (cos * attention_scaling).to(dtype)
                cos, sin = cos * scale, sin * scale
            self._rope_cache = (freqs, cos.to(q.dtype), sin.to(q.dtype).contiguous())
        _, cos, sin = self._rope_cache
        rd = freqs.shape[-1]
        if rd == q.shape[-1]:
            return ApplyRope.apply(q, k, cos, sin)
        # partial rotary (freqs [.., rd < hn]): each head's first rd values rotate, the rest pass (transformers' Phi-3)
        q_rot, k_rot = ApplyRope.apply(q[..., :rd], k[..., :rd], cos, sin)
        return torch.cat((q_rot, q[..., rd:]), dim=-1), torch.cat((k_rot, k[..., rd:]), dim=-1)

    @staticmethod
    def num_params(shape: ModelShape, split: Split) -> int:
        h, q, kv = shape.hidden_size, shape.q_width, shape.kv_width
        sharded = h * (q + 2 * kv) + q * h + (q + 2 * kv if shape.qkv_bias else 0)  # qkv and proj weights, qkv bias
        norms = qk_norm_params(shape, split)  # models/qk_norm.py: per head replicated, over q and k split
        sinks = shape.num_attention_heads if shape.attention_sinks else 0  # [np], split like the heads
        return (sharded + sinks) // split.tp + (h if shape.add_bias_linear else 0) + norms  # proj bias: replicated

    @staticmethod
    def flops_per_token(shape: ModelShape) -> float:
        h, q, kv = shape.hidden_size, shape.q_width, shape.kv_width
        scores = 2 * 2 * attended_keys(shape) * q  # q k^T and probs v over the keys a query sees
        return 2 * h * (q + 2 * kv) + scores + 2 * q * h

    @staticmethod
    def activation_bytes(shape: ModelShape, split: Split, act: ActivationContext) -> float:
        """linear_qkv's input; the Q, K and V the attention core keeps and its output (linear_proj's input is a
        view of it); QK-norm's inputs (Q regrouped into heads is a copy); under CP the gathered K and V (CP's
        causal mask is one tensor for all layers: the estimate counts it once a stage, as a sliding window's band);
        without flash attention the s x s scores (Korthikanti et al. 2022's unfused core attention; not measured
        here); with soft-capping or sinks the explicit scores' tanh output, fp32 softmax and its copy."""
        e, b, s, t = act.bytes, act.micro_batch, act.seq, split.tp
        q, kv, full = shape.q_width, shape.kv_width, act.seq * act.cp  # full: K/V length after the CP gather
        rope = shape.position_embedding == "rope"
        gathered = act.cp > 1 and act.recompute == "none"  # selective recomputes the gather in backward
        # Q is a view of QKV's output unless rotated, normalised (QK-norm) or regrouped into heads (copies)
        q_view = not rope and not shape.qk_norm and shape.heads_per_group == 1
        width = q + (0 if q_view else q)  # the core's output; Q
        if gathered:  # K and V at full length [cp*s, b, ng/tp, hn]; the local K and V are not kept
            width += 2 * kv * act.cp
        elif rope or shape.qk_norm:  # the rotated (or normalised) K
            width += kv
        if q_view or not gathered or shape.qk_norm:  # V (Q, K without RoPE; QK-norm's inputs) are views of
            width += q + 2 * kv  # QKV's output: all of it stays
        if shape.qk_norm and shape.heads_per_group > 1:  # QK-norm keeps its input Q: regrouped into heads, a copy
            width += q
        out = e * b * s * shape.hidden_size / act.seq_split(split) + e * b * s * width / t
        scores = shape.num_attention_heads * b * s * full / t  # elements of [b, np/tp, s, s_k]
        if act.recompute != "none":  # selective recomputes the core (full: only the layer's input)
            return out
        if shape.attn_logit_softcap is not None or shape.attention_sinks:  # explicit scores (models/core_attention.py)
            dropped = act.attention_dropout or e != 4  # the probabilities' copy the last matmul keeps
            out += scores * (4 + (e if shape.attn_logit_softcap is not None else 0) + (e if dropped else 0) +
                             (1 if act.attention_dropout else 0))  # fp32 softmax, tanh's output, the copy, a mask
            if shape.attention_sinks:
                out += 4 * shape.num_attention_heads * b * s / t  # the softmax's sink column
        elif not act.flash:  # softmax output (+ dropout mask and output) [b, np/tp, s, s]
            out += (e + (1 + e if act.attention_dropout else 0)) * scores
        return out

    # ---- Hugging Face interop (Llama, Qwen2, Qwen3): this block's weights <-> HF's `self_attn.*` -------------
    # HF keeps q_proj [np*hn, h] and k_proj, v_proj [ng*hn, h] apart; our full (tp=1) linear_qkv interleaves them
    # per query group, [ng, (np/ng)*hn q | hn k | hn v] rows (module docstring). HF's q/k rows are already in the
    # rotate_half order of Megatron-Core's non-interleaved RoPE (ours): no permutation. Biases follow the same
    # layout: q, k, v's with add_qkv_bias (Qwen2) or add_bias_linear (Llama's attention_bias, also o's). QK-norm:
    # HF's q_norm / k_norm [hn] are our q_layernorm / k_layernorm; OLMo 2's over the projections, [np*hn] and
    # [ng*hn] in HF's head order, are ours at tp=1 too. Phi-3 (config.hf_family, set by training/interop/hf.py)
    # fuses q, k and v into qkv_proj, [np*hn q; ng*hn k; ng*hn v] rows. `get` reads a tensor by name relative to
    # the block.
    @staticmethod
    def from_hf(get, config: TransformerConfig) -> dict[str, torch.Tensor]:
        ng = config.num_query_groups
        out = {}
        for kind in _hf_kinds(config, qkv=True):
            if _fused(config):
                q, k, v = get(f"qkv_proj.{kind}").split(_qkv_rows(config), dim=0)
            else:
                q, k, v = (get(f"{n}_proj.{kind}") for n in "qkv")  # [np*hn, ...], [ng*hn, ...] x 2
            grouped = [t.reshape(ng, -1, *t.shape[1:]) for t in (q, k, v)]  # [ng, rows per group, ...]
            out[f"linear_qkv.{kind}"] = torch.cat(grouped, dim=1).flatten(0, 1)  # [ng*(np/ng+2)*hn, ...]
        for kind in _hf_kinds(config, qkv=False):
            out[f"linear_proj.{kind}"] = get(f"o_proj.{kind}")
        for ours, hf in _qk_norms(config):
            out.update({f"{ours}.{n}": get(f"{hf}.{n}") for n in _norm_kinds(config)})
        if config.softmax_type == "learnable":  # gpt-oss's sinks [np]
            out[_SINKS[0]] = get(_SINKS[1])
        return out

    @staticmethod
    def to_hf(get, config: TransformerConfig) -> dict[str, torch.Tensor]:
        ng, hn = config.num_query_groups, config.kv_channels
        per_group = divide(config.num_attention_heads, ng) * hn
        out = {}
        for kind in _hf_kinds(config, qkv=True):
            qkv = get(f"linear_qkv.{kind}")
            q, k, v = qkv.reshape(ng, per_group + 2 * hn, *qkv.shape[1:]).split([per_group, hn, hn], dim=1)
            q, k, v = (t.flatten(0, 1) for t in (q, k, v))
            if _fused(config):
                out[f"qkv_proj.{kind}"] = torch.cat((q, k, v), dim=0)
            else:
                out[f"q_proj.{kind}"], out[f"k_proj.{kind}"], out[f"v_proj.{kind}"] = q, k, v
        for kind in _hf_kinds(config, qkv=False):
            out[f"o_proj.{kind}"] = get(f"linear_proj.{kind}")
        for ours, hf in _qk_norms(config):
            out.update({f"{hf}.{n}": get(f"{ours}.{n}") for n in _norm_kinds(config)})
        if config.softmax_type == "learnable":
            out[_SINKS[1]] = get(_SINKS[0])
        return out


_QK_NORMS = (("q_layernorm", "q_norm"), ("k_layernorm", "k_norm"))
_SINKS = ("core_attention.softmax_offset", "sinks")  # ours (Megatron-Core's name), HF's (self_attn.sinks)


def _qk_norms(config: TransformerConfig) -> tuple[tuple[str, str], ...]:
    """(ours, HF's) QK-norm module names: per head (Qwen3, Gemma 3) or over the projections (OLMo 2)."""
    return _QK_NORMS if config.qk_layernorm or getattr(config, "qk_norm_span", None) == "projection" else ()


def _fused(config: TransformerConfig) -> bool:  # Phi-3's qkv_proj (training/interop/hf.py names the family)
    return getattr(config, "hf_family", None) == "phi3"


def _qkv_rows(config: TransformerConfig) -> list[int]:
    kv = config.num_query_groups * config.kv_channels
    return [config.num_attention_heads * config.kv_channels, kv, kv]


def _hf_kinds(config: TransformerConfig, qkv: bool) -> tuple[str, ...]:
    bias = config.add_bias_linear or (qkv and config.add_qkv_bias)
    return ("weight", "bias") if bias else ("weight",)


def _norm_kinds(config: TransformerConfig) -> tuple[str, ...]:
    return ("weight", "bias") if config.normalization == "LayerNorm" else ("weight",)


def attended_keys(shape: ModelShape) -> float:
    """Keys a query sees, averaged over the sequence and the model's layers (each layer's flops_per_token is this
    mean: their sum is exact): s/2 on a causal layer (the mask halves the s x s scores, as Megatron-LM counts); on
    a sliding layer a query at position p = 1..s sees min(window, p) keys, so it keeps that share of the causal
    (query, key) pairs: (w(w + 1)/2 + (s - w)w) of s(s + 1)/2."""
    s, w = shape.seq_length, shape.sliding_window
    sliding = shape.layer_types.count("sliding") if w is not None and w < s else 0
    kept = (w * (w + 1) / 2 + (s - w) * w) / (s * (s + 1) / 2) if sliding else 1.0
    return s / 2 * (shape.num_layers - sliding * (1 - kept)) / shape.num_layers
