"""DeepSeek-V3's config.json (model_type deepseek_v3: DeepSeek-V3/R1, Kimi K2, Moonlight) <-> our model config;
training/interop/hf_config.py asks this file for the family's refusals, fields and export config.

    attention   multi-latent attention (models/mla.py): q_lora_rank, kv_lora_rank, qk_nope_head_dim,
                qk_rope_head_dim, v_head_dim -> model.mla.*; no GQA (num_key_value_heads = heads); YaRN with
                DeepSeek's mscale / mscale_all_dim (training/interop/hf_rope.py)
    rope_interleave  the layout of the rotated rows in the checkpoint: true (DeepSeek's and transformers'
                default; models/mla.py reorders them on import and back on export)
    MoE         after first_k_dense_replace dense layers: n_routed_experts SwiGLU experts of moe_intermediate_size,
                n_shared_experts folded into one shared expert (moe.shared_expert_ffn_hidden_size); Megatron-Core's
                TopKRouter: sigmoid scores + e_score_correction_bias (model.moe.router_expert_bias), n_group /
                topk_group (router_num_groups / router_group_topk; Megatron-Core sums each group's top
                top_k/topk_group scores where transformers sums its top 2: equal only when top_k = 2 topk_group,
                checked), the top-k renormalised (norm_topk_prob) and times routed_scaling_factor
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
    out = [
        ("num_key_value_heads", hf.get("num_key_value_heads", heads), f"{heads} (num_attention_heads: MLA has one "
         f"K/V per head)", hf.get("num_key_value_heads", heads) == heads),
        ("rope_interleave", hf.get("rope_interleave", True), "true (DeepSeek's layout)", rope_interleave(hf))]
    if dense(hf):
        return out
    k, groups, pick = hf["num_experts_per_tok"], hf.get("n_group") or 1, hf.get("topk_group") or 1
    return out + [
        ("scoring_func", hf.get("scoring_func", "sigmoid"), "sigmoid", hf.get("scoring_func", "sigmoid") == "sigmoid"),
        ("norm_topk_prob", hf.get("norm_topk_prob", True), "true (Megatron-Core renormalises sigmoid top-k)",
         hf.get("norm_topk_prob", True) or k == 1),
        ("topk_group", pick, f"num_experts_per_tok / 2 = {k / 2} with n_group={groups} > 1 (transformers scores a "
         f"group by its top 2, Megatron-Core by its top num_experts_per_tok / topk_group)",
         groups == 1 or k == 2 * pick),
        ("moe_layer_freq", hf.get("moe_layer_freq", 1), "1", hf.get("moe_layer_freq", 1) == 1)]


def fields(hf: dict) -> dict:
    """The model.* fields this family sets beyond Llama's (hf_config.model_fields sets the common ones)."""
    out = dict(attention="mla", kv_channels=None, num_query_groups=None, mla={k: hf[k] for k in MLA_FIELDS})
    if not dense(hf):
        groups = hf.get("n_group") or 1
        out["moe"] = dict(
            num_experts=hf["n_routed_experts"], top_k=hf["num_experts_per_tok"],
            ffn_hidden_size=hf["moe_intermediate_size"],
            shared_expert_ffn_hidden_size=hf["moe_intermediate_size"] * hf.get("n_shared_experts", 1) or None,
            layer_freq=1, first_dense=hf.get("first_k_dense_replace", 0), dense_layers=[], score_function="sigmoid",
            pre_softmax=False, aux_loss_coeff=0.0, router_expert_bias=True,  # aux-loss-free: the bias balances
            router_num_groups=groups if groups > 1 else None,
            router_group_topk=hf.get("topk_group") if groups > 1 else None,
            router_topk_scaling_factor=float(hf.get("routed_scaling_factor", 1.0)))
    return out


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


def hf_config(transformers, shape, model, common: dict):
    """Our MLA model's shape (+ its config's router settings) -> transformers' DeepseekV3Config (the rotated rows
    interleaved as DeepSeek stores them)."""
    m = shape.mla
    common = {**common, "head_dim": m.qk_rope_head_dim, "num_key_value_heads": shape.num_attention_heads}
    moe = dict(moe_intermediate_size=shape.ffn_hidden_size, first_k_dense_replace=shape.num_layers)
    if shape.num_experts:
        r = model.moe
        ffn, shared = shape.moe_ffn_hidden_size, shape.moe_shared_ffn_hidden_size or 0
        moe = dict(moe_intermediate_size=ffn, n_routed_experts=shape.num_experts, num_experts_per_tok=shape.moe_top_k,
                   n_shared_experts=shared // ffn, first_k_dense_replace=min(shape.moe_layer_numbers) - 1,
                   n_group=r.router_num_groups or 1, topk_group=r.router_group_topk or 1, norm_topk_prob=True,
                   routed_scaling_factor=r.router_topk_scaling_factor or 1.0)
    return transformers.DeepseekV3Config(
        **common, **moe, attention_bias=shape.add_bias_linear, rope_interleave=True,
        **{k: getattr(m, k) for k in MLA_FIELDS}, architectures=["DeepseekV3ForCausalLM"])
