"""The attention core: softmax(q k^T / sqrt(hn)) v on this rank's heads (models/attention.py builds on it;
models/context_parallel.py extends it with K/V gathered over the context-parallel group)."""

import contextlib

import torch
import torch.nn.functional as F
from megatron.core import tensor_parallel
from megatron.core.transformer.transformer_config import TransformerConfig

from models.tp_blocks import replicated


def packed_mask(segment_ids: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """[b, s] segment ids of packed sequences (data.format=sft: 1, 2, ... one per conversation, 0 padding) ->
    [b, 1, s, s] additive mask: 0 where query i may attend to key j (same segment, j <= i), else -inf. Each
    conversation sees only itself; a padding token sees the padding before it (never an empty row: no NaN).
    Additive and built once per micro-batch: SDPA would turn a boolean mask into an additive one in every layer."""
    s = segment_ids.shape[1]
    causal = torch.ones(s, s, dtype=torch.bool, device=segment_ids.device).tril_()  # [s, s]
    allowed = (segment_ids[:, :, None] == segment_ids[:, None, :]) & causal  # [b, s, s]
    return torch.zeros(allowed.shape, dtype=dtype, device=segment_ids.device).masked_fill_(
        ~allowed, float("-inf"))[:, None]  # [b, 1, s, s]


class CoreAttention(torch.nn.Module):
    """softmax(q k^T / sqrt(hn)) v with a causal mask, via torch's scaled_dot_product_attention.

    Attention dropout acts on sharded heads, so it is drawn from the TP-distinct RNG stream; in a replicated
    attention (left out of parallel.tp_blocks: every TP rank holds every head) from the default stream, the same
    on every TP rank, so the replicas stay identical.
    """

    def __init__(self, config: TransformerConfig):
        super().__init__()
        self.dropout_p = config.attention_dropout
        self.tp_stream = not replicated(config)

    def forward(self, q, k, v, mask=None):  # q [s, b, np/tp, hn]; k, v [s_k, b, ng/tp, hn]; mask [b, 1, s, s_k]
        # mask: generation's cache, or packed sequences (packed_mask); None: causal
        q, k, v = (t.permute(1, 2, 0, 3) for t in (q, k, v))  # [b, heads/tp, s(_k), hn]
        dropout_p = self.dropout_p if self.training else 0.0
        # without dropout no random numbers are drawn: the fork (~40 us of RNG state copies) would cost ~15% of
        # a small attention call on CPU for nothing
        fork = dropout_p > 0 and self.tp_stream
        with tensor_parallel.get_cuda_rng_tracker().fork() if fork else contextlib.nullcontext():
            out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, dropout_p=dropout_p, is_causal=mask is None,
                                                 enable_gqa=k.shape[1] != q.shape[1])
        b, n, s, hn = out.shape
        return out.permute(2, 0, 1, 3).reshape(s, b, n * hn)  # [s, b, np/tp * hn]
