"""Benchmark helpers for tools/bench.py: timed training steps through the engine's own functions
(training.engine.build.build, training.engine.step.train_step / run_schedule) on a fixed synthetic global batch, and
Megatron-Core's own GPTModel at the same config, layout and weights, wrapped and stepped the same way.

Megatron-Core's GPTModel goes through the very same code as ours: `build(make_model=...)` with a maker
of GPTModel chunks (same TransformerConfig from training.engine.bridge, Float16Module for bf16,
DDP, optimizer, scheduler and schedule hooks), and `train_step(step=...)` with a forward step that passes
GPTModel's arguments (input_ids, position_ids, attention_mask, labels=).
"""

from __future__ import annotations

import contextlib
import statistics
import time
from functools import partial

import torch

from models.shape import ModelShape
from training.config.schema import Config
from training.data.streams import micro_batch_streams
from training.engine import step as S
from training.engine.build import TrainState, build
from training.engine.losses import loss_func
from training.errors import ConfigError
from training.parallel import dist as D
from training.parallel.layout import Layout
from training.parallel.wrap import unwrap


@contextlib.contextmanager
def swapped(owner, name: str, value):
    """Temporarily replace `owner.name` (a module global, or an instance or class attribute)."""
    own = name in vars(owner)
    original = getattr(owner, name)
    setattr(owner, name, value)
    try:
        yield
    finally:
        if own:
            setattr(owner, name, original)
        else:  # it came from the class: drop the instance attribute again
            delattr(owner, name)


def synthetic_batch(cfg: Config, vocab_size: int, seed: int = 0) -> list[dict]:
    """One global batch of random tokens, as a list of samples (MicroBatches indexes it like a dataset)."""
    g = torch.Generator().manual_seed(seed)
    text = torch.randint(0, vocab_size, (cfg.train.global_batch_size, cfg.model.seq_length + 1), generator=g)
    mask = torch.ones(cfg.model.seq_length)
    return [{"tokens": row[:-1], "labels": row[1:], "loss_mask": mask} for row in text]


def batch_streams(state: TrainState, batch: list[dict], cfg: Config):
    """A fresh streams factory: every call streams the same global batch from its start, as training.engine.loop
    does for a dataset (training.data.datasets.micro_batch_streams)."""
    return lambda: micro_batch_streams(len(state.model), batch, 0, cfg.train.micro_batch_size)


# --- Megatron-Core's GPTModel ------------------------------------------------------------------------------


def mcore_layer_spec(config, use_te: bool):
    """TE spec when asked, else the local spec: Megatron-Core's own layers with the same fusions as
    ours, since both read the one TransformerConfig of training.engine.bridge (model.fused_kernels)."""
    from megatron.core.models.gpt import gpt_layer_specs as specs

    if use_te:
        return specs.get_gpt_layer_with_transformer_engine_spec()
    return specs.get_gpt_layer_local_spec(normalization=config.normalization)


def mcore_model_maker(use_te: bool):
    """make_model for training.engine.build: Megatron-Core's GPTModel at our shape."""
    from megatron.core.models.gpt import GPTModel

    def make_model(config, shape: ModelShape, pre_process, post_process, vp_stage):
        return GPTModel(
            config, mcore_layer_spec(config, use_te), vocab_size=shape.padded_vocab(config.tensor_model_parallel_size),
            max_sequence_length=shape.seq_length, pre_process=pre_process, post_process=post_process,
            share_embeddings_and_output_weights=shape.tie_embeddings,
            position_embedding_type="rope" if shape.position_embedding == "rope" else "learned_absolute",
            rotary_base=shape.rotary_base, vp_stage=vp_stage)

    return make_model


