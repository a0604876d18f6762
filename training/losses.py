"""The loss path: each micro-batch's loss for Megatron-Core's schedule, and the step's reported losses.

    loss_func        per micro-batch on the last stage: the masked token sum and count ("lm loss")
    global_loss      the global-batch token mean of the LM loss, identical on every rank
    extra_losses     every named extra loss (models/extra_losses.py) as its token-weighted global mean

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
    """Token-mean loss over the whole global batch, identical on every rank: [loss_sum, tokens] summed
    over micro-batches, then over DP ranks, then sent from the last pipeline stage to the others."""
    total = torch.zeros(2, dtype=torch.float64, device=device)
    for report in reports:
        total += report["lm loss"].to(device=device, dtype=torch.float64)
    dist.all_reduce(total, group=parallel_state.get_data_parallel_group())
    if parallel_state.get_pipeline_model_parallel_world_size() > 1:
        if not parallel_state.is_pipeline_last_stage(ignore_virtual=True):
            total.zero_()
        dist.all_reduce(total, group=parallel_state.get_pipeline_model_parallel_group())
    return total[0] / total[1].clamp(min=1)


def extra_losses(names: tuple[str, ...], device: torch.device) -> dict[str, float]:
    """{name: token-weighted mean over the global batch and the attaching layers} of what the blocks recorded
    since the last call (models/extra_losses.py); one all-reduce over every rank, none without names.

    Summing [sum n*L, sum n] over all ranks is exact at every layout: DP ranks and PP stages hold other
    tokens or layers; under SP the TP ranks hold other tokens; without SP they repeat the same numbers,
    which scales the sum and the count alike."""
    recorded = extra.take_recorded()
    if unknown := set(recorded) - set(names):
        raise RuntimeError(f"extra losses {sorted(unknown)} are attached but no block lists them in its "
                           f"`extra_losses` (models/spec.py)")
    if not names:
        return {}
    totals = torch.zeros(len(names), 2, dtype=torch.float64, device=device)
    for i, name in enumerate(names):
        if name in recorded:
            totals[i] = recorded[name].to(device)
    dist.all_reduce(totals)
    return {name: (totals[i, 0] / totals[i, 1]).item() if totals[i, 1] > 0 else None
            for i, name in enumerate(names)}
