"""Options of a freshly built model (no import: the importers' tests hold HF's weights, under which some bugs
compute the same function as a fresh model) against plain PyTorch or the one-process model:

- model.activation=clamped_swiglu in a dense MLP (with biases) = gpt-oss's definition, at a limit (0.5) that clamps
  a large share of both the gate and the linear half: output and every gradient;
- RoPE scaling's attention factor (yarn: cos and sin times 0.1 ln(4) + 1) reaches a built model's attention: its
  first layer = plain attention with transformers' own cos, sin (its attention_scaling);
- Gemma's zero-centred final norm, its weight perturbed from its 0 start: the logits = (1 + w) RMSNorm then the
  output layer in plain PyTorch;
- attention sinks at tp2 from a fresh start: each rank's sinks are its heads' slice of the one-process model's.
"""

import pytest
import torch
from harness import run_distributed

pytest.importorskip("transformers")
RTOL = 1e-5
LIMIT = 0.5
SMALL = ["model.num_layers=2", "model.hidden_size=64", "model.num_attention_heads=4", "model.num_query_groups=2",
         "model.ffn_hidden_size=96", "model.seq_length=32", "checkpoint=none"]
YARN = ["model.rope_scaling.type=yarn", "model.rope_scaling.factor=4", "model.rope_scaling.original_max_position=8"]
SINKS = [*SMALL, "model.attention_sinks=true"]


def _build(overrides: list[str]):
    from models.shape import ModelShape
    from training.config.compose import compose
    from training.engine.build import build
    from training.parallel import dist as D

    cfg = compose(overrides)
    D.init(**{**D.layout_of(cfg), "timeout_minutes": 2})
    state = build(cfg, ModelShape.of(cfg.model, 101), torch.device("cpu"), train=False)
    return cfg, state.model[0].eval()


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a - b).abs().max() / b.abs().max()).item()


def _clamped_swiglu(gpt) -> dict:
    mlp = gpt.decoder.layers[0].mlp
    x = (torch.randn(8, 2, 64, generator=torch.Generator().manual_seed(0)) * 3).requires_grad_()
    out, bias = mlp(x)
    out = out + bias
    params = [mlp.linear_fc1.weight, mlp.linear_fc1.bias, mlp.linear_fc2.weight, mlp.linear_fc2.bias]
    h = x @ params[0].T + params[1]  # [gate; linear] rows (gpt-oss interleaves them: its import reorders)
    gate, linear = h.chunk(2, dim=-1)
    clamped = ((gate > LIMIT).float().mean().item(), (linear.abs() > LIMIT).float().mean().item())
    gate, linear = gate.clamp(max=LIMIT), linear.clamp(min=-LIMIT, max=LIMIT)
    ref = ((linear + 1) * gate * torch.sigmoid(1.702 * gate)) @ params[2].T + params[3]
    grad = torch.randn_like(ref)
    ours = torch.autograd.grad(out, [x, *params], grad)
    theirs = torch.autograd.grad(ref, [x, *params], grad)
    return {"out": _rel(out, ref), "grads": [_rel(a, b) for a, b in zip(ours, theirs)], "clamped": clamped}


