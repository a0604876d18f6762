"""Gemma 3, OLMo 2, Phi-3 and Gemma 2 through tools/convert_hf.py (training/interop/hf_families.py): a small random
model of each, built and saved by transformers' own classes, imports (--check: our logits at tp1 within 1e-5 of
transformers', eager attention, on 64 tokens: past every window of 16), gives transformers' logits at tp2 (all
families in one 2-process group, which also decodes greedily at tp2 past the window, token for token as
transformers' generate(), and fine-tunes 3 steps at tp2 from the import), and exports (--check: the exported model's logits in transformers equal ours) as
its own family's config.json.

    gemma3_text  sandwich norms, (1 + w) norms, scaled embeddings, GeGLU-tanh, per-head QK-norm, layers sliding,
                 sliding, full, sliding (window 16), local base 1e4 and global 1e6 with linear scaling x2 on the
                 global layers only, query_pre_attn_scalar 32 (head_dim 24), tied
    olmo2        post-norms only, RMSNorm over the whole q and k projections (tp2: statistics across ranks)
    phi3         fused qkv_proj and gate_up_proj, partial rotary 0.5, longrope (original context 32 < 64), window 16
    gemma2       Gemma 2: alternating sliding / full layers, attention soft-cap 5 and final-logit soft-cap 3 (small
                 enough to bite on random weights), query_pre_attn_scalar 32 (head_dim 16)

Every norm weight and bias is random (transformers initialises them to 1 or 0, which would hide a swapped or dropped
tensor). fp32; logits compared as max |diff| / max |logit| over the real vocabulary.
"""

import importlib.util
import json
import math
import sys
from pathlib import Path

import pytest
import torch
from harness import run_distributed
from hf_interop import NEW, PROMPTS, ROOT, VOCAB, convert_main, greedy_at_tp2, logits_at_layouts, relative_diff

if importlib.util.find_spec("transformers") is None or importlib.util.find_spec("safetensors") is None:
    pytest.skip("needs the hf extra: pip install -e '.[hf]'", allow_module_level=True)

TOLERANCE = 1e-5
WINDOW = 16  # < the 64 tokens of the logits check
BASE = dict(vocab_size=VOCAB, hidden_size=64, intermediate_size=96, num_hidden_layers=4, num_attention_heads=4,
            num_key_value_heads=2, rms_norm_eps=1e-6, max_position_embeddings=128, pad_token_id=0, bos_token_id=None,
            eos_token_id=None)
FAMILIES = {
    "gemma3_text": ("Gemma3TextConfig", dict(
        BASE, head_dim=24, sliding_window=WINDOW, query_pre_attn_scalar=32,
        layer_types=["sliding_attention", "sliding_attention", "full_attention", "sliding_attention"],
        rope_parameters={"full_attention": {"rope_type": "linear", "factor": 2.0, "rope_theta": 1e6},
                         "sliding_attention": {"rope_type": "default", "rope_theta": 1e4}})),
    "olmo2": ("Olmo2Config", dict(BASE, tie_word_embeddings=False)),
    "phi3": ("Phi3Config", dict(
        BASE, sliding_window=WINDOW, tie_word_embeddings=False, original_max_position_embeddings=32,
        partial_rotary_factor=0.5, rope_parameters={"rope_type": "longrope", "rope_theta": 1e4,
                                                     "short_factor": [1.0, 1.2, 1.5, 2.0],
                                                     "long_factor": [1.0, 2.0, 3.0, 4.0]})),
    "gemma2": ("Gemma2Config", dict(BASE, head_dim=16, sliding_window=WINDOW, query_pre_attn_scalar=32,
                                    attn_logit_softcapping=5.0, final_logit_softcapping=3.0)),
}
# two prompts (19 and 2 tokens, the short one left-padded) and 24 new tokens: both run past the window of 16


def _hf_models(root: str) -> dict:
    """One process: each family's random HF model saved, imported (--check), exported from the import (--check);
    transformers' logits on the check's tokens and its greedy continuation of each prompt (generate(), eager)."""
    import transformers

    sys.path.insert(0, str(ROOT / "tools"))
    import convert_hf

    from training.interop.hf import check_tokens, reference_logits

    out = {"tokens": check_tokens(VOCAB, BASE["max_position_embeddings"])}
    for i, (name, (config_class, fields)) in enumerate(FAMILIES.items()):
        torch.manual_seed(40 + i)
        model = transformers.AutoModelForCausalLM.from_config(getattr(transformers, config_class)(**fields))
        with torch.no_grad():
            for param in model.parameters():
                if param.dim() == 1:  # norms (1, or 0 for Gemma's 1 + w) and biases: random around their init
                    param.normal_(1.0 if param.abs().max() == 1 else 0.0, 0.2)
        hf_dir = Path(root) / name
        model.save_pretrained(str(hf_dir))
        tolerance = ["--check", "--tolerance", str(TOLERANCE)]
        out[name] = {"import": convert_main(convert_hf, [
            "import", "--hf-dir", str(hf_dir), "--out", f"{root}/ckpt_{name}", *tolerance,
            "--preset-out", f"{root}/conf/model/hf_{name}.yaml"])}
        out[name]["export"] = convert_main(convert_hf, ["export", "--ckpt", f"{root}/ckpt_{name}", "--out",
                                                        f"{root}/exported_{name}", *tolerance])
        out[name]["reference"] = reference_logits(hf_dir, out["tokens"])
        eager = transformers.AutoModelForCausalLM.from_pretrained(str(hf_dir), attn_implementation="eager").eval()
        out[name]["generated"] = [eager.generate(
            torch.tensor([p]), attention_mask=torch.ones(1, len(p), dtype=torch.long), max_new_tokens=NEW,
            min_new_tokens=NEW, do_sample=False, pad_token_id=0)[0, len(p):].tolist() for p in PROMPTS]
    return out


