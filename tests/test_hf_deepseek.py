"""DeepSeek-V3 (model_type deepseek_v3) end to end through tools/convert_hf.py: a small random model built and saved by
transformers' own classes (multi-latent attention with q low-rank, v_head_dim != the q/k head dim, DeepSeek's
interleaved RoPE rows, YaRN with mscale != mscale_all_dim; the first layer dense, then 4 experts top-2 from 1 of 2
groups with the expert-bias correction, x 2.5, a shared expert; a multi-token prediction layer's tensor in the
checkpoint) is imported (--check: transformers' logits within 1e-5), gives the same logits at tp2, tp2 + sp and ep2,
decodes greedily at tp2 (MLA's latent KV cache) token for token as transformers' generate(), fine-tunes 3 steps
at tp2 x ep2 (the expert bias updated from the load), and exports that (--check: the exported model's logits in
transformers equal ours) as a DeepseekV3Config.

Every norm weight and the expert bias are random (transformers initialises them to 1 and 0). fp32; logits compared
as max |diff| / max |logit|. The presets' parameter counts: the last test.
"""

import importlib.util
import json
import sys
from pathlib import Path

import pytest
import torch
from harness import run_distributed
from hf_interop import (ROOT, VOCAB, convert_main, greedy_at_tp2, hf_greedy, logits_at_layouts,
                        meta_parameter_count, relative_diff)

if importlib.util.find_spec("transformers") is None or importlib.util.find_spec("safetensors") is None:
    pytest.skip("needs the hf extra: pip install -e '.[hf]'", allow_module_level=True)

TOLERANCE = 1e-5
LAYERS = 2
ARCH = dict(vocab_size=VOCAB, hidden_size=64, intermediate_size=96, moe_intermediate_size=32,
            num_hidden_layers=LAYERS, num_attention_heads=4, num_key_value_heads=4, q_lora_rank=24, kv_lora_rank=16,
            qk_nope_head_dim=12, qk_rope_head_dim=8, v_head_dim=10, first_k_dense_replace=1, n_routed_experts=4,
            num_experts_per_tok=2, n_group=2, topk_group=1, n_shared_experts=1, routed_scaling_factor=2.5,
            norm_topk_prob=True, num_nextn_predict_layers=1, rms_norm_eps=1e-6, max_position_embeddings=128,
            tie_word_embeddings=False,
            rope_parameters={"rope_type": "yarn", "rope_theta": 10000.0, "factor": 4.0, "beta_fast": 32.0,
                             "beta_slow": 1.0, "mscale": 0.8, "mscale_all_dim": 0.6,
                             "original_max_position_embeddings": 16})
MTP = f"model.layers.{LAYERS}.eh_proj.weight"  # a multi-token prediction layer's tensor, as DeepSeek ships them


def _import(root: str) -> dict:
    """One process: the random model saved (plus an MTP tensor), imported with --check; transformers' logits."""
    import transformers
    from safetensors.torch import load_file, save_file

    sys.path.insert(0, str(ROOT / "tools"))
    import convert_hf

    from training.interop.hf import check_tokens, reference_logits

    torch.manual_seed(7)
    model = transformers.AutoModelForCausalLM.from_config(transformers.DeepseekV3Config(**ARCH))
    with torch.no_grad():
        for name, param in model.named_parameters():
            if "norm" in name:
                param.normal_(1.0, 0.2)
        for name, bias in model.named_buffers():
            if name.endswith("e_score_correction_bias"):  # large enough to change which experts win
                bias.normal_(0.0, 0.3)
    hf_dir = Path(root) / "hf"
    model.save_pretrained(str(hf_dir))
    tensors = load_file(str(hf_dir / "model.safetensors"))
    save_file({**tensors, MTP: torch.zeros(4, 4)}, str(hf_dir / "model.safetensors"), metadata={"format": "pt"})
    tokens = check_tokens(VOCAB, ARCH["max_position_embeddings"])
    cli = convert_main(convert_hf, ["import", "--hf-dir", str(hf_dir), "--out", f"{root}/ckpt_deepseek", "--check",
                                    "--preset-out", f"{root}/conf/model/hf_deepseek.yaml"])
    return {"tokens": tokens, "cli": cli, "reference": reference_logits(hf_dir, tokens), "generated": hf_greedy(model)}


