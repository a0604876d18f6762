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


def train_watching_steps(overrides: list[str], run_dir: str) -> tuple[str, list[dict]]:
    """train_catching on one rank, and per train_step: skipped, whether the model's weights and the optimizer's
    tensors (main params, Adam's moments and step count) are bit-identical after it, the lr schedule's steps."""
    import torch

    from training.engine import loop

    steps, train_step = [], loop.train_step

    def snapshot(state) -> tuple[list, list, int]:
        optimizers = getattr(state.optimizer, "chained_optimizers", [state.optimizer])
        inner = [o.optimizer for o in optimizers]  # torch's Adam over the main params (this rank's shard)
        return ([p.detach().clone() for chunk in state.model for p in chunk.parameters()],
                [t.detach().clone() for adam in inner for group in adam.param_groups for p in group["params"]
                 for t in (p, *adam.state.get(p, {}).values()) if torch.is_tensor(t)],
                state.scheduler.num_steps)

    def watched(state, *args, **kwargs):
        before = snapshot(state)
        result = train_step(state, *args, **kwargs)
        after = snapshot(state)
        same = [len(a) == len(b) and all(torch.equal(x, y) for x, y in zip(a, b))
                for a, b in zip(before[:2], after[:2])]
        steps.append(dict(skipped=result.skipped, weights_same=same[0], optimizer_same=same[1],
                          schedule=(before[2], after[2])))
        return result

    loop.train_step = watched  # the loop looks its train_step up at each call
    return train_catching(overrides, run_dir), steps


def assert_only_skipped_steps_leave_everything(steps: list[dict]) -> None:
    """A skipped step moves nothing (no Adam momentum or weight decay on zeroed gradients, no schedule step);
    every other step moves the optimizer state and the schedule by one, and the weights (unless its lr is 0:
    the first warmup step)."""
    for i, step in enumerate(steps, 1):
        if step["skipped"]:
            assert step["weights_same"] and step["optimizer_same"], f"skipped step {i} changed the weights: {step}"
            assert step["schedule"][1] == step["schedule"][0], f"skipped step {i} advanced the lr schedule: {step}"
        else:
            assert not step["optimizer_same"], f"step {i} did not update: {step}"
            assert step["schedule"][1] == step["schedule"][0] + 1, f"step {i}: {step}"
    assert any(not step["weights_same"] for step in steps), "no step moved the weights: nothing was compared"
