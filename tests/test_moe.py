"""Mixture of experts (models/moe.py) at every expert-parallel layout against one process.

Each case loads the single-process reference's full weights into its shards (experts split over EP ranks,
each expert's FFN over ETP ranks), takes one optimizer step and one more forward/backward on the same
global batch, and compares with the reference: both losses, the extra losses (router load-balancing loss,
z-loss, the load imbalance), every gradient of the second step and every parameter after the first update,
fp32, max|diff| / max|ref| <= 1e-5 per tensor (gradients and updated parameters 3e-5: on an AVX-512 machine an
expert's linear_fc2 after the update differs up to 1.18e-5 at ep2-tp2-sp-etp2 and ep2-dp4, the summation order);
every rank's parameter count against the estimate.

DeepSeek-V3's router (sigmoid, group-limited top-k, scaled, a shared expert) runs at ep2 and ep2 x tp2 + sp against
its own reference; its expert bias is updated after the first step from the load summed over every rank, so the
second step's routing, and loss, hold the update to one process's (planted: one rank's counts -> both fail).

A MoE layer's load-balancing loss depends on which tokens share a micro-batch, so every layout keeps the
reference's micro-batches (2 sequences): DP ranks take whole micro-batches, never smaller ones.
"""

import pytest
from layouts import make_batch, max_rel_diff, model_overrides, run_layouts
from model_options import DEEPSEEK_ROUTER

RTOL = 1e-5
TENSOR_RTOL = 3e-5  # gradients and updated parameters (the docstring)
MOE = ["model.moe.num_experts=4", "model.moe.top_k=2", "model.moe.ffn_hidden_size=32",
       "model.moe.aux_loss_coeff=0.1", "model.moe.z_loss_coeff=0.01", "model.moe.first_dense=1",
       "optim.warmup_iters=0", "optim.lr=1e-4", "optim.min_lr=1e-5"]  # the first step updates (lr 0 in a warm-up)
ALLGATHER = ["model.moe.dispatcher=allgather"]
SP = ["parallel.tp=2", "parallel.sp=true"]
# name -> (layout overrides, processes)
CASES = {
    "ep2": (["parallel.ep=2"], 2),
    "ep2-allgather": (["parallel.ep=2", *ALLGATHER], 2),
    "ep2-distopt": (["parallel.ep=2", "parallel.dist_opt=true", "parallel.overlap_grad_reduce=true"], 2),
    "dp2-ep1": ([], 2),
    "ep2-tp2-sp": (["parallel.ep=2", *SP], 4),
    "ep2-tp2-sp-etp2": (["parallel.ep=2", "parallel.etp=2", *SP], 4),
    "ep2-tp2-sp-etp2-allgather": (["parallel.ep=2", "parallel.etp=2", *SP, *ALLGATHER], 4),
    "ep2-pp2": (["parallel.ep=2", "parallel.pp=2"], 4),
    "ep2-dp4": (["parallel.ep=2", "train.micro_batch_size=1"], 4),  # experts' DP 2: their buffer reduced over it
}
DEEPSEEK = DEEPSEEK_ROUTER  # DeepSeek-V3's router (tests/layouts.py)
CASES |= {"deepseek-ep2": (["parallel.ep=2", *DEEPSEEK], 2),
          "deepseek-ep2-tp2-sp": (["parallel.ep=2", *SP, *DEEPSEEK], 4)}
FAST = {"ep2"}
BATCH = make_batch(global_batch=4, seq=16)
# the references: micro-batches of 2 sequences (the default), and of 1 for the layouts with 4 DP ranks
REFS = {"micro2": [], "micro1": ["train.micro_batch_size=1"], "deepseek": DEEPSEEK}


def _ref(case: str) -> str:
    overrides = CASES[case][0]
    return "deepseek" if DEEPSEEK[0] in overrides else "micro1" if "train.micro_batch_size=1" in overrides else "micro2"


