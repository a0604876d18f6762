"""One parameter at a time out of a torch_dist checkpoint (any layout it was saved at): the full, unsharded
tensor, for conversions that must not hold the whole model (tools/convert_hf.py export and --check).

The template model is built on the meta device at tp1 / pp1 (shapes only); its sharded state dict names each
parameter's ShardedTensor (or SwiGLU's factory); reading a parameter loads that one entry with Megatron-Core's
dist_checkpointing into a fresh tensor (the checkpoint's shards gathered and cast to the tensor's dtype by DCP).
The checkpoint's integrity manifest is verified on the first read.
"""

from __future__ import annotations

import copy
from pathlib import Path

import torch
from megatron.core import dist_checkpointing

from training.parallel.wrap import unwrap


def meta_model(cfg, shape):
    """This config's model (tp1 / pp1, the config's precision) on the meta device: no memory, no init."""
    from training.engine.build import build

    with torch.device("meta"):
        return build(cfg, shape, torch.device("meta"), init=False, train=False)


class CheckpointReader:
    """reader(name, dtype=None) -> our full parameter `name` from checkpoint `path` (in `dtype`, default the
    meta model's, which is the run's precision: what the checkpoint holds). Parameters saved under one key (the
    experts of a MoE layer: one tensor with an expert axis) are read together, the others kept until asked for
    (at world size 1 Megatron-Core loads such a key only whole)."""

    def __init__(self, cfg, state, path: Path):
        from training.checkpoint import torch_dist

        self.path = path
        self.entries = next(iter(torch_dist.model_state_dict(cfg, state.model).values()))  # {name: sharded entry}
        from training.interop.hf import weights_of

        self.params = weights_of(unwrap(state.model[0]))  # parameters and persistent buffers
        self.groups: dict[str, list[str]] = {}
        for name, entry in self.entries.items():
            if name in self.params:
                self.groups.setdefault(entry.key, []).append(name)
        self.kept: dict[str, torch.Tensor] = {}
        self.verified = False

    def __call__(self, name: str, dtype: torch.dtype | None = None) -> torch.Tensor:
        if name in self.kept:
            return self.kept.pop(name)
        group = {}
        for member in self.groups[self.entries[name].key]:
            entry = copy.copy(self.entries[member])
            entry.data = torch.empty(self.params[member].shape, dtype=dtype or self.params[member].dtype)
            group[member] = entry
        loaded = dist_checkpointing.load(group, str(self.path), validate_access_integrity=False,
                                         verify_integrity=not self.verified)
        self.verified = True
        self.kept.update((member, tensor) for member, tensor in loaded.items() if member != name)
        return loaded[name]


def hf_tensors(cfg, shape, path: Path):
    """(HF name, full tensor) for every weight of checkpoint `path`, read one parameter at a time (the walk of
    models/gpt.py to_hf: a block's tensors at a time), in the dtype the checkpoint holds."""
    from models import gpt as gpt_module
    from training.interop.hf import _hf_errors, _with_family
    from training.interop.hf_config import family

    state = meta_model(cfg, shape)
    reader = CheckpointReader(cfg, state, path)
    config = _with_family(unwrap(state.model[0]).config, family(shape))
    return _hf_errors(gpt_module.to_hf, reader, config, shape)


def param_bytes(cfg, shape) -> int:
    """The bytes the export writes: this model's parameters in the checkpoint's dtype, less the vocab padding."""
    params = list(unwrap(meta_model(cfg, shape).model[0]).parameters())
    padding = (shape.padded_vocab(1) - shape.vocab_size) * shape.hidden_size * (1 + (not shape.tie_embeddings))
    return sum(p.numel() * p.element_size() for p in params) - padding * params[0].element_size()


def return_freed_memory() -> None:
    """Make glibc hand freed tensors back to the system: after a large free it raises its mmap threshold (up
    to 32 MiB), so the next tensors of that size come from the heap, where freed memory stays resident; a fixed
    threshold keeps every tensor above 1 MiB in its own mapping (measured: a streamed check's peak grew ~5 MiB
    a layer without it). A no-op where the C library is not glibc."""
    import ctypes

    try:
        ctypes.CDLL("libc.so.6").mallopt(-3, 1 << 20)  # M_MMAP_THRESHOLD
    except (OSError, AttributeError):
        pass
