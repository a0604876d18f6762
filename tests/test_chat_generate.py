"""tools/generate.py --chat and export keeping the chat template (issue 30). A tiny model trained on one
conversation in the Llama 3 chat template (tests/chat_fixtures.py: byte ids + the family's special tokens) as its
data.tokenizer: generate --chat renders each prompt exactly as transformers' apply_chat_template(...,
add_generation_prompt=True) does, answers with the trained reply and stops at <|eot_id|> (the end of the turn, not
end-of-document), printing the answer alone; a tokenizer without a chat template is one line, exit 2; on a
terminal it is a conversation; export without --tokenizer-dir takes the run's tokenizer directory, so the exported
AutoTokenizer renders conversations to the same ids."""

import json
import os
import pty
import select
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest
from harness import TOOL_NOISE, run_distributed

pytest.importorskip("transformers")
ROOT = Path(__file__).resolve().parents[1]
SYSTEM, USER, ANSWER = "Be brief.", "hello", "Hi there!"  # the one conversation the model learns
PROMPTS = [USER, "who are you?"]  # the second: another prompt length, rendered by the template too
CONVERSATIONS = [  # export: rendered by the source's and the exported tokenizer's templates alike
    ([{"role": "user", "content": "hi"}], True),
    ([{"role": "system", "content": SYSTEM}, {"role": "user", "content": USER}], True),
    ([{"role": "user", "content": "a"}, {"role": "assistant", "content": "b"}, {"role": "user", "content": "c"}],
     False),
]


def _messages(user: str, answer: str | None = None) -> list[dict]:
    return [{"role": "system", "content": SYSTEM}, {"role": "user", "content": user}] + \
        ([{"role": "assistant", "content": answer}] if answer is not None else [])


def _train_and_export(root: str) -> dict:
    """The chat tokenizer; 400 copies of the conversation (template ids, then end-of-document) as the data; 60
    training steps; the export without --tokenizer-dir; the ids each tokenizer's template gives."""
    from chat_fixtures import chat_tokenizer
    from runs import QUICK, _train
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from training.data.datasets import write_indexed
    from training.data.tokenizer import HFTokenizer

    sys.path.insert(0, str(ROOT / "tools"))
    import convert_hf
    import torch

    root = Path(root)
    tok_dir = chat_tokenizer(root / "tok", "llama3")
    source = AutoTokenizer.from_pretrained(str(tok_dir), local_files_only=True)

    def ids(tokenizer, messages, generation_prompt=True) -> list[int]:
        return list(tokenizer.apply_chat_template(messages, add_generation_prompt=generation_prompt, tokenize=True,
                                                  return_dict=True)["input_ids"])

    document = ids(source, _messages(USER, ANSWER), False)  # ... assistant header, ANSWER, <|eot_id|>
    write_indexed(root / "data" / "chat", [document] * 400, HFTokenizer(str(tok_dir)))
    _train(QUICK + [f"data.tokenizer={tok_dir}", f"data.paths=[{root / 'data' / 'chat'}]",
                    f"data.cache_dir={root / 'cache'}", "train.iters=60", "optim.lr=1e-2"], str(root / "run"))
    code = convert_hf.main(["export", "--ckpt", str(root / "run" / "checkpoints"), "--out", str(root / "hf")])
    prompt = torch.tensor([ids(source, _messages(USER))])

    def exported_ids():
        exported = AutoTokenizer.from_pretrained(str(root / "hf"), local_files_only=True)
        return [ids(exported, m, g) for m, g in CONVERSATIONS]

    def hf_answer():  # transformers' greedy answer: it stops at the exported config.json's eos_token_id
        model = AutoModelForCausalLM.from_pretrained(str(root / "hf")).eval()
        answer = model.generate(prompt, attention_mask=torch.ones_like(prompt), max_new_tokens=24, do_sample=False)
        return answer[0, prompt.shape[1]:].tolist()

    return {"code": code, "eot": source.convert_tokens_to_ids("<|eot_id|>"),
            "prompt_ids": [ids(source, _messages(p)) for p in PROMPTS],
            "source": [ids(source, m, g) for m, g in CONVERSATIONS],
            "exported": _or_error(exported_ids), "hf_answer": _or_error(hf_answer)}


def _or_error(fn):
    """fn(), or its error as a string (a broken export fails its own assertion, not the fixture)."""
    try:
        return fn()
    except Exception as err:  # noqa: BLE001
        return f"{type(err).__name__}: {err}"


@pytest.fixture(scope="module")
def chat_run(tmp_path_factory):
    root = tmp_path_factory.mktemp("chat")
    (result,) = run_distributed(_train_and_export, 1, (str(root),), timeout=600)
    return root, result


def tool(*args: str, stdin=None) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "tools/generate.py", *args], cwd=ROOT, capture_output=True, text=True,
                          timeout=300, stdin=stdin, env=dict(os.environ, OMP_NUM_THREADS="1"))


