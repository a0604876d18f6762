"""Megatron-Core on CPU: the one place that makes megatron-core run without CUDA (gloo backend).

Megatron-Core assumes CUDA. On a machine without a GPU, `apply()` (called by `training.parallel.dist` before any
Megatron-Core object is built, and only when `torch.cuda.is_available()` is False) installs the patches
below. Each patch is named, says why it exists, and has a gloo test in tests/test_cpu_compat.py. They are
pinned to one megatron-core release: another version is refused, because the call sites are version-specific.

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

What this module does not cover (not reached by a training step on CPU): TE/apex kernels, CUDA graphs,
`torch.autocast("cuda")` (keep `enable_autocast` off), torch FSDP2, inference, the grad scaler (fp16 only; we
train fp32/bf16). The torch.compile'd fusions need no patch (model.fused_kernels=true runs on CPU, tested).
"""

from __future__ import annotations

import contextlib
import importlib.abc
import importlib.machinery
import sys
import types

import torch

from training.errors import LaunchError

SUPPORTED_MCORE_VERSION = "0.19.2"
_CPU = torch.device("cpu")
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
            f"{SUPPORTED_MCORE_VERSION} (training/shims/cpu_compat.py patches version-specific call sites): "
            f"run `make setup` or `pip install megatron-core=={SUPPORTED_MCORE_VERSION}`"
        )


# --- patch 1: the `torch` name inside megatron.core modules -----------------------------------------------


class _NoOpStream:
    """Stands in for torch.cuda.Stream / Event: host-synchronous gloo needs no ordering between streams."""

    def __init__(self, *args, **kwargs):
        pass

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return False

    def wait_stream(self, *args, **kwargs):
        pass

    def wait_event(self, *args, **kwargs):
        pass

    def record_event(self, *args, **kwargs):
        return _NoOpStream()

    def record(self, *args, **kwargs):
        pass

    def wait(self, *args, **kwargs):
        pass

    def synchronize(self):
        pass

    def query(self):
        return True


def _to_cpu_device(device):
    """Map any CUDA device spelling (str, int index, torch.device) to cpu; leave others alone."""
    if device is None:
        return None
    if isinstance(device, int) or (isinstance(device, str) and device.startswith("cuda")):
        return _CPU
    if isinstance(device, torch.device) and device.type == "cuda":
        return _CPU
    return device


def _cpu_factory(fn):
    def factory(*args, **kwargs):
        if "device" in kwargs:
            kwargs["device"] = _to_cpu_device(kwargs["device"])
        kwargs.pop("pin_memory", None)  # page-locked memory needs CUDA (rope_utils.py:62, context parallel)
        return fn(*args, **kwargs)

    factory.__name__ = fn.__name__
    factory.__doc__ = f"{fn.__name__} with CUDA devices mapped to cpu (training/shims/cpu_compat.py, patch 1)"
    return factory


def _get_rng_state(device=None):
    return torch.get_rng_state()


def _set_rng_state(new_state, device=None):
    torch.set_rng_state(new_state)


class _CudaRandomOnCpu(types.ModuleType):
    get_rng_state = staticmethod(_get_rng_state)
    set_rng_state = staticmethod(_set_rng_state)

    def __init__(self):
        super().__init__("torch.cuda.random (cpu)")

    def __getattr__(self, name):
        return getattr(torch.cuda.random, name)


class _CudaOnCpu(types.ModuleType):
    """`torch.cuda` as megatron.core sees it on a CPU-only machine."""

    Stream = _NoOpStream
    Event = _NoOpStream

    def __init__(self):
        super().__init__("torch.cuda (cpu)")
        self.random = _CudaRandomOnCpu()
        self.default_generators = (torch.default_generator,)

    @staticmethod
    def current_device():
        return _CPU

    @staticmethod
    def synchronize(device=None):
        pass

    @staticmethod
    def current_stream(device=None):
        return _NoOpStream()

    default_stream = current_stream

    @staticmethod
    def stream(stream):
        return contextlib.nullcontext()

    @staticmethod
    def empty_cache():
        pass

    get_rng_state = staticmethod(_get_rng_state)
    set_rng_state = staticmethod(_set_rng_state)

    @staticmethod
    def manual_seed(seed):
        torch.manual_seed(seed)

    def __getattr__(self, name):
        return getattr(torch.cuda, name)


_FACTORIES = (
    "tensor", "zeros", "ones", "empty", "full", "arange", "rand", "randn", "randint",
    "zeros_like", "ones_like", "empty_like", "full_like", "as_tensor", "eye", "linspace",
)


class _DeviceOnCpu(type):
    """`torch.device` as megatron.core sees it (patch 7): a CUDA spelling ("cuda", "cuda:0", and the
    f"cuda:{torch.cuda.current_device()}" that reads "cuda:cpu" here) builds the CPU device; isinstance
    checks still see torch.device."""

    def __call__(cls, *args, **kwargs):
        if args and isinstance(args[0], str) and args[0].startswith("cuda"):
            return _CPU
        return torch.device(*args, **kwargs)

    def __instancecheck__(cls, instance):
        return isinstance(instance, torch.device)


class _Device(metaclass=_DeviceOnCpu):
    pass


