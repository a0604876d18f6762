"""Workarounds for Megatron-Core 0.19.2 bugs that are not CPU-specific (they also hit GPUs), each named
after the upstream report and covered by a test.

1. Interleaved pipeline + batched p2p (Megatron-LM issues #750 / #1450): with a virtual pipeline
   (`vpp`) at PP=2, `batch_p2p_comm=True` exchanges the wrong tensors between the two ranks and the
   gradients come out silently wrong. Megatron-LM itself defaults interleaving to
   `overlap_p2p_comm=True, batch_p2p_comm=False`; we always do the same.
   Test: tests/test_model_parallel_equivalence.py (the pp2-vpp2 case compares every gradient).
"""

from __future__ import annotations


def pipeline_p2p_settings(pp: int, vpp: int | None) -> dict:
    """TransformerConfig p2p fields: batched for plain 1F1B, overlapped (unbatched) when interleaved."""
    interleaved = pp > 1 and vpp is not None
    return {"overlap_p2p_comm": interleaved, "batch_p2p_comm": not interleaved}


def before_optimizer_load(optimizer) -> None:
    """Hook run before a checkpoint's optimizer state is loaded (see the fixes listed above)."""


def after_optimizer_load(optimizer) -> None:
    """Hook run after a checkpoint's optimizer state is loaded (see the fixes listed above)."""
