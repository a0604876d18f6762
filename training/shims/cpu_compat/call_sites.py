"""Patches 2-6 and 8 of training.shims.cpu_compat: single functions and methods replaced for their callers.

Each replacement here is installed by `cpu_compat.apply()` into one Megatron-Core namespace (or, for the two
Tensor methods, scoped by the calling module's name). The package docstring lists the call sites and reasons.
The replacements keep the private names they had in the one-file module (tests read them, e.g. patch 2's).
"""

from __future__ import annotations

import sys

import torch


def _set_rng_state_on_cpu(new_state, device=-1, graph_safe=False):
    """Replacement for tensor_parallel.random._set_cuda_rng_state (patch 2)."""
    torch.set_rng_state(new_state)


# --- patches 3 and 4: caller-scoped Tensor methods --------------------------------------------------------


def _caller_module(depth: int = 2) -> str:
    return sys._getframe(depth).f_globals.get("__name__", "")


_torch_tensor_type = torch.Tensor.type
_torch_tensor_cuda = torch.Tensor.cuda


def _tensor_type(self, dtype=None, non_blocking=False, **kwargs):
    """Tensor.type (patch 3): a CPU tensor reports its CUDA type name to callers in megatron.core.optimizer."""
    if dtype is None and not kwargs and self.device.type == "cpu":
        if _caller_module().startswith("megatron.core.optimizer"):
            return _torch_tensor_type(self).replace("torch.", "torch.cuda.", 1)
        return _torch_tensor_type(self)
    return _torch_tensor_type(self, dtype, non_blocking, **kwargs)


def _tensor_cuda(self, *args, **kwargs):
    """Tensor.cuda (patch 4): for callers in megatron.core a CPU tensor stays where it is."""
    if self.device.type == "cpu" and _caller_module().startswith("megatron.core"):
        return self
    return _torch_tensor_cuda(self, *args, **kwargs)


# --- patches 5 and 6: MoE token dispatch on gloo ------------------------------------------------------------


def _move_tensor_to_cpu(tensor, as_numpy=False, record_stream=False):
    """moe_utils.maybe_move_tensor_to_cpu for a CPU-only machine (patch 5): split sizes become numpy."""
    if torch.is_tensor(tensor) and as_numpy:
        return tensor.cpu().numpy()
    return tensor


def _uneven_gather(original):
    """mappings._gather_along_first_dim with uneven split sizes on gloo (patch 6): pad, all-gather, trim."""

    def gather_along_first_dim(input_, group, output_split_sizes=None, use_global_buffer=False):
        if output_split_sizes is None or group.size() == 1:
            return original(input_, group, output_split_sizes, use_global_buffer)
        sizes = [int(n) for n in output_split_sizes]
        padded = input_.new_zeros((max(sizes), *input_.shape[1:]))  # [max rows, ...]
        padded[: input_.shape[0]] = input_
        blocks = [torch.empty_like(padded) for _ in sizes]
        torch.distributed.all_gather(blocks, padded, group=group)
        return torch.cat([block[:n] for block, n in zip(blocks, sizes)])  # [sum rows, ...]

    return gather_along_first_dim


def _uneven_reduce_scatter(original):
    """mappings._reduce_scatter_along_first_dim with uneven split sizes on gloo (patch 6): all-reduce, slice."""

    def reduce_scatter_along_first_dim(input_, group, input_split_sizes=None, use_global_buffer=False):
        if input_split_sizes is None or group.size() == 1:
            return original(input_, group, input_split_sizes, use_global_buffer)
        sizes = [int(n) for n in input_split_sizes]
        total = input_.contiguous().clone()  # [sum rows, ...]
        torch.distributed.all_reduce(total, group=group)
        start = sum(sizes[: group.rank()])
        return total[start: start + sizes[group.rank()]].contiguous()  # this rank's [rows, ...]

    return reduce_scatter_along_first_dim


# --- patch 8: Megatron-FSDP's parameter all-gathers ---------------------------------------------------------


def synchronous_param_gather(all_gather_pipeline: type) -> None:
    """Make AllGatherPipeline.all_gather_params synchronous (patch 8: gloo's thread wrote into freed buckets)."""
    gather = all_gather_pipeline.all_gather_params
    all_gather_pipeline.all_gather_params = lambda self, *a, **k: gather(self, *a, **k, async_param_gather=False)