@pytest.fixture(scope="module")
def runs(request):
    selected = {item.callspec.params["case"] for item in request.session.items
                if item.module is request.module and hasattr(item, "callspec")}
    wanted = {_ref(case) for case in selected} | {"micro2"}
    refs = dict(zip(wanted, run_layouts([(model_overrides(*MOE, *REFS[name]), None, 2, True) for name in wanted],
                                        1, BATCH)))
    for name, ref in refs.items():
        if isinstance(ref, Exception):
            raise AssertionError(f"the 1-process MoE reference {name} failed") from ref
    cases = {}
    for world in (2, 4):
        names = [n for n, (_, w) in CASES.items() if w == world and n in selected]
        if names:  # the same initial weights as the reference (the same seed)
            specs = [(model_overrides(*MOE, *CASES[n][0]), refs[_ref(n)]["params_before"], 2, True) for n in names]
            cases.update(zip(names, run_layouts(specs, world, BATCH)))
    return refs, cases


@pytest.mark.parametrize("case", [pytest.param(c, marks=pytest.mark.fast) if c in FAST else c for c in CASES])
def test_moe_layout_matches_single_process(case, runs):
    refs, cases = runs
    ref = refs[_ref(case)]
    out = cases[case]
    if isinstance(out, Exception):
        raise out
    assert out["losses"] == pytest.approx(ref["losses"], rel=RTOL)
    for step in range(2):
        assert set(out["extra"][step]) == set(ref["extra"][step]) == {"load_balancing_loss", "z_loss",
                                                                        "moe_load_imbalance"}
        for name, value in ref["extra"][step].items():
            assert value > 0 and out["extra"][step][name] == pytest.approx(value, rel=RTOL), (step, name)
    if "logits" in out:
        assert max_rel_diff(out["logits"], ref["logits"]) <= RTOL
    if "distopt" not in case:  # the distributed optimizer keeps only its shard of the gradients
        assert set(out["grads"]) == set(ref["grads"])
        bad = {n: d for n, g in ref["grads"].items() if not (d := max_rel_diff(out["grads"][n], g)) <= TENSOR_RTOL}
        assert not bad, f"gradients differ from the single-process reference: {bad}"
    assert set(out["params"]) == set(ref["params"])
    bad = {n: d for n, p in ref["params"].items() if not (d := max_rel_diff(out["params"][n], p)) <= TENSOR_RTOL}
    assert not bad, f"parameters after one update differ: {bad}"
    for built, estimated in out["counts"]:
        assert built == estimated, out["counts"]
    assert all(buffers == 1 for buffers in out["expert_buffers"])  # DDP keeps the experts' grads apart
    routers = [n for n in ref["grads"] if n.endswith("router.weight")]
    assert len(routers) == 3 and all(ref["grads"][n].abs().max() > 0 for n in routers)  # layers 2-4 are MoE


# ---- checkpoints: resume at EP2, and across EP sizes with the optimizer state ------------------------------------
CKPT = ["model=moe_tiny", "model.num_layers=2", "train.iters=6", "train.save_interval=3", "checkpoint.keep=0"]


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    """moe_tiny trained 6 iterations at EP1 (1 process) and EP2 (2 processes), saving at 3 and 6."""
    from runs import train

    root = tmp_path_factory.mktemp("moe-checkpoints")
    return {ep: (root / f"ep{ep}", train(CKPT + [f"parallel.ep={ep}"], ep, root / f"ep{ep}")) for ep in (1, 2)}


def test_moe_resume_at_ep2_is_bit_identical(saved, tmp_path):
    from runs import train

    run_dir, full = saved[2]
    resumed = train(CKPT + ["parallel.ep=2", f"checkpoint.load={run_dir}/checkpoints/iter_0000003"], 2, tmp_path)
    assert resumed == {i: full[i] for i in (4, 5, 6)}  # exact float equality


