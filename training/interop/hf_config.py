"""Hugging Face config.json <-> our model config, for the families tools/convert_hf.py converts:

    family      what it adds to Llama's decoder (GQA, RoPE, RMSNorm, SwiGLU)       our fields
    llama       Llama 2 / 3.x (3.1+: RoPE scaling "llama3"), Mistral              rope_scaling.*, sliding_window
    qwen2       biases on q, k and v (Qwen2, Qwen2.5)                              qkv_bias
    qwen3       RMSNorm of each query and key head before RoPE; head_dim != h/heads qk_norm, kv_channels
    mixtral     MoE in every layer, softmax over the top-k                        moe.*
    qwen3_moe   Qwen3's attention; MoE layers by decoder_sparse_step / mlp_only_layers moe.*, moe.dense_layers
    gpt_oss     biases everywhere, sinks, sliding / full layers, YaRN, a router bias, clamped SwiGLU experts
                (MXFP4 checkpoints dequantized): training/interop/hf_gpt_oss.py
    gemma2, gemma3_text, olmo2, phi3: training/interop/hf_families.py (sandwich / post norms, soft-caps, windows
                per layer, whole-projection QK-norm, fused Phi-3 projections)
    deepseek_v3 multi-latent attention, DeepSeek's router and shared experts: training/interop/hf_deepseek.py

Import (`model_fields`) refuses what the template cannot express, naming the field and its value as the
checkpoint holds it; export (`hf_config`) writes the family's own config class, picked from the model's
features by `family` (the same rule models/moe.py's HF names follow: QK-norm means Qwen3). RoPE (every type,
partial rotary, a sliding layers' base) for every family: training/interop/hf_rope.py.
Sliding windows (Mistral's, Mixtral's `sliding_window`): transformers' query at position q sees keys k with
q - k < window (masking_utils.sliding_window_overlay: the window counts the query itself), as ours
(models/core_attention.py); the window goes to model.sliding_window (every layer "sliding") and back on export.
Light on purpose (no Megatron-Core, no torch): the config check before any work.
"""

from __future__ import annotations

from training.errors import TemplateError
from training.interop import hf_deepseek, hf_families, hf_gpt_oss, hf_rope

FAMILIES = ("llama", "mistral", "mixtral", "qwen2", "qwen3", "qwen3_moe", *hf_families.FAMILIES, hf_gpt_oss.KIND,
            hf_deepseek.FAMILY)
QWEN = ("qwen2", "qwen3", "qwen3_moe")
WINDOWED = ("mistral", "mixtral", "phi3")  # every layer sliding when config.json's sliding_window is set
ACTIVATIONS = {"silu": "swiglu", "gelu_pytorch_tanh": "geglu_tanh"}  # transformers' gated MLP's act -> ours


class HFError(TemplateError):
    pass


