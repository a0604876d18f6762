"""LoRA checkpoints and Hugging Face interop at layouts other than tp1 (training/checkpoint/torch_dist.py,
training/interop/peft_export.py, peft_import.py, training/config/checkpoint_match.py), from two training runs:

- a LoRA fine-tune at tp2 of an imported HF Llama (adapters-only saves at iterations 2 and 4) and one at pp2
  (saved at 2); at each save the run's own adapters (gathered from its ranks) and logits are recorded;
- iteration 2 of tp2 resumed at tp1: its adapters after the load are the tp2 run's, bit for bit (the fused QKV's
  and SwiGLU fc1's B resharded from two ranks), and its losses those of the tp2 run within 1e-6; resumed at tp2:
  bit for bit;
- tools/convert_hf.py export --adapter / --merge of the tp2 and pp2 checkpoints: the exported tensors are the
  run's adapters exactly (q/k/v and gate/up fused back), the PEFT adapter on the transformers base and the merged
  model give the run's own logits within 1e-5; import --adapter of the tp2 export, exported again: the same tensors;
- the tp2 checkpoint loaded with peft=none (fine-tune or resume): refused in one line naming peft.method and the
  overrides to pass, by tools/check_config.py (before torchrun) and by the ranks.
"""

from pathlib import Path

import pytest
import torch
from harness import run_distributed

TOLERANCE = 1e-5  # the logits of an export against the run's own (the --check lines' tolerance)
LORA = ["peft=lora", "peft.rank=4", "peft.alpha=8", "optim.lr=1e-2", "checkpoint.keep=0"]


def _common(root: str) -> list[str]:
    from runs import QUICK

    return [f"hydra.searchpath=[file://{root}/conf]", "model=hf_lora", *QUICK, "model.num_layers=4"]


def _import_base(root: str) -> tuple:
    """A random transformers Llama (untied), imported as the base checkpoint."""
    import sys

    import transformers
    from hf_interop import ARCH, ROOT, convert_main

    sys.path.insert(0, str(ROOT / "tools"))
    import convert_hf

    torch.manual_seed(5)
    transformers.LlamaForCausalLM(transformers.LlamaConfig(**ARCH, tie_word_embeddings=False)).save_pretrained(
        f"{root}/hf")
    return convert_main(convert_hf, ["import", "--hf-dir", f"{root}/hf", "--out", f"{root}/base",
                                     "--preset-out", f"{root}/conf/model/hf_lora.yaml"])


def _adapters(state) -> dict:
    """This rank's adapters by their single-process names, tagged as layouts.assemble glues them."""
    from layouts import global_name
    from megatron.core import parallel_state as ps

    from models.lora import is_adapter
    from training.parallel.wrap import unwrap

    tp, out = (ps.get_tensor_model_parallel_rank(), ps.get_tensor_model_parallel_world_size()), {}
    for chunk in state.model:
        gpt = unwrap(chunk)
        for name, p in gpt.named_parameters():
            if is_adapter(name):
                split = getattr(p, "tensor_model_parallel", False)
                out[global_name(gpt, name)] = [(*tp, p.partition_dim if split else None,
                                                p.partition_stride if split else 1, p.detach().clone())]
    return out


def _recording_saves(seen: dict) -> None:
    """Wrap torch_dist.save: before each save, the run's adapters and its logits on the check tokens, into
    seen[seen["run"]][iter_*]."""
    from hf_interop import ARCH, VOCAB

    from training.checkpoint import torch_dist
    from training.interop.hf import check_tokens, full_logits

    real = torch_dist.save

    def save(cfg, state, path, *args, **kwargs):
        logits = full_logits(state, check_tokens(VOCAB, ARCH["max_position_embeddings"]), VOCAB)
        for chunk in state.model:
            chunk.train()  # full_logits left it in eval mode
        seen[seen["run"]][Path(path).name] = {"adapters": _adapters(state), "logits": logits}
        return real(cfg, state, path, *args, **kwargs)

    torch_dist.save = save


