"""A Hugging Face config.json's RoPE <-> our model.rotary_base, rotary_base_local, partial_rotary_factor and
model.rope_scaling.* (training/interop/hf_config.py asks this file for its refusals, fields and export keys).

Where transformers keeps them: 4.x writes `rope_theta` and `rope_scaling` ({"type" or "rope_type", "factor", ...});
5.x `rope_parameters` ({"rope_type", "rope_theta", ...}), nested by layer type for models whose layer kinds differ
(Gemma 3: {"full_attention": {...}, "sliding_attention": {...}}; 4.x: `rope_local_base_freq`). Every type of
transformers' ROPE_INIT_FUNCTIONS but "proportional" imports (models/rope.py computes the same tables):
llama3, linear, dynamic (its threshold is config.json's max_position_embeddings), yarn (beta_fast, beta_slow,
mscale, mscale_all_dim, attention_factor, truncate), longrope (short/long factors; Phi-3's top-level
original_max_position_embeddings wins, as in transformers). Sliding layers with their own base take plain RoPE.
Light on purpose (no torch).
"""

from __future__ import annotations

TYPES = ("default", "llama3", "linear", "dynamic", "yarn", "longrope")
# families whose transformers modeling rotates only the first partial_rotary_factor of each head (Llama's ignores
# the field in its default RoPE and rotates every value: importing it as partial would not be transformers' model)
PARTIAL_ROTARY = ("phi3",)
LOCAL_BASE = ("gemma3_text", "gemma3")  # families with a base of their own for sliding layers (rope_local_base_freq)
# our field -> transformers' key, for the parameters each type carries (beyond rope_type and factor)
KEYS = {"llama3": {"low_freq_factor": "low_freq_factor", "high_freq_factor": "high_freq_factor",
                   "original_max_position": "original_max_position_embeddings"},
        "yarn": {"original_max_position": "original_max_position_embeddings", "beta_fast": "beta_fast",
                 "beta_slow": "beta_slow", "mscale": "mscale", "mscale_all_dim": "mscale_all_dim",
                 "attention_factor": "attention_factor", "truncate": "truncate"},
        "longrope": {"original_max_position": "original_max_position_embeddings", "short_factor": "short_factor",
                     "long_factor": "long_factor", "attention_factor": "attention_factor"}}


def _where(hf: dict) -> tuple[str, dict, dict | None]:
    """(the key holding RoPE, the full layers' parameters, the sliding layers' own or None)."""
    key = "rope_parameters" if hf.get("rope_parameters") else "rope_scaling"
    rope = hf.get(key) or {}
    if "full_attention" in rope or "sliding_attention" in rope:  # transformers 5, per layer type
        return f"{key}.full_attention", rope.get("full_attention") or {}, rope.get("sliding_attention") or {}
    return key, rope, None


def _type(rope: dict) -> str:
    return rope.get("rope_type", rope.get("type", "default"))


def _partial(hf: dict, rope: dict) -> float:
    return float(hf.get("partial_rotary_factor", rope.get("partial_rotary_factor", 1.0)))


def checks(hf: dict) -> list[tuple[str, object, str, bool]]:
    """(field, value, supported, ok) for what the template cannot express of config.json's RoPE."""
    where, rope, local = _where(hf)
    out = [(f"{where}.rope_type", _type(rope), ", ".join(TYPES), _type(rope) in TYPES)]
    if local is not None:
        name = where.replace("full_attention", "sliding_attention") + ".rope_type"
        out.append((name, _type(local), "default (sliding layers: plain RoPE at their own base)",
                    _type(local) == "default"))
    partial = _partial(hf, rope)
    if hf.get("model_type") not in PARTIAL_ROTARY:
        out.append(("partial_rotary_factor", partial, "1.0 (this family's transformers model rotates whole heads)",
                    partial == 1.0))
    return out


def fields(hf: dict) -> dict:
    """Our ModelConfig fields of config.json's RoPE (rope_scaling as a dict of model.rope_scaling.*)."""
    _, rope, local = _where(hf)
    theta = float(rope.get("rope_theta", hf.get("rope_theta", 10000.0)))
    out = dict(rotary_base=theta, partial_rotary_factor=_partial(hf, rope), rotary_base_local=None)
    if local is not None:
        out["rotary_base_local"] = float(local.get("rope_theta", hf.get("rope_local_base_freq", 10000.0)))
    elif hf.get("rope_local_base_freq") is not None or hf.get("model_type") in LOCAL_BASE:  # 4.x (default: 10k)
        out["rotary_base_local"] = float(hf.get("rope_local_base_freq") or 10000.0)
    kind = _type(rope)
    if kind == "default":
        return out
    positions = hf.get("max_position_embeddings", 2048)
    # transformers: a top-level original_max_position_embeddings (Phi-3) wins over the one in the RoPE dict
    original = int(hf.get("original_max_position_embeddings") or rope.get("original_max_position_embeddings")
                   or positions)
    if kind == "dynamic":  # its threshold is max_position_embeddings itself
        original = int(positions)
    scaling = dict(type=kind, factor=float(rope.get("factor") or positions / original), original_max_position=original)
    for ours, theirs in KEYS.get(kind, {}).items():
        if ours != "original_max_position" and rope.get(theirs) is not None:
            value = rope[theirs]
            scaling[ours] = [float(v) for v in value] if isinstance(value, list) else value
    out["rope_scaling"] = scaling
    return out


def export_problems(shape, kind: str) -> dict:
    """{our field: value} that family `kind`'s transformers config cannot express."""
    out = {}
    if shape.partial_rotary_factor != 1.0 and kind not in PARTIAL_ROTARY:
        out["model.partial_rotary_factor"] = shape.partial_rotary_factor
    if shape.rotary_base_local is not None and kind not in LOCAL_BASE:
        out["model.rotary_base_local"] = shape.rotary_base_local
    return out


def export_fields(shape, kind: str) -> dict:
    """The transformers config keyword arguments of our RoPE (4.x spelling: 5.x reads it too)."""
    out = dict(rope_theta=shape.rotary_base)
    if shape.partial_rotary_factor != 1.0:
        out["partial_rotary_factor"] = shape.partial_rotary_factor
    if shape.rotary_base_local is not None:
        out["rope_local_base_freq"] = shape.rotary_base_local
    s = shape.rope_scaling
    if s is None:
        return out
    rope = dict(rope_type=s.type, factor=s.factor)
    for ours, theirs in KEYS.get(s.type, {}).items():
        if (value := getattr(s, ours)) is not None:
            rope[theirs] = list(value) if isinstance(value, tuple) else value
    out["rope_scaling"] = rope
    if s.type == "dynamic":  # transformers' threshold for the growing base
        out["max_position_embeddings"] = s.original_max_position
    if s.type == "longrope":  # Phi3Config's own field (default 4096) wins over the RoPE dict's
        out["original_max_position_embeddings"] = s.original_max_position
    return out
