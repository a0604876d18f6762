"""The model families teams start from, end to end (tools/convert_hf.py): a small random model of each, built and
saved by transformers' own classes, is imported (--check), gives transformers' logits at tp1, tp2 (and ep2 for
Qwen3-MoE), decodes greedily at tp2 token for token as transformers' generate(), fine-tunes 3 steps at tp2 (ep2),
exports from that checkpoint (--check: the exported model's logits in transformers equal ours), and the export's
config.json is the family's own.

    llama3     Llama 3.x: RoPE scaling "llama3" (factor 4, from an original context of 16: the 64-token check and
               the generated positions run past it)
    qwen2      Qwen2 / 2.5: biases on q, k, v only; tied embeddings
    qwen3      Qwen3: QK-norm, head_dim 24 (4 x 24 != hidden 64)
    qwen3_moe  Qwen3-MoE: Qwen3's attention, 4 experts top-2 renormalised (norm_topk_prob), layer 1 dense
               (mlp_only_layers)
    gpt_oss    gpt-oss: q/k/v/o biases, learned sinks, sliding (window 16) / full layers, YaRN (original context 32),
               4 experts top-2 with a router bias and expert biases, the clamped SwiGLU (limit 0.3: it bites on
               these weights); fine-tuned at tp2 x ep2

Every norm weight and bias is random (transformers initialises them to 1 and 0, which would hide a swapped or
dropped tensor). fp32; logits compared as max |diff| / max |logit| over the real vocabulary.
"""

import importlib.util
import json
import sys
from pathlib import Path

import pytest
import torch
from harness import run_distributed
from hf_interop import (ARCH, ROOT, VOCAB, convert_main, greedy_at_tp2, hf_greedy, logits_at_layouts,
                        meta_parameter_count, relative_diff)

if importlib.util.find_spec("transformers") is None or importlib.util.find_spec("safetensors") is None:
    pytest.skip("needs the hf extra: pip install -e '.[hf]'", allow_module_level=True)

TOLERANCE = 1e-5
ROPE = {"rope_type": "llama3", "factor": 4.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
        "original_max_position_embeddings": 16}
QWEN3 = dict(ARCH, head_dim=24)
# family -> (transformers config class, its fields, extra layouts besides tp2 (for logits), train/decode layout)
FAMILIES = {
    "llama3": ("LlamaConfig", dict(ARCH, rope_scaling=ROPE, tie_word_embeddings=False), [], ["parallel.tp=2"]),
    "qwen2": ("Qwen2Config", dict(ARCH, tie_word_embeddings=True), [], ["parallel.tp=2"]),
    "qwen3": ("Qwen3Config", dict(QWEN3, tie_word_embeddings=False), [], ["parallel.tp=2"]),
    "qwen3_moe": ("Qwen3MoeConfig", dict(QWEN3, num_experts=4, num_experts_per_tok=2, moe_intermediate_size=48,
                                         norm_topk_prob=True, mlp_only_layers=[1], tie_word_embeddings=False),
                  [["parallel.ep=2"]], ["parallel.tp=2", "parallel.sp=true"]),
    "gpt_oss": ("GptOssConfig", dict(
        {k: v for k, v in ARCH.items() if k != "rope_theta"}, head_dim=16, num_local_experts=4, num_experts_per_tok=2, intermediate_size=48, sliding_window=16,
        layer_types=["sliding_attention", "full_attention"] * 2, swiglu_limit=0.3, tie_word_embeddings=False,
        rope_parameters={"rope_type": "yarn", "factor": 4.0, "beta_fast": 32.0, "beta_slow": 1.0, "truncate": False,
                         "original_max_position_embeddings": 32, "rope_theta": 1.5e5}),
                [["parallel.ep=2"]], ["parallel.tp=2", "parallel.sp=true", "parallel.ep=2"]),
}


