"""Preflight: before the model is built, estimate this layout's per-GPU memory (training/estimate/memory.py,
the planner's arithmetic) and record the software environment, so a run that cannot fit stops in
seconds with numbers instead of an out-of-memory error minutes later, and every run dir says what
it ran on.

    from training.estimate.preflight import preflight
    preflight(cfg, layout, shape, info.device, run_dir)   # every rank, after the process group

Every rank computes the same estimate and raises the same ConfigError (no rank waits on a peer that
left); only global rank 0 prints and writes <run dir>/environment.json. On CPU nothing is enforced:
host memory is not what the estimate models, so it is only reported.
"""

from __future__ import annotations

import importlib.metadata
import json
import os
import platform
import socket
from pathlib import Path

import torch

from models.shape import ModelShape
from training.config.schema import Config
from training.errors import ConfigError
from training.estimate.memory import GB, Estimate, estimate, flash_attention_on
from training.parallel.layout import Layout

# Distributions whose versions explain a run's numbers (torch: its own __version__, which names the
# CUDA build); the first installed name of each entry counts.
PACKAGES = {"megatron-core": ("megatron-core", "megatron_core"),
            "transformer-engine": ("transformer-engine", "transformer_engine", "transformer-engine-torch"),
            "apex": ("apex",), "hydra-core": ("hydra-core",), "numpy": ("numpy",)}


def _version(names: tuple[str, ...]) -> str | None:
    for name in names:
        try:
            return importlib.metadata.version(name)
        except importlib.metadata.PackageNotFoundError:
            continue
    return None


def environment(device: torch.device) -> dict:
    """Versions, accelerator and launch facts; `warnings` lists mismatches worth a look."""
    cuda = device.type == "cuda"
    local_world = int(os.environ.get("LOCAL_WORLD_SIZE", "1"))
    gpus = torch.cuda.device_count() if cuda else 0
    report = {
        "host": socket.gethostname(), "python": platform.python_version(),
        "packages": {"torch": str(torch.__version__), **{key: _version(names) for key, names in PACKAGES.items()}},
        "cuda": torch.version.cuda if cuda else None,
        "nccl": ".".join(map(str, torch.cuda.nccl.version())) if cuda else None,
        "device": torch.cuda.get_device_name(device) if cuda else "cpu",
        "device_memory_gb": round(torch.cuda.get_device_properties(device).total_memory / GB, 2) if cuda else None,
        "gpus_visible": gpus, "local_world_size": local_world,
        "world_size": int(os.environ.get("WORLD_SIZE", "1")),
        "env": {k: os.environ[k] for k in ("CUDA_DEVICE_MAX_CONNECTIONS", "NCCL_DEBUG", "OMP_NUM_THREADS",
                                           "TORCH_NCCL_ASYNC_ERROR_HANDLING", "SLURM_JOB_ID",
                                           "TORCHELASTIC_RESTART_COUNT") if k in os.environ},
        "warnings": [],
    }
    if cuda and gpus != local_world:
        hint = f"GPUs sit idle: start NPROC={gpus}" if gpus > local_world else "processes share GPUs"
        report["warnings"].append(f"{gpus} GPUs visible but {local_world} processes on this node "
                                  f"(LOCAL_WORLD_SIZE): {hint}")
    if cuda and os.environ.get("CUDA_DEVICE_MAX_CONNECTIONS") != "1":
        report["warnings"].append("CUDA_DEVICE_MAX_CONNECTIONS is not 1: TP/SP communication overlap may "
                                  "reorder kernels (launch/common.sh sets it)")
    return report


def host_memory_warning(per_process: float, processes: int, host: float | None) -> str | None:
    """On CPU: a warning when this node's processes need more than its memory by the estimate (a lower bound
    there), the out-of-memory killer's signal 9 being the only word otherwise."""
    if host is None or per_process * processes <= host:
        return None
    return (f"by the estimate this node's {processes} process(es) need {per_process * processes / GB:.1f} GB "
            f"({per_process / GB:.1f} GB each, a lower bound on CPU), more than its {host / GB:.1f} GB of memory: the "
            f"kernel may kill a rank (signal 9); lower model.seq_length or train.micro_batch_size, or set "
            f"model.recompute=full")


def _host_memory() -> float | None:
    try:
        return float(os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE"))
    except (ValueError, OSError, AttributeError):
        return None


def check(est: Estimate, capacity_bytes: int | None, fraction: float, model: str, precision: str | None = None) -> None:
    """ConfigError when the estimate exceeds the device's memory x train.max_memory_fraction; it names the planner
    command for this model, global batch and precision (the planner searches the micro batch)."""
    if capacity_bytes is None:
        return
    budget = capacity_bytes * fraction
    if est.total > budget:
        lay, g = est.layout, est.mem_gb()
        raise ConfigError(
            f"estimated {g['total']:.1f} GB per GPU (weights+grads+optimizer {g['weights_and_optimizer']:.1f} + "
            f"activations {g['activations']:.1f}, pipeline stage {est.stage}) exceeds {capacity_bytes / GB:.1f} GB x "
            f"train.max_memory_fraction={fraction:g} = {budget / GB:.1f} GB: run `.venv/bin/python tools/plan.py "
            f"model={model} train.global_batch_size={lay.global_batch_size}"
            f"{f' train.precision={precision}' if precision else ''} plan.gpus_per_node="
            f"{max(1, torch.cuda.device_count())} plan.gpu_mem_gb={capacity_bytes / GB:.0f}` for layouts that fit, "
            f"or try model.recompute=full, "
            f"parallel.dist_opt=true (dp {lay.dp}), or a smaller train.micro_batch_size")


def preflight(cfg: Config, layout: Layout, shape: ModelShape, device: torch.device,
              run_dir: str | Path) -> Estimate:
    """Print the estimate (rank 0), write the environment report (rank 0), stop on GPU if it cannot fit."""
    from training.parallel.dist import is_rank0, print0

    est = estimate(cfg, shape, layout, flash_attention_on(cfg, device.type))
    capacity = torch.cuda.get_device_properties(device).total_memory if device.type == "cuda" else None
    budget = "" if capacity is None else \
        f"; budget {capacity * cfg.train.max_memory_fraction / GB:.1f} GB of {capacity / GB:.1f} GB"
    print0(f"preflight: {est.summary()}{budget or '; CPU: reported, not enforced'}")
    report = environment(device)
    if capacity is None and (warning := host_memory_warning(est.total, report["local_world_size"], _host_memory())):
        report["warnings"].append(warning)
    for warning in report["warnings"]:
        print0(f"preflight warning: {warning}")
    if is_rank0():
        report["memory_estimate"] = {"layout": est.layout.name, "recompute": est.recompute, "stage": est.stage,
                                     "params_total": est.params_total, "params_per_gpu": est.params_per_gpu,
                                     "lora_adapters_per_gpu": est.adapters,
                                     "gb": est.mem_gb(), "max_memory_fraction": cfg.train.max_memory_fraction}
        path = Path(run_dir) / "environment.json"
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps(report, indent=1) + "\n")
    check(est, capacity, cfg.train.max_memory_fraction, cfg.model.name, str(cfg.train.precision))
    return est