def _yarn_attention(cfg, gpt) -> dict:
    """The first layer's attention on the input it saw, recomputed: transformers' Llama rotary module and
    apply_rotary_pos_emb, SDPA (causal, GQA), the output projection."""
    import transformers
    from transformers.models.llama.modeling_llama import LlamaRotaryEmbedding, apply_rotary_pos_emb

    attention, seen = gpt.decoder.layers[0].self_attention, {}
    hook = attention.register_forward_hook(lambda m, args, out: seen.update(x=args[0], out=out[0]))
    tokens = torch.randint(0, 101, (2, 32), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        attention.linear_qkv.weight.mul_(4.0)  # sharper scores: the factor scales them by its square
        gpt(tokens)
    hook.remove()
    hf = transformers.LlamaConfig(hidden_size=64, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
                                  max_position_embeddings=32, rope_parameters=dict(
                                      rope_type="yarn", factor=4.0, original_max_position_embeddings=8,
                                      rope_theta=cfg.model.rotary_base))
    x = seen["x"]  # [s, b, h]
    s, b, _ = x.shape
    qkv = (x @ attention.linear_qkv.weight.T).view(s, b, 2, 4, 16)  # per group: 2 q heads, k, v
    q, k, v = (t.permute(1, 2, 0, 3) for t in (qkv[:, :, :, :2].reshape(s, b, 4, 16), qkv[:, :, :, 2], qkv[:, :, :, 3]))
    rotary = LlamaRotaryEmbedding(hf)
    out = {}
    for name, factor in (("scaled", None), ("unscaled", 1.0)):  # unscaled: how far dropping the factor moves it
        if factor is not None:
            rotary.attention_scaling = factor
        cos, sin = rotary(v, torch.arange(s)[None])
        q_r, k_r = apply_rotary_pos_emb(q, k, cos, sin)
        attended = torch.nn.functional.scaled_dot_product_attention(
            q_r, k_r.repeat_interleave(2, dim=1), v.repeat_interleave(2, dim=1), is_causal=True)
        ref = attended.permute(2, 0, 1, 3).reshape(s, b, 64) @ attention.linear_proj.weight.T
        out[name] = _rel(seen["out"], ref)
    out["factor"] = LlamaRotaryEmbedding(hf).attention_scaling
    return out


def _zero_centred_final_norm(cfg, gpt) -> dict:
    norm = gpt.decoder.final_layernorm
    start = norm.weight.detach().clone()
    with torch.no_grad():
        norm.weight.copy_(torch.randn(64, generator=torch.Generator().manual_seed(2)) * 0.5)
    seen = {}
    hook = norm.register_forward_hook(lambda m, args, out: seen.update(x=args[0]))
    tokens = torch.randint(0, 101, (2, 16), generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        logits = gpt(tokens)[..., :101]  # [b, s, V]
    hook.remove()
    x = seen["x"].transpose(0, 1).double()  # [b, s, h]
    normed = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + cfg.model.norm_epsilon) * (1 + norm.weight.double())
    ref = normed @ gpt.shared_embedding_or_output_weight().double()[:101].T
    return {"start": start, "logits": _rel(logits.double(), ref)}


def _sinks(overrides: list[str]) -> dict:
    from training.parallel import dist as D

    _, gpt = _build(overrides)
    sinks = {n: p.detach().clone() for n, p in gpt.named_parameters() if n.endswith("softmax_offset")}
    D.teardown()
    return sinks


def _one_process() -> dict:
    from training.parallel import dist as D

    out = {}
    for name, overrides, check in (
            ("swiglu", [*SMALL, "model.activation=clamped_swiglu", f"model.swiglu_limit={LIMIT}",
                        "model.add_bias_linear=true"], lambda cfg, gpt: _clamped_swiglu(gpt)),
            ("yarn", [*SMALL, *YARN], _yarn_attention),
            ("norm", [*SMALL, "model.norm_zero_centered=true"], _zero_centred_final_norm)):
        cfg, gpt = _build(overrides)
        out[name] = check(cfg, gpt)
        D.reset_model_parallel()
    D.teardown()
    out["sinks"] = _sinks(SINKS)
    return out


@pytest.fixture(scope="module")
def one_process():
    (result,) = run_distributed(_one_process, 1, timeout=300)
    return result


def test_dense_clamped_swiglu_is_gpt_oss(one_process):
    result = one_process["swiglu"]
    assert min(result["clamped"]) > 0.1, result["clamped"]  # the limit bites on both halves
    assert result["out"] <= RTOL and max(result["grads"]) <= RTOL, result


def test_rope_scalings_attention_factor_reaches_a_built_model(one_process):
    result = one_process["yarn"]
    assert result["factor"] == pytest.approx(1.1386, abs=1e-4)  # 0.1 ln(4) + 1
    assert result["scaled"] <= RTOL, result
    assert result["unscaled"] > 1e-2, result  # the factor matters here: dropping it would show


def test_zero_centred_final_norm_of_a_fresh_model_is_one_plus_w(one_process):
    result = one_process["norm"]
    assert torch.equal(result["start"], torch.zeros(64))
    assert result["logits"] <= RTOL, result


def test_sinks_at_tp2_are_each_ranks_heads_slice_of_one_process(one_process):
    full = one_process["sinks"]  # [4] a layer
    for rank, sinks in enumerate(run_distributed(_sinks, 2, ([*SINKS, "parallel.tp=2"],), timeout=300)):
        assert set(sinks) == set(full) and len(full) == 2, sorted(sinks)
        for name, local in sinks.items():
            assert local.shape == (2,) and full[name].abs().min() > 0, (name, full[name])
            assert torch.equal(local, full[name][2 * rank:2 * rank + 2]), (name, rank, local, full[name])
