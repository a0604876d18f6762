"""Sliding windows and where imports go (tools/convert_hf.py): a small random HF Mistral (window 16, every layer
windowed, as transformers' MistralForCausalLM) imports as full attention. transformers' query at q sees keys
q - window < k <= q, so at seq = window the logits equal ours (1e-5) and at seq = window + 1 only the last
position differs; a longer model.seq_length is refused in one line at import and at train time, generation past
the window too (greedy decoding up to it is transformers'); export writes the window back (MistralConfig).
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

WINDOW = 16  # < max_position_embeddings 128: the import's seq_length is the window
TOLERANCE = 1e-5


def _mistral(root: str) -> dict:
    """One process: a random HF Mistral saved, imported (--check), imported again at seq window + 1 (refused),
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
        ("too long", ["import", "--hf-dir", str(hf_dir), "--out", f"{root}/refused", "--preset-out",
                      f"{root}/refused.yaml", f"model.seq_length={WINDOW + 1}"]),
        ("export", ["export", "--ckpt", f"{root}/ckpt", "--out", f"{root}/exported", "--check", "--tolerance",
                    str(TOLERANCE)]))}
    tokens = torch.randint(0, VOCAB, (2, WINDOW + 1), generator=torch.Generator().manual_seed(1))
    out = {"cli": cli, "ours": {}, "hf": {}, "exported": {}}
    for seq in (WINDOW, WINDOW + 1):
        out["hf"][seq] = reference_logits(hf_dir, tokens[:, :seq])
        out["exported"][seq] = reference_logits(Path(root) / "exported", tokens[:, :seq])
        job = ("tp1", str(conf), f"{root}/ckpt", ["model=hf_mistral"])
        out["ours"][seq] = logits_at_layouts([job], tokens[:, :seq])["tp1"]
    prompt = tokens[0, :WINDOW - 4].tolist()  # greedy decoding up to the window, then one token past it
    model.eval()
    out["hf_generated"] = model.generate(torch.tensor([prompt]), attention_mask=torch.ones(1, len(prompt)).long(),
                                         max_new_tokens=4, min_new_tokens=4, do_sample=False, pad_token_id=0)
    out["generated"], out["refused"] = _generate(f"{root}/ckpt", prompt)
    return out


def _generate(ckpt: str, prompt: list[int]) -> tuple[list[int], str]:
    """Ours: the greedy continuation of prompt up to the window, and the error past it."""
    from megatron.core import parallel_state

    from training.errors import ConfigError
    from training.interop.generation import Sampling, generate, inference_config, load_model
    from training.parallel import dist as D

    cfg, shape, _ = inference_config(ckpt, [])
    info = D.init(**{**D.layout_of(cfg), "timeout_minutes": 2})
    state = load_model(cfg, shape, info.device)
    (generated,) = generate(state, [prompt], 4, Sampling(greedy=True), eod=-1, device=info.device)
    try:
        generate(state, [prompt], 5, Sampling(greedy=True), eod=-1, device=info.device)
        refused = ""
    except ConfigError as err:
        refused = str(err)
    parallel_state.destroy_model_parallel()
    D.teardown()
    return generated, refused


@pytest.fixture(scope="module")
def mistral(tmp_path_factory):
    root = tmp_path_factory.mktemp("mistral")
    (result,) = run_distributed(_mistral, 1, (str(root),), timeout=600)
    return root, result


def _relative(ours: torch.Tensor, reference: torch.Tensor) -> float:
    return ((ours - reference).abs().max() / reference.abs().max()).item()


def test_sliding_window_imports_as_full_attention_up_to_the_window(mistral):
    root, result = mistral
    for name in ("import", "export"):
        code, output, errors = result["cli"][name]
        assert code == 0 and relative_diff(output) <= TOLERANCE, output + errors
    preset = (root / "conf" / "model" / "hf_mistral.yaml").read_text().splitlines()
    assert f"sliding_window: {WINDOW}" in preset and f"seq_length: {WINDOW}" in preset  # min(128, window)
    assert "max_position_embeddings: 128" in preset
    ours, hf = result["ours"], result["hf"]
    at_window, past = _relative(ours[WINDOW], hf[WINDOW]), _relative(ours[WINDOW + 1], hf[WINDOW + 1])
    head = _relative(ours[WINDOW + 1][:, :WINDOW], hf[WINDOW + 1][:, :WINDOW])
    last = _relative(ours[WINDOW + 1][:, WINDOW:], hf[WINDOW + 1][:, WINDOW:])
    print(f"relative logits diff vs transformers' Mistral (window {WINDOW}): seq {WINDOW} {at_window:.2e}; "
          f"seq {WINDOW + 1}: first {WINDOW} positions {head:.2e}, the last {last:.2e}")
    assert at_window <= TOLERANCE and head <= TOLERANCE, (at_window, head)
    assert last > 100 * TOLERANCE, last  # position `window` no longer sees token 0 in transformers: ours does


def test_generation_within_the_window_is_transformers_and_past_it_refused(mistral):
    _, result = mistral
    assert result["generated"] == result["hf_generated"][0, WINDOW - 4:].tolist()
    assert f"pass the attention window model.sliding_window={WINDOW}: ask for at most 4 new" in result["refused"]


def test_export_writes_the_window_back(mistral):
    root, result = mistral
    config = json.loads((root / "exported" / "config.json").read_text())
    assert (config["model_type"], config["sliding_window"], config["architectures"]) == (
        "mistral", WINDOW, ["MistralForCausalLM"])
    for seq in (WINDOW, WINDOW + 1):  # the exported model windows as the original does (past it too)
        assert torch.equal(result["exported"][seq], result["hf"][seq]), seq


def test_a_sequence_past_the_window_is_refused_at_import_and_at_train_time(mistral, tmp_path):
    root, result = mistral
    code, output, errors = result["cli"]["too long"]
    line = f"model.seq_length={WINDOW + 1} is longer than model.sliding_window={WINDOW}"
    assert code == 2 and errors.strip().splitlines() == [errors.strip()] and line in errors, output + errors
    assert not (root / "refused").exists()
    run = subprocess.run(
        [sys.executable, "train.py", f"hydra.searchpath=[file://{root}/conf]", "model=hf_mistral",
         f"model.seq_length={WINDOW + 1}", f"checkpoint.load={root}/ckpt", "checkpoint.finetune=true",
         f"hydra.run.dir={tmp_path}/run", "train.iters=1"], cwd=ROOT, capture_output=True, text=True, timeout=300)
    last = (run.stdout + run.stderr).strip().splitlines()[-1]
    assert run.returncode == 2 and last.startswith("error: ") and line in last, run.stdout + run.stderr

    from training.config.compose import compose
    from training.config.validate import problems

    at_window = compose([f"hydra.searchpath=[file://{root}/conf]", "model=hf_mistral", "checkpoint=none"])
    assert at_window.model.seq_length == WINDOW and not problems(at_window, 1)


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
