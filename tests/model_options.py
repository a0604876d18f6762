"""Model options shared by the layout suites (tests/test_model_parallel_equivalence.py, test_moe.py,
test_whole_step.py)."""

# DeepSeek-V3's multi-latent attention (models/mla.py): q low-rank, replicated down projections, the shared k_pe
# entering the TP-split heads, YaRN with DeepSeek's mscale
MLA_OPTIONS = ["model.attention=mla", "model.mla.q_lora_rank=24", "model.rope_scaling.type=yarn",
               "model.rope_scaling.factor=4", "model.rope_scaling.original_max_position=8",
               "model.rope_scaling.mscale=0.8", "model.rope_scaling.mscale_all_dim=0.6"]
# DeepSeek-V3's router (Megatron-Core's TopKRouter fields): sigmoid scores, 2 groups with the top-2 from 1, the
# expert bias updated from the load summed over every rank (fast enough, 0.05, that the second step routes by it)
DEEPSEEK_ROUTER = ["model.moe.score_function=sigmoid", "model.moe.router_expert_bias=true",
                   "model.moe.router_bias_update_rate=0.05", "model.moe.router_num_groups=2",
                   "model.moe.router_group_topk=1", "model.moe.router_topk_scaling_factor=2.5",
                   "model.moe.shared_expert_ffn_hidden_size=16"]
