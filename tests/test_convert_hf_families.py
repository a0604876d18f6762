"""Which Hugging Face models map, and how: every block's from_hf / to_hf round trip for MQA, GQA and MHA with
and without biases; configs that are not a plain Llama-style decoder refused in one line; a small random HF
Mixtral imported, exported and run at EP2 (tools/convert_hf.py). The Llama workflow: tests/test_convert_hf.py.
"""

import importlib.util
import sys
from pathlib import Path

import pytest
import torch
from harness import run_distributed
from hf_interop import ARCH, ROOT, TOLERANCE, VOCAB, convert_main, logits_at_layouts, relative_diff

if importlib.util.find_spec("transformers") is None or importlib.util.find_spec("safetensors") is None:
    pytest.skip("needs the hf extra: pip install -e '.[hf]'", allow_module_level=True)


# what a family has that the template cannot express: each refused naming the field and the value config.json holds
UNSUPPORTED = {
    # every RoPE type transformers' ROPE_INIT_FUNCTIONS has imports (tests/test_rope.py) but Gemma 4's proportional
    "rope_scaling.rope_type='proportional'": dict(rope_scaling={"rope_type": "proportional", "factor": 4.0}),
    "rope_parameters.rope_type='proportional'": dict(rope_parameters={"rope_type": "proportional"}),
    "model_type='gemma3'": dict(model_type="gemma3"), "hidden_act='gelu'": dict(hidden_act="gelu"),
    # Llama: q, k, v, o biases (attention_bias) apart from the MLP's (mlp_bias): the field the checkpoint sets
    "attention_bias=True (supported: only with mlp_bias=true": dict(attention_bias=True, mlp_bias=False),
    "mlp_bias=True (supported: only with attention_bias=true": dict(mlp_bias=True),
    "partial_rotary_factor=0.5": dict(partial_rotary_factor=0.5),
    "sliding_window=4096": dict(model_type="llama", sliding_window=4096),  # Mistral's: tests/test_convert_hf_window.py
    "use_sliding_window=True": dict(model_type="qwen2", use_sliding_window=True, sliding_window=4096),
    "layer_types=['full_attention', 'sliding_attention']": dict(
        model_type="qwen3", layer_types=["sliding_attention", "full_attention"]),
    "attention_bias=True": dict(model_type="qwen3", attention_bias=True),
    "attn_logit_softcapping=50.0": dict(attn_logit_softcapping=50.0),
}


def _refusals() -> dict:
    """training.interop.hf_config.model_fields' error for each UNSUPPORTED change of a valid config.json."""
    from training.interop.hf_config import HFError, model_fields

    base = dict(ARCH, model_type="llama", hidden_act="silu", tie_word_embeddings=False)
    assert model_fields(base)["num_query_groups"] == 2
    # Qwen2.5's config.json carries a window size with the window off: accepted
    assert model_fields(dict(base, model_type="qwen2", sliding_window=131072, use_sliding_window=False))["qkv_bias"]
    out = {}
    for named, change in UNSUPPORTED.items():
        try:
            model_fields(dict(base, **change))
        except HFError as err:
            out[named] = str(err)
    return out


