"""Weights & Biases (train.wandb, training/engine/wandb_log.py): an offline run's own files hold what metrics.jsonl
holds, with the resolved config; a resumed run continues the same W&B run; only the writing rank opens it; asked
for without the package, one `error:` line before any process starts. No network: WANDB_MODE=offline, every W&B
directory in tmp. W&B's files are read back with W&B's own reader (`wandb leet inspect --json`).

The one training process (three short runs in turn: ~1 s each after the first) also checks a block's named
extra loss in the console line and TensorBoard, what tests/test_engine.py's
test_named_extra_losses_are_logged_like_the_loss checks with a process of its own."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
from harness import run_distributed
from runs import QUICK, _train

from training.engine.metrics import MetricsLogger

# with a block's named extra loss (tests/blocks.py): it reaches W&B like the loss
WANDB = ["train.wandb.mode=offline", "train.wandb.project=test", "train.eval_interval=2",
         "model.mlp=blocks:PenalizedMLP"]


def _train_in_turn(runs: list[list[str]], run_dir: str) -> None:
    """Train runs one after the other in one run dir (one process; each as a requeued or restarted job would)."""
    for overrides in runs:
        _train(overrides, run_dir)


def wandb_records(wandb_file: Path) -> list[dict]:
    """W&B's own reader of a run's .wandb transaction log: one JSON object per record."""
    out = subprocess.run([sys.executable, "-m", "wandb", "leet", "inspect", "--json", str(wandb_file)],
                         capture_output=True, text=True, timeout=120, check=True).stdout
    return [json.loads(line) for line in out.splitlines() if line.strip()]


def run_record(records: list[dict]) -> dict:
    (run,) = [r["run"] for r in records if r["type"] == "run"]
    return run


def history(records: list[dict]) -> dict[int, dict]:
    """{step: the numbers logged at it}, W&B's own `_runtime`, `_step`, ... left out."""
    rows: dict[int, dict] = {}
    for r in records:
        if r["type"] == "history":
            row = rows.setdefault(int(r["history"]["step"]["num"]), {})
            row.update({k: v for k, v in r["history"]["item"].items() if not k.startswith("_")})
    return rows


def expected_rows(metrics: list[dict]) -> dict[int, dict]:
    """metrics.jsonl as W&B should hold it: per iteration, every number but the iteration (nulls are not logged)."""
    rows: dict[int, dict] = {}
    for m in metrics:
        numbers = {k: v for k, v in m.items() if isinstance(v, (int, float)) and not isinstance(v, bool)}
        rows.setdefault(numbers.pop("iteration"), {}).update(numbers)
    return rows


def test_an_offline_run_holds_what_metrics_jsonl_holds_and_a_resume_continues_it(tmp_path, monkeypatch):
    from blocks import PENALTY
    from omegaconf import OmegaConf
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    from training.config.compose import compose
    from training.engine.metrics import format_line

    for name in ("WANDB_DIR", "WANDB_CACHE_DIR", "WANDB_CONFIG_DIR", "WANDB_DATA_DIR", "WANDB_ARTIFACT_DIR"):
        monkeypatch.setenv(name, str(tmp_path / name.lower()))
    monkeypatch.setenv("WANDB_MODE", "offline")  # besides train.wandb.mode=offline (which wins over it)
    run_dir = tmp_path / "run"
    # 2 iterations (an evaluation at the second), resumed to 3, then a fresh start in the same run dir
    first = QUICK + WANDB + ["train.iters=2", "train.tensorboard=true"]
    resumed, fresh = QUICK + WANDB + ["train.iters=3"], QUICK + WANDB + ["train.iters=1", "checkpoint=none"]
    run_distributed(_train_in_turn, 1, ([first, resumed, fresh], str(run_dir)), timeout=300)

    metrics = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert [(m["iteration"], "val_loss" in m) for m in metrics] == [(1, False), (2, False), (2, True), (3, False),
                                                                    (1, False)]
    files = list((tmp_path / "wandb_dir" / "wandb").glob("offline-run-*/run-*.wandb"))
    assert len(files) == 3, files  # one per training run
    logged = sorted((wandb_records(f) for f in files), key=lambda recs: run_record(recs)["start_time"])
    run1, run2, run3 = map(run_record, logged)
    # W&B holds exactly what metrics.jsonl holds
    assert [history(records) for records in logged] == [expected_rows(metrics[:3]), expected_rows(metrics[3:4]),
                                                        expected_rows(metrics[4:])]
    assert set(history(logged[0])[2]) >= {"loss", PENALTY, "lr", "grad_norm", "tokens_per_s", "mem_gb", "val_loss"}
    # the named extra loss in the other sinks: the console line and TensorBoard (the first run's)
    assert all(m[PENALTY] > 0 for m in metrics if "loss" in m)
    assert f"| {PENALTY} {metrics[1][PENALTY]:.4g} |" in format_line(metrics[1], 2)
    events = EventAccumulator(str(run_dir / "tensorboard"))
    events.Reload()
    assert [e.value for e in events.Scalars(PENALTY)] == pytest.approx([m[PENALTY] for m in metrics[:2]], rel=1e-6)
    # the resumed run continued the W&B run its run dir names; the fresh start began a new one
    assert run1["run_id"] == run2["run_id"] != run3["run_id"] == (run_dir / "wandb_run_id").read_text().strip()
    # the run's config is the resolved config
    for run, overrides in ((run1, first), (run2, resumed), (run3, fresh)):
        cfg = compose(overrides)
        if cfg.checkpoint.dir is not None:
            cfg.checkpoint.dir = str(run_dir / cfg.checkpoint.dir)  # as the run made it
        config = {k: v for k, v in run["config"]["update"].items() if k != "_wandb"}
        assert config == OmegaConf.to_container(OmegaConf.structured(cfg), enum_to_str=True)
        assert run["project"] == "test"


class FakeSink:
    def __init__(self):
        self.calls = []

    def open(self):
        self.calls.append("open")

    def log(self, scalars, iteration):
        self.calls.append((iteration, scalars))

    def close(self):
        self.calls.append("close")


@pytest.mark.fast
def test_only_the_rank_that_writes_metrics_opens_wandb(tmp_path):
    for enabled in (False, True):
        sink = FakeSink()
        logger = MetricsLogger(tmp_path, 5, enabled, tensorboard=False, wandb=sink)
        logger.log({"iteration": 3, "val_loss": 1.5, "mfu": None})
        logger.close()
        assert sink.calls == (["open", (3, {"val_loss": 1.5}), "close"] if enabled else [])


@pytest.mark.fast
def test_asking_for_wandb_without_the_package_is_one_error_line(capsys, monkeypatch):
    from tools.check_config import main
    from training.config.compose import compose
    from training.engine.wandb_log import WandbSink
    from training.errors import ConfigError

    monkeypatch.setitem(sys.modules, "wandb", None)  # as if not installed: find_spec -> None, import fails
    line = "train.wandb.mode=offline needs the wandb package, which is not installed: pip install -e '.[wandb]'"
    assert main(["train.wandb.mode=offline"]) == 2
    assert capsys.readouterr().err.splitlines() == [f"error: {line}"]
    assert main([]) == 0  # disabled (the default): nothing needs it
    with pytest.raises(ConfigError, match=r"^train\.wandb\.mode=online needs the wandb package"):
        WandbSink(compose(["train.wandb.mode=online"]), "unused", resumed=False).open()  # a broken install
