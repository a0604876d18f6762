"""The loss path: each micro-batch's loss for Megatron-Core's schedule, and the step's reported losses.

    loss_func        per micro-batch on the last stage: the masked token sum and count ("lm loss")
    global_loss      the global-batch token mean of the LM loss, identical on every rank
    extra_losses     every named extra loss and statistic of the blocks (models/extra_losses.py), reduced

The schedule divides the returned loss by nothing (calculate_per_token_loss); finalize_model_grads
divides every gradient by the global batch's loss-token count, so the gradient is that of the token mean.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from megatron.core import parallel_state

from models import extra_losses as extra


def loss_func(loss_mask: torch.Tensor, per_token_loss: torch.Tensor):
    """Sum of the masked token losses and their count; Megatron-Core divides by the global count."""
    mask = loss_mask.reshape(-1).float()  # [b*s]
    loss_sum = torch.sum(per_token_loss.reshape(-1).float() * mask)
    num_tokens = mask.sum().to(torch.int)
    return loss_sum, num_tokens, {"lm loss": torch.stack([loss_sum.detach().clone(), mask.sum()])}


def global_loss(reports: list[dict], device: torch.device) -> torch.Tensor:
    """Token-mean loss over the whole global batch, identical on every rank."""
    total = global_loss_sum(reports, device)
    return total[0] / total[1].clamp(min=1)


def global_loss_sum(reports: list[dict], device: torch.device, key: str = "lm loss", size: int = 2) -> torch.Tensor:
    """[loss sum, tokens] (float64) of the whole global batch, identical on every rank: summed over
    micro-batches, then over DP x CP ranks (CP ranks hold other tokens of the same sequences), then sent
    from the last pipeline stage to the others. key, size: another report of the loss function's, its length."""
    total = torch.zeros(size, dtype=torch.float64, device=device)
    for report in reports:
        total += report[key].to(device=device, dtype=torch.float64)
    dist.all_reduce(total, group=parallel_state.get_data_parallel_group(with_context_parallel=True))
    if parallel_state.get_pipeline_model_parallel_world_size() > 1:
        if not parallel_state.is_pipeline_last_stage(ignore_virtual=True):
            total.zero_()
        dist.all_reduce(total, group=parallel_state.get_pipeline_model_parallel_group())
    return total


def extra_losses(stats: dict[str, extra.Stat], device: torch.device) -> dict[str, float | None]:
    """{name: its Stat's report of the sum over this step and every rank} of what the blocks recorded since
    the last call (models/extra_losses.py; `stats`: models.spec.extra_stats); one all-reduce over every
    rank, none without stats. For an extra loss, the token-weighted mean over the global batch and the
    attaching layers.

    Summing over all ranks is exact at every layout: DP ranks and PP stages hold other tokens or layers;
    under SP the TP ranks hold other tokens; without SP they repeat the same numbers, which scales a sum
    and its count (or every count of a histogram) alike."""
    recorded = extra.take_recorded()
    if unknown := set(recorded) - set(stats):
        raise RuntimeError(f"{sorted(unknown)} are recorded but no block lists them in its `extra_losses` or "
                           f"`extra_stats` (models/spec.py)")
    if not stats:
        return {}
    offsets, total = {}, 0
    for name, stat in stats.items():
        offsets[name], total = total, total + stat.size
    flat = torch.zeros(total, dtype=torch.float64, device=device)
    for name, value in recorded.items():
        flat[offsets[name]:offsets[name] + stats[name].size] = value.to(device)
    dist.all_reduce(flat)
    return {name: stat.report(flat[offsets[name]:offsets[name] + stat.size]) for name, stat in stats.items()}
