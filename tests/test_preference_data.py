"""Preference records -> pairs on disk -> packed sequences (training/post/records.py, pairs.py, tools/preprocess_data.py
--format preference): the layouts people ship give transformers' own chat-template rendering with the mask on the
last answer only; every malformed record is one line naming file:line (exit 2 through the tool); a packed sequence
holds each pair's chosen and rejected answers as segments of their own, answer_ids naming their targets."""

import json
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

ROOT = Path(__file__).resolve().parents[1]
SYSTEM = {"role": "system", "content": "Be brief."}
USER, EARLIER = {"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Hello."}
ASK = {"role": "user", "content": "2+2?"}
ANSWERS = ("4.", "Five.")


@pytest.fixture(scope="module")
def tokenizer(tmp_path_factory):
    from chat_fixtures import chat_tokenizer

    from training.data.chat import ChatTokenizer

    return ChatTokenizer(str(chat_tokenizer(tmp_path_factory.mktemp("tok"), "llama3")))


LAYOUTS = {  # (record, the prompt turns it means)
    "strings": ({"prompt": "2+2?", "chosen": ANSWERS[0], "rejected": ANSWERS[1], "system": "Be brief."},
                [SYSTEM, ASK]),
    "conversational": ({"prompt": [SYSTEM, USER, EARLIER, ASK], "chosen": [{"role": "assistant", "content": ANSWERS[0]}],
                        "rejected": [{"role": "assistant", "content": ANSWERS[1]}]}, [SYSTEM, USER, EARLIER, ASK]),
    "ultrafeedback": ({"prompt": "2+2?", "chosen": [USER, EARLIER, ASK, {"role": "assistant", "content": ANSWERS[0]}],
                       "rejected": [USER, EARLIER, ASK, {"role": "assistant", "content": ANSWERS[1]}]},
                      [USER, EARLIER, ASK]),
}


@pytest.mark.fast
@pytest.mark.parametrize("layout", sorted(LAYOUTS))
def test_each_layout_renders_with_the_template_and_masks_the_last_answer(tokenizer, layout):
    from training.post.records import encode_pair

    record, prompt = LAYOUTS[layout]
    for (ids, mask), answer in zip(encode_pair(tokenizer, record, "pairs.jsonl", 1), ANSWERS):
        messages = prompt + [{"role": "assistant", "content": answer}]
        assert ids.tolist() == tokenizer.reference(messages)  # transformers' apply_chat_template
        assert tokenizer.hf.decode(ids[mask.astype(bool)].tolist()) == answer + "<|eot_id|>"  # not "Hello."


BAD = [  # (record, the error after "pairs.jsonl:N: ")
    ({"prompt": "a", "chosen": "b"}, "no 'rejected' (its keys: prompt, chosen)"),
    ({"prompt": "a", "chosen": "b", "rejected": " "}, "the rejected answer is empty"),
    ({"prompt": "a", "chosen": "same", "rejected": "same"}, "the chosen and rejected answers are the same"),
    ({"chosen": [ASK, {"role": "assistant", "content": "4"}], "rejected": [USER, {"role": "assistant", "content": "5"}]},
     "the chosen and rejected conversations differ before their last turn"),
    ({"prompt": "a", "chosen": "b", "rejected": [{"role": "assistant", "content": "c"}]},
     "\"chosen\" is a str but \"rejected\" a list"),
    ({"chosen": [ASK], "rejected": [ASK, {"role": "assistant", "content": "c"}]},
     "the chosen conversation ends with a user turn"),
    (["a", "b"], "a list, not a JSON object"),
]


@pytest.mark.fast
def test_every_malformed_record_is_one_line_naming_its_line(tokenizer):
    from training.errors import ConfigError
    from training.post.records import encode_pair

    for n, (record, message) in enumerate(BAD, 1):
        with pytest.raises(ConfigError) as err:
            encode_pair(tokenizer, record, "pairs.jsonl", n)
        assert str(err.value).startswith(f"pairs.jsonl:{n}: {message}") and "\n" not in str(err.value), str(err.value)


def test_the_tool_writes_pairs_and_refuses_a_bad_record_with_exit_2(tmp_path):
    """Through tools/preprocess_data.py: the byte tokenizer (no template: prompt + answer + end-of-document, TRL's
    standard format), then the packed sequences; and a malformed third line."""
    from training.data.sft import Conversations
    from training.post.pairs import PackedPairs

    good = [{"prompt": "2+2? ", "chosen": "4", "rejected": "five"}, {"prompt": "Hi ", "chosen": "Hello.", "rejected": "Go."},
            {"prompt": "x" * 40, "chosen": "y" * 30, "rejected": "z" * 30}]  # the last: longer than a sequence of 64
    (tmp_path / "pairs.jsonl").write_text("".join(json.dumps(r) + "\n" for r in good))
    run = lambda name: subprocess.run(  # noqa: E731
        [sys.executable, str(ROOT / "tools/preprocess_data.py"), "--format", "preference", "--input",
         str(tmp_path / name), "--output-prefix", str(tmp_path / "pairs"), "--tokenizer", "byte"],
        capture_output=True, text=True, cwd=ROOT)
    done = run("pairs.jsonl")
    assert done.returncode == 0 and "3 pairs" in done.stdout, done.stderr[-2000:]
    (tmp_path / "bad.jsonl").write_text(json.dumps(good[0]) + "\n\n" + json.dumps({"prompt": "a", "chosen": "b"}) + "\n")
    bad = run("bad.jsonl")
    assert bad.returncode == 2 and bad.stderr.strip().splitlines()[-1].startswith(
        f"error: {tmp_path / 'bad.jsonl'}:3: no 'rejected'"), bad.stderr[-2000:]

    from megatron.core.datasets.indexed_dataset import IndexedDataset

    tokens, masks = IndexedDataset(str(tmp_path / "pairs")), IndexedDataset(str(tmp_path / "pairs.mask"))
    assert tokens[0].tolist() == list(b"2+2? 4") + [256] and masks[0].tolist() == [0] * 5 + [1, 1]
    data = PackedPairs(Conversations([(tokens, masks, range(0, 6))]), 64, 1234, 1, 256)
    assert data.dropped == 1 and len(data) == 1  # the long pair left out; both short ones in one sequence
    row = data[0]
    assert sorted(row["pair_index"][row["pair_index"] >= 0].tolist()) == [0, 1]
    for k, pair in enumerate(row["pair_index"][:2].tolist()):
        for side in (0, 1):
            where = row["answer_ids"] == 2 * k + side
            conversation = tokens[2 * pair + side]
            assert row["labels"][where].tolist() == conversation[masks[2 * pair + side].astype(bool)].tolist()
            assert set(row["segment_ids"][where].tolist()) == {2 * k + 1 + side}  # a segment of its own
    assert row["ref_logps"].shape == (32, 2) and not row["loss_mask"][row["answer_ids"] < 0].any()
