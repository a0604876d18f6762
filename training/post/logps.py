"""Each answer's summed log-probability from the last stage's token losses.

    sums, counts = answer_sums(token_losses, answer_ids, slots)   # [b, P, 2] each: (chosen, rejected) per slot

The model's last stage returns every position's cross entropy, -log p(label) (vocab-parallel under TP: whole and
the same on every TP rank, SP included), so an answer's log-probability is minus the sum of its targets' losses;
`answer_ids` (training/post/pairs.py) names each target's answer (2k chosen, 2k + 1 rejected of slot k; -1 for
prompts, padding and segment ends). Packed pairs are refused with CP (training/config/validate.py), so a sequence
is whole on its rank and the sums need no reduction.
"""

from __future__ import annotations

import torch


def answer_sums(token_losses: torch.Tensor, answer_ids: torch.Tensor, slots: int) -> tuple[torch.Tensor, torch.Tensor]:
    b = token_losses.shape[0]
    ids = answer_ids.to(token_losses.device)  # [b, s]
    targets = ids >= 0
    rows = torch.arange(b, device=ids.device).unsqueeze(1).expand_as(ids)  # [b, s]
    flat = (rows * 2 * slots + ids)[targets]  # [targets] index into b * P * 2
    logp = -token_losses.float()[targets]  # [targets]
    sums = torch.zeros(b * 2 * slots, dtype=torch.float32, device=logp.device).index_add(0, flat, logp)
    counts = torch.zeros(b * 2 * slots, dtype=torch.float32, device=logp.device).index_add(
        0, flat, torch.ones_like(logp))
    return sums.view(b, slots, 2), counts.view(b, slots, 2)  # [b, P, 2]