class _DeviceMeshOnCpu:
    """torch's DeviceMesh for megatron.core's FSDP adapter (patch 7): its hard-coded device_type="cuda"
    becomes "cpu", so the mesh's groups are the gloo ones."""

    def __getattr__(self, name):
        return getattr(torch.distributed.DeviceMesh, name)

    @staticmethod
    def from_group(*args, device_type: str = "cuda", **kwargs):
        return torch.distributed.DeviceMesh.from_group(*args, device_type="cpu", **kwargs)

    def __call__(self, device_type, *args, **kwargs):
        return torch.distributed.DeviceMesh("cpu" if device_type == "cuda" else device_type, *args, **kwargs)


class _TorchOnCpu(types.ModuleType):
    """`torch` as megatron.core modules see it: torch itself, but CUDA placement resolves to the CPU."""

    def __init__(self):
        super().__init__("torch (megatron-core on cpu)")
        self.cuda = _CudaOnCpu()
        self.device = _Device
        for name in _FACTORIES:
            setattr(self, name, _cpu_factory(getattr(torch, name)))

    def __getattr__(self, name):
        return getattr(torch, name)


_TORCH_ON_CPU: _TorchOnCpu | None = None


def _bind_cpu_torch(module: types.ModuleType) -> None:
    if module.__dict__.get("torch") is torch:
        module.torch = _TORCH_ON_CPU


class _McoreImportHook(importlib.abc.MetaPathFinder):
    """Binds the CPU `torch` into megatron.core modules imported after apply() (lazy imports)."""

    def find_spec(self, fullname, path, target=None):
        if not fullname.startswith("megatron.core"):
            return None
        spec = importlib.machinery.PathFinder.find_spec(fullname, path)
        if spec is None or spec.loader is None or not hasattr(spec.loader, "exec_module"):
            return spec
        exec_module = spec.loader.exec_module

        def exec_and_bind(module, _exec=exec_module):
            _exec(module)
            _bind_cpu_torch(module)

        spec.loader.exec_module = exec_and_bind
        return spec


# --- patches 3 and 4: caller-scoped Tensor methods --------------------------------------------------------


def _caller_module(depth: int = 2) -> str:
    return sys._getframe(depth).f_globals.get("__name__", "")


_torch_tensor_type = torch.Tensor.type
_torch_tensor_cuda = torch.Tensor.cuda


def _tensor_type(self, dtype=None, non_blocking=False, **kwargs):
    if dtype is None and not kwargs and self.device.type == "cpu":
        if _caller_module().startswith("megatron.core.optimizer"):
            return _torch_tensor_type(self).replace("torch.", "torch.cuda.", 1)
        return _torch_tensor_type(self)
    return _torch_tensor_type(self, dtype, non_blocking, **kwargs)


def _tensor_cuda(self, *args, **kwargs):
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
    def reduce_scatter_along_first_dim(input_, group, input_split_sizes=None, use_global_buffer=False):
        if input_split_sizes is None or group.size() == 1:
            return original(input_, group, input_split_sizes, use_global_buffer)
        sizes = [int(n) for n in input_split_sizes]
        total = input_.contiguous().clone()  # [sum rows, ...]
        torch.distributed.all_reduce(total, group=group)
        start = sum(sizes[: group.rank()])
        return total[start: start + sizes[group.rank()]].contiguous()  # this rank's [rows, ...]

    return reduce_scatter_along_first_dim


# --- apply ------------------------------------------------------------------------------------------------


def _set_rng_state_on_cpu(new_state, device=-1, graph_safe=False):
    """Replacement for tensor_parallel.random._set_cuda_rng_state (patch 2)."""
    torch.set_rng_state(new_state)


def apply() -> bool:
    """Install the patches if CUDA is unavailable. Idempotent. Returns True when patches are active."""
    global _applied, _TORCH_ON_CPU
    check_mcore_version()
    if torch.cuda.is_available():
        return False
    if _applied:
        return True
    _TORCH_ON_CPU = _TorchOnCpu()
    sys.meta_path.insert(0, _McoreImportHook())
    import megatron.core.tensor_parallel.mappings as mappings  # (imports after the hook)
    import megatron.core.tensor_parallel.random as mcore_random
    import megatron.core.transformer.moe.token_dispatcher as token_dispatcher

    for name, module in list(sys.modules.items()):
        if name.startswith("megatron.core") and module is not None:
            _bind_cpu_torch(module)
    mcore_random._set_cuda_rng_state = _set_rng_state_on_cpu
    token_dispatcher.maybe_move_tensor_to_cpu = _move_tensor_to_cpu
    mappings._gather_along_first_dim = _uneven_gather(mappings._gather_along_first_dim)
    mappings._reduce_scatter_along_first_dim = _uneven_reduce_scatter(mappings._reduce_scatter_along_first_dim)
    torch.Tensor.type = _tensor_type
    torch.Tensor.cuda = _tensor_cuda
    with contextlib.suppress(ImportError):  # Megatron-FSDP (parallel.fsdp); its adapter imports einops
        import megatron.core.distributed.fsdp.mcore_fsdp_adapter as fsdp_adapter

        fsdp_adapter.DeviceMesh = _DeviceMeshOnCpu()
        from megatron.core.distributed.fsdp.src.megatron_fsdp.param_and_grad_buffer import AllGatherPipeline

        gather = AllGatherPipeline.all_gather_params  # patch 8: synchronous
        AllGatherPipeline.all_gather_params = lambda self, *a, **k: gather(self, *a, **k, async_param_gather=False)
    _applied = True
    return True
