"""Causal self-attention: fused QKV ColumnParallelLinear -> RoPE -> SDPA -> RowParallelLinear.

Heads are split across TP ranks. With grouped-query attention (`num_query_groups` = ng < np heads) the
fused QKV weight is laid out per query group, as in Megatron-Core:
    [ng, (np/ng) * hn (q) + hn (k) + hn (v), h]
so a contiguous TP shard of its rows holds whole groups: ng/tp groups, np/tp query heads.
"""

import torch
import torch.nn.functional as F
from megatron.core import tensor_parallel
from megatron.core.models.common.embeddings.rope_utils import apply_rotary_pos_emb
from megatron.core.transformer.module import MegatronModule
from megatron.core.transformer.transformer_config import TransformerConfig
from megatron.core.utils import divide


class CoreAttention(torch.nn.Module):
    """softmax(q k^T / sqrt(hn)) v with a causal mask, via torch's scaled_dot_product_attention.

    Attention dropout acts on sharded heads, so it is drawn from the TP-distinct RNG stream.
    """

    def __init__(self, config: TransformerConfig):
        super().__init__()
        self.dropout_p = config.attention_dropout

    def forward(self, q, k, v):  # q [s, b, np/tp, hn]; k, v [s, b, ng/tp, hn]
        q, k, v = (t.permute(1, 2, 0, 3) for t in (q, k, v))  # [b, heads/tp, s, hn]
        dropout_p = self.dropout_p if self.training else 0.0
        with tensor_parallel.get_cuda_rng_tracker().fork():
            out = F.scaled_dot_product_attention(q, k, v, dropout_p=dropout_p, is_causal=True,
                                                 enable_gqa=k.shape[1] != q.shape[1])
        b, n, s, hn = out.shape
        return out.permute(2, 0, 1, 3).reshape(s, b, n * hn)  # [s, b, np/tp * hn]


class SelfAttention(MegatronModule):
    def __init__(self, config: TransformerConfig):
        super().__init__(config=config)
        tp = config.tensor_model_parallel_size
        self.head_dim = config.kv_channels
        self.heads_per_group = divide(config.num_attention_heads, config.num_query_groups)
        self.local_groups = divide(config.num_query_groups, tp)
        qkv_size = (config.num_attention_heads + 2 * config.num_query_groups) * self.head_dim
        self.linear_qkv = tensor_parallel.ColumnParallelLinear(
            config.hidden_size, qkv_size, config=config, init_method=config.init_method,
            bias=config.add_bias_linear or config.add_qkv_bias, gather_output=False,
        )
        self.core_attention = CoreAttention(config)
        self.selective_recompute = config.recompute_granularity == "selective"
        self.linear_proj = tensor_parallel.RowParallelLinear(
            config.num_attention_heads * self.head_dim, config.hidden_size, config=config,
            init_method=config.output_layer_init_method, bias=config.add_bias_linear,
            input_is_parallel=True, skip_bias_add=True,
        )

    def forward(self, x: torch.Tensor, rotary_freqs: torch.Tensor | None):  # x [s(/tp), b, h]
        qkv, _ = self.linear_qkv(x)  # [s, b, ng/tp * (np/ng + 2) * hn] (SP: gathered along s)
        s, b, _ = qkv.shape
        qkv = qkv.view(s, b, self.local_groups, (self.heads_per_group + 2) * self.head_dim)
        q, k, v = torch.split(qkv, [self.heads_per_group * self.head_dim, self.head_dim, self.head_dim],
                              dim=-1)  # [s, b, ng/tp, (np/ng)*hn], [s, b, ng/tp, hn] x 2
        q = q.reshape(s, b, -1, self.head_dim)  # [s, b, np/tp, hn]
        if rotary_freqs is not None:  # [s, 1, 1, hn]
            q = apply_rotary_pos_emb(q, rotary_freqs, self.config)
            k = apply_rotary_pos_emb(k, rotary_freqs, self.config)
        if self.selective_recompute and self.training:  # keep only q, k, v; redo attention in backward
            out = tensor_parallel.checkpoint(self.core_attention, False, q, k, v)
        else:
            out = self.core_attention(q, k, v)  # [s, b, np/tp * hn]
        return self.linear_proj(out)  # ([s(/tp), b, h], bias or None)
