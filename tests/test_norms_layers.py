"""Norms and layer shapes of Gemma 2/3 and OLMo 2 (docs/blocks.md): each option against transformers' own modules,
and the TP-sensitive ones at tp2 and tp2+sp against one process.

- model.norm_zero_centered: (1 + weight) RMSNorm = Gemma2RMSNorm (fp32 and bf16), the weight starting at 0;
- model.scale_embedding: the embedding times sqrt(h) rounded to its dtype = Gemma2TextScaledWordEmbedding (bf16);
- model.norm_placement=sandwich + geglu_tanh + zero-centred: one layer = Gemma2DecoderLayer, output and gradients;
- model.norm_placement=post + qk_norm_span=projection: one layer = Olmo2DecoderLayer (q_norm over np*hn);
- both models through the engine at tp2 and tp2+sp = one process (loss, logits, every gradient), from weights
  whose every norm weight is random (the QK-norm's statistics span both ranks' heads).
"""

from __future__ import annotations

import pytest
import torch
from harness import run_distributed
from layouts import make_batch, max_rel_diff, model_overrides, run_layouts

from training.config.compose import compose

RTOL = 1e-5
S, B = 16, 2
# the layer tests' model: h 64, 4 heads in 2 groups of 16, ffn 96 (one layer, built directly)
LAYER = ["model.hidden_size=64", "model.num_attention_heads=4", "model.num_query_groups=2", "model.kv_channels=16",
         "model.ffn_hidden_size=96", "model.norm_epsilon=1e-6", f"model.seq_length={S}", "model.vocab_size=101",
         "model.fused_kernels=false"]
GEMMA = ["model.norm_placement=sandwich", "model.norm_zero_centered=true", "model.activation=geglu_tanh"]
OLMO2 = ["model.norm_placement=post", "model.qk_norm=true", "model.qk_norm_span=projection"]
# the layout models (tests/layouts.py's small GPT): Gemma 2/3's options, with Gemma 3's per-head QK-norm; OLMo 2's
MODELS = {"gemma": [*GEMMA, "model.scale_embedding=true", "model.qk_norm=true"], "olmo2": OLMO2}
LAYOUTS = {"tp2": ["parallel.tp=2"], "tp2-sp": ["parallel.tp=2", "parallel.sp=true"]}
BATCH = make_batch(global_batch=4, seq=16)


def _config(overrides: list[str], precision: str = "fp32"):
    from models.shape import ModelShape
    from training.engine.bridge import transformer_config

    cfg = compose([*LAYER, *overrides, f"train.precision={precision}"])
    shape = ModelShape.of(cfg.model)
    return transformer_config(cfg, shape), shape


@pytest.mark.fast
def test_zero_centered_rmsnorm_is_gemmas(one_process):
    """(1 + w) over the HF weight as stored, fp32 and bf16 (rounded once, as Gemma2RMSNorm); the weight starts at
    0, so a fresh zero-centred norm is a plain RMSNorm."""
    from transformers.models.gemma2.modeling_gemma2 import Gemma2RMSNorm

    from models.norm import Norm

    for dtype, tol in ((torch.float32, RTOL), (torch.bfloat16, 0.0)):
        config, _ = _config(["model.norm_zero_centered=true"], "bf16" if dtype == torch.bfloat16 else "fp32")
        ours, theirs = Norm(config), Gemma2RMSNorm(64, eps=1e-6)
        assert torch.equal(ours.weight, torch.zeros(64, dtype=dtype))  # zero-centred: starts at 0
        with torch.no_grad():
            theirs.weight.copy_(torch.randn(64) * 0.5)
            ours.weight.copy_(theirs.weight)
        theirs.to(dtype)
        x = torch.randn(S, B, 64, dtype=dtype, requires_grad=True)
        out, ref = ours(x), theirs(x)
        assert max_rel_diff(out.float(), ref.float()) <= tol, dtype
        if dtype == torch.float32:
            grad = torch.randn_like(out)
            mine = torch.autograd.grad(out, [x, ours.weight], grad)
            hf = torch.autograd.grad(ref, [x, theirs.weight], grad)
            assert all(max_rel_diff(a, b) <= RTOL for a, b in zip(mine, hf))


