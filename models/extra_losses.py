"""Named extra losses (a router's load-balancing loss, a z-loss, an activation penalty) and other per-step
statistics of the blocks (a MoE layer's tokens per expert): recorded during a step, reduced over every
rank once per step by training/engine/losses.py and logged next to the LM loss. No engine edit per new one.

    out = attach(out, penalty, name="act_penalty", coeff=1e-2)   # penalty: a scalar, mean over out's tokens

The objective. The LM loss is a sum over tokens that Megatron-Core's finalize_model_grads divides by the
global batch's loss-token count N (calculate_per_token_loss). An extra loss L, the mean over the n tokens
its block saw in this micro-batch (n = out.shape[0] * out.shape[1]), adds coeff * n * L to that sum, so a
step minimises  lm_loss + coeff * sum(n * L) / N  over micro-batches, DP ranks and attaching layers: a
token-weighted mean, the same at every layout as in one process. Under TP without SP every TP rank holds
the same (replicated) activations and computes the same L; under SP each rank has its own sequence shard
and the shards' sums add up. A loss computed from a TP-sharded tensor (a hidden of ffn/tp) must be reduced
over TP by its block first. Training runs bf16/fp32 without a loss scaler, so the backward scale is 1.
(Megatron-Core's MoE router attaches its own losses with its own scale; models/moe.py only records them.)

What is recorded: a float64 tensor per name, added to by `record` during the step (over micro-batches and
layers) and summed over all ranks; a `Stat` says its size and how the sum becomes the logged number. An
extra loss is Stat(2, token_mean) over [sum n*L, sum n]: `attach` records it in backward, once per
micro-batch (also under full recomputation, which runs the forward twice; evaluation records nothing).
Whoever records in forward must do so only when `torch.is_grad_enabled()` (the first pass of a recomputed
layer runs without it), as Megatron-Core's router does. A block lists the names it records: the class
attribute `extra_losses` (token means) and, for other statistics, `extra_stats(shape) -> {name: Stat}`
(models/spec.py), so every rank knows every name, also ranks whose stages record none.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import torch

_RECORDED: dict[str, torch.Tensor] = {}  # name -> float64 sum since the last take_recorded()


def token_mean(total: torch.Tensor) -> float | None:
    """[sum n*L, sum n] -> the token-weighted mean (None when nothing was recorded)."""
    return (total[0] / total[1]).item() if total[1] > 0 else None


@dataclass(frozen=True)
class Stat:
    """A logged per-step statistic: `size` float64 entries, summed over the step and all ranks, then `report`."""

    size: int
    report: Callable[[torch.Tensor], float | None] = token_mean


def record(name: str, value: torch.Tensor) -> None:
    """Add `value` (its Stat's size, any dtype, on the model's device) to this step's sum for `name`."""
    value = value.detach().to(torch.float64).reshape(-1)
    _RECORDED[name] = _RECORDED[name] + value if name in _RECORDED else value


def record_mean(name: str, loss: torch.Tensor, tokens: int) -> None:
    """An extra loss's entry: `loss` (a scalar mean over `tokens` tokens) weighted by its token count."""
    loss = loss.detach().to(torch.float64)
    record(name, torch.stack([loss * tokens, torch.full_like(loss, float(tokens))]))


class _Attach(torch.autograd.Function):
    """forward: x unchanged; backward: x's gradient passes through and `loss` gets coeff * n."""

    @staticmethod
    def forward(ctx, x, loss, name: str, coeff: float, tokens: int):
        ctx.name, ctx.coeff, ctx.tokens = name, coeff, tokens
        ctx.save_for_backward(loss.detach())
        return x

    @staticmethod
    def backward(ctx, grad):
        (loss,) = ctx.saved_tensors
        record_mean(ctx.name, loss, ctx.tokens)
        return grad, torch.full_like(loss, ctx.coeff * ctx.tokens), None, None, None


def attach(x: torch.Tensor, loss: torch.Tensor, name: str, coeff: float) -> torch.Tensor:
    """x ([s, b, ...], returned unchanged) carries `loss` (a scalar, the mean over x's s*b tokens) into
    backward with weight `coeff`; use the returned tensor in place of x."""
    return _Attach.apply(x, loss, name, coeff, x.shape[0] * x.shape[1])


def take_recorded() -> dict[str, torch.Tensor]:
    """What was recorded since the last call, per name, and a fresh start."""
    recorded = dict(_RECORDED)
    _RECORDED.clear()
    return recorded