def _two_ranks(root: str) -> dict:
    """tp2 (4 iterations, saves at 2 and 4), tp2 resumed from its iteration 2, pp2 (2 iterations)."""
    from runs import _train, losses

    common, base = [*_common(root), *LORA], [f"checkpoint.load={root}/base", "checkpoint.finetune=true"]
    out = {"tp2": {}, "pp2": {}, "run": "tp2"}
    _recording_saves(out)
    _train([*common, *base, "parallel.tp=2", "train.iters=4", "train.save_interval=2", "checkpoint.dir=ckpt"],
           f"{root}/tp2")
    _train([*common, "parallel.tp=2", "train.iters=4", f"checkpoint.load={root}/tp2/ckpt/iter_0000002",
            "checkpoint.dir=null"], f"{root}/tp2_resumed")
    out["run"] = "pp2"
    _train([*common, *base, "parallel.pp=2", "train.iters=2", "checkpoint.dir=ckpt"], f"{root}/pp2")
    out["losses"] = {run: losses(Path(root) / run) for run in ("tp2", "tp2_resumed")}
    return out


def _one_process(root: str) -> dict:
    """tp2's iteration 2 resumed at tp1 (its adapters right after the load); the exports of the tp2 and pp2
    checkpoints and their logits; the import --adapter round trip; the loads with peft=none."""
    import contextlib
    import io
    import sys

    from hf_interop import ARCH, ROOT, VOCAB, convert_main
    from runs import _train, losses, train_catching
    from safetensors.torch import load_file

    sys.path.insert(0, str(ROOT / "tools"))
    import check_config
    import convert_hf

    from training import checkpoint
    from training.interop.hf import check_tokens, reference_logits
    from training.interop.peft_export import peft_logits

    tp2, hf, out = f"{root}/tp2/ckpt/iter_0000002", f"{root}/hf", {"cli": {}, "tensors": {}, "logits": {}}
    real = checkpoint.maybe_load

    def maybe_load(cfg, state, *args, **kwargs):
        start = real(cfg, state, *args, **kwargs)
        out["loaded"] = {name: parts[0][-1] for name, parts in _adapters(state).items()}
        return start

    checkpoint.maybe_load = maybe_load
    _train([*_common(root), *LORA, "train.iters=4", f"checkpoint.load={tp2}", "checkpoint.dir=null"], f"{root}/tp1")
    out["losses"] = losses(Path(root) / "tp1")
    checkpoint.maybe_load = real
    tokens = check_tokens(VOCAB, ARCH["max_position_embeddings"])
    out["logits"]["base"] = reference_logits(hf, tokens)
    for label, ckpt in (("tp2", f"{root}/tp2/ckpt/iter_0000004"), ("pp2", f"{root}/pp2/ckpt/iter_0000002")):
        check = ["--check", "--tolerance", str(TOLERANCE)]
        adapter, merged = f"{root}/export_{label}", f"{root}/merged_{label}"
        out["cli"][label] = [convert_main(convert_hf, ["export", "--ckpt", ckpt, "--out", adapter, "--adapter",
                                                       "--base-hf-dir", hf, *check]),
                             convert_main(convert_hf, ["export", "--ckpt", ckpt, "--out", merged, "--merge", *check])]
        out["tensors"][label] = load_file(f"{adapter}/adapter_model.safetensors")
        out["logits"][label] = {"peft": peft_logits(hf, Path(adapter), tokens),
                                "merged": reference_logits(merged, tokens)}
    out["cli"]["round_trip"] = [
        convert_main(convert_hf, ["import", "--adapter", f"{root}/export_tp2", "--base", f"{root}/base", "--out",
                                  f"{root}/imported"]),
        convert_main(convert_hf, ["export", "--ckpt", f"{root}/imported", "--out", f"{root}/again", "--adapter"])]
    out["tensors"]["again"] = load_file(f"{root}/again/adapter_model.safetensors")
    without = [*_common(root), "train.iters=1", f"checkpoint.load={tp2}", "checkpoint.dir=null"]
    out["refused"] = {}
    for kind, extra in (("finetune", ["checkpoint.finetune=true"]), ("resume", [])):
        err = io.StringIO()
        with contextlib.redirect_stderr(err):
            code = check_config.main([*without, *extra])
        try:  # any failure but the one-line refusal comes back as its text (the other tests still run)
            ranks = train_catching([*without, *extra], f"{root}/refused_{kind}")
        except Exception as crash:  # noqa: BLE001
            ranks = f"{type(crash).__name__}: {crash}"
        out["refused"][kind] = {"check_config": (code, err.getvalue()), "ranks": ranks}
    return out


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    from layouts import assemble

    root = str(tmp_path_factory.mktemp("lora_layouts"))
    imported = run_distributed(_import_base, 1, (root,), timeout=300)[0]
    assert imported[0] == 0, imported
    ranks = run_distributed(_two_ranks, 2, (root,), timeout=600)
    single = run_distributed(_one_process, 1, (root,), timeout=600)[0]
    saved = {}  # (layout, iter_*) -> {"adapters": gathered, "logits": the last stage's}
    for layout in ("tp2", "pp2"):
        for name in ranks[0][layout]:
            parts: dict[str, list] = {}
            for r in ranks:
                for key, tagged in r[layout][name]["adapters"].items():
                    parts.setdefault(key, []).extend(tagged)
            logits = next(r[layout][name]["logits"] for r in ranks if r[layout][name]["logits"] is not None)
            saved[layout, name] = {"adapters": {k: assemble(p, None) for k, p in parts.items()}, "logits": logits}
    return {"saved": saved, "losses": {**ranks[0]["losses"], "tp1": single["losses"]}, "single": single}


