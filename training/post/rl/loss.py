"""The GRPO family's advantages and loss, per token, as TRL's GRPOTrainer computes them (the pinned 1.16).

    adv = advantages(rewards, group=G, kind="grpo")                  # [n] one per completion, groups of G in order
    loss, count, metrics = policy_loss(logps, old, adv, mask, cfg)   # summed for Megatron-Core's per-token count

Advantages (a prompt's G completions are one group): grpo (r - mean) / (std + 1e-4), the unbiased std (TRL's
scale_rewards="group"); dr_grpo r - mean (Dr. GRPO: no std, scale_rewards="none"); rloo r - the mean of the
group's other G - 1 rewards.
The per-token loss: ratio = exp(logp - old); -min(ratio A, clip(ratio, 1 - eps_low, 1 + eps_high) A), plus
beta x the k3 KL exp(ref - logp) - (ref - logp) - 1 when a reference is given (times the ratio by default: TRL's
use_bias_correction_kl). Aggregations, as sums with the count
Megatron-Core divides the gradient by (calculate_per_token_loss):
  grpo     each completion's token mean, then the mean over completions    -> sum of token means, count completions
  dr_grpo  every token / (completions x max_completion_length)              -> sum / L_max, count completions
  dapo     every token / all completion tokens of the batch (token-level)   -> sum, count tokens
Masked (padding) positions contribute nothing and are not counted.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

AGGREGATIONS = ("grpo", "dr_grpo", "dapo")
ADVANTAGES = ("grpo", "dr_grpo", "rloo")


def advantages(rewards: torch.Tensor, group: int, kind: str = "grpo") -> torch.Tensor:
    """[n] rewards of n = prompts x group completions (each prompt's group contiguous) -> [n] advantages."""
    r = rewards.view(-1, group).double()  # [prompts, G]
    mean = r.mean(dim=1, keepdim=True)
    if kind == "grpo":
        out = (r - mean) / (r.std(dim=1, keepdim=True) + 1e-4)
    elif kind == "dr_grpo":
        out = r - mean
    elif kind == "rloo":
        out = (r - mean) * group / (group - 1)  # r - (sum - r) / (G - 1)
    else:
        raise ValueError(f"advantages {kind!r}: one of {ADVANTAGES}")
    return out.view(-1).to(rewards.dtype)


@dataclass(frozen=True)
class LossConfig:
    aggregation: str = "grpo"  # grpo | dr_grpo | dapo (see the module docstring)
    epsilon_low: float = 0.2  # the clip below 1 (PPO's and TRL's 0.2)
    epsilon_high: float = 0.2  # the clip above 1 (DAPO: 0.28, clip-higher)
    beta: float = 0.0  # the k3 KL's weight (0: no reference needed; TRL's default 0.0)
    max_completion_length: int = 256  # dr_grpo's constant normaliser
    kl_ratio: bool = True  # the KL times the policy/old ratio: the unbiased reverse-KL gradient (DeepSeek-V3.2; TRL's default)


def policy_loss(logps: torch.Tensor, old: torch.Tensor, adv: torch.Tensor, mask: torch.Tensor, cfg: LossConfig,
                ref: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor, dict]:
    """logps, old, ref, mask [b, t] (the completion tokens' log-probs under the policy, the policy that sampled,
    the reference); adv [b] -> (loss sum, count, metrics sums) of this micro-batch."""
    mask = mask.to(logps.dtype)
    ratio = torch.exp(logps - old)  # [b, t]
    a = adv.view(-1, 1).to(logps.dtype)  # [b, 1]
    clipped = torch.clamp(ratio, 1 - cfg.epsilon_low, 1 + cfg.epsilon_high)
    per_token = -torch.min(ratio * a, clipped * a)  # [b, t]
    kl = None
    if cfg.beta:
        if ref is None:
            raise ValueError("a KL term (beta > 0) needs the reference's log-probs")
        kl = torch.exp(ref - logps) - (ref - logps) - 1  # [b, t] k3 (Schulman's unbiased, >= 0)
        kl = kl * ratio if cfg.kl_ratio else kl  # sampled from the old policy: importance-weighted
        per_token = per_token + cfg.beta * kl
    tokens = mask.sum(dim=1)  # [b]
    if cfg.aggregation == "grpo":
        loss, count = ((per_token * mask).sum(dim=1) / tokens.clamp(min=1)).sum(), torch.tensor(len(mask))
    elif cfg.aggregation == "dr_grpo":
        loss, count = (per_token * mask).sum() / cfg.max_completion_length, torch.tensor(len(mask))
    elif cfg.aggregation == "dapo":
        loss, count = (per_token * mask).sum(), tokens.sum().round().long()
    else:
        raise ValueError(f"aggregation {cfg.aggregation!r}: one of {AGGREGATIONS}")
    with torch.no_grad():
        low = ((ratio < 1 - cfg.epsilon_low) & (a < 0)).to(mask.dtype)  # clipped: the gradient is zero there
        high = ((ratio > 1 + cfg.epsilon_high) & (a > 0)).to(mask.dtype)
        metrics = {"clip_low": (low * mask).sum(), "clip_high": (high * mask).sum(), "tokens": mask.sum(),
                   "kl": (kl * mask).sum() if kl is not None else mask.sum() * 0}
    return loss, count, metrics
