"""tools/preprocess_data.py's inputs beyond plain text and JSON lines (training/data/sources.py): Parquet shard
sets, a `datasets` save_to_disk folder, Arrow, CSV and TSV, gzip and zstd JSON lines each give the same dataset as
the same documents in plain .jsonl; unknown or damaged inputs are one line; tools/merge_datasets.py joins parts into
exactly what preprocessing their concatenation writes. In-process, CPU only (the training check on such a dataset
is tests/test_end_to_end.py's preprocess-then-train run, which reads Parquet shards, a save_to_disk folder and a
.jsonl.zst).
"""

import gzip
import importlib.util
import json
import os
import sys
from pathlib import Path

import pyarrow as pa
import pyarrow.csv as pa_csv
import pyarrow.parquet as pq
import pytest
import zstandard
from corpora import EXPECTED_WARNINGS, decoded

from training.data import sources

ROOT = Path(__file__).resolve().parents[1]
pytestmark = EXPECTED_WARNINGS

DOCS = [f"doc {i}: " + "ünïcödé 中文 😀 " * (i % 7) + "word " * (i * 37 % 400) for i in range(60)]
DOCS[5] = "a JSON document\nspanning lines, \"quoted\"\n"


def load(name):
    """tools/NAME.py as a module, to call main() in-process (no ~10 s interpreter start)."""
    spec = importlib.util.spec_from_file_location(name, ROOT / "tools" / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module  # worker processes unpickle encode_chunk by this name
    spec.loader.exec_module(module)
    return module


def jsonl(docs) -> bytes:
    return "".join(json.dumps({"text": d, "n": i}) + "\n" for i, d in enumerate(docs)).encode()


def write_parquet(path, docs, **columns):
    pq.write_table(pa.table({"id": list(range(len(docs))), "text": docs, **columns}), path, row_group_size=7)


def save_to_disk(folder, parts):
    """What `datasets.Dataset.save_to_disk(folder, num_shards=len(parts))` writes: Arrow IPC stream shards,
    state.json listing them, dataset_info.json with the features (datasets 5.2.0's load_from_disk reads it)."""
    folder.mkdir()
    schema = pa.schema([("text", pa.string()), ("id", pa.int64())], metadata={"huggingface": '{"info": {}}'})
    names = [f"data-{i:05d}-of-{len(parts):05d}.arrow" for i in range(len(parts))]
    for name, docs in zip(names, parts):
        table = pa.table({"text": docs, "id": list(range(len(docs)))}, schema=schema)
        with pa.OSFile(str(folder / name), "wb") as f, pa.ipc.new_stream(f, schema) as writer:
            writer.write_table(table, max_chunksize=4)  # several record batches, as datasets' writer_batch_size
    state = {"_data_files": [{"filename": n} for n in names], "_fingerprint": "0", "_format_columns": None,
             "_format_kwargs": {}, "_format_type": None, "_output_all_columns": False, "_split": None}
    (folder / "state.json").write_text(json.dumps(state))
    features = {"text": {"dtype": "string", "_type": "Value"}, "id": {"dtype": "int64", "_type": "Value"}}
    (folder / "dataset_info.json").write_text(json.dumps({"features": features}))


def files_of(prefix):
    return [Path(f"{prefix}{s}").read_bytes() for s in (".bin", ".idx")]


def test_every_input_kind_writes_what_plain_jsonl_writes(tmp_path, monkeypatch, capsys):
    tool = load("preprocess_data")
    monkeypatch.setattr(sources, "CHUNK_BYTES", 2000)  # many chunks, batches sliced, across shards
    (tmp_path / "ref.jsonl").write_bytes(jsonl(DOCS))
    (tmp_path / "shards").mkdir()
    for i, (a, b) in enumerate([(0, 25), (25, 26), (26, 60)]):  # 3 shards, one of a single row
        write_parquet(tmp_path / "shards" / f"part-{i}.parquet", DOCS[a:b], url=[f"u{j}" for j in range(a, b)])
    write_parquet(tmp_path / "gaps.parquet", [DOCS[0], None, "", DOCS[1]])  # null and empty rows: skipped
    save_to_disk(tmp_path / "saved", [DOCS[:33], DOCS[33:]])
    half = jsonl(DOCS).index(b"\n", 3000) + 1  # two zstd frames, split at a line, as parallel compressors write
    zst = zstandard.ZstdCompressor()
    (tmp_path / "ref.jsonl.zst").write_bytes(zst.compress(jsonl(DOCS)[:half]) + zst.compress(jsonl(DOCS)[half:]))
    (tmp_path / "ref.jsonl.gz").write_bytes(gzip.compress(jsonl(DOCS)))
    (tmp_path / "ref.txt.gz").write_bytes(gzip.compress("\n".join(DOCS[:5]).encode()))
    table = pa.table({"id": list(range(len(DOCS))), "text": DOCS})  # a header row; quoted values (new lines, ")
    pa_csv.write_csv(table, tmp_path / "ref.csv")
    pa_csv.write_csv(table, tmp_path / "ref.tsv", pa_csv.WriteOptions(delimiter="\t"))

    def preprocess(name, *inputs, workers=1):
        args = ["--input", *map(str, inputs), "--output-prefix", str(tmp_path / name), "--tokenizer", "byte"]
        assert tool.main(args + ["--workers", str(workers)]) == 0, capsys.readouterr().err
        return tmp_path / name

    ref = preprocess("ref", tmp_path / "ref.jsonl")
    assert decoded(ref) == DOCS
    for name, inputs, workers in [("parquet", [tmp_path / "shards" / "*.parquet"], 2),
                                  ("saved", [tmp_path / "saved"], 1),
                                  ("arrow", [tmp_path / "saved" / "*.arrow"], 1),
                                  ("zst", [tmp_path / "ref.jsonl.zst"], 2),
                                  ("gz", [tmp_path / "ref.jsonl.gz"], 1),
                                  ("csv", [tmp_path / "ref.csv"], 2),
                                  ("tsv", [tmp_path / "ref.tsv"], 1)]:
        assert files_of(preprocess(name, *inputs, workers=workers)) == files_of(ref), name  # tokens, boundaries
    assert "from 3 file(s)" in capsys.readouterr().out.splitlines()[1]  # the Parquet glob: its 3 shards
    assert decoded(preprocess("gaps", tmp_path / "gaps.parquet")) == DOCS[:2]
    pq.write_table(pa.table({"text": ["not this"] * 3, "content": DOCS[:3]}), tmp_path / "content.parquet")
    assert decoded(preprocess("content", tmp_path / "content.parquet", "--json-key", "content")) == DOCS[:3]
    assert decoded(preprocess("text_gz", tmp_path / "ref.txt.gz")) == DOCS[:5]  # plain text, gzip-compressed
    lines = [d.replace("word ", "word\n") for d in DOCS]  # quoted new lines across CSV blocks of ~CHUNK_BYTES
    pa_csv.write_csv(pa.table({"text": lines}), tmp_path / "lines.csv")
    assert decoded(preprocess("lines", tmp_path / "lines.csv")) == lines

    # Progress over every input: the bytes on disk it counts add up to the files' sizes (what its ETA uses).
    inputs = sources.resolve([str(tmp_path / "shards" / "*.parquet"), str(tmp_path / "saved"),
                              str(tmp_path / "ref.jsonl.zst"), str(tmp_path / "ref.jsonl")], "text")
    progress = tool.preprocess(inputs, tmp_path / "mixed", tool.build_tokenizer("byte"), "byte", "text", 1)
    assert len(inputs) == 7 and progress.bytes == progress.total == sum(os.path.getsize(s.path) for s in inputs)
    assert progress.documents == 4 * len(DOCS) and progress.text > progress.bytes  # zstd: more text than disk
    assert progress.line(final=False).startswith(f"file 7/7: {4 * len(DOCS)} documents, ")
    assert "(100%)" in progress.line(final=False) and "ETA 0 s" in progress.line(final=False)


def test_unknown_or_damaged_inputs_are_one_line(tmp_path, capsys):
    tool = load("preprocess_data")
    write_parquet(tmp_path / "good.parquet", DOCS[:30])
    good = (tmp_path / "good.parquet").read_bytes()
    cases = {  # file name: (content, what the line must say)
        "licenses.parquet": (b"MIT License\nPermission is hereby granted\n", ["holds plain text", "Parquet"]),
        "shard.txt": (good, ["holds Parquet data", "name it .parquet"]),
        "model.bin": (b"\x93NUMPY\x01\x00v\x00{'descr'", ["binary data (a NUL byte at offset 7)"]),
        "plain.jsonl.gz": (jsonl(DOCS[:2]), ["holds plain text", "gzip data"]),
        "cut.parquet": (good[:len(good) // 2], ["damaged Parquet data", "footer"]),
        "flipped.parquet": (good[:2000] + bytes(b ^ 0x5A for b in good[2000:2300]) + good[2300:],
                            ["damaged Parquet data"]),
        "cut.jsonl.gz": (gzip.compress(jsonl(DOCS))[:500], ["damaged gzip data"]),
        "cut.jsonl.zst": (zstandard.ZstdCompressor().compress(jsonl(DOCS))[:-9], ["damaged zstd", "truncated"]),
        "empty.parquet": (b"", ["holds nothing (an empty file)"]),
    }
    for name, (content, _) in cases.items():
        (tmp_path / name).write_bytes(content)
    write_parquet(tmp_path / "body.parquet", DOCS[:2], body=DOCS[:2])
    (tmp_path / "body.csv").write_text("id,body\n1,a document\n")
    pq.write_table(pa.table({"text": [1, 2]}), tmp_path / "ints.parquet")
    (tmp_path / "plain_folder").mkdir()
    (tmp_path / "dict").mkdir()
    (tmp_path / "dict" / "dataset_dict.json").write_text('{"splits": ["train", "test"]}')
    cases = {name: expected for name, (_, expected) in cases.items()} | {
        "body.parquet --text-key content": ['no column "content" (its columns: id, text, body)', "--text-key"],
        "body.csv --text-key content": ['no column "content" (its columns: id, body)', "--text-key"],
        "ints.parquet": ['column "text" holds int64, not text'],
        "plain_folder": ["without state.json", "a glob"],
        "dict": ["DatasetDict with splits train, test", "dict/train"],
    }
    for case, expected in cases.items():
        name, *extra = case.split()
        args = ["--input", str(tmp_path / name), *extra, "--output-prefix", str(tmp_path / "out" / "x")]
        assert tool.main(args + ["--tokenizer", "byte"]) == 2, case
        err = capsys.readouterr().err.strip()
        assert err.startswith(f"error: {tmp_path / name}") and "\n" not in err, err
        assert all(e in err for e in expected), (expected, err)
        assert "supported: " in err or "column" in err or "DatasetDict" in err, err  # says what is read
    assert not (tmp_path / "out").exists() or os.listdir(tmp_path / "out") == []  # nothing half-written


def test_missing_packages_say_which_extra(tmp_path, monkeypatch):
    write_parquet(tmp_path / "a.parquet", DOCS[:2])
    (tmp_path / "a.jsonl.zst").write_bytes(zstandard.ZstdCompressor().compress(jsonl(DOCS[:2])))
    monkeypatch.setitem(sys.modules, "pyarrow", None)  # import fails, as where the `data` extra is absent
    monkeypatch.setitem(sys.modules, "zstandard", None)
    for name in ("a.parquet", "a.jsonl.zst"):
        with pytest.raises(sources.ConfigError, match=r"needs the `\w+` package: pip install -e '\.\[data\]'"):
            list(sources.chunks(sources.resolve([str(tmp_path / name)], "text"), "text"))


def test_merge_equals_preprocessing_the_concatenation(tmp_path, capsys):
    preprocess, merge = load("preprocess_data"), load("merge_datasets")
    (tmp_path / "a.jsonl").write_bytes(jsonl(DOCS[:20]))
    (tmp_path / "b.jsonl").write_bytes(jsonl(DOCS[20:]))
    for name, inputs in [("whole", ["a.jsonl", "b.jsonl"]), ("parts/p-0", ["a.jsonl"]), ("parts/p-1", ["b.jsonl"])]:
        assert preprocess.main(["--input", *(str(tmp_path / i) for i in inputs), "--output-prefix",
                                str(tmp_path / name), "--tokenizer", "byte"]) == 0
    # One merge (add_index runs gc.collect: ~0.5 s a part in a test process): a prefix, then a glob of files.
    assert merge.main(["--input", str(tmp_path / "parts" / "p-0"), str(tmp_path / "parts" / "p-[1-9].*"),
                       "--output-prefix", str(tmp_path / "merged")]) == 0
    assert files_of(tmp_path / "merged") == files_of(tmp_path / "whole")  # tokens and document boundaries
    meta, whole = (json.loads((tmp_path / f"{n}.json").read_text()) for n in ("merged", "whole"))
    assert meta.pop("merged_from") == [str(tmp_path / "parts" / p) for p in ("p-0", "p-1")]
    assert meta == whole  # tokenizer, vocab_size, eod, documents, tokens
    assert "wrote" in capsys.readouterr().out

    # Refused in one line, nothing written: another tokenizer, no PREFIX.json, a missing or truncated part.
    other = json.loads((tmp_path / "parts" / "p-1.json").read_text()) | {"tokenizer": "hf:sha256-0123", "eod": 0}
    (tmp_path / "other.json").write_text(json.dumps(other))
    for suffix in (".bin", ".idx"):
        (tmp_path / f"other{suffix}").write_bytes((tmp_path / "parts" / f"p-1{suffix}").read_bytes())
        (tmp_path / f"bare{suffix}").write_bytes((tmp_path / "parts" / f"p-1{suffix}").read_bytes())
    (tmp_path / "short.bin").write_bytes((tmp_path / "parts" / "p-1.bin").read_bytes()[:-2])
    for suffix in (".idx", ".json"):
        (tmp_path / f"short{suffix}").write_bytes((tmp_path / "parts" / f"p-1{suffix}").read_bytes())
    cases = {"other": ["other was written with tokenizer hf:sha256-0123", "p-0 with byte", "same --tokenizer"],
             "bare": ["bare: no bare.json", "tools/preprocess_data.py"],
             "nope": ["no dataset at prefix", "nope"], "short": ["short.bin has", "truncated"]}
    for part, expected in cases.items():
        args = ["--input", str(tmp_path / "parts" / "p-0"), str(tmp_path / part)]
        assert merge.main(args + ["--output-prefix", str(tmp_path / "out" / "m")]) == 2, part
        err = capsys.readouterr().err.strip()
        assert err.startswith("error: ") and "\n" not in err and all(e in err for e in expected), (expected, err)
    assert not (tmp_path / "out").exists() or os.listdir(tmp_path / "out") == []


def test_parquet_is_read_a_row_group_at_a_time(tmp_path, monkeypatch):
    """Arrow memory stays at about a row group, not the file: pyarrow's pre_buffer default kept every row group
    read (a 1 GB input reached the file's size in Arrow buffers)."""
    monkeypatch.setattr(sources, "CHUNK_BYTES", 10_000)  # batches of ~2 rows: a row group is the unit read
    rows = [f"{i} " + os.urandom(3000).hex() for i in range(400)]  # 2.4 MB of text, 20 row groups of 120 KB
    pq.write_table(pa.table({"text": rows}), tmp_path / "big.parquet", row_group_size=20)
    peak, seen = 0, []
    for chunk in sources.chunks(sources.resolve([str(tmp_path / "big.parquet")], "text"), "text"):
        peak = max(peak, pa.total_allocated_bytes())
        seen += chunk.items
    assert seen == rows
    assert peak < 0.3 * sum(map(len, rows)), peak  # measured: 0.37 MB of 2.4 (pre_buffer on: 2.65 MB)
