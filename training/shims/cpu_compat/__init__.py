"""Megatron-Core on CPU: the one place that makes megatron-core run without CUDA (gloo backend).

Megatron-Core assumes CUDA. On a machine without a GPU, `apply()` (called by `training.parallel.dist` before any
Megatron-Core object is built, and only when `torch.cuda.is_available()` is False) installs the eight patches
below. Each patch is named, says why it exists, and has a gloo test in tests/test_cpu_compat.py. They are
pinned to one megatron-core release: another version is refused, because the call sites are version-specific.
This package: `__init__` (version pin, `apply`), `torch_proxy` (patches 1 and 7: the `torch` that megatron.core
modules see), `call_sites` (patches 2-6 and 8: single functions and methods replaced where they are called).

The patches, narrowest first:

1. `torch` as seen from megatron.core modules (`_TorchOnCpu`). Megatron-Core allocates on
   `torch.cuda.current_device()` (~200 sites: grad buffers, SP buffers, p2p shapes, schedules), passes
   `device="cuda"` literally (schedules.py 749/1121/2292, optimizer.py 315/698/702/1249, clip_grads.py
   108/112/180, utils.py 1332, transformer/utils.py 39), calls `torch.cuda.synchronize()` after batched p2p
   and in the checkpoint writer, and uses CUDA streams/events in DDP's grad sync (0.19.x
   `_ParamAndGradBucketGroup.start_grad_sync` calls `torch.cuda.current_stream()` unconditionally). Instead
   of changing torch globally, every `megatron.core.*` module gets its own `torch` name bound to a proxy
   that forwards everything to torch except: `torch.cuda.current_device()` -> cpu, streams/events/
   synchronize -> no-ops (gloo collectives are synchronous w.r.t. the host), `device="cuda"` in tensor
   factories -> cpu (and `pin_memory=True` dropped: rope_utils.py:62 pins the context-parallel RoPE
   index), and the CUDA RNG API -> the CPU generator (so `model_parallel_cuda_manual_seed`,
   `get_cuda_rng_tracker().fork()` and `tensor_parallel.checkpoint` give distinct TP streams and exact
   dropout replay). An import hook binds the proxy in modules imported later too.
2. `tensor_parallel.random._set_cuda_rng_state` goes through `torch.cuda._lazy_call`, which on a machine
   without CUDA queues the call forever: the tracker's fork() would silently never switch streams. It is
   replaced by `torch.set_rng_state` in that module.
3. Caller-scoped `Tensor.type()`: the optimizer dispatches on `param.type() == 'torch.cuda.FloatTensor'`
   (distrib_optimizer.py 401/466/758, optimizer.py 1009/1028, clip_grads.py 174 every clipped step). For
   callers in `megatron.core.optimizer` only, a CPU tensor reports its CUDA type name. Everyone else sees
   torch's answer.
4. Caller-scoped `Tensor.cuda()`: tied embeddings across pipeline stages call `weight.data.cuda()`
   (language_module.py 307) and the optimizer state reload calls `.cuda()`; for callers in `megatron.core`
   on a CPU-only machine `.cuda()` returns the tensor itself.
5. MoE's alltoall dispatcher: `moe_utils.maybe_move_tensor_to_cpu` (bound in token_dispatcher.py) turns
   only CUDA tensors into the numpy split sizes `all_to_all_single` takes; on CPU they stay tensors and
   the collective raises `TypeError: incompatible function arguments`. Replaced in token_dispatcher's
   namespace by one that also converts CPU tensors.
6. Uneven first-dimension gathers: with expert TP > 1 the alltoall dispatcher gathers and reduce-scatters
   token blocks of different sizes per rank (mappings.py `_gather_along_first_dim` /
   `_reduce_scatter_along_first_dim` with split sizes), which gloo refuses (`invalid tensor size`). In
   mappings' namespace, those calls pad to the largest block and all-gather, or all-reduce and slice;
   calls without split sizes are Megatron-Core's own.
7. Megatron-FSDP (parallel.fsdp) builds `torch.device(f"cuda:{torch.cuda.current_device()}")` (megatron_fsdp.py
   232-234, which reads "cuda:cpu" here) and its adapter makes `DeviceMesh.from_group(..., device_type="cuda")`
   (mcore_fsdp_adapter.py 407-449): megatron.core's `torch.device` maps CUDA spellings to the CPU (isinstance
   still sees torch.device), and the adapter's DeviceMesh is built on "cpu".
8. Megatron-FSDP's ZeRO-3 parameter all-gathers are asynchronous (`AllGatherPipeline.all_gather_params`,
   coalesced, waited later) and it frees and refills bucket storage as CUDA's stream-ordered allocator allows;
   gloo runs them on its own thread, which then wrote into freed memory: SIGSEGV / "malloc(): unaligned tcache
   chunk" in the pre-backward unshard, in ~1 of 6 ZeRO-3 DP2 runs. They run synchronously here.

What this package does not cover (not reached by a training step on CPU): TE/apex kernels, CUDA graphs,
`torch.autocast("cuda")` (keep `enable_autocast` off), torch FSDP2, inference, the grad scaler (fp16 only; we
train fp32/bf16). The torch.compile'd fusions need no patch (model.fused_kernels=true runs on CPU, tested).
"""

