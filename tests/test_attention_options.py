"""The attention options (models/core_attention.py): a sliding window per layer, attention-logit and final-logit
soft-capping, a softmax scale other than 1/sqrt(hn), learned attention sinks.

- The core against transformers' own code: the window's mask from `masking_utils` (causal and
  `sliding_window_overlay`) at seq = window - 1, window, window + 1; Gemma 2's and gpt-oss's
  `eager_attention_forward` for soft-capping + scale and for sinks: outputs and gradients.
- The GPT with every option (sliding and full layers, window 6 < seq 16) at tp2, tp2+sp, cp2 and tp2 with
  selective / full recomputation against one process (tests/layouts.py): loss, logits, every gradient.
- One process: KV-cache decoding past the window equals a full forward at every step; packed sequences on a
  windowed model equal each sequence run alone (block-diagonal and the band).
(Generation past the window equal to transformers' Mistral generate(): tests/test_convert_hf_window.py.)
"""

from types import SimpleNamespace

import pytest
import torch
from harness import run_distributed
from layouts import make_batch, max_rel_diff, model_overrides, run_layouts

RTOL = 1e-5
W = 5  # the core tests' window


def _core(window=None, softcap=None, scalar=None, sinks=False, heads=4, groups=2, layer=1, pattern=None):
    from megatron.core.transformer.transformer_config import TransformerConfig

    from models.core_attention import CoreAttention

    config = TransformerConfig(num_layers=2, hidden_size=64, num_attention_heads=heads, num_query_groups=groups,
                               attention_dropout=0.0, window_size=(window - 1, 0) if window else None,
                               window_attn_skip_freq=pattern, softmax_scale=scalar ** -0.5 if scalar else None,
                               softmax_type="learnable" if sinks else "vanilla")
    config.attn_logit_softcap = softcap
    core = CoreAttention(config, layer).eval()
    if sinks:
        with torch.no_grad():
            core.softmax_offset.copy_(torch.tensor([0.5, -1.0, 2.0, 0.0][:heads]))
    return core


def _qkv(s, b=2, heads=4, groups=2, hn=16, seed=0):
    g = torch.Generator().manual_seed(seed)
    return [(torch.randn(s, b, n, hn, generator=g) * 2).requires_grad_() for n in (heads, groups, groups)]


def _hf_mask(s: int, window: int | None) -> torch.Tensor:
    """[1, 1, s, s] additive mask from transformers' own mask functions (the oracle for the window)."""
    from transformers.masking_utils import and_masks, causal_mask_function, sliding_window_overlay

    fn = and_masks(causal_mask_function, sliding_window_overlay(window)) if window else causal_mask_function
    ok = fn(0, 0, torch.arange(s)[:, None], torch.arange(s)[None, :])
    return torch.zeros(s, s).masked_fill(~ok, float("-inf"))[None, None]


def _hf(eager, q, k, v, mask, **options):
    """transformers' eager attention on our [s, b, heads, hn] tensors -> [s, b, heads * hn]."""
    module = SimpleNamespace(head_dim=q.shape[-1], num_key_value_groups=q.shape[2] // k.shape[2], training=False,
                             sinks=options.pop("sinks", None))
    out, _ = eager(module, *(t.permute(1, 2, 0, 3) for t in (q, k, v)), mask, **options)  # [b, s, heads, hn]
    return out.transpose(0, 1).flatten(2)


def _grads(out, inputs, seed=1):
    g = torch.randn(out.shape, generator=torch.Generator().manual_seed(seed))
    return torch.autograd.grad(out, inputs, g)


@pytest.mark.fast
def test_window_is_transformers_sliding_window_at_window_minus_one_window_and_past_it():
    from transformers.models.llama.modeling_llama import eager_attention_forward

    core, full = _core(window=W), _core()
    for s in (W - 1, W, W + 1, 3 * W):
        q, k, v = _qkv(s)
        ours = core(q, k, v)
        hf = _hf(eager_attention_forward, q, k, v, _hf_mask(s, W), scaling=q.shape[-1] ** -0.5)
        assert max_rel_diff(ours, hf) <= RTOL, s
        for a, b in zip(_grads(ours, (q, k, v)), _grads(hf, (q, k, v))):
            assert max_rel_diff(a, b) <= RTOL, s
        plain = full(q, k, v)
        # up to the window a windowed layer is a causal one; from position `window` on it sees less
        assert max_rel_diff(ours[:W], plain[:W]) <= RTOL
        assert s <= W or max_rel_diff(ours[W:], plain[W:]) > 1e-2, s


