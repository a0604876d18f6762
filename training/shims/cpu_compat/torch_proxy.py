"""Patches 1 and 7 of training.shims.cpu_compat: the `torch` name inside megatron.core modules.

Every `megatron.core.*` module that imported `torch` gets that name rebound to `_TorchOnCpu`, a proxy that
forwards everything to torch except CUDA placement: `torch.cuda.current_device()` is the CPU, streams/events/
synchronize are no-ops, tensor factories map `device="cuda"` to cpu and drop `pin_memory`, the CUDA RNG API is
the CPU generator, and `torch.device` maps CUDA spellings to the CPU (patch 7). `DeviceMeshOnCpu` is the other
half of patch 7 (Megatron-FSDP's adapter). Nothing here changes torch itself; see the package docstring for the
call sites and the reasons.
"""

from __future__ import annotations

import contextlib
import importlib.abc
import importlib.machinery
import sys
import types

import torch

_CPU = torch.device("cpu")


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
    factory.__doc__ = f"{fn.__name__} with CUDA devices mapped to cpu (training/shims/cpu_compat, patch 1)"
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


class DeviceMeshOnCpu:
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


def bind_cpu_torch(module: types.ModuleType) -> None:
    """Rebind `module.torch` to the proxy if the module imported torch itself (install_import_hook first)."""
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
            bind_cpu_torch(module)

        spec.loader.exec_module = exec_and_bind
        return spec


def install_import_hook() -> None:
    """Create the proxy and bind it into every megatron.core module imported from now on (once per process)."""
    global _TORCH_ON_CPU
    _TORCH_ON_CPU = _TorchOnCpu()
    sys.meta_path.insert(0, _McoreImportHook())
