"""Context-parallel causal attention without Transformer Engine: K and V all-gathered over the CP group.

Under parallel.cp = cp every sequence is cut into 2 x cp equal chunks and CP rank r holds chunks r and
2cp-1-r (Megatron-Core's zigzag split, done on the batch by training/parallel/context.py), so each rank has
the same causal work. Queries stay local. Keys and values are all-gathered over the CP group
(`gather_from_sequence_parallel_region`: all-gather forward, reduce-scatter of their gradients backward), and
SDPA runs with the causal mask on global positions: query i sees key j iff position(i) >= position(j) (and, on
a sliding-window layer, position(i) - position(j) < window: the band on global positions too). This
is the all-gather CP Llama 3 trained its long contexts with; the gathered K/V cost 2 x s x b x ng/tp x hn
values per layer, which the memory estimate counts. The RoPE angles come from the full-length table, sliced
the same zigzag way (Megatron-Core's RotaryEmbedding does it).

SelfAttention (models/attention.py) picks this core when config.context_parallel_size > 1.
"""

import functools

import torch
from megatron.core import parallel_state
from megatron.core.tensor_parallel import gather_from_sequence_parallel_region
from megatron.core.transformer.transformer_config import TransformerConfig

from models.core_attention import CoreAttention, allowed


def zigzag_positions(rank: int, cp: int, local_length: int, device=None) -> torch.Tensor:
    """Global positions of CP rank `rank`'s tokens: chunks rank and 2cp-1-rank, each local_length/2 long."""
    chunk = local_length // 2
    first, second = rank * chunk, (2 * cp - 1 - rank) * chunk
    return torch.cat([torch.arange(first, first + chunk, device=device),
                      torch.arange(second, second + chunk, device=device)])  # [s/cp]


@functools.lru_cache(maxsize=8)
def causal_mask(rank: int, cp: int, local_length: int, device: torch.device, dtype: torch.dtype,
                window: int | None = None) -> torch.Tensor:
    """[s/cp, s] additive mask: 0 where CP rank `rank`'s query may attend to a gathered key (keys in CP-rank
    order), -inf elsewhere; one per rank, length and dtype, shared by every layer. Additive, not boolean:
    scaled_dot_product_attention turns a boolean mask into a new additive one on every call, and its kernels
    keep that for backward: an [s/cp, s] copy per layer and micro-batch (tests/test_activation_bytes.py).
    window: a sliding layer's (one mask per kind of layer)."""
    queries = zigzag_positions(rank, cp, local_length, device)  # [s/cp]
    keys = torch.cat([zigzag_positions(r, cp, local_length, device) for r in range(cp)])  # [s]
    ok = allowed(queries, keys, window)  # [s/cp, s]
    return torch.zeros(ok.shape, dtype=dtype, device=device).masked_fill_(~ok, float("-inf"))


class AllGatherKVAttention(CoreAttention):
    def __init__(self, config: TransformerConfig, layer_number: int = 1):
        super().__init__(config, layer_number)
        self.cp = config.context_parallel_size

    def forward(self, q, k, v, mask=None):  # q [s/cp, b, np/tp, hn]; k, v [s/cp, b, ng/tp, hn]
        if mask is not None:
            raise ValueError("context-parallel attention takes no explicit mask (generation runs at parallel.cp=1)")
        group = parallel_state.get_context_parallel_group()
        k = gather_from_sequence_parallel_region(k, group=group)  # [s, b, ng/tp, hn], CP ranks in order
        v = gather_from_sequence_parallel_region(v, group=group)  # [s, b, ng/tp, hn]
        mask = causal_mask(parallel_state.get_context_parallel_rank(), self.cp, q.shape[0], q.device, q.dtype,
                           self.window)
        return self.attend(q, k, v, mask)  # [s/cp, b, np/tp * hn]
