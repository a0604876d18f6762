"""Hugging Face interop (tools/convert_hf.py): a small random HF Llama (GQA 4 heads / 2 KV heads, odd vocab 301:
padded to 384 at tp1, 512 at tp2; 4 layers, hidden 64; untied, tied, and with biases) is imported, checked against
transformers' logits at tp1 / tp2 / pp2, exported back and re-imported bit-identically. Fine-tuning at tp2 and
exporting from it (--tokenizer-dir): tests/test_hf_families.py, for Llama 3, Qwen2, Qwen3 and Qwen3-MoE. Nothing
is downloaded: the HF models are built from a LlamaConfig and saved locally.
Block mappings, refused configs and Mixtral: tests/test_convert_hf_families.py.

Logit differences are max |ours - HF| / max |HF| over the first vocab_size logits (padding excluded), fp32.
"""

import importlib.util
import json
import sys
from pathlib import Path

import pytest
import torch
from harness import run_distributed
from hf_interop import ARCH, ROOT, TOLERANCE, VOCAB, convert_main, logits_at_layouts, relative_diff

if importlib.util.find_spec("transformers") is None or importlib.util.find_spec("safetensors") is None:
    pytest.skip("needs the hf extra: pip install -e '.[hf]'", allow_module_level=True)


def _hf_model(directory: Path, tied: bool, shard: str | None = None, bias: bool = False) -> Path:
    import transformers

    torch.manual_seed(7 if tied else 3)
    model = transformers.LlamaForCausalLM(transformers.LlamaConfig(
        **ARCH, tie_word_embeddings=tied, attention_bias=bias, mlp_bias=bias))
    with torch.no_grad():
        for name, param in model.named_parameters():
            if name.endswith(".bias"):  # HF initialises biases to zero: make them count
                param.normal_(0.0, 0.1)
    model.save_pretrained(str(directory), **({"max_shard_size": shard} if shard else {}))
    return directory


def _convert(paths: dict, argvs: list[list[str]]) -> dict:
    """In one spawned process (megatron and transformers imported once): build the HF models, run
    tools/convert_hf.py main() per argv (and once sabotaged), and compute transformers' reference logits."""
    sys.path.insert(0, str(ROOT / "tools"))
    import convert_hf

    from training.interop.hf import check_tokens, reference_logits

    _hf_model(paths["hf"], tied=False, shard="100KB")  # sharded: several files + model.safetensors.index.json
    _hf_model(paths["hf_tied"], tied=True)
    _hf_model(paths["hf_bias"], tied=False, bias=True)  # q, k, v, o, gate, up, down biases
    results = [convert_main(convert_hf, argv) for argv in argvs]
    results.append(_sabotaged_import(convert_hf, ["import", "--hf-dir", str(paths["hf"]), "--out", str(paths["ckpt"]) +
                                                  "_bad", "--check", "--preset-out", str(paths["ckpt"]) + "_bad.yaml"]))
    tokens = check_tokens(VOCAB, ARCH["max_position_embeddings"])
    return {"cli": results, "tokens": tokens,
            "reference": {name: reference_logits(paths[name], tokens) for name in ("hf", "hf_tied", "exported")}}