def _hf_models(root: str) -> dict:
    """One process: each family's random HF model saved, imported with --check, its reference logits and its
    greedy continuation of each prompt (transformers' generate())."""
    import transformers

    sys.path.insert(0, str(ROOT / "tools"))
    import convert_hf

    from training.interop.hf import check_tokens, reference_logits

    out = {"tokens": check_tokens(VOCAB, ARCH["max_position_embeddings"])}
    for i, (name, (config_class, fields, _, _)) in enumerate(FAMILIES.items()):
        torch.manual_seed(20 + i)
        model = transformers.AutoModelForCausalLM.from_config(getattr(transformers, config_class)(**fields))
        with torch.no_grad():
            for param_name, param in model.named_parameters():
                if param.dim() == 1:  # norms around 1, biases (and gpt-oss's sinks) around 0: both random
                    param.normal_(1.0 if param.abs().max() == 1 else 0.0, 0.2)
                if param_name.endswith("router.weight"):  # gpt-oss: tokens spread over the experts despite the bias
                    param.normal_(0.0, 0.5)
        hf_dir = Path(root) / name
        model.save_pretrained(str(hf_dir))
        cli = convert_main(convert_hf, ["import", "--hf-dir", str(hf_dir), "--out", f"{root}/ckpt_{name}", "--check",
                                        "--preset-out", f"{root}/conf/model/hf_{name}.yaml"])
        out[name] = {"cli": cli, "reference": reference_logits(hf_dir, out["tokens"]), "generated": hf_greedy(model)}
    return out


def _at_tp2(root: str, tokens: torch.Tensor) -> dict:
    """Two processes: each family's logits at tp2 (and its other layouts), greedy decoding at tp2, then 3 steps
    of fine-tuning at its training layout, saved for export."""
    from runs import QUICK, _train

    jobs = [(f"{name} {' '.join(extra) or 'tp2'}", f"{root}/conf", f"{root}/ckpt_{name}", [f"model=hf_{name}", *extra])
            for name, (_, _, others, _) in FAMILIES.items() for extra in (["parallel.tp=2"], *others)]
    out = {"logits": logits_at_layouts(jobs, tokens), "generated": greedy_at_tp2(root, FAMILIES)}
    for name, (_, _, _, layout) in FAMILIES.items():
        _train([f"hydra.searchpath=[file://{root}/conf]", f"model=hf_{name}", *QUICK, "model.num_layers=4",
                *layout, f"checkpoint.load={root}/ckpt_{name}", "checkpoint.finetune=true", "train.iters=3",
                "checkpoint.dir=tuned", "optim.lr=1e-2"], f"{root}/run_{name}")
    return out


def _export(root: str) -> dict:
    """One process: export each fine-tuned checkpoint with --check."""
    sys.path.insert(0, str(ROOT / "tools"))
    import convert_hf

    return {name: convert_main(convert_hf, ["export", "--ckpt", f"{root}/run_{name}/tuned", "--out",
                                            f"{root}/exported_{name}", "--check", "--tolerance", str(TOLERANCE),
                                            "--tokenizer-dir", f"{root}/{name}"])  # its generation_config.json
            for name in FAMILIES}


@pytest.fixture(scope="module")
def families(tmp_path_factory):
    root = str(tmp_path_factory.mktemp("families"))
    (imported,) = run_distributed(_hf_models, 1, (root,), timeout=600)
    ranks = run_distributed(_at_tp2, 2, (root, imported["tokens"]), timeout=900)
    (exported,) = run_distributed(_export, 1, (root,), timeout=600)
    return Path(root), imported, ranks, exported