def test_lora_tp2_checkpoint_resumes_at_tp1_exactly_and_at_tp2_bit_exact(runs):
    """The adapters-only checkpoint saved at tp2 loads at tp1 with the run's adapters bit for bit; its losses
    continue the tp2 run's (another layout: within 1e-6); resumed at tp2 they are the same floats."""
    saved, loaded = runs["saved"]["tp2", "iter_0000002"]["adapters"], runs["single"]["loaded"]
    assert len(saved) == 4 * 4 * 2 and set(loaded) == set(saved)  # 4 layers x 4 linears x (A, B)
    differ = {k: (loaded[k] - saved[k]).abs().max().item() for k in saved if not torch.equal(loaded[k], saved[k])}
    assert not differ, differ
    assert any(saved[k].abs().max() > 0 for k in saved if k.endswith("linear_fc1.lora_b"))  # B trained (nonzero)
    tp2, tp1, again = (runs["losses"][k] for k in ("tp2", "tp1", "tp2_resumed"))
    assert sorted(tp1) == sorted(again) == [3, 4] and sorted(tp2) == [1, 2, 3, 4]
    assert {i: tp2[i] for i in again} == again
    assert all(abs(tp1[i] - tp2[i]) <= 1e-6 * abs(tp2[i]) for i in tp1), (tp1, tp2)


@pytest.mark.parametrize("layout", ["tp2", "pp2"])
def test_lora_export_of_a_tp2_or_pp2_checkpoint_gives_the_runs_logits(runs, layout):
    """export --adapter writes the run's adapters exactly (q/k/v and gate/up fused back: test_lora_peft.py's
    mapping); PEFT on the transformers base and the merged export give the run's own logits (computed at its
    layout when it saved) within 1e-5, and the adapters move them by far more."""
    from hf_interop import relative_diff

    from training.interop.peft_export import PROJECTIONS
    from training.interop.peft_import import fuse_b

    single = runs["single"]
    for code, stdout, stderr in single["cli"][layout]:
        assert code == 0 and relative_diff(stdout) <= TOLERANCE, (stdout, stderr[-2000:])
    saved = runs["saved"][layout, "iter_0000004" if layout == "tp2" else "iter_0000002"]
    tensors, adapters = single["tensors"][layout], saved["adapters"]
    config = type("Config", (), {"num_query_groups": 2, "kv_channels": 16})  # hf_interop.ARCH: 2 groups, 64 / 4
    for name in {k.rsplit(".", 1)[0] for k in adapters}:
        _, _, layer, block, linear = name.split(".")
        prefix = f"base_model.model.model.layers.{layer}.{dict(self_attention='self_attn', mlp='mlp')[block]}."
        a = [tensors[f"{prefix}{p}.lora_A.weight"] for p in PROJECTIONS[linear]]
        b = fuse_b(linear, [tensors[f"{prefix}{p}.lora_B.weight"] for p in PROJECTIONS[linear]], config)
        assert all(torch.equal(x, adapters[f"{name}.lora_a"]) for x in a), name
        assert torch.equal(b, adapters[f"{name}.lora_b"]), name
    ours, base = saved["logits"], single["logits"]["base"]
    scale = ours.abs().max()
    assert (ours - base).abs().max() > 1e-3 * scale  # the adapters are not a no-op
    for kind, theirs in single["logits"][layout].items():
        assert (theirs - ours).abs().max() <= TOLERANCE * scale, (kind, ((theirs - ours).abs().max() / scale).item())