def _at_tp2(root: str, tokens: torch.Tensor) -> dict:
    """Two processes: every family's imported checkpoint at tp2 (one process group for all): logits, greedy
    decoding, then 3 fine-tuning steps (seq 64, past the window)."""
    from runs import QUICK, _train

    out = {"logits": logits_at_layouts([(name, f"{root}/conf", f"{root}/ckpt_{name}",
                                         [f"model=hf_{name}", "parallel.tp=2"]) for name in FAMILIES], tokens),
           "generated": greedy_at_tp2(root, FAMILIES)}
    for name in FAMILIES:
        _train([f"hydra.searchpath=[file://{root}/conf]", f"model=hf_{name}", *QUICK, "model.num_layers=4",
                "parallel.tp=2", f"checkpoint.load={root}/ckpt_{name}", "checkpoint.finetune=true", "train.iters=3",
                "checkpoint.dir=null", "optim.lr=1e-2"], f"{root}/run_{name}")
    return out


@pytest.fixture(scope="module")
def families(tmp_path_factory):
    root = str(tmp_path_factory.mktemp("dense_families"))
    (imported,) = run_distributed(_hf_models, 1, (root,), timeout=600)
    ranks = run_distributed(_at_tp2, 2, (root, imported["tokens"]), timeout=600)
    return Path(root), imported, ranks


def test_each_family_imports_with_transformers_logits_past_the_window_at_tp1_and_tp2(families):
    _, imported, ranks = families
    diffs = {}
    for name in FAMILIES:
        code, output, errors = imported[name]["import"]
        assert code == 0, output + errors
        diffs[f"{name} tp1"] = relative_diff(output)
        reference = imported[name]["reference"]
        got = [r["logits"][name] for r in ranks]
        assert torch.equal(got[0], got[1]), name  # every rank gathers the same logits
        diffs[f"{name} tp2"] = ((got[0] - reference).abs().max() / reference.abs().max()).item()
    print(f"relative logits diff vs transformers: {diffs}")
    assert all(d <= TOLERANCE for d in diffs.values()), diffs


def test_greedy_decoding_at_tp2_past_the_window_equals_transformers_generate(families):
    _, imported, ranks = families
    for name in FAMILIES:
        assert ranks[0]["generated"][name] == ranks[1]["generated"][name] == imported[name]["generated"], name
        assert all(len(ids) == NEW for ids in imported[name]["generated"]), name


def test_each_family_fine_tunes_3_steps_at_tp2_from_the_import(families):
    root, _, _ = families
    from runs import losses

    for name in FAMILIES:
        steps = list(losses(root / f"run_{name}").values())
        print(f"{name} fine-tuning losses at tp2: {steps}")
        assert len(steps) == 3 and all(math.isfinite(x) for x in steps), (name, steps)
        assert steps[-1] < steps[0], (name, steps)


def test_each_family_exports_as_itself_with_equal_logits(families):
    root, imported, _ = families
    for name in FAMILIES:
        code, output, errors = imported[name]["export"]
        assert code == 0 and relative_diff(output) <= TOLERANCE, output + errors
        config = json.loads((root / f"exported_{name}" / "config.json").read_text())
        original = json.loads((root / name / "config.json").read_text())
        if "factor" not in original["rope_parameters"]:  # longrope's factor, written out: max / original positions
            config["rope_parameters"].pop("factor", None)
        for key in ("model_type", "architectures", "layer_types", "sliding_window", "head_dim", "query_pre_attn_scalar",
                    "attn_logit_softcapping", "final_logit_softcapping", "rope_parameters", "tie_word_embeddings",
                    "original_max_position_embeddings", "partial_rotary_factor"):
            assert config.get(key) == original.get(key), (name, key, config.get(key), original.get(key))
    from safetensors import safe_open

    with safe_open(str(root / "exported_phi3" / "model.safetensors"), "pt") as f:  # Phi-3's names: fused
        names = set(f.keys())
    assert "model.layers.0.self_attn.qkv_proj.weight" in names and "model.layers.0.mlp.gate_up_proj.weight" in names


@pytest.mark.fast
@pytest.mark.parametrize("family, fields, refused", [
    ("gemma3_text", dict(use_bidirectional_attention=True), "use_bidirectional_attention=True"),
    ("gemma3_text", dict(attn_logit_softcapping=50.0), "attn_logit_softcapping=50.0"),  # transformers ignores it
    ("gemma2", dict(hidden_activation="gelu"), "hidden_activation='gelu'"),
    ("olmo2", dict(attention_bias=True), "attention_bias=True"),
    ("olmo2", dict(clip_qkv=8.0), "clip_qkv=8.0"),
    ("phi3", dict(head_dim=8), "head_dim=8"),
    ("gemma3", {}, "model_type='gemma3'"),
])
def test_what_a_family_carries_beyond_the_template_is_refused_naming_it(family, fields, refused):
    from training.interop.hf_config import HFError, model_fields

    hf = dict(BASE, model_type=family, num_hidden_layers=2, **fields)
    with pytest.raises(HFError, match=refused.replace("(", r"\(").replace(")", r"\)")):
        model_fields(hf)
