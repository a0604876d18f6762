"""The policy-gradient step on a rollout batch: Megatron-Core's schedule through training/engine/step.py's seam,
the GRPO family's loss (training/post/rl/loss.py) on each micro-batch's completion tokens.

    objective = PolicyGradient(LossConfig(aggregation="dapo", epsilon_high=0.28))
    result = objective.train_step(state, streams, layout, cfg, device)    # StepResult; rl/* metrics in extra
    old = objective.score(state, streams, layout, cfg)                     # the rows' log-probs, forward only

A rollout row (one prompt and one completion, right-padded to model.seq_length): tokens [s], labels [s] (the
next tokens), loss_mask [s] (1 where the label is a completion token), old_logps [s] and ref_logps [s] (the
log-probs of each label under the policy that sampled it and under the reference, 0 elsewhere), advantages []
(the completion's). The last stage's token losses are -log p(label): the log-probs, whole over the vocabulary
under TP (vocab-parallel cross entropy). Context parallelism is not taken yet (a completion's token mean would
need its CP pieces summed first).
"""

from __future__ import annotations

from functools import partial

import torch

from training.config.schema import Config
from training.engine import step as engine_step
from training.engine.losses import global_loss_sum
from training.post.rl.loss import LossConfig, policy_loss

METRICS = ("clip_low", "clip_high", "kl")  # per completion token, means over the global batch


class PolicyGradient:
    def __init__(self, loss: LossConfig):
        self.loss = loss

    def _step(self, data_iterator, model):
        batch = next(data_iterator) if data_iterator is not None else None
        output, _ = engine_step.forward_step(iter([batch]) if batch is not None else None, model)
        return output, partial(self._loss, batch)

    def _loss(self, batch, token_losses):
        device = token_losses.device
        logps = -token_losses.float()  # [b, s] log p(label)
        ref = batch["ref_logps"].to(device) if self.loss.beta else None
        loss, count, m = policy_loss(logps, batch["old_logps"].to(device), batch["advantages"].to(device),
                                     batch["loss_mask"].to(device), self.loss, ref=ref)
        sums = torch.stack([m["clip_low"], m["clip_high"], m["kl"], m["tokens"]]).double()
        report = {"lm loss": torch.stack([loss.detach().double(), count.to(device).double()]), "rl": sums}
        return loss, count.to(device).int(), report

    def _summary(self, reports, device) -> dict[str, float]:
        total = global_loss_sum(reports, device, "rl", len(METRICS) + 1)
        return {f"rl/{name}": (total[k] / total[-1].clamp(min=1)).item() for k, name in enumerate(METRICS)
                if name != "kl" or self.loss.beta}

    def train_step(self, state, streams, layout, cfg: Config, device):
        return engine_step.train_step(state, streams, layout, cfg, device, step=self._step, summary=self._summary)

    def score(self, state, streams, layout, cfg: Config) -> list[torch.Tensor]:
        """Each micro-batch's [b, s] label log-probs on the last stage (forward only): the old log-probs of a
        rollout batch, recomputed at the training layout."""
        out = []

        def keep(data_iterator, model):
            batch = next(data_iterator) if data_iterator is not None else None
            output, _ = engine_step.forward_step(iter([batch]) if batch is not None else None, model)

            def store(token_losses):
                out.append(-token_losses.detach().float())
                return token_losses.sum() * 0, torch.tensor(1, dtype=torch.int), {}
            return output, store

        with torch.no_grad():
            engine_step.run_schedule(state, streams, layout, cfg, forward_only=True, step=keep)
        return out
