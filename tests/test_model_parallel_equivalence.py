"""Every parallel layout computes what one process computes.

Each case builds the GPT with the real engine at a layout (gloo processes), loads the single-process
reference's full weights into its shards, runs one forward/backward through Megatron-Core's schedule
on the same global batch, and compares the loss, the logits (PP=1) and every parameter's gradient
(gathered back to full shape) with the reference: fp32, max|diff| / max|ref| <= 1e-5 per tensor.

The vocabulary (101) is not divisible by any tp used here: the padded rows must change nothing.
"""

import pytest

from layouts import make_batch, max_rel_diff, run_layout, model_overrides

RTOL = 1e-5

# Model variants (each has its own single-process reference):
MODELS = {
    # GQA (4 heads / 2 groups), SwiGLU, RMSNorm, RoPE, tied embeddings, no biases
    "llama": [],
    # MHA, GELU, LayerNorm, learned positions, biases, untied output layer
    "gpt2": ["model.num_query_groups=null", "model.activation=gelu", "model.normalization=LayerNorm",
             "model.position_embedding=learned", "model.add_bias_linear=true", "model.tie_embeddings=false"],
    # hidden dropout on (attention dropout off: see test_dropout_rng_contract for why)
    "dropout": ["model.hidden_dropout=0.2"],
}

# (model, layout overrides, processes)
CASES = {
    "tp2": ("llama", ["parallel.tp=2"], 2),
    "tp2-sp": ("llama", ["parallel.tp=2", "parallel.sp=true"], 2),
    "pp2-tied": ("llama", ["parallel.pp=2"], 2),
    "pp2-vpp2": ("llama", ["parallel.pp=2", "parallel.vpp=2", "train.micro_batch_size=1"], 2),
    "tp2-pp2": ("llama", ["parallel.tp=2", "parallel.pp=2"], 4),
    "dp2-accumulate": ("llama", ["train.micro_batch_size=1"], 2),
    "tp2-recompute-full": ("llama", ["parallel.tp=2", "model.recompute=full"], 2),
    "tp2-sp-recompute-selective": ("llama", ["parallel.tp=2", "parallel.sp=true", "model.recompute=selective"], 2),
    "gpt2-tp2": ("gpt2", ["parallel.tp=2"], 2),
    "gpt2-pp2-untied": ("gpt2", ["parallel.pp=2"], 2),
    "dropout-tp2": ("dropout", ["parallel.tp=2"], 2),
    "dropout-tp2-recompute-full": ("dropout", ["parallel.tp=2", "model.recompute=full"], 2),
}

BATCH = make_batch(global_batch=4, seq=16)


@pytest.fixture(scope="module")
def references():
    cache = {}

    def get(model: str) -> dict:
        if model not in cache:
            cache[model] = run_layout(model_overrides(*MODELS[model]), 1, None, BATCH, want_logits=True)
        return cache[model]

    return get


@pytest.mark.parametrize("case", list(CASES))
def test_layout_matches_single_process(case, references):
    model, layout, world = CASES[case]
    ref = references(model)
    out = run_layout(model_overrides(*MODELS[model], *layout), world, ref["params"], BATCH, want_logits=True)

    assert out["losses"][0] == pytest.approx(ref["losses"][0], rel=RTOL)
    if "logits" in ref and "logits" in out:
        assert out["logits"].shape == ref["logits"].shape
        assert max_rel_diff(out["logits"], ref["logits"]) <= RTOL
    assert set(out["grads"]) == set(ref["grads"]), "the layout must hold exactly the reference's parameters"
    worst = {name: max_rel_diff(out["grads"][name], grad) for name, grad in ref["grads"].items()}
    bad = {name: diff for name, diff in worst.items() if not diff <= RTOL}
    assert not bad, f"gradients differ from the single-process reference: {bad}"
    for name, grad in ref["grads"].items():
        assert grad.abs().max() > 0, f"reference gradient of {name} is zero: the comparison would be empty"