def build_mcore(cfg: Config, shape: ModelShape, device: torch.device, use_te: bool = False) -> TrainState:
    """Megatron-Core's GPTModel through training.engine.build.build: DDP, optimizer, scheduler, hooks as ours."""
    from megatron.core.models.gpt import GPTModel
    from megatron.core.models.gpt.gpt_layer_specs import HAVE_APEX, HAVE_TE

    if shape.num_experts:
        raise ConfigError("--compare-mcore builds Megatron-Core's dense GPTModel: compare a dense model (this one "
                          "has model.moe.num_experts)")
    if use_te and not HAVE_TE:
        raise ConfigError("--te needs Transformer Engine (the NGC PyTorch image has it)")
    if cfg.parallel.sp and not use_te and (cfg.model.normalization == "RMSNorm" or not HAVE_APEX):
        raise ConfigError("Megatron-Core's local spec has no sequence-parallel norm here (torch's norm refuses "
                          "parallel.sp; apex has one for LayerNorm only): compare without parallel.sp, or with "
                          "--te where Transformer Engine is installed")
    state = build(cfg, shape, device, make_model=mcore_model_maker(use_te))
    assert isinstance(unwrap(state.model[0]), GPTModel)
    return state


def mcore_forward_step(data_iterator, model):
    """training.engine.step.forward_step for GPTModel's signature (it needs position ids for learned positions)."""
    batch = next(data_iterator) if data_iterator is not None else None
    gpt, device = unwrap(model), D.current_device()
    tokens = batch["tokens"].to(device) if gpt.pre_process else None  # [b, s]
    positions = torch.arange(tokens.shape[1], device=device).expand_as(tokens) if gpt.pre_process else None
    labels = batch["labels"].to(device) if gpt.post_process else None  # [b, s]
    output = model(tokens, positions, None, labels=labels)
    mask = batch["loss_mask"].to(device) if gpt.post_process else None
    return output, partial(loss_func, mask)


# Megatron-Core's TE spec fuses each pre-norm into the linear after it (TELayerNormColumnParallelLinear), so
# the norm's weight lives there under another name (Megatron-Core's own sharded_state_dict_keys_map).
TE_FUSED_NORMS = {"input_layernorm.": "self_attention.linear_qkv.layer_norm_",
                  "pre_mlp_layernorm.": "mlp.linear_fc1.layer_norm_"}


def mcore_name(name: str, theirs: dict) -> str:
    """Megatron-Core's name of our parameter `name`: the same, except the TE spec's fused norms."""
    if name not in theirs:
        for ours, fused in TE_FUSED_NORMS.items():
            if f".{ours}" in name and name.replace(ours, fused) in theirs:
                return name.replace(ours, fused)
    return name


def copy_weights(src: TrainState, dst: TrainState) -> None:
    """Our chunks' parameters into Megatron-Core's (same names, same shards on every rank)."""
    for a, b in zip(src.model, dst.model):
        theirs = dict(unwrap(b).named_parameters())
        ours = {mcore_name(name, theirs): param for name, param in unwrap(a).named_parameters()}
        if set(ours) != set(theirs):
            raise RuntimeError(f"parameter names differ: only ours {sorted(set(ours) - set(theirs))}, "
                               f"only Megatron-Core's {sorted(set(theirs) - set(ours))}")
        with torch.no_grad():
            for name, param in theirs.items():
                if param.shape != ours[name].shape:
                    raise RuntimeError(f"{name}: ours {tuple(ours[name].shape)}, mcore {tuple(param.shape)}")
                param.copy_(ours[name])
    dst.optimizer.reload_model_params()  # fp32 main params (bf16) follow the copy


# --- timing -----------------------------------------------------------------------------------------------


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def time_steps(state: TrainState, make_streams, layout: Layout, cfg: Config, device, steps: int,
               step=S.forward_step) -> list[float]:
    """Seconds per training step (forward + backward + optimizer), each through training.engine.step.train_step."""
    times = []
    for _ in range(steps):
        streams = make_streams()
        sync(device)
        start = time.perf_counter()
        S.train_step(state, streams, layout, cfg, device, step=step)
        sync(device)
        times.append(time.perf_counter() - start)
    return times


class _Timer:
    """Accumulates the wall time of calls to a wrapped function (CUDA synchronised at both ends, so the
    GPU work a call enqueued is counted in it and not in the caller's next wait)."""

    def __init__(self, fn, device: torch.device):
        self.fn, self.device, self.total = fn, device, 0.0

    def __call__(self, *args, **kwargs):
        sync(self.device)
        start = time.perf_counter()
        try:
            return self.fn(*args, **kwargs)
        finally:
            sync(self.device)
            self.total += time.perf_counter() - start


