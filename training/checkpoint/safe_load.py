"""Loading a checkpoint runs no code from it.

A dist_checkpointing checkpoint holds pickles in two places: the `.metadata` file (torch DCP's index of the
shards: `pickle.load`), and every non-tensor object (our RNG states, the optimizer's param groups, the
scheduler, the iteration: DCP's planner reads them with `torch.load(weights_only=False)`). A crafted pickle
runs whatever it names when unpickled, so a checkpoint from elsewhere could run code as the training job.
Inside `safe_unpickling()` (every checkpoint load goes through it: common.loading) both go through restricted
unpicklers: the index may name only DCP's own metadata classes and torch's dtypes and sizes, the objects only what
`torch.load(weights_only=True)` accepts (tensors, numbers, strings, containers, numpy arrays). Anything else
is refused with UnsafeCheckpoint, before it runs. Tensors are raw bytes (never unpickled). run.json is JSON.
"""

from __future__ import annotations

import contextlib
import pickle
import types

import torch

# What DCP's .metadata pickle may name: its own dataclasses, and torch's dtype / Size / layout helpers.
_INDEX_MODULES = ("torch.distributed.checkpoint.metadata", "torch.distributed.checkpoint.planner")
_INDEX_NAMES = {("torch.distributed.checkpoint.filesystem", "_StorageInfo"), ("torch", "Size"),
                ("torch.serialization", "_get_layout"), ("collections", "OrderedDict"),
                ("pathlib", "PosixPath")}  # DCP's own saves record the directory (checkpoint_id) as a path


class UnsafeCheckpoint(pickle.UnpicklingError):
    pass


class _IndexUnpickler(pickle.Unpickler):
    def find_class(self, module, name):
        allowed = module in _INDEX_MODULES or (module, name) in _INDEX_NAMES or \
            (module == "torch" and isinstance(getattr(torch, name, None), torch.dtype))
        if not allowed:
            raise UnsafeCheckpoint(f"the checkpoint's index (.metadata) names {module}.{name}, which is not part "
                                   f"of a checkpoint index: refused (unpickling it could run code)")
        return super().find_class(module, name)


class _SafePickle(types.ModuleType):
    """`pickle` as torch DCP's filesystem reader sees it here: load() restricted to the index's classes."""

    def __init__(self):
        super().__init__("pickle (checkpoint index only)")

    @staticmethod
    def load(file, *args, **kwargs):
        return _IndexUnpickler(file).load()

    def __getattr__(self, name):
        return getattr(pickle, name)


class _WeightsOnlyTorch(types.ModuleType):
    """`torch` as torch DCP's load planner sees it here: load() always weights_only."""

    def __init__(self):
        super().__init__("torch (weights_only loads)")

    @staticmethod
    def load(file, *args, weights_only=None, **kwargs):
        try:
            return torch.load(file, *args, weights_only=True, **kwargs)
        except pickle.UnpicklingError as err:
            raise UnsafeCheckpoint(f"the checkpoint holds a pickled object that is not plain data (tensors, "
                                   f"numbers, strings, containers): refused, since unpickling it could run "
                                   f"code ({str(err).splitlines()[0]})") from err

    def __getattr__(self, name):
        return getattr(torch, name)


@contextlib.contextmanager
def safe_unpickling():
    from torch.distributed.checkpoint import default_planner, filesystem

    saved = default_planner.torch, filesystem.pickle
    default_planner.torch, filesystem.pickle = _WeightsOnlyTorch(), _SafePickle()
    try:
        yield
    finally:
        default_planner.torch, filesystem.pickle = saved
