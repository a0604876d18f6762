"""DeepSeek-V3's config.json (model_type deepseek_v3: DeepSeek-V3/R1, Kimi K2, Moonlight) <-> our model config;
training/interop/hf_config.py asks this file for the family's refusals, fields and export config.

    attention   multi-latent attention (models/mla.py): q_lora_rank, kv_lora_rank, qk_nope_head_dim,
                qk_rope_head_dim, v_head_dim -> model.mla.*; no GQA (num_key_value_heads = heads); YaRN with
                DeepSeek's mscale / mscale_all_dim (training/interop/hf_rope.py)
    rope_interleave  the layout of the rotated rows in the checkpoint: true (DeepSeek's and transformers'
                default; models/mla.py reorders them on import and back on export)
    MLP         dense layers only so far: the MoE layers (sigmoid router with expert-bias correction,
                group-limited top-k, shared experts) are refused until models/moe.py maps them
    num_nextn_predict_layers  multi-token prediction: its layers (model.layers.{num_hidden_layers}...) are not
                imported (transformers' model has none either)

Light on purpose (no torch, no Megatron-Core): the config check before any work.
"""

from __future__ import annotations

FAMILY = "deepseek_v3"
MLA_FIELDS = ("q_lora_rank", "kv_lora_rank", "qk_nope_head_dim", "qk_rope_head_dim", "v_head_dim")


def dense(hf: dict) -> bool:
    """Every layer keeps a dense MLP (first_k_dense_replace covers them all, or no routed experts)."""
    return not hf.get("n_routed_experts") or hf.get("first_k_dense_replace", 0) >= hf["num_hidden_layers"]


def checks(hf: dict) -> list[tuple[str, object, str, bool]]:
    """(field, value, supported, ok) of what the template cannot express of a deepseek_v3 config.json."""
    heads = hf["num_attention_heads"]
    return [
        ("num_key_value_heads", hf.get("num_key_value_heads", heads), f"{heads} (num_attention_heads: MLA has one "
         f"K/V per head)", hf.get("num_key_value_heads", heads) == heads),
        ("first_k_dense_replace", hf.get("first_k_dense_replace"), f"{hf['num_hidden_layers']} "
         f"(num_hidden_layers: DeepSeek's MoE layers are not imported yet)", dense(hf)),
        ("rope_interleave", hf.get("rope_interleave", True), "true (DeepSeek's layout)", rope_interleave(hf))]


def fields(hf: dict) -> dict:
    """The model.* fields this family sets beyond Llama's (hf_config.model_fields sets the common ones)."""
    return dict(attention="mla", kv_channels=None, num_query_groups=None, mla={k: hf[k] for k in MLA_FIELDS})


def skipped(hf: dict) -> str | None:
    """The one line import prints about what it leaves out (multi-token prediction), or None."""
    if not hf.get("num_nextn_predict_layers"):
        return None
    return (f"skipped: num_nextn_predict_layers={hf['num_nextn_predict_layers']} multi-token prediction layer(s) "
            f"(model.layers.{hf['num_hidden_layers']}...; transformers' model has none either)")


def mtp_tensor(hf: dict, name: str) -> bool:
    """A tensor of the multi-token prediction layers (the layers past num_hidden_layers)."""
    layers = int(hf["num_hidden_layers"])
    return any(name.startswith(f"model.layers.{layers + i}.") for i in range(int(hf.get("num_nextn_predict_layers")
                                                                                  or 0)))


def rope_interleave(hf: dict) -> bool:
    return bool(hf.get("rope_interleave", True))


def hf_config(transformers, shape, common: dict):
    """Our MLA model's shape -> transformers' DeepseekV3Config (dense layers; the rotated rows interleaved as
    DeepSeek stores them)."""
    m = shape.mla
    common = {**common, "head_dim": m.qk_rope_head_dim, "num_key_value_heads": shape.num_attention_heads}
    return transformers.DeepseekV3Config(
        **common, moe_intermediate_size=shape.ffn_hidden_size,
        first_k_dense_replace=shape.num_layers, attention_bias=shape.add_bias_linear,
        rope_interleave=True, **{k: getattr(m, k) for k in MLA_FIELDS}, architectures=["DeepseekV3ForCausalLM"])