def _sabotaged_import(convert_hf, argv: list[str]) -> tuple[int, str, str]:
    """import --check with q/k rows in the interleaved RoPE order (Meta's original checkpoints, a classic
    conversion bug) instead of HF's rotate_half order, which ours shares: the check must fail (exit 1)."""
    from models import attention

    original = attention.SelfAttention.from_hf

    def interleaved(get, config):
        hn = config.kv_channels
        order = torch.arange(hn).view(2, hn // 2).t().reshape(-1)  # [0, hn/2, 1, hn/2+1, ...]

        def permuted(name):
            tensor = get(name)
            return tensor.view(-1, hn, *tensor.shape[1:])[:, order].reshape(tensor.shape) if name[0] in "qk" else tensor
        return original(permuted, config)

    attention.SelfAttention.from_hf = staticmethod(interleaved)
    try:
        return convert_main(convert_hf, argv)
    finally:
        attention.SelfAttention.from_hf = staticmethod(original)


@pytest.fixture(scope="module")
def converted(tmp_path_factory):
    """Both HF models imported (--check), the untied one exported (--check) and re-imported."""
    root = tmp_path_factory.mktemp("hf")
    paths = {name: root / name for name in ("hf", "hf_tied", "hf_bias", "ckpt", "ckpt_tied", "exported", "ckpt2",
                                            "conf")}
    argvs = [["import", "--hf-dir", str(paths["hf"]), "--out", str(paths["ckpt"]), "--check",
              "--preset-out", str(paths["conf"] / "model" / "hf_llama.yaml")],
             ["import", "--hf-dir", str(paths["hf_tied"]), "--out", str(paths["ckpt_tied"]), "--check",
              "--preset-out", str(paths["conf"] / "model" / "hf_llama_tied.yaml")],
             ["export", "--ckpt", str(paths["ckpt"]), "--out", str(paths["exported"]), "--check"],
             ["import", "--hf-dir", str(paths["exported"]), "--out", str(paths["ckpt2"]),
              "--preset-out", str(root / "conf2" / "model" / "again.yaml")],
             ["import", "--hf-dir", str(paths["hf_bias"]), "--out", str(root / "ckpt_bias"), "--check",
              "--preset-out", str(paths["conf"] / "model" / "hf_llama_bias.yaml")],
             # refused before any work: a shape field is config.json's, not an override
             ["import", "--hf-dir", str(paths["hf"]), "--out", str(root / "refused"), "model.num_layers=2"]]
    (result,) = run_distributed(_convert, 1, (paths, argvs), timeout=300)
    return paths, result


def test_import_and_export_checks_pass(converted):
    paths, result = converted
    cli = result["cli"]
    for code, output, errors in cli[:5]:
        assert code == 0, output + errors
    diffs = {name: relative_diff(cli[i][1])
             for i, name in ((0, "import"), (1, "import tied"), (2, "export"), (4, "import biases"))}
    print(f"relative logits diff at tp1 (--check): {diffs}")
    assert all(d <= TOLERANCE for d in diffs.values()), diffs
    preset = (paths["conf"] / "model" / "hf_llama.yaml").read_text()
    for line in ("num_layers: 4", "num_attention_heads: 4", "num_query_groups: 2", "ffn_hidden_size: 96",
                 "vocab_size: 301", "rotary_base: 500000.0", "norm_epsilon: 1.0e-06", "tie_embeddings: false",
                 "normalization: RMSNorm", "activation: swiglu", "add_bias_linear: false", "name: hf_llama"):
        assert line in preset.splitlines(), line
    assert "tie_embeddings: true" in (paths["conf"] / "model" / "hf_llama_tied.yaml").read_text()
    run = json.loads((paths["ckpt"] / "iter_0000000" / "run.json").read_text())
    assert run["config"]["model"]["num_query_groups"] == 2 and run["vocab_size"] == VOCAB
    assert (paths["ckpt"] / "latest").read_text().strip() == "iter_0000000"
    code, output, _ = cli[6]  # q/k rows in the wrong RoPE order: the check fails
    print(f"sabotaged import: {output.strip().splitlines()[-1]}")
    assert code == 1 and "-> FAILED" in output and relative_diff(output) > 10 * TOLERANCE
    assert (paths["hf"] / "model.safetensors.index.json").is_file()  # the input was sharded
    assert "add_bias_linear: true" in (paths["conf"] / "model" / "hf_llama_bias.yaml").read_text()
    code, output, errors = cli[5]  # refused before any work
    assert code == 2 and "error: not overridable on import: ['model.num_layers']" in errors, errors
    assert not (paths["ckpt"].parent / "refused").exists()


def test_imported_model_matches_hf_logits_at_tp2_and_pp2(converted):
    """(tp1 is the import's own --check, above.) Tied embeddings at pp2: the last stage's output layer
    loads the first stage's embedding."""
    paths, result = converted
    jobs = [(f"{name} {layout}", str(paths["conf"]), str(paths[ckpt]), [f"model={preset}", override])
            for name, ckpt, preset in (("hf", "ckpt", "hf_llama"), ("hf_tied", "ckpt_tied", "hf_llama_tied"))
            for layout, override in (("tp2", "parallel.tp=2"), ("pp2", "parallel.pp=2"))]
    ranks = run_distributed(logits_at_layouts, 2, (jobs, result["tokens"]), timeout=300)
    diffs = {}
    for label, *_ in jobs:
        got = [r[label] for r in ranks if label in r]
        assert got, f"no rank returned logits for {label}"
        for other in got[1:]:  # both TP ranks hold the same gathered logits
            assert torch.equal(other, got[0]), label
        reference = result["reference"][label.split()[0]]
        assert got[0].shape == reference.shape == (2, 64, VOCAB)
        diffs[label] = ((got[0] - reference).abs().max() / reference.abs().max()).item()
    print(f"relative logits diff vs transformers: {diffs}")
    assert all(d <= TOLERANCE for d in diffs.values()), diffs


def test_export_round_trip_is_exact(converted):
    from safetensors.torch import load_file
    from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

    paths, result = converted
    original = {}
    for file in paths["hf"].glob("*.safetensors"):
        original.update(load_file(str(file)))
    exported = load_file(str(paths["exported"] / "model.safetensors"))
    assert sorted(exported) == sorted(original) and len(original) == 2 + 4 * 9 + 1
    for name, tensor in original.items():  # the HF weights come back bit for bit, vocab padding dropped
        assert exported[name].dtype == tensor.dtype and torch.equal(exported[name], tensor), name

    hf_config = json.loads((paths["hf"] / "config.json").read_text())
    back_config = json.loads((paths["exported"] / "config.json").read_text())
    for key in ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
                "num_key_value_heads", "rms_norm_eps", "max_position_embeddings", "tie_word_embeddings",
                "rope_parameters", "rope_theta", "head_dim", "model_type", "hidden_act"):
        assert back_config.get(key) == hf_config.get(key), key
    # from_pretrained(export) gives the original's logits exactly (the same weights, the same code)
    assert torch.equal(result["reference"]["exported"], result["reference"]["hf"])

    # import -> export -> import: every model tensor of the two checkpoints is identical (padding included)
    tensors = []
    for ckpt in ("ckpt", "ckpt2"):
        target = paths[ckpt].parent / f"{ckpt}.pt"
        dcp_to_torch_save(str(paths[ckpt] / "iter_0000000"), str(target))
        state = torch.load(target, weights_only=False)
        tensors.append({k: v for k, v in state.items() if isinstance(v, torch.Tensor)
                        and k.startswith(("embedding.", "decoder.", "output_layer."))})
    assert len(tensors[0]) == 2 + 4 * 6 + 1, sorted(tensors[0])  # embedding, 4 x 6 per layer, final norm, output
    assert sorted(tensors[0]) == sorted(tensors[1])
    for key, value in tensors[0].items():
        assert torch.equal(value, tensors[1][key]), key
    assert tensors[0]["embedding.word_embeddings.weight"].shape == (384, 64)  # 301 padded to 128 at tp1
    assert not tensors[0]["embedding.word_embeddings.weight"][VOCAB:].any()