def _at_tp2(root: str, tokens: torch.Tensor) -> dict:
    jobs = [(label, f"{root}/conf", f"{root}/ckpt_deepseek", ["model=hf_deepseek", *extra])
            for label, extra in (("tp2", ["parallel.tp=2"]), ("tp2-sp", ["parallel.tp=2", "parallel.sp=true"]),
                                 ("ep2", ["parallel.ep=2"]))]
    return {"logits": logits_at_layouts(jobs, tokens), "generated": greedy_at_tp2(root, ["deepseek"])["deepseek"]}


def _export(root: str):
    sys.path.insert(0, str(ROOT / "tools"))
    import convert_hf

    return convert_main(convert_hf, ["export", "--ckpt", f"{root}/run/tuned", "--out", f"{root}/exported", "--check",
                                     "--tolerance", str(TOLERANCE)])


def test_deepseek_v3_imports_runs_at_tp2_and_exports_with_transformers_logits(tmp_path):
    root = str(tmp_path)
    (imported,) = run_distributed(_import, 1, (root,), timeout=600)
    code, output, errors = imported["cli"]
    assert code == 0, output + errors
    assert "skipped: num_nextn_predict_layers=1" in output
    diffs = {"tp1": relative_diff(output)}
    ranks = run_distributed(_at_tp2, 2, (root, imported["tokens"]), timeout=600)
    reference = imported["reference"]
    for label in ("tp2", "tp2-sp", "ep2"):
        got = [r["logits"][label] for r in ranks]
        assert torch.equal(got[0], got[1]), label
        diffs[label] = ((got[0] - reference).abs().max() / reference.abs().max()).item()
    print(f"relative logits diff vs transformers: {diffs}")
    assert all(d <= TOLERANCE for d in diffs.values()), diffs
    # greedy decoding at tp2 through the latent KV cache = transformers' generate()
    assert ranks[0]["generated"] == ranks[1]["generated"] == imported["generated"]
    preset = (tmp_path / "conf" / "model" / "hf_deepseek.yaml").read_text()
    assert "attention: mla" in preset and "  q_lora_rank: 24" in preset and "  mscale_all_dim: 0.6" in preset

    # 3 fine-tuning steps at tp2 x ep2 (+ sp: MoE under TP), the expert bias updated each step, then exported
    from runs import QUICK, _train

    run_distributed(_train, 4, ([f"hydra.searchpath=[file://{root}/conf]", "model=hf_deepseek", *QUICK,
                                 f"model.num_layers={LAYERS}", "parallel.tp=2", "parallel.sp=true", "parallel.ep=2",
                                 f"checkpoint.load={root}/ckpt_deepseek", "checkpoint.finetune=true",
                                 "train.iters=3", "checkpoint.dir=tuned", "optim.lr=1e-2",
                                 "model.moe.router_bias_update_rate=0.05"], f"{root}/run"), timeout=600)
    losses = [json.loads(line)["loss"] for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()
              if "loss" in json.loads(line)]
    assert len(losses) == 3 and losses[-1] < losses[0], losses
    (code, output, errors) = run_distributed(_export, 1, (root,), timeout=600)[0]
    assert code == 0 and relative_diff(output) <= TOLERANCE, output + errors
    assert "saved at tp/pp 2/1, iteration 3" in output  # resharded from tp2 x ep2 to one process
    from safetensors.torch import load_file

    biases = [t for n, t in load_file(str(tmp_path / "exported" / "model.safetensors")).items()
              if n.endswith("e_score_correction_bias")]
    original = [t for n, t in load_file(str(tmp_path / "hf" / "model.safetensors")).items()
                if n.endswith("e_score_correction_bias")]
    assert len(biases) == LAYERS - 1 and not torch.equal(biases[0], original[0])  # updated from the load, exported
    config = json.loads((tmp_path / "exported" / "config.json").read_text())
    assert config["model_type"] == "deepseek_v3" and config["architectures"] == ["DeepseekV3ForCausalLM"]
    original = json.loads((tmp_path / "hf" / "config.json").read_text())
    assert config["rope_parameters"].pop("truncate", True) is True  # export writes YaRN's default out
    for key in ("q_lora_rank", "kv_lora_rank", "qk_nope_head_dim", "qk_rope_head_dim", "v_head_dim",
                "rope_parameters", "num_key_value_heads", "rope_interleave", "max_position_embeddings",
                "n_routed_experts", "num_experts_per_tok", "n_group", "topk_group", "n_shared_experts",
                "first_k_dense_replace", "routed_scaling_factor", "moe_intermediate_size", "intermediate_size"):
        assert config.get(key) == original.get(key), (key, config.get(key), original.get(key))


