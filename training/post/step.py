"""The preference step: the reference's pass over the step's micro-batches, then the policy's (Megatron-Core's
schedule through training/engine/step.py's seam), the loss a function of each pair's answer sums.

    objective = PreferenceObjective(cfg, state)       # training/engine/loop.py, when post.objective is set
    result = objective.train_step(state, streams, layout, cfg, device)     # StepResult: loss, rewards/* in extra
    values = objective.evaluate(state, make_streams, layout, cfg, device)  # {"val_loss", "val_rewards/..."}

Per micro-batch (last stage): the answers' log-prob sums (training/post/logps.py) -> the objective per pair
(training/post/objectives.py) -> the returned loss is the micro-batch's sum over pairs and its count the pairs, so
Megatron-Core's per-token normalisation (calculate_per_token_loss: finalize_model_grads divides the gradients by
the global count) makes the gradient that of the mean over the global batch's pairs, at every DP / PP layout.
The SFT term is a token mean over the global batch's chosen answers: its sum is scaled by pairs / chosen tokens
of the global batch, counted before the step (one all-reduce over DP).
"""

from __future__ import annotations

from functools import partial

import numpy as np
import torch
import torch.distributed as dist
from megatron.core import parallel_state

from training.config.schema import Config
from training.engine import step as engine_step
from training.engine.losses import global_loss_sum
from training.parallel import dist as D
from training.post.logps import answer_sums
from training.post.objectives import METRICS, metric_sums, pair_losses
from training.post.reference import Reference, peek


class PreferenceObjective:
    def __init__(self, cfg: Config, state):
        self.cfg, self.post = cfg, cfg.post
        self.reference = Reference.of(cfg, state)
        D.print0(f"post-training: post.objective={self.post.objective}, beta {self.post.beta}, reference "
                 f"{self.post.reference}" + (f", sft_weight {self.post.sft_weight}" if self.post.sft_weight else ""))

    def attach(self, state, layout, train_ds, valid_ds, consumed: int = 0) -> None:
        """post.reference=stored: the datasets' pairs take the stored scores (scored now if missing)."""
        if str(self.post.reference) == "stored":
            from training.post.stored import load_or_score

            datasets = {"train": train_ds, "valid": valid_ds}
            tables = load_or_score(self.cfg, state, layout, datasets)
            for name, data in datasets.items():
                if data is not None:
                    data.reference = tables[name]
                    assert np.isfinite(data.reference[data.kept]).all(), f"{name}: a kept pair without a stored score"

    def _prepare(self, streams, count: int, device) -> torch.Tensor:
        """Score the step's pairs with the reference; [pairs, chosen answer tokens] of the global batch."""
        batches, iterators = peek(streams, count)
        if self.reference is not None:
            self.reference.score(iterators, count)
        mine = next((b for b in batches if b is not None), [])  # every stage reads packed batches
        totals = torch.zeros(2, dtype=torch.float64, device=device)
        for batch in mine:
            ids = batch["answer_ids"]
            totals += torch.tensor([(batch["pair_index"] >= 0).sum().item(), ((ids >= 0) & (ids % 2 == 0)).sum().item()],
                                   dtype=torch.float64, device=device)
        dist.all_reduce(totals, group=parallel_state.get_data_parallel_group())
        return totals

    def _policy_step(self, totals, data_iterator, model):
        batch = next(data_iterator) if data_iterator is not None else None
        output, _ = engine_step.forward_step(iter([batch]) if batch is not None else None, model)
        return output, partial(self._loss, batch, totals)

    def _loss(self, batch, totals, token_losses):
        device = token_losses.device
        sums, counts = answer_sums(token_losses, batch["answer_ids"], batch["ref_logps"].shape[1])  # [b, P, 2]
        present = (batch["pair_index"] >= 0).to(device)  # [b, P] the slots holding a pair
        logps, lengths = sums[present], counts[present]  # [n, 2] (chosen, rejected)
        ref = batch["ref_logps"].to(device)[present].float()  # [n, 2]
        losses, rewards = pair_losses(self.post, logps, ref, lengths)
        total = losses.sum()
        if self.post.sft_weight:  # + weight * (chosen NLL sum) * pairs / chosen tokens: the global token mean
            total = total + self.post.sft_weight * (-logps[:, 0].sum()) * (totals[0] / totals[1].clamp(min=1)).float()
        n = present.sum()
        report = {"lm loss": torch.stack([total.detach().double(), n.double()]),
                  "preference": torch.cat([metric_sums(rewards, logps), n.double().view(1)])}
        return total, n.to(torch.int), report

    def _summary(self, reports, device, prefix: str = "") -> dict[str, float]:
        total = global_loss_sum(reports, device, "preference", len(METRICS) + 1)
        return {prefix + name: (total[k] / total[-1].clamp(min=1)).item() for k, name in enumerate(METRICS)}

    def train_step(self, state, streams, layout, cfg: Config, device):
        totals = self._prepare(streams, layout.num_microbatches, device)
        return engine_step.train_step(state, streams, layout, cfg, device, step=partial(self._policy_step, totals),
                                      summary=self._summary)

    def evaluate(self, state, make_streams, layout, cfg: Config, device) -> dict[str, float]:
        """The objective and TRL's metrics over the first train.eval_iters global batches of the validation split."""
        for chunk in state.model:
            chunk.eval()
        values = self.measure(state, make_streams(), layout, cfg, device, cfg.train.eval_iters, "val_")
        for chunk in state.model:
            chunk.train()
        return values

    def measure(self, state, streams, layout, cfg: Config, device, batches: int, prefix: str = "") -> dict:
        """Forward only over `batches` global batches of `streams`: {loss, rewards/..., logps/...} (prefixed)."""
        reports = []
        with torch.no_grad():
            for _ in range(batches):
                totals = self._prepare(streams, layout.num_microbatches, device)
                reports += engine_step.run_schedule(state, streams, layout, cfg, forward_only=True,
                                                    step=partial(self._policy_step, totals))
        loss = global_loss_sum(reports, device)
        return {f"{prefix}loss": (loss[0] / loss[1].clamp(min=1)).item(), **self._summary(reports, device, prefix)}
