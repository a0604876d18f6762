"""From an imported model to a chat with it, as docs/sft.md walks through: a random Llama (transformers, saved with
a Llama 3 chat tokenizer) -> tools/convert_hf.py import -> a few hundred synthetic conversations in JSON lines ->
tools/preprocess_data.py --format sft -> fine-tuning at DP 2 (data.format=sft) -> tools/generate.py --chat.

The conversations ask for the colour of one of ten things; the answer is a fixed sentence with it. The answer loss
must fall, the log line shows answer tokens/s, and greedy generation with the chat template must answer in the
template's format: the learnt sentence (a thing and its colour), ended by the end-of-turn token (not by the token
limit); tools/evaluate.py on the checkpoint gives the logged validation loss (the same packed sequences).
"""

import contextlib
import io
import json
import random
import re
import sys
from pathlib import Path

import pytest
from chat_fixtures import chat_tokenizer
from harness import run_distributed
from hf_interop import convert_main
from runs import _train, losses

ROOT = Path(__file__).resolve().parents[1]
COLOURS = {"sky": "blue", "grass": "green", "snow": "white", "coal": "black", "blood": "red", "sun": "yellow",
           "orange": "orange", "violet": "purple", "sand": "beige", "ash": "grey"}


def conversations(count: int, seed: int = 0) -> list[dict]:
    rng = random.Random(seed)
    out = []
    for i in range(count):
        thing = rng.choice(sorted(COLOURS))
        question = rng.choice(["What colour is the {}?", "Tell me the colour of the {}.", "The {}: which colour?"])
        answer = f"The {thing} is {COLOURS[thing]}."
        out.append({"prompt": question.format(thing), "completion": answer} if i % 2 else
                   {"messages": [{"role": "user", "content": question.format(thing)},
                                 {"role": "assistant", "content": answer}]})
    return out


def tool(name: str, argv: list[str]) -> tuple[int, str]:
    """tools/<name>.py main(argv) in this process: (exit code, stdout + stderr)."""
    sys.path.insert(0, str(ROOT / "tools"))
    module = __import__(name)
    out = io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(out):
        code = module.main(argv)
    return code, out.getvalue()


def _import_and_preprocess(root: str) -> dict:
    import torch
    import transformers

    root = Path(root)
    hf = chat_tokenizer(root / "hf", "llama3")  # tokenizer files first: config.json is the model's after
    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM(transformers.LlamaConfig(
        vocab_size=261, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=256, rope_theta=5e5, tie_word_embeddings=True,
        bos_token_id=257, eos_token_id=260))
    model.save_pretrained(str(hf))
    sys.path.insert(0, str(ROOT / "tools"))
    import convert_hf

    code, out, err = convert_main(convert_hf, [
        "import", "--hf-dir", str(hf), "--out", str(root / "imported"),
        "--preset-out", str(root / "conf" / "model" / "chat_llama.yaml")])
    assert code == 0, out + err
    (root / "chats.jsonl").write_text("".join(json.dumps(c) + "\n" for c in conversations(400)))
    code, out = tool("preprocess_data", ["--input", str(root / "chats.jsonl"), "--output-prefix",
                                         str(root / "data" / "chats"), "--tokenizer", str(hf), "--format", "sft"])
    assert code == 0, out
    return {"preprocess": out}


def _generate_and_evaluate(root: str) -> tuple[tuple[int, str], tuple[int, str]]:
    chat = tool("generate", ["--ckpt", f"{root}/run/checkpoints", "--chat", "--greedy", "--json",
                             "--max-new-tokens", "40", "--prompt", "What colour is the grass?",
                             "--prompt", "Tell me the colour of the coal."])
    return chat, tool("evaluate", ["--ckpt", f"{root}/run/checkpoints", "--json"])


@pytest.mark.slow
def test_fine_tune_an_imported_model_on_conversations_then_chat(tmp_path):
    root = str(tmp_path)
    (prepared,) = run_distributed(_import_and_preprocess, 1, (root,), timeout=600)
    assert "conversations" in prepared["preprocess"], prepared["preprocess"]
    overrides = [f"hydra.searchpath=[file://{root}/conf]", "model=chat_llama", "model.seq_length=128",
                 f"checkpoint.load={root}/imported", "checkpoint.finetune=true", "checkpoint.dir=checkpoints",
                 f"data.paths=[{root}/data/chats]", f"data.tokenizer={root}/hf", "data.format=sft",
                 "train.iters=150", "train.global_batch_size=8", "train.micro_batch_size=2",
                 "train.log_interval=1", "train.eval_interval=150", "optim.lr=3e-3", "optim.warmup_iters=5",
                 "train.tensorboard=false"]
    run_distributed(_train, 2, (overrides, f"{root}/run"), timeout=900)
    curve = losses(Path(root) / "run")
    first, last = curve[min(curve)], curve[max(curve)]
    assert last < 0.1 * first, f"the answer loss did not fall: {curve}"
    records = [json.loads(line) for line in (Path(root) / "run" / "metrics.jsonl").read_text().splitlines()]
    assert all(r["answer_tokens_per_s"] > 0 for r in records if "loss" in r)
    (((code, out), (evaluated, scores)),) = run_distributed(_generate_and_evaluate, 1, (root,), timeout=600)
    assert code == 0 and evaluated == 0, out + scores
    (val_loss,) = [r["val_loss"] for r in records if "val_loss" in r]  # the packed validation split, at DP 2
    assert json.loads(scores.strip().splitlines()[-1])["loss"] == pytest.approx(val_loss, rel=1e-5)
    answers = [json.loads(line) for line in out.splitlines() if line.startswith("{")]
    said = [re.fullmatch(r"The (\w+) is (\w+)\.", a["text"]) for a in answers]  # the learnt sentence, whole
    assert len(answers) == 2 and all(m and COLOURS.get(m[1]) == m[2] for m in said), answers
    assert all(len(a["new_ids"]) < 40 and a["new_ids"][-1] == 260 for a in answers), answers  # <|eot_id|> ended it
