"""Sliding windows and where imports go (tools/convert_hf.py): a small random HF Mistral (window 16, every layer
windowed, as transformers' MistralForCausalLM) imports with its window (models/core_attention.py): transformers'
query at q sees keys q - window < k <= q, and ours too: the logits equal at seq = window and window + 1 (1e-5); a
longer model.seq_length is accepted at import and validation; greedy decoding past the window is transformers'
token for token; export writes the window back (MistralConfig).
An import into the default place (conf/model/local/, model=local/<name>) leaves the set of presets the suite
collects as it was. Refused bias combinations: tests/test_convert_hf_families.py.
"""

import contextlib
import importlib.util
import json
import re
import subprocess
import sys
import uuid
from pathlib import Path

import pytest
import torch
from harness import run_distributed
from hf_interop import ARCH, ROOT, VOCAB, convert_main, logits_at_layouts, relative_diff

if importlib.util.find_spec("transformers") is None or importlib.util.find_spec("safetensors") is None:
    pytest.skip("needs the hf extra: pip install -e '.[hf]'", allow_module_level=True)

WINDOW = 16  # < max_position_embeddings 128: the import's seq_length, which --check runs, passes the window
TOLERANCE = 1e-5
NEW = 12  # generated tokens after a prompt of WINDOW - 4: 8 past the window


def _mistral(root: str) -> dict:
    """One process: a random HF Mistral saved, imported (--check), imported again at seq window + 1,
    exported (--check); transformers' logits and ours on the same tokens at seq window and window + 1."""
    import transformers

    sys.path.insert(0, str(ROOT / "tools"))
    import convert_hf

    from training.interop.hf import reference_logits

    torch.manual_seed(17)
    model = transformers.MistralForCausalLM(transformers.MistralConfig(
        **ARCH, sliding_window=WINDOW, tie_word_embeddings=False))
    with torch.no_grad():
        for param in model.parameters():
            if param.dim() == 1:  # the norms: random around 1 (transformers sets them to 1)
                param.normal_(1.0, 0.2)
    hf_dir = Path(root) / "hf"
    model.save_pretrained(str(hf_dir))
    conf = Path(root) / "conf"
    cli = {name: convert_main(convert_hf, argv) for name, argv in (
        ("import", ["import", "--hf-dir", str(hf_dir), "--out", f"{root}/ckpt", "--check", "--tolerance",
                    str(TOLERANCE), "--preset-out", str(conf / "model" / "hf_mistral.yaml")]),
        ("too long", ["import", "--hf-dir", str(hf_dir), "--out", f"{root}/longer", "--preset-out",
                      f"{root}/longer.yaml", f"model.seq_length={WINDOW + 1}"]),
        ("export", ["export", "--ckpt", f"{root}/ckpt", "--out", f"{root}/exported", "--check", "--tolerance",
                    str(TOLERANCE)]))}
    tokens = torch.randint(0, VOCAB, (2, WINDOW + 1), generator=torch.Generator().manual_seed(1))
    out = {"cli": cli, "ours": {}, "hf": {}, "exported": {}}
    for seq in (WINDOW, WINDOW + 1):
        out["hf"][seq] = reference_logits(hf_dir, tokens[:, :seq])
        out["exported"][seq] = reference_logits(Path(root) / "exported", tokens[:, :seq])
        job = ("tp1", str(conf), f"{root}/ckpt", ["model=hf_mistral"])
        out["ours"][seq] = logits_at_layouts([job], tokens[:, :seq])["tp1"]
    prompt = tokens[0, :WINDOW - 4].tolist()  # greedy decoding 12 tokens: 8 past the window
    model.eval()
    out["hf_generated"] = model.generate(torch.tensor([prompt]), attention_mask=torch.ones(1, len(prompt)).long(),
                                         max_new_tokens=NEW, min_new_tokens=NEW, do_sample=False, pad_token_id=0)
    out["generated"] = _generate(f"{root}/ckpt", prompt)
    return out


def _generate(ckpt: str, prompt: list[int]) -> list[int]:
    """Ours: the greedy continuation of prompt, past the window (the KV cache's masks narrowed to it)."""
    from megatron.core import parallel_state

    from training.interop.generation import Sampling, generate, inference_config, load_model
    from training.parallel import dist as D

    cfg, shape, _ = inference_config(ckpt, [])
    info = D.init(**{**D.layout_of(cfg), "timeout_minutes": 2})
    state = load_model(cfg, shape, info.device)
    (generated,) = generate(state, [prompt], NEW, Sampling(greedy=True), eod=-1, device=info.device)
    parallel_state.destroy_model_parallel()
    D.teardown()
    return generated


@pytest.fixture(scope="module")
def mistral(tmp_path_factory):
    root = tmp_path_factory.mktemp("mistral")
    (result,) = run_distributed(_mistral, 1, (str(root),), timeout=600)
    return root, result


def _relative(ours: torch.Tensor, reference: torch.Tensor) -> float:
    return ((ours - reference).abs().max() / reference.abs().max()).item()


