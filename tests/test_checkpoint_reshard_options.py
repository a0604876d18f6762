"""Checkpoints of issue 42's TP-split weights reshard: learned attention sinks (gpt-oss, `core_attention.softmax_offset`
[np], split over TP like the heads) and OLMo 2's whole-projection QK-norm (`model.qk_norm_span=projection`: weights
[np * hn] and [ng * hn], split over TP), each saved at tp2 and loaded at tp1 and at pp2 give the tp2 model's logits
(max |diff| / max |logit| <= 1e-6). Every 1-D weight is random (the sinks start near 0, the norms at 1: a dropped or
misplaced shard would hide). One 2-process group: both saves at tp2, then every load (tp1 runs as dp2).
"""

import pytest
import torch
from harness import run_distributed
from hf_interop import logits_at_layouts
from layouts import VOCAB, model_overrides

TOLERANCE = 1e-6
MODELS = {
    "sinks": ["model.attention_sinks=true"],
    "projection-qk-norm": ["model.norm_placement=post", "model.qk_norm=true", "model.qk_norm_span=projection"],
}
LOADS = {"tp1": [], "pp2": ["parallel.pp=2"]}


def _randomise(gpt) -> None:
    """Every 1-D weight drawn by its name (and TP rank, for a TP shard): the same model at any TP rank's view."""
    from megatron.core import parallel_state

    with torch.no_grad():
        for i, (name, param) in enumerate(sorted(gpt.named_parameters())):
            if param.dim() == 1:
                split = getattr(param, "tensor_model_parallel", False)
                g = torch.Generator().manual_seed(100 * i + (parallel_state.get_tensor_model_parallel_rank() if split
                                                             else 0))
                sinks = "softmax_offset" in name
                param.copy_(torch.randn(param.shape, generator=g) * (1.0 if sinks else 0.3) + (0.0 if sinks else 1.0))


def _save_then_load(root: str, tokens: torch.Tensor) -> dict:
    """Two processes: each model built, randomised and saved (weights only) at tp2 with its logits; then each
    checkpoint's logits at every load layout (tests/hf_interop.py's loader)."""
    from megatron.core import parallel_state

    from models.shape import ModelShape
    from training import checkpoint
    from training.config.compose import compose
    from training.engine.build import build
    from training.interop import hf
    from training.parallel import dist as D
    from training.parallel.wrap import unwrap

    out = {}
    for name, extra in MODELS.items():
        cfg = compose(model_overrides(*extra, "parallel.tp=2", f"checkpoint.dir={root}/{name}"))
        info = D.init(**{**D.layout_of(cfg), "timeout_minutes": 2})
        state = build(cfg, ModelShape.of(cfg.model), info.device, train=False)
        _randomise(unwrap(state.model[0]))
        checkpoint.save(cfg, state, iteration=0, consumed_samples=0, model_only=True)
        out[f"{name} tp2"] = hf.full_logits(state, tokens, VOCAB)
        parallel_state.destroy_model_parallel()
    jobs = [(f"{name} {load}", root, f"{root}/{name}", model_overrides(*extra, *overrides))
            for name, extra in MODELS.items() for load, overrides in LOADS.items()]
    return {**out, **logits_at_layouts(jobs, tokens)}  # logits_at_layouts tears the group down


@pytest.fixture(scope="module")
def logits(tmp_path_factory):
    tokens = torch.randint(0, VOCAB, (2, 16), generator=torch.Generator().manual_seed(7))
    ranks = run_distributed(_save_then_load, 2, (str(tmp_path_factory.mktemp("reshard")), tokens), timeout=300)
    return ranks


@pytest.mark.parametrize("name", list(MODELS))
def test_saved_at_tp2_loads_at_tp1_and_pp2_with_the_same_logits(name, logits):
    saved = [r[f"{name} tp2"] for r in logits]
    assert torch.equal(saved[0], saved[1])  # both TP ranks gather the same logits
    diffs = {}
    for load in LOADS:
        got = [r[f"{name} {load}"] for r in logits if f"{name} {load}" in r]  # pp2: the last stage only
        assert len(got) == (1 if load == "pp2" else 2), load
        diffs[load] = ((got[0] - saved[0]).abs().max() / saved[0].abs().max()).item()
    print(f"{name}: relative logits diff vs the tp2 model: {diffs}")
    assert all(d <= TOLERANCE for d in diffs.values()), diffs
