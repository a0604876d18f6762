"""Blocks that exist only for the tests, named in the config as `blocks:<Class>` (tests/ is on the path of
every test process): a user's block plugs in the same way, from its own file, with no edit of models/."""

from __future__ import annotations

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
