"""Measured memory and communication of a built run, for the benchmark and the memory tests (the estimate is
training/estimate/memory.py; these are what it is checked against).

    state_bytes(state)              this rank's bytes of parameters, gradient buffers and optimizer state
    with SavedActivations(state) as saved: ...   the largest micro-batch's bytes saved for backward
    collective_seconds(profiler)    time spent inside collectives (gloo / NCCL) in a torch.profiler trace
    measure_detail(state, ...)      all three for tools/bench.py --detail (--layouts rows)
"""

from __future__ import annotations

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
    """Counts the bytes autograd saves for backward (each storage once, parameters excluded) between
    `start()` calls; `peak` is the largest count, i.e. the activations of the largest forward pass. The
    schedule calls one forward per micro-batch (and model chunk), so wrapping training.engine.step.forward_step's
    call gives the activations of one micro-batch; a pipeline stage holds up to pp of them at once."""

    def __init__(self, state: TrainState):
        self.weights = {t.untyped_storage().data_ptr() for t in state_tensors(state)}
        self.seen: set[int] = set()
        self.current = self.peak = 0
        self._hooks = torch.autograd.graph.saved_tensors_hooks(self._pack, lambda t: t)

    def _pack(self, t: torch.Tensor) -> torch.Tensor:
        if t.device.type != "meta":
            ptr = t.untyped_storage().data_ptr()
            if ptr not in self.weights and ptr not in self.seen:
                self.seen.add(ptr)
                self.current += t.untyped_storage().nbytes()
                self.peak = max(self.peak, self.current)
        return t

    def start(self) -> None:
        self.seen.clear()
        self.current = 0

    def __enter__(self) -> SavedActivations:
        self._hooks.__enter__()
        return self

    def __exit__(self, *exc) -> None:
        self._hooks.__exit__(*exc)


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


def measure_detail(state: TrainState, streams, layout, cfg, device) -> dict:
    """The largest rank's state bytes and activations saved per micro-batch, and the collectives' share of
    3 profiled steps (rank 0's)."""
    from training.engine import step as S

    with SavedActivations(state) as saved:
        def counting_step(data_iterator, model):
            saved.start()
            return S.forward_step(data_iterator, model)

        S.train_step(state, streams(), layout, cfg, device, step=counting_step)
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
            "comm_share": collective_seconds(prof) / wall}
