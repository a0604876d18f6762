"""The training loop, top to bottom: distributed init -> data -> model/optimizer -> resume -> steps.

    run(cfg, layout, run_dir)      # train.py, after validate(cfg) gave `layout`

`setup` builds what a run works on (model, optimizer, data, the resumed position); `run` then steps it: each
step is training/engine/step.py's train_step; every train.log_interval steps one record (loss, the named
extra losses, lr, grad norm, throughput, memory: metrics.TrainRecord) goes to the console, metrics.jsonl and
TensorBoard; evaluation, saving and stopping follow their own clocks.
"""

from __future__ import annotations

import dataclasses
import os
from dataclasses import dataclass
from pathlib import Path

from models.shape import ModelShape
from models.spec import extra_stats
from training import checkpoint
from training.config import optim_defaults
from training.config.optim_defaults import min_lr, peak_lr
from training.config.schema import PACKED, Config, to_config
from training.config.validate import notes
from training.data.build import build_datasets
from training.data.datasets import resolve_vocab_size
from training.data.streams import micro_batch_streams, reads_data
from training.data.tokenizer import build_tokenizer
from training.engine.bridge import lr_at
from training.engine.build import TrainState, build
from training.engine.metrics import RESERVED_KEYS, MetricsLogger, Throughput
from training.engine.profiling import Profiler
from training.engine.step import evaluate, train_step
from training.engine.stopping import SaveClock, Stopper
from training.engine.wandb_log import WandbSink
from training.engine.watchdog import Watchdog
from training.errors import ConfigError
from training.estimate.preflight import preflight
from training.parallel import dist as D
from training.parallel import fsdp
from training.parallel.layout import Layout


@dataclass
class Run:
    """What the loop works on."""

    state: TrainState
    start: checkpoint.Start
    train_data: list  # this rank's micro-batch stream per model chunk
    valid_data: object  # () -> the same validation streams at every evaluation
    train_samples: int  # the train dataset's size (saved with checkpoints)
    objective: object = None  # .train_step and .evaluate: the token loss (TokenLoss), or post-training's


class TokenLoss:
    """The next-token loss of pretraining and SFT: training/engine/step.py as it is."""

    def train_step(self, *args, **kwargs):
        return train_step(*args, **kwargs)  # looked up at each call: tests (and users' hooks) may wrap loop.train_step

    def evaluate(self, *args, **kwargs):
        return evaluate(*args, **kwargs)

    def attach(self, state, layout, train_ds, valid_ds, consumed: int = 0) -> None:
        """What the objective needs of the data before training (post-training's stored reference, RL's prompt
        position): nothing."""


def objective_of(cfg: Config, state: TrainState):
    """TokenLoss, or post.objective's step (training/post/step.py: imported only for a post-training run)."""
    if str(cfg.post.objective) == "none":
        return TokenLoss()
    if str(cfg.post.objective) == "grpo":  # its own rollouts: no dataset (training/post/rl/objective.py)
        from training.post.rl.objective import RLObjective

        return RLObjective(cfg, state)
    from training.post.step import PreferenceObjective

    return PreferenceObjective(cfg, state)


def train_dataset_size(cfg: Config, start: checkpoint.Start) -> int:
    """Samples to build: the run's need, but a resumed run keeps the size its checkpoint was built with
    (Megatron's multi-epoch shuffle depends on it) as long as that covers the run, so its batches continue
    exactly. Raising train.iters past it reshuffles the rest of the run: said, not silent."""
    needed = cfg.train.iters * cfg.train.global_batch_size
    saved = start.train_samples
    if saved is not None and saved < needed:
        D.print0(f"note: train.iters grew: the dataset is rebuilt for {needed} samples (was {saved}); the "
                 f"order of samples after iteration {start.iteration} differs from the original run's plan")
    return needed if saved is None or saved < needed else saved


def schedule_note(cfg: Config, start: checkpoint.Start) -> str | None:
    """A resumed run whose train.iters or optim.* differ from its checkpoint's: the schedule is this config's
    (bridge.scheduler_kwargs overrides the saved one), so say so, with the lr at the resumed iteration both ways."""
    saved = start.saved_config
    if not saved or "optim" not in saved:
        return None
    old = to_config({k: saved[k] for k in ("train", "optim", "peft", "checkpoint") if k in saved})
    pairs = {"train.iters": (old.train.iters, cfg.train.iters), "optim.lr": (peak_lr(old), peak_lr(cfg)),
             "optim.min_lr": (min_lr(old), min_lr(cfg))}
    pairs |= {f"optim.{f.name}": (getattr(old.optim, f.name), getattr(cfg.optim, f.name))
              for f in dataclasses.fields(cfg.optim) if f.name not in ("lr", "min_lr")}
    changed = [f"{key} {a} -> {b}" for key, (a, b) in pairs.items() if a != b]
    if not changed:
        return None
    return (f"note: {', '.join(changed)} since the checkpoint: the lr schedule is rebuilt from this config; lr at "
            f"iteration {start.iteration}: {lr_at(old, start.iteration):.3g} before, {lr_at(cfg, start.iteration):.3g} "
            f"now")


