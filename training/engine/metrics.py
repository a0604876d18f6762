"""Throughput, memory, and the sinks of every logged iteration: console, metrics.jsonl, TensorBoard and
Weights & Biases (training/engine/wandb_log.py, when train.wandb asks). Only global rank 0 writes; every
value it writes is identical on all ranks (the loss is reduced before logging) or is rank 0's own (memory).
"""

from __future__ import annotations

import json
import math
import os
import time
from dataclasses import dataclass, field, fields
from pathlib import Path

import torch

# Dense peak TFLOP/s per GPU (no sparsity), from the vendors' data sheets: (bf16, tf32).
PEAK_TFLOPS = {
    "GB200": (2500.0, 1250.0), "B200": (2250.0, 1100.0), "H200": (989.0, 494.0),
    "GH200": (989.0, 494.0), "H100 PCIe": (756.0, 378.0), "H100": (989.0, 494.0), "H800": (989.0, 494.0),
    "A100": (312.0, 156.0), "A800": (312.0, 156.0), "L40S": (362.0, 183.0), "A10G": (70.0, 35.0),
}


def peak_tflops(device: torch.device, precision: str) -> float | None:
    """The device's dense peak for the run's precision, or None (CPU, unknown GPU)."""
    if device.type != "cuda":
        return None
    name = torch.cuda.get_device_name(device)
    for key, (bf16, tf32) in PEAK_TFLOPS.items():
        if key in name:
            return bf16 if precision == "bf16" else tf32
    return None


def memory_gb(device: torch.device) -> float:
    """Peak allocated GPU memory, or this process's resident memory on CPU."""
    if device.type == "cuda":
        return torch.cuda.max_memory_allocated(device) / 1e9
    import psutil

    return psutil.Process(os.getpid()).memory_info().rss / 1e9


@dataclass
class TrainRecord:
    """One logged training iteration: a field here is a metrics.jsonl key, a TensorBoard scalar and (in
    format_line) part of the console line. Adding a metric = a field here and its value in the loop."""

    iteration: int
    loss: float  # the token mean over the global batch, identical on every rank
    lr: float
    grad_norm: float | None
    tokens_per_s: float
    answer_tokens_per_s: float | None  # data.format=sft: the loss's tokens (answers) a second; None otherwise
    tflops_per_gpu: float
    mfu: float | None  # None where the peak is unknown (CPU)
    mem_gb: float
    step_ms: float
    consumed_samples: int
    skipped: int  # steps skipped so far (train.nan_policy=skip)
    restarts: int  # torchrun restarts of this job
    extra: dict = field(default_factory=dict)  # the blocks' named extra losses (models/extra_losses.py)

    def as_dict(self) -> dict:
        """The JSON line: the extra losses right after the loss, each under its own name."""
        plain = {f.name: getattr(self, f.name) for f in fields(self) if f.name != "extra"}
        if plain["answer_tokens_per_s"] is None:  # not a fine-tuning run: no such key
            del plain["answer_tokens_per_s"]
        head = {k: plain.pop(k) for k in ("iteration", "loss")}
        return {**head, **self.extra, **plain}


# The keys of a training record (and an eval record's val_loss); any other numeric key is a named extra
# loss, printed after the loss.
RESERVED_KEYS = frozenset(f.name for f in fields(TrainRecord) if f.name != "extra") | {"val_loss"}


def format_line(record: dict, total_iters: int) -> str:
    def num(key, fmt):
        value = record.get(key)
        return "-" if value is None else format(value, fmt)

    if "val_loss" in record:
        head = f" eval iter {record['iteration']:>6} | val loss {record['val_loss']:.4f}"
        extra = [f"{key} {value:.4g}" for key, value in record.items() if key.startswith("val_") and key != "val_loss"]
        if extra:  # a post-training objective's metrics (training/post/): a perplexity would mean nothing
            return " | ".join([head, *extra])
        return f"{head} | val ppl {math.exp(min(record['val_loss'], 30)):.2f}"
    parts = [
        f" iter {record['iteration']:>6}/{total_iters}", f"loss {num('loss', '.4f')}",
        *(f"{key} {num(key, '.4g')}" for key in record if key not in RESERVED_KEYS),
        f"lr {num('lr', '.3e')}", f"grad norm {num('grad_norm', '.3f')}",
        f"{num('tokens_per_s', ',.0f')} tok/s",
        *([f"{num('answer_tokens_per_s', ',.0f')} answer tok/s"] if "answer_tokens_per_s" in record else []),
        f"{num('tflops_per_gpu', '.2f')} TFLOP/s/dev",
        f"mfu {num('mfu', '.1%')}", f"mem {num('mem_gb', '.2f')} GB", f"{num('step_ms', '.1f')} ms/step",
    ]
    if record.get("skipped"):
        parts.append(f"skipped {record['skipped']}")
    return " | ".join(parts)


