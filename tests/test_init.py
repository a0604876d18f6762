"""The initial weights themselves (one process, fp32): each weight has the spread its init method states
(Megatron's: normal(0, init_method_std); the residual branch's output projections scaled by 1 / sqrt(2 x layers))
and its 64-row blocks, which training/engine/init.py draws one generator seed each, are independent. The layout
tests cannot see a fault here: a fault that every layout shares trains the same model at every layout."""

from __future__ import annotations

import math

import pytest
import torch
from harness import run_distributed

from training.config.compose import compose

STD, LAYERS = 0.02, 2
OVERRIDES = ["model.hidden_size=256", "model.ffn_hidden_size=640", "model.num_attention_heads=4",
             f"model.num_layers={LAYERS}", f"model.init_method_std={STD}"]
OUTPUT_PROJECTIONS = ("linear_proj", "linear_fc2")  # attention's output and the MLP's down projection


def _initial_weights(overrides: list[str]) -> dict[str, torch.Tensor]:
    from models.shape import ModelShape
    from training.engine.build import build
    from training.parallel import dist as D
    from training.parallel.wrap import unwrap

    cfg = compose(overrides)
    with D.distributed(timeout_minutes=2) as info:
        gpt = unwrap(build(cfg, ModelShape.of(cfg.model, 257), info.device, train=False).model[0])
        return {name: p.detach().float().clone() for name, p in gpt.named_parameters() if p.dim() == 2}


@pytest.mark.fast
def test_initial_weights_have_their_init_methods_spread_and_independent_row_blocks():
    weights = run_distributed(_initial_weights, 1, (OVERRIDES,), timeout=300)[0]
    assert len(weights) >= 1 + 4 * LAYERS, sorted(weights)
    blocks_checked = 0
    for name, w in weights.items():
        if "embedding" in name:
            w = w[:257]  # the vocabulary's real rows (padding rows: blocks of their own)
        expected = STD / math.sqrt(2 * LAYERS) if name.rsplit(".", 2)[-2] in OUTPUT_PROJECTIONS else STD
        assert abs(w.mean().item()) < 0.1 * expected, (name, w.mean().item())
        assert w.std().item() == pytest.approx(expected, rel=0.05), (name, w.std().item(), expected)
        blocks = w[: w.shape[0] // 64 * 64].reshape(-1, 64 * w.shape[1])  # [blocks of 64 rows, 64 x columns]
        if blocks.shape[0] >= 2:
            corr = torch.corrcoef(blocks)  # [blocks, blocks]: independent draws are ~1/sqrt(64 x columns) apart
            off_diagonal = corr[~torch.eye(len(corr), dtype=torch.bool)].abs().max().item()
            assert off_diagonal < 0.1, (name, off_diagonal)
            blocks_checked += 1
    assert blocks_checked >= 4 * LAYERS, blocks_checked
    names = sorted(weights)  # two weights of the same shape are different draws (seeded by their names)
    same_shape = [(a, b) for a in names for b in names if a < b and weights[a].shape == weights[b].shape]
    assert same_shape and all(not torch.equal(weights[a], weights[b]) for a, b in same_shape)