def setup(cfg: Config, layout: Layout, device, run_dir: Path) -> Run:
    """Tokenizer -> shape -> memory preflight -> model and optimizer -> resume -> this rank's data."""
    t = cfg.train
    tokenizer = build_tokenizer(cfg.data.tokenizer)
    shape = ModelShape.of(cfg.model, resolve_vocab_size(cfg, tokenizer))
    if clash := set(extra_stats(shape)) & RESERVED_KEYS:
        raise ConfigError(f"extra losses {sorted(clash)} (the blocks' `extra_losses`) are metrics keys: rename them")
    for note in notes(cfg):
        D.print0(note)
    preflight(cfg, layout, shape, device, run_dir)  # memory estimate; stops if it cannot fit
    state = build(cfg, shape, device, prepare=checkpoint.fsdp_weights_loader(cfg))
    start = checkpoint.maybe_load(cfg, state)
    if start.resumed and (note := schedule_note(cfg, start)):
        D.print0(note)
    train_samples = train_dataset_size(cfg, start)
    evals = t.iters // t.eval_interval + 1 if t.eval_interval else 0
    chunks, packed = len(state.model), str(cfg.data.format) in PACKED  # packed: every stage reads its batches
    rollouts = str(cfg.post.objective) == "grpo"  # RL draws its own batches
    train_ds, valid_ds = build_datasets(cfg, tokenizer, (train_samples, evals * t.eval_iters * t.global_batch_size),
                                        reads_data(chunks, packed)) if start.iteration < t.iters and not rollouts \
        else (None, None)
    D.print0(f"config: {layout.describe()}; {t.global_batch_size * shape.seq_length} tokens/step; vocab "
             f"{shape.vocab_size} (padded {shape.padded_vocab(layout.tp)}); {device.type}; start at iteration "
             f"{start.iteration} ({start.consumed_samples} samples consumed); {optim_defaults.describe(cfg)}")
    objective = objective_of(cfg, state)
    objective.attach(state, layout, train_ds, valid_ds, start.consumed_samples)
    return Run(state, start, micro_batch_streams(chunks, train_ds, start.consumed_samples, t.micro_batch_size, packed),
               lambda: micro_batch_streams(chunks, valid_ds, 0, t.micro_batch_size, packed), train_samples, objective)


def run(cfg: Config, layout: Layout, run_dir: str | Path) -> dict:
    t = cfg.train
    fsdp.set_env(cfg)  # before CUDA starts
    with D.distributed(**D.layout_of(cfg)) as info:
        stopper = Stopper(cfg)  # signal handlers first: a SIGTERM during setup still stops cleanly
        r = setup(cfg, layout, info.device, Path(run_dir))
        state, iteration, consumed = r.state, r.start.iteration, r.start.consumed_samples
        saved_at = iteration if r.start.resumed else None  # the iteration already on disk
        if iteration >= t.iters:
            D.print0(f"nothing to train: the checkpoint is at iteration {iteration} >= train.iters={t.iters} "
                     f"(raise train.iters to continue)" if r.start.resumed else
                     f"nothing to train: train.iters={t.iters}")
        restarts = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"))  # torchrun's, after a rank died
        if restarts:
            D.print0(f"restart {restarts} (launch MAX_RESTARTS): resumed at iteration {iteration}")
        logger = MetricsLogger(run_dir, t.iters, D.is_rank0(), t.tensorboard, WandbSink(cfg, run_dir, r.start.resumed))
        profiler = Profiler(cfg, run_dir, D.is_rank0())
        save_clock = SaveClock(cfg)  # train.save_interval / save_interval_minutes (the end and a stop save too)
        with checkpoint.Saver(cfg, run_dir, r.train_samples) as saver:  # checkpoint.async_save: in the background
            watchdog = Watchdog.of(cfg, run_dir)  # a rank stalled in a step, an evaluation or a save: exit 3
            throughput = Throughput(cfg, state.shape, layout, info.device)
            skipped, last = 0, {}
            while iteration < t.iters:
                profiler.step(iteration)
                with watchdog.phase("step", iteration + 1):
                    result = r.objective.train_step(state, r.train_data, layout, cfg, info.device)
                iteration, consumed, skipped = iteration + 1, consumed + t.global_batch_size, skipped + result.skipped
                throughput.stepped(result.loss_tokens)
                if iteration % t.log_interval == 0 or iteration == t.iters:
                    record = throughput.record(iteration, result, state, consumed, skipped, restarts)
                    logger.log(record)
                    last = record.as_dict()
                if t.eval_interval and iteration % t.eval_interval == 0:
                    with watchdog.phase("evaluation", iteration):
                        logger.log(dict(iteration=iteration, **r.objective.evaluate(state, r.valid_data, layout, cfg,
                                                                                    info.device)))
                    throughput.pause()
                if save_clock.due(iteration):
                    with watchdog.phase("save", iteration):
                        if saver.save(state, iteration, consumed):
                            saved_at = iteration
                            save_clock.saved()
                    throughput.pause()
                saver.poll()  # a background write that finished becomes `latest`
                if stopper.should_stop(iteration):
                    D.print0(f"stopping at iteration {iteration}: {stopper.reason}")
                    break
            with watchdog.phase("save", iteration):
                if cfg.checkpoint.dir is not None and saved_at != iteration:  # the end, or an early stop
                    saver.save(state, iteration, consumed)
                saver.close()  # the write in flight completes before the run ends
        watchdog.close()
        profiler.close()
        logger.close()
        return last
