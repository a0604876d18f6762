"""models/mla.py's multi-latent attention against transformers' DeepseekV3Attention, one process: the same
weights through from_hf (HF's interleaved RoPE rows, rope_interleave=True, and the plain layout), YaRN with
DeepSeek's mscale on the softmax and on cos / sin, q low-rank or a plain q projection, v_head_dim != qk head
dim. Output and input gradient within 1e-5; to_hf gives back HF's tensors. The layouts (tp2, tp2 + sp, pp2) are
tests/test_model_parallel_equivalence.py's "mla" cases; the activation bytes tests/test_activation_bytes.py's."""

from __future__ import annotations

import pytest
import torch

from training.config.compose import compose

S, B, H, HEADS = 24, 2, 64, 4
MLA = ["model.attention=mla", f"model.hidden_size={H}", f"model.num_attention_heads={HEADS}",
       "model.num_query_groups=null", "model.mla.kv_lora_rank=16", "model.mla.qk_nope_head_dim=12",
       "model.mla.qk_rope_head_dim=8", "model.mla.v_head_dim=10"]
YARN = ["model.rope_scaling.type=yarn", "model.rope_scaling.factor=4", "model.rope_scaling.original_max_position=8",
        "model.rope_scaling.mscale=0.8", "model.rope_scaling.mscale_all_dim=0.6"]
# name -> (our overrides, transformers' config, HF's rope_interleave)
CASES = {
    "q-lora-yarn-interleaved": ([*MLA, "model.mla.q_lora_rank=20", *YARN], True),
    "q-proj-plain-rope": ([*MLA, "model.mla.q_lora_rank=null"], False),
}


def hf_config(cfg, interleave: bool):
    from transformers import DeepseekV3Config

    m, r = cfg.model.mla, cfg.model.rope_scaling
    rope = {"rope_type": "default", "rope_theta": cfg.model.rotary_base}
    if str(r.type) == "yarn":
        rope = {**rope, "rope_type": "yarn", "factor": r.factor, "original_max_position_embeddings":
                r.original_max_position, "mscale": r.mscale, "mscale_all_dim": r.mscale_all_dim,
                "beta_fast": r.beta_fast, "beta_slow": r.beta_slow}
    return DeepseekV3Config(
        hidden_size=H, num_attention_heads=HEADS, num_key_value_heads=HEADS, q_lora_rank=m.q_lora_rank,
        kv_lora_rank=m.kv_lora_rank, qk_nope_head_dim=m.qk_nope_head_dim, qk_rope_head_dim=m.qk_rope_head_dim,
        v_head_dim=m.v_head_dim, rope_interleave=interleave, rope_parameters=rope, max_position_embeddings=64,
        attention_bias=False, attn_implementation="eager")


@pytest.mark.parametrize("case", list(CASES))
def test_mla_equals_transformers_deepseek_v3_attention(case, one_process):
    from transformers.models.deepseek_v3.modeling_deepseek_v3 import (DeepseekV3Attention,
                                                                      DeepseekV3RotaryEmbedding)

    from models.mla import MLA as Block
    from models.rope import RotaryTables
    from models.shape import ModelShape
    from training.engine.bridge import transformer_config

    overrides, interleave = CASES[case]
    cfg = compose(["model=tiny", "model.vocab_size=256", f"model.seq_length={S}", *overrides])
    shape = ModelShape.of(cfg.model)
    config = transformer_config(cfg, shape)
    config.hf_rope_interleave = interleave
    hf_cfg = hf_config(cfg, interleave)
    torch.manual_seed(0)
    ref = DeepseekV3Attention(hf_cfg, 0)
    for name, p in ref.named_parameters():  # norms too: a weight of 1 would hide a swapped norm
        torch.nn.init.normal_(p, 1.0 if "layernorm" in name else 0.0, 0.3 if "layernorm" in name else 0.1)
    hf_state = {k: v.detach().clone() for k, v in ref.state_dict().items()}
    ours = Block(config, 1)
    ours.load_state_dict(Block.from_hf(hf_state.__getitem__, config), strict=False)
    missing = {k for k in ours.state_dict() if not k.endswith("_extra_state")} - set(
        Block.from_hf(hf_state.__getitem__, config))
    assert not missing, missing
    tables = RotaryTables(shape)
    ours.rope_scale = tables.attention_factor("full")
    assert ours.core_attention.scale == pytest.approx(ref.scaling, rel=1e-12)

    x = torch.randn(B, S, H, requires_grad=True)
    cos, sin = DeepseekV3RotaryEmbedding(hf_cfg)(x, torch.arange(S)[None].expand(B, S))
    mask = torch.full((S, S), float("-inf")).triu(1)[None, None]
    expected, _ = ref(x, (cos, sin), mask)
    x_ours = x.detach().transpose(0, 1).contiguous().requires_grad_()  # [s, b, h]
    out, _ = ours(x_ours, tables(S))
    torch.testing.assert_close(out.transpose(0, 1), expected, atol=1e-5, rtol=1e-5)
    grad = torch.randn_like(expected)
    expected.backward(grad)
    out.backward(grad.transpose(0, 1))
    torch.testing.assert_close(x_ours.grad.transpose(0, 1), x.grad, atol=1e-5, rtol=1e-5)

    back = Block.to_hf(ours.state_dict().__getitem__, config)
    assert set(back) == set(hf_state)
    for name, tensor in back.items():
        assert torch.equal(tensor, hf_state[name]), name
