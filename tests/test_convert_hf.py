"""Hugging Face interop (tools/convert_hf.py): a small random HF Llama (GQA 4 heads / 2 KV heads, odd vocab 301:
padded to 384 at tp1, 512 at tp2; 4 layers, hidden 64; untied, tied, and with biases) is imported, checked against
transformers' logits at tp1 / tp2 / pp2, exported back, re-imported bit-identically, and fine-tuned with the
normal launch script. Nothing is downloaded: the HF models are built from a LlamaConfig and saved locally.

Logit differences are max |ours - HF| / max |HF| over the first vocab_size logits (padding excluded), fp32.
"""

import contextlib
import importlib.util
import io
import json
import math
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from harness import run_distributed

if importlib.util.find_spec("transformers") is None or importlib.util.find_spec("safetensors") is None:
    pytest.skip("needs the hf extra: pip install -e '.[hf]'", allow_module_level=True)

ROOT = Path(__file__).resolve().parents[1]
VOCAB = 301
TOLERANCE = 1e-4
ARCH = dict(vocab_size=VOCAB, hidden_size=64, intermediate_size=96, num_hidden_layers=4, num_attention_heads=4,
            num_key_value_heads=2, rope_theta=5e5, rms_norm_eps=1e-6, max_position_embeddings=128)


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
    results = [_main(convert_hf, argv) for argv in argvs]
    results.append(_sabotaged_import(convert_hf, ["import", "--hf-dir", str(paths["hf"]), "--out", str(paths["ckpt"]) +
                                                  "_bad", "--check", "--preset-out", str(paths["ckpt"]) + "_bad.yaml"]))
    tokens = check_tokens(VOCAB, ARCH["max_position_embeddings"])
    return {"cli": results, "tokens": tokens, "refusals": _refusals(), "mapping": _mapping_round_trips(),
            "reference": {name: reference_logits(paths[name], tokens) for name in ("hf", "hf_tied", "exported")}}


def _main(convert_hf, argv: list[str]) -> tuple[int, str, str]:
    """tools/convert_hf.py main(argv) in this process: (exit code, stdout, stderr)."""
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        code = convert_hf.main(argv)
    return code, out.getvalue(), err.getvalue()


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
        return _main(convert_hf, argv)
    finally:
        attention.SelfAttention.from_hf = staticmethod(original)


UNSUPPORTED = {"rope_scaling": dict(rope_scaling={"rope_type": "llama3", "factor": 8.0}),
               "model_type='qwen3'": dict(model_type="qwen3"), "hidden_act='gelu'": dict(hidden_act="gelu"),
               "mlp_bias=False": dict(attention_bias=True, mlp_bias=False)}


def _refusals() -> dict:
    """training.interop.hf.model_fields' error for each UNSUPPORTED change of a valid config.json."""
    from training.interop.hf import HFError, model_fields

    base = dict(ARCH, model_type="llama", hidden_act="silu", tie_word_embeddings=False)
    assert model_fields(base)["num_query_groups"] == 2
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
    for heads, groups, bias, tied in ((4, 1, False, True), (4, 4, True, False), (8, 2, True, True)):
        hn, h, ffn, vocab = 8, 32, 48, 101
        config = SimpleNamespace(num_layers=2, num_attention_heads=heads, num_query_groups=groups, kv_channels=hn,
                                 add_bias_linear=bias, gated_linear_unit=True, normalization="RMSNorm",
                                 tensor_model_parallel_size=2)
        shape = ModelShape.of(ModelConfig(num_layers=2, hidden_size=h, num_attention_heads=heads,
                                          num_query_groups=groups, kv_channels=hn, ffn_hidden_size=ffn,
                                          vocab_size=vocab, seq_length=16, add_bias_linear=bias,
                                          tie_embeddings=tied))
        shapes = {"model.embed_tokens.weight": (vocab, h), "model.norm.weight": (h,)}
        if not tied:
            shapes["lm_head.weight"] = (vocab, h)
        for i in range(2):
            for name, rows, cols in (("self_attn.q_proj", heads * hn, h), ("self_attn.k_proj", groups * hn, h),
                                     ("self_attn.v_proj", groups * hn, h), ("self_attn.o_proj", h, heads * hn),
                                     ("mlp.gate_proj", ffn, h), ("mlp.up_proj", ffn, h), ("mlp.down_proj", h, ffn)):
                shapes[f"model.layers.{i}.{name}.weight"] = (rows, cols)
                if bias:
                    shapes[f"model.layers.{i}.{name}.bias"] = (rows,)
            for name in ("input_layernorm", "post_attention_layernorm"):
                shapes[f"model.layers.{i}.{name}.weight"] = (h,)
        hf = {name: torch.randn(shape) for name, shape in shapes.items()}
        ours = dict(gpt_module.from_hf(hf.__getitem__, config, shape))
        assert ours["embedding.word_embeddings.weight"].shape == (256, h)  # 101 padded to 128 * tp 2
        back = dict(gpt_module.to_hf(ours.__getitem__, config, shape))
        out[f"np{heads} ng{groups} bias={bias} tied={tied}"] = sorted(
            set(hf) ^ set(back) | {n for n in hf if n in back and not torch.equal(hf[n], back[n])})
    return out


