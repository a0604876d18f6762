"""gpt-oss (model_type gpt_oss: gpt-oss-20b / 120b) <-> our model config (training/interop/hf_config.py asks this
file for its refusals, fields, export checks and config). What it adds to Mixtral's MoE decoder, and where:

    attention  q, k, v and o biases (model.add_bias_linear); a learned sink logit per head in the softmax
               denominator (model.attention_sinks); sliding and full layers (layer_types, sliding_window); YaRN
               RoPE, unscaled beyond its attention factor (hf_rope.py)
    MoE        a router with a bias, softmax over the top-k logits (model.moe.pre_softmax=false); every expert's
               projections with biases (model.add_bias_linear: one switch, as gpt-oss has no bias-free linear),
               the down bias weighted by the routing probability (Megatron-Core's expert MLP); the clamped SwiGLU
               (model.activation=clamped_swiglu, model.swiglu_limit); gate and up interleaved in HF's fused
               gate_up_proj (models/moe.py maps them)

Published checkpoints store the experts in MXFP4 (`..._blocks`, `..._scales`, quantization_config.quant_method
mxfp4): import dequantizes them to bf16 (training/interop/mxfp4.py); export writes bf16 (no quantization_config).
Light (no torch): part of the config check before any work.
"""

from __future__ import annotations

from training.interop.hf_families import LAYER_TYPES, HF_LAYER_TYPES

KIND = "gpt_oss"
ALPHA = 1.702  # Megatron-Core's quick_gelu: sigmoid(1.702 x); gpt-oss's swiglu_alpha


def checks(hf: dict) -> list[tuple[str, object, str, bool]]:
    """(field, value, supported, ok) of what the template cannot express of a gpt_oss config.json."""
    types = list(hf.get("layer_types") or [])
    quant = (hf.get("quantization_config") or {}).get("quant_method")
    return [
        ("swiglu_alpha", hf.get("swiglu_alpha", ALPHA), f"{ALPHA} (Megatron-Core's quick_gelu)",
         float(hf.get("swiglu_alpha", ALPHA)) == ALPHA),
        ("attention_bias", hf.get("attention_bias", True), "true (the experts' and attention's biases are one "
         "switch, model.add_bias_linear)", bool(hf.get("attention_bias", True))),
        ("layer_types", types, "full_attention, sliding_attention", set(types) <= set(LAYER_TYPES)),
        ("quantization_config.quant_method", quant, "mxfp4 (dequantized to bf16) or none", quant in (None, "mxfp4")),
    ]


def fields(hf: dict) -> dict:
    """The model.* fields gpt-oss sets beyond Llama's (hf_config.model_fields sets the common ones)."""
    types = list(hf.get("layer_types") or ["full_attention"] * hf["num_hidden_layers"])
    window = hf.get("sliding_window")
    sliding = window is not None and "sliding_attention" in types
    return dict(
        add_bias_linear=True, qkv_bias=False, attention_sinks=True, activation="clamped_swiglu",
        swiglu_limit=float(hf.get("swiglu_limit", 7.0)), tie_embeddings=bool(hf.get("tie_word_embeddings", False)),
        sliding_window=int(window) if sliding else None,
        layer_types=[LAYER_TYPES[t] for t in types] if sliding else None,
        moe=dict(num_experts=hf["num_local_experts"], top_k=hf["num_experts_per_tok"], ffn_hidden_size=None,
                 shared_expert_ffn_hidden_size=None, layer_freq=1, first_dense=0, dense_layers=[],
                 score_function="softmax", pre_softmax=False,  # softmax over the k selected logits
                 aux_loss_coeff=float(hf.get("router_aux_loss_coef", 0.001))))


def is_gpt_oss(shape) -> bool:
    """Our features that only gpt-oss expresses: experts with the clamped SwiGLU or attention sinks."""
    return bool(shape.num_experts) and (shape.activation == "clamped_swiglu" or shape.attention_sinks)


def export_checks(shape) -> list[tuple[str, object, object]]:
    """(our field, value, the value gpt_oss needs)."""
    return [("model.norm_placement", shape.norm_placement, "pre"),
            ("model.norm_zero_centered", shape.norm_zero_centered, False),
            ("model.scale_embedding", shape.scale_embedding, False), ("model.qk_norm", shape.qk_norm, False),
            ("model.attention_sinks", shape.attention_sinks, True),
            ("model.add_bias_linear", shape.add_bias_linear, True),
            ("model.activation", shape.activation, "clamped_swiglu"),
            ("model.query_pre_attn_scalar", shape.query_pre_attn_scalar, None),
            ("model.attn_logit_softcap", shape.attn_logit_softcap, None),
            ("model.final_logit_softcap", shape.final_logit_softcap, None),
            ("model.moe.shared_expert_ffn_hidden_size", shape.moe_shared_ffn_hidden_size, None),
            ("model.moe.score_function", shape.moe_score_function, "softmax"),
            ("model.moe.pre_softmax", shape.moe_pre_softmax, False),
            ("MoE layers (model.moe.first_dense, layer_freq, dense_layers)", len(shape.moe_layer_numbers),
             shape.num_layers)]


def hf_config(transformers, shape, model, common: dict):
    """GptOssConfig from hf_config.hf_config's common keyword arguments."""
    common = {**common, "pad_token_id": None}
    common.pop("hidden_act")
    window = shape.sliding_window if "sliding" in shape.layer_types else None
    return transformers.GptOssConfig(
        **common, intermediate_size=shape.moe_ffn_hidden_size, num_local_experts=shape.num_experts,
        num_experts_per_tok=shape.moe_top_k, router_aux_loss_coef=model.moe.aux_loss_coeff,
        swiglu_limit=shape.swiglu_limit, attention_bias=True, sliding_window=window,
        layer_types=[HF_LAYER_TYPES[t] for t in shape.layer_types], architectures=["GptOssForCausalLM"])
