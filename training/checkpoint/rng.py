"""The RNG states a checkpoint holds: Python's, NumPy's, torch's (CPU and CUDA) and Megatron-Core's
tensor-parallel tracker. Each format stores them per rank (torch_dist: one object per (pp, tp) rank;
fsdp_dtensor: one per rank) and restores them only when the ranks line up, else the streams restart from
the seed. Callers use `rng.get_state()` through the module, so a test can substitute it."""

from __future__ import annotations

import random

import numpy as np
import torch
from megatron.core import tensor_parallel


def get_state() -> dict:
    return {"random": random.getstate(), "numpy": np.random.get_state(), "torch": torch.get_rng_state(),
            "cuda": torch.cuda.get_rng_state() if torch.cuda.is_available() else None,
            "tracker": tensor_parallel.get_cuda_rng_tracker().get_states()}


def set_state(state: dict) -> None:
    random.setstate(state["random"])
    np.random.set_state(state["numpy"])
    torch.set_rng_state(state["torch"])
    if state["cuda"] is not None and torch.cuda.is_available():
        torch.cuda.set_rng_state(state["cuda"])
    tensor_parallel.get_cuda_rng_tracker().set_states(state["tracker"])