def _relative_diff(output: str) -> float:
    (value,) = re.findall(r"relative to max \|logit\| [0-9.]+: ([0-9.e+-]+)", output)
    return float(value)


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
    diffs = {name: _relative_diff(cli[i][1])
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
    assert code == 1 and "-> FAILED" in output and _relative_diff(output) > 10 * TOLERANCE
    assert (paths["hf"] / "model.safetensors.index.json").is_file()  # the input was sharded
    assert "add_bias_linear: true" in (paths["conf"] / "model" / "hf_llama_bias.yaml").read_text()
    code, output, errors = cli[5]  # refused before any work
    assert code == 2 and "error: not overridable on import: ['model.num_layers']" in errors, errors
    assert not (paths["ckpt"].parent / "refused").exists()


def _logits_at_layouts(jobs: list[tuple[str, str, str, list[str]]], tokens: torch.Tensor) -> dict:
    """For each (label, preset dir, checkpoint, overrides): load the checkpoint's weights at that layout (one
    2-process group; the model-parallel state is rebuilt per job) and return the gathered logits, if any."""
    from megatron.core import parallel_state

    from models.shape import ModelShape
    from training.checkpoint import torch_dist as checkpoint
    from training.config.compose import compose
    from training.engine.build import build
    from training.interop import hf
    from training.parallel import dist as D

    out = {}
    for label, conf, ckpt, overrides in jobs:
        cfg = compose([f"hydra.searchpath=[file://{conf}]", *overrides, "checkpoint.dir=null",
                       f"checkpoint.load={ckpt}", "checkpoint.finetune=true"])
        info = D.init(**{**D.layout_of(cfg), "timeout_minutes": 2})
        state = build(cfg, ModelShape.of(cfg.model), info.device)
        checkpoint.maybe_load(cfg, state)
        logits = hf.full_logits(state, tokens, cfg.model.vocab_size)
        if logits is not None:  # the last pipeline stage
            out[label] = logits
        parallel_state.destroy_model_parallel()
    D.teardown()
    return out


def test_imported_model_matches_hf_logits_at_tp2_and_pp2(converted):
    """(tp1 is the import's own --check, above.) Tied embeddings at pp2: the last stage's output layer
    loads the first stage's embedding."""
    paths, result = converted
    jobs = [(f"{name} {layout}", str(paths["conf"]), str(paths[ckpt]), [f"model={preset}", override])
            for name, ckpt, preset in (("hf", "ckpt", "hf_llama"), ("hf_tied", "ckpt_tied", "hf_llama_tied"))
            for layout, override in (("tp2", "parallel.tp=2"), ("pp2", "parallel.pp=2"))]
    ranks = run_distributed(_logits_at_layouts, 2, (jobs, result["tokens"]), timeout=300)
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


def test_finetune_with_launch_script_then_export_from_tp2(converted, tmp_path):
    from safetensors.torch import load_file

    paths, _ = converted
    run_dir = tmp_path / "run"
    env = dict(os.environ, NPROC="2", RUN_DIR=str(run_dir))
    overrides = [f"hydra.searchpath=[file://{paths['conf']}]", "model=hf_llama", "model.seq_length=64",
                 "parallel.tp=2", f"checkpoint.load={paths['ckpt']}", "checkpoint.finetune=true", "train.iters=8",
                 "train.log_interval=1", "train.eval_interval=0", "train.micro_batch_size=4",
                 "train.global_batch_size=8", "optim.warmup_iters=2", "train.tensorboard=false"]
    proc = subprocess.run(["launch/train.sh", *overrides], cwd=ROOT, env=env, capture_output=True, text=True,
                          timeout=300)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert "fine-tuning from the weights of" in proc.stdout
    records = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    losses = [r["loss"] for r in records if "loss" in r]
    print(f"fine-tune losses (byte data, tp2): {losses}")
    assert len(losses) == 8 and losses[0] > losses[-1], losses
    assert losses[0] == pytest.approx(math.log(VOCAB), rel=0.05)  # a random model starts near uniform

    # The fine-tuned checkpoint was saved at tp2: export (the real command) reshards it to tp1 and checks it.
    exported = tmp_path / "exported"
    proc = subprocess.run([sys.executable, "tools/convert_hf.py", "export", "--ckpt", str(run_dir / "checkpoints"),
                           "--out", str(exported), "--check", "--tokenizer-dir", str(paths["hf"])],
                          cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert "saved at tp/pp 2/1, iteration 8" in proc.stdout
    print(proc.stdout.strip().splitlines()[-1])
    assert _relative_diff(proc.stdout) <= TOLERANCE
    assert (exported / "generation_config.json").is_file()  # copied with --tokenizer-dir, and the special ids:
    assert json.loads((exported / "config.json").read_text())["eos_token_id"] == 2
    tuned, before = (load_file(str(d / "model.safetensors")) for d in (exported, paths["exported"]))
    assert not torch.equal(tuned["model.layers.0.mlp.up_proj.weight"], before["model.layers.0.mlp.up_proj.weight"])


def test_block_mappings_round_trip_for_mqa_gqa_mha_and_biases(converted):
    _, result = converted
    assert result["mapping"] and all(not bad for bad in result["mapping"].values()), result["mapping"]


def test_unsupported_hf_configs_are_refused(converted):
    _, result = converted
    for named in UNSUPPORTED:
        message = result["refusals"].get(named, "")
        assert "not a plain Llama-style decoder" in message and named in message, (named, message)


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
    cli = [_main(convert_hf, argv) for argv in (
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
    diffs = [_relative_diff(result["cli"][i][1]) for i in (0, 1)]
    assert all(d <= TOLERANCE for d in diffs), diffs
    assert torch.equal(result["reference"]["exported"], result["reference"]["hf"])
    preset = (tmp_path / "conf" / "model" / "hf_mixtral.yaml").read_text()
    assert "  num_experts: 4" in preset and "  top_k: 2" in preset
    for name in ("ckpt", "again"):
        dcp_to_torch_save(str(tmp_path / name / "iter_0000000"), str(tmp_path / f"{name}.pt"))
    first, again = (torch.load(tmp_path / f"{n}.pt", weights_only=False) for n in ("ckpt", "again"))
    assert set(first) == set(again) and all(torch.equal(first[k], again[k]) for k in first if torch.is_tensor(first[k]))

    jobs = [("ep2", str(tmp_path / "conf"), str(tmp_path / "ckpt"), ["model=hf_mixtral", "parallel.ep=2"])]
    logits = run_distributed(_logits_at_layouts, 2, (jobs, result["tokens"]), timeout=300)
    reference = result["reference"]["hf"]
    for rank_logits in logits:
        diff = ((rank_logits["ep2"] - reference).abs().max() / reference.abs().max()).item()
        assert diff <= TOLERANCE, diff
