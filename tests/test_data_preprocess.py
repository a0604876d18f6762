"""Data preparation: tools/preprocess_data.py's round trip (text and JSONL, two workers) and its errors; the
embedded corpus; Hugging Face tokenizer.json files. CPU only, no process group needed (sampling and datasets:
tests/test_data.py).

Every test here is a direct call except the one that runs tools/preprocess_data.py as a user would.
"""

import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from corpora import BYTE, EXPECTED_WARNINGS, config, decoded

from training.data.datasets import (
    build_datasets,
    check_prefix,
    embedded_documents,
    embedded_prefix,
    prepare_embedded,
)
from training.data.tokenizer import build_tokenizer
from training.errors import ConfigError

ROOT = Path(__file__).resolve().parents[1]
TOOL = ROOT / "tools" / "preprocess_data.py"

pytestmark = EXPECTED_WARNINGS


def load_tool():
    """tools/preprocess_data.py as a module, to call main() in-process (no ~10 s interpreter start)."""
    spec = importlib.util.spec_from_file_location("preprocess_data", TOOL)
    module = importlib.util.module_from_spec(spec)
    sys.modules["preprocess_data"] = module  # worker processes unpickle encode_chunk by this name
    spec.loader.exec_module(module)
    return module


# ----------------------------------------------------------------------------------------- preprocessing

TEXT_DOCS = ["Plain ASCII line.", "  leading spaces and a\ttab kept",
             "Ünïcödé: naïve café, 中文, Ελληνικά", "emoji 😀 and \"quotes\" and \\backslash"]
JSON_DOCS = ["a JSON document\nspanning lines\n", "ß → ∑ ∞ 🚀", "{\"nested\": \"json-looking text\"}", "x"]


def test_preprocess_round_trip_text_and_jsonl(tmp_path):
    # 1.3 MB of text: more than one 1 MB task, so 2 workers finish out of order and imap must restore it.
    bulk = [f"line {i} " + "word " * (i % 40) for i in range(12000)]
    text_docs = TEXT_DOCS + bulk
    lines = text_docs[:2] + ["", "   "] + text_docs[2:]  # blank and whitespace-only lines are skipped
    (tmp_path / "docs.txt").write_text("\n".join(lines) + "\n", encoding="utf-8")
    records = [json.dumps({"text": d, "id": i}, ensure_ascii=i % 2 == 0) for i, d in enumerate(JSON_DOCS)]
    (tmp_path / "docs.jsonl").write_text("\n".join(records) + "\n", encoding="utf-8")  # \\u escapes and raw UTF-8
    out = tmp_path / "out"
    command = [sys.executable, str(TOOL), "--input", str(tmp_path / "docs.txt"), str(tmp_path / "*.jsonl"),
               "--output-prefix", str(out / "rt"), "--tokenizer", "byte", "--workers", "2"]
    run = subprocess.run(command, capture_output=True, text=True, timeout=120)
    assert run.returncode == 0, run.stderr
    assert "wrote" in run.stdout and "documents/s" in run.stdout and "MB/s" in run.stdout
    assert decoded(out / "rt") == text_docs + JSON_DOCS
    assert sorted(os.listdir(out)) == ["rt.bin", "rt.idx", "rt.json"]  # no temporary files left
    meta = json.loads((out / "rt.json").read_text())
    assert (meta["tokenizer"], meta["documents"]) == ("byte", len(text_docs) + len(JSON_DOCS))
    check_prefix(str(out / "rt"), BYTE)  # readable for training with the same tokenizer


def test_preprocess_errors_are_one_line_naming_the_input(tmp_path, capsys):
    tool = load_tool()
    (tmp_path / "blank.txt").write_text("\n  \n\n")
    (tmp_path / "bad.jsonl").write_text('{"text": "ok"}\n\n{"body": "no text key"}\n')
    cases = [  # (arguments, what the error must name)
        (["--input", str(tmp_path / "none*.txt")], ["none*.txt", "no file matches"]),
        (["--input", str(tmp_path / "blank.txt")], ["blank.txt", "no documents"]),
        (["--input", str(tmp_path / "bad.jsonl"), "--workers", "2"], ["bad.jsonl:3", '"text"', "its keys: body"]),
        (["--input", str(tmp_path / "blank.txt"), "--tokenizer", str(tmp_path / "tok.json")], ["tok.json"]),
    ]
    for args, expected in cases:
        args = args + ["--tokenizer", "byte"] if "--tokenizer" not in args else args
        assert tool.main(args + ["--output-prefix", str(tmp_path / "out" / "x")]) == 2, args
        err = capsys.readouterr().err.strip()
        assert err.startswith("error: ") and "\n" not in err, err
        assert all(e in err for e in expected), (expected, err)
    assert not (tmp_path / "out").exists() or os.listdir(tmp_path / "out") == []  # nothing half-written


