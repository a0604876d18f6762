"""Reinforcement learning from verifiable rewards (issue 51, in progress): the GRPO family's pieces.

    rewards.py   built-in rewards (exact match, math-verify, a format regex) and the user's own by import path,
                 combined with weights; a reward that raises or returns a non-number stops with one line
    loss.py      group advantages (GRPO, Dr. GRPO, RLOO) and the token-level clipped surrogate with its
                 aggregations (grpo, dr_grpo, dapo), the k3 KL to a reference, as TRL's GRPOTrainer computes them
    step.py      the policy-gradient step on rollout rows through training/engine/step.py's seam; old log-probs
    rollout.py   completions from our generation, each from its own seeded generator (layout-invariant), and
                 the rollout rows (the loss on the completion's tokens)

Not yet: the loop that ties them (prompts, config group, logging, checkpoints), vLLM rollouts, the layouts' proof.
Pretraining never imports this package.
"""
