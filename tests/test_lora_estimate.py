"""The memory estimate's LoRA terms (training/estimate/lora.py) against the built model: the weights+optimizer
bytes the estimate gives for peft=lora equal, by the formula docs/peft.md states, what the model's frozen and
trainable parameters on each rank say (the base in the training dtype only: 2 bytes in bf16, 4 in fp32; an
adapter element 2 + 4 + 12 in bf16, 4 + 4 + 8 in fp32, the optimizer's 12 (8) over DP with the distributed
optimizer), and the saving against a full fine-tune is the difference of the two formulas."""

import pytest
from harness import run_distributed
from layouts import VOCAB, model_overrides

from models.shape import ModelShape
from training.config.compose import compose

CASES = {  # name: overrides on world 2
    "tp2-sp-bf16": ["parallel.tp=2", "parallel.sp=true", "train.precision=bf16"],
    "pp2-bf16-qkv-fc2": ["parallel.pp=2", "train.precision=bf16", "peft.targets=[linear_qkv,linear_fc2]"],
    "dp2-distopt-fp32": ["parallel.dist_opt=true", "peft.rank=6"],
    "tp2-mlp-only": ["parallel.tp=2", "parallel.tp_blocks=[mlp]", "peft.targets=[linear_proj,linear_fc1]"],
}


def _counts(cases: dict) -> dict:
    """Per case: this rank's trainable and frozen parameter elements in the built model (after freezing)."""
    from megatron.core import parallel_state as ps

    from models.shape import ModelShape
    from training.config.compose import compose
    from training.config.validate import validate
    from training.engine.build import build
    from training.parallel import dist as D
    from training.parallel.wrap import unwrap

    out = {}
    try:
        for name, overrides in cases.items():
            cfg = compose(model_overrides("peft=lora", *overrides))
            validate(cfg)
            info = D.init(**{**D.layout_of(cfg), "timeout_minutes": 2})
            try:
                state = build(cfg, ModelShape.of(cfg.model, VOCAB), info.device)
                params = [p for chunk in state.model for p in unwrap(chunk).parameters()]
                out[name] = (sum(p.numel() for p in params if p.requires_grad),
                             sum(p.numel() for p in params if not p.requires_grad),
                             ps.get_pipeline_model_parallel_rank())
            finally:
                D.reset_model_parallel()
    finally:
        D.teardown()
    return out


def test_lora_estimate_matches_the_built_models_parameters():
    from training.estimate.memory import estimate
    from training.parallel.layout import Layout

    per_rank = run_distributed(_counts, 2, (CASES,), timeout=300)
    for name, overrides in CASES.items():
        cfg = compose(model_overrides("peft=lora", *overrides))
        full = compose(model_overrides(*overrides))  # the same run, every weight trained
        shape, bf16 = ModelShape.of(cfg.model, VOCAB), "train.precision=bf16" in overrides
        lay = Layout.of(cfg, 2)
        dp = 2 if "parallel.dist_opt=true" in overrides else 1
        frozen_bytes, adapter_bytes = (2, 2 + 4 + 12 / dp) if bf16 else (4, 4 + 4 + 8 / dp)
        lora, whole = estimate(cfg, shape, lay), estimate(full, shape, Layout.of(full, 2))
        # the estimate is the most-loaded pipeline stage's: the ranks of that stage (the same counts on each)
        (trainable, frozen), = {rank[name][:2] for rank in per_rank if rank[name][2] == lora.stage}
        assert trainable > 0 and frozen > trainable, (name, trainable, frozen)
        assert lora.params_per_gpu == frozen and lora.adapters == trainable, (name, lora, trainable, frozen)
        expected = frozen * frozen_bytes + trainable * adapter_bytes
        assert lora.weights_and_optimizer == pytest.approx(expected, rel=1e-12), (name, lora, expected)
        # a full fine-tune: every base weight with its gradient and Adam state, no adapters
        full_bytes = (2 + 4 + 12 / dp) if bf16 else (4 + 4 + 8 / dp)
        saving = frozen * (full_bytes - frozen_bytes) - trainable * adapter_bytes
        assert whole.weights_and_optimizer - lora.weights_and_optimizer == pytest.approx(saving, rel=1e-9), name
        assert whole.stage == lora.stage and lora.activations > whole.activations  # the adapters' rank-r activations


def test_planner_plans_lora_with_the_frozen_base():
    """tools/plan.py's search with peft=lora: Llama 3.1 8B fits 80 GB GPUs as plain data parallelism, no
    optimizer sharding (the frozen base's 16 GB in bf16), which a full fine-tune (18 bytes a weight: 145 GB) does not; LoRA's DP traffic is the
    adapters' gradients only; no Megatron-FSDP layout (refused with LoRA) is proposed."""
    from training.estimate.planner import rank, search

    settings = {"gpus_per_node": 8, "nodes": 1, "gpu_mem_gb": 80.0, "flash_attention": True, "tflops": 400.0,
                "link_gbps": 200.0, "internode_gbps": 40.0}
    rows = {}
    for peft in ("lora", "none"):
        cfg = compose(["model=llama3_1_8b", f"peft={peft}", "train.precision=bf16", "train.global_batch_size=64",
                       "model.seq_length=2048"])
        rows[peft] = rank(search(cfg, ModelShape.of(cfg.model, cfg.model.vocab_size), settings, 1))
    plain = lambda r: r["tp"] == 1 and r["pp"] == 1 and r["cp"] == 1 and not r["dist_opt"]  # noqa: E731
    lora = [r for r in rows["lora"] if plain(r) and r["fits"]]
    assert lora and not [r for r in rows["none"] if plain(r) and r["fits"]]
    assert all(r["fsdp"] == "none" for r in rows["lora"])
    # bf16: the base's 2 bytes a weight; the adapters (17.8 M at rank 8) add < 1 GB
    assert all(2 * r["params_total"] / 1e9 <= r["mem_gb"]["weights_and_optimizer"] < 2 * r["params_total"] / 1e9 + 1
               for r in lora)
    assert all(r["comm_gb"]["dp"] < 0.5 for r in lora)  # 17.8 M fp32 gradients, not 8 B
