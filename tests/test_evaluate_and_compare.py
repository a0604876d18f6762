"""After training: tools/evaluate.py scores a checkpoint on its run's validation batches (equal to the val loss
the run logged, at the same and at another layout) and on a text file; tools/compare_runs.py draws runs
side by side and --assert-close tells apart runs that differ."""

import json
import subprocess
import sys
from pathlib import Path

import pytest
from harness import TOOL_NOISE
from runs import train

ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    """Two short runs: 4 iterations, evaluated (2 batches) and saved at the end; the second from another seed."""
    runs = {}
    for seed in (1234, 99):
        run_dir = tmp_path_factory.mktemp(f"run{seed}")
        train(["train.iters=4", "train.eval_interval=4", "train.eval_iters=2", f"train.seed={seed}"], 1, run_dir)
        runs[seed] = run_dir
    return runs


def evaluate(*args: str) -> dict:
    proc = subprocess.run([sys.executable, "tools/evaluate.py", "--json", *args], cwd=ROOT, capture_output=True,
                          text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-3000:]
    assert not TOOL_NOISE.search(proc.stdout + proc.stderr), proc.stderr  # quiet tools (checkpoint loading's notes)
    return json.loads(proc.stdout.strip().splitlines()[-1])


def test_evaluate_equals_the_logged_val_loss_at_any_layout(trained, tmp_path):
    run_dir = trained[1234]
    records = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    (logged,) = [r["val_loss"] for r in records if "val_loss" in r]
    same = evaluate("--ckpt", str(run_dir / "checkpoints"))
    assert same["loss"] == pytest.approx(logged, rel=1e-9) and same["batches"] == 2
    assert same["tokens"] == 2 * 8 * 64  # eval_iters x global batch x seq_length (tests/runs.py QUICK)
    tp2 = evaluate("--ckpt", str(run_dir / "checkpoints"), "--nproc", "2", "parallel.tp=2")
    assert tp2["loss"] == pytest.approx(logged, rel=1e-5) and tp2["layout"] == "tp 2 pp 1 cp 1 dp 1"

    text = tmp_path / "notes.txt"
    text.write_text("The import statement combines two operations.\n\nIt searches for the named module.\n")
    on_text = evaluate("--ckpt", str(run_dir / "checkpoints"), "--text", str(text))
    lines = [line for line in text.read_text().splitlines() if line.strip()]
    assert on_text["tokens"] == sum(len(line.encode()) + 1 for line in lines) - 1  # each token predicted once
    assert 0 < on_text["loss"] < 10
    cp2 = evaluate("--ckpt", str(run_dir / "checkpoints"), "--text", str(text), "--nproc", "2", "parallel.cp=2")
    assert cp2["layout"] == "tp 1 pp 1 cp 2 dp 1" and cp2["tokens"] == on_text["tokens"]
    assert cp2["loss"] == pytest.approx(on_text["loss"], rel=1e-5)


def test_compare_runs_draws_and_asserts(trained, tmp_path):
    from PIL import Image

    a, b = (str(trained[s]) for s in (1234, 99))
    out = tmp_path / "runs.png"
    same = subprocess.run([sys.executable, "tools/compare_runs.py", a, a, "--labels", "a,again", "--out", str(out),
                           "--assert-close", "1e-9"], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert same.returncode == 0, same.stdout + same.stderr
    with Image.open(out) as picture:
        assert picture.format == "PNG" and picture.size[0] > 400 and picture.size[1] > 300
    differ = subprocess.run([sys.executable, "tools/compare_runs.py", a, b, "--out", str(tmp_path / "d.png"),
                             "--assert-close", "1e-3"], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert differ.returncode == 1 and "FAILED" in differ.stdout, differ.stdout + differ.stderr
    missing = subprocess.run([sys.executable, "tools/compare_runs.py", str(tmp_path / "nowhere")], cwd=ROOT,
                             capture_output=True, text=True, timeout=120)
    assert missing.returncode == 2 and missing.stderr.startswith("error: ") and "no metrics.jsonl" in missing.stderr


def _metrics(path: Path, losses: dict[int, float]) -> str:
    path.write_text("".join(json.dumps({"iteration": i, "loss": loss, "lr": 1e-3}) + "\n"
                            for i, loss in losses.items()))
    return str(path)


def test_compare_runs_assert_close_at_its_tolerance(tmp_path, monkeypatch, capsys):
    """--assert-close RTOL fails on a relative loss difference of more than RTOL (from the first run's loss), at
    any shared iteration, either sign; exactly RTOL passes. RTOL = 2^-10 and losses 8, 4, 2: exact in binary."""
    monkeypatch.syspath_prepend(str(ROOT / "tools"))
    import compare_runs

    rtol = 2.0 ** -10
    first = _metrics(tmp_path / "a.jsonl", {1: 8.0, 2: 4.0, 3: 2.0})

    def compare(losses: dict[int, float]) -> tuple[int, str]:
        second = _metrics(tmp_path / "b.jsonl", losses)
        code = compare_runs.main([first, second, "--labels", "a,b", "--out", str(tmp_path / "c.png"),
                                  "--assert-close", repr(rtol)])
        return code, capsys.readouterr().out

    under = {1: 8.0 * (1 + 0.9 * rtol), 2: 4.0 * (1 - 0.9 * rtol), 3: 2.0 * (1 + 0.99 * rtol)}
    assert compare(under) == (0, f"wrote {tmp_path / 'c.png'} (2 runs)\n"
                                 f"max relative loss difference 9.668e-04 (tolerance {rtol:g}): ok\n")
    code, out = compare({1: 8.0, 2: 4.0 * (1 + rtol), 3: 2.0})  # exactly the tolerance: 4.00390625
    assert code == 0 and "ok" in out, out
    for sign in (1, -1):  # just over, at the last iteration only
        code, out = compare({**under, 3: 2.0 * (1 + sign * 1.01 * rtol)})
        assert code == 1, out
        assert f"max relative loss difference 9.863e-04 (tolerance {rtol:g}): FAILED; b vs a at iteration 3: " \
               f"{2.0 * (1 + sign * 1.01 * rtol):.6f} vs 2.000000" in out, out


def test_compare_runs_labels_runs_of_the_same_name_apart(tmp_path, monkeypatch, capsys):
    """Two run directories (or their metrics.jsonl) with the same last component are labelled by their shortest
    distinct path endings, a/run and b/run; a run given twice asks for --labels (exit 2)."""
    monkeypatch.syspath_prepend(str(ROOT / "tools"))
    import compare_runs

    for name in ("a", "b"):
        (tmp_path / name / "run").mkdir(parents=True)
    a = _metrics(tmp_path / "a" / "run" / "metrics.jsonl", {1: 8.0})
    b = _metrics(tmp_path / "b" / "run" / "metrics.jsonl", {1: 4.0})
    assert compare_runs.default_labels([str(Path(a).parent), b, str(tmp_path / "c")]) == ["a/run", "b/run", "c"]
    code = compare_runs.main([str(Path(a).parent), str(Path(b).parent), "--out", str(tmp_path / "c.png"),
                              "--assert-close", "0.1"])
    out = capsys.readouterr().out
    assert code == 1 and "b/run vs a/run at iteration 1" in out, out
    assert compare_runs.main([a, a, "--out", str(tmp_path / "c.png")]) == 2
    assert "--labels" in capsys.readouterr().err
