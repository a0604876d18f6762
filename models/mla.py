"""Multi-latent attention (DeepSeek-V2/V3, Kimi K2, Moonlight), transformers' DeepseekV3Attention as a block:

    q  = q_up(norm(q_down(x)))  (q_lora_rank null: q_proj(x))            [s, b, np/tp, nope + rope]
    kv = kv_down(x) -> latent [kv_lora_rank], k_pe [rope] (one head, shared by all)
    k_nope, v = kv_up(norm(latent))                                        [s, b, np/tp, nope], [.., v_head_dim]
    q_pe, k_pe rotated (RoPE on the decoupled `rope` dims only); k = [k_nope, k_pe]; q = [q_nope, q_pe]
    out = linear_proj(softmax(q k^T * scale) v),  scale = (nope + rope)^-0.5 * mscale(factor, mscale_all_dim)^2

Our own block, from models/linear.py's layers, not Megatron-Core's MLASelfAttention: its forward takes no
rotary table from the seam (it builds its own RotaryEmbedding / YarnRotaryEmbedding per layer from
MLATransformerConfig, where ours come from the checkpoint's rope parameters in models/rope.py, shared by every
layer), its sub-layers come from a ModuleSpec with a DotProductAttention core (no packed-sequence masks, no
sinks, no CP without TE), and the KV-cache and recomputation paths differ from models/attention.py's. The names
are Megatron-Core's MLA names (linear_q_down_proj, linear_kv_up_proj, q_layernorm, kv_layernorm, ...).

Tensor parallelism: heads split over TP (q_up / q_proj, kv_up: ColumnParallelLinear; linear_proj:
RowParallelLinear). The down projections and the latents' norms are replicated: every TP rank holds the whole
weight and runs it on its own tokens (under SP, its sequence shard, the weights marked `sequence_parallel` so
finalize_model_grads sums their gradients over TP; without SP on every token, the up projections' input-gradient
all-reduce makes their gradients whole). k_pe, shared by every head, enters the heads through the TP mappings a
column layer uses: all-gathered along s under SP (backward: reduce-scatter), else copied (backward: all-reduce).
The latents' norms use eps 1e-6, transformers' DeepseekV3RMSNorm default (they do not read rms_norm_eps).
Generation's KV cache (models/kv_cache.py) holds the normalised K/V latent and the rotated k_pe, as inference
engines do (kv_lora_rank + rope values a token instead of np * (nope + rope + v)); every step expands the cached
latents again through linear_kv_up_proj (the weight-absorbed form, which skips that, is not done).
"""

import math

import torch
from megatron.core import tensor_parallel
from megatron.core.tensor_parallel.mappings import (copy_to_tensor_model_parallel_region,
                                                    gather_from_sequence_parallel_region)
from megatron.core.transformer.module import MegatronModule
from megatron.core.transformer.transformer_config import TransformerConfig
from megatron.core.utils import divide

from models.activations import ActivationContext
from models.attention import SelfAttention, attended_keys
from models.context_parallel import AllGatherKVAttention
from models.core_attention import CoreAttention
from models.linear import ColumnParallelLinear, ReplicatedLinear, RowParallelLinear
from models.norm import Norm
from models.shape import ModelShape, Split

LATENT_EPS = 1e-6  # transformers' DeepseekV3RMSNorm default: q_a_layernorm / kv_a_layernorm take no config eps


def softmax_scale(shape: ModelShape) -> float:
    """transformers' yarn_apply_mscale: qk_head_dim^-0.5, times mscale(factor, mscale_all_dim)^2 when the RoPE
    scaling is not the default one and sets mscale_all_dim."""
    scale, r = shape.mla.qk_head_dim ** -0.5, shape.rope_scaling
    if r is not None and r.mscale_all_dim and r.factor > 1:
        mscale = 0.1 * r.mscale_all_dim * math.log(r.factor) + 1.0
        scale *= mscale * mscale
    return scale