def test_sliding_window_imports_and_equals_transformers_past_the_window(mistral):
    root, result = mistral
    for name in ("import", "export"):
        code, output, errors = result["cli"][name]
        assert code == 0 and relative_diff(output) <= TOLERANCE, output + errors
    preset = (root / "conf" / "model" / "hf_mistral.yaml").read_text().splitlines()
    assert f"sliding_window: {WINDOW}" in preset and "seq_length: 128" in preset  # not capped at the window
    assert "max_position_embeddings: 128" in preset
    ours, hf = result["ours"], result["hf"]
    at_window, past = _relative(ours[WINDOW], hf[WINDOW]), _relative(ours[WINDOW + 1], hf[WINDOW + 1])
    head = _relative(ours[WINDOW + 1][:, :WINDOW], hf[WINDOW + 1][:, :WINDOW])
    last = _relative(ours[WINDOW + 1][:, WINDOW:], hf[WINDOW + 1][:, WINDOW:])
    print(f"relative logits diff vs transformers' Mistral (window {WINDOW}): seq {WINDOW} {at_window:.2e}; "
          f"seq {WINDOW + 1}: first {WINDOW} positions {head:.2e}, the last {last:.2e}")
    assert at_window <= TOLERANCE and head <= TOLERANCE and past <= TOLERANCE, (at_window, head, past)
    assert last <= TOLERANCE, last  # position `window` no longer sees token 0, in transformers and ours


def test_greedy_generation_past_the_window_is_transformers_token_for_token(mistral):
    _, result = mistral
    assert result["generated"] == result["hf_generated"][0, WINDOW - 4:].tolist()
    assert len(result["generated"]) == NEW


def test_export_writes_the_window_back(mistral):
    root, result = mistral
    config = json.loads((root / "exported" / "config.json").read_text())
    assert (config["model_type"], config["sliding_window"], config["architectures"]) == (
        "mistral", WINDOW, ["MistralForCausalLM"])
    for seq in (WINDOW, WINDOW + 1):  # the exported model windows as the original does (past it too)
        assert torch.equal(result["exported"][seq], result["hf"][seq]), seq


def test_a_sequence_past_the_window_is_accepted_at_import_and_validation(mistral):
    root, result = mistral
    code, output, errors = result["cli"]["too long"]
    assert code == 0 and (root / "longer").is_dir(), output + errors

    from training.config.compose import compose
    from training.config.validate import problems

    base = [f"hydra.searchpath=[file://{root}/conf]", "model=hf_mistral", "checkpoint=none"]
    imported = compose(base)
    assert imported.model.seq_length == 128 and not problems(imported, 1)
    assert not problems(compose([*base, f"model.seq_length={4 * WINDOW}"]), 1)


def _collected_presets() -> list[str]:
    """The test ids of the test files that enumerate the config folders (training.config.compose.CONF_DIR)."""
    files = [str(p) for p in sorted((ROOT / "tests").glob("test_*.py")) if "CONF_DIR" in p.read_text()]
    assert len(files) >= 2, files  # test_config.py, test_model_spec.py
    run = subprocess.run([sys.executable, "-m", "pytest", "--collect-only", "-q", "-p", "no:cacheprovider", *files],
                         cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stdout + run.stderr
    return sorted(line for line in run.stdout.splitlines() if "::" in line)


def test_an_import_into_the_default_place_is_not_collected_by_the_suite(mistral, tmp_path):
    """The user's import (no --preset-out) lands in conf/model/local/, git-ignored; model=local/<name> selects it."""
    from training.config.compose import compose

    root, _ = mistral
    name = f"pytest_{uuid.uuid4().hex[:8]}"
    local = ROOT / "conf" / "model" / "local" / f"{name}.yaml"
    before, written = _collected_presets(), None
    try:
        run = subprocess.run([sys.executable, "tools/convert_hf.py", "import", "--hf-dir", str(root / "hf"),
                              "--out", str(tmp_path / "ckpt"), "--name", name], cwd=ROOT, capture_output=True,
                             text=True, timeout=300)
        written = Path(re.search(r", preset (\S+)\n", run.stdout).group(1)) if run.returncode == 0 else None
        assert written is not None and written.is_file(), run.stdout + run.stderr
        after = _collected_presets()
        assert after == before, sorted(set(after) ^ set(before))
        assert written == local, written
        assert f"train it with: model=local/{name} checkpoint.load={tmp_path / 'ckpt'}" in run.stdout, run.stdout
        cfg = compose([f"model=local/{name}"])
        assert (cfg.model.name, cfg.model.sliding_window) == (name, WINDOW)
        ignored = subprocess.run(["git", "check-ignore", "-q", str(local)], cwd=ROOT)
        assert ignored.returncode == 0, f"{local} is not git-ignored"
    finally:
        for path in {local, written} - {None}:
            path.unlink(missing_ok=True)
        with contextlib.suppress(OSError):  # the folder, when this test made it
            local.parent.rmdir()
