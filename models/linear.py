"""Megatron-Core's ColumnParallelLinear / RowParallelLinear, with one shortcut: on a single tensor-parallel rank
(tp = 1, so no sequence parallelism) they compute y = x W^T (+ b) through torch's own autograd linear.

There Megatron-Core's path adds nothing but cost: two identity autograd Functions per layer (the copy to and
the reduce from the TP region, which are no-ops at tp = 1) and its Python `LinearWithGradAccumulation...`
Function, whose backward is the same two GEMMs torch runs (and weight-gradient accumulation fusion is off
without apex: training/engine/bridge.py). Measured on CPU, tiny preset: ~7% of a training step. The arithmetic is
the same (matmul, then + bias, as Megatron-Core's forward), so the gradients are too; everything else
(parameters, their TP attributes, init, checkpoints, the tied output weight) is Megatron-Core's class. With
tp > 1 the classes are exactly Megatron-Core's.
"""

import torch
import torch.nn.functional as F
from megatron.core import tensor_parallel


def _plain(layer) -> bool:
    """True where Megatron-Core's forward would reduce to a plain linear."""
    c = layer.config
    return (c.tensor_model_parallel_size == 1 and not layer.sequence_parallel
            and not layer.gradient_accumulation_fusion and not c.defer_embedding_wgrad_compute
            and c._cpu_offloading_context is None and getattr(layer, "gtp_remat_size", 1) == 1
            and not layer.explicit_expert_comm)


def _linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, skip_bias_add: bool):
    out = F.linear(x, weight)  # [..., out]: Megatron-Core's matmul(x, W^T)
    if bias is not None and not skip_bias_add:
        out = out + bias
    return out, bias if skip_bias_add else None


class ColumnParallelLinear(tensor_parallel.ColumnParallelLinear):
    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self._tp1 = _plain(self)

    def forward(self, input_, weight=None, runtime_gather_output=None):  # [s, b, h] -> [s, b, out/tp]
        if not self._tp1:
            return super().forward(input_, weight, runtime_gather_output)
        return _linear(input_, self.weight if weight is None else weight, self.bias, self.skip_bias_add)


class RowParallelLinear(tensor_parallel.RowParallelLinear):
    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self._tp1 = _plain(self)

    def forward(self, input_):  # [s, b, in/tp] -> [s, b, h]
        if not self._tp1:
            return super().forward(input_)
        return _linear(input_, self.weight, self.bias, self.skip_bias_add)