class MLA(MegatronModule):
    rope_scale = 1.0  # yarn's attention factor on cos and sin (models/rope.py); the GPT sets it
    _rope = SelfAttention._rope  # RoPE on q_pe [s, b, np/tp, rope] and k_pe [s, b, 1, rope], cos / sin cached

    def __init__(self, config: TransformerConfig, layer_number: int | None = None):
        super().__init__(config=config)
        m, h, heads = config.mla, config.hidden_size, config.num_attention_heads
        self.m, self.layer_number = m, layer_number
        self.local_heads = divide(heads, config.tensor_model_parallel_size)
        self.split_tp = config.tensor_model_parallel_size > 1  # else one rank, or a replicated block

        def column(inputs: int, outputs: int):  # heads split over TP
            return ColumnParallelLinear(inputs, outputs, config=config, init_method=config.init_method,
                                        bias=False, gather_output=False)

        def down(outputs: int):  # replicated: the whole weight on every rank, on its own tokens
            layer = ReplicatedLinear(h, outputs, config=config, init_method=config.init_method,
                                     bias=config.add_bias_linear)
            for param in layer.parameters():
                param.sequence_parallel = config.sequence_parallel
            return layer

        def norm(size: int):
            layer = Norm(config, size=size)
            layer.eps = LATENT_EPS
            return layer

        if m.q_lora_rank:
            self.linear_q_down_proj, self.q_layernorm = down(m.q_lora_rank), norm(m.q_lora_rank)
            self.linear_q_up_proj = column(m.q_lora_rank, heads * m.qk_head_dim)
        else:
            self.linear_q_proj = column(h, heads * m.qk_head_dim)
        self.linear_kv_down_proj = down(m.kv_lora_rank + m.qk_rope_head_dim)
        self.kv_layernorm = norm(m.kv_lora_rank)
        self.linear_kv_up_proj = column(m.kv_lora_rank, heads * (m.qk_nope_head_dim + m.v_head_dim))
        core = CoreAttention if config.context_parallel_size == 1 else AllGatherKVAttention
        self.core_attention = core(config, layer_number or 1)  # scale: config.softmax_scale (softmax_scale above)
        self.selective_recompute = config.recompute_granularity == "selective"
        self._rope_cache = (None, None, None)
        self.linear_proj = RowParallelLinear(
            heads * m.v_head_dim, h, config=config, init_method=config.output_layer_init_method,
            bias=config.add_bias_linear, input_is_parallel=True, skip_bias_add=True)

    def forward(self, x: torch.Tensor, rotary_freqs: torch.Tensor | None, cache=None,
                attention_mask: torch.Tensor | None = None):
        """x [s(/tp), b, h]; rotary_freqs [s, 1, 1, rope] (with a cache: [s, b, 1, rope], each token's position);
        cache: generation's latents so far (models/kv_cache.py); attention_mask: packed sequences' (None: causal)."""
        m = self.m
        if m.q_lora_rank:
            latent_q, _ = self.linear_q_down_proj(x)  # [s(/tp), b, q_lora_rank] (SP: this rank's tokens)
            q, _ = self.linear_q_up_proj(self.q_layernorm(latent_q))  # [s, b, np/tp * (nope + rope)]
        else:
            q, _ = self.linear_q_proj(x)  # [s, b, np/tp * (nope + rope)]
        s, b, _ = q.shape
        q = q.view(s, b, self.local_heads, m.qk_head_dim)  # [s, b, np/tp, nope + rope]
        q_nope, q_pe = torch.split(q, [m.qk_nope_head_dim, m.qk_rope_head_dim], dim=-1)
        kv, _ = self.linear_kv_down_proj(x)  # [s(/tp), b, kv_lora_rank + rope]
        latent, k_pe = torch.split(kv, [m.kv_lora_rank, m.qk_rope_head_dim], dim=-1)
        latent = self.kv_layernorm(latent)  # [s(/tp), b, kv_lora_rank]
        if self.split_tp:  # every rank's heads read every token's k_pe (module docstring)
            k_pe = (gather_from_sequence_parallel_region(k_pe) if self.config.sequence_parallel
                    else copy_to_tensor_model_parallel_region(k_pe))  # [s, b, rope]
        k_pe = k_pe.unsqueeze(2)  # [s, b, 1, rope]: one head, shared
        if rotary_freqs is not None:  # [s, 1, 1, rope]
            q_pe, k_pe = self._rope(q_pe, k_pe, rotary_freqs)
        if cache is not None:  # every position so far: [length + s, b, kv_lora_rank], [length + s, b, 1, rope]
            latent, k_pe = cache.store(self.layer_number, latent, k_pe)
        kv, _ = self.linear_kv_up_proj(latent)  # [s_k, b, np/tp * (nope + v)]
        s_k = kv.shape[0]
        kv = kv.view(s_k, b, self.local_heads, m.qk_nope_head_dim + m.v_head_dim)  # [s_k, b, np/tp, nope + v]
        k_nope, v = torch.split(kv, [m.qk_nope_head_dim, m.v_head_dim], dim=-1)
        q = torch.cat((q_nope, q_pe), dim=-1)  # [s, b, np/tp, nope + rope]
        k = torch.cat((k_nope, k_pe.expand(s_k, b, self.local_heads, m.qk_rope_head_dim)), dim=-1)  # [s_k, ...]
        if cache is not None:
            out = self.core_attention(q, k, v, mask=cache.mask(s))
        elif self.selective_recompute and self.training:  # keep only q, k, v; redo attention in backward
            out = tensor_parallel.checkpoint(self.core_attention, False, q, k, v, attention_mask)
        else:
            out = self.core_attention(q, k, v, mask=attention_mask)  # [s, b, np/tp * v_head_dim]
        return self.linear_proj(out)  # ([s(/tp), b, h], bias or None)

    @staticmethod
    def num_params(shape: ModelShape, split: Split) -> int:
        m, h, heads = shape.mla, shape.hidden_size, shape.num_attention_heads
        bias = h if shape.add_bias_linear else 0
        sharded = heads * m.qk_head_dim * (m.q_lora_rank or h) + m.kv_lora_rank * heads * (
            m.qk_nope_head_dim + m.v_head_dim) + heads * m.v_head_dim * h  # q up (or q), kv up, proj
        down = (m.kv_lora_rank + m.qk_rope_head_dim) * (h + (1 if bias else 0)) + m.kv_lora_rank
        if m.q_lora_rank:  # q down (+ its bias) and its norm
            down += m.q_lora_rank * (h + (1 if bias else 0)) + m.q_lora_rank
        return sharded // split.tp + down + bias  # down projections, norms and proj bias: replicated

    @staticmethod
    def flops_per_token(shape: ModelShape) -> float:
        m, h, heads = shape.mla, shape.hidden_size, shape.num_attention_heads
        q = 2 * heads * m.qk_head_dim * (m.q_lora_rank or h) + (2 * h * m.q_lora_rank if m.q_lora_rank else 0)
        kv = 2 * h * (m.kv_lora_rank + m.qk_rope_head_dim) + 2 * m.kv_lora_rank * heads * (
            m.qk_nope_head_dim + m.v_head_dim)
        scores = 2 * attended_keys(shape) * heads * (m.qk_head_dim + m.v_head_dim)  # q k^T, probs v
        norms = 2 * ((m.q_lora_rank or 0) + m.kv_lora_rank)  # the latents' norms, as Megatron-LM's MLA formula
        return q + kv + scores + norms + 2 * heads * m.v_head_dim * h

    @staticmethod
    def activation_bytes(shape: ModelShape, split: Split, act: ActivationContext) -> float:
        """Replicated (sequence-sharded under SP): the input, the kv down projection's output (the latent's norm
        keeps it: a view) and the norm's output (kv_up's input), q's latent and its norm's output. Split by heads:
        the attention core's Q and K (concatenated copies), kv_up's output (V is a view of it) and the core's
        output. The s x s softmax without flash attention, and also when v_head_dim differs from the q/k head dim
        (DeepSeek-V3: 128 vs 192): torch's CPU flash kernel needs one head dim, so SDPA takes its math path, which
        keeps Q, K and the softmax in fp32 (CUDA's memory-efficient kernel keeps no scores: there this
        overestimates)."""
        m, e, t, heads = shape.mla, act.bytes, split.tp, shape.num_attention_heads
        math = act.recompute == "none" and not (act.flash and m.v_head_dim == m.qk_head_dim)  # SDPA's math path
        qk = max(e, 4) if math else e  # the math path keeps Q and K in fp32 (its own copies below fp32)
        replicated = shape.hidden_size + m.kv_lora_rank * 2 + m.qk_rope_head_dim + 2 * (m.q_lora_rank or 0)
        sharded = e * heads * (m.qk_nope_head_dim + 2 * m.v_head_dim) + qk * heads * 2 * m.qk_head_dim
        out = act.tokens * (e * replicated / act.seq_split(split) + sharded / t)
        if not math:
            return out
        scores = heads * act.tokens * act.seq * act.cp / t  # [b, np/tp, s, s_k], the fp32 softmax
        return out + (max(e, 4) + (1 + e if act.attention_dropout else 0)) * scores

    # ---- Hugging Face interop (deepseek_v3): this block's weights <-> HF's `self_attn.*` ----------------------
    # The same matrices under other names; with rope_interleave (transformers' default for DeepSeek-V3) HF's
    # rotated dims are stored in interleaved pairs (x0, x1), (x2, x3)...: their rows are reordered to the
    # evens-then-odds order our (rotate-half) RoPE rotates, which is exactly what transformers'
    # apply_rotary_pos_emb_interleave computes on. config.hf_rope_interleave (absent: True) names the layout.
    @staticmethod
    def from_hf(get, config: TransformerConfig) -> dict[str, torch.Tensor]:
        return {ours: _reorder(get(hf), config, ours, inverse=False) for ours, hf in _hf_names(config)}

    @staticmethod
    def to_hf(get, config: TransformerConfig) -> dict[str, torch.Tensor]:
        return {hf: _reorder(get(ours), config, ours, inverse=True) for ours, hf in _hf_names(config)}


