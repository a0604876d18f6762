"""The plain-PyTorch side of `tools/bench.py --compare-hf` (and `--compare`, with training/bench/bench_titan.py's
torchtitan model): transformers' LlamaForCausalLM (SDPA attention) at our model's shape, with our weights
(training/interop/hf.py's mapping), trained the way a plain PyTorch loop trains it:
`torch.optim.AdamW` (weight decay on matrices only, as Megatron-Core's optimizer groups them),
`clip_grad_norm_`, and the learning rate of our config's schedule (Megatron-Core's OptimizerParamScheduler with
training/engine/bridge.py's arguments, stepping the torch optimizer's param groups: warmup from 0, then decay).

One step = zero_grad(set_to_none) (as our step zeroes its buffers first), then the global batch in the same
micro-batches as ours: each micro-batch's summed token cross entropy divided by the global batch's loss-token
count, backward (gradients accumulate), clip, AdamW step, scheduler step. The same arithmetic as our step
(calculate_per_token_loss: finalize_model_grads divides by the token count), so the two losses and updates
agree (tests/test_bench.py).
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Callable

import torch
import torch.nn.functional as F
from megatron.core.optimizer_param_scheduler import OptimizerParamScheduler

from training.bench.benchmark import sync
from training.config.schema import Config, Precision
from training.config.optim_defaults import peak_lr
from training.engine import bridge
from training.errors import ConfigError
from training.interop import hf, hf_config


@dataclass
class PlainSide:
    """A plain PyTorch model and its training pieces (torch AdamW, our config's schedule)."""

    model: torch.nn.Module  # LlamaForCausalLM, torchtitan's Llama3Model
    optimizer: torch.optim.AdamW
    scheduler: OptimizerParamScheduler
    cfg: Config
    logits: Callable  # (model, tokens [b, s]) -> logits [b, s, V]


def check_plain(state, cfg: Config, flag: str) -> None:
    """What a plain-PyTorch comparison needs of our run: fp32, a dense model, no dropout."""
    if cfg.train.precision != Precision.fp32:
        raise ConfigError(f"{flag} runs fp32 (the plain PyTorch side has no mixed-precision main weights): drop "
                          "train.precision")
    if state.shape.num_experts or cfg.model.hidden_dropout or cfg.model.attention_dropout:
        raise ConfigError(f"{flag} compares a dense Llama without dropout: drop model.moe.* and model.*_dropout")


def build_hf(state, cfg: Config, device: torch.device, flag: str = "--compare-hf") -> PlainSide:
    """LlamaForCausalLM with the weights of our single-process model `state` (TrainState, tp = pp = 1)."""
    import transformers

    check_plain(state, cfg, flag)
    config = hf_config.hf_config(state.shape, cfg.model, "fp32")  # LlamaConfig, or Qwen's for their options
    config._attn_implementation = "sdpa"
    model = transformers.AutoModelForCausalLM.from_config(config).to(device)
    missing = set(model.state_dict())
    with torch.no_grad():
        params = dict(model.named_parameters())
        for name, tensor in hf.hf_tensors(state):
            params[name].copy_(tensor)
            missing.discard(name)
    if state.shape.tie_embeddings:
        missing.discard("lm_head.weight")  # the embedding's tensor
    if missing:
        raise RuntimeError(f"weights not copied into the HF model: {sorted(missing)}")
    return plain_side(model, cfg, lambda m, tokens: m(input_ids=tokens).logits)


def plain_side(model: torch.nn.Module, cfg: Config, logits: Callable) -> PlainSide:
    """`model` in training mode with torch AdamW and Megatron-Core's schedule at our config's settings."""
    model.train()
    o = cfg.optim
    decay = [p for n, p in model.named_parameters() if p.ndim > 1 and not n.endswith(".bias")]
    no_decay = [p for n, p in model.named_parameters() if not (p.ndim > 1 and not n.endswith(".bias"))]
    optimizer = torch.optim.AdamW([{"params": decay, "weight_decay": o.weight_decay, "wd_mult": 1.0},
                                   {"params": no_decay, "weight_decay": 0.0, "wd_mult": 0.0}],
                                  lr=peak_lr(cfg), betas=(o.adam_beta1, o.adam_beta2), eps=o.adam_eps)
    scheduler = OptimizerParamScheduler(optimizer, **bridge.scheduler_kwargs(cfg))  # sets step 0's lr
    return PlainSide(model, optimizer, scheduler, cfg, logits)


def compile_layers(side: PlainSide) -> int:
    """tools/bench.py --compile: torch.compile each decoder layer in place, as torchtitan's own compile option does
    per block (and model.compile ours). transformers' layers are LlamaForCausalLM.model.layers, torchtitan's
    Llama3Model.layers (a ModuleDict or ModuleList). Returns the number of layers."""
    layers = getattr(side.model, "model", side.model).layers
    blocks = list(layers.values() if isinstance(layers, torch.nn.ModuleDict) else layers)
    for block in blocks:
        block.compile()
    return len(blocks)


def micro_batches(batch: list[dict], micro_batch_size: int, device: torch.device) -> list[tuple]:
    """(tokens [b, s], labels [b, s], loss mask [b, s]) per micro-batch, in our streams' order."""
    out = []
    for i in range(0, len(batch), micro_batch_size):
        rows = batch[i:i + micro_batch_size]
        keys = ("tokens", "labels", "loss_mask")
        out.append(tuple(torch.stack([r[k] for r in rows]).to(device) for k in keys))  # [b, s] each
    return out


class _Phases:
    """Wall time per phase name, accumulated across steps (CUDA synchronised at each boundary)."""

    def __init__(self, device: torch.device):
        self.device, self.totals, self._last = device, {}, None

    def mark(self, name: str | None) -> None:  # closes the running phase, opens `name`
        sync(self.device)
        now = time.perf_counter()
        if self._last is not None:
            self.totals[self._last[0]] = self.totals.get(self._last[0], 0.0) + now - self._last[1]
        self._last = None if name is None else (name, now)


def hf_train_step(side: PlainSide, micro: list[tuple], phases: _Phases | None = None) -> tuple[float, float]:
    """One optimizer step over the micro-batches; returns (global token-mean loss, grad norm before clipping).
    With `phases`, the time of each part is added to it (zero, forward, loss, backward, clip, optimizer)."""
    mark = phases.mark if phases is not None else (lambda name: None)
    mark("zero")
    side.optimizer.zero_grad(set_to_none=True)
    total_tokens = sum(mask.sum() for _, _, mask in micro)
    loss_sum = torch.zeros((), dtype=torch.float64, device=total_tokens.device)
    for tokens, labels, mask in micro:
        mark("forward")
        logits = side.logits(side.model, tokens)  # [b, s, V]
        mark("loss")
        micro_sum = _loss_sum(logits, labels, mask)
        mark("backward")
        (micro_sum / total_tokens).backward()
        loss_sum += micro_sum.detach()
    mark("clip")
    clip = side.cfg.optim.clip_grad
    norm = torch.nn.utils.clip_grad_norm_(side.model.parameters(), clip if clip > 0 else float("inf"))
    mark("optimizer")
    side.optimizer.step()
    side.scheduler.step(increment=1)
    mark(None)
    return (loss_sum / total_tokens).item(), norm.item()


def hf_breakdown(side: PlainSide, micro: list[tuple], device: torch.device, steps: int) -> dict:
    """Shares of the HF step by phase, as benchmark.breakdown gives ours."""
    phases = _Phases(device)
    start = time.perf_counter()
    for _ in range(steps):
        hf_train_step(side, micro, phases)
    total = time.perf_counter() - start
    return {"step_s": total / steps, **{f"{k}_share": v / total for k, v in phases.totals.items()}}


def _loss_sum(logits: torch.Tensor, labels: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """The masked sum of token cross entropies: logits [b, s, V], labels and mask [b, s]."""
    per_token = F.cross_entropy(logits.flatten(0, 1).float(), labels.flatten(), reduction="none")  # [b*s]
    return (per_token * mask.flatten()).sum()


def hf_loss(side: PlainSide, micro: list[tuple]) -> float:
    """The global token-mean loss, forward only."""
    with torch.no_grad():
        sums = [_loss_sum(side.logits(side.model, t), y, m).double() for t, y, m in micro]
    return (sum(sums) / sum(m.sum() for _, _, m in micro)).item()


def time_hf_steps(side: PlainSide, micro: list[tuple], device: torch.device, steps: int) -> list[float]:
    times = []
    for _ in range(steps):
        sync(device)
        start = time.perf_counter()
        hf_train_step(side, micro)
        sync(device)
        times.append(time.perf_counter() - start)
    return times