def test_every_family_imports_with_transformers_logits_at_tp1_tp2_and_ep2(families):
    root, imported, ranks, _ = families
    diffs = {f"{name} tp1": relative_diff(imported[name]["cli"][1]) for name in FAMILIES}
    for name in FAMILIES:
        code, output, errors = imported[name]["cli"]
        assert code == 0, output + errors
        reference = imported[name]["reference"]
        for label in [label for label in ranks[0]["logits"] | ranks[1]["logits"] if label.split()[0] == name]:
            got = [r["logits"][label] for r in ranks if label in r["logits"]]
            assert all(torch.equal(g, got[0]) for g in got), label  # every rank gathers the same logits
            diffs[label] = ((got[0] - reference).abs().max() / reference.abs().max()).item()
    print(f"relative logits diff vs transformers: {diffs}")
    layouts = sum(2 + len(others) for _, _, others, _ in FAMILIES.values())  # tp1, tp2 and the others
    assert len(diffs) == layouts and all(d <= TOLERANCE for d in diffs.values()), diffs
    preset = {name: (root / "conf" / "model" / f"hf_{name}.yaml").read_text() for name in FAMILIES}
    assert "  type: llama3" in preset["llama3"] and "  factor: 4.0" in preset["llama3"]
    assert "qkv_bias: true" in preset["qwen2"] and "tie_embeddings: true" in preset["qwen2"]
    assert "qk_norm: true" in preset["qwen3"] and "kv_channels: 24" in preset["qwen3"]
    assert "  dense_layers:\n  - 1" in preset["qwen3_moe"] and "  pre_softmax: false" in preset["qwen3_moe"]
    assert "activation: clamped_swiglu" in preset["gpt_oss"] and "attention_sinks: true" in preset["gpt_oss"]
    assert "swiglu_limit: 0.3" in preset["gpt_oss"] and "add_bias_linear: true" in preset["gpt_oss"]


def test_greedy_decoding_at_tp2_equals_transformers_generate(families):
    _, imported, ranks, _ = families
    for name in FAMILIES:
        assert ranks[0]["generated"][name] == ranks[1]["generated"][name] == imported[name]["generated"], name


def test_fine_tuned_checkpoints_export_as_their_family_with_equal_logits(families):
    root, imported, _, exported = families
    for name, (config_class, fields, _, _) in FAMILIES.items():
        code, output, errors = exported[name]
        assert code == 0 and relative_diff(output) <= TOLERANCE, output + errors
        losses = [json.loads(line)["loss"] for line in (root / f"run_{name}" / "metrics.jsonl").read_text().splitlines()
                  if "loss" in json.loads(line)]
        assert len(losses) == 3 and losses[-1] < losses[0], (name, losses)
        assert "saved at tp/pp 2/1, iteration 3" in output  # resharded from tp2 to one process
        config = json.loads((root / f"exported_{name}" / "config.json").read_text())
        original = json.loads((root / name / "config.json").read_text())
        assert config["architectures"] == original["architectures"], name
        if (root / name / "generation_config.json").is_file():  # --tokenizer-dir copies it, and the special ids
            assert (root / f"exported_{name}" / "generation_config.json").is_file(), name
            assert config["eos_token_id"] == original["eos_token_id"], name
        for key in ("model_type", "head_dim", "num_key_value_heads", "rope_parameters", "tie_word_embeddings",
                    "max_position_embeddings",  # 128, though it trained at seq 64
                    "num_experts", "num_local_experts", "moe_intermediate_size", "norm_topk_prob", "mlp_only_layers",
                    "decoder_sparse_step", "swiglu_limit", "sliding_window" if name == "gpt_oss" else "num_experts"):
            assert config.get(key) == original.get(key), (name, key, config.get(key), original.get(key))
    assert json.loads((root / "exported_llama3" / "config.json").read_text())["eos_token_id"] == 2  # LlamaConfig's


