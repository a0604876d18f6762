"""The same seed gives the same model, and the whole training step, at every layout.

Every case starts from its own initialisation (no weights are loaded: training/engine/init.py draws each
weight by name) and runs 3 full steps (forward, backward, gradient reduction, clipping, the optimizer and the
schedule) and a 4th forward/backward, with clipping active (the global norm is above optim.clip_grad every
step) and Adam's eps raised so that the update stays proportional to the gradient (a gradient off by a factor
would otherwise be normalised away). Compared with one process, max|diff| / max|ref| per tensor: the initial
weights (exactly), the losses and grad norms of every step, the weights after 3 updates, the last gradients.
"""

import pytest
from layouts import make_batch, max_rel_diff, model_overrides, run_layouts
from model_options import DEEPSEEK_ROUTER, MLA_OPTIONS

RTOL = 1e-5
# the weights after 3 updates and the last gradients: TP/PP sum partial products in another order, and on an
# AVX-512 machine's kernels that shows up to 1.41e-5 of a tensor's scale (tp2: the embedding's gradient; 1e-5 held
# elsewhere): a wrong reduction or a missed gradient is off by far more
TENSOR_RTOL = 3e-5
STEPS = 4  # 3 updates, then the gradients of a 4th step
WHOLE_STEP = ["optim.clip_grad=0.05", "optim.adam_eps=1e-4", "optim.lr=1e-2", "optim.warmup_iters=0",
              "optim.weight_decay=0.1"]
MOE = ["model.moe.num_experts=4", "model.moe.top_k=2", "model.moe.dispatcher=alltoall"]
# issue 42's options all on (Gemma 2/3, gpt-oss, Phi): a window of 6 < seq 16 on sliding layers only (their own
# RoPE base), soft-caps, Gemma's softmax scale, sinks, (1 + w) sandwich norms, the scaled embedding, GeGLU-tanh,
# half the head rotated with YaRN (original context 8 < 16)
OPTIONS = ["model.sliding_window=6", "model.layer_types=[sliding,full,sliding,full]", "model.rotary_base_local=1000",
           "model.attn_logit_softcap=3.0", "model.final_logit_softcap=5.0", "model.query_pre_attn_scalar=8",
           "model.attention_sinks=true", "model.norm_zero_centered=true", "model.norm_placement=sandwich",
           "model.scale_embedding=true", "model.activation=geglu_tanh", "model.partial_rotary_factor=0.5",
           "model.rope_scaling.type=yarn", "model.rope_scaling.factor=4", "model.rope_scaling.original_max_position=8"]
# gpt-oss's (issue 45): biases on attention, the router and the experts, the clamped SwiGLU (its limit biting),
# sinks, a window on alternate layers
GPT_OSS = [*MOE, "model.add_bias_linear=true", "model.activation=clamped_swiglu", "model.swiglu_limit=0.1",
           "model.attention_sinks=true", "model.sliding_window=6", "model.layer_types=[sliding,full,sliding,full]"]
# DeepSeek-V3's: multi-latent attention, a dense first layer, then its router (sigmoid, groups, the expert bias
# updated from the load every step, scaling) with a shared expert
DEEPSEEK = [*MOE, *MLA_OPTIONS, *DEEPSEEK_ROUTER, "model.moe.first_dense=1"]
MODELS = {"dense": WHOLE_STEP, "moe": [*WHOLE_STEP, *MOE], "options": [*WHOLE_STEP, *OPTIONS],
          "gpt_oss": [*WHOLE_STEP, *GPT_OSS], "deepseek": [*WHOLE_STEP, *DEEPSEEK]}
