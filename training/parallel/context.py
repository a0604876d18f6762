"""Context parallelism on the batch side: this CP rank's share of a micro-batch, and the way back.

    batch = split_batch(batch)              # tokens, labels, loss_mask [b, s] -> [b, s/cp] + position_ids
    full = gather_sequence(logits, dim=1)   # [b, s/cp, ...] on every CP rank -> [b, s, ...] in token order

Megatron-Core's `get_batch_on_this_cp_rank` cuts each sequence into 2 x cp chunks and gives rank r chunks r
and 2cp-1-r (the zigzag: early and late tokens together, so causal attention costs every rank the same). The
CP ranks of one DP replica read the same samples (the data loader's DP rank excludes CP); the loss is then a
token sum over DP x CP (training/engine/losses.py) and DDP reduces gradients over DP x CP (Megatron-Core).
"""

from __future__ import annotations

import torch
import torch.distributed as dist


def split_batch(batch: dict) -> dict:
    """This CP rank's tokens of every [b, s] tensor of a micro-batch, with their global `position_ids`."""
    from megatron.core import parallel_state as ps  # here: validation imports this module before Megatron-Core
    from megatron.core.utils import get_batch_on_this_cp_rank

    if ps.get_context_parallel_world_size() == 1:
        return batch
    first = next(v for v in batch.values() if v is not None)
    b, s = first.shape
    batch = dict(batch, position_ids=torch.arange(s, device=first.device).expand(b, s).contiguous())  # [b, s]
    return get_batch_on_this_cp_rank(batch, is_hybrid_cp=False, cp_group=ps.get_context_parallel_group())


def gather_sequence(x: torch.Tensor, dim: int) -> torch.Tensor:
    """Every CP rank's zigzag share of `x` along `dim`, put back in token order (the inverse of split_batch)."""
    from megatron.core import parallel_state as ps

    cp = ps.get_context_parallel_world_size()
    if cp == 1:
        return x
    parts = [torch.empty_like(x) for _ in range(cp)]
    dist.all_gather(parts, x.contiguous(), group=ps.get_context_parallel_group())
    chunks: list[torch.Tensor | None] = [None] * (2 * cp)
    for rank, part in enumerate(parts):  # rank r holds chunks r and 2cp-1-r
        chunks[rank], chunks[2 * cp - 1 - rank] = part.chunk(2, dim=dim)
    return torch.cat(chunks, dim=dim)


def problems(cfg, layout) -> list[str]:
    """Beyond the sequence split (training/parallel/layout.py: seq_length % seq_divisor)."""
    if layout.cp_enabled and cfg.model.moe.num_experts:
        return [f"parallel.cp={layout.cp} with a mixture of experts is not supported here yet: use parallel.cp=1"]
    return []