# ------------------------------------------------------------------------------------ embedded + tokenizers

def test_embedded_corpus_round_trips_exactly(tmp_path):
    cfg = config(tmp_path, [])
    prefix = prepare_embedded(cfg, BYTE)
    assert prefix == embedded_prefix(cfg, BYTE)
    documents = embedded_documents()
    assert decoded(prefix) == documents
    assert 300_000 < sum(len(d.encode()) for d in documents) < 2_000_000  # "~0.5 MB of prose"
    stamp = os.stat(f"{prefix}.bin").st_mtime_ns
    train, valid = build_datasets(cfg, BYTE, (16, 4), True)  # data.paths=[]: the default run's data
    assert os.stat(f"{prefix}.bin").st_mtime_ns == stamp  # cached, not rewritten
    sample = bytes(t for t in train[0]["tokens"].tolist() if t != BYTE.eod)  # may cut a UTF-8 character
    assert sample in "".join(documents).encode() and len(valid) >= 4


def test_hf_tokenizer_json(tmp_path, capsys):
    tokenizers = pytest.importorskip("tokenizers")  # optional (the `hf` extra); CI installs only `.[dev]`
    vocab = {"<|endoftext|>": 0, "[UNK]": 1, "hello": 2, "world": 3, "again": 4}
    tok = tokenizers.Tokenizer(tokenizers.models.WordLevel(vocab, unk_token="[UNK]"))
    tok.pre_tokenizer = tokenizers.pre_tokenizers.Whitespace()
    tok.add_special_tokens(["<|endoftext|>"])  # as in real tokenizers: EOD is special, skipped by decode
    (tmp_path / "a").mkdir()
    tok.save(str(tmp_path / "a" / "tokenizer.json"))
    hf = build_tokenizer(str(tmp_path / "a"))  # a directory holding tokenizer.json
    assert (hf.vocab_size, hf.eod, hf.encode("hello world again")) == (5, 0, [2, 3, 4])
    assert hf.decode([2, 3, 0]) == "hello world"  # EOD is special: dropped when decoding
    # The name is the content's hash: a copy elsewhere is the same tokenizer, an edited file is not.
    (tmp_path / "b.json").write_bytes((tmp_path / "a" / "tokenizer.json").read_bytes())
    assert build_tokenizer(str(tmp_path / "b.json")).name == hf.name
    (tmp_path / "b.json").write_bytes((tmp_path / "a" / "tokenizer.json").read_bytes() + b"\n")
    assert build_tokenizer(str(tmp_path / "b.json")).name != hf.name
    (tmp_path / "a" / "tokenizer.json").replace(tmp_path / "b.json")
    (tmp_path / "broken.json").write_text("{")
    with pytest.raises(ConfigError, match="broken.json"):
        build_tokenizer(str(tmp_path / "broken.json"))
    # Preprocess with it, then read with the byte tokenizer: refused, naming both.
    (tmp_path / "in.txt").write_text("hello world\nworld again hello\n")
    assert load_tool().main(["--input", str(tmp_path / "in.txt"), "--output-prefix", str(tmp_path / "hf"),
                             "--tokenizer", str(tmp_path / "b.json")]) == 0
    capsys.readouterr()
    assert decoded(tmp_path / "hf", hf) == ["hello world", "world again hello"]
    check_prefix(str(tmp_path / "hf"), hf)
    with pytest.raises(ConfigError, match=f"{hf.name}.*byte"):
        check_prefix(str(tmp_path / "hf"), BYTE)


def test_hf_tokenizer_without_the_package_says_how_to_install(tmp_path, monkeypatch):
    (tmp_path / "tokenizer.json").write_text("{}")
    monkeypatch.setitem(sys.modules, "tokenizers", None)  # import fails, as where the `hf` extra is absent
    with pytest.raises(ConfigError, match=r"tokenizer\.json needs the `tokenizers` package: pip install"):
        build_tokenizer(str(tmp_path))