def _hf_names(config: TransformerConfig) -> list[tuple[str, str]]:
    """(ours, HF's) tensor names relative to the block."""
    names = [("linear_kv_down_proj", "kv_a_proj_with_mqa"), ("kv_layernorm", "kv_a_layernorm"),
             ("linear_kv_up_proj", "kv_b_proj"), ("linear_proj", "o_proj")]
    if config.mla.q_lora_rank:
        names += [("linear_q_down_proj", "q_a_proj"), ("q_layernorm", "q_a_layernorm"), ("linear_q_up_proj", "q_b_proj")]
    else:
        names += [("linear_q_proj", "q_proj")]
    biased = ("linear_kv_down_proj", "linear_proj", "linear_q_down_proj") if config.add_bias_linear else ()
    return ([(f"{o}.weight", f"{h}.weight") for o, h in names] +
            [(f"{o}.bias", f"{h}.bias") for o, h in names if o in biased])


def _reorder(t: torch.Tensor, config: TransformerConfig, ours: str, inverse: bool) -> torch.Tensor:
    """Rows of the rotated dims from HF's interleaved pairs to evens-then-odds (inverse: back)."""
    m = config.mla
    if not getattr(config, "hf_rope_interleave", True) or ours.split(".")[0] not in (
            "linear_kv_down_proj", "linear_q_up_proj", "linear_q_proj"):
        return t
    r = m.qk_rope_head_dim
    order = torch.cat((torch.arange(0, r, 2), torch.arange(1, r, 2)))  # ours[i] = hf[order[i]]
    if inverse:
        order = torch.argsort(order)
    if ours.startswith("linear_kv_down_proj"):  # [kv_lora_rank + rope, ...]: k_pe's rows last
        return torch.cat((t[:m.kv_lora_rank], t[m.kv_lora_rank:][order]))
    per_head = t.reshape(config.num_attention_heads, m.qk_head_dim, *t.shape[1:])  # [np, nope + rope, in]
    rope = per_head[:, m.qk_nope_head_dim:][:, order]
    return torch.cat((per_head[:, :m.qk_nope_head_dim], rope), dim=1).reshape(t.shape)  # [np * (nope + rope), in]
