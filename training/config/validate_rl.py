"""post.objective=grpo's rules, one line each, before any process starts (training/config/validate.py calls it)."""

from __future__ import annotations

import os

from training.config.schema import Config


def rl_problems(cfg: Config) -> list[str]:
    rl, p, t = cfg.post.rl, cfg.parallel, cfg.train
    rules = [
        (rl.prompts is not None, "post.objective=grpo trains on its own rollouts of prompts: set post.rl.prompts="
                                 "<prompts.jsonl> (one {\"prompt\": ..., \"answer\": ...} a line)"),
        (rl.prompts is None or os.path.isfile(rl.prompts), f"post.rl.prompts={rl.prompts}: no such file"),
        (rl.group_size >= 2, f"post.rl.group_size={rl.group_size} must be >= 2 (advantages compare a prompt's "
                             f"completions)"),
        (t.global_batch_size % max(rl.group_size, 1) == 0,
         f"train.global_batch_size={t.global_batch_size} must be a multiple of post.rl.group_size={rl.group_size} "
         f"(a rollout batch is whole groups)"),
        (rl.max_new_tokens >= 1, f"post.rl.max_new_tokens={rl.max_new_tokens} must be >= 1"),
        (rl.temperature > 0, f"post.rl.temperature={rl.temperature} must be > 0"),
        (0 < rl.top_p <= 1, f"post.rl.top_p={rl.top_p} must be in (0, 1]"),
        (rl.top_k >= 0, f"post.rl.top_k={rl.top_k} must be >= 0"),
        (0 <= rl.epsilon_low < 1 and rl.epsilon_high >= 0,
         f"post.rl.epsilon_low={rl.epsilon_low} must be in [0, 1) and epsilon_high={rl.epsilon_high} >= 0"),
        (rl.updates >= 1, f"post.rl.updates={rl.updates} must be >= 1"),
        (bool(rl.rewards), "post.rl.rewards is empty: name at least one reward (math, exact_match, format, or "
                           "package.module:function)"),
        (not rl.reward_weights or len(rl.reward_weights) == len(rl.rewards),
         f"post.rl.reward_weights has {len(rl.reward_weights)} weights for {len(rl.rewards)} rewards "
         f"({list(rl.rewards)}): give one each, or none (1 each)"),
        (not (p.sp or p.vpp is not None or p.cp > 1),
         "post.objective=grpo rolls out with the training layout: parallel.sp, parallel.vpp and parallel.cp are not "
         "taken yet (a one-token decoding step cannot be split along the sequence)"),
        (rl.max_new_tokens < cfg.model.seq_length,
         f"post.rl.max_new_tokens={rl.max_new_tokens} must leave room for the prompt in model.seq_length="
         f"{cfg.model.seq_length}"),
    ]
    return [message for ok, message in rules if not ok]
