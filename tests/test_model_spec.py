"""The model's seam: every preset's shape, parameter count and FLOPs against the built model and Megatron's
formula; blocks named by the config (models/spec.py); the named extra losses' gradient and reported value
against the objective models/extra_losses.py states. (Layouts: tests/test_model_parallel_equivalence.py.)"""

from __future__ import annotations

import pytest
import torch
from harness import run_distributed

from training.config.compose import CONF_DIR, compose

PRESETS = sorted(p.stem for p in (CONF_DIR / "model").glob("*.yaml"))
# every preset, and two with the README's example block (gated_mlp: with and without biases)
BUILDS = {name: [f"model={name}"] for name in PRESETS} | {
    "tiny+gated_mlp": ["model=tiny", "model.mlp=gated_mlp"],
    "gpt2_124m+gated_mlp": ["model=gpt2_124m", "model.mlp=gated_mlp"],
    # Gemma 2/3's four norms a layer and per-head QK-norm; OLMo 2's two post-norms and whole-projection QK-norm
    "tiny+sandwich": ["model=tiny", "model.norm_placement=sandwich", "model.qk_norm=true"],
    "tiny+post": ["model=tiny", "model.norm_placement=post", "model.qk_norm=true", "model.qk_norm_span=projection"],
    # DeepSeek-V3's multi-latent attention: q low-rank with biases (attention_bias), a plain q projection
    "tiny+mla": ["model=tiny", "model.attention=mla", "model.mla.q_lora_rank=48", "model.add_bias_linear=true"],
    "tiny+mla-q-proj": ["model=tiny", "model.attention=mla"]}


def _built_counts(builds: dict) -> dict:
    """For each build: (the whole model's parameters, {block: (its parameters in layer 1, declared)}),
    built on the meta device (no memory, no init) in a world of one."""
    from models.gpt import num_params
    from models.shape import ModelShape, Split
    from models.spec import layer_spec
    from training.engine.build import build
    from training.parallel import dist as D
    from training.parallel.wrap import unwrap

    out = {}
    with D.distributed(timeout_minutes=2):
        for name, overrides in builds.items():
            cfg = compose(overrides)
            shape = ModelShape.of(cfg.model, cfg.model.vocab_size or 257)
            with torch.device("meta"):
                gpt = unwrap(build(cfg, shape, torch.device("meta"), init=False, train=False).model[0])
            layer = gpt.decoder.layers[0]
            blocks = {key: (sum(p.numel() for p in getattr(layer, key).parameters()), block.num_params(shape, Split()))
                      for key, block in layer_spec(shape, 1).items()}
            out[name] = (sum(p.numel() for p in gpt.parameters()), num_params(shape), blocks)
    return out


@pytest.mark.fast
def test_every_preset_has_exactly_the_parameters_the_estimate_counts():
    """models/gpt.py num_params (the memory estimate's and the planner's count, summed from each block's
    declaration) equals the built model's, for every preset in conf/model; and so does every block's own."""
    results = run_distributed(_built_counts, 1, (BUILDS,), timeout=300)[0]
    for name, (built, counted, blocks) in results.items():
        assert built == counted, (name, built, counted)
        for key, (block_built, declared) in blocks.items():
            assert block_built == declared, (name, key, block_built, declared)
    assert results["llama2_7b"][0] == 6_738_415_616  # Llama 2 7B's published count (vocab 32000: no padding)
    assert results["gpt2_124m"][0] == 124_475_904  # GPT-2 small, vocabulary padded to 50304
    assert results["mixtral_8x7b"][0] == 46_702_792_704  # Mixtral-8x7B's published count
    # transformers' models built from the published config.json on the meta device (a script, not this test)
    assert results["gemma3_1b"][0] == 999_885_952 and results["gemma3_4b"][0] == 3_880_263_168
    assert results["gemma3_12b"][0] == 11_766_034_176 and results["gemma3_27b"][0] == 27_009_346_304
    assert results["olmo2_7b"][0] == 7_298_617_344 and results["olmo2_13b"][0] == 13_716_198_400
    assert results["phi4"][0] == 14_659_507_200 and results["phi4_mini"][0] == 3_836_021_760
    assert results["mistral_7b_v0_1"][0] == 7_241_732_096
    assert results["llama3_1_70b"][0] == 70_553_706_496  # Llama 3.1 70B's published count
    # DeepSeek-V3's architecture (tests/test_hf_deepseek.py: transformers' meta-device count of the config.json)
    assert results["deepseek_v3"][0] == 671_026_404_352 and results["kimi_k2"][0] == 1_026_408_209_408
    assert results["moonlight_16b_a3b"][0] == 15_960_108_544


