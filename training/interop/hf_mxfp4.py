"""MXFP4, the format gpt-oss's published checkpoints store their experts in, dequantized on import.

OCP Microscaling (MX) FP4: values in blocks of 32 that share one scale. Per block, 16 bytes hold 32 FP4 (E2M1)
values, two a byte, the low nibble first (element 2i in bits 0-3 of byte i, element 2i + 1 in bits 4-7); each
nibble is sign (bit 3), two exponent bits and one mantissa bit:

    nibble & 7   0    1    2    3    4    5    6    7          nibble & 8: negative
    value        0    0.5  1    1.5  2    3    4    6

The block's scale is one E8M0 byte: 2 ** (byte - 127). A gpt-oss checkpoint keeps a projection `P` of the experts
as `P_blocks` uint8 [E, rows, G, 16] and `P_scales` uint8 [E, rows, G], rows being the output features and G * 32
the input features; its bf16 form (what transformers builds, and what a bf16 checkpoint stores under `P`) is
[E, G * 32, rows] (x @ W). This follows transformers' integrations/mxfp4.py `convert_moe_packed_tensors` (its
oracle in tests/test_mxfp4.py) with the same arithmetic in the target dtype (table lookup, then ldexp), so the
result is bit-identical; one expert at a time, so the temporaries are one expert's (the result is the only full-size
tensor: gpt-oss-120b's largest, a layer's gate_up_proj, 4.2 GB in bf16).
"""

from __future__ import annotations

import torch

VALUES = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0)  # by nibble
BIAS = 127  # E8M0: the scale is 2 ** (byte - 127)
SUFFIXES = ("_blocks", "_scales")


def dequantize(blocks: torch.Tensor, scales: torch.Tensor, dtype: torch.dtype = torch.bfloat16) -> torch.Tensor:
    """blocks uint8 [E, rows, G, 16], scales uint8 [E, rows, G] -> [E, G * 32, rows] in `dtype`."""
    experts, rows, groups, width = blocks.shape
    if scales.shape != blocks.shape[:-1] or width != 16:
        raise ValueError(f"MXFP4 blocks {tuple(blocks.shape)} and scales {tuple(scales.shape)} do not pair "
                         f"(blocks [E, rows, G, 16], scales [E, rows, G])")
    table = torch.tensor(VALUES, dtype=dtype)
    out = torch.empty(experts, groups * 32, rows, dtype=dtype)
    for e in range(experts):
        packed = blocks[e].to(torch.uint8).reshape(rows * groups, 16)  # [rows * G, 16]
        values = torch.empty(rows * groups, 32, dtype=dtype)  # [rows * G, 32]
        values[:, 0::2] = table[(packed & 0x0F).long()]  # the low nibble first
        values[:, 1::2] = table[(packed >> 4).long()]
        exponent = scales[e].to(torch.int32).reshape(rows * groups, 1) - BIAS  # [rows * G, 1]
        torch.ldexp(values, exponent, out=values)
        out[e] = values.reshape(rows, groups * 32).t()  # [rows, G * 32] -> [G * 32, rows]
    return out


def dequantized_shape(blocks_shape: list[int]) -> list[int]:
    """The bf16 tensor's shape [E, G * 32, rows] from the blocks' [E, rows, G, 16]."""
    experts, rows, groups, _ = blocks_shape
    return [experts, groups * 32, rows]