def _refusals(hf: dict) -> list[str]:
    """config.json's fields the template cannot express, each as `field=value (supported: ...)`."""
    kind = hf.get("model_type")
    layer_types = sorted(set(hf.get("layer_types") or ["full_attention"]))
    act, gemma = hf_families.activation(hf), kind in hf_families.GEMMA
    want = "gelu_pytorch_tanh" if gemma else "silu"
    checks = [
        ("model_type", kind, ", ".join(FAMILIES), kind in FAMILIES),
        *hf_rope.checks(hf),  # RoPE types, a sliding layers' RoPE of their own, partial rotary
        ("router_jitter_noise", hf.get("router_jitter_noise", 0.0), "0.0", hf.get("router_jitter_noise", 0.0) == 0.0),
    ]
    if kind == hf_gpt_oss.KIND:  # its experts' activation is its own (swiglu_alpha, swiglu_limit), not hidden_act
        return _named(checks + hf_gpt_oss.checks(hf))
    checks.append(("hidden_activation" if gemma else "hidden_act", act, want, act == want))
    if kind in hf_families.FAMILIES:  # Gemma's layer types, soft-caps; biases, OLMo 2's clip_qkv
        return _named(checks + hf_families.checks(hf))
    checks += [
        ("layer_types", layer_types, "full_attention", layer_types == ["full_attention"]),
        ("attn_logit_softcapping", hf.get("attn_logit_softcapping"), "null", hf.get("attn_logit_softcapping") is None),
        ("final_logit_softcapping", hf.get("final_logit_softcapping"), "null",
         hf.get("final_logit_softcapping") is None)]
    if kind in QWEN:  # Qwen configs carry a sliding_window size even when use_sliding_window is off
        checks.append(("use_sliding_window", hf.get("use_sliding_window", False), "false",
                       not hf.get("use_sliding_window", False)))
    elif kind not in WINDOWED:  # Llama has no window: a size here means a model transformers' Llama is not
        checks.append(("sliding_window", hf.get("sliding_window"), "null", hf.get("sliding_window") is None))
    if kind in ("qwen3", "qwen3_moe"):  # Qwen3's flag biases q, k, v and o, its MLP has none
        checks.append(("attention_bias", hf.get("attention_bias", False), "false", not hf.get("attention_bias")))
    attention_bias, mlp_bias = bool(hf.get("attention_bias", False)), bool(hf.get("mlp_bias", False))
    if kind not in QWEN and attention_bias != mlp_bias:  # our o_proj bias comes with the MLP's (add_bias_linear)
        field = "attention_bias" if attention_bias else "mlp_bias"
        checks.append((field, True, f"only with {'mlp_bias' if attention_bias else 'attention_bias'}=true: the "
                                    f"template's o_proj bias and MLP biases are one switch, model.add_bias_linear",
                       False))
    if kind == hf_deepseek.FAMILY:  # multi-latent attention, DeepSeek's MoE: training/interop/hf_deepseek.py
        checks += hf_deepseek.checks(hf)
    if kind == "qwen3_moe":
        checks.append(("shared_expert_intermediate_size", hf.get("shared_expert_intermediate_size"), "null or 0",
                       not hf.get("shared_expert_intermediate_size")))
    return _named(checks)


def _named(checks: list) -> list[str]:
    return [f"{name}={value!r} (supported: {ok})" for name, value, ok, good in checks if not good]


def model_fields(hf: dict) -> dict:
    """HF config.json -> training.config.schema.ModelConfig fields (nested groups "moe", "rope_scaling" as dicts);
    refuses what our GPT cannot express, naming the field and the value config.json holds."""
    if problems := _refusals(hf):
        raise HFError(f"this Hugging Face model ({hf.get('model_type')}) has what the template cannot express: "
                      + "; ".join(problems))
    kind = hf["model_type"]
    window = int(hf["sliding_window"]) if kind in WINDOWED and hf.get("sliding_window") is not None else None
    heads = hf["num_attention_heads"]
    head_dim = hf.get("head_dim") or hf["hidden_size"] // heads
    fields = dict(
        num_layers=hf["num_hidden_layers"], hidden_size=hf["hidden_size"], num_attention_heads=heads,
        num_query_groups=hf.get("num_key_value_heads") or heads, ffn_hidden_size=hf["intermediate_size"],
        kv_channels=None if head_dim * heads == hf["hidden_size"] else head_dim,
        vocab_size=hf["vocab_size"], seq_length=hf.get("max_position_embeddings", 2048),
        max_position_embeddings=hf.get("max_position_embeddings"),  # kept for export when seq_length is cut
        sliding_window=window,
        position_embedding="rope", **hf_rope.fields(hf),  # rotary_base(_local), partial_rotary_factor, rope_scaling
        normalization="RMSNorm", norm_epsilon=float(hf.get("rms_norm_eps", 1e-6)),
        activation=ACTIVATIONS.get(hf_families.activation(hf), "swiglu"),  # gpt_oss: its own (hf_gpt_oss.py)
        add_bias_linear=bool(hf.get("attention_bias", False)) and kind not in QWEN,
        qkv_bias=kind == "qwen2", qk_norm=kind in ("qwen3", "qwen3_moe"),
        tie_embeddings=bool(hf.get("tie_word_embeddings", False)),  # LlamaConfig's default
        attention_dropout=float(hf.get("attention_dropout", 0.0)), hidden_dropout=0.0,
        init_method_std=float(hf.get("initializer_range", 0.02)))
    fields.update(hf_families.fields(hf))  # Gemma's norms, scale, soft-caps and layer types; OLMo 2's norms
    if kind == hf_gpt_oss.KIND:  # biases, sinks, windows, clamped SwiGLU experts
        fields.update(hf_gpt_oss.fields(hf))
    if kind == hf_deepseek.FAMILY:
        fields.update(hf_deepseek.fields(hf))  # multi-latent attention's sizes
    if kind == "mixtral":  # every layer sparse; the top-k renormalised: softmax over the top-k logits
        fields["moe"] = dict(
            num_experts=hf["num_local_experts"], top_k=hf["num_experts_per_tok"], ffn_hidden_size=None,
            shared_expert_ffn_hidden_size=None, layer_freq=1, first_dense=0, dense_layers=[],
            score_function="softmax", pre_softmax=False, aux_loss_coeff=float(hf.get("router_aux_loss_coef", 0.02)))
    elif kind == "qwen3_moe":  # HF: layer i sparse unless in mlp_only_layers, when (i+1) % decoder_sparse_step == 0
        step = int(hf.get("decoder_sparse_step", 1))
        fields["moe"] = dict(
            num_experts=hf.get("num_experts") or hf["num_local_experts"], top_k=hf["num_experts_per_tok"],
            ffn_hidden_size=hf["moe_intermediate_size"], shared_expert_ffn_hidden_size=None,
            layer_freq=step, first_dense=step - 1, dense_layers=sorted(hf.get("mlp_only_layers") or []),
            score_function="softmax",
            # norm_topk_prob: renormalise the top-k probabilities = softmax over the top-k logits (pre_softmax off)
            pre_softmax=not hf.get("norm_topk_prob", False),
            aux_loss_coeff=float(hf.get("router_aux_loss_coef", 0.001)))
    return fields