def breakdown(state: TrainState, make_streams, layout: Layout, cfg: Config, device, steps: int) -> dict:
    """Where a step's time goes: forward (data, model, loss), backward, finalize_model_grads (grad
    reduction), optimizer.step, the rest of the schedule (its own code; with PP also the pipeline's
    send/receive waits, i.e. the bubble), and the loop's own code (train_step minus
    run_schedule and optimizer.step: zeroing grads, the loss all-reduce and .item(), the NaN check,
    the scheduler). Shares of the mean step. On a GPU every part is synchronised at its ends, which
    costs ~10 us of idle GPU per boundary (micro-batches x 2 + 3 per step): the shares are right, the
    step time is a little longer than without the breakdown."""
    from megatron.core.pipeline_parallel import schedules

    fwd, bwd = _Timer(schedules.forward_step, device), _Timer(schedules.backward_step, device)
    fin, opt = _Timer(state.config.finalize_model_grads_func, device), _Timer(state.optimizer.step, device)
    sched = _Timer(S.run_schedule, device)
    with swapped(schedules, "forward_step", fwd), swapped(schedules, "backward_step", bwd), \
            swapped(state.config, "finalize_model_grads_func", fin), swapped(state.optimizer, "step", opt), \
            swapped(S, "run_schedule", sched):
        total = sum(time_steps(state, make_streams, layout, cfg, device, steps))
    parts = {"forward": fwd.total, "backward": bwd.total, "finalize_grads": fin.total,
             "schedule_other": sched.total - fwd.total - bwd.total - fin.total, "optimizer": opt.total,
             "loop_overhead": total - sched.total - opt.total}
    return {"step_s": total / steps, **{f"{k}_share": v / total for k, v in parts.items()}}


def paired_windows(a, b, windows: int, steps: int, other: str = "mcore") -> dict:
    """Alternate two step-timers A B A B ...: the medians of all their steps, and `ratio`, the median of
    the per-window ratios (a window's median A over the next window's median B), so that load from other
    processes, which changes over seconds, hits both sides of most pairs alike. `ratio_min` (fastest
    step over fastest step) is a cross-check that is robust to such load. `other` names B's keys (mcore_s, hf_s)."""
    a_all, b_all, ratios = [], [], []
    for _ in range(windows):
        ta, tb = a(steps), b(steps)
        a_all += ta
        b_all += tb
        ratios.append(statistics.median(ta) / statistics.median(tb))
    return {"ours_s": statistics.median(a_all), f"{other}_s": statistics.median(b_all),
            "ratio": statistics.median(ratios), "window_ratios": ratios, "ratio_min": min(a_all) / min(b_all),
            "ours_steps_s": a_all, f"{other}_steps_s": b_all}


def rotated_windows(a, others: dict, windows: int, steps: int) -> dict:
    """paired_windows against several step-timers ({name: timer}): each window runs ours and every other once, in
    an order that rotates window to window (A B C, B C A, C A B, ...) so that no side always runs right after
    another; `ratio_<name>` is the median over windows of ours' window median over that side's."""
    timers = {"ours": a, **others}
    names = list(timers)
    times, ratios = {n: [] for n in names}, {n: [] for n in others}
    for w in range(windows):
        medians = {}
        for n in names[w % len(names):] + names[:w % len(names)]:
            t = timers[n](steps)
            times[n] += t
            medians[n] = statistics.median(t)
        for n in others:
            ratios[n].append(medians["ours"] / medians[n])
    out = {"ours_s": statistics.median(times["ours"]), "ours_steps_s": times["ours"]}
    for n in others:
        out.update({f"{n}_s": statistics.median(times[n]), f"ratio_{n}": statistics.median(ratios[n]),
                    f"window_ratios_{n}": ratios[n], f"ratio_min_{n}": min(times["ours"]) / min(times[n]),
                    f"{n}_steps_s": times[n]})
    return out
