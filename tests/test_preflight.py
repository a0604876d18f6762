"""Before the run: what the files a config names can tell, refused by the launcher before torchrun
(tools/check_config.py: a checkpoint of another model or tokenizer, conversations read as documents);
training/estimate/preflight.py: the estimate reported before the model is built (and refused on a GPU when it
cannot fit), the environment report, and on CPU a warning when the node's processes exceed its memory."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest
import torch

from models.shape import ModelShape
from training.config.compose import compose

ROOT = Path(__file__).resolve().parents[1]
# A checkpoint the template wrote (its README: 2 layers, hidden 32, 2 heads, 1 query group, ffn 64, byte tokenizer)
FIXTURE = ROOT / "tests" / "fixtures" / "ckpt_pre_redesign" / "iter_0000002"
FIXTURE_MODEL = ["model.num_layers=2", "model.hidden_size=32", "model.num_attention_heads=2",
                 "model.num_query_groups=1", "model.ffn_hidden_size=64"]
# what model=tiny (conf/model/tiny.yaml) has instead, field: (checkpoint, config)
TINY_VS_FIXTURE = {"num_layers": (2, 4), "hidden_size": (32, 128), "num_attention_heads": (2, 4),
                   "num_query_groups": (1, 2), "ffn_hidden_size": (64, 352)}


def refused_before_torchrun(run_dir: Path, *overrides: str) -> tuple[str, float]:
    """launch/train.sh with the overrides: its one stderr line and the seconds it took. Refused before torchrun:
    exit 2, that line alone, nothing on stdout (no `config ok`, no rank's output)."""
    env = {k: v for k, v in os.environ.items() if not k.startswith(("SLURM_", "MASTER_", "RUN_", "NPROC", "DRY_RUN"))}
    started = time.monotonic()
    done = subprocess.run([str(ROOT / "launch" / "train.sh"), *overrides], capture_output=True, text=True,
                          timeout=300, env=dict(env, NPROC="1", RUN_DIR=str(run_dir), PYTHON=sys.executable))
    took = time.monotonic() - started
    assert done.returncode == 2 and done.stdout == "", (done.returncode, done.stdout, done.stderr)
    lines = done.stderr.splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: "), done.stderr
    print(f"refused in {took:.1f} s: {lines[0]}")
    return lines[0], took


def assert_every_field_named(line: str) -> None:
    for field, (saved, config) in TINY_VS_FIXTURE.items():
        assert f"{field}: checkpoint {saved} vs config {config}" in line, line


@pytest.mark.fast
@pytest.mark.parametrize("mismatch", ["model", "model-auto", "tokenizer", "format"])
def test_the_launcher_refuses_what_the_files_tell_before_torchrun(tmp_path, mismatch):
    """Each mismatch a file shows is one line, exit 2, within seconds (torchrun and the ranks' own refusal take
    ~25 s), and the refused run leaves no run dir (a resumed one: nothing new in it)."""
    run_dir = tmp_path / "run"
    if mismatch == "model":  # a checkpoint of an imported preset, loaded with the default model=tiny
        ckpt = tmp_path / "imported" / FIXTURE.name
        shutil.copytree(FIXTURE, ckpt)
        run = json.loads((ckpt / "run.json").read_text())
        run["config"]["model"]["name"] = "my_llama"  # as tools/convert_hf.py import --name my_llama records it
        (ckpt / "run.json").write_text(json.dumps(run))
        line, took = refused_before_torchrun(run_dir, f"checkpoint.load={ckpt}")
        assert_every_field_named(line)
        assert line.startswith(f"error: the model in the config (model=tiny) does not match checkpoint {ckpt}: ")
        assert "it was written with model=my_llama: add model=my_llama" in line, line
    elif mismatch == "model-auto":  # relaunching a run dir (checkpoint.load=auto) with another model
        shutil.copytree(FIXTURE, run_dir / "checkpoints" / FIXTURE.name)
        (run_dir / "checkpoints" / "latest").write_text(f"{FIXTURE.name}\n")
        before = sorted(run_dir.rglob("*"))
        line, took = refused_before_torchrun(run_dir)
        assert_every_field_named(line)
        assert f"match checkpoint {run_dir}/checkpoints/{FIXTURE.name}: " in line, line
        assert sorted(run_dir.rglob("*")) == before  # no config.yaml, no flight_recorder/
    elif mismatch == "tokenizer":  # fine-tuning the byte-tokenizer checkpoint with a Hugging Face tokenizer
        from tokenizers import Tokenizer, models

        tokenizer = tmp_path / "tokenizer.json"
        Tokenizer(models.WordLevel({"<|endoftext|>": 0, "a": 1, "[UNK]": 2}, unk_token="[UNK]")).save(str(tokenizer))
        line, took = refused_before_torchrun(run_dir, f"checkpoint.load={FIXTURE}", "checkpoint.finetune=true",
                                             f"data.tokenizer={tokenizer}", *FIXTURE_MODEL)
        assert line.startswith(f"error: checkpoint {FIXTURE} was written with the tokenizer byte, this run has "
                               f"data.tokenizer={tokenizer}: "), line
    else:  # conversations (tools/preprocess_data.py --format sft) without data.format=sft
        from corpora import BYTE

        from training.data.sft_write import write_sft

        class ByteChat:  # the byte tokenizer as write_sft sees one (no chat template)
            name, vocab_size, eod, template_hash = BYTE.name, BYTE.vocab_size, BYTE.eod, "none"

        chats = tmp_path / "chats"
        pairs = [(np.arange(65, 65 + n, dtype=np.uint16), np.r_[np.zeros(2, np.uint8), np.ones(n - 2, np.uint8)])
                 for n in (8, 12, 20)]  # (token ids, loss mask): a 2-token prompt, then the answer
        write_sft(chats, pairs, ByteChat())
        line, took = refused_before_torchrun(run_dir, f"data.paths=[{chats}]")
        assert line == (f"error: data.paths: {chats} holds conversations (tools/preprocess_data.py --format sft), but "
                        f"data.format=text: set data.format=sft")
    assert took < 20, took  # ~3 s on an idle 2-core machine (the bound: 5 s); generous for a loaded one
    if mismatch != "model-auto":
        assert not run_dir.exists()  # the launcher makes it only after the check


def test_preflight_reports_on_cpu_and_stops_what_cannot_fit(tmp_path, capsys):
    from training.config.validate import validate
    from training.errors import ConfigError
    from training.estimate.preflight import check, preflight

    cfg = compose(["model=tiny"])
    est = preflight(cfg, validate(cfg, 1), ModelShape.of(cfg.model, 257), torch.device("cpu"), tmp_path)
    assert "CPU: reported, not enforced" in capsys.readouterr().out
    report = json.loads((tmp_path / "environment.json").read_text())
    assert report["packages"]["megatron-core"] == "0.19.2" and report["packages"]["torch"] == torch.__version__
    assert report["memory_estimate"]["gb"] == est.mem_gb()
    check(est, capacity_bytes=int(est.total) + 1, fraction=1.0, model="tiny")  # fits: no error
    with pytest.raises(ConfigError, match=r"exceeds .* train.max_memory_fraction=0.5 .*tools/plan.py model=tiny"):
        check(est, capacity_bytes=int(est.total) + 1, fraction=0.5, model="tiny")


def test_preflight_warns_on_cpu_when_the_nodes_processes_exceed_its_memory(tmp_path, capsys, monkeypatch):
    """The helper's seq_length=100000 run: 2 x 17 GB on a 23 GB machine ended as a bare signal 9."""
    from training.config.validate import validate
    from training.estimate import preflight as P

    cfg = compose(["model=tiny"])
    est = P.preflight(cfg, validate(cfg, 1), ModelShape.of(cfg.model, 257), torch.device("cpu"), tmp_path)
    assert "preflight warning" not in capsys.readouterr().out  # 1 process of the tiny model fits any machine
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "2")
    monkeypatch.setattr(P, "_host_memory", lambda: 1.5 * est.total)
    P.preflight(cfg, validate(cfg, 1), ModelShape.of(cfg.model, 257), torch.device("cpu"), tmp_path)
    out = capsys.readouterr().out
    assert f"preflight warning: by the estimate this node's 2 process(es) need {2 * est.total / 1e9:.1f} GB" in out
    assert "the kernel may kill a rank (signal 9)" in out, out
