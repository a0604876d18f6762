"""Canonical LoRA (models/lora_split.py) against Hugging Face PEFT (training/interop/peft_import.py, peft_export.py):

- one step (forward, loss, backward) on one process equals peft.PeftModel's on a PEFT adapter with a different
  random A (and B) for every projection, q, k, v, o, gate, up and down: the loss and every adapter gradient, each
  projection's own A and B against PEFT's (tolerance 1e-5);
- tools/convert_hf.py import --adapter picks the form (canonical where the A's differ or only q_proj + v_proj are
  adapted, fused where they are equal, canonical there too when peft.targets says so), says which and why, and
  the export gives back the same tensors; a peft.targets the adapter cannot take is refused in one line;
- the import (saved at tp1, every B nonzero) loaded at tp2 + SP gives one process's logits: the keys reshard.
The adapted linear and the layouts: tests/test_lora_canonical.py."""

import json
from pathlib import Path

import pytest
import torch
from harness import run_distributed
from hf_interop import relative_diff
from layouts import max_rel_diff
from test_lora_canonical import CANONICAL, TARGETS

TOLERANCE = 1e-5


HF_NAMES = {"linear_q": "self_attn.q_proj", "linear_k": "self_attn.k_proj", "linear_v": "self_attn.v_proj",
            "linear_proj": "self_attn.o_proj", "linear_fc1_gate": "mlp.gate_proj", "linear_fc1_up": "mlp.up_proj",
            "linear_fc2": "mlp.down_proj"}  # our target -> PEFT's module (transformers' Llama names)
LORA = ["peft=lora", "peft.rank=4", "peft.alpha=8"]


def _peft_adapter(hf_dir: Path, out: Path, modules: list[str], seed: int) -> None:
    """A PEFT adapter as trained elsewhere: init_lora_weights=False draws every A and B at random (nn.Linear's
    init: each projection its own A, B nonzero)."""
    import transformers
    from peft import LoraConfig, get_peft_model

    torch.manual_seed(seed)
    base = transformers.AutoModelForCausalLM.from_pretrained(str(hf_dir), dtype=torch.float32)
    config = LoraConfig(r=4, lora_alpha=8, lora_dropout=0.0, target_modules=modules, init_lora_weights=False)
    get_peft_model(base, config).save_pretrained(str(out))


def _step(cfg, hf_dir: Path, adapter: Path, tokens, labels) -> dict:
    """Our step (one process) on the imported checkpoint vs PeftModel's on the adapter: the loss, every adapter
    gradient ({our name: relative difference}) and our logits (for the resharded load)."""
    import torch.nn.functional as F
    import transformers
    from peft import PeftModel

    from models.lora import is_adapter
    from models.shape import ModelShape
    from training import checkpoint
    from training.engine.build import build
    from training.interop import hf
    from training.parallel import dist as D
    from training.parallel.wrap import unwrap

    with D.distributed(tp=1, pp=1, seed=cfg.train.seed, timeout_minutes=2) as info:
        state = build(cfg, ModelShape.of(cfg.model), info.device, train=False)
        checkpoint.maybe_load(cfg, state)
        logits = hf.full_logits(state, tokens, cfg.model.vocab_size)
        gpt = unwrap(state.model[0])
        gpt.train()
        ours = gpt(tokens, labels=labels).float().mean()  # per-token losses [b, s]
        ours.backward()
        grads = {n: p.grad for n, p in gpt.named_parameters() if is_adapter(n)}
    base = transformers.AutoModelForCausalLM.from_pretrained(str(hf_dir), dtype=torch.float32)
    model = PeftModel.from_pretrained(base, str(adapter), is_trainable=True)
    model.train()
    theirs = F.cross_entropy(model(input_ids=tokens).logits.flatten(0, 1).float(), labels.flatten())
    theirs.backward()
    peft_grads = {n.replace(".default", ""): p.grad for n, p in model.named_parameters() if p.requires_grad}
    out = {"loss": abs(ours.item() - theirs.item()) / abs(theirs.item())}
    for name, grad in grads.items():  # decoder.layers.L.<block>.<linear>[.<part>].lora_a
        layer, target, ab = name.split(".")[2], name.split(".")[-2], name.split(".")[-1][-1].upper()
        key = f"base_model.model.model.layers.{layer}.{HF_NAMES[target]}.lora_{ab}.weight"
        out[name] = max_rel_diff(grad, peft_grads.pop(key))
    out["unmatched"] = sorted(peft_grads)  # PEFT adapters we have no gradient for
    return {"diffs": out, "logits": logits}


