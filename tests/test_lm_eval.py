"""tools/evaluate.py --tasks (training/interop/lm_eval_adapter.py): lm-evaluation-harness's own task definitions,
here three of ours over local JSON lines (tests/fixtures/lm_eval: multiple choice, rolling perplexity,
generation) and a fourth the test writes (choices the export continues greedily, and near misses), scored on a
checkpoint at tp1 and tp2 give what lm-eval's `hf` backend gives on the same checkpoint exported to Hugging Face
(tools/convert_hf.py export): equal accuracies, greedy flags and generated text, every log-likelihood within 1e-4
(plus the fp32 resolution of hf's sums). Offline: HF_DATASETS_OFFLINE /
HF_HUB_OFFLINE, the datasets cache in tmp.

Two launches: one process saves a checkpoint (one step), exports it, runs lm-eval's hf backend and the tool at
tp1 (main() in that process); the tool then runs at tp2 on 2 processes of its own (--nproc 2, as a user would)."""

from __future__ import annotations

import contextlib
import io
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from harness import run_distributed
from hf_interop import convert_main
from runs import QUICK, _train

ROOT = Path(__file__).resolve().parents[1]
FIXTURES = "tests/fixtures/lm_eval"  # the YAMLs' data_files are relative to the repository root
TASKS = ["tiny_choice", "tiny_perplexity", "tiny_generate", "tiny_greedy"]  # tiny_greedy: written by greedy_task
OFFLINE = {"HF_DATASETS_OFFLINE": "1", "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1"}
TOLERANCE = 1e-4  # log-likelihood, absolute (fp32; the exported model computes in another order)
# Random weights, saved after one step: with a larger init std the logits spread (std ~3) so greedy tokens are
# clear-cut and varied (a model trained a few steps writes only spaces); the byte tokenizer, 64-token windows.
SHARP = ["train.iters=1", "model.init_method_std=0.1"]


