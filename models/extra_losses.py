"""Named extra losses (a router's load-balancing loss, a z-loss, an activation penalty): a block attaches
one to an activation in its forward; its gradient joins the LM loss's in backward, on whichever pipeline
stage the block runs, and its value is recorded for the logs. No engine edit per new loss.

    out = attach(out, penalty, name="act_penalty", coeff=1e-2)   # penalty: a scalar, mean over out's tokens

The objective. The LM loss is a sum over tokens that Megatron-Core's finalize_model_grads divides by the
global batch's loss-token count N (calculate_per_token_loss). An extra loss L, the mean over the n tokens
its block saw in this micro-batch (n = out.shape[0] * out.shape[1]), adds coeff * n * L to that sum, so a
step minimises  lm_loss + coeff * sum(n * L) / N  over micro-batches, DP ranks and attaching layers: a
token-weighted mean, the same at every layout as in one process. Under TP without SP every TP rank holds
the same (replicated) activations and computes the same L; under SP each rank has its own sequence shard
and the shards' sums add up. A loss computed from a TP-sharded tensor (a hidden of ffn/tp) must be reduced
over TP by its block first. Training runs bf16/fp32 without a loss scaler, so the backward scale is 1.

Recording happens in backward (once per micro-batch, also under full recomputation, which runs the forward
twice; evaluation, forward only, records nothing): [sum n*L, sum n] per name, on the device. training/
losses.py sums them over all ranks once per step and logs sum(n*L) / sum(n), under the loss's name.
A block lists the names it attaches in its class attribute `extra_losses` (models/spec.py), so every rank
knows every name, also ranks whose stages attach none.
"""

from __future__ import annotations

import torch

_RECORDED: dict[str, torch.Tensor] = {}  # name -> float64 [sum n*L, sum n] since the last take_recorded()


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
        value = torch.stack([loss.double() * ctx.tokens, torch.tensor(float(ctx.tokens), dtype=torch.float64,
                                                                      device=loss.device)])
        _RECORDED[ctx.name] = _RECORDED[ctx.name] + value if ctx.name in _RECORDED else value
        return grad, torch.full_like(loss, ctx.coeff * ctx.tokens), None, None, None


def attach(x: torch.Tensor, loss: torch.Tensor, name: str, coeff: float) -> torch.Tensor:
    """x ([s, b, ...], returned unchanged) carries `loss` (a scalar, the mean over x's s*b tokens) into
    backward with weight `coeff`; use the returned tensor in place of x."""
    return _Attach.apply(x, loss, name, coeff, x.shape[0] * x.shape[1])


def take_recorded() -> dict[str, torch.Tensor]:
    """The [sum n*L, sum n] per name recorded since the last call, and a fresh start."""
    recorded = dict(_RECORDED)
    _RECORDED.clear()
    return recorded