@pytest.mark.fast
def test_embedding_scale_in_the_checkpoints_dtype(one_process):
    """bf16: sqrt(128) rounds to 11.3125; transformers multiplies by that, not by 11.3137: bit for bit."""
    from transformers.models.gemma2.modeling_gemma2 import Gemma2TextScaledWordEmbedding

    from models.embedding import Embedding

    config, _ = _config(["model.scale_embedding=true", "model.hidden_size=128", "model.kv_channels=32"], "bf16")
    ours = Embedding(config, 128, S, learned_positions=False)
    theirs = Gemma2TextScaledWordEmbedding(128, 128, padding_idx=0, embed_scale=128**0.5).to(torch.bfloat16)
    with torch.no_grad():
        ours.word_embeddings.weight.copy_(torch.randn(128, 128))
        theirs.weight.copy_(ours.word_embeddings.weight)
    tokens = torch.randint(0, 128, (B, S))
    assert torch.equal(ours(tokens), theirs(tokens).transpose(0, 1))  # [s, b, h]


def _hf_layer(kind: str):
    """transformers' decoder layer (eager attention), every weight random (norms too), its RoPE (cos, sin)."""
    if kind == "gemma":
        from transformers import Gemma2Config as Config
        from transformers.models.gemma2.modeling_gemma2 import Gemma2DecoderLayer as Layer
        from transformers.models.gemma2.modeling_gemma2 import Gemma2RotaryEmbedding as Rope
        extra = dict(query_pre_attn_scalar=16, attn_logit_softcapping=None, final_logit_softcapping=None,
                     sliding_window=4096, hidden_activation="gelu_pytorch_tanh")
    else:
        from transformers import Olmo2Config as Config
        from transformers.models.olmo2.modeling_olmo2 import Olmo2DecoderLayer as Layer
        from transformers.models.olmo2.modeling_olmo2 import Olmo2RotaryEmbedding as Rope
        extra = {}
    config = Config(vocab_size=101, hidden_size=64, intermediate_size=96, num_hidden_layers=1, num_attention_heads=4,
                    num_key_value_heads=2, head_dim=16, rms_norm_eps=1e-6, attention_bias=False, **extra)
    config._attn_implementation = "eager"
    layer = Layer(config, 0)
    g = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for name, p in layer.named_parameters():  # Gemma stores w of (1 + w); OLMo 2 the weight itself
            base = 1.0 if p.dim() == 1 and kind == "olmo2" else 0.0
            p.copy_(base + torch.randn(p.shape, generator=g) * (0.3 if p.dim() == 1 else 0.1))
    positions = torch.arange(S)[None].expand(B, S)
    cos_sin = Rope(config)(torch.zeros(B, S, 64), positions)
    return layer, cos_sin, config.rope_parameters["rope_theta"]


def _qk_norm_names(shape) -> tuple[tuple[str, str], ...]:
    """The projection QK-norm's weights: not in attention.py's HF mapping yet (it maps the per-head one)."""
    return (("self_attention.q_layernorm.weight", "self_attn.q_norm.weight"),
            ("self_attention.k_layernorm.weight", "self_attn.k_norm.weight")) if shape.qk_norm_span == "projection" \
        else ()


@pytest.mark.fast
@pytest.mark.parametrize("kind", ["gemma", "olmo2"])
def test_layer_matches_transformers(kind, one_process):
    """Our TransformerLayer with Gemma 2's sandwich norms, zero-centred, GeGLU-tanh (or OLMo 2's post-norms and
    whole-projection QK-norm) = transformers' decoder layer from the same weights: output, input gradient and
    every weight's gradient (ours mapped to HF's names by the blocks' own to_hf)."""
    from megatron.core.models.common.embeddings.rotary_pos_embedding import RotaryEmbedding

    from models.layer import TransformerLayer, hf_names
    from models.spec import layer_spec

    hf, cos_sin, theta = _hf_layer(kind)
    config, shape = _config([*(GEMMA if kind == "gemma" else OLMO2), f"model.rotary_base={theta}"])
    ours = TransformerLayer(config, shape, 1)
    names, spec = hf_names(shape), layer_spec(shape, 1)
    hf_state = hf.state_dict()
    ours_state = {}
    for name, block in spec.items():
        mapped = block.from_hf(lambda n, name=name: hf_state[f"{names[name]}.{n}"], config)
        ours_state.update({f"{name}.{n}": t for n, t in mapped.items()})
    ours_state.update({o: hf_state[h] for o, h in _qk_norm_names(shape)})
    ours.load_state_dict(ours_state, strict=True)

    x = torch.randn(B, S, 64, requires_grad=True)  # HF's [b, s, h]
    mask = torch.full((S, S), float("-inf")).triu(1)[None, None]  # causal, additive
    ref = hf(x, position_embeddings=cos_sin, attention_mask=mask)
    freqs = RotaryEmbedding(16, rotary_percent=1.0, rotary_base=theta, use_cpu_initialization=True)(S)
    out = ours(x.transpose(0, 1), freqs).transpose(0, 1)
    assert max_rel_diff(out, ref) <= RTOL

    grad = torch.randn_like(ref)
    hf_params = dict(hf.named_parameters())
    ref_grads = torch.autograd.grad(ref, [x, *hf_params.values()], grad)
    our_params = dict(ours.named_parameters())
    our_grads = torch.autograd.grad(out, [x, *our_params.values()], grad)
    assert max_rel_diff(our_grads[0], ref_grads[0]) <= RTOL
    ours_by_name, hf_by_name = dict(zip(our_params, our_grads[1:])), dict(zip(hf_params, ref_grads[1:]))
    mapped = {h: ours_by_name[o] for o, h in _qk_norm_names(shape)}
    for name, block in spec.items():
        grads = block.to_hf(lambda n, name=name: ours_by_name[f"{name}.{n}"], config)
        mapped.update({f"{names[name]}.{n}": t for n, t in grads.items()})
    assert set(mapped) == set(hf_by_name)
    bad = {n: max_rel_diff(mapped[n], g) for n, g in hf_by_name.items() if not max_rel_diff(mapped[n], g) <= RTOL}
    assert not bad, bad


