"""Run the real training loop (training.engine.loop.run) on N gloo processes and read what it wrote.

Cheaper than torchrun + Hydra (no extra interpreter per run); the launch path itself is covered by
tests/test_end_to_end.py and tests/test_launch.py.
"""

from __future__ import annotations

import json
from pathlib import Path

from harness import run_distributed

# Small and quick: 2 layers, 16 x 64-token batches, every iteration logged, no evaluation.
QUICK = ["model.num_layers=2", "model.seq_length=64", "train.micro_batch_size=2", "train.global_batch_size=8",
         "train.log_interval=1", "train.eval_interval=0", "train.tensorboard=false", "optim.warmup_iters=2"]


def _train(overrides: list[str], run_dir: str) -> dict:
    from training.config.compose import compose
    from training.config.validate import validate
    from training.engine.loop import run

    cfg = compose(overrides)
    if cfg.checkpoint.dir is not None and not Path(cfg.checkpoint.dir).is_absolute():
        cfg.checkpoint.dir = str(Path(run_dir) / cfg.checkpoint.dir)  # as train.py does
    return run(cfg, validate(cfg), run_dir)


def train_catching(overrides: list[str], run_dir: str) -> str:
    """_train on one rank: "finished", or "error: <the one-line message>" of the template's own error."""
    from training.errors import TemplateError

    try:
        _train(overrides, run_dir)
        return "finished"
    except TemplateError as err:
        return f"error: {err}"


def train(overrides: list[str], world_size: int, run_dir: Path, timeout: float = 300.0) -> dict[int, float]:
    """Train; returns {iteration: loss} from the run's metrics.jsonl."""
    run_distributed(_train, world_size, (QUICK + list(overrides), str(run_dir)), timeout=timeout)
    return losses(run_dir)


def losses(run_dir: Path) -> dict[int, float]:
    records = [json.loads(line) for line in (Path(run_dir) / "metrics.jsonl").read_text().splitlines()]
    return {r["iteration"]: r["loss"] for r in records if "loss" in r}
