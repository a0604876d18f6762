"""Data-parallel wrapping of the model chunks: Megatron-Core's DDP, or with parallel.fsdp its Megatron-FSDP
adapter (training/parallel/fsdp.py), and the way back to the bare model.

    model = wrap(chunks, config, ddp_config, cfg, device)   # training/engine/build.py
    unwrap(model[0])                                         # -> our GPT (checkpoints, HF export, tests)
"""

from __future__ import annotations

import torch
from megatron.core.distributed import DistributedDataParallel
from megatron.core.distributed.data_parallel_base import _BaseDataParallel
from megatron.core.transformer.module import Float16Module

from training.parallel import fsdp


def wrap(chunks: list, config, ddp_config, cfg, device: torch.device) -> list:
    """One wrapper per chunk; as Megatron-LM, only the first chunk buckets (overlap with backward)."""
    if fsdp.enabled(cfg):
        return fsdp.wrap(chunks, config, ddp_config, cfg, device)
    return [DistributedDataParallel(config=config, ddp_config=ddp_config, module=chunk, disable_bucketing=index > 0)
            for index, chunk in enumerate(chunks)]


def unwrap(module: torch.nn.Module) -> torch.nn.Module:
    """DDP(Float16Module(model)) or FSDP(MegatronFSDP(...)) -> model (any wrapper may be absent): our GPT, or
    Megatron-Core's GPTModel in the benchmark."""
    while isinstance(module, (_BaseDataParallel, Float16Module)) or type(module).__name__ == "MegatronFSDP":
        module = module.module
    return module
