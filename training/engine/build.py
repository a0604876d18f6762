"""Build this rank's model chunks, wrap them in Megatron-Core DDP, and create the optimizer + scheduler.

Follows Megatron-LM's `get_model` / `setup_model_and_optimizer`: one GPT chunk per virtual pipeline
stage, Float16Module for bf16, DDP per chunk (bucketing only on the first chunk), then
`get_megatron_optimizer` and `OptimizerParamScheduler`, and the config hooks the schedules call.

    state = build(cfg, ModelShape.of(cfg.model, vocab_size), device)    # -> TrainState
"""

from __future__ import annotations

import contextlib
import sys
from dataclasses import dataclass

import torch
from megatron.core import parallel_state, tensor_parallel
from megatron.core.distributed import finalize_model_grads
from megatron.core.optimizer import MegatronOptimizer, get_megatron_optimizer
from megatron.core.optimizer_param_scheduler import OptimizerParamScheduler
from megatron.core.transformer.module import Float16Module
from megatron.core.transformer.transformer_config import TransformerConfig

from models.gpt import GPT
from models.layer import TransformerLayer
from models.shape import ModelShape
from training.config.schema import Config
from training.engine import bridge, init
from training.parallel import dist as D
from training.parallel import peft
from training.parallel.wrap import wrap
from training.shims import upstream_fixes


@dataclass
class TrainState:
    """What training works on: this rank's model chunks and what updates them (what checkpoint/ reads of it is
    the TrainState protocol in training/checkpoint/common.py: checkpoint/ does not import the engine)."""

    model: list[torch.nn.Module]  # DDP-wrapped chunks, one per virtual pipeline stage (bare when train=False)
    optimizer: MegatronOptimizer | None  # Megatron-Core's (or its ChainedOptimizer); None when train=False
    scheduler: OptimizerParamScheduler | None
    config: TransformerConfig  # the one config every chunk and Megatron-Core's schedules read
    shape: ModelShape  # the resolved sizes (models/shape.py)


def build_chunks(config: TransformerConfig, shape: ModelShape, vpp: int | None, device: torch.device,
                 make_model=GPT, seed: int = 1234, adapt=None) -> list[torch.nn.Module]:
    """This rank's model chunk(s), one per virtual pipeline stage: pre_process / post_process from its
    pipeline position. make_model(config, shape, pre_process=, post_process=, vp_stage=) builds one. Weights
    are drawn by name from the seed (training/engine/init.py): the same model at every layout.
    adapt(chunks, record): adds parameters (LoRA adapters) to the built chunks, record(param, init_method)."""
    chunks = []
    with init.recording(config) if config.perform_initialization else contextlib.nullcontext() as recorded:
        for vp_stage in range(vpp or 1):
            stage = vp_stage if vpp else None
            chunks.append(make_model(
                config, shape, vp_stage=stage,
                pre_process=parallel_state.is_pipeline_first_stage(ignore_virtual=False, vp_stage=stage),
                post_process=parallel_state.is_pipeline_last_stage(ignore_virtual=False, vp_stage=stage)))
        if adapt is not None:
            adapt(chunks, None if recorded is None else recorded.__setitem__)
    if recorded is not None:
        init.initialize(chunks, recorded, seed)
    for index, model in enumerate(chunks):
        for param in model.parameters():
            tensor_parallel.set_defaults_if_not_set_tensor_model_parallel_attributes(param)
        upstream_fixes.mark_expert_params(model)  # the same optimizer layout at every EP size
        model.to(device)
        chunks[index] = Float16Module(config, model) if config.bf16 else model
    return chunks


def _one_or_list(hooks: list):
    return hooks[0] if len(hooks) == 1 else hooks


def compile_layers(chunks: list[torch.nn.Module]) -> int:
    """model.compile: torch.compile each transformer layer in place (`Module.compile`: the same module, names and
    checkpoint keys), as torchtitan compiles per block: the layers repeat, so one compiled graph serves them all;
    embedding, loss and Megatron-Core's DDP hooks stay eager. Compiling happens at the first step (forward, then
    backward). Returns the number of layers."""
    layers = [m for chunk in chunks for m in chunk.modules() if isinstance(m, TransformerLayer)]
    for layer in layers:
        layer.compile()
    D.print0(f"model.compile: {len(layers)} transformer layers compiled by torch.compile at the first step",
             file=sys.stderr)  # stderr: tools' stdout (bench --json) stays theirs
    return len(layers)


def build(cfg: Config, shape: ModelShape, device: torch.device, *, init: bool = True, train: bool = True,
          make_model=GPT, prepare=None) -> TrainState:
    """init=False skips the random init (every weight will be loaded: conversions); train=False returns
    the bare chunks without DDP's gradient buffers, optimizer or scheduler (inference, conversion);
    make_model builds another model the same way (tools/bench.py: Megatron-Core's GPTModel);
    prepare(chunks) runs on the bare chunks before DDP / FSDP takes them (tests load weights there)."""
    config = bridge.transformer_config(cfg, shape)
    config.perform_initialization = init
    if device.type == "meta":  # shapes only (a streamed conversion): no layer may pick a device of its own
        config.use_cpu_initialization = True
    chunks = build_chunks(config, shape, cfg.parallel.vpp, device, make_model, cfg.train.seed,
                          adapt=lambda chunks, record: peft.adapt(cfg, chunks, record))
    if prepare is not None:
        prepare(chunks)
    peft.freeze(cfg, chunks)  # peft=lora: only the adapters train (before DDP sizes its gradient buffers)
    if train and cfg.model.compile:
        compile_layers(chunks)
    if not train:
        return TrainState(model=chunks, optimizer=None, scheduler=None, config=config, shape=shape)
    model = wrap(chunks, config, bridge.ddp_config(cfg), cfg, device)  # DDP, or Megatron-FSDP
    optimizer = get_megatron_optimizer(bridge.optimizer_config(cfg), model)
    scheduler = OptimizerParamScheduler(optimizer, **bridge.scheduler_kwargs(cfg))

    # Hooks Megatron-Core's schedules call (as Megatron-LM's training.py sets them).
    config.finalize_model_grads_func = finalize_model_grads
    config.grad_scale_func = optimizer.scale_loss
    config.no_sync_func = _one_or_list([m.no_sync for m in model])
    if cfg.parallel.overlap_grad_reduce:
        config.grad_sync_func = _one_or_list([m.start_grad_sync for m in model])
    if cfg.parallel.overlap_param_gather and cfg.parallel.dist_opt:
        config.param_sync_func = _one_or_list([m.start_param_sync for m in model])
    return TrainState(model=model, optimizer=optimizer, scheduler=scheduler, config=config, shape=shape)