@pytest.mark.fast
@pytest.mark.parametrize("preset", PRESETS)
def test_flops_per_token_is_megatrons_formula(preset):
    """models/gpt.py flops_per_token equals Megatron-LM's `num_floating_point_operations` (training/training.py,
    transformer_flops: dense and MoE MLPs, GQA attention with the causal half, the logits over the padded
    vocabulary; 3 x forward), written out here independently. Megatron's formula has no sliding window: the
    windowed presets without it (the window's count: the test below)."""
    from models.gpt import flops_per_token
    from models.shape import ModelShape

    m = compose([f"model={preset}", "model.sliding_window=null", "model.layer_types=null"]).model
    shape = ModelShape.of(m, m.vocab_size or 257)
    h, s, L, V = m.hidden_size, m.seq_length, m.num_layers, shape.padded_vocab(1)
    heads = m.num_attention_heads
    groups, head_dim, ffn = m.num_query_groups or heads, m.kv_channels or h // heads, m.ffn_hidden_size or 4 * h
    ffn_gemms = 3 if m.activation in ("swiglu", "geglu_tanh", "clamped_swiglu") else 2  # gated: gate, up, down
    moe = m.moe
    moe_layers = 0 if not moe.num_experts else \
        sum(1 for i in range(L) if i >= moe.first_dense and (i - moe.first_dense) % moe.layer_freq == 0)
    routed = (moe.ffn_hidden_size or ffn) * moe.top_k + (moe.shared_expert_ffn_hidden_size or 0)
    q, kv = head_dim * heads, head_dim * groups
    attention = h * (q + 2 * kv) + q * s / 2 * 2 + q * h
    if m.attention == "mla":  # Megatron-LM's multi_latent_attention branch (its qk_head_dim: the part without RoPE)
        a = m.mla
        q_term = h * heads * (a.qk_nope_head_dim + a.qk_rope_head_dim) if a.q_lora_rank is None else \
            a.q_lora_rank * (h + heads * (a.qk_nope_head_dim + a.qk_rope_head_dim) + 1)
        attention = (q_term + a.kv_lora_rank * (h + heads * (a.qk_nope_head_dim + a.v_head_dim) + 1)
                     + h * a.qk_rope_head_dim + heads * a.v_head_dim * h
                     + s * heads * (a.qk_nope_head_dim + a.qk_rope_head_dim) / 2 + s * heads * a.v_head_dim / 2)
    megatron = 3 * 2 * (h * (ffn * ffn_gemms * (L - moe_layers) + routed * ffn_gemms * moe_layers)
                        + L * attention + h * V)
    assert flops_per_token(shape) == pytest.approx(megatron, rel=1e-12)
    if preset == "llama3_8b":  # and the closed form of older Megatron-LMs, for a dense model
        older = 12 * s * L * h * h * ((1 + groups / heads + s / h / 2) * (q / h) + ffn / h * 1.5 + V / (2 * L * h))
        assert flops_per_token(shape) * s == pytest.approx(older, rel=1e-12)


@pytest.mark.fast
def test_flops_count_min_window_position_keys_on_sliding_layers():
    """On a sliding layer the query at position p (1..s) sees min(window, p) keys, not p: a 2-layer model (sliding,
    full) with s = 8, window 3 keeps 1 + 2 + 3 x 6 = 21 of the 36 causal (query, key) pairs on its sliding layer,
    so its attention scores cost 21/36 of Megatron's s/2-keys count there; the full layer's are unchanged."""
    from models.gpt import flops_per_token
    from models.shape import ModelShape

    s, w, h, heads, groups, ffn, V = 8, 3, 64, 4, 2, 96, 128
    sizes = [f"model.seq_length={s}", f"model.hidden_size={h}", f"model.num_attention_heads={heads}",
             f"model.num_query_groups={groups}", f"model.ffn_hidden_size={ffn}", "model.num_layers=2",
             "model.kv_channels=null", "model.activation=swiglu", f"model.vocab_size={V}"]
    windowed = ModelShape.of(compose([*sizes, f"model.sliding_window={w}", "model.layer_types=[sliding,full]"]).model)
    kept = sum(1 for q in range(s) for k in range(s) if 0 <= q - k < w)  # counted, not from the formula
    causal = sum(1 for q in range(s) for k in range(s) if 0 <= q - k)
    assert (kept, causal) == (21, 36)
    q, kv = h, h // heads * groups
    layer = 2 * h * (q + 2 * kv) + 2 * q * h + 2 * h * ffn * 3  # projections and the gated MLP
    scores = [2 * 2 * q * s / 2 * kept / causal, 2 * 2 * q * s / 2]  # sliding, full
    assert flops_per_token(windowed) == pytest.approx(3 * (2 * layer + sum(scores) + 2 * h * V), rel=1e-12)
    wide = ModelShape.of(compose([*sizes, f"model.sliding_window={s}", "model.layer_types=[sliding,full]"]).model)
    assert flops_per_token(wide) == pytest.approx(3 * (2 * layer + 2 * scores[1] + 2 * h * V), rel=1e-12)


def test_shape_resolves_every_default_once():
    from models.shape import ModelShape

    gpt2 = ModelShape.of(compose(["model=gpt2_124m", "model.ffn_hidden_size=null"]).model)
    assert (gpt2.num_query_groups, gpt2.kv_channels, gpt2.ffn_hidden_size) == (12, 64, 4 * 768)  # MHA, h/n, 4h
    assert gpt2.padded_vocab(1) == 50_304 and gpt2.padded_vocab(8) == 51_200  # multiples of 128 * tp
    tiny = ModelShape.of(compose([]).model, 257)
    assert (tiny.heads_per_group, tiny.q_width, tiny.kv_width, tiny.gated) == (2, 128, 64, True)
    assert [b.mlp for b in tiny.layers] == ["mlp"] * 4
    assert ModelShape.config_fields("run") == ("seq_length", "make_vocab_size_divisible_by")


