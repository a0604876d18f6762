"""Megatron-Core's ColumnParallelLinear / RowParallelLinear, with one shortcut: on a single tensor-parallel rank
(tp = 1, so no sequence parallelism) they compute y = x W^T (+ b) through torch's own autograd linear.

There Megatron-Core's path adds nothing but cost: two identity autograd Functions per layer (the copy to and
the reduce from the TP region, which are no-ops at tp = 1) and its Python `LinearWithGradAccumulation...`
Function, whose backward is the same two GEMMs torch runs (and weight-gradient accumulation fusion is off
without apex: training/engine/bridge.py). Measured on CPU, tiny preset: ~7% of a training step. The arithmetic is
the same (matmul, then + bias, as Megatron-Core's forward), so the gradients are too; everything else
(parameters, their TP attributes, init, checkpoints, the tied output weight) is Megatron-Core's class. With
tp > 1 the classes are exactly Megatron-Core's.

A sub-block left out of parallel.tp_blocks (models/tp_blocks.py) is built with a config marked `tp_replicated`:
then both classes give a `ReplicatedLinear` instead, the full weight on every TP rank with no TP attributes and
no communication (the same names, forward and checkpoint keys), so a block written with these two classes can
be split or replicated by the config alone.

All three can carry a LoRA adapter (models/lora.py's Adaptable: `add_lora`, added after the model is built):
their forward then adds scale * B A x, and their sharded state dict splits A and B as they are sharded. A fused
column linear may instead carry one adapter per part (models/lora_split.py: q, k, v; gate, up).
"""

import torch
import torch.nn.functional as F
from megatron.core import tensor_parallel
from megatron.core.transformer.module import MegatronModule

from models.lora import Adaptable, adapters_on
from models.lora_split import sharded_axes, split_delta
from models.tp_blocks import replicated


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


class ReplicatedLinear(Adaptable, MegatronModule):
    """y = x W^T (+ b) with the full W [output_size, input_size] on every TP rank (a replicated sub-block).

    Its parameters have no `tensor_model_parallel` attribute (training/engine/build.py sets Megatron-Core's
    defaults: a TP duplicate) and MegatronModule's default sharded state dict (one global tensor, replicated
    over TP), the key a TP-split layer's shards add up to. Takes the Column/RowParallelLinear arguments."""

    def __init__(self, input_size: int, output_size: int, *, config, init_method, bias: bool = True,
                 skip_bias_add: bool = False, skip_weight_param_allocation: bool = False, **_tp_only):
        super().__init__(config=config)
        self.skip_bias_add, self.input_size, self.output_size = skip_bias_add, input_size, output_size
        self.weight = None
        if not skip_weight_param_allocation:  # a tied output layer reads the embedding's weight in forward
            self.weight = torch.nn.Parameter(torch.empty(output_size, input_size, dtype=config.params_dtype))
            if config.perform_initialization:  # training/engine/init.py records this call and draws by name
                init_method(self.weight)
        self.bias = torch.nn.Parameter(torch.zeros(output_size, dtype=config.params_dtype)) if bias else None

    def get_extra_state(self) -> None:  # as Megatron-Core's TP layers: an (empty) `_extra_state` checkpoint key
        return None

    def set_extra_state(self, state) -> None:
        pass

    def forward(self, input_, weight=None, runtime_gather_output=None):  # [s, b, in] -> [s, b, out]
        return _adapted(self, input_, _linear(input_, self.weight if weight is None else weight, self.bias,
                                              self.skip_bias_add))


def _adapted(layer, input_, result):
    """The base layer's (output, bias) plus the LoRA adapter's share, if the layer carries one (fused, or one per
    part of a fused linear: models/lora_split.py)."""
    if not adapters_on():  # models.lora.adapters_off(): the base alone
        return result
    if layer.has_lora:
        return result[0] + layer.lora_delta(input_), result[1]
    if getattr(layer, "lora_split", None) is not None:
        return result[0] + split_delta(layer, input_), result[1]
    return result


class ColumnParallelLinear(Adaptable, tensor_parallel.ColumnParallelLinear):
    lora_kind = "column"

    def __new__(cls, *args, config, **kwargs):  # a replicated sub-block's: the full layer (no __init__ after)
        return ReplicatedLinear(*args, config=config, **kwargs) if replicated(config) else super().__new__(cls)

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self._tp1 = _plain(self)

    def forward(self, input_, weight=None, runtime_gather_output=None):  # [s, b, h] -> [s, b, out/tp]
        if not self._tp1:
            return _adapted(self, input_, super().forward(input_, weight, runtime_gather_output))
        return _adapted(self, input_, _linear(input_, self.weight if weight is None else weight, self.bias,
                                              self.skip_bias_add))

    def sharded_state_dict(self, prefix="", sharded_offsets=(), metadata=None):  # W, b and B's split on dim 0
        return self.adapted_sharded_state_dict(prefix, sharded_offsets, metadata,
                                               {"weight": 0, "bias": 0, **sharded_axes(self)})


class RowParallelLinear(Adaptable, tensor_parallel.RowParallelLinear):
    lora_kind = "row"

    def __new__(cls, *args, config, **kwargs):
        return ReplicatedLinear(*args, config=config, **kwargs) if replicated(config) else super().__new__(cls)

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self._tp1 = _plain(self)

    def forward(self, input_):  # [s, b, in/tp] -> [s, b, h]
        if not self._tp1:
            return _adapted(self, input_, super().forward(input_))
        return _adapted(self, input_, _linear(input_, self.weight, self.bias, self.skip_bias_add))

    def sharded_state_dict(self, prefix="", sharded_offsets=(), metadata=None):  # W and A split on dim 1
        return self.adapted_sharded_state_dict(prefix, sharded_offsets, metadata, {"weight": 1})
