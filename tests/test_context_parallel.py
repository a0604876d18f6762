"""Context parallelism (parallel.cp) computes what one process computes.

Each case builds the GPT at a CP layout (gloo processes) from the single-process reference's weights, runs
the real step on the same global batch and compares, fp32, max|diff| / max|ref| <= 1e-5 per tensor: the loss
of every step, the logits (gathered back into token order, PP=1) and every parameter's gradient (DDP's,
reduced over DP x CP). The distributed-optimizer cases, which shard gradients, compare the parameters after
two updates instead. The sequence (16) is cut into 2 x cp chunks (zigzag); RoPE and learned positions both
follow the tokens' global positions.
"""

import json

import pytest
from layouts import FAMILY_OPTIONS, make_batch, max_rel_diff, model_overrides, run_layouts
from runs import train

RTOL = 1e-5
EPS = ["optim.adam_eps=1e-4"]  # the multi-step cases compare updated weights: Adam's step then follows the gradient
MODELS = {  # (instead of normalising last-bit gradient differences up to ~3e-5 of a weight's scale)
    "llama": [*EPS],  # GQA, SwiGLU, RMSNorm, RoPE, tied embeddings
    "gpt2": [*EPS, "model.num_query_groups=null", "model.activation=gelu", "model.normalization=LayerNorm",
             "model.position_embedding=learned", "model.add_bias_linear=true", "model.tie_embeddings=false"],
    "families": [*EPS, *FAMILY_OPTIONS],  # QK-norm, q/k/v biases, head dim 24, RoPE scaling (tests/layouts.py)
}
# (model, overrides, processes, steps): steps > 1 compares every step's loss and the parameters after them
CASES = {
    "cp2": ("llama", ["parallel.cp=2"], 2, 1),
    "gpt2-cp2": ("gpt2", ["parallel.cp=2"], 2, 1),
    "families-cp2": ("families", ["parallel.cp=2"], 2, 1),
    "cp2-recompute-selective": ("llama", ["parallel.cp=2", "model.recompute=selective"], 2, 1),
    "cp2-distopt": ("llama", ["parallel.cp=2", "parallel.dist_opt=true"], 2, 3),
    "cp4": ("llama", ["parallel.cp=4"], 4, 1),
    "cp2-tp2-sp": ("llama", ["parallel.cp=2", "parallel.tp=2", "parallel.sp=true"], 4, 1),
    "cp2-pp2": ("llama", ["parallel.cp=2", "parallel.pp=2"], 4, 1),
    "cp2-dp2-distopt": ("llama", ["parallel.cp=2", "parallel.dist_opt=true", "train.micro_batch_size=1"], 4, 3),
}
FAST = {"cp2"}
BATCH = make_batch(global_batch=4, seq=16)


def initial(ref: dict) -> dict:
    """The reference's starting weights (a one-step reference does not update them)."""
    return ref["params_before"] or ref["params"]


@pytest.fixture(scope="module")
def runs(request):
    items = [item for item in request.session.items if item.module is request.module]
    selected = {item.callspec.params["case"] for item in items if hasattr(item, "callspec")}
    needed = sorted({(CASES[n][0], CASES[n][3]) for n in selected})
    refs = dict(zip(needed, run_layouts([(model_overrides(*MODELS[m]), None, steps, True) for m, steps in needed],
                                        1, BATCH)))
    for key, ref in refs.items():
        if isinstance(ref, Exception):
            raise AssertionError(f"reference {key} failed") from ref
    cases = {}
    for world in sorted({CASES[n][2] for n in selected}):
        names = [n for n in CASES if n in selected and CASES[n][2] == world]
        specs = [(model_overrides(*MODELS[CASES[n][0]], *CASES[n][1]), initial(refs[(CASES[n][0], CASES[n][3])]),
                  CASES[n][3], True) for n in names]
        cases.update(zip(names, run_layouts(specs, world, BATCH)))
    return refs, cases


@pytest.mark.parametrize("case", [pytest.param(c, marks=pytest.mark.fast) if c in FAST else c for c in CASES])
def test_context_parallel_matches_single_process(case, runs):
    refs, cases = runs
    model, _, _, steps = CASES[case]
    ref, out = refs[(model, steps)], cases[case]
    if isinstance(out, Exception):
        raise out
    assert out["losses"] == pytest.approx(ref["losses"], rel=RTOL)
    for built, estimated in out["counts"]:
        assert built == estimated, out["counts"]
    if "logits" in out:
        assert out["logits"].shape == ref["logits"].shape
        assert max_rel_diff(out["logits"], ref["logits"]) <= RTOL
    if steps == 1:
        assert set(out["grads"]) == set(ref["grads"])
        bad = {n: d for n, g in ref["grads"].items() if not (d := max_rel_diff(out["grads"][n], g)) <= RTOL}
        assert not bad, f"gradients differ from the single-process reference: {bad}"
        assert all(g.abs().max() > 0 for g in ref["grads"].values())
    else:  # the distributed optimizer shards the gradients: the parameters after steps - 1 updates
        moved = {n: max_rel_diff(p, ref["params_before"][n]) for n, p in ref["params"].items()}
        assert min(moved.values()) > 0, "the reference's updates must move every parameter"
        bad = {n: d for n, p in ref["params"].items() if not (d := max_rel_diff(out["params"][n], p)) <= RTOL}
        assert not bad, f"parameters after {steps - 1} updates differ: {bad}"


SAVE_AT_3 = ["train.iters=6", "train.save_interval=3", "checkpoint.keep=0"]


def test_a_cp2_checkpoint_resumes_at_cp1_and_back(tmp_path):
    """Context parallelism shards no weight: a checkpoint crosses CP sizes with the optimizer state, and the
    resumed losses equal the uninterrupted run's (the two layouts compute the same model: 1e-5)."""
    runs = {}
    for cp, world in ((1, 1), (2, 2)):
        runs[cp] = train(SAVE_AT_3 + [f"parallel.cp={cp}"], world, tmp_path / f"cp{cp}")
        run = json.loads((tmp_path / f"cp{cp}" / "checkpoints" / "iter_0000003" / "run.json").read_text())
        assert run["layout"]["cp"] == cp
    assert runs[2] == pytest.approx(runs[1], rel=RTOL)
    for saved, resumed, world in ((2, 1, 1), (1, 2, 2)):
        losses = train(SAVE_AT_3 + [f"parallel.cp={resumed}",
                                    f"checkpoint.load={tmp_path}/cp{saved}/checkpoints/iter_0000003"],
                       world, tmp_path / f"cp{saved}-to-cp{resumed}")
        assert sorted(losses) == [4, 5, 6]
        assert losses == pytest.approx({i: runs[saved][i] for i in losses}, rel=RTOL), (saved, resumed)
