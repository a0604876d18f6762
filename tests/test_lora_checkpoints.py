"""LoRA checkpoints (training/checkpoint/torch_dist.py, training/config/checkpoint_match.py): a LoRA fine-tune
from a base checkpoint saves its adapters and their optimizer state only, naming the base in run.json; a resumed
run takes the frozen weights from that base and continues bit for bit; a base that is missing, changed or not
the one the config names is refused in one line naming both. Its run also trains two base weights in full
(peft.trainable: a glob and an exact name): they change, have Adam moments, are saved with the adapters and come
back on resume."""

import json
import shutil
from pathlib import Path

import pytest
import torch
from harness import run_distributed

# peft.trainable: the final norm (a glob) and a linear's own weight beside its adapter (an exact name)
TRAINED = ("decoder.final_layernorm.weight", "decoder.layers.1.mlp.linear_fc2.weight")
LORA = ["peft=lora", "peft.rank=4", "peft.alpha=8", "optim.lr=1e-2", "train.save_interval=2", "checkpoint.keep=0"]
TRAINABLE = f"peft.trainable=['*final_layernorm*',{TRAINED[1]}]"  # _scenario's runs (export --adapter refuses it)


def _tensor_numel(path: Path) -> dict[str, int]:
    """Every tensor a torch_dist checkpoint holds: its key -> the number of elements (the global shape)."""
    import math

    from megatron.core import dist_checkpointing

    return {key: math.prod(t.global_shape) for key, t in dist_checkpointing.load_tensors_metadata(str(path)).items()}


def _tensors(path: Path, keys) -> dict[str, torch.Tensor]:
    """These tensors of a torch_dist checkpoint (torch.distributed.checkpoint's format), in their global shapes."""
    import torch.distributed.checkpoint as dcp
    from megatron.core import dist_checkpointing

    meta = dist_checkpointing.load_tensors_metadata(str(path))
    out = {key: torch.empty(meta[key].global_shape) for key in keys}
    dcp.load(out, checkpoint_id=str(path), no_dist=True)
    return out


def _scenario(root: str) -> dict:
    """A base run; a LoRA fine-tune from it (4 iterations, saves at 2 and 4); the same resumed from its
    iteration 2 in another run dir; then loads that must be refused: another base named, the base changed, the
    base gone."""
    from runs import QUICK, _train, losses, train_catching

    root = Path(root)
    _train([*QUICK, "train.iters=2"], str(root / "base"))
    _train([*QUICK, "train.iters=2", "train.seed=7"], str(root / "other"))
    base = root / "base" / "checkpoints" / "iter_0000002"
    shutil.copytree(base, root / "copy")  # a base that will change / disappear below
    tune = [*QUICK, *LORA, TRAINABLE, "train.iters=4", "checkpoint.finetune=true"]
    _train([*tune, f"checkpoint.load={base}"], str(root / "full"))
    first = root / "full" / "checkpoints" / "iter_0000002"
    _train([*QUICK, *LORA, TRAINABLE, "train.iters=4", f"checkpoint.load={first}"], str(root / "resumed"))
    _train([*tune, f"checkpoint.load={root / 'copy'}", "train.iters=2"], str(root / "on_copy"))
    out = {"full": losses(root / "full"), "resumed": losses(root / "resumed"),
           "numel": {k: _tensor_numel(p) for k, p in (("base", base), ("adapters", first))},
           "trained": {k: _tensors(p, TRAINED) for k, p in (("base", base), ("adapters", first))},
           "run": json.loads((first / "run.json").read_text())}
    again = [*tune, f"checkpoint.dir={root / 'full' / 'checkpoints'}"]  # resumes its own iteration 4
    out["other_base"] = train_catching([*again, f"checkpoint.load={root / 'other' / 'checkpoints'}",
                                        "train.iters=6"], str(root / "x1"))
    shutil.rmtree(root / "copy")
    shutil.copytree(root / "other" / "checkpoints" / "iter_0000002", root / "copy")
    resume_copy = [*QUICK, *LORA, TRAINABLE, "train.iters=3", f"checkpoint.load={root / 'on_copy' / 'checkpoints'}"]
    out["changed_base"] = train_catching(resume_copy, str(root / "x2"))
    shutil.rmtree(root / "copy")
    out["missing_base"] = train_catching(resume_copy, str(root / "x3"))
    return out


