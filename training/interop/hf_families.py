"""The dense families past Llama's decoder (training/interop/hf_config.py asks this file for their refusals,
fields, export checks and config): what each adds, and the model.* fields that carry it.

    gemma2       sandwich norms (four a layer), (1 + w) RMSNorm, embeddings x sqrt(h), GeGLU-tanh, softmax scale
                 query_pre_attn_scalar^-0.5, attention and final-logit soft-caps, sliding layers every other one
    gemma3_text  Gemma 2's layer with per-head QK-norm, no soft-caps by default, 5 sliding : 1 full layers
                 (layer_types / sliding_window_pattern), a local RoPE base for sliding layers (hf_rope.py)
    olmo2        norms after attention and the MLP only (no input norms), RMSNorm over the whole q and k projections
    phi3         Phi-3 / Phi-4: fused qkv_proj and gate_up_proj (models/attention.py, models/mlp.py split them),
                 partial rotary and longrope (hf_rope.py), Mistral's window on every layer when set

transformers' layer types: "sliding_attention" -> our "sliding", "full_attention" -> "full". Light (no torch).
"""

from __future__ import annotations

GEMMA = ("gemma2", "gemma3_text")
FAMILIES = (*GEMMA, "olmo2", "phi3")
LAYER_TYPES = {"full_attention": "full", "sliding_attention": "sliding"}
HF_LAYER_TYPES = {ours: theirs for theirs, ours in LAYER_TYPES.items()}


def activation(hf: dict) -> str:
    """The MLP's activation as the family's transformers model reads it (Gemma: hidden_activation)."""
    if hf.get("model_type") in GEMMA:
        return hf.get("hidden_activation") or "gelu_pytorch_tanh"
    return hf.get("hidden_act", "silu")


def gemma_layer_types(hf: dict) -> list[str]:
    """config.json's layer_types, else the family's default pattern (transformers' __post_init__)."""
    if hf.get("layer_types"):
        return list(hf["layer_types"])
    every = 2 if hf["model_type"] == "gemma2" else int(hf.get("sliding_window_pattern") or 6)
    return ["sliding_attention" if (i + 1) % every else "full_attention" for i in range(hf["num_hidden_layers"])]