def _scenario(root: str) -> dict:
    """A random HF Llama (GQA) imported as the base; PEFT adapters (different A's: all seven projections; q_proj
    + v_proj only; A's made equal) imported (auto, and with peft.targets), exported back; one step vs PEFT."""
    import sys

    import transformers
    from hf_interop import ARCH, ROOT, convert_main
    from safetensors.torch import load_file, save_file

    sys.path.insert(0, str(ROOT / "tools"))
    import convert_hf

    from training.config.compose import compose

    root, out = Path(root), {"cli": {}}
    hf, base = root / "hf", root / "base"
    torch.manual_seed(5)
    transformers.LlamaForCausalLM(transformers.LlamaConfig(**ARCH, tie_word_embeddings=False)).save_pretrained(hf)
    assert convert_main(convert_hf, ["import", "--hf-dir", str(hf), "--out", str(base), "--preset-out",
                                     f"{root}/conf/model/canonical.yaml"])[0] == 0
    _peft_adapter(hf, root / "peft", [p.split(".")[-1] for p in HF_NAMES.values()], seed=7)
    _peft_adapter(hf, root / "qv", ["q_proj", "v_proj"], seed=8)
    same = load_file(str(root / "peft" / "adapter_model.safetensors"))  # the A's of q, k, v (gate, up) equal
    for key in [k for k in same if k.endswith(("k_proj.lora_A.weight", "v_proj.lora_A.weight"))]:
        same[key] = same[key.replace(key.split(".")[-3], "q_proj")].clone()
    for key in [k for k in same if k.endswith("up_proj.lora_A.weight")]:
        same[key] = same[key.replace("up_proj", "gate_proj")].clone()
    (root / "same").mkdir()
    save_file(same, str(root / "same" / "adapter_model.safetensors"), metadata={"format": "pt"})
    (root / "same" / "adapter_config.json").write_text((root / "peft" / "adapter_config.json").read_text())
    imports = {"peft": [], "qv": [], "same": [], "same-canonical": [TARGETS],  # refused: fused for different A's
               "refused": ["peft.targets=[linear_qkv,linear_proj,linear_fc1,linear_fc2]"]}
    for label, overrides in imports.items():
        source = root / label.split("-")[0].replace("refused", "peft")
        cli = convert_main(convert_hf, ["import", "--adapter", str(source), "--base", str(base), "--out",
                                        str(root / f"imported-{label}"), *overrides])
        out["cli"][label] = cli
        if cli[0] == 0:
            again = root / f"again-{label}"
            out["cli"][f"export-{label}"] = convert_main(convert_hf, ["export", "--ckpt",
                                                                      str(root / f"imported-{label}"), "--out",
                                                                      str(again), "--adapter"])
            out[label] = {"run": json.loads((root / f"imported-{label}" / "iter_0000000" / "run.json").read_text()),
                          "source": load_file(str(source / "adapter_model.safetensors")),
                          "again": load_file(str(again / "adapter_model.safetensors"))}
    out["cli"]["merge"] = convert_main(convert_hf, ["export", "--ckpt", str(root / "imported-peft"), "--out",
                                                    str(root / "merged"), "--merge", "--check"])  # transformers'
    g = torch.Generator().manual_seed(3)
    tokens, labels = torch.randint(0, ARCH["vocab_size"], (2, 16), generator=g), \
        torch.randint(0, ARCH["vocab_size"], (2, 16), generator=g)
    cfg = compose([f"hydra.searchpath=[file://{root}/conf]", "model=canonical", *LORA, TARGETS,
                   f"checkpoint.load={root / 'imported-peft'}", "checkpoint.finetune=true", "checkpoint.dir=null"])
    out["step"] = _step(cfg, hf, root / "peft", tokens, labels)
    out["tokens"] = tokens
    return out


