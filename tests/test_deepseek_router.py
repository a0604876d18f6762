"""DeepSeek-V3's MoE through Megatron-Core's own TopKRouter config (training/engine/bridge.py moe_settings) against
transformers' DeepseekV3MoE, one process: sigmoid scores, the expert-bias correction choosing the experts (not
weighting them), group-limited top-k (4 groups of 2 experts, 2 groups a token), the top-k renormalised and
scaled by routed_scaling_factor, a shared expert added. Output and input gradient within 1e-5."""

from __future__ import annotations

import torch

from training.config.compose import compose

S, B, H, E, FFN = 16, 2, 64, 8, 16
MOE = [f"model.hidden_size={H}", "model.num_attention_heads=4", f"model.moe.num_experts={E}", "model.moe.top_k=4",
       f"model.moe.ffn_hidden_size={FFN}", f"model.moe.shared_expert_ffn_hidden_size={FFN}",
       "model.moe.score_function=sigmoid", "model.moe.router_expert_bias=true", "model.moe.router_num_groups=4",
       "model.moe.router_group_topk=2", "model.moe.router_topk_scaling_factor=2.5", "model.moe.aux_loss_coeff=0",
       "model.moe.first_dense=0", "model.moe.dispatcher=allgather"]


def test_deepseek_v3_router_and_shared_expert_equal_transformers(one_process):
    from transformers import DeepseekV3Config
    from transformers.models.deepseek_v3.modeling_deepseek_v3 import DeepseekV3MoE

    from models.extra_losses import take_recorded
    from models.shape import ModelShape
    from models.spec import layer_spec
    from training.engine.bridge import transformer_config

    cfg = compose(["model=tiny", "model.vocab_size=256", f"model.seq_length={S}", *MOE])
    shape = ModelShape.of(cfg.model)
    config = transformer_config(cfg, shape)
    ours = layer_spec(shape, 1).mlp(config, 1)
    hf = DeepseekV3MoE(DeepseekV3Config(
        hidden_size=H, moe_intermediate_size=FFN, n_routed_experts=E, num_experts_per_tok=4, n_group=4, topk_group=2,
        routed_scaling_factor=2.5, n_shared_experts=1, norm_topk_prob=True, hidden_act="silu"))
    torch.manual_seed(0)
    with torch.no_grad():
        for p in hf.parameters():
            p.normal_(0.0, 0.2)
        hf.gate.e_score_correction_bias.normal_(0.0, 0.3)  # large enough to change which experts win
        state = {"router.weight": hf.gate.weight, "router.expert_bias": hf.gate.e_score_correction_bias,
                 "shared_experts.linear_fc1.weight": torch.cat([hf.shared_experts.gate_proj.weight,
                                                                hf.shared_experts.up_proj.weight]),
                 "shared_experts.linear_fc2.weight": hf.shared_experts.down_proj.weight}
        for j in range(E):
            state[f"experts.local_experts.{j}.linear_fc1.weight"] = hf.experts.gate_up_proj[j]  # [gate; up]
            state[f"experts.local_experts.{j}.linear_fc2.weight"] = hf.experts.down_proj[j]
        missing = [k for k in ours.state_dict() if not k.endswith("_extra_state") and k not in state]
        assert not missing, missing
        ours.load_state_dict({k: v.clone() for k, v in state.items()}, strict=False)

    x = torch.randn(B, S, H, requires_grad=True)
    expected = hf(x)
    x_ours = x.detach().transpose(0, 1).contiguous().requires_grad_()  # [s, b, h]
    out, bias = ours(x_ours)
    take_recorded()
    assert bias is None
    torch.testing.assert_close(out.transpose(0, 1), expected, atol=1e-5, rtol=1e-5)
    grad = torch.randn_like(expected)
    expected.backward(grad)
    out.backward(grad.transpose(0, 1))
    torch.testing.assert_close(x_ours.grad.transpose(0, 1), x.grad, atol=1e-5, rtol=1e-5)
    # the load the bias update reads (finalize_model_grads): k experts a token, counted while training
    assert ours.router.local_tokens_per_expert.sum().item() == 4 * S * B
