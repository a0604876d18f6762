"""tools/plan.py plans the user's job: the batch is stated (the user's, or a realistic one for a published model),
the micro batch is searched, the published jobs of docs/parallelism.md fit, a mixture of experts gets expert
parallelism, and when nothing fits the planner says what would and lists the layouts closest to fitting.

Reference values from outside this repository: Megatron-Bridge's recipes train Llama 3 8B at seq 8192 with
global batch 128 (its H100 benchmarks) to 512 (its pre-training recipe), i.e. 1-4 M tokens a step, micro batch 1,
TP 1, CP 2; Qwen3-30B-A3B on 8 H100s at TP 4, PP 2, EP 4 with sequence parallelism and full recomputation.
"""

from __future__ import annotations

import importlib.util
import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
M = 2 ** 20


def _tool():
    spec = importlib.util.spec_from_file_location("plan_tool", ROOT / "tools/plan.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _run(capsys, args: list[str]) -> str:
    assert _tool().run(args) == 0
    return capsys.readouterr().out


def _plan(args: list[str]) -> tuple[list[dict], str]:
    plan = _tool()
    settings, overrides, _ = plan.parse_args(args)
    return plan.plan(settings, overrides)


def _table(out: str) -> list[dict]:
    """The printed table's rows as {column: text}."""
    lines = out.splitlines()
    head = next(i for i, line in enumerate(lines) if line.lstrip().startswith("#  tp"))
    names = lines[head].replace("|", " ").split()
    rows = []
    for line in lines[head + 2:]:
        if not line.strip():
            break
        rows.append(dict(zip(names, line.replace("|", " ").split())))
    return rows


def test_published_model_is_planned_at_a_realistic_batch_stated_in_the_header(capsys):
    """llama3_1_8b on 2 x 8 GPUs with no batch given: a global batch of 1-4 M tokens (the recipes' range), the
    micro batch searched, bf16, all said in the header and repeated in the recommended command; the user's batch
    is kept; a small model keeps the config's global batch and searches the micro batch."""
    out = _run(capsys, ["model=llama3_1_8b", "model.seq_length=8192", "plan.nodes=2", "plan.top=3"])
    batch = next(line for line in out.splitlines() if line.startswith("batch: "))
    global_batch = int(re.search(r"global batch (\d+)", batch).group(1))
    assert 1 * M <= global_batch * 8192 <= 4 * M and "train.global_batch_size" in batch, batch
    assert "micro batch searched" in batch and "bf16" in batch, batch
    command = next(line for line in out.splitlines() if line.startswith("recommended (#1): "))
    assert f"train.global_batch_size={global_batch}" in command and "train.precision=bf16" in command, command
    micro = int(re.search(r"train\.micro_batch_size=(\d+)", command).group(1))
    assert global_batch % micro == 0, command

    rows, header = _plan(["model=llama3_1_8b", "train.global_batch_size=64", "train.micro_batch_size=2"])
    assert "global batch 64 (yours)" in header and "micro batch 2 (yours)" in header, header
    assert {(r["global_batch_size"], r["micro_batch_size"]) for r in rows} == {(64, 2)}
    assert all("train.micro_batch_size" not in r["overrides"] for r in rows)

    rows, header = _plan(["model=tiny", "plan.gpus_per_node=1"])  # 0.8 M parameters: the quickstart's batch
    assert "global batch 16 (the config default" in header and "micro batch searched" in header, header
    assert rows[0]["fits"] and rows[0]["micro_batch_size"] == 16, rows[0]  # one GPU: the whole batch at once


def test_llama31_8b_on_two_nodes_at_seq_8192_fits_without_context_parallel_4():
    """The issue's job: 2 x 8 x 80 GB, seq 8192. The tiny default's batch capped DP at 4 and the planner split
    sequences 4 ways; at a realistic batch the pick fits with TP 1 and at most CP 2, micro batch 1 (the recipes')."""
    rows, _ = _plan(["model=llama3_1_8b", "model.seq_length=8192", "plan.nodes=2"])
    best = rows[0]
    assert best["recommended"] and best["fits"], best
    assert 1 * M <= best["global_batch_size"] * 8192 <= 4 * M, best
    assert best["tp"] == 1 and best["cp"] <= 2 and best["micro_batch_size"] == 1, best
    assert best["tp"] * best["pp"] * best["cp"] * best["dp"] == 16


def test_qwen3_30b_a3b_on_8_gpus_fits_with_expert_parallelism():
    """Qwen3-30B-A3B on 8 x 80 GB at a realistic batch: layouts fit (the issue's plan at micro batch 4 had none),
    the pick splits the experts (ep > 1, folded over TP / DP ranks inside the node), and Megatron-Bridge's own
    layout for this job (TP 4, PP 2, EP 4, SP, full recompute) is among those that fit."""
    rows, header = _plan(["model=qwen3_30b_a3b"])
    best = rows[0]
    assert best["recommended"] and best["ep"] > 1 and best["ep"] <= 8 and best["tp"] <= 8, best
    assert 1 * M <= best["global_batch_size"] * 4096 <= 4 * M, best
    recipe = [r for r in rows if (r["tp"], r["pp"], r["ep"], r["sp"], r["recompute"]) == (4, 2, 4, True, "full")]
    assert recipe and any(r["fits"] for r in recipe), recipe
    assert len({r["ep"] for r in rows if r["fits"]}) > 1  # the fitting rows are not one EP size


def test_nothing_fits_says_what_would_and_lists_the_closest_layouts(capsys):
    """Mixtral-8x7B on one node of 8 x 80 GB: nothing fits. The table lists the layouts closest to fitting, least
    memory first, expert-parallel ones among them; the message names the node count that fits (checked by
    planning it) and larger GPUs. With the user's micro batch 4, Qwen3-30B-A3B (the issue's case): it names the
    smaller micro batch, and planning without it finds layouts that fit."""
    out = _run(capsys, ["model=mixtral_8x7b", "plan.top=10"])
    assert ", 0 fit; the 10 closest to fitting" in out, out
    shown = _table(out)
    totals = [float(r["total"]) for r in shown]
    assert len(shown) == 10 and totals == sorted(totals), totals
    assert any(int(r["ep"]) > 1 for r in shown), shown
    nodes = int(re.search(r"more GPUs: plan\.nodes=(\d+) \(", out).group(1))
    assert re.search(r"larger GPUs: plan\.gpu_mem_gb=\d+", out), out
    assert any(r["fits"] for r in _plan(["model=mixtral_8x7b", f"plan.nodes={nodes}"])[0])
    assert not any(r["fits"] for r in _plan(["model=mixtral_8x7b", f"plan.nodes={nodes // 2}"])[0])

    args = ["model=qwen3_30b_a3b", "train.precision=bf16", "train.micro_batch_size=4", "train.global_batch_size=16"]
    out = _run(capsys, args)
    assert ", 0 fit;" in out and "a smaller micro batch: " in out, out
    assert any(r["fits"] for r in _plan(args[:2] + ["train.global_batch_size=16"])[0])