def byte_tokenizer(out: Path) -> None:
    """A Hugging Face tokenizer that encodes text as ours does with `byte`: UTF-8 byte b is id b, end-of-document
    256 (a byte-level BPE without merges), and a config.json giving the exported model eos_token_id 256."""
    from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    printable = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    others = [b for b in range(256) if b not in printable]  # GPT-2's bytes_to_unicode: the rest from chr(256) up
    char = {**{b: chr(b) for b in printable}, **{b: chr(256 + i) for i, b in enumerate(others)}}
    tok = Tokenizer(models.BPE(vocab={char[b]: b for b in range(256)} | {"<|endoftext|>": 256}, merges=[]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    tok.decoder = decoders.ByteLevel()
    tok.add_special_tokens([AddedToken("<|endoftext|>", special=True)])
    PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<|endoftext|>",
                            clean_up_tokenization_spaces=False).save_pretrained(str(out))
    (out / "config.json").write_text(json.dumps({"eos_token_id": 256}))


def greedy_task(root: Path) -> None:
    """root/tasks/tiny_greedy: after each prompt of choice.jsonl and generate.jsonl, what the exported model writes
    greedily (hf's generate; its first 1-3 bytes up to one that is not ASCII) as the first choice (is_greedy True),
    then that with its first byte changed and, when longer than one, with its last byte changed (False): the flag
    is checked both ways and on every token (tiny_choice's answers are never greedy)."""
    import torch
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(root / "hf", dtype=torch.float32)
    docs = []
    for name, field in (("choice.jsonl", "question"), ("generate.jsonl", "prompt")):
        for line in (ROOT / FIXTURES / name).read_text().splitlines():
            prompt = json.loads(line)[field]
            ids = torch.tensor([list(prompt.encode())])  # the byte tokenizer: byte b is id b
            new = model.generate(ids, max_new_tokens=3, do_sample=False, pad_token_id=256)[0, ids.shape[1]:].tolist()
            ascii_ = next((i for i, t in enumerate(new) if not 0 < t < 128), len(new))
            if ascii_:  # one byte each, in both tokenizers
                greedy = bytes(new[:ascii_]).decode()
                flips = [chr(ord(greedy[0]) ^ 1) + greedy[1:]] + ([greedy[:-1] + chr(ord(greedy[-1]) ^ 1)]
                                                                  if len(greedy) > 1 else [])
                docs.append({"question": prompt, "choices": [greedy, *flips], "answer": 0})
    assert len(docs) >= 3 and any(len(doc["choices"]) == 3 for doc in docs), docs
    tasks = root / "tasks"
    tasks.mkdir()
    (tasks / "greedy.jsonl").write_text("".join(json.dumps(doc) + "\n" for doc in docs))
    (tasks / "tiny_greedy.yaml").write_text(
        (ROOT / FIXTURES / "tiny_choice.yaml").read_text().replace("tiny_choice", "tiny_greedy")
        .replace(f"{FIXTURES}/choice.jsonl", str(tasks / "greedy.jsonl"))
        .replace('doc_to_text: "Question: {{question}}\\nAnswer:"',
                 'doc_to_text: "{{question}}"\ntarget_delimiter: ""'))


def tool_args(ckpt: Path, output: Path) -> list[str]:
    return ["--ckpt", str(ckpt), "--tasks", ",".join(TASKS), "--include-path", FIXTURES, "--include-path",
            str(ckpt.parents[1] / "tasks"), "--batch-size", "4",
            "--bootstrap-iters", "0", "--log-samples", "--output", str(output), "--json"]


def _reference(root: str) -> dict:
    """One process: train and save, export to HF, score with lm-eval's hf backend, then with ours at tp1."""
    os.chdir(ROOT)
    os.environ.update(OFFLINE, HF_HOME=f"{root}/hf_home")
    sys.path.insert(0, str(ROOT / "tools"))
    import convert_hf
    import evaluate
    from lm_eval import simple_evaluate
    from lm_eval.tasks import TaskManager
    from lm_eval.utils import handle_non_serializable

    run = Path(root) / "run"
    _train(QUICK + SHARP, str(run))
    byte_tokenizer(Path(root) / "tokenizer")
    code, out, err = convert_main(convert_hf, ["export", "--ckpt", str(run / "checkpoints"), "--out",
                                               f"{root}/hf", "--tokenizer-dir", f"{root}/tokenizer"])
    assert code == 0, out + err
    greedy_task(Path(root))
    hf = simple_evaluate(model="hf", model_args={"pretrained": f"{root}/hf", "dtype": "float32"}, tasks=TASKS,
                         batch_size=1, device="cpu", log_samples=True, bootstrap_iters=0,
                         task_manager=TaskManager(include_path=[FIXTURES, f"{root}/tasks"], include_defaults=False))
    assert evaluate.main(tool_args(run / "checkpoints", Path(root) / "tp1.json")) == 0
    hub = Path(root) / "hub_task"  # a task whose dataset is on the Hub, offline: one line, exit 2
    hub.mkdir()
    yaml = (ROOT / FIXTURES / "tiny_choice.yaml").read_text().replace("tiny_choice", "tiny_hub")
    (hub / "tiny_hub.yaml").write_text(yaml.replace("dataset_path: json", "dataset_path: allenai/ai2_arc\n"
                                                                          "dataset_name: ARC-Easy"))
    with contextlib.redirect_stderr(io.StringIO()) as err:
        offline = evaluate.main(["--ckpt", str(run / "checkpoints"), "--tasks", "tiny_hub", "--include-path",
                                 str(hub)])
    return {"hf": json.loads(json.dumps(hf, default=handle_non_serializable)),
            "tp1": json.loads((Path(root) / "tp1.json").read_text()), "offline": (offline, err.getvalue())}


@pytest.fixture(scope="module")
def scored(tmp_path_factory):
    root = tmp_path_factory.mktemp("lm_eval")
    (result,) = run_distributed(_reference, 1, (str(root),), timeout=600)
    env = {**os.environ, **OFFLINE, "HF_HOME": str(root / "hf_home")}
    proc = subprocess.run([sys.executable, "tools/evaluate.py", *tool_args(root / "run" / "checkpoints",
                                                                          root / "tp2.json"),
                           "--nproc", "2", "parallel.tp=2"], cwd=ROOT, env=env, capture_output=True, text=True,
                          timeout=600)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-5000:]
    line = json.loads(proc.stdout.strip().splitlines()[-1])  # --json: one line on stdout
    assert line["layout"] == "tp 2 pp 1" and set(line["results"]) == set(TASKS), line
    return {**result, "tp2": json.loads((root / "tp2.json").read_text())}


