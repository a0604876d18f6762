"""Throughput, memory, and the three sinks of every logged iteration: console, metrics.jsonl,
TensorBoard. Only global rank 0 writes; every value it writes is identical on all ranks (the loss is
reduced before logging) or is rank 0's own (memory).
"""

from __future__ import annotations

import json
import math
import os
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


# The keys of a training record; any other numeric key is a named extra loss (models/extra_losses.py),
# printed after the loss.
RESERVED_KEYS = frozenset({"iteration", "loss", "val_loss", "lr", "grad_norm", "tokens_per_s", "tflops_per_gpu",
                           "mfu", "mem_gb", "step_ms", "consumed_samples", "skipped", "restarts"})


def format_line(record: dict, total_iters: int) -> str:
    def num(key, fmt):
        value = record.get(key)
        return "-" if value is None else format(value, fmt)

    if "val_loss" in record:
        return (f" eval iter {record['iteration']:>6} | val loss {record['val_loss']:.4f} | "
                f"val ppl {math.exp(min(record['val_loss'], 30)):.2f}")
    parts = [
        f" iter {record['iteration']:>6}/{total_iters}", f"loss {num('loss', '.4f')}",
        *(f"{key} {num(key, '.4g')}" for key in record if key not in RESERVED_KEYS),
        f"lr {num('lr', '.3e')}", f"grad norm {num('grad_norm', '.3f')}",
        f"{num('tokens_per_s', ',.0f')} tok/s", f"{num('tflops_per_gpu', '.2f')} TFLOP/s/dev",
        f"mfu {num('mfu', '.1%')}", f"mem {num('mem_gb', '.2f')} GB", f"{num('step_ms', '.1f')} ms/step",
    ]
    if record.get("skipped"):
        parts.append(f"skipped {record['skipped']}")
    return " | ".join(parts)


class MetricsLogger:
    """Appends to <run dir>/metrics.jsonl, prints one line, writes TensorBoard scalars (rank 0 only)."""

    def __init__(self, run_dir: str | Path, total_iters: int, enabled: bool, tensorboard: bool):
        self.enabled, self.total_iters = enabled, total_iters
        self.path = Path(run_dir) / "metrics.jsonl"
        self.writer = None
        if enabled:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            if tensorboard:
                from torch.utils.tensorboard import SummaryWriter

                self.writer = SummaryWriter(log_dir=str(Path(run_dir) / "tensorboard"))

    def log(self, record: dict) -> None:
        if not self.enabled:
            return
        with self.path.open("a") as f:
            f.write(json.dumps(record) + "\n")
        print(format_line(record, self.total_iters), flush=True)
        if self.writer is not None:
            for key, value in record.items():
                if key != "iteration" and isinstance(value, (int, float)) and not isinstance(value, bool):
                    self.writer.add_scalar(key, value, record["iteration"])

    def close(self) -> None:
        if self.writer is not None:
            self.writer.close()