@pytest.fixture(scope="module")
def scenario(tmp_path_factory):
    root = tmp_path_factory.mktemp("lora_canonical")
    return {**run_distributed(_scenario, 1, (str(root),), timeout=600)[0], "root": root}


def test_one_step_equals_peft_with_different_a(scenario):
    diffs = dict(scenario["step"]["diffs"])
    assert diffs.pop("unmatched") == []  # every PEFT adapter has its own A and B here, and each was compared
    assert len(diffs) == 1 + 4 * 7 * 2, sorted(diffs)  # the loss + 4 layers x 7 projections x (A, B)
    assert all(d <= TOLERANCE for d in diffs.values()), {k: f"{d:.2e}" for k, d in diffs.items() if d > TOLERANCE}


def test_peft_adapters_import_canonical_and_export_back(scenario):
    cli = scenario["cli"]
    for label in ("peft", "qv", "same", "same-canonical"):
        for step in (label, f"export-{label}"):
            assert cli[step][0] == 0, (step, cli[step][1][-2000:], cli[step][2][-2000:])
        first, again = scenario[label]["source"], scenario[label]["again"]
        assert set(first) == set(again) and all(torch.equal(first[k], again[k]) for k in first), label
    targets = {label: scenario[label]["run"]["config"]["peft"]["targets"] for label in ("peft", "qv", "same")}
    assert targets["peft"] == CANONICAL, targets
    assert targets["qv"] == ["linear_q", "linear_v"], targets
    assert targets["same"] == ["linear_qkv", "linear_proj", "linear_fc1", "linear_fc2"], targets
    assert scenario["same-canonical"]["run"]["config"]["peft"]["targets"] == CANONICAL
    said = {label: cli[label][1] for label in ("peft", "qv", "same", "same-canonical")}  # the choice, and why
    assert "linear_qkv as ['linear_q', 'linear_k', 'linear_v'] (lora_A of q_proj, k_proj, v_proj differ)" \
        in said["peft"]
    assert "linear_fc1 as ['linear_fc1_gate', 'linear_fc1_up'] (lora_A of gate_proj, up_proj differ)" in said["peft"]
    assert "linear_qkv as ['linear_q', 'linear_v'] (only q_proj, v_proj adapted)" in said["qv"]
    assert "linear_qkv fused (q_proj, k_proj, v_proj share one lora_A)" in said["same"]
    assert "(peft.targets names them)" in said["same-canonical"]
    code, output, err = cli["merge"]  # W + scale B_i A_i on each part's rows: transformers' logits = ours unmerged
    assert code == 0 and relative_diff(output) <= TOLERANCE, (output[-2000:], err[-2000:])
    code, _, err = cli["refused"]  # the fused form asked for an adapter whose A's differ
    line = err.strip().splitlines()[-1]
    assert code == 2 and line.startswith("error: peft.targets=") and "lora_A of q_proj, k_proj, v_proj differ" \
        in line, err


def test_import_loads_at_tp2_sp(scenario):
    """The tp1 import, its B's nonzero, loaded at tp2 + SP (its B_q / B_k / B_v / B_gate / B_up split from the
    saved whole tensors): one process's logits."""
    from hf_interop import logits_at_layouts

    root = scenario["root"]
    jobs = [("tp2-sp", f"{root}/conf", f"{root}/imported-peft", ["model=canonical", *LORA, TARGETS, "parallel.tp=2",
                                                                  "parallel.sp=true"])]
    logits = run_distributed(logits_at_layouts, 2, (jobs, scenario["tokens"]), timeout=300)[0]["tp2-sp"]
    assert max_rel_diff(logits, scenario["step"]["logits"]) <= TOLERANCE