def checks(hf: dict) -> list[tuple[str, object, str, bool]]:
    """(field, value, supported, ok) of what the template cannot express of these families' config.json."""
    kind = hf.get("model_type")
    out = [("attention_bias", hf.get("attention_bias", False), "false (q, k, v and o biases without MLP biases: "
            "the template's o bias comes with the MLP's)", not hf.get("attention_bias"))]
    if kind in GEMMA:
        types = gemma_layer_types(hf)
        out += [("layer_types", types, "full_attention, sliding_attention", set(types) <= set(LAYER_TYPES)),
                ("use_bidirectional_attention", hf.get("use_bidirectional_attention"), "false/null",
                 not hf.get("use_bidirectional_attention"))]
    if kind == "gemma3_text":  # transformers' Gemma3Attention never applies it: the model it builds has no cap
        out.append(("attn_logit_softcapping", hf.get("attn_logit_softcapping"), "null (transformers' Gemma 3 "
                    "ignores it)", hf.get("attn_logit_softcapping") is None))
    if kind == "olmo2" and hf.get("clip_qkv") is not None:  # OLMo 1's option; OLMo 2's modeling has none
        out.append(("clip_qkv", hf["clip_qkv"], "null", False))
    if kind in ("olmo2", "phi3") and hf.get("head_dim") not in (None, hf["hidden_size"] // hf["num_attention_heads"]):
        out.append(("head_dim", hf["head_dim"], "hidden_size / num_attention_heads", False))
    return out


def fields(hf: dict) -> dict:
    """The model.* fields these families set beyond Llama's (hf_config.model_fields sets the common ones)."""
    kind = hf["model_type"]
    if kind in GEMMA:
        types = gemma_layer_types(hf)
        window = hf.get("sliding_window")
        return dict(norm_placement="sandwich", norm_zero_centered=True, scale_embedding=True,
                    qk_norm=kind == "gemma3_text", query_pre_attn_scalar=float(hf.get("query_pre_attn_scalar", 256)),
                    attn_logit_softcap=_float(hf.get("attn_logit_softcapping", 50.0 if kind == "gemma2" else None)),
                    final_logit_softcap=_float(hf.get("final_logit_softcapping", 30.0 if kind == "gemma2" else None)),
                    sliding_window=int(window) if window is not None and "sliding_attention" in types else None,
                    layer_types=[LAYER_TYPES[t] for t in types] if window is not None else None,
                    tie_embeddings=bool(hf.get("tie_word_embeddings", True)))  # Gemma's default: tied
    if kind == "olmo2":
        return dict(norm_placement="post", qk_norm=True, qk_norm_span="projection")
    return {}


def _float(value) -> float | None:
    return None if value is None else float(value)


def _int(value: float) -> int | float:  # transformers' strict configs type query_pre_attn_scalar as int
    return int(value) if float(value).is_integer() else value


def family(shape) -> str | None:
    """Which of these families expresses the shape (by its features), or None: one of hf_config's."""
    if shape.norm_placement == "sandwich":
        return "gemma3_text" if shape.qk_norm or shape.rotary_base_local is not None else "gemma2"
    if shape.norm_placement == "post":
        return "olmo2"
    if not shape.num_experts and not shape.qk_norm and (
            shape.partial_rotary_factor != 1.0 or (shape.rope_scaling and shape.rope_scaling.type == "longrope")):
        return "phi3"
    return None


def export_checks(shape, kind: str) -> list[tuple[str, object, object]]:
    """(our field, value, the value family `kind` needs) for every family: the Llama-like ones need none of
    Gemma's and OLMo 2's features."""
    gemma, head_dim = kind in GEMMA, shape.kv_channels
    out = [("model.norm_placement", shape.norm_placement,
            "sandwich" if gemma else "post" if kind == "olmo2" else "pre"),
           ("model.norm_zero_centered", shape.norm_zero_centered, gemma),
           ("model.scale_embedding", shape.scale_embedding, gemma),
           ("model.attention_sinks", shape.attention_sinks, False)]
    if not gemma:  # the softmax scale is 1/sqrt(head_dim); no soft-caps
        out += [("model.query_pre_attn_scalar", shape.query_pre_attn_scalar,
                 head_dim if shape.query_pre_attn_scalar == head_dim else None),
                ("model.attn_logit_softcap", shape.attn_logit_softcap, None),
                ("model.final_logit_softcap", shape.final_logit_softcap, None)]
        if len(set(shape.layer_types)) > 1:  # Mistral / Phi-3: a window on every layer or none
            out.append(("model.layer_types", list(shape.layer_types), "all full or all sliding"))
    if kind in FAMILIES:
        out += [("model.add_bias_linear", shape.add_bias_linear, False), ("model.qkv_bias", shape.qkv_bias, False),
                ("model.activation", shape.activation, "geglu_tanh" if gemma else "swiglu")]
    if kind == "gemma2":
        out.append(("model.qk_norm", shape.qk_norm, False))
    if kind == "gemma3_text":
        out.append(("model.qk_norm_span", shape.qk_norm_span if shape.qk_norm else None, "head"))
    if kind == "olmo2":
        out += [("model.qk_norm_span", shape.qk_norm_span if shape.qk_norm else None, "projection"),
                ("model.sliding_window", shape.sliding_window, None)]
    if kind in ("olmo2", "phi3"):  # no head_dim field: hidden_size / heads
        out.append(("model.kv_channels", head_dim, shape.hidden_size // shape.num_attention_heads))
    return out


def hf_config(transformers, shape, kind: str, common: dict):
    """The family's transformers config from hf_config.hf_config's common keyword arguments."""
    common = {**common, "pad_token_id": None}  # Phi-3's default 32000 would index past a smaller vocabulary
    if kind in GEMMA:
        common.pop("hidden_act")
        types = [HF_LAYER_TYPES[t] for t in shape.layer_types]
        extra = dict(hidden_activation="gelu_pytorch_tanh",
                     query_pre_attn_scalar=_int(shape.query_pre_attn_scalar or shape.kv_channels),
                     sliding_window=shape.sliding_window, layer_types=types,
                     attn_logit_softcapping=shape.attn_logit_softcap,
                     final_logit_softcapping=shape.final_logit_softcap)
        if kind == "gemma3_text":  # sliding layers' base: their own or the full layers'
            common.setdefault("rope_local_base_freq", shape.rotary_base)
            return transformers.Gemma3TextConfig(**common, **extra, architectures=["Gemma3ForCausalLM"])
        return transformers.Gemma2Config(**common, **extra, architectures=["Gemma2ForCausalLM"])
    common.pop("head_dim")
    if kind == "olmo2":
        return transformers.Olmo2Config(**common, attention_bias=False, architectures=["Olmo2ForCausalLM"])
    window = shape.sliding_window if "sliding" in shape.layer_types else None
    return transformers.Phi3Config(**common, sliding_window=window, architectures=["Phi3ForCausalLM"])