def _objective_vs_engine(overrides: list[str]) -> dict:
    """One process: the engine's gradient (Megatron-Core's schedule + finalize_model_grads) with
    PenalizedMLP's extra loss attached, and autograd's gradient of the objective written out by hand."""
    import blocks
    from layouts import VOCAB, make_batch

    from models.extra_losses import Stat
    from models.shape import ModelShape
    from training.config.validate import validate
    from training.data.streams import micro_batch_streams
    from training.engine.build import build
    from training.engine.losses import extra_losses
    from training.engine.step import run_schedule
    from training.parallel import dist as D
    from training.parallel.wrap import unwrap

    cfg = compose(overrides)
    derived = validate(cfg, 1)
    batch = make_batch(cfg.train.global_batch_size, cfg.model.seq_length)
    with D.distributed(timeout_minutes=2) as info:
        state = build(cfg, ModelShape.of(cfg.model, VOCAB), info.device)
        gpt = unwrap(state.model[0])
        run_schedule(state, micro_batch_streams(1, batch, 0, cfg.train.micro_batch_size), derived, cfg, False)
        engine = {n: p.main_grad.clone() for n, p in gpt.named_parameters()}
        stats = {blocks.PENALTY: Stat(2)}
        reported = extra_losses(stats, info.device)[blocks.PENALTY]

        # By hand: sum over micro-batches of (masked token-loss sum + coeff * n * sum over layers of L) / N,
        # N = the loss-token count of the global batch, n = the tokens of a micro-batch, L = mean(out^2).
        outputs = []
        hooks = [layer.mlp.register_forward_hook(lambda mod, inp, out: outputs.append(out[0]))
                 for layer in gpt.decoder.layers]
        coeff, blocks.PenalizedMLP.coeff = blocks.PenalizedMLP.coeff, 0.0  # no attached gradient this time
        tokens = torch.stack([s["tokens"] for s in batch])
        labels, mask = torch.stack([s["labels"] for s in batch]), torch.stack([s["loss_mask"] for s in batch])
        total_tokens, total, penalties = mask.sum(), 0.0, []
        for j in range(0, len(batch), cfg.train.micro_batch_size):
            part = slice(j, j + cfg.train.micro_batch_size)
            outputs.clear()
            token_losses = gpt(tokens[part], labels[part])  # [b, s]
            n = tokens[part].numel()
            layer_means = [out.float().pow(2).mean() for out in outputs]
            penalties += [float(v) for v in layer_means]
            total = total + ((token_losses * mask[part]).sum() + coeff * n * sum(layer_means)) / total_tokens
        params = dict(gpt.named_parameters())
        by_hand = dict(zip(params, torch.autograd.grad(total, list(params.values()))))
        blocks.PenalizedMLP.coeff = coeff
        for hook in hooks:
            hook.remove()
        extra_losses(stats, info.device)  # drop what the by-hand pass recorded
        return {"engine": engine, "by_hand": by_hand, "reported": reported,
                "expected_report": sum(penalties) / len(penalties)}


@pytest.mark.fast
def test_extra_loss_gradient_and_report_are_the_stated_objective():
    overrides = ["model.mlp=blocks:PenalizedMLP", "model.num_layers=2", "model.hidden_size=64",
                 "model.ffn_hidden_size=96", "model.seq_length=16", "model.vocab_size=101",
                 "train.micro_batch_size=2", "train.global_batch_size=4", "checkpoint=none"]
    r = run_distributed(_objective_vs_engine, 1, (overrides,), timeout=300)[0]
    for name, grad in r["by_hand"].items():
        diff = ((r["engine"][name] - grad).abs().max() / grad.abs().max()).item()
        assert diff <= 1e-5, (name, diff)
    # equal-size micro-batches: the token-weighted mean is the plain mean over micro-batches and layers
    assert r["reported"] == pytest.approx(r["expected_report"], rel=1e-6)
    penalty_grads = [n for n in r["by_hand"] if "mlp" in n]
    assert penalty_grads and all(r["by_hand"][n].abs().max() > 0 for n in penalty_grads)


@pytest.mark.fast
def test_readme_example_block_is_the_tested_file():
    """The README's add-a-block example is models/gated_mlp.py's code (which the equivalence test trains at
    tp2 and pp2 and the count test builds), line for line, in order."""
    from pathlib import Path

    root = Path(__file__).resolve().parents[1]
    readme = (root / "README.md").read_text()
    section = readme[readme.index("## The model, and adding or changing a block"):]
    example = section[section.index("```python\n") + 10:section.index("\n```", section.index("```python"))]
    source = (root / "models" / "gated_mlp.py").read_text()
    start = source.index(example.splitlines()[0])
    assert source[start:start + len(example)] == example
    assert compose(["model.mlp=gated_mlp"]).model.mlp == "gated_mlp"