@pytest.mark.fast
def test_window_follows_the_layer_pattern():
    assert (_core(window=W, pattern=[1, 0], layer=1).window, _core(window=W, pattern=[1, 0], layer=2).window) == (W, None)


@pytest.mark.fast
def test_softcap_and_scale_are_gemma2_eager_attention():
    from transformers.models.gemma2.modeling_gemma2 import eager_attention_forward

    s, cap, scalar = 2 * W, 2.0, 7.0  # a small cap: the tanh bends the scores (|q.k| * scale reaches ~10)
    q, k, v = _qkv(s)
    for window in (None, W):
        ours = _core(window=window, softcap=cap, scalar=scalar)(q, k, v)
        hf = _hf(eager_attention_forward, q, k, v, _hf_mask(s, window), scaling=scalar ** -0.5, softcap=cap)
        assert max_rel_diff(ours, hf) <= RTOL, window
        for a, b in zip(_grads(ours, (q, k, v)), _grads(hf, (q, k, v))):
            assert max_rel_diff(a, b) <= RTOL, window
    uncapped = _core(window=W, scalar=scalar)(q, k, v)  # SDPA's path: the cap must matter here
    assert max_rel_diff(uncapped, _core(window=W, softcap=cap, scalar=scalar)(q, k, v)) > 1e-2


@pytest.mark.fast
def test_sinks_are_gpt_oss_eager_attention():
    from transformers.models.gpt_oss.modeling_gpt_oss import eager_attention_forward

    s = 2 * W
    q, k, v = _qkv(s)
    for window in (None, W):
        core = _core(window=window, sinks=True)
        sinks = core.softmax_offset.detach().clone().requires_grad_()
        ours = core(q, k, v)
        hf = _hf(eager_attention_forward, q, k, v, _hf_mask(s, window), scaling=q.shape[-1] ** -0.5, sinks=sinks)
        assert max_rel_diff(ours, hf) <= RTOL, window
        for a, b in zip(_grads(ours, (q, k, v, core.softmax_offset)), _grads(hf, (q, k, v, sinks))):
            assert max_rel_diff(a, b) <= RTOL, window
    assert max_rel_diff(ours, _core(window=W)(q, k, v)) > 1e-2  # the sinks take probability mass


@pytest.mark.fast
def test_packed_sequences_see_their_own_window():
    """Two packed segments (6 and 9 tokens) on a windowed core equal each segment alone."""
    from models.core_attention import packed_mask

    core = _core(window=W, softcap=3.0, sinks=True)
    q, k, v = _qkv(15)
    segments = torch.tensor([[1] * 6 + [2] * 9] * 2)  # [b, s]
    packed = core(q, k, v, mask=packed_mask(segments, q.dtype))
    alone = torch.cat([core(q[a:e], k[a:e], v[a:e]) for a, e in ((0, 6), (6, 15))])
    assert max_rel_diff(packed, alone) <= RTOL


# ---- the GPT with every option: layouts against one process; KV cache and packing in one process ---------
OPTIONS = ["model.sliding_window=6", "model.layer_types=[sliding,full,sliding,full]", "model.attention_sinks=true",
           "model.attn_logit_softcap=3.0", "model.final_logit_softcap=5.0", "model.query_pre_attn_scalar=8"]
CASES = {
    "tp2": ["parallel.tp=2"],
    "tp2-sp": ["parallel.tp=2", "parallel.sp=true"],
    "cp2": ["parallel.cp=2"],
    "tp2-recompute-selective": ["parallel.tp=2", "model.recompute=selective"],
    "tp2-recompute-full": ["parallel.tp=2", "model.recompute=full"],
}
BATCH = make_batch(global_batch=4, seq=16)


