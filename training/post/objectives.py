"""The preference objectives, per pair, and TRL's metrics (trl 1.16 DPOTrainer._compute_loss; SimPO: its CPOTrainer).

    losses, rewards = pair_losses(post, logps, ref, lengths)   # [n], [n, 2]; logps, ref, lengths: [n, 2]

Columns are (chosen, rejected). `logps` are the answers' summed token log-probabilities under the policy, `ref`
under the reference, `lengths` their answer tokens. With log-ratios r = logps - ref, d = r_chosen - r_rejected:

    sigmoid   -log sigmoid(beta d)                                                  DPO
    hinge     relu(1 - beta d)                                                      SLiC
    ipo       (r_chosen / n_chosen - r_rejected / n_rejected - 1 / (2 beta))^2      IPO, TRL's length normalisation
    robust    ((1 - e)(-log sigmoid(beta d)) + e log sigmoid(-beta d)) / (1 - 2e)   robust DPO, e = label_smoothing
    simpo     m = a_chosen - a_rejected - gamma / beta, a = logps / lengths (no reference):
              -(1 - e) log sigmoid(beta m) - e log sigmoid(-beta m)                 SimPO

Rewards (TRL's): beta * r per answer (simpo: beta * a). The step's loss is the mean over the global batch's pairs,
plus post.sft_weight times the token mean of the chosen answers' NLL over the global batch (TRL's "sft" term).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from training.config.schema_post import PostConfig

METRICS = ("rewards/chosen", "rewards/rejected", "rewards/accuracies", "rewards/margins", "logps/chosen",
           "logps/rejected")  # TRL's names, each a mean over the global batch's pairs


def pair_losses(post: PostConfig, logps: torch.Tensor, ref: torch.Tensor, lengths: torch.Tensor):
    """(loss per pair [n], rewards [n, 2]) of the objective; every input [n, 2] (chosen, rejected)."""
    beta, eps, objective = post.beta, post.label_smoothing, str(post.objective)
    if objective == "simpo":
        mean = logps / lengths.clamp(min=1)  # [n, 2] the length-normalised log-probs
        margin = mean[:, 0] - mean[:, 1] - post.simpo_gamma / beta
        loss = -(1 - eps) * F.logsigmoid(beta * margin) - eps * F.logsigmoid(-beta * margin)
        return loss, beta * mean.detach()
    ratios = logps - ref  # [n, 2]
    d = ratios[:, 0] - ratios[:, 1]
    if objective == "sigmoid":
        loss = -F.logsigmoid(beta * d)
    elif objective == "hinge":
        loss = torch.relu(1 - beta * d)
    elif objective == "ipo":
        per_token = ratios / lengths.clamp(min=1)
        loss = (per_token[:, 0] - per_token[:, 1] - 1 / (2 * beta)) ** 2
    elif objective == "robust":
        loss = (-(1 - eps) * F.logsigmoid(beta * d) + eps * F.logsigmoid(-beta * d)) / (1 - 2 * eps)
    else:
        raise ValueError(f"post.objective={objective}: not a preference objective")
    return loss, beta * ratios.detach()


def metric_sums(rewards: torch.Tensor, logps: torch.Tensor) -> torch.Tensor:
    """[6] sums over the pairs of TRL's metrics (METRICS' order): divide by the pairs for the means."""
    chosen, rejected = rewards[:, 0], rewards[:, 1]
    logps = logps.detach()
    return torch.stack([chosen.sum(), rejected.sum(), (chosen > rejected).float().sum(), (chosen - rejected).sum(),
                        logps[:, 0].sum(), logps[:, 1].sum()]).double()