def responses(result: dict, task: str) -> list:
    """Per document (by doc_id): lm-eval's responses to its requests (one per choice, window sum or text)."""
    return [s["filtered_resps"] for s in sorted(result["samples"][task], key=lambda s: s["doc_id"])]


def test_a_task_on_the_hub_offline_is_one_line(scored):
    code, err = scored["offline"]  # the last line (lm-eval warns about the YAML's metrics before)
    last = err.strip().splitlines()[-1]
    assert code == 2 and last.startswith("error: --tasks tiny_hub: a task's dataset could not be fetched (") \
        and "--include-path" in last and "Traceback" not in err, err


@pytest.mark.parametrize("layout", ["tp1", "tp2"])
def test_tasks_score_as_lm_evals_hf_backend_on_the_export(scored, layout):
    hf, ours = scored["hf"], scored[layout]
    assert ours["config"]["layout"] == ("tp 1 pp 1" if layout == "tp1" else "tp 2 pp 1")
    assert ours["config"]["max_length"] == 64  # model.seq_length (tests/runs.py QUICK); the export's too

    choice_hf, choice = responses(hf, "tiny_choice"), responses(ours, "tiny_choice")
    assert len(choice) == 12 and [len(c) for c in choice] == [len(c) for c in choice_hf]
    pairs = [(float(ll), float(ll_hf)) for doc, doc_hf in zip(choice, choice_hf) for (ll, _), (ll_hf, _) in
             zip(doc, doc_hf)]
    rolling = [(ll, ll_hf) for (ll,), (ll_hf,) in zip(responses(ours, "tiny_perplexity"),
                                                      responses(hf, "tiny_perplexity"))]
    assert len(rolling) == 4 and max(len(s["doc"]["text"]) for s in ours["samples"]["tiny_perplexity"]) > 3 * 64
    print(f"{layout}: max |log-likelihood - hf's|: {max(abs(a - b) for a, b in pairs):.3g} (choices), "
          f"{max(abs(a - b) for a, b in rolling):.3g} (documents, {min(b for _, b in rolling):.0f} and up)")
    for ll, ll_hf in pairs + rolling:  # hf sums each window in fp32: its own resolution at |ll| ~ 1000 is 6e-5
        assert abs(ll - ll_hf) < TOLERANCE + 2**-24 * abs(ll_hf), (ll, ll_hf)
    assert [g for doc in choice for _, g in doc] == [g for doc in choice_hf for _, g in doc]  # is_greedy
    greedy_hf, greedy = responses(hf, "tiny_greedy"), responses(ours, "tiny_greedy")
    built = [[True] + [False] * (len(doc) - 1) for doc in greedy_hf]  # as greedy_task built them
    assert [[g for _, g in doc] for doc in greedy_hf] == built and [[g for _, g in doc] for doc in greedy] == built
    for metric in ("acc,none", "acc_norm,none"):
        assert ours["results"]["tiny_choice"][metric] == hf["results"]["tiny_choice"][metric], metric
    for metric in ("word_perplexity,none", "byte_perplexity,none", "bits_per_byte,none"):
        assert ours["results"]["tiny_perplexity"][metric] == pytest.approx(
            hf["results"]["tiny_perplexity"][metric], rel=1e-5), metric

    generated_hf, generated = responses(hf, "tiny_generate"), responses(ours, "tiny_generate")
    print(f"{layout}: generated {generated}")
    assert generated == generated_hf and len(generated) == 5 and any(g[0] for g in generated), generated
    assert ours["results"]["tiny_generate"]["exact_match,none"] == hf["results"]["tiny_generate"]["exact_match,none"]


def test_user_errors_are_one_line_before_any_process(monkeypatch, capsys, tmp_path):
    monkeypatch.syspath_prepend(str(ROOT / "tools"))
    import evaluate

    code = evaluate.main(["--ckpt", str(tmp_path), "--tasks", "x", "--include-path", str(tmp_path / "nowhere")])
    err = capsys.readouterr().err
    assert code == 2 and err.startswith("error: --include-path ") and len(err.splitlines()) == 1, err
    code = evaluate.main(["--ckpt", str(tmp_path), "--tasks", "x", "--batch-size", "0"])
    err = capsys.readouterr().err
    assert code == 2 and err.startswith("error: --batch-size=0") and len(err.splitlines()) == 1, err