def test_lora_adapter_of_a_tp2_run_imports_and_exports_unchanged(runs):
    single = runs["single"]
    for code, stdout, stderr in single["cli"]["round_trip"]:
        assert code == 0, (stdout[-2000:], stderr[-2000:])
    first, again = single["tensors"]["tp2"], single["tensors"]["again"]
    assert set(first) == set(again) and all(torch.equal(first[k], again[k]) for k in first)


@pytest.mark.parametrize("kind", ["finetune", "resume"])
def test_lora_checkpoint_loaded_without_peft_is_refused(runs, kind):
    """peft=none on an adapters-only checkpoint (the adapters would be dropped, the base's weights never loaded):
    one line naming peft.method and the overrides that load it, before torchrun (check_config) and on the ranks."""
    refused = runs["single"]["refused"][kind]
    code, stderr = refused["check_config"]
    lines = stderr.strip().splitlines()
    assert code == 2 and len(lines) == 1, stderr
    for line in (lines[0], refused["ranks"]):
        assert line.startswith("error: checkpoint ") and "tp2/ckpt/iter_0000002" in line, line
        assert "peft.method=lora (this run: none)" in line, line
        assert "pass peft=lora peft.rank=4 peft.alpha=8 'peft.targets=[linear_fc1,linear_fc2,linear_proj,linear_qkv]'" \
            in line, line


@pytest.mark.fast
def test_lora_checkpoint_refused_with_other_peft_settings():
    """training/config/checkpoint_match.py peft_problem: a checkpoint's adapters load only with its method, rank,
    alpha (their scale: another would silently change the model) and targets (in any order); dropout may differ;
    a checkpoint without adapters (a base) takes any."""
    from training.config.checkpoint_match import peft_problem
    from training.config.compose import compose

    targets = ["linear_qkv", "linear_proj", "linear_fc1", "linear_fc2"]
    run = {"config": {"peft": {"method": "lora", "rank": 4, "alpha": 8.0, "dropout": 0.0, "targets": targets}}}
    problem = lambda *o: peft_problem(run, compose(list(o)), Path("/ckpt/iter_0000002"))  # noqa: E731
    lora = ["peft=lora", "peft.rank=4", "peft.alpha=8"]
    assert problem(*lora) is None and problem(*lora, "peft.dropout=0.1") is None
    assert problem(*lora, "peft.targets=[linear_fc2,linear_fc1,linear_proj,linear_qkv]") is None
    assert peft_problem({"config": {"peft": {"method": "none"}}}, compose([]), Path("/base")) is None
    assert peft_problem({"config": {}}, compose(lora), Path("/base")) is None  # written before peft existed
    give = "pass peft=lora peft.rank=4 peft.alpha=8 'peft.targets=[linear_fc1,linear_fc2,linear_proj,linear_qkv]'"
    for overrides, differ in (([], "peft.method=lora (this run: none)"),
                              (["peft=lora", "peft.alpha=8"], "peft.rank=4 (this run: 8)"),
                              (["peft=lora", "peft.rank=4"], "peft.alpha=8 (this run: 16)"),
                              ([*lora, "peft.targets=[linear_qkv]"], "peft.targets=[linear_fc1,linear_fc2,"
                                                                      "linear_proj,linear_qkv] (this run: "
                                                                      "[linear_qkv])")):
        line = problem(*overrides)
        assert line.startswith("checkpoint /ckpt/iter_0000002 holds LoRA adapters trained with ") and "\n" not in line
        assert differ in line and give in line, (overrides, line)
