"""post.objective=grpo: each rollout batch drawn by the policy at the training layout, scored, trained on.

    objective = RLObjective(cfg, state)          # training/engine/loop.py, when post.objective=grpo
    result = objective.train_step(state, None, layout, cfg, device)    # a rollout every post.rl.updates steps

A rollout batch is train.global_batch_size completions, group_size per prompt (prompts in a seeded order, epoch
by epoch). Each DP rank draws the completions of the rows it will train on (training/data/streams.py's split),
each from its own seeded generator (rollout.py: the same completion at any layout); the rewards of every rank's
rows are summed over DP so each rank has the whole batch's, for the group advantages. The old log-probs are
scored once (forward only) and kept in the cached micro-batches the `updates` steps read.
"""

from __future__ import annotations

import functools
import json

import numpy as np
import torch
import torch.distributed as dist
from megatron.core import parallel_state as ps

from training.config.schema import Config
from training.data.streams import micro_batch_streams
from training.data.tokenizer import build_tokenizer
from training.errors import ConfigError
from training.interop.generation import Sampling, generate
from training.parallel import dist as D
from training.post.reference import peek
from training.post.rl.loss import LossConfig, advantages
from training.post.rl.rewards import Rewards
from training.post.rl.rollout import rollout_rows, sample_seeds
from training.post.rl.step import PolicyGradient


def read_prompts(path: str, tokenizer) -> list[tuple[list[int], dict]]:
    out = []
    with open(path) as f:
        for line_number, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                record = json.loads(line)
            except json.JSONDecodeError as err:
                raise ConfigError(f"{path}:{line_number}: not JSON ({err.msg})") from err
            prompt = record.get("prompt") if isinstance(record, dict) else None
            if not isinstance(prompt, str) or not prompt:
                raise ConfigError(f"{path}:{line_number}: no \"prompt\" string (a prompts record is {{\"prompt\": str, "
                                  f"\"answer\": ...}}; message lists are not taken yet)")
            out.append((tokenizer.encode(prompt), record))
    if not out:
        raise ConfigError(f"{path}: no prompts")
    return out


class RLObjective:
    def __init__(self, cfg: Config, state):
        self.cfg, self.rl = cfg, cfg.post.rl
        weights = list(self.rl.reward_weights) or [1.0] * len(self.rl.rewards)
        self.rewards = Rewards.of(dict(zip(self.rl.rewards, weights, strict=True)))
        self.tokenizer = build_tokenizer(cfg.data.tokenizer)
        self.prompts = read_prompts(self.rl.prompts, self.tokenizer)
        self.pg = PolicyGradient(LossConfig(aggregation=str(self.rl.loss), epsilon_low=self.rl.epsilon_low,
                                            epsilon_high=self.rl.epsilon_high, max_completion_length=self.rl.max_new_tokens))
        self.iteration, self.cached, self.metrics = 0, None, {}
        D.print0(f"post-training: post.objective=grpo, {len(self.prompts)} prompts, {self.rl.group_size} completions "
                 f"each, rewards {dict(self.rewards.weights)}, advantage {self.rl.advantage}, loss {self.rl.loss}")

    def attach(self, state, layout, train_ds, valid_ds, consumed: int = 0) -> None:
        self.iteration = consumed // self.cfg.train.global_batch_size  # a resume mid-batch draws it again

    def prompt_of(self, k: int) -> tuple[list[int], dict]:
        """The k-th prompt of the run: epoch k // N in its own seeded order."""
        n = len(self.prompts)
        return self.prompts[self._order(k // n)[k % n]]

    @functools.lru_cache(maxsize=2)  # noqa: B019 - one objective a run; the epoch's order, not one a completion
    def _order(self, epoch: int) -> np.ndarray:
        return np.random.default_rng([self.cfg.train.seed, epoch]).permutation(len(self.prompts))

    def _rollout(self, state, layout, cfg: Config, device):
        g, gbs, micro, count = self.rl.group_size, cfg.train.global_batch_size, cfg.train.micro_batch_size, \
            layout.num_microbatches
        batch_index = self.iteration // self.rl.updates
        dp, rank = ps.get_data_parallel_world_size(), ps.get_data_parallel_rank()
        mine = [k * micro * dp + rank * micro + j for k in range(count) for j in range(micro)]  # streams.py's split
        prompts = [self.prompt_of(batch_index * (gbs // g) + i // g) for i in mine]
        sampling = Sampling(greedy=False, temperature=self.rl.temperature, top_k=self.rl.top_k, top_p=self.rl.top_p)
        for chunk in state.model:
            chunk.eval()
        completions = generate(state, [ids for ids, _ in prompts], self.rl.max_new_tokens, sampling,
                               self.tokenizer.eod, device, seeds=sample_seeds(cfg.train.seed, 0,
                                                                               [batch_index * gbs + i for i in mine]))
        for chunk in state.model:
            chunk.train()
        samples = [{**record, "completion": self.tokenizer.decode(
            [t for t in ids if t != self.tokenizer.eod])} for (_, record), ids in zip(prompts, completions)]
        table, total = self.rewards(samples)
        full = torch.zeros(len(table) + 2, gbs, dtype=torch.float64, device=device)  # per function, total, length
        for k, i in enumerate(mine):
            full[:, i] = torch.tensor([*(table[n][k] for n in table), total[k], len(completions[k])])
        dist.all_reduce(full, group=ps.get_data_parallel_group())  # every rank: the whole batch's rewards
        adv = advantages(full[-2], g, str(self.rl.advantage))  # [gbs]
        rows = [None] * gbs
        for k, row in enumerate(rollout_rows([ids for ids, _ in prompts], completions, [adv[i] for i in mine],
                                             cfg.model.seq_length, self.tokenizer.eod)):
            rows[mine[k]] = row
        batches, iterators = peek(micro_batch_streams(len(state.model), rows, 0, micro), count)
        old = self.pg.score(state, iterators, layout, cfg)  # the last stage's [b, s] per micro-batch
        for batch, logps in zip(batches[-1] or [], old):
            batch["old_logps"] = logps.cpu()
        metrics = {f"rl/reward_{n}": full[k].mean().item() for k, n in enumerate(table)}
        metrics |= {"rl/reward": full[-2].mean().item(), "rl/reward_std": full[-2].std().item(),
                    "rl/completion_length": full[-1].mean().item()}
        return batches, metrics

    def train_step(self, state, streams, layout, cfg: Config, device):
        if self.iteration % self.rl.updates == 0 or self.cached is None:
            self.cached, self.metrics = self._rollout(state, layout, cfg, device)
        self.iteration += 1
        iterators = [None if b is None else iter(b) for b in self.cached]
        result = self.pg.train_step(state, iterators if len(iterators) > 1 else iterators[0], layout, cfg, device)
        result.extra |= self.metrics
        return result

    def evaluate(self, state, make_streams, layout, cfg: Config, device) -> dict[str, float]:
        return {}  # held-out prompts: not yet