class Throughput:
    """The logging window's clock: tokens/s, TFLOP/s per device, MFU and step time over the steps since the
    last record; an evaluation or a save pauses it (their time is not a step's)."""

    def __init__(self, cfg, shape, layout, device: torch.device):
        from models.gpt import flops_per_token

        self.tokens_per_step = cfg.train.global_batch_size * cfg.model.seq_length
        self.flops_per_step = flops_per_token(shape, layout.tp) * self.tokens_per_step
        self.world, self.device = layout.world, device
        self.peak = peak_tflops(device, cfg.train.precision)
        self.answers = str(cfg.data.format) == "sft"  # also report the loss's (answer) tokens a second
        self.pause()

    def pause(self) -> None:
        self.start, self.steps, self.loss_tokens = time.perf_counter(), 0, 0

    def stepped(self, loss_tokens: int = 0) -> None:
        self.steps, self.loss_tokens = self.steps + 1, self.loss_tokens + loss_tokens

    def record(self, iteration: int, result, state, consumed: int, skipped: int, restarts: int) -> TrainRecord:
        """This window's record (step.StepResult's loss, grad norm, extras and the lr its update used; a skipped
        step: the scheduler's); restarts the window."""
        elapsed = time.perf_counter() - self.start
        tflops = self.flops_per_step * self.steps / elapsed / self.world / 1e12
        record = TrainRecord(
            iteration=iteration, loss=result.loss, lr=result.lr if result.lr is not None else state.scheduler.get_lr(state.optimizer.param_groups[0]),
            grad_norm=result.grad_norm, tokens_per_s=self.tokens_per_step * self.steps / elapsed,
            answer_tokens_per_s=self.loss_tokens / elapsed if self.answers else None,
            tflops_per_gpu=tflops, mfu=None if self.peak is None else tflops / self.peak,
            mem_gb=memory_gb(self.device), step_ms=1000 * elapsed / self.steps, consumed_samples=consumed,
            skipped=skipped, restarts=restarts, extra=dict(result.extra))
        self.pause()
        return record


class MetricsLogger:
    """Appends to <run dir>/metrics.jsonl, prints one line, writes TensorBoard and W&B scalars (rank 0 only)."""

    def __init__(self, run_dir: str | Path, total_iters: int, enabled: bool, tensorboard: bool, wandb=None):
        self.enabled, self.total_iters = enabled, total_iters
        self.wandb = wandb if enabled else None  # a wandb_log.WandbSink, opened on the writing rank only
        self.path = Path(run_dir) / "metrics.jsonl"
        self.writer = None
        if enabled:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            if tensorboard:
                from torch.utils.tensorboard import SummaryWriter

                self.writer = SummaryWriter(log_dir=str(Path(run_dir) / "tensorboard"))
            if self.wandb is not None:
                self.wandb.open()

    def log(self, record: dict | TrainRecord) -> None:
        if not self.enabled:
            return
        if isinstance(record, TrainRecord):
            record = record.as_dict()
        with self.path.open("a") as f:
            f.write(json.dumps(record) + "\n")
        print(format_line(record, self.total_iters), flush=True)
        scalars = {key: value for key, value in record.items()
                   if key != "iteration" and isinstance(value, (int, float)) and not isinstance(value, bool)}
        if self.writer is not None:
            for key, value in scalars.items():
                self.writer.add_scalar(key, value, record["iteration"])
        if self.wandb is not None:
            self.wandb.log(scalars, record["iteration"])

    def close(self) -> None:
        if self.writer is not None:
            self.writer.close()
        if self.wandb is not None:
            self.wandb.close()