from __future__ import annotations

import contextlib
import sys

import torch

from training.errors import LaunchError
from training.shims.cpu_compat import call_sites, torch_proxy

SUPPORTED_MCORE_VERSION = "0.19.2"
_applied = False


class McoreVersionError(LaunchError):
    """The installed megatron-core is not the release these patches were written and tested against."""


def check_mcore_version(installed: str | None = None) -> None:
    """Refuse any megatron-core other than the pinned release, in one line."""
    if installed is None:
        from importlib.metadata import PackageNotFoundError, version

        try:
            installed = version("megatron-core")
        except PackageNotFoundError:
            installed = "not installed"
    if installed != SUPPORTED_MCORE_VERSION:
        raise McoreVersionError(
            f"megatron-core {installed} found, but this template is pinned to megatron-core=="
            f"{SUPPORTED_MCORE_VERSION} (training/shims/cpu_compat patches version-specific call sites): "
            f"run `make setup` or `pip install megatron-core=={SUPPORTED_MCORE_VERSION}`"
        )


def apply() -> bool:
    """Install the patches if CUDA is unavailable. Idempotent. Returns True when patches are active."""
    global _applied
    check_mcore_version()
    if torch.cuda.is_available():
        return False
    if _applied:
        return True
    torch_proxy.install_import_hook()  # patch 1, for megatron.core modules imported from here on
    import megatron.core.tensor_parallel.mappings as mappings  # (imports after the hook)
    import megatron.core.tensor_parallel.random as mcore_random
    import megatron.core.transformer.moe.token_dispatcher as token_dispatcher

    for name, module in list(sys.modules.items()):  # patch 1, for those imported before
        if name.startswith("megatron.core") and module is not None:
            torch_proxy.bind_cpu_torch(module)
    mcore_random._set_cuda_rng_state = call_sites._set_rng_state_on_cpu  # patch 2
    torch.Tensor.type = call_sites._tensor_type  # patch 3
    torch.Tensor.cuda = call_sites._tensor_cuda  # patch 4
    token_dispatcher.maybe_move_tensor_to_cpu = call_sites._move_tensor_to_cpu  # patch 5
    mappings._gather_along_first_dim = call_sites._uneven_gather(mappings._gather_along_first_dim)  # patch 6
    mappings._reduce_scatter_along_first_dim = call_sites._uneven_reduce_scatter(
        mappings._reduce_scatter_along_first_dim
    )
    with contextlib.suppress(ImportError):  # Megatron-FSDP (parallel.fsdp); its adapter imports einops
        import megatron.core.distributed.fsdp.mcore_fsdp_adapter as fsdp_adapter

        fsdp_adapter.DeviceMesh = torch_proxy.DeviceMeshOnCpu()  # patch 7 (the torch.device half is in patch 1)
        from megatron.core.distributed.fsdp.src.megatron_fsdp.param_and_grad_buffer import AllGatherPipeline

        call_sites.synchronous_param_gather(AllGatherPipeline)  # patch 8
    _applied = True
    return True
