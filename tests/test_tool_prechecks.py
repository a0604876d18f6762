"""The tools' own mistakes caught before any process starts: tools/generate.py and tools/evaluate.py compare the
layout the overrides ask for with --nproc in the launching process (it once took 36 s of spawned workers to say
so); the workers' check stays for torchrun."""

from __future__ import annotations

from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
CKPT = ROOT / "tests" / "fixtures" / "ckpt_pre_redesign" / "iter_0000002"  # 4 heads, 1 query group
pytestmark = pytest.mark.fast


def _never_spawned(monkeypatch, tool):
    def spawn(*args, **kwargs):
        raise AssertionError("a process was started before the layout was checked")
    monkeypatch.setattr(tool, "run_local", spawn)


@pytest.mark.parametrize("tool_name, argv, line", [
    ("generate", ["--prompt", "x", "--nproc", "2", "parallel.tp=4"],
     "error: generation runs one model replica: 2 processes but parallel.tp * pp = 4 * 1 = 4 (start tp * pp "
     "processes: --nproc 4)"),
    ("generate", ["--prompt", "x", "parallel.pp=2"], "error: generation runs one model replica: 1 processes but "
                                                      "parallel.tp * pp = 1 * 2 = 2"),
    ("evaluate", ["--nproc", "3", "parallel.pp=2"], "error: world size 3 is not divisible by parallel.tp * "
                                                    "parallel.pp = 1 * 2 = 2"),
])
def test_a_layout_that_does_not_fit_nproc_is_refused_before_any_process(tool_name, argv, line, monkeypatch, capsys):
    import importlib

    tool = importlib.import_module(f"tools.{tool_name}")
    monkeypatch.delenv("WORLD_SIZE", raising=False)
    _never_spawned(monkeypatch, tool)
    assert tool.main(["--ckpt", str(CKPT), *argv]) == 2
    lines = capsys.readouterr().err.strip().splitlines()
    assert lines[-1].startswith("error: ") and any(shown.startswith(line) for shown in lines), lines


def test_the_launchers_check_prints_the_configs_notes(capsys):
    """tools/check_config.py (run by launch/train.sh before torchrun) prints validate.notes() above its ok line."""
    from tools.check_config import main

    assert main(["model.max_position_embeddings=32", "model.seq_length=64"]) == 0
    out = capsys.readouterr().out.splitlines()
    assert out[0].startswith("note: model.seq_length=64 > model.max_position_embeddings=32") and \
        out[1].startswith("config ok: "), out


def test_the_adapter_imports_continue_line_selects_the_base_model():
    """import --adapter prints the command that continues training: with the base's model preset selected (as
    convert_hf import wrote it: conf/model/local/NAME.yaml, or a shipped conf/model/NAME.yaml)."""
    from training.interop.peft_import import model_selection

    local = ROOT / "conf" / "model" / "local"
    made_dir, preset = not local.exists(), local / "adapter_base_test.yaml"
    local.mkdir(exist_ok=True)
    preset.write_text("num_layers: 2\n")
    try:
        assert model_selection("adapter_base_test") == "model=local/adapter_base_test"
    finally:
        preset.unlink()
        if made_dir:
            local.rmdir()
    assert model_selection("llama3_2_1b") == "model=llama3_2_1b"
    assert model_selection("nowhere").startswith("model=<the base's preset: nowhere")
