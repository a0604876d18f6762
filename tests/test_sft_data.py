"""Chat (SFT) data preprocessing: training/data/chat.py and tools/preprocess_data.py --format sft.

The reference is transformers itself on the real Llama 3 and Qwen2.5 (ChatML) templates (tests/chat_fixtures.py):
the ids equal apply_chat_template's, the masked tokens decode to exactly each answer and its end-of-turn text, and
the files the tool writes (JSON lines, Parquet; one or two workers) read back with Megatron-Core equal to encode().
CPU only, in-process (no interpreter start per tool run).
"""

import hashlib
import importlib.util
import json
import os
import sys
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from chat_fixtures import STYLES, chat_tokenizer
from corpora import EXPECTED_WARNINGS

from training.data import chat, sft_write, sources
from training.data.datasets import check_prefix
from training.data.tokenizer import HFTokenizer
from training.errors import ConfigError

ROOT = Path(__file__).resolve().parents[1]
pytestmark = EXPECTED_WARNINGS

MULTI = [{"role": "system", "content": "You answer in one line."}, {"role": "user", "content": "héllo 中文, 2+2?"},
         {"role": "assistant", "content": "4 😀, and \"quotes\""}, {"role": "user", "content": "And 3+3?"},
         {"role": "assistant", "content": "  6, with spaces around  "}]
SINGLE = [{"role": "user", "content": "Capital of France?"}, {"role": "assistant", "content": "Paris."}]
END_OF_TURN = {"llama3": "<|eot_id|>", "chatml": "<|im_end|>\n"}


@pytest.fixture(scope="module")
def tokenizers(tmp_path_factory):
    """{style: its tokenizer directory}."""
    root = tmp_path_factory.mktemp("tok")
    return {style: str(chat_tokenizer(root / style, style)) for style in STYLES}