def family(shape) -> str:
    """The Hugging Face family that expresses this models/shape.py ModelShape (export writes its config)."""
    if shape.mla is not None:  # multi-latent attention: DeepSeek-V3's
        return hf_deepseek.FAMILY
    if shape.num_experts:
        return hf_gpt_oss.KIND if hf_gpt_oss.is_gpt_oss(shape) else "qwen3_moe" if shape.qk_norm else "mixtral"
    if kind := hf_families.family(shape):  # sandwich norms: Gemma; post: OLMo 2; partial / longrope RoPE: Phi-3
        return kind
    if shape.qk_norm:
        return "qwen3"
    return "qwen2" if shape.qkv_bias and not shape.add_bias_linear else "llama"


def _export_problems(shape, kind: str) -> dict:
    """{our field: value} that the family `kind` cannot express."""
    if kind == hf_gpt_oss.KIND:
        return {**{name: value for name, value, ok in hf_gpt_oss.export_checks(shape) if value != ok},
                **hf_rope.export_problems(shape, kind)}
    checks = [("model.position_embedding", shape.position_embedding, "rope"),
              ("model.normalization", shape.normalization, "RMSNorm"), *hf_families.export_checks(shape, kind)]
    if kind not in hf_families.FAMILIES:
        checks.append(("model.activation", shape.activation, "swiglu"))
    if kind in ("qwen3", "qwen3_moe", "mixtral"):
        checks += [("model.add_bias_linear", shape.add_bias_linear, False), ("model.qkv_bias", shape.qkv_bias, False)]
    if kind in QWEN:  # their windows cover some layers (max_window_layers, layer_types), Mistral's every layer
        checks.append(("model.sliding_window", shape.sliding_window, None))
    if kind == "llama" and shape.sliding_window:  # a window exports as Mistral, which has no biases
        checks.append(("model.add_bias_linear", shape.add_bias_linear, False))
    if kind == "qwen2":  # Qwen2's head dim is hidden_size / heads
        checks.append(("model.kv_channels", shape.kv_channels, shape.hidden_size // shape.num_attention_heads))
    if shape.num_experts and kind != hf_deepseek.FAMILY:  # DeepSeek's: sigmoid, shared experts
        checks += [("model.moe.shared_expert_ffn_hidden_size", shape.moe_shared_ffn_hidden_size, None),
                   ("model.moe.score_function", shape.moe_score_function, "softmax")]
    if kind == "mixtral":
        checks += [("MoE layers (model.moe.first_dense, layer_freq, dense_layers)", len(shape.moe_layer_numbers),
                    shape.num_layers),  # Mixtral: every layer
                   ("model.moe.pre_softmax", shape.moe_pre_softmax, False)]
    return {**{name: value for name, value, ok in checks if value != ok}, **hf_rope.export_problems(shape, kind)}


def hf_config(shape, model, precision: str):
    """Our model's shape (+ its config's dropout, init std, aux-loss weight) -> the family's transformers config
    (LlamaConfig, MistralConfig for a llama with a sliding window, Qwen2Config, Qwen3Config, MixtralConfig or
    Qwen3MoeConfig)."""
    import transformers

    kind = family(shape)
    if wrong := _export_problems(shape, kind):
        raise HFError(f"this model exports as {kind} (from its features), which cannot express {wrong}")
    dtype_key = "dtype" if int(transformers.__version__.split(".")[0]) >= 5 else "torch_dtype"
    common = dict(
        vocab_size=shape.vocab_size, hidden_size=shape.hidden_size, num_hidden_layers=shape.num_layers,
        num_attention_heads=shape.num_attention_heads, num_key_value_heads=shape.num_query_groups,
        head_dim=shape.kv_channels, max_position_embeddings=model.max_position_embeddings or shape.seq_length,
        rms_norm_eps=shape.norm_epsilon, hidden_act="silu", tie_word_embeddings=shape.tie_embeddings,
        attention_dropout=model.attention_dropout, initializer_range=model.init_method_std, bos_token_id=None,
        eos_token_id=None, **{dtype_key: "bfloat16" if precision == "bf16" else "float32"})
    common.update(hf_rope.export_fields(shape, kind))  # rope_theta, rope_scaling, partial rotary, a local base
    if kind == hf_gpt_oss.KIND:
        return hf_gpt_oss.hf_config(transformers, shape, model, common)
    if kind == hf_deepseek.FAMILY:
        return hf_deepseek.hf_config(transformers, shape, model, {**common, "intermediate_size": shape.ffn_hidden_size})
    if kind in hf_families.FAMILIES:  # Gemma 2 / 3, OLMo 2, Phi-3
        return hf_families.hf_config(transformers, shape, kind, {**common, "intermediate_size": shape.ffn_hidden_size})
    if kind == "mixtral":
        return transformers.MixtralConfig(
            **common, intermediate_size=shape.moe_ffn_hidden_size, num_local_experts=shape.num_experts,
            num_experts_per_tok=shape.moe_top_k, router_aux_loss_coef=model.moe.aux_loss_coeff,
            sliding_window=shape.sliding_window,
            architectures=["MixtralForCausalLM"])
    if kind == "qwen3_moe":
        dense = [n - 1 for n in range(1, shape.num_layers + 1) if n not in shape.moe_layer_numbers]
        return transformers.Qwen3MoeConfig(
            **common, intermediate_size=shape.ffn_hidden_size, moe_intermediate_size=shape.moe_ffn_hidden_size,
            num_experts=shape.num_experts, num_experts_per_tok=shape.moe_top_k,
            norm_topk_prob=not shape.moe_pre_softmax, decoder_sparse_step=1, mlp_only_layers=dense,
            router_aux_loss_coef=model.moe.aux_loss_coeff, attention_bias=False, use_sliding_window=False,
            architectures=["Qwen3MoeForCausalLM"])
    if kind == "qwen3":
        return transformers.Qwen3Config(**common, intermediate_size=shape.ffn_hidden_size, attention_bias=False,
                                        use_sliding_window=False, architectures=["Qwen3ForCausalLM"])
    if kind == "qwen2":  # no head_dim field: hidden_size / heads (checked above)
        common.pop("head_dim")
        return transformers.Qwen2Config(**common, intermediate_size=shape.ffn_hidden_size, use_sliding_window=False,
                                        architectures=["Qwen2ForCausalLM"])
    if shape.sliding_window:  # Mistral: Llama's decoder with every layer's attention windowed
        return transformers.MistralConfig(**common, intermediate_size=shape.ffn_hidden_size,
                                          sliding_window=shape.sliding_window, architectures=["MistralForCausalLM"])
    return transformers.LlamaConfig(
        **common, intermediate_size=shape.ffn_hidden_size, attention_bias=shape.add_bias_linear,
        mlp_bias=shape.add_bias_linear, architectures=["LlamaForCausalLM"])