@pytest.mark.fast
def test_projection_qk_norm_needs_rmsnorm_and_qk_norm():
    from training.config.validate import validate
    from training.errors import ConfigError

    for extra, says in ((["model.qk_norm_span=projection"], "model.qk_norm=true"),
                        ([*OLMO2, "model.normalization=LayerNorm"], "model.normalization=RMSNorm")):
        with pytest.raises(ConfigError, match=says):
            validate(compose(extra), 1)


# ---- tp2 and tp2+sp against one process, through the engine (tests/layouts.py) ------------------------------

def _references(models: dict) -> dict:
    """World 1: each model from its own init (its norm weights: 0 zero-centred, else 1), then from those weights
    with every 1-D weight (the norms) randomised: the reference (loss, logits, gradients) and its weights."""
    from layouts import _gather, _one_layout

    from training.parallel import dist as D

    out = {}
    try:
        for name, overrides in models.items():
            init = _gather([_one_layout(overrides, None, BATCH, 1, False)])["params"]
            g = torch.Generator().manual_seed(1)
            weights = {n: p + 0.3 * torch.randn(p.shape, generator=g) if p.dim() == 1 else p for n, p in init.items()}
            out[name] = (init, weights, _gather([_one_layout(overrides, weights, BATCH, 1, True)]))
    finally:
        D.teardown()
    return out


@pytest.fixture(scope="module")
def layouts():
    """The references (one process), then every (model, layout) case in one 2-process group."""
    (refs,) = run_distributed(_references, 1, ({m: model_overrides(*o) for m, o in MODELS.items()},), timeout=300)
    names = [(m, lay) for m in MODELS for lay in LAYOUTS]
    specs = [(model_overrides(*MODELS[m], *LAYOUTS[lay]), refs[m][1], 1, True) for m, lay in names]
    return refs, dict(zip(names, run_layouts(specs, 2, BATCH)))


def test_norms_start_as_their_constants(layouts):
    refs, _ = layouts
    for model, start in (("gemma", 0.0), ("olmo2", 1.0)):
        norms = {n: p for n, p in refs[model][0].items() if "layernorm" in n}
        assert any("q_layernorm" in n for n in norms) and any("post_mlp_layernorm" in n for n in norms)
        assert all(torch.equal(p, torch.full_like(p, start)) for p in norms.values()), model


@pytest.mark.parametrize("model", list(MODELS))
@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_layout_matches_single_process(model, layout, layouts):
    refs, cases = layouts
    ref, out = refs[model][2], cases[(model, layout)]
    if isinstance(out, Exception):
        raise out
    assert out["losses"][0] == pytest.approx(ref["losses"][0], rel=RTOL)
    for built, estimated in out["counts"]:  # every rank's parameters = the estimate's (the QK-norm split)
        assert built == estimated, out["counts"]
    assert max_rel_diff(out["logits"], ref["logits"]) <= RTOL
    assert set(out["grads"]) == set(ref["grads"])
    bad = {n: max_rel_diff(out["grads"][n], g) for n, g in ref["grads"].items()
           if not max_rel_diff(out["grads"][n], g) <= RTOL}
    assert not bad, f"gradients differ from one process: {bad}"
    for name, grad in ref["grads"].items():
        assert grad.abs().max() > 0, f"reference gradient of {name} is zero: the comparison would be empty"