# The published config.json of each model (the fields that set the shape), as on the Hugging Face Hub
V3 = dict(vocab_size=129280, hidden_size=7168, intermediate_size=18432, moe_intermediate_size=2048,
          num_hidden_layers=61, num_attention_heads=128, num_key_value_heads=128, n_shared_experts=1,
          n_routed_experts=256,
          routed_scaling_factor=2.5, kv_lora_rank=512, q_lora_rank=1536, qk_rope_head_dim=64, v_head_dim=128,
          qk_nope_head_dim=128, n_group=8, topk_group=4, num_experts_per_tok=8, first_k_dense_replace=3,
          norm_topk_prob=True, max_position_embeddings=163840, rms_norm_eps=1e-6, tie_word_embeddings=False,
          rope_parameters=dict(rope_type="yarn", rope_theta=10000.0, factor=40.0, original_max_position_embeddings=4096,
                               beta_fast=32.0, beta_slow=1.0, mscale=1.0, mscale_all_dim=1.0))
PUBLISHED = {
    "deepseek_v3": V3,
    "moonlight_16b_a3b": dict(
        V3, vocab_size=163840, hidden_size=2048, intermediate_size=11264, moe_intermediate_size=1408,
        num_hidden_layers=27, num_attention_heads=16, num_key_value_heads=16, n_shared_experts=2, n_routed_experts=64,
        routed_scaling_factor=2.446, q_lora_rank=None, n_group=1, topk_group=1, num_experts_per_tok=6,
        first_k_dense_replace=1, max_position_embeddings=8192, rms_norm_eps=1e-5,
        rope_parameters=dict(rope_type="default", rope_theta=50000.0)),
    "kimi_k2": dict(
        V3, vocab_size=163840, num_attention_heads=64, num_key_value_heads=64, n_routed_experts=384,
        routed_scaling_factor=2.827, n_group=1, topk_group=1, first_k_dense_replace=1, max_position_embeddings=131072,
        rope_parameters=dict(rope_type="yarn", rope_theta=50000.0, factor=32.0, original_max_position_embeddings=4096,
                             beta_fast=1.0, beta_slow=1.0, mscale=1.0, mscale_all_dim=1.0)),
}


@pytest.mark.fast
def test_presets_have_transformers_parameter_counts():
    """conf/model's DeepSeek-V3, Moonlight and Kimi K2: the planner's count (summed from the blocks' declarations)
    equals transformers' DeepseekV3 model built on the meta device from the published config.json (671.0 B,
    16.0 B, 1.03 T), and the preset's MLA sizes and MoE routing are config.json's."""
    from models.gpt import num_params
    from models.shape import ModelShape
    from training.config.compose import compose

    for preset, published in PUBLISHED.items():
        model = compose([f"model={preset}"]).model
        shape = ModelShape.of(model)
        assert num_params(shape) == meta_parameter_count("DeepseekV3Config", published), preset
        assert {k: getattr(shape.mla, k) for k in ARCH if hasattr(shape.mla, k)} == \
            {k: published[k] for k in ARCH if hasattr(shape.mla, k)}, preset
        moe = model.moe
        assert (moe.num_experts, moe.top_k, moe.ffn_hidden_size, moe.first_dense, moe.router_topk_scaling_factor) == (
            published["n_routed_experts"], published["num_experts_per_tok"], published["moe_intermediate_size"],
            published["first_k_dense_replace"], published["routed_scaling_factor"]), preset
        assert moe.shared_expert_ffn_hidden_size == published["moe_intermediate_size"] * published["n_shared_experts"]
        groups = (moe.router_num_groups or 1, moe.router_group_topk or 1)
        assert groups == (published["n_group"], published["topk_group"]), preset
