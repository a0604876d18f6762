"""The training loop, top to bottom: distributed init -> data -> model/optimizer -> resume -> steps.

One step: this DP rank's micro-batches go through Megatron-Core's pipeline schedule
(`get_forward_backward_func`: no pipelining, 1F1B, or interleaved 1F1B), which calls
`finalize_model_grads` (DP reduction, SP norm grads, tied-embedding grads, division by the global
batch's token count); the loss is reduced to the global-batch token mean, checked for NaN/Inf, then
`optimizer.step()` (clipping inside) and the scheduler step.
"""

from __future__ import annotations

import math
import time
from functools import partial
from pathlib import Path

import torch
import torch.distributed as dist
from megatron.core import parallel_state
from megatron.core.pipeline_parallel import get_forward_backward_func

from training import checkpoint, dist as D
from training.build import build, unwrap
from training.config import Config
from training.data import MicroBatches, build_datasets, resolve_vocab_size
from training.errors import TemplateError
from training.preflight import preflight
from training.metrics import MetricsLogger, memory_gb, model_flops_per_token, peak_tflops
from training.profiling import Profiler
from training.stopping import Stopper
from training.tokenizer import build_tokenizer
from training.validate import Derived, validate


class NonFiniteLoss(TemplateError):
    pass


def loss_func(loss_mask: torch.Tensor, per_token_loss: torch.Tensor):
    """Sum of the masked token losses and their count; Megatron-Core divides by the global count."""
    mask = loss_mask.reshape(-1).float()  # [b*s]
    loss_sum = torch.sum(per_token_loss.reshape(-1).float() * mask)
    num_tokens = mask.sum().to(torch.int)
    return loss_sum, num_tokens, {"lm loss": torch.stack([loss_sum.detach().clone(), mask.sum()])}


def forward_step(data_iterator, model):
    """Called by the schedule once per micro-batch and model chunk."""
    batch = next(data_iterator) if data_iterator is not None else None
    gpt, device = unwrap(model), D.current_device()
    tokens = batch["tokens"].to(device) if gpt.pre_process else None  # [b, s]
    labels = batch["labels"].to(device) if gpt.post_process else None  # [b, s]
    output = model(tokens, labels)  # [b, s] token losses on the last stage, activations elsewhere
    mask = batch["loss_mask"].to(device) if gpt.post_process else None
    return output, partial(loss_func, mask)


def global_loss(reports: list[dict], device: torch.device) -> torch.Tensor:
    """Token-mean loss over the whole global batch, identical on every rank: [loss_sum, tokens] summed
    over micro-batches, then over DP ranks, then sent from the last pipeline stage to the others."""
    total = torch.zeros(2, dtype=torch.float64, device=device)
    for report in reports:
        total += report["lm loss"].to(device=device, dtype=torch.float64)
    dist.all_reduce(total, group=parallel_state.get_data_parallel_group())
    if parallel_state.get_pipeline_model_parallel_world_size() > 1:
        if not parallel_state.is_pipeline_last_stage(ignore_virtual=True):
            total.zero_()
        dist.all_reduce(total, group=parallel_state.get_pipeline_model_parallel_group())
    return total[0] / total[1].clamp(min=1)


def run_schedule(t, iterators, derived: Derived, cfg: Config, forward_only: bool,
                 step=forward_step) -> list[dict]:
    return get_forward_backward_func()(
        forward_step_func=step, data_iterator=iterators, model=t.model,
        num_microbatches=derived.num_microbatches, seq_length=cfg.model.seq_length,
        micro_batch_size=cfg.train.micro_batch_size, forward_only=forward_only)


def train_step(t, iterators, derived: Derived, cfg: Config, device,
               step=forward_step) -> tuple[float, float | None, bool]:
    for chunk in t.model:
        chunk.zero_grad_buffer()
    t.optimizer.zero_grad()
    loss = global_loss(run_schedule(t, iterators, derived, cfg, forward_only=False, step=step), device).item()
    if not math.isfinite(loss):
        if cfg.train.nan_policy == "stop":
            raise NonFiniteLoss(f"loss is {loss} at this step: stopping (train.nan_policy=stop); the last "
                                f"checkpoint is intact. Lower optim.lr or set train.nan_policy=skip")
        return loss, None, True  # skip: no update, gradients are zeroed next step
    _, grad_norm, _ = t.optimizer.step()
    t.scheduler.step(increment=1)
    return loss, grad_norm, False


def evaluate(t, valid_data, derived: Derived, cfg: Config, device) -> float:
    for chunk in t.model:
        chunk.eval()
    total = torch.zeros((), dtype=torch.float64, device=device)
    with torch.no_grad():
        for _ in range(cfg.train.eval_iters):
            total += global_loss(run_schedule(t, valid_data(), derived, cfg, forward_only=True), device)
    for chunk in t.model:
        chunk.train()
    return (total / cfg.train.eval_iters).item()


