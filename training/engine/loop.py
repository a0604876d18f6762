"""The training loop, top to bottom: distributed init -> data -> model/optimizer -> resume -> steps.

    run(cfg, derived, run_dir)      # train.py, after validate(cfg) gave `derived`

Each step is training/engine/step.py's train_step; every train.log_interval steps one record (loss, the named
extra losses, lr, grad norm, throughput, memory) goes to the console, metrics.jsonl and TensorBoard.
"""

from __future__ import annotations

import os
import time
from pathlib import Path

from models.gpt import flops_per_token
from models.shape import ModelShape
from models.spec import extra_stats
from training.checkpoint import fsdp_dtensor as fsdp_checkpoint
from training.checkpoint import torch_dist as checkpoint
from training.config.schema import Config
from training.config.validate import Derived
from training.data.datasets import build_datasets, micro_batch_streams, reads_data, resolve_vocab_size
from training.data.tokenizer import build_tokenizer
from training.engine.bridge import uses_fsdp
from training.engine.build import build
from training.engine.metrics import RESERVED_KEYS, MetricsLogger, memory_gb, peak_tflops
from training.engine.profiling import Profiler
from training.engine.step import evaluate, train_step
from training.engine.stopping import SaveClock, Stopper
from training.engine.watchdog import Watchdog
from training.errors import ConfigError
from training.estimate.preflight import preflight
from training.parallel import dist as D


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


def run(cfg: Config, derived: Derived, run_dir: str | Path) -> dict:
    p = cfg.parallel
    if uses_fsdp(cfg) and os.environ.get("CUDA_DEVICE_MAX_CONNECTIONS") == "1":  # before CUDA starts
        os.environ["CUDA_DEVICE_MAX_CONNECTIONS"] = "8"  # Megatron-FSDP overlaps its gathers on other queues
    with D.distributed(**D.layout_of(cfg)) as info:
        stopper = Stopper(cfg)  # signal handlers first: a SIGTERM during setup still stops cleanly
        tokenizer = build_tokenizer(cfg.data.tokenizer)
        shape = ModelShape.of(cfg.model, resolve_vocab_size(cfg, tokenizer))
        if clash := set(extra_stats(shape)) & RESERVED_KEYS:
            raise ConfigError(f"extra losses {sorted(clash)} (the blocks' `extra_losses`) are metrics keys: "
                              f"rename them")
        preflight(cfg, derived, shape, info.device, run_dir)  # memory estimate; stops if it cannot fit
        state = build(cfg, shape, info.device, prepare=fsdp_checkpoint.fsdp_weights_loader(cfg))
        start = checkpoint.maybe_load(cfg, state)
        iteration, consumed = start.iteration, start.consumed_samples
        saved_at = iteration if start.resumed else None  # the iteration already on disk
        g = cfg.train.global_batch_size
        train_samples = train_dataset_size(cfg, start)
        evals = cfg.train.iters // cfg.train.eval_interval + 1 if cfg.train.eval_interval else 0
        chunks, micro = len(state.model), cfg.train.micro_batch_size
        train_ds, valid_ds = build_datasets(cfg, tokenizer, (train_samples, evals * cfg.train.eval_iters * g),
                                            reads_data(chunks)) if iteration < cfg.train.iters else (None, None)
        train_data = micro_batch_streams(chunks, train_ds, consumed, micro)

        def valid_data():  # the same validation batches at every evaluation
            return micro_batch_streams(chunks, valid_ds, 0, micro)

        padded = shape.padded_vocab(p.tp)
        flops_per_step = flops_per_token(shape, p.tp) * derived.tokens_per_step
        peak = peak_tflops(info.device, cfg.train.precision)
        D.print0(f"config: {derived.describe(cfg)}; vocab {shape.vocab_size} (padded {padded}); "
                 f"{info.device.type}; start at iteration {iteration} ({consumed} samples consumed)")
        if iteration >= cfg.train.iters:
            D.print0(f"nothing to train: the checkpoint is at iteration {iteration} >= train.iters="
                     f"{cfg.train.iters} (raise train.iters to continue)")
        restarts = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"))  # torchrun's, after a rank died
        if restarts:
            D.print0(f"restart {restarts} (launch MAX_RESTARTS): resumed at iteration {iteration}")
        logger = MetricsLogger(run_dir, cfg.train.iters, D.is_rank0(), cfg.train.tensorboard)
        profiler = Profiler(cfg, run_dir, D.is_rank0())
        save_clock = SaveClock(cfg)  # train.save_interval / save_interval_minutes (the end and a stop save too)
        watchdog = Watchdog.of(cfg)  # a rank stalled in a step, an evaluation or a save: named, then exit 3
        window_start, window_steps, skipped, last = time.perf_counter(), 0, 0, {}
        while iteration < cfg.train.iters:
            profiler.step(iteration)
            with watchdog.phase("step", iteration + 1):
                result = train_step(state, train_data, derived, cfg, info.device)
            iteration += 1
            consumed += g
            skipped += result.skipped
            window_steps += 1
            if iteration % cfg.train.log_interval == 0 or iteration == cfg.train.iters:
                elapsed = time.perf_counter() - window_start
                tflops = flops_per_step * window_steps / elapsed / derived.world_size / 1e12
                last = dict(iteration=iteration, loss=result.loss, **result.extra,
                            lr=state.scheduler.get_lr(state.optimizer.param_groups[0]), grad_norm=result.grad_norm,
                            tokens_per_s=derived.tokens_per_step * window_steps / elapsed,
                            tflops_per_gpu=tflops, mfu=None if peak is None else tflops / peak,
                            mem_gb=memory_gb(info.device), step_ms=1000 * elapsed / window_steps,
                            consumed_samples=consumed, skipped=skipped, restarts=restarts)
                logger.log(last)
                window_start, window_steps = time.perf_counter(), 0
            if cfg.train.eval_interval and iteration % cfg.train.eval_interval == 0:
                with watchdog.phase("evaluation", iteration):
                    val_loss = evaluate(state, valid_data, derived, cfg, info.device)
                logger.log(dict(iteration=iteration, val_loss=val_loss))
                window_start = time.perf_counter()
            if save_clock.due(iteration):
                with watchdog.phase("save", iteration):
                    if checkpoint.save(cfg, state, iteration, consumed, run_dir, train_samples) is not None:
                        saved_at = iteration
                        save_clock.saved()
                window_start = time.perf_counter()
            if stopper.should_stop(iteration):
                D.print0(f"stopping at iteration {iteration}: {stopper.reason}")
                break
        if cfg.checkpoint.dir is not None and saved_at != iteration:  # the end, or an early stop
            with watchdog.phase("save", iteration):
                checkpoint.save(cfg, state, iteration, consumed, run_dir, train_samples)
        watchdog.close()
        profiler.close()
        logger.close()
        return last