@pytest.fixture(scope="module")
def scenario(tmp_path_factory):
    return run_distributed(_scenario, 1, (str(tmp_path_factory.mktemp("lora_ckpt")),), timeout=600)[0]


def test_lora_checkpoint_holds_adapters_only_and_resumes_bit_exact(scenario):
    full, resumed = scenario["full"], scenario["resumed"]
    assert sorted(resumed) == [3, 4] and sorted(full) == [1, 2, 3, 4]
    assert {i: full[i] for i in resumed} == resumed  # exact: the base (and peft.trainable's) came back
    base, adapters = scenario["numel"]["base"], scenario["numel"]["adapters"]
    model = [k for k in adapters if not k.startswith("optimizer.")]
    assert model and all(k.endswith((".lora_a", ".lora_b")) for k in model if k not in TRAINED), model
    assert set(TRAINED) <= set(model) and all(adapters[k] == base[k] for k in TRAINED)  # whole, as the base's
    assert not [k for k in base if "lora_" in k]
    for key in TRAINED:  # peft.trainable's weights trained (the base's rest comes from the base, unchanged)
        assert not torch.equal(scenario["trained"]["adapters"][key], scenario["trained"]["base"][key]), key
    adapter_params = sum(adapters[k] for k in model)
    base_params = sum(n for k, n in base.items() if not k.startswith("optimizer."))
    # fp32 Adam: each trainable element (adapters and peft.trainable's) is saved with its two moments, in
    # either checkpoint; peft.trainable's weights are in the optimizer
    assert all(f"optimizer.state.{m}.{k}" in adapters for m in ("exp_avg", "exp_avg_sq") for k in TRAINED), adapters
    assert sum(adapters.values()) == 3 * adapter_params and sum(base.values()) == 3 * base_params
    record = scenario["run"]["peft_base"]
    assert record["path"].endswith("base/checkpoints/iter_0000002") and len(record["fingerprint"]) == 64
    # the files: 12 bytes (fp32 weight + 2 moments) a trainable element, plus what every checkpoint holds besides
    # (RNG states, scheduler, DCP's index: ~0.14 MiB here) no larger than the base's, but for DCP's ~0.5 KiB of
    # index and storage a tensor where it holds more tensors than the base (here 54 against 42)
    fixed = record["base_bytes"] - 12 * base_params + 1024 * max(0, len(adapters) - len(base))
    assert 0 < record["bytes"] - 12 * adapter_params <= fixed + 4096, (record, fixed)


def test_lora_checkpoint_refuses_another_base(scenario):
    other, changed, missing = scenario["other_base"], scenario["changed_base"], scenario["missing_base"]
    for line in (other, changed, missing):
        assert line.startswith("error: checkpoint ") and "\n" not in line, line
    assert "base/checkpoints/iter_0000002" in other and "other/checkpoints" in other, other
    assert "changed" in changed and "/copy" in changed and "on_copy/checkpoints" in changed, changed
    assert "missing" in missing and "/copy" in missing and "on_copy/checkpoints" in missing, missing