def load_tool():
    """tools/preprocess_data.py as a module, to call main() in-process."""
    spec = importlib.util.spec_from_file_location("preprocess_data", ROOT / "tools" / "preprocess_data.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules["preprocess_data"] = module  # worker processes unpickle encode_conversations by this name
    spec.loader.exec_module(module)
    return module


def answer_runs(ids: np.ndarray, mask: np.ndarray, directory: str) -> list[str]:
    """The text of each maximal run of masked tokens, special tokens included."""
    from tokenizers import Tokenizer

    tok = Tokenizer.from_file(os.path.join(directory, "tokenizer.json"))
    edges = np.flatnonzero(np.diff(np.concatenate([[0], mask.astype(int), [0]])))  # [2 * runs] starts and ends
    return [tok.decode(ids[a:b].tolist(), skip_special_tokens=False) for a, b in zip(edges[::2], edges[1::2])]


def expected_answers(style: str, messages: list[dict]) -> list[str]:
    """Each assistant content as the template writes it (Llama 3's trims it) and its end-of-turn text."""
    trim = str.strip if style == "llama3" else str
    return [trim(m["content"]) + END_OF_TURN[style] for m in messages if m["role"] == "assistant"]


def test_encode_equals_the_template_and_masks_exactly_the_answers(tokenizers):
    from transformers import AutoTokenizer

    for style, directory in tokenizers.items():
        tok, hf, plain = chat.ChatTokenizer(directory), AutoTokenizer.from_pretrained(directory), HFTokenizer(directory)
        assert (tok.name, tok.vocab_size, tok.eod) == (plain.name, plain.vocab_size, plain.eod)
        for messages in (SINGLE, MULTI):
            ids, mask = chat.encode(tok, messages)
            assert mask.dtype == np.uint8 and ids.shape == mask.shape
            assert ids.tolist() == hf.apply_chat_template(messages, tokenize=True)["input_ids"], style
            assert ids.tolist() == plain.encode(hf.apply_chat_template(messages, tokenize=False)), style
            # Both answers of MULTI, each whole with its end of turn, and nothing else (system, prompts, headers).
            assert answer_runs(ids, mask, directory) == expected_answers(style, messages), style
        assert chat.conversation({"conversations": sharegpt(MULTI)}, "f", 1) == MULTI  # ShareGPT's layout
        prompt_completion = chat.conversation({"system": "Be brief.", "prompt": "Q?", "completion": "A."}, "f", 1)
        assert [m["role"] for m in prompt_completion] == ["system", "user", "assistant"]
        assert answer_runs(*chat.encode(tok, prompt_completion), directory) == [f"A.{END_OF_TURN[style]}"]


def test_templates_that_rewrite_earlier_turns_or_are_missing_are_refused(tokenizers, tmp_path):
    llama = Path(tokenizers["llama3"])
    unstable = tmp_path / "unstable"  # marks the last turn: rendering more turns changes earlier text
    unstable.mkdir()
    for name in ("tokenizer.json", "tokenizer_config.json"):
        (unstable / name).write_bytes((llama / name).read_bytes())
    (unstable / "chat_template.jinja").write_text(
        "{% for m in messages %}{% if loop.last %}LAST {% endif %}{{ m.role }}: {{ m.content }}\n{% endfor %}"
        "{% if add_generation_prompt %}assistant: {% endif %}")
    with pytest.raises(ConfigError, match=r"^chats.jsonl:7: the chat template is not prefix-stable .*turn 1"):
        chat.encode(chat.ChatTokenizer(str(unstable)), SINGLE, "chats.jsonl:7")
    bare = tmp_path / "bare"  # the same tokenizer without any template
    bare.mkdir()
    (bare / "tokenizer.json").write_bytes((llama / "tokenizer.json").read_bytes())
    config = json.loads((llama / "tokenizer_config.json").read_text())
    (bare / "tokenizer_config.json").write_text(json.dumps({k: v for k, v in config.items() if k != "chat_template"}))
    with pytest.raises(ConfigError, match="no chat template"):
        chat.ChatTokenizer(str(bare))
    with pytest.raises(ConfigError, match="a bare tokenizer file has no chat template"):
        chat.ChatTokenizer(str(bare / "tokenizer.json"))


def test_crash_while_writing_leaves_no_files(tokenizers, tmp_path):
    tok = chat.ChatTokenizer(tokenizers["chatml"])

    def pairs():
        yield chat.encode(tok, SINGLE)
        raise ConfigError("chats.jsonl:2: no assistant turn")

    with pytest.raises(ConfigError, match="chats.jsonl:2"):
        sft_write.write_sft(tmp_path / "out" / "c", pairs(), tok)
    assert os.listdir(tmp_path / "out") == []


def sharegpt(messages: list[dict]) -> list[dict]:
    """The same turns in ShareGPT's layout: {"from": "system" | "human" | "gpt", "value": ...}."""
    names = {"system": "system", "user": "human", "assistant": "gpt"}
    return [{"from": names[m["role"]], "value": m["content"]} for m in messages]


RECORDS = [{"messages": MULTI}, None, {"prompt": "Capital of France?", "completion": "Paris."},
           {"messages": []}, {"system": "Terse.", "prompt": "1+1?", "completion": "2"},
           {"conversations": sharegpt(SINGLE)}]  # None: a blank line


def write_inputs(folder: Path) -> list[tuple[str, dict]]:
    """chats.jsonl (RECORDS, x7 with varied text), chats.arrow, chats.parquet (a messages column with null rows),
    sharegpt.parquet (ShareGPT's conversations column) and pc.parquet (prompt, completion, system); returns every
    (file, record) in input order, empty ones included."""
    folder.mkdir()
    lines, records = [], []
    for k in range(7):
        for record in RECORDS:
            if record and "messages" in record and record["messages"]:
                record = {"messages": [{**m, "content": f"{m['content']} #{k}"} for m in record["messages"]]}
            lines.append("" if record is None else json.dumps(record, ensure_ascii=k % 2 == 0))
            records += [] if record is None else [("chats.jsonl", record)]
    (folder / "chats.jsonl").write_text("\n".join(lines) + "\n", encoding="utf-8")
    rows = [MULTI, None, SINGLE, MULTI[:3]] * 5
    pq.write_table(pa.table({"id": list(range(len(rows))), "messages": rows}), folder / "chats.parquet",
                   row_group_size=3)
    records += [("chats.parquet", {"messages": r}) for r in rows]
    arrow = pa.table({"messages": [SINGLE, MULTI[1:]], "n": [1, 2]})  # an Arrow IPC stream, as `datasets` writes
    with pa.OSFile(str(folder / "chats.arrow"), "wb") as f, pa.ipc.new_stream(f, arrow.schema) as writer:
        writer.write_table(arrow, max_chunksize=1)
    records += [("chats.arrow", {"messages": r}) for r in (SINGLE, MULTI[1:])]
    shared = [sharegpt(MULTI), sharegpt(SINGLE)]  # ShareGPT's column
    pq.write_table(pa.table({"conversations": shared, "source": ["x", "y"]}), folder / "sharegpt.parquet")
    records += [("sharegpt.parquet", {"conversations": r}) for r in shared]
    pc = {"prompt": ["a?", "b?", None], "completion": ["A.", "B.", None], "system": [None, "Be kind.", None]}
    pq.write_table(pa.table(pc), folder / "pc.parquet")
    records += [("pc.parquet", dict(zip(pc, values))) for values in zip(*pc.values())]
    return records


def test_tool_round_trip_jsonl_arrow_parquet_one_or_two_workers(tokenizers, tmp_path, monkeypatch, capsys):
    monkeypatch.setattr(sources, "CHUNK_BYTES", 2000)  # many chunks: two workers finish out of order
    tool = load_tool()
    records = write_inputs(tmp_path / "in")
    directory = tokenizers["llama3"]
    tok = chat.ChatTokenizer(directory)
    expected = [chat.encode(tok, m) for m in (chat.conversation(r, f, 0) for f, r in records) if m is not None]
    dropped = sum(chat.conversation(r, f, 0) is None for f, r in records)
    outputs = {}
    for workers in (1, 2):
        prefix = tmp_path / f"w{workers}" / "chats"
        inputs = [str(tmp_path / "in" / name) for name in ("chats.jsonl", "chats.parquet", "chats.arrow",
                                                           "sharegpt.parquet", "pc.parquet")]
        assert tool.main(["--format", "sft", "--input", *inputs, "--output-prefix", str(prefix), "--tokenizer",
                          directory, "--workers", str(workers)]) == 0, capsys.readouterr().err
        summary = capsys.readouterr().out
        suffixes = sft_write.SFT_SUFFIXES
        assert sorted(os.listdir(prefix.parent)) == sorted(f"chats{s}" for s in suffixes)  # no temporary files
        outputs[workers] = {s: Path(f"{prefix}{s}").read_bytes() for s in suffixes}
    assert outputs[1] == outputs[2]  # two workers: the same bytes
    from megatron.core.datasets.indexed_dataset import IndexedDataset

    ids, masks = IndexedDataset(str(prefix)), IndexedDataset(chat.mask_prefix(prefix))
    assert len(ids) == len(masks) == len(expected) and masks[0].dtype == np.uint8
    for k, (want_ids, want_mask) in enumerate(expected):
        assert ids[k].tolist() == want_ids.tolist() and masks[k].tolist() == want_mask.tolist(), k
    meta = json.loads(Path(f"{prefix}.json").read_text())
    plain = HFTokenizer(directory)
    assert meta == {"format": "sft", "tokenizer": plain.name, "vocab_size": plain.vocab_size, "eod": plain.eod,
                    "documents": len(expected), "tokens": sum(len(i) for i, _ in expected),
                    "answer_tokens": sum(int(m.sum()) for _, m in expected),
                    "chat_template": hashlib.sha256(STYLES["llama3"][3].encode()).hexdigest()[:16],
                    "dropped": dropped}
    assert dropped == 7 + 5 + 1  # {"messages": []} per copy, the Parquet null rows, the null prompt/completion
    assert (f"{len(expected)} conversations, {meta['tokens']} tokens, {meta['answer_tokens']} answer tokens"
            in summary), summary
    check_prefix(str(prefix), plain, plain.vocab_size, data_format="sft")  # what training checks


# Alpaca's records and the messages they stand for, written out by hand: the user turn is the instruction, a
# newline and the input (LLaMA-Factory's and axolotl's join), the instruction alone for an empty or missing input.
ALPACA = [
    ({"instruction": "Translate to French.", "input": "Good morning", "output": "Bonjour"},
     [{"role": "user", "content": "Translate to French.\nGood morning"}, {"role": "assistant", "content": "Bonjour"}]),
    ({"instruction": "Name a primary colour.", "input": "", "output": "Red."},
     [{"role": "user", "content": "Name a primary colour."}, {"role": "assistant", "content": "Red."}]),
    ({"instruction": "Say hi.", "output": "Hi!"},
     [{"role": "user", "content": "Say hi."}, {"role": "assistant", "content": "Hi!"}]),
    ({"system": "Be terse.", "instruction": "Sum them.", "input": "2, 3\n", "output": "5"},
     [{"role": "system", "content": "Be terse."}, {"role": "user", "content": "Sum them.\n2, 3\n"},
      {"role": "assistant", "content": "5"}]),
    ({"instruction": None, "input": None, "output": None}, []),  # empty: skipped and counted, as {"messages": []}
]


def test_alpaca_records_preprocess_to_their_messages(tokenizers, tmp_path, capsys):
    tool = load_tool()
    (tmp_path / "alpaca.jsonl").write_text("".join(json.dumps(a) + "\n" for a, _ in ALPACA))
    (tmp_path / "messages.jsonl").write_text("".join(json.dumps({"messages": m}) + "\n" for _, m in ALPACA))
    columns = ("instruction", "input", "output", "system")  # Parquet: nulls where a record has no such field
    pq.write_table(pa.table({"id": range(len(ALPACA)), **{c: [a.get(c) for a, _ in ALPACA] for c in columns}}),
                   tmp_path / "alpaca.parquet")
    for style, directory in tokenizers.items():  # ChatML keeps a trailing newline that Llama 3's template trims
        written = {}
        for name in ("alpaca.jsonl", "alpaca.parquet", "messages.jsonl"):
            prefix = tmp_path / style / name.replace(".", "_")
            assert tool.main(["--format", "sft", "--input", str(tmp_path / name), "--output-prefix", str(prefix),
                              "--tokenizer", directory]) == 0, capsys.readouterr().err
            written[name] = {s: Path(f"{prefix}{s}").read_bytes() for s in sft_write.SFT_SUFFIXES}
        assert json.loads(written["messages.jsonl"][".json"])["dropped"] == 1
        for name in ("alpaca.jsonl", "alpaca.parquet"):  # the same token ids, loss mask and counts
            for suffix, data in written["messages.jsonl"].items():
                assert written[name][suffix] == data, (style, name, suffix)


def test_tool_refuses_bad_records_and_tokenizers_in_one_line(tokenizers, tmp_path, capsys):
    tool = load_tool()
    (tmp_path / "noanswer.jsonl").write_text(json.dumps({"messages": SINGLE}) + "\n\n"
                                             + json.dumps({"messages": SINGLE[:1]}) + "\n")
    rows = [SINGLE, SINGLE, [{"role": "tool", "content": "{}"}, *SINGLE]]
    pq.write_table(pa.table({"messages": rows}), tmp_path / "role.parquet")
    (tmp_path / "content.jsonl").write_text(json.dumps({"prompt": "Q?", "completion": 42}) + "\n")
    (tmp_path / "input.jsonl").write_text(json.dumps({"instruction": "Add.", "input": [1, 2], "output": "3"}) + "\n")
    pq.write_table(pa.table({"instruction": ["A?", "B?"], "output": ["a", "b"], "history": [[], [["Q?", "q"]]]}),
                   tmp_path / "history.parquet")
    (tmp_path / "keys.jsonl").write_text(json.dumps({"question": "Q?", "answer": "A."}) + "\n")
    (tmp_path / "plain.txt").write_text("a document\n")
    pq.write_table(pa.table({"text": ["a"]}), tmp_path / "cols.parquet")
    bare = tmp_path / "bare"
    bare.mkdir()
    (bare / "tokenizer.json").write_bytes((Path(tokenizers["chatml"]) / "tokenizer.json").read_bytes())
    cases = [  # (input, tokenizer, what the line must say); the first also with two workers
        ("noanswer.jsonl", tokenizers["chatml"], ["noanswer.jsonl:3:", "no assistant turn", "roles: user"]),
        ("role.parquet", tokenizers["llama3"], ["role.parquet:3:", "role 'tool'", "system, user, assistant"]),
        ("content.jsonl", tokenizers["llama3"], ["content.jsonl:1:", "(assistant) has content of type int"]),
        ("input.jsonl", tokenizers["llama3"], ["input.jsonl:1:", '"input" is a list, not a string']),
        ("history.parquet", tokenizers["llama3"], ["history.parquet:2:", 'Alpaca\'s "history"', '"messages"']),
        ("keys.jsonl", tokenizers["llama3"], ["keys.jsonl:1:", 'nor Alpaca\'s "instruction" and "output"',
                                              "its keys: question, answer"]),
        ("plain.txt", tokenizers["llama3"], ["plain.txt", "plain text holds no conversations"]),
        ("cols.parquet", tokenizers["llama3"], ["cols.parquet", 'no "messages" (or "conversations") column',
                                                "its columns: text"]),
        ("noanswer.jsonl", str(bare), [str(bare), "no chat template"]),
        ("noanswer.jsonl", str(bare / "tokenizer.json"), ["bare tokenizer file has no chat template"]),
    ]
    for k, (name, tokenizer, expected) in enumerate(cases):
        for workers in ["1", "2"] if k == 0 else ["1"]:
            args = ["--format", "sft", "--input", str(tmp_path / name), "--output-prefix", str(tmp_path / "out" / "c"),
                    "--tokenizer", tokenizer, "--workers", workers]
            assert tool.main(args) == 2, (name, tokenizer)
            err = capsys.readouterr().err.strip()
            assert err.startswith("error: ") and "\n" not in err and all(e in err for e in expected), (expected, err)
    assert tool.main(["--format", "sft", "--input", str(tmp_path / "noanswer.jsonl"), "--output-prefix",
                      str(tmp_path / "out" / "c"), "--tokenizer", tokenizers["llama3"], "--text-key", "body"]) == 2
    assert capsys.readouterr().err.strip() == ('error: --text-key body names the document of --format text; --format '
                                               'sft reads each record\'s "messages" (or "conversations", or "prompt" '
                                               'and "completion")')
    assert not (tmp_path / "out").exists() or os.listdir(tmp_path / "out") == []