# case -> (model, layout overrides, processes)
CASES = {
    "tp2": ("dense", ["parallel.tp=2"], 2),
    "pp2": ("dense", ["parallel.pp=2"], 2),
    "cp2": ("dense", ["parallel.cp=2"], 2),
    "dp2-distopt": ("dense", ["train.micro_batch_size=1", "parallel.dist_opt=true",
                              "parallel.overlap_grad_reduce=true"], 2),
    "dp2-zero3": ("dense", ["parallel.fsdp=optim_grads_params"], 2),
    "ep2": ("moe", ["parallel.ep=2"], 2),
    "tp2-pp2-vpp2": ("dense", ["parallel.tp=2", "parallel.pp=2", "parallel.vpp=2", "train.micro_batch_size=1"], 4),
    # minimal TP: only the MLP split (attention and the tied vocabulary whole on both TP ranks: grad norm, clipping)
    "tp2-mlp": ("dense", ["parallel.tp=2", "parallel.tp_blocks=[mlp]"], 2),
    "tp2-mlp-pp2": ("dense", ["parallel.tp=2", "parallel.tp_blocks=[mlp]", "parallel.pp=2",
                              "train.micro_batch_size=1"], 4),
    "options-tp2": ("options", ["parallel.tp=2"], 2),
    "options-pp2": ("options", ["parallel.pp=2"], 2),
    "options-cp2": ("options", ["parallel.cp=2"], 2),
    "gpt-oss-ep2-distopt": ("gpt_oss", ["parallel.ep=2", "parallel.dist_opt=true"], 2),
    "gpt-oss-tp2-sp-ep2": ("gpt_oss", ["parallel.tp=2", "parallel.sp=true", "parallel.ep=2"], 2),
    "gpt-oss-pp2": ("gpt_oss", ["parallel.pp=2"], 2),
    "deepseek-ep2-distopt": ("deepseek", ["parallel.ep=2", "parallel.dist_opt=true"], 2),
    "deepseek-tp2-sp-ep2": ("deepseek", ["parallel.tp=2", "parallel.sp=true", "parallel.ep=2"], 2),
    "deepseek-pp2": ("deepseek", ["parallel.pp=2"], 2),
}
BATCH = make_batch(global_batch=4, seq=16)


@pytest.fixture(scope="module")
def runs():
    refs = dict(zip(MODELS, run_layouts([(model_overrides(*o), None, STEPS, False) for o in MODELS.values()], 1,
                                        BATCH)))
    cases = {}
    for world in sorted({w for _, _, w in CASES.values()}):
        names = [n for n, (_, _, w) in CASES.items() if w == world]
        specs = [(model_overrides(*MODELS[CASES[n][0]], *CASES[n][1]), None, STEPS, False) for n in names]
        cases.update(zip(names, run_layouts(specs, world, BATCH)))
    return refs, cases


@pytest.mark.slow
@pytest.mark.parametrize("case", list(CASES))
def test_fresh_layout_trains_the_single_process_model(case, runs):
    refs, cases = runs
    ref, out = refs[CASES[case][0]], cases[case]
    for result in (ref, out):
        if isinstance(result, Exception):
            raise result
    assert all(norm > 0.05 for norm in ref["grad_norms"]), f"clipping must be active: {ref['grad_norms']}"
    bad_init = [n for n, w in ref["params_before"].items() if max_rel_diff(out["params_before"][n], w) != 0]
    assert not bad_init, f"initial weights differ from one process's (same seed): {bad_init}"
    assert out["losses"] == pytest.approx(ref["losses"], rel=RTOL)
    assert out["grad_norms"] == pytest.approx(ref["grad_norms"], rel=RTOL)
    moved = {n: max_rel_diff(w, ref["params_before"][n]) for n, w in ref["params"].items()}
    # (MLA's latent norms, no weight decay on norms, move least: 9.5e-5 of their scale in 3 steps)
    assert min(moved.values()) > 5e-5, f"every weight must have moved: {min(moved, key=moved.get)}"
    bad = {n: d for n, w in ref["params"].items() if (d := max_rel_diff(out["params"][n], w)) > TENSOR_RTOL}
    assert not bad, f"weights after the updates differ: {bad}"
    if out["grads"]:  # the distributed optimizer keeps only its shard of the gradients
        bad = {n: d for n, g in ref["grads"].items() if (d := max_rel_diff(out["grads"][n], g)) > TENSOR_RTOL}
        assert not bad, f"gradients of the last step differ: {bad}"
