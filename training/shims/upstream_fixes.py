"""Workarounds for Megatron-Core 0.19.2 bugs that are not CPU-specific (they also hit GPUs), each named
after the upstream report and covered by a test.

1. Interleaved pipeline + batched p2p (Megatron-LM issues #750 / #1450): with a virtual pipeline
   (`vpp`) at PP=2, `batch_p2p_comm=True` exchanges the wrong tensors between the two ranks and the
   gradients come out silently wrong. Megatron-LM itself defaults interleaving to
   `overlap_p2p_comm=True, batch_p2p_comm=False`; we always do the same.
   Test: tests/test_model_parallel_equivalence.py (the pp2-vpp2 case compares every gradient).

2. DistributedOptimizer over torch.optim.AdamW (what Megatron-Core uses without TE/apex: every CPU run,
   and GPU boxes without them) cannot resume correctly:
   a. `sharded_state_dict(is_loading=True)` calls `state_dict()`, which asserts exactly one distinct
      Adam `step` among the per-parameter states; before the first step there are none, so loading a
      checkpoint into a fresh optimizer fails (`AssertionError` / `KeyError: 'step'`).
      Fix: give every parameter an empty Adam state (zeros, its own `step`) before loading.
   b. Loading the `fully_reshardable` parameter state copies every tensor of a parameter's Adam state
      from the checkpoint, including torch's `step` tensor, which the checkpoint does not hold per
      parameter: `KeyError: 'step'`. Fix: the step is left out of that copy (it is restored from the
      param groups, as Megatron-Core intends).
   c. `load_state_dict` puts ONE `step` tensor object into every parameter's state. torch's AdamW
      increments each parameter's step in place, so after a load the shared counter advances once per
      parameter per iteration and the bias correction is wrong from then on: the run silently diverges
      from the uninterrupted one. Fix: give each parameter its own copy after loading.
   Test: tests/test_checkpoint.py (bit-identical losses after resuming with the distributed optimizer).

3. MoE optimizer state across expert-parallel sizes: Megatron-Core marks expert weights `allreduce=False`
   (own DDP buffer, own optimizer in a ChainedOptimizer, reduced over the expert-data-parallel group)
   only when EP > 1 or expert TP != TP; at EP = 1 they are ordinary weights in the dense optimizer. The
   optimizer's checkpoint layout then differs between EP = 1 and EP > 1, and a resume across them fails
   (`ValueError: Could not find parameter group ...`, plain; `KeyError: 'optimizer'`, distributed).
   Fix: expert weights are always marked expert weights; at EP = 1 the expert-data-parallel group is the
   data-parallel group, so the arithmetic is unchanged.
   Test: tests/test_moe.py (EP2 -> EP1 and EP1 -> EP2 resume, Adam state included).
   Also: an expert's RowParallelLinear marks its bias `sequence_parallel` whenever sequence parallelism is on
   (tensor_parallel/layers.py), so finalize_model_grads sums the expert biases' gradients over the TP group. An
   expert's tokens come through the dispatcher, not a TP sequence shard: its bias gradient is already whole, and
   with EP across the TP ranks (tp2 x ep2) the sum adds another expert's gradient to it (gpt-oss's down biases
   1.9x off after one step). Fix: routed experts' parameters are never `sequence_parallel`.
   Test: tests/test_whole_step.py (gpt-oss at tp2 + sp x ep2).

4. dist_checkpointing's write-results queue outlives a killed rank (no upstream report found): a rank's first save
   with shards to write starts a multiprocessing Manager (spawn: its server process, and the resource tracker)
   for the rest of the process's life, sharing the rank's stdout and stderr. When the rank is killed (OOM, kill -9)
   the Manager lives on, an orphan per dead rank (one more at each MAX_RESTARTS restart), holding the launcher's
   output pipes open. Fix: the queue comes from a Manager whose server asks Linux to kill it when the rank dies
   (PR_SET_PDEATHSIG); the resource tracker then ends too (its last writer is gone). Megatron-Core's
   get_write_results_queue is replaced before a save; nvidia-resiliency-ext's copy of it (checkpoint.async_save
   in NGC containers) likewise when importable.
   Test: tests/test_faults.py (the rank that saved is killed: its helper processes are gone within a minute).

5. A resume with another optim.lr / optim.min_lr fails (no upstream report found): 0.19 pairs the saved optimizer's
   param groups with the current ones by an identifier that includes `max_lr` and `min_lr`
   (optimizer.py `param_group_identifier_keys`), so any changed learning rate is `ValueError: Could not find
   parameter group with key (...)` from every rank, although the scheduler is built to take this config's values
   (`override_opt_param_scheduler=True`). Fix: the loaded groups take the current groups' max_lr / min_lr before
   the load (the template never sets a decoupled lr: every group has the same two).
   Test: tests/test_end_to_end.py (a tp2 run resumed with optim.lr changed trains at the new schedule's lr).
"""

from __future__ import annotations

import ctypes
import importlib
import multiprocessing
import os
import signal
import sys
from multiprocessing.managers import SyncManager

import torch

RESULTS_QUEUE_MODULES = ("megatron.core.dist_checkpointing.strategies.filesystem_async",
                         "nvidia_resiliency_ext.checkpointing.async_ckpt.filesystem_async")