def _export_scenario(root: str) -> dict:
    """One process: a random HF Llama imported as the base, 3 LoRA steps from it (an adapters-only checkpoint),
    then tools/convert_hf.py export --adapter (--check against peft.PeftModel) and --merge (--check against
    transformers), and export without either (refused); the logits of base, base + adapter and merged model."""
    import sys

    import torch
    import transformers
    from hf_interop import ARCH, ROOT, VOCAB, convert_main
    from runs import QUICK, _train
    from safetensors.torch import load_file

    sys.path.insert(0, str(ROOT / "tools"))
    import convert_hf

    from training.interop.hf import check_tokens, reference_logits
    from training.interop.peft_export import peft_logits

    hf, root = f"{root}/hf", Path(root)
    torch.manual_seed(5)
    transformers.LlamaForCausalLM(transformers.LlamaConfig(**ARCH, tie_word_embeddings=False)).save_pretrained(hf)
    cli = {"import": convert_main(convert_hf, ["import", "--hf-dir", hf, "--out", f"{root}/base",
                                               "--preset-out", f"{root}/conf/model/hf_lora.yaml"])}
    _train([f"hydra.searchpath=[file://{root}/conf]", "model=hf_lora", *QUICK, "model.num_layers=4", *LORA,
            f"checkpoint.load={root}/base", "checkpoint.finetune=true", "train.iters=3", "checkpoint.dir=tuned"],
           str(root / "run"))
    tuned, check = str(root / "run" / "tuned"), ["--check", "--tolerance", "1e-5"]
    cli["adapter"] = convert_main(convert_hf, ["export", "--ckpt", tuned, "--out", f"{root}/adapter", "--adapter",
                                               "--base-hf-dir", hf, *check])
    cli["merge"] = convert_main(convert_hf, ["export", "--ckpt", tuned, "--out", f"{root}/merged", "--merge", *check])
    cli["plain"] = convert_main(convert_hf, ["export", "--ckpt", tuned, "--out", f"{root}/plain"])
    tokens = check_tokens(VOCAB, ARCH["max_position_embeddings"])
    return {"cli": cli, "tensors": load_file(f"{root}/adapter/adapter_model.safetensors"),
            "config": json.loads((root / "adapter" / "adapter_config.json").read_text()),
            "logits": {"base": reference_logits(hf, tokens), "peft": peft_logits(hf, root / "adapter", tokens),
                       "merged": reference_logits(root / "merged", tokens)}}


def test_lora_exports_as_a_peft_adapter_and_merged(tmp_path):
    """The PEFT adapter on the base in transformers, and the merged model, give our logits within 1e-5 (the
    --check lines); the adapter moved the logits far more than that (the check compares a trained adapter)."""
    from hf_interop import relative_diff

    out = run_distributed(_export_scenario, 1, (str(tmp_path),), timeout=600)[0]
    cli = out["cli"]
    assert cli["import"][0] == 0, cli["import"]
    for kind in ("adapter", "merge"):
        code, stdout, stderr = cli[kind]
        assert code == 0 and relative_diff(stdout) <= 1e-5, (kind, stdout, stderr[-2000:])
    assert cli["plain"][0] == 2 and "holds LoRA adapters" in cli["plain"][2] and "--adapter" in cli["plain"][2]
    logits = out["logits"]
    scale = logits["base"].abs().max()
    assert (logits["peft"] - logits["base"]).abs().max() > 1e-3 * scale  # the adapters are not a no-op
    assert (logits["merged"] - logits["peft"]).abs().max() <= 1e-5 * scale
    projections = {"self_attn": ("q_proj", "k_proj", "v_proj", "o_proj"), "mlp": ("gate_proj", "up_proj", "down_proj")}
    expected = {f"base_model.model.model.layers.{i}.{block}.{proj}.lora_{ab}.weight" for i in range(4)
                for block, projs in projections.items() for proj in projs for ab in "AB"}
    tensors = out["tensors"]
    assert set(tensors) == expected
    assert out["config"]["r"] == 4 and out["config"]["lora_alpha"] == 8 and out["config"]["peft_type"] == "LORA"
    assert sorted(out["config"]["target_modules"]) == sorted(p for projs in projections.values() for p in projs)
    first = "base_model.model.model.layers.0.self_attn."  # the fused QKV's one A, repeated per projection
    assert torch.equal(tensors[first + "q_proj.lora_A.weight"], tensors[first + "v_proj.lora_A.weight"])