def _moments_after_load(overrides: list[str]) -> dict:
    """Load a checkpoint in one process (EP1: every expert here) and return every parameter's Adam moments
    under the checkpoint's keys (the experts stacked as Megatron-Core saves them, [E, ...])."""
    import torch
    from runs import QUICK

    from models.shape import ModelShape
    from training import checkpoint
    from training.config.compose import compose
    from training.engine.build import build
    from training.parallel import dist as D
    from training.parallel.wrap import unwrap

    cfg = compose(QUICK + overrides)
    with D.distributed(timeout_minutes=2) as info:
        state = build(cfg, ModelShape.of(cfg.model, 257), info.device)
        assert checkpoint.maybe_load(cfg, state).iteration == 3
        adam = {}
        for opt in state.optimizer.chained_optimizers:
            adam.update(opt.optimizer.state)
        out: dict[str, dict] = {}
        for name, param in unwrap(state.model[0]).named_parameters():
            for moment in ("exp_avg", "exp_avg_sq"):
                value = adam[param][moment].clone()
                if ".local_experts." in name:  # ...experts.local_experts.<j>.x -> ...experts.experts.x [j]
                    head, rest = name.split(".local_experts.")
                    index, rest = rest.split(".", 1)
                    out.setdefault(f"{moment}.{head}.experts.{rest}", {})[int(index)] = value
                else:
                    out[f"{moment}.{name}"] = value
        return {k: torch.stack([v[j] for j in sorted(v)]) if isinstance(v, dict) else v for k, v in out.items()}


def test_moe_resume_across_ep_sizes_keeps_adam_state(saved, tmp_path):
    """EP2 -> EP1 and EP1 -> EP2 (Megatron-Core's optimizer layout differs there: upstream_fixes 3): Adam's
    moments after the load equal the saved ones, and training continues as the uninterrupted run did."""
    import torch
    from harness import run_distributed
    from runs import train
    from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

    ep2_dir, ep2_full = saved[2]
    ckpt = ep2_dir / "checkpoints" / "iter_0000003"
    dcp_to_torch_save(str(ckpt), str(tmp_path / "ep2.pt"))
    original = {k.removeprefix("optimizer.state."): v for k, v in torch.load(tmp_path / "ep2.pt", weights_only=False).items()
                if k.startswith("optimizer.state.exp_avg")}
    (loaded,) = run_distributed(_moments_after_load, 1, (CKPT + [f"checkpoint.load={ckpt}", "checkpoint.dir=null"],),
                                timeout=300)
    assert set(loaded) == set(original)
    for key, value in loaded.items():
        assert torch.equal(value, original[key]), key

    for source, target in ((2, 1), (1, 2)):
        run_dir, full = saved[source]
        resumed = train(CKPT + [f"parallel.ep={target}", f"checkpoint.load={run_dir}/checkpoints/iter_0000003"],
                        target, tmp_path / f"ep{source}-to-ep{target}")
        assert sorted(resumed) == [4, 5, 6]
        for i, loss in resumed.items():
            assert loss == pytest.approx(full[i], rel=1e-5), (source, target, i, loss, full[i])


def test_launch_moe_tiny_at_ep2_learns_and_logs_the_router(tmp_path):
    """NPROC=2 launch/train.sh model=moe_tiny parallel.ep=2: the loss falls by more than 20% in 60 steps and
    every logged step carries the load-balancing loss, the z-loss and the load imbalance."""
    import json
    import os
    import subprocess
    from pathlib import Path

    root = Path(__file__).resolve().parents[1]
    env = dict(os.environ, NPROC="2", RUN_DIR=str(tmp_path / "run"))
    proc = subprocess.run(["launch/train.sh", "model=moe_tiny", "parallel.ep=2", "train.iters=60",
                           "train.eval_interval=0", "checkpoint=none"],
                          cwd=root, env=env, capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert "(experts: ep 2 x etp 1 x edp 1 per stage)" in proc.stdout
    records = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    assert [r["iteration"] for r in records] == [10, 20, 30, 40, 50, 60]
    assert records[-1]["loss"] < 0.8 * records[0]["loss"], [r["loss"] for r in records]
    for r in records:
        assert r["load_balancing_loss"] > 0 and r["z_loss"] > 0 and 1.0 <= r["moe_load_imbalance"] <= 8.0, r
    assert " | moe_load_imbalance " in proc.stdout
