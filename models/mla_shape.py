"""Multi-latent attention's sizes as models/shape.py's ModelShape carries them (models/mla.py is the block), and
their rules. Light (no Megatron-Core): the config checks before launching read it."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class MLAShape:
    """Multi-latent attention's sizes (models/mla.py; their meaning: training/config/schema_model.py MLAConfig)."""

    q_lora_rank: int | None  # None: one plain q projection
    kv_lora_rank: int
    qk_nope_head_dim: int
    qk_rope_head_dim: int
    v_head_dim: int

    @property
    def qk_head_dim(self) -> int:  # a q (and k) head: its plain part, then its rotated part
        return self.qk_nope_head_dim + self.qk_rope_head_dim


def mla_of(model) -> MLAShape | None:
    """Multi-latent attention's sizes when the layers' attention is models/mla.py's (model.attention=mla)."""
    if str(model.attention) not in ("mla", "models.mla:MLA"):
        return None
    m = model.mla
    return MLAShape(m.q_lora_rank or None, m.kv_lora_rank, m.qk_nope_head_dim, m.qk_rope_head_dim, m.v_head_dim)


def mla_problems(shape) -> list[str]:
    """Multi-latent attention's sizes, and the attention options models/mla.py does not implement (refused, not
    silently ignored)."""
    m = shape.mla
    sizes = {"kv_lora_rank": m.kv_lora_rank, "qk_nope_head_dim": m.qk_nope_head_dim, "v_head_dim": m.v_head_dim,
             **({"q_lora_rank": m.q_lora_rank} if m.q_lora_rank is not None else {})}
    out = [f"model.mla.{k}={v} must be >= 1" for k, v in sizes.items() if v < 1]
    if m.qk_rope_head_dim < 2 or m.qk_rope_head_dim % 2:
        out.append(f"model.mla.qk_rope_head_dim={m.qk_rope_head_dim} must be even and >= 2 (RoPE rotates pairs)")
    unsupported = {"position_embedding": (shape.position_embedding, "rope"), "qk_norm": (shape.qk_norm, False),
                   "qkv_bias": (shape.qkv_bias and not shape.add_bias_linear, False),
                   "attention_sinks": (shape.attention_sinks, False), "sliding_window": (shape.sliding_window, None),
                   "attn_logit_softcap": (shape.attn_logit_softcap, None),
                   "query_pre_attn_scalar": (shape.query_pre_attn_scalar, None),
                   "partial_rotary_factor": (shape.partial_rotary_factor, 1.0)}
    out += [f"model.attention=mla does not implement model.{k}={v} (use {ok})" for k, (v, ok) in unsupported.items()
            if v != ok]
    return out
