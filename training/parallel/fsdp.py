"""Megatron-FSDP (parallel.fsdp): ZeRO-2 (optim_grads) and ZeRO-3 (optim_grads_params) over data parallel.

Everything this feature needs, in one place: its rules (where this template has tested it), its environment
setting, its part of Megatron-Core's DDP config, the wrapper, and its memory terms. Its checkpoint format
(fsdp_dtensor) is training/checkpoint/fsdp_dtensor.py. schema.to_config turns parallel.dist_opt on with it
(Megatron-FSDP shards through the distributed optimizer).
"""

from __future__ import annotations

import os

import torch

ZERO3 = "optim_grads_params"


def enabled(cfg) -> bool:
    return str(cfg.parallel.fsdp) != "none"


def problems(cfg, layout) -> list[str]:
    """Tested here with TP, SP and DP on dense models."""
    if not layout.fsdp_enabled:
        return []
    others = [f"parallel.{k}={v}" for k, v in (("pp", layout.pp), ("cp", layout.cp), ("ep", layout.ep)) if v > 1]
    others += ["model.moe.num_experts"] if cfg.model.moe.num_experts else []
    if others:
        return [f"parallel.fsdp={layout.fsdp} is tested here with TP, SP and DP only: drop {', '.join(others)} (or "
                f"use parallel.fsdp=none with parallel.dist_opt=true)"]
    return []


def set_env(cfg) -> None:
    """Before CUDA starts: Megatron-FSDP overlaps its gathers on other queues, so one connection (what
    Megatron-LM's TP overlap wants, launch/common.sh's default) would serialise them."""
    if enabled(cfg) and os.environ.get("CUDA_DEVICE_MAX_CONNECTIONS") == "1":
        os.environ["CUDA_DEVICE_MAX_CONNECTIONS"] = "8"


def ddp_settings(cfg) -> dict:
    """This feature's fields of Megatron-Core's DistributedDataParallelConfig."""
    on = enabled(cfg)
    return dict(
        use_megatron_fsdp=on, data_parallel_sharding_strategy=str(cfg.parallel.fsdp) if on else "no_shard",
        # gradients kept and reduced in fp32, as DDP's (its default is the parameters' dtype)
        megatron_fsdp_main_grads_dtype=torch.float32, megatron_fsdp_grad_comm_dtype=torch.float32,
        # ZeRO-3: after the optimizer step Megatron-FSDP would prefetch every unit's weights at once and
        # hold that full copy until the next forward (11 instead of 9 bytes/param at DP2, bf16); off, the
        # forward's own hooks gather (and prefetch) unit by unit and free each after use
        fsdp_all_gather_in_start_param_sync=False,
    )


def wrap(chunks: list, config, ddp_config, cfg, device: torch.device) -> list:
    """Megatron-FSDP's adapter per chunk: ZeRO-3 gathers each TransformerLayer's parameters when it runs
    (the FSDP unit) and frees them after; ZeRO-2 keeps them."""
    from megatron.core.distributed.fsdp.mcore_fsdp_adapter import FullyShardedDataParallel

    from models.layer import TransformerLayer

    units = [TransformerLayer] if str(cfg.parallel.fsdp) == ZERO3 else []
    return [FullyShardedDataParallel(config=config, ddp_config=ddp_config, module=chunk, fsdp_unit_modules=units,
                                     disable_bucketing=index > 0, device=device)
            for index, chunk in enumerate(chunks)]


def bytes_per_param(precision: str, fsdp: str, dp: int) -> float:
    """Model weights p bytes, fp32 main weights, gradients and Adam's two moments (4 + 4 + 8), sharded over
    DP: ZeRO-2 p + 16/dp, ZeRO-3 (p + 16)/dp."""
    p = 2 if precision == "bf16" else 4
    return p + 16 / dp if fsdp == "optim_grads" else (p + 16) / dp


def unsharded_bytes(precision: str, fsdp: str, params: int, layer_params: int, num_layers: int) -> tuple[float, float]:
    """ZeRO-3's unsharded weights: (always, the root unit = everything outside the layers; while running,
    a layer's unit and the next, prefetched) in bytes; (0, 0) otherwise."""
    if fsdp != ZERO3:
        return 0.0, 0.0
    p = 2 if precision == "bf16" else 4
    return p * (params - num_layers * layer_params), p * min(2, num_layers) * layer_params
