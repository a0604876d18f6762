"""Mixture of experts (models/moe.py) at every expert-parallel layout against one process.

Each case loads the single-process reference's full weights into its shards (experts split over EP ranks,
each expert's FFN over ETP ranks), takes one optimizer step and one more forward/backward on the same
global batch, and compares with the reference: both losses, the extra losses (router load-balancing loss,
z-loss, the load imbalance), every gradient of the second step and every parameter after the first update,
fp32, max|diff| / max|ref| <= 1e-5 per tensor; every rank's parameter count against the estimate.

A MoE layer's load-balancing loss depends on which tokens share a micro-batch, so every layout keeps the
reference's micro-batches (2 sequences): DP ranks take whole micro-batches, never smaller ones.
"""

import pytest

from layouts import make_batch, max_rel_diff, model_overrides, run_layouts

RTOL = 1e-5
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
}
FAST = {"ep2"}
BATCH = make_batch(global_batch=4, seq=16)


@pytest.fixture(scope="module")
def runs(request):
    selected = {item.callspec.params["case"] for item in request.session.items
                if item.module is request.module and hasattr(item, "callspec")}
    (ref,) = run_layouts([(model_overrides(*MOE), None, 2, True)], 1, BATCH)
    if isinstance(ref, Exception):
        raise AssertionError("the 1-process MoE reference failed") from ref
    cases = {}
    for world in (2, 4):
        names = [n for n, (_, w) in CASES.items() if w == world and n in selected]
        if names:
            specs = [(model_overrides(*MOE, *CASES[n][0]), ref["params_before"], 2, True) for n in names]
            cases.update(zip(names, run_layouts(specs, world, BATCH)))
    return ref, cases


@pytest.mark.parametrize("case", [pytest.param(c, marks=pytest.mark.fast) if c in FAST else c for c in CASES])
def test_moe_layout_matches_single_process(case, runs):
    ref, cases = runs
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
        bad = {n: d for n, g in ref["grads"].items() if not (d := max_rel_diff(out["grads"][n], g)) <= RTOL}
        assert not bad, f"gradients differ from the single-process reference: {bad}"
    assert set(out["params"]) == set(ref["params"])
    bad = {n: d for n, p in ref["params"].items() if not (d := max_rel_diff(out["params"][n], p)) <= RTOL}
    assert not bad, f"parameters after one update differ: {bad}"
    for built, estimated in out["counts"]:
        assert built == estimated, out["counts"]
    routers = [n for n in ref["grads"] if n.endswith("router.weight")]
    assert len(routers) == 3 and all(ref["grads"][n].abs().max() > 0 for n in routers)  # layers 2-4 are MoE
