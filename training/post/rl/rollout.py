"""Rollouts with the policy itself (the embedded engine): each completion drawn from its own seeded generator, so
the same run seed gives the same completions whichever DP rank, batch or TP x PP layout draws it; and the
rollout rows the policy-gradient step reads (training/post/rl/step.py).

    seeds = sample_seeds(run_seed, step, indices)           # one per completion, from its global index
    completions = generate(state, prompts, max_new, sampling, stops, device, seeds=seeds)
    rows = rollout_rows(prompts, completions, advantages, seq_length, pad)
"""

from __future__ import annotations

import numpy as np
import torch

from training.errors import ConfigError


def sample_seeds(seed: int, step: int, indices) -> list[int]:
    """A 63-bit seed per completion from (run seed, rollout step, the completion's index in the global batch)."""
    return [int(np.random.SeedSequence([seed, step, int(i)]).generate_state(2, np.uint64)[0] >> np.uint64(1))
            for i in indices]


def rollout_rows(prompts: list[list[int]], completions: list[list[int]], advantages, seq_length: int,
                 pad: int) -> list[dict]:
    """One row per (prompt, completion): tokens / labels [seq_length] of prompt + completion (right-padded with
    `pad`), loss_mask 1 where the label is a completion token, old_logps / ref_logps zeros to be filled, the
    completion's advantage."""
    rows = []
    for prompt, completion, advantage in zip(prompts, completions, advantages, strict=True):
        ids = list(prompt) + list(completion)
        if len(ids) > seq_length + 1:
            raise ConfigError(f"a prompt of {len(prompt)} tokens + a completion of {len(completion)} exceed "
                              f"model.seq_length={seq_length} + 1: lower the rollouts' max_new_tokens or the prompts")
        seq = torch.full((seq_length + 1,), pad, dtype=torch.long)
        seq[:len(ids)] = torch.tensor(ids, dtype=torch.long)
        mask = torch.zeros(seq_length)
        mask[len(prompt) - 1:len(ids) - 1] = 1.0  # label j is token j + 1: the completion's tokens
        rows.append({"tokens": seq[:-1], "labels": seq[1:], "loss_mask": mask, "old_logps": torch.zeros(seq_length),
                     "ref_logps": torch.zeros(seq_length), "advantages": torch.tensor(float(advantage))})
    return rows