def test_chat_prompts_are_the_templates_ids_and_the_answer_stops_at_the_end_of_the_turn(chat_run):
    root, expected = chat_run
    assert expected["code"] == 0
    proc = tool("--ckpt", str(root / "run" / "checkpoints"), "--chat", "--system", SYSTEM,
                *[a for p in PROMPTS for a in ("--prompt", p)], "--greedy", "--json", "--max-new-tokens", "24")
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-3000:]
    assert not TOOL_NOISE.search(proc.stdout + proc.stderr), proc.stderr
    lines = [json.loads(line) for line in proc.stdout.splitlines() if line.startswith("{")]
    assert [line["prompt"] for line in lines] == PROMPTS
    assert [line["prompt_ids"] for line in lines] == expected["prompt_ids"]  # transformers' template, id for id
    # the trained reply, ended by <|eot_id|> (256 = end-of-document follows it in the data: not reached)
    assert lines[0]["new_ids"] == list(ANSWER.encode()) + [expected["eot"]], lines[0]
    assert lines[0]["text"] == ANSWER  # the answer alone: no prompt, no end-of-turn token
    assert len(lines[1]["new_ids"]) == 24 or lines[1]["new_ids"][-1] in (expected["eot"], 256), lines[1]
    # text output: the answer alone, after the prompt's header line
    plain = tool("--ckpt", str(root / "run" / "checkpoints"), "--chat", "--system", SYSTEM, "--prompt", USER,
                 "--prompt", USER, "--greedy", "--max-new-tokens", "24")
    assert plain.returncode == 0, plain.stderr[-3000:]
    assert plain.stdout.splitlines()[-4:] == [f"--- {USER!r}", ANSWER] * 2, plain.stdout


def test_chat_without_a_template_is_one_line(chat_run, tmp_path):
    root, _ = chat_run
    bare = shutil.copytree(root / "tok", tmp_path / "bare")
    (bare / "chat_template.jinja").unlink()  # tokenizer_config.json holds no chat_template either
    for tokenizer in (str(bare), "byte"):
        proc = tool("--ckpt", str(root / "run" / "checkpoints"), "--chat", "--prompt", USER, "--tokenizer", tokenizer)
        assert proc.returncode == 2, proc.stderr[-3000:]
        errors = [line for line in proc.stderr.splitlines() if line.strip()]
        assert len(errors) == 1 and "no chat template" in errors[0] and "--tokenizer" in errors[0], proc.stderr


def test_chat_on_a_terminal_is_a_conversation(chat_run):
    """Two turns typed on a pseudo-terminal, then Ctrl-D: each answer streams, the loop ends with exit 0."""
    root, _ = chat_run
    leader, follower = pty.openpty()
    proc = subprocess.Popen([sys.executable, "tools/generate.py", "--ckpt", str(root / "run" / "checkpoints"),
                             "--chat", "--system", SYSTEM, "--greedy", "--max-new-tokens", "24"], cwd=ROOT,
                            stdin=follower, stdout=follower, stderr=subprocess.PIPE,
                            env=dict(os.environ, OMP_NUM_THREADS="1"))
    os.close(follower)
    turns, seen, sent, deadline = [f"{USER}\n".encode()] * 2 + [b"\x04"], b"", 0, time.monotonic() + 240
    try:
        while time.monotonic() < deadline and proc.poll() is None:
            if select.select([leader], [], [], 1)[0]:
                try:
                    seen += os.read(leader, 4096)
                except OSError:  # the terminal closed: the process ended
                    break
            if sent < len(turns) and seen.count(b"you> ") > sent:  # the next prompt is up: type the next turn
                os.write(leader, turns[sent])
                sent += 1
        proc.wait(timeout=60)
        while select.select([leader], [], [], 0.2)[0]:  # what is still in the terminal
            try:
                seen += os.read(leader, 4096)
            except OSError:
                break
    finally:
        os.close(leader)
        if proc.poll() is None:
            proc.kill()
    text = seen.decode(errors="replace").replace("\r\n", "\n")
    assert proc.returncode == 0, text + proc.stderr.read().decode()[-3000:]
    assert sent == len(turns) and f"you> {USER}\n{ANSWER}\nyou> {USER}\n" in text, text


def test_export_without_tokenizer_dir_keeps_the_runs_tokenizer_and_chat_template(chat_run):
    """data.tokenizer was the chat tokenizer's directory: the export copies it (chat_template.jinja included) and
    its eos id, so transformers renders, answers and stops as the source and our tool do."""
    root, expected = chat_run
    assert expected["code"] == 0
    assert (root / "hf" / "chat_template.jinja").is_file()
    assert expected["exported"] == expected["source"]  # the same template ids, conversation by conversation
    assert json.loads((root / "hf" / "config.json").read_text())["eos_token_id"] == expected["eot"]
    assert expected["hf_answer"] == list(ANSWER.encode()) + [expected["eot"]]  # transformers' generate() stops there