def _mapping_round_trips() -> dict:
    """models/*.py from_hf then to_hf on random HF tensors, for MQA / GQA / MHA with and without biases:
    {case: the HF names whose tensors did not come back exactly} (shapes only: the logits checks cover meaning)."""
    from types import SimpleNamespace

    from models import gpt as gpt_module
    from models.shape import ModelShape
    from training.config.schema import ModelConfig

    out = {}
    # (heads, groups, biases everywhere, tied, q/k/v biases only (Qwen2), QK-norm with head dim 12 (Qwen3))
    for heads, groups, bias, tied, qkv_bias, qk_norm in (
            (4, 1, False, True, False, False), (4, 4, True, False, False, False), (8, 2, True, True, False, False),
            (4, 2, False, False, True, False), (4, 2, False, True, False, True)):
        hn, h, ffn, vocab = 12 if qk_norm else 8, 32, 48, 101
        config = SimpleNamespace(num_layers=2, num_attention_heads=heads, num_query_groups=groups, kv_channels=hn,
                                 add_bias_linear=bias, add_qkv_bias=qkv_bias, qk_layernorm=qk_norm,
                                 gated_linear_unit=True, normalization="RMSNorm", tensor_model_parallel_size=2,
                                 softmax_type="vanilla")
        shape = ModelShape.of(ModelConfig(num_layers=2, hidden_size=h, num_attention_heads=heads,
                                          num_query_groups=groups, kv_channels=hn, ffn_hidden_size=ffn,
                                          vocab_size=vocab, seq_length=16, add_bias_linear=bias,
                                          qkv_bias=qkv_bias, qk_norm=qk_norm, tie_embeddings=tied))
        shapes = {"model.embed_tokens.weight": (vocab, h), "model.norm.weight": (h,)}
        if not tied:
            shapes["lm_head.weight"] = (vocab, h)
        for i in range(2):
            for name, rows, cols in (("self_attn.q_proj", heads * hn, h), ("self_attn.k_proj", groups * hn, h),
                                     ("self_attn.v_proj", groups * hn, h), ("self_attn.o_proj", h, heads * hn),
                                     ("mlp.gate_proj", ffn, h), ("mlp.up_proj", ffn, h), ("mlp.down_proj", h, ffn)):
                shapes[f"model.layers.{i}.{name}.weight"] = (rows, cols)
                if bias or (qkv_bias and name in ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj")):
                    shapes[f"model.layers.{i}.{name}.bias"] = (rows,)
            for name in ("q_norm", "k_norm") if qk_norm else ():
                shapes[f"model.layers.{i}.self_attn.{name}.weight"] = (hn,)
            for name in ("input_layernorm", "post_attention_layernorm"):
                shapes[f"model.layers.{i}.{name}.weight"] = (h,)
        hf = {name: torch.randn(shape) for name, shape in shapes.items()}
        ours = dict(gpt_module.from_hf(hf.__getitem__, config, shape))
        assert ours["embedding.word_embeddings.weight"].shape == (256, h)  # 101 padded to 128 * tp 2
        back = dict(gpt_module.to_hf(ours.__getitem__, config, shape))
        out[f"np{heads} ng{groups} bias={bias} tied={tied} qkv_bias={qkv_bias} qk_norm={qk_norm}"] = sorted(
            set(hf) ^ set(back) | {n for n in hf if n in back and not torch.equal(hf[n], back[n])})
    return out


def test_block_mappings_round_trip_for_mqa_gqa_mha_and_biases():
    mapping = _mapping_round_trips()
    assert mapping and all(not bad for bad in mapping.values()), mapping


def test_unsupported_hf_configs_are_refused():
    refusals = _refusals()
    for named in UNSUPPORTED:
        message = refusals.get(named, "")
        assert "has what the template cannot express" in message and named in message, (named, message)


# ---- Mixtral: Llama's attention with mixture-of-experts MLPs ----------------------------------------------------
MIXTRAL = dict(ARCH, num_hidden_layers=2, num_local_experts=4, num_experts_per_tok=2, tie_word_embeddings=False)


def _mixtral(root: str) -> dict:
    """In one process: a random HF Mixtral -> import --check -> export --check -> re-import; both HF models'
    logits (transformers) on the check tokens."""
    import transformers

    sys.path.insert(0, str(ROOT / "tools"))
    import convert_hf

    from training.interop.hf import check_tokens, reference_logits

    paths = {name: Path(root) / name for name in ("hf", "ckpt", "exported", "again")}
    torch.manual_seed(11)
    transformers.MixtralForCausalLM(transformers.MixtralConfig(**MIXTRAL)).save_pretrained(str(paths["hf"]))
    conf = Path(root) / "conf" / "model"
    cli = [convert_main(convert_hf, argv) for argv in (
        ["import", "--hf-dir", str(paths["hf"]), "--out", str(paths["ckpt"]), "--check",
         "--preset-out", str(conf / "hf_mixtral.yaml")],
        ["export", "--ckpt", str(paths["ckpt"]), "--out", str(paths["exported"]), "--check"],
        ["import", "--hf-dir", str(paths["exported"]), "--out", str(paths["again"]),
         "--preset-out", str(Path(root) / "again.yaml")])]
    tokens = check_tokens(VOCAB, MIXTRAL["max_position_embeddings"])
    return {"cli": cli, "tokens": tokens,
            "reference": {name: reference_logits(paths[name], tokens) for name in ("hf", "exported")}}


def test_mixtral_imports_exports_and_runs_at_ep2(tmp_path):
    """A random small HF Mixtral (4 experts, top-2, GQA 4/2, vocabulary 301, untied): import --check (logits
    within 1e-4), export --check, the exported model's logits in transformers equal the original's, re-import
    is bit-identical, and the imported checkpoint gives the HF logits at EP2 too."""
    from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

    (result,) = run_distributed(_mixtral, 1, (str(tmp_path),), timeout=300)
    for code, output, errors in result["cli"]:
        assert code == 0, output + errors
    diffs = [relative_diff(result["cli"][i][1]) for i in (0, 1)]
    assert all(d <= TOLERANCE for d in diffs), diffs
    assert torch.equal(result["reference"]["exported"], result["reference"]["hf"])
    preset = (tmp_path / "conf" / "model" / "hf_mixtral.yaml").read_text()
    assert "  num_experts: 4" in preset and "  top_k: 2" in preset
    for name in ("ckpt", "again"):
        dcp_to_torch_save(str(tmp_path / name / "iter_0000000"), str(tmp_path / f"{name}.pt"))
    first, again = (torch.load(tmp_path / f"{n}.pt", weights_only=False) for n in ("ckpt", "again"))
    assert set(first) == set(again) and all(torch.equal(first[k], again[k]) for k in first if torch.is_tensor(first[k]))

    jobs = [("ep2", str(tmp_path / "conf"), str(tmp_path / "ckpt"), ["model=hf_mixtral", "parallel.ep=2"])]
    logits = run_distributed(logits_at_layouts, 2, (jobs, result["tokens"]), timeout=300)
    reference = result["reference"]["hf"]
    for rank_logits in logits:
        diff = ((rank_logits["ep2"] - reference).abs().max() / reference.abs().max()).item()
        assert diff <= TOLERANCE, diff