def pipeline_p2p_settings(pp: int, vpp: int | None) -> dict:
    """TransformerConfig p2p fields: batched for plain 1F1B, overlapped (unbatched) when interleaved."""
    interleaved = pp > 1 and vpp is not None
    return {"overlap_p2p_comm": interleaved, "batch_p2p_comm": not interleaved}


def mark_expert_params(chunk) -> None:
    """Fix 3: every routed expert's weights are expert weights (allreduce=False), whatever the EP size, and
    none is summed over TP as a sequence-parallel parameter."""
    from megatron.core.transformer.moe.experts import SequentialMLP

    for module in chunk.modules():
        if isinstance(module, SequentialMLP) or type(module).__name__ == "TEGroupedMLP":
            for param in module.parameters():
                param.allreduce = False
                param.sequence_parallel = False


def _torch_adam_distributed_optimizers(optimizer) -> list:
    """Megatron-Core DistributedOptimizers that wrap torch Adam/AdamW, when TE/apex (whose fused Adam
    keeps `step` per param group and has none of these bugs) are absent."""
    from megatron.core.optimizer import distrib_optimizer

    if distrib_optimizer.HAVE_APEX_OR_TE:
        return []
    return [opt for opt in getattr(optimizer, "chained_optimizers", [optimizer])
            if isinstance(opt, distrib_optimizer.DistributedOptimizer)
            and isinstance(getattr(opt, "optimizer", None), torch.optim.Adam)]  # AdamW subclasses Adam


def _copy_state_without_step(dist_opt) -> None:
    """Fix 2b, on this optimizer instance only (idempotent)."""
    if getattr(dist_opt, "_template_step_fix", False):
        return
    original = dist_opt._set_main_param_and_optimizer_states

    def set_states(model_param, tensors):
        group_index, group_order = dist_opt.model_param_group_index_map[model_param]
        state = dist_opt.optimizer.state[dist_opt.optimizer.param_groups[group_index]["params"][group_order]]
        step = state.pop("step", None)
        try:
            original(model_param, tensors)
        finally:
            if step is not None:
                state["step"] = step

    dist_opt._set_main_param_and_optimizer_states = set_states
    dist_opt._template_step_fix = True


def before_optimizer_state_dict(optimizer) -> None:
    """Fixes 2a and 2b, before the optimizer's sharded state dict is built (save or load): an empty
    Adam state (equivalent to none) for parameters without one; the step left out of the state copy."""
    for dist_opt in _torch_adam_distributed_optimizers(optimizer):
        adam = dist_opt.optimizer
        for group in adam.param_groups:
            for param in group["params"]:
                if param not in adam.state:
                    adam.state[param] = {"step": torch.tensor(0.0), "exp_avg": torch.zeros_like(param),
                                         "exp_avg_sq": torch.zeros_like(param)}
        _copy_state_without_step(dist_opt)


def after_optimizer_load(optimizer) -> None:
    """Fix 2c: one `step` tensor per parameter (the load shares a single tensor among all of them)."""
    for dist_opt in _torch_adam_distributed_optimizers(optimizer):
        for state in dist_opt.optimizer.state.values():
            if "step" in state:
                state["step"] = state["step"].clone()


def saved_groups_at_current_lr(optimizer, saved: dict) -> None:
    """Fix 5: every param group in the loaded optimizer state `saved` (any nesting: chained, distributed) takes
    the current optimizer's max_lr / min_lr, so a changed learning rate still pairs the groups."""
    current = {(g["max_lr"], g["min_lr"]) for opt in getattr(optimizer, "chained_optimizers", [optimizer])
               for g in opt.optimizer.param_groups}
    assert len(current) == 1, f"param groups with different learning rates: {sorted(current)}"
    (max_lr, min_lr), = current

    def visit(node) -> None:
        if isinstance(node, dict):
            if isinstance(node.get("max_lr"), float) and "min_lr" in node:  # a param group
                node["max_lr"], node["min_lr"] = max_lr, min_lr
            for value in node.values():
                visit(value)
        elif isinstance(node, (list, tuple)):
            for value in node:
                visit(value)

    visit(saved)


def _die_with(parent: int) -> None:
    """In the Manager's server process, first: SIGKILL when the thread that started it (the rank's) ends."""
    ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGKILL)  # 1: PR_SET_PDEATHSIG
    if os.getppid() != parent:  # the rank died before the prctl
        os._exit(0)


def _queue_getter(module):
    """get_write_results_queue for `module`, as lazy as Megatron-Core's (only ranks with shards to write start a
    Manager), from a Manager that dies with this rank."""
    def get_write_results_queue(mp_mode: str = "spawn"):
        if module._results_queue is None:
            manager = SyncManager(ctx=multiprocessing.get_context(mp_mode))
            manager.start(initializer=_die_with, initargs=(os.getpid(),))
            module._results_queue = manager.Queue()  # its proxy keeps the manager alive
        return module._results_queue

    get_write_results_queue.dies_with_the_rank = True
    return get_write_results_queue


def results_queue_dies_with_the_rank() -> None:
    """Fix 4, before a save (idempotent; Linux only, where prctl exists): each module's get_write_results_queue
    (looked up at call time by its callers) replaced."""
    if not sys.platform.startswith("linux"):
        return
    for name in RESULTS_QUEUE_MODULES:
        try:
            module = importlib.import_module(name)
        except ImportError:
            continue
        current = getattr(module, "get_write_results_queue", None)
        if current is not None and not getattr(current, "dies_with_the_rank", False):
            module.get_write_results_queue = _queue_getter(module)
