"""post.rl.*: RL from verifiable rewards (post.objective=grpo; training/post/rl/). A rollout batch is
train.global_batch_size completions: global_batch_size / group_size prompts, group_size completions each, drawn by
the policy at the training layout, scored by the rewards, then trained on for `updates` iterations."""

from __future__ import annotations

from dataclasses import dataclass, field
from enum import StrEnum
from typing import List, Optional


class Advantage(StrEnum):
    grpo = "grpo"  # (r - group mean) / (group std + 1e-4) (GRPO; TRL's scale_rewards="group")
    dr_grpo = "dr_grpo"  # r - group mean (Dr. GRPO: no std)
    rloo = "rloo"  # r - the mean of the group's other rewards (RLOO)


class Aggregation(StrEnum):
    grpo = "grpo"  # each completion's token mean, then the mean over completions (GRPO)
    dr_grpo = "dr_grpo"  # all tokens / (completions x max_new_tokens) (Dr. GRPO: no length bias)
    dapo = "dapo"  # all tokens / all completion tokens (DAPO's token-level mean; TRL's default)


@dataclass
class RLConfig:
    prompts: Optional[str] = None  # JSON lines: {"prompt": str, "answer": ...} (the rewards read the other keys)
    group_size: int = 4  # completions a prompt (GRPO's G); divides train.global_batch_size
    max_new_tokens: int = 32  # a completion's length limit (it stops at end-of-document sooner)
    temperature: float = 1.0  # sampling temperature of the rollouts (TRL's default)
    top_p: float = 1.0  # nucleus sampling (1: off)
    top_k: int = 0  # keep the k most likely tokens (0: all)
    rewards: List[str] = field(default_factory=lambda: ["math"])  # built-ins or package.module:function (rewards.py)
    reward_weights: List[float] = field(default_factory=list)  # one per reward, summed (empty: 1 each; TRL's name)
    advantage: Advantage = Advantage.grpo  # how rewards become advantages within a prompt's group
    loss: Aggregation = Aggregation.grpo  # how the token losses are averaged
    epsilon_low: float = 0.2  # the ratio's clip below 1 (PPO's 0.2)
    epsilon_high: float = 0.2  # the ratio's clip above 1 (DAPO's clip-higher: 0.28)
    updates: int = 1  # optimizer steps on each rollout batch (TRL's num_iterations); old log-probs scored once
