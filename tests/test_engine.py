"""Engine behaviour beyond layouts: the NaN/Inf guard (stop or skip), the profiler window, and (tests/test_wandb.py)
the named extra losses in every sink."""

import json

from harness import run_distributed
from runs import QUICK, _train, assert_only_skipped_steps_leave_everything, train_catching, train_watching_steps

# A learning rate this large without clipping blows the weights up within a few steps.
EXPLODE = ["optim.lr=1e6", "optim.min_lr=0", "optim.warmup_iters=0", "optim.clip_grad=0", "train.iters=8",
           "checkpoint=none"]


def test_nan_loss_stops_with_a_clear_message(tmp_path):
    (result,) = run_distributed(train_catching, 1, (QUICK + EXPLODE, str(tmp_path)), timeout=300)
    # the exploding weights give an Inf gradient first (caught before the update), or a NaN / Inf loss
    assert result.startswith(("error: loss is nan", "error: loss is inf",
                              "error: the gradients are not finite (NaN/Inf) on rank 0")), result
    assert "train.nan_policy=stop" in result and "\n" not in result


def test_nan_loss_is_skipped_by_policy(tmp_path):
    ((result, steps),) = run_distributed(train_watching_steps, 1,
                                         (QUICK + EXPLODE + ["train.nan_policy=skip"], str(tmp_path)), timeout=300)
    assert result == "finished"
    records = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert records[-1]["iteration"] == 8 and records[-1]["skipped"] >= 1
    skipped_steps = [r for r in records if r["grad_norm"] is None]
    assert skipped_steps, "a skipped step logs no gradient norm (no update happened)"
    assert [s["skipped"] for s in steps] == [r["grad_norm"] is None for r in records]
    assert_only_skipped_steps_leave_everything(steps)


def test_profiler_writes_a_trace_of_the_window(tmp_path):
    run_distributed(_train, 1, (QUICK + ["train.iters=5", "train.profile=true", "train.profile_start=2",
                                         "train.profile_end=4", "checkpoint=none"], str(tmp_path)), timeout=300)
    (trace,) = (tmp_path / "profile").glob("trace_iters_2_4.json")
    events = json.loads(trace.read_text())["traceEvents"]
    assert any("aten::" in str(e.get("name", "")) for e in events)