def chunk_iterators(t, dataset, consumed: int, cfg: Config, derived: Derived):
    """One micro-batch stream per model chunk that reads data (first/last stage), None elsewhere."""
    dp_rank = parallel_state.get_data_parallel_rank()
    streams = [MicroBatches(dataset, consumed, cfg.train.micro_batch_size, derived.dp, dp_rank)
               if (unwrap(m).pre_process or unwrap(m).post_process) else None for m in t.model]
    return streams if len(streams) > 1 else streams[0]


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


def run(cfg: Config, run_dir: str | Path) -> dict:
    derived = validate(cfg)
    p = cfg.parallel
    with D.distributed(tp=p.tp, pp=p.pp, vpp=p.vpp, seed=cfg.train.seed,
                       timeout_minutes=p.timeout_minutes) as info:
        stopper = Stopper(cfg)  # signal handlers first: a SIGTERM during setup still stops cleanly
        tokenizer = build_tokenizer(cfg.data.tokenizer)
        vocab_size = resolve_vocab_size(cfg, tokenizer)
        preflight(cfg, derived, info.device, run_dir, vocab_size)  # memory estimate; stops if it cannot fit
        t = build(cfg, vocab_size, info.device)
        start = checkpoint.maybe_load(cfg, t)
        iteration, consumed = start.iteration, start.consumed_samples
        saved_at = iteration if start.resumed else None  # the iteration already on disk
        g = cfg.train.global_batch_size
        train_samples = train_dataset_size(cfg, start)
        evals = cfg.train.iters // cfg.train.eval_interval + 1 if cfg.train.eval_interval else 0
        needs_data = any(unwrap(m).pre_process or unwrap(m).post_process for m in t.model)
        train_ds, valid_ds = build_datasets(cfg, tokenizer, (train_samples, evals * cfg.train.eval_iters * g),
                                            needs_data) if iteration < cfg.train.iters else (None, None)
        train_data = chunk_iterators(t, train_ds, consumed, cfg, derived)

        def valid_data():  # the same validation batches at every evaluation
            return chunk_iterators(t, valid_ds, 0, cfg, derived)

        gpt = unwrap(t.model[0])
        flops_per_step = model_flops_per_token(cfg, gpt.padded_vocab_size, t.config.ffn_hidden_size) \
            * derived.tokens_per_step
        peak = peak_tflops(info.device, cfg.train.precision)
        D.print0(f"config: {derived.describe(cfg)}; vocab {vocab_size} (padded {gpt.padded_vocab_size}); "
                 f"{info.device.type}; start at iteration {iteration} ({consumed} samples consumed)")
        if iteration >= cfg.train.iters:
            D.print0(f"nothing to train: the checkpoint is at iteration {iteration} >= train.iters="
                     f"{cfg.train.iters} (raise train.iters to continue)")
        logger = MetricsLogger(run_dir, cfg.train.iters, D.is_rank0(), cfg.train.tensorboard)
        profiler = Profiler(cfg, run_dir, D.is_rank0())
        window_start, window_steps, skipped, last = time.perf_counter(), 0, 0, {}
        while iteration < cfg.train.iters:
            profiler.step(iteration)
            loss, grad_norm, was_skipped = train_step(t, train_data, derived, cfg, info.device)
            iteration += 1
            consumed += g
            skipped += was_skipped
            window_steps += 1
            if iteration % cfg.train.log_interval == 0 or iteration == cfg.train.iters:
                elapsed = time.perf_counter() - window_start
                tflops = flops_per_step * window_steps / elapsed / derived.world_size / 1e12
                last = dict(iteration=iteration, loss=loss, lr=t.scheduler.get_lr(t.optimizer.param_groups[0]),
                            grad_norm=None if grad_norm is None else float(grad_norm),
                            tokens_per_s=derived.tokens_per_step * window_steps / elapsed,
                            tflops_per_gpu=tflops, mfu=None if peak is None else tflops / peak,
                            mem_gb=memory_gb(info.device), step_ms=1000 * elapsed / window_steps,
                            consumed_samples=consumed, skipped=skipped)
                logger.log(last)
                window_start, window_steps = time.perf_counter(), 0
            if cfg.train.eval_interval and iteration % cfg.train.eval_interval == 0:
                logger.log(dict(iteration=iteration, val_loss=evaluate(t, valid_data, derived, cfg, info.device)))
                window_start = time.perf_counter()
            if checkpoint.due(cfg, iteration):
                checkpoint.save(cfg, t, iteration, consumed, run_dir, train_samples)
                saved_at = iteration
                window_start = time.perf_counter()
            if stopper.should_stop(iteration):
                D.print0(f"stopping at iteration {iteration}: {stopper.reason}")
                break
        if cfg.checkpoint.dir is not None and saved_at != iteration:  # the end, or an early stop
            checkpoint.save(cfg, t, iteration, consumed, run_dir, train_samples)
        profiler.close()
        logger.close()
        return last
