"""Reinforcement learning from verifiable rewards (issue 51, in progress): the GRPO family's pieces.

    rewards.py   built-in rewards (exact match, math-verify, a format regex) and the user's own by import path,
                 combined with weights; a reward that raises or returns a non-number stops with one line
    loss.py      group advantages (GRPO, Dr. GRPO, RLOO) and the token-level clipped surrogate with its
                 aggregations (grpo, dr_grpo, dapo), the k3 KL to a reference, as TRL's GRPOTrainer computes them

Not yet: the rollout loop (prompts, sampling with our generation, the step through training/engine/step.py's seam).
Pretraining never imports this package.
"""