# The published config.json of each family's model (the fields that set the shape), as on the Hugging Face Hub
PUBLISHED = {
    "llama3_2_1b": dict(model_type="llama", hidden_size=2048, intermediate_size=8192, num_hidden_layers=16,
                        num_attention_heads=32, num_key_value_heads=8, head_dim=64, vocab_size=128256,
                        max_position_embeddings=131072, rms_norm_eps=1e-5, rope_theta=500000.0,
                        rope_scaling=dict(ROPE, factor=32.0, original_max_position_embeddings=8192),
                        tie_word_embeddings=True, hidden_act="silu", attention_bias=False, mlp_bias=False),
    "llama3_1_8b": dict(model_type="llama", hidden_size=4096, intermediate_size=14336, num_hidden_layers=32,
                        num_attention_heads=32, num_key_value_heads=8, vocab_size=128256,
                        max_position_embeddings=131072, rms_norm_eps=1e-5, rope_theta=500000.0,
                        rope_scaling=dict(ROPE, factor=8.0, original_max_position_embeddings=8192),
                        tie_word_embeddings=False, hidden_act="silu", attention_bias=False, mlp_bias=False),
    "qwen2_5_7b": dict(model_type="qwen2", hidden_size=3584, intermediate_size=18944, num_hidden_layers=28,
                       num_attention_heads=28, num_key_value_heads=4, vocab_size=152064, max_position_embeddings=131072,
                       rms_norm_eps=1e-6, rope_theta=1000000.0, sliding_window=131072, use_sliding_window=False,
                       max_window_layers=28, tie_word_embeddings=False, hidden_act="silu"),
    "qwen3_8b": dict(model_type="qwen3", hidden_size=4096, intermediate_size=12288, num_hidden_layers=36,
                     num_attention_heads=32, num_key_value_heads=8, head_dim=128, vocab_size=151936,
                     max_position_embeddings=40960, rms_norm_eps=1e-6, rope_theta=1000000.0, sliding_window=None,
                     use_sliding_window=False, attention_bias=False, tie_word_embeddings=False, hidden_act="silu"),
    "qwen3_30b_a3b": dict(model_type="qwen3_moe", hidden_size=2048, intermediate_size=6144, num_hidden_layers=48,
                          num_attention_heads=32, num_key_value_heads=4, head_dim=128, vocab_size=151936,
                          max_position_embeddings=40960, rms_norm_eps=1e-6, rope_theta=1000000.0,
                          use_sliding_window=False, attention_bias=False, tie_word_embeddings=False,
                          hidden_act="silu", num_experts=128, num_experts_per_tok=8, moe_intermediate_size=768,
                          norm_topk_prob=True, decoder_sparse_step=1, mlp_only_layers=[],
                          router_aux_loss_coef=0.001),
}
CONFIG_CLASSES = {"llama": "LlamaConfig", "qwen2": "Qwen2Config", "qwen3": "Qwen3Config", "qwen3_moe": "Qwen3MoeConfig"}


@pytest.mark.fast
def test_presets_are_the_published_models():
    """conf/model's Llama 3.x and Qwen presets: importing the published config.json gives the preset's shape
    (sequence length aside: the presets train shorter), and the planner's parameter count equals transformers'
    model built on the meta device from that config.json (Qwen3-8B 8.19 B, Qwen3-30B-A3B 30.5 B, as published)."""
    import transformers

    from models.gpt import num_params
    from models.shape import ModelShape
    from training.config.compose import compose
    from training.interop.hf_config import model_fields

    counts = {}
    for preset, published in PUBLISHED.items():
        ours = compose([f"model={preset}"]).model
        imported = compose([f"model={preset}"]).model
        fields = model_fields(published)
        for group in ("moe", "rope_scaling"):
            for key, value in fields.pop(group, {}).items():
                setattr(getattr(imported, group), key, value)
        for key, value in fields.items():
            setattr(imported, key, value)
        imported.seq_length = ours.seq_length
        assert ModelShape.of(imported) == ModelShape.of(ours), preset
        assert ours.max_position_embeddings == published["max_position_embeddings"], preset  # what export writes
        counts[preset] = meta_parameter_count(CONFIG_CLASSES[published["model_type"]], published)
        assert num_params(ModelShape.of(ours)) == counts[preset], (preset, counts[preset])
    assert round(counts["qwen3_8b"] / 1e9, 2) == 8.19 and round(counts["qwen3_30b_a3b"] / 1e9, 1) == 30.5, counts