@pytest.fixture(scope="module")
def layouts():
    (ref,) = run_layouts([(model_overrides(*OPTIONS), None, 1, True)], 1, BATCH)
    if isinstance(ref, Exception):
        raise ref
    specs = [(model_overrides(*OPTIONS, *extra), ref["params"], 1, True) for extra in CASES.values()]
    return ref, dict(zip(CASES, run_layouts(specs, 2, BATCH)))


@pytest.mark.parametrize("case", list(CASES))
def test_options_at_a_layout_equal_one_process(case, layouts):
    ref, cases = layouts
    out = cases[case]
    if isinstance(out, Exception):
        raise out
    assert out["losses"][0] == pytest.approx(ref["losses"][0], rel=RTOL)
    for built, estimated in out["counts"]:
        assert built == estimated, out["counts"]
    assert max_rel_diff(out["logits"], ref["logits"]) <= RTOL
    assert ref["logits"].abs().max() < 5.0  # the final soft-cap bounds every logit
    assert any("softmax_offset" in name for name in ref["grads"]), "the sinks are parameters"
    bad = {name: d for name, g in ref["grads"].items() if not (d := max_rel_diff(out["grads"][name], g)) <= RTOL}
    assert not bad, bad
    assert all(g.abs().max() > 0 for g in ref["grads"].values())


def _one_process_checks() -> dict:
    """KV-cache decoding past the window vs a full forward at each step; packed vs each sequence alone."""
    from models.kv_cache import KVCache
    from models.shape import ModelShape
    from training.config.compose import compose
    from training.engine.build import build
    from training.interop.generation import last_logits
    from training.parallel import dist as D

    out = {}
    with D.distributed(timeout_minutes=2) as info:
        cfg = compose(model_overrides(*OPTIONS, "model.seq_length=32"))
        state = build(cfg, ModelShape.of(cfg.model, 101), info.device, train=False)
        gpt = state.model[0].eval()
        g = torch.Generator().manual_seed(0)
        prompts = [torch.randint(0, 101, (n,), generator=g).tolist() for n in (4, 9)]  # left-padded to 9
        pad = torch.tensor([5, 0])
        tokens = torch.tensor([[0] * 5 + prompts[0], prompts[1]])
        cache, step_input, steps = KVCache(9 + 12, pad), tokens, []
        for _ in range(12):  # up to position 20: 3x past the window of 6
            cached = last_logits(state, step_input, cache, 2)
            with torch.no_grad():  # each sequence alone, without padding or cache: the training path's masks
                full = torch.cat([gpt(tokens[i:i + 1, int(pad[i]):])[:, -1].float() for i in range(2)])
            steps.append((cached, full))
            picked = torch.randint(0, 101, (2,), generator=g)  # any continuation
            tokens, step_input = torch.cat([tokens, picked[:, None]], dim=1), picked[:, None]
        out["cache"] = steps
        text = torch.randint(0, 101, (1, 20), generator=g)
        with torch.no_grad():
            positions = torch.cat([torch.arange(8), torch.arange(12)])[None]
            segments = torch.tensor([[1] * 8 + [2] * 12])
            packed = gpt(text, position_ids=positions, segment_ids=segments)  # [1, 20, V]
            alone = torch.cat([gpt(text[:, :8]), gpt(text[:, 8:])], dim=1)
        out["packed"] = (packed, alone)
    return out


@pytest.fixture(scope="module")
def one_process():
    (result,) = run_distributed(_one_process_checks, 1, timeout=300)
    return result


def test_kv_cache_decoding_past_the_window_equals_a_full_forward(one_process):
    for step, (cached, full) in enumerate(one_process["cache"]):
        real = torch.isfinite(full)
        assert torch.equal(real, torch.isfinite(cached))
        assert max_rel_diff(cached[real], full[real]) <= RTOL, step


def test_packed_sequences_on_a_windowed_model_equal_each_alone(one_process):
    packed, alone = one_process["packed"]
    real = torch.isfinite(alone)
    assert max_rel_diff(packed[real], alone[real]) <= RTOL
