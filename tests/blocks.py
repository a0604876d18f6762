"""Blocks that exist only for the tests, named in the config as `blocks:<Class>` (tests/ is on the path of
every test process): a user's block plugs in the same way, from its own file, with no edit of models/."""

from __future__ import annotations

import os
import time

import torch

from models.extra_losses import attach
from models.mlp import MLP

PENALTY = "mlp_output_penalty"


class PenalizedMLP(MLP):
    """models/mlp.py's MLP with a named extra loss: the mean square of its output (an activation penalty),
    weight `coeff`. The output is replicated over TP (without SP) or this rank's sequence shard (with SP):
    what models/extra_losses.py's contract asks for. Parameters and FLOPs are MLP's (inherited)."""

    extra_losses = (PENALTY,)
    coeff = 1e4  # strong: the outputs are ~1e-3, so its gradient is ~half of the MLP weights'; a class attribute,
    # so a test can switch the attached gradient off

    def forward(self, x: torch.Tensor):
        out, bias = super().forward(x)  # [s(/tp), b, h]
        return attach(out, out.float().pow(2).mean(), PENALTY, self.coeff), bias


class FaultyMLP(MLP):
    """models/mlp.py's MLP that injects one fault (tests/test_faults.py), configured by the environment:
    on rank FAULT_RANK, at its FAULT_AT-th training forward (counted over its layers and micro-batches),
    FAULT=nan makes the gradient flowing into this MLP's output NaN, FAULT=stall sleeps FAULT_SECONDS (a
    hung rank). Without FAULT it is the MLP."""

    calls = 0

    def forward(self, x: torch.Tensor):
        out, bias = super().forward(x)
        if os.environ.get("FAULT") and self.training and torch.is_grad_enabled() and \
                os.environ.get("RANK") == os.environ.get("FAULT_RANK", "1"):
            FaultyMLP.calls += 1
            if FaultyMLP.calls == int(os.environ["FAULT_AT"]):
                if os.environ["FAULT"] == "nan":
                    out.register_hook(lambda grad: grad * float("nan"))
                elif os.environ["FAULT"] == "stall":
                    time.sleep(float(os.environ.get("FAULT_SECONDS", "600")))
        return out, bias
