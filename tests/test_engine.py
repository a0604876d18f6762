"""Engine behaviour beyond layouts: the NaN/Inf guard (stop or skip), the profiler window, metrics."""

import json

import pytest

from harness import run_distributed
from runs import QUICK, _train


def _train_catching(overrides: list[str], run_dir: str) -> str:
    from training.errors import TemplateError

    try:
        _train(overrides, run_dir)
        return "finished"
    except TemplateError as err:
        return f"error: {err}"


# A learning rate this large without clipping blows the weights up within a few steps.
EXPLODE = ["optim.lr=1e6", "optim.min_lr=0", "optim.warmup_iters=0", "optim.clip_grad=0", "train.iters=8",
           "checkpoint=none"]


def test_nan_loss_stops_with_a_clear_message(tmp_path):
    (result,) = run_distributed(_train_catching, 1, (QUICK + EXPLODE, str(tmp_path)), timeout=300)
    assert result.startswith("error: loss is nan") or result.startswith("error: loss is inf"), result
    assert "train.nan_policy=stop" in result and "\n" not in result


def test_nan_loss_is_skipped_by_policy(tmp_path):
    (result,) = run_distributed(_train_catching, 1, (QUICK + EXPLODE + ["train.nan_policy=skip"], str(tmp_path)),
                                timeout=300)
    assert result == "finished"
    records = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert records[-1]["iteration"] == 8 and records[-1]["skipped"] >= 1
    skipped_steps = [r for r in records if r["grad_norm"] is None]
    assert skipped_steps, "a skipped step logs no gradient norm (no update happened)"


def test_profiler_writes_a_trace_of_the_window(tmp_path):
    run_distributed(_train, 1, (QUICK + ["train.iters=5", "train.profile=true", "train.profile_start=2",
                                         "train.profile_end=4", "checkpoint=none"], str(tmp_path)), timeout=300)
    (trace,) = (tmp_path / "profile").glob("trace_iters_2_4.json")
    events = json.loads(trace.read_text())["traceEvents"]
    assert any("aten::" in str(e.get("name", "")) for e in events)


def test_flops_formula_matches_megatron_closed_form():
    """Our per-token count equals Megatron-LM's num_floating_point_operations closed form."""
    from training.compose import compose
    from training.metrics import model_flops_per_token

    for preset in ("llama3_8b", "gpt2_124m"):
        cfg = compose([f"model={preset}"])
        m = cfg.model
        h, s, L, V = m.hidden_size, m.seq_length, m.num_layers, 128256 if preset == "llama3_8b" else 50304
        ffn, heads = m.ffn_hidden_size, m.num_attention_heads
        groups = m.num_query_groups or heads
        gated = 1.5 if m.activation == "swiglu" else 1.0
        # Megatron-LM: 12 * s * L * h^2 * ((1 + g/n + s/(2h)) * (n*hn/h) + ffn/h * gated + V/(2Lh)) per sample
        megatron = 12 * s * L * h * h * ((1 + groups / heads + s / h / 2) * (heads * (h // heads) / h)
                                         + ffn / h * gated + V / (2 * L * h))
        assert model_flops_per_token(cfg, V, ffn) * s == pytest.approx(megatron, rel=1e-12)
