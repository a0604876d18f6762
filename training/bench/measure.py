"""Measured memory and communication of a built run, for the benchmark and the memory tests (the estimate is
training/estimate/memory.py; these are what it is checked against).

    state_bytes(state)              this rank's bytes of parameters, gradient buffers and optimizer state
    SavedActivations(state).forward_step(step)   the largest micro-batch's bytes its forward saves
    collective_seconds(profiler)    time spent inside collectives (gloo / NCCL) in a torch.profiler trace
    measure_detail(state, ...)      all three for tools/bench.py --detail (--layouts rows)
"""

from __future__ import annotations

import contextlib
import time

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor

from training.engine.build import TrainState


def _local(t):
    return t._local_tensor if isinstance(t, DTensor) else t


def state_tensors(state: TrainState) -> list[torch.Tensor]:
    """Parameters, gradient / weight buffers (DDP's, or Megatron-FSDP's sharded ones and its DTensor shards)
    and the optimizer's main parameters and moments."""
    tensors = []
    for chunk in state.model:
        tensors += [_local(p) for p in chunk.parameters()]
        if hasattr(chunk, "expert_parallel_buffers"):  # DDP
            tensors += [t for buf in (*chunk.buffers, *chunk.expert_parallel_buffers)
                        for t in (buf.grad_data, buf.param_data)]
        else:  # Megatron-FSDP
            tensors += [getattr(group, kind).data for group in chunk.param_and_grad_buffer.parameter_groups
                        for kind in ("model_weight_buffer", "main_weight_buffer", "main_grad_buffer")
                        if getattr(group, kind) is not None]
    for opt in getattr(state.optimizer, "chained_optimizers", [state.optimizer]):
        tensors += [_local(p) for group in opt.optimizer.param_groups for p in group["params"]]
        tensors += [_local(v) for s in opt.optimizer.state.values() for v in s.values() if torch.is_tensor(v)]
    return [t for t in tensors if t is not None]


def state_bytes(state: TrainState) -> int:
    """Bytes of state_tensors, each storage once (views into DDP's buffers are not counted twice). After an
    optimizer step, so that Adam's moments exist."""
    storages = {t.untyped_storage().data_ptr(): t.untyped_storage().nbytes() for t in state_tensors(state)}
    return sum(storages.values())


class SavedActivations:
    """Counts the bytes autograd saves for backward during the forward passes only (each storage once,
    parameters excluded), per micro-batch: `forward_step(step)` wraps the schedule's forward step so that the
    hooks are on while it and its loss function run, and off in backward, where recomputation (model.recompute)
    saves again what the forward dropped. The k-th call of a model chunk is its k-th micro-batch; a micro-batch's
    count sums its chunks (interleaved pipelines). `peak` is the largest micro-batch's count: the activations
    one micro-batch keeps on this rank; a pipeline stage holds up to pp of them at once."""

    def __init__(self, state: TrainState):
        self.weights = {t.untyped_storage().data_ptr() for t in state_tensors(state)}
        self.seen: dict[int, set[int]] = {}  # micro-batch -> storages counted
        self.bytes: dict[int, int] = {}  # micro-batch -> bytes saved by its forward passes
        self._calls: dict[int, int] = {}  # model chunk (id) -> forward calls so far

    @property
    def peak(self) -> int:
        return max(self.bytes.values(), default=0)

    @contextlib.contextmanager
    def counting(self, micro_batch: int):
        """Inside: what autograd saves counts for `micro_batch`."""
        seen = self.seen.setdefault(micro_batch, set())
        self.bytes.setdefault(micro_batch, 0)

        def pack(t: torch.Tensor) -> torch.Tensor:
            if t.device.type != "meta":
                ptr = t.untyped_storage().data_ptr()
                if ptr not in self.weights and ptr not in seen:
                    seen.add(ptr)
                    self.bytes[micro_batch] += t.untyped_storage().nbytes()
            return t

        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            yield

    def forward_step(self, step):
        """`step` (a schedule's forward_step_func) counting what it and its loss function save."""
        def counted_step(data_iterator, model):
            k = self._calls[id(model)] = self._calls.get(id(model), -1) + 1
            with self.counting(k):
                output, loss_func = step(data_iterator, model)

            def counted_loss(*args, **kwargs):
                with self.counting(k):
                    return loss_func(*args, **kwargs)
            return output, counted_loss
        return counted_step


def collective_seconds(prof) -> float:
    """Wall seconds during which a collective was running, from a finished torch.profiler run: the union of
    the intervals of gloo's work records (`gloo:all_reduce`, ...: enqueue to completion, the wait for the
    peers included) and of NCCL's kernels on a GPU. Overlapping collectives count once."""
    spans = sorted((e.time_range.start, e.time_range.end) for e in prof.events()
                   if e.name.startswith("gloo:") or "nccl" in e.name.lower() and "Kernel" in e.name)
    total, end = 0.0, float("-inf")
    for a, b in spans:
        if b > end:
            total += b - max(a, end)
            end = b
    return total / 1e6


def cpu_math_attention(cfg, device) -> bool:
    """On a CPU with attention dropout torch's SDPA keeps s x s tensors (training/estimate/memory.py)."""
    from training.estimate.memory import flash_attention_on

    return not flash_attention_on(cfg, device.type)


def activation_estimate(cfg, shape, layout, device) -> float:
    """The memory estimate's bytes for what SavedActivations measures: one micro-batch's forward passes on the
    most-loaded stage (training/estimate/memory.py's stage_activations at one micro-batch), without the term
    full recomputation adds for backward (one layer's activations while it is recomputed), which no forward
    saves. On a CPU with attention dropout, the math attention's s x s tensors are counted."""
    from models.stack import stage_layer_numbers
    from training.estimate.memory import layer_activations, stage_activations

    flash = not cpu_math_attention(cfg, device)
    worst = 0.0
    for stage in sorted({0, layout.pp - 1}):
        out = stage_activations(cfg, shape, layout, 1, stage, flash)
        if str(cfg.model.recompute) == "full":
            out -= max(layer_activations(cfg, shape, layout, flash, n, recompute="none")
                       for n in stage_layer_numbers(shape.num_layers, layout.pp, layout.vpp, stage))
        worst = max(worst, out)
    return worst


def measure_detail(state: TrainState, streams, layout, cfg, device) -> dict:
    """The largest rank's state bytes and activations saved per micro-batch (and their estimate), and the
    collectives' share of 3 profiled steps (rank 0's)."""
    from training.engine import step as S

    saved = SavedActivations(state)
    S.train_step(state, streams(), layout, cfg, device, step=saved.forward_step(S.forward_step))
    sizes = torch.tensor([state_bytes(state), saved.peak], dtype=torch.float64, device=device)
    dist.all_reduce(sizes, op=dist.ReduceOp.MAX)
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU] + (
            [torch.profiler.ProfilerActivity.CUDA] if device.type == "cuda" else [])) as prof:
        start = time.perf_counter()
        for _ in range(3):
            S.train_step(state, streams(), layout, cfg, device)
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        wall = time.perf_counter() - start
    return {"state_bytes": int(sizes[0]), "activation_bytes": int(sizes[1]),
            "activation_estimate_bytes": int(activation_estimate(cfg, state.shape, layout, device)),
            "cpu_math_attention": cpu_math_attention(cfg, device),
            "comm_share": collective_seconds(prof) / wall}
