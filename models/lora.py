"""LoRA on the model's linears: y = base(x) + (alpha / r) * B A dropout(x), the base weight frozen, A [r, in]
drawn as Hugging Face PEFT draws it (kaiming-uniform, a = sqrt(5)), B [out, r] zero, so training starts from the
base model exactly.

The seam: models/linear.py's three linears (Column/RowParallelLinear, and the ReplicatedLinear of a block left
out of parallel.tp_blocks) are `Adaptable`; `add_adapters(module, targets, ...)` gives every such linear whose
module name is a target (linear_qkv, linear_proj, linear_fc1, linear_fc2, or a custom block's own names) its
`lora_a` / `lora_b` parameters, after the model is built. A block built from those linears gets LoRA without
code of its own, and the base's parameter names and checkpoint keys do not change. (Canonical LoRA, an adapter
per part of a fused linear, q / k / v or gate / up: models/lora_split.py.)

Design: torchtitan's components/lora.py converts linears in place after the model is built (no wrapper module,
the same names) and leaves TP to DTensor; Megatron-Bridge's ParallelLinearAdapter wraps each linear in an
adapter module whose linear_in / linear_out are Megatron-Core parallel layers, placed by the base's input_is_
parallel. We take torchtitan's in-place conversion (no new module level in names or checkpoints, a custom block
needs nothing) and Megatron-Bridge's sharding, written as explicit Megatron-Core mappings on the small rank-r
activation h = A x (the only tensor that crosses ranks):

    column base W [out/tp, in]:  A [r, in] replicated, B [out/tp, r] split like W (with W's stride: SwiGLU's
        gate|up).  h = A x, then copy-to-TP (backward: all-reduce dL/dh, partial on each rank since B is split),
        so A's gradient is whole and the same on every TP rank. SP: h = A x_local is gathered along the sequence
        (backward: reduce-scatter), A's gradient is summed over TP by finalize_model_grads (sequence_parallel).
    row base W [out, in/tp]:  A [r, in/tp] split like W, B [out, r] replicated.  h = A x_local is a partial
        sum: all-reduced (reduce-from-TP), or with SP reduce-scattered along the sequence (B's gradient then summed
        over TP by finalize_model_grads, sequence_parallel), then y = B h matches the base's output.

An expert's linears (models/moe.py) take the same shards over the expert-TP group, but the token dispatcher does
their communication (it gathers the tokens over expert TP before fc1 and sums fc2's partial outputs after): so
x before a column adapter is already whole, and a row adapter's B h_partial is summed with the base's partial
output. Nothing crosses ranks in forward; in backward the factor replicated over expert TP (a column's A, a
row's B) gets its partial gradients summed over expert TP (copy-to-TP on the parameter: identity forward,
all-reduce backward), while the input's gradient stays partial, as the dispatcher expects. The adapters carry
the weight's `allreduce` marking (False for experts): DDP reduces them over the expert-data-parallel group.

Each communication moves r features per token (the base moves h or out). Dropout on the adapter's input takes
the default RNG stream where the input is the same on every TP rank, the tensor-parallel stream where each rank
holds its own piece (row inputs, SP column inputs), as Megatron-Core's dropouts do; an expert's column input (the
same tokens on every expert-TP rank) the data-parallel stream, since under SP the layers run in the TP stream.
"""

from __future__ import annotations

import math
from contextlib import contextmanager

import torch
import torch.nn.functional as F
from megatron.core import tensor_parallel
from megatron.core.transformer.mlp import apply_swiglu_sharded_factory
from megatron.core.transformer.utils import ensure_metadata_has_dp_cp_group, make_sharded_tensors_for_checkpoint

LORA_PARAMS = ("lora_a", "lora_b")  # the adapter's parameter names on an adapted linear
_OFF = [False]  # adapters_off(): every adapted linear computes its base alone


@contextmanager
def adapters_off():
    """Within: every adapter is left out (the base model, e.g. a preference run's reference); not thread-local."""
    _OFF[0] = True
    try:
        yield
    finally:
        _OFF[0] = False


def adapters_on() -> bool:
    return not _OFF[0]


def init_a(tensor: torch.Tensor) -> None:
    """HF PEFT's lora_A init: kaiming-uniform with a = sqrt(5), fan_in = the (global) input size."""
    torch.nn.init.kaiming_uniform_(tensor, a=math.sqrt(5))


def init_b(tensor: torch.Tensor) -> None:
    """B = 0: the adapted model starts as the base model."""
    torch.nn.init.zeros_(tensor)


class Adaptable:
    """A linear that can carry a LoRA adapter. lora_kind: "column" | "row" | "whole" (the full weight)."""

    lora_kind = "whole"
    lora_scale, lora_dropout = 0.0, 0.0  # lora_a / lora_b: registered parameters once add_lora ran

    @property
    def has_lora(self) -> bool:
        return "lora_a" in self._parameters

    def add_lora(self, rank: int, alpha: float, dropout: float = 0.0, record=None) -> None:
        """Add A and B, sharded as this layer's weight is (module docstring). record(param, init) draws them
        later by checkpoint key (training/engine/init.py); without it they are initialised here."""
        kind, weight = self.lora_kind, self.weight
        if weight is None or getattr(self, "gather_output", False) or not getattr(self, "input_is_parallel", True):
            raise ValueError(f"{type(self).__name__}: LoRA is for a linear with its own weight, "
                             f"gather_output=False / input_is_parallel=True")
        expert = getattr(self, "explicit_expert_comm", False)  # the token dispatcher does its TP communication
        tp = self.tp_group.size() if kind != "whole" else 1
        out = self.output_size // tp if kind == "column" else self.output_size
        inp = self.input_size // tp if kind == "row" else self.input_size
        make = lambda *shape: torch.nn.Parameter(torch.empty(*shape, dtype=weight.dtype, device=weight.device))  # noqa: E731
        self.lora_a, self.lora_b = make(rank, inp), make(out, rank)  # [r, in(/tp)], [out(/tp), r]
        if kind == "column":  # B split on the output dim, as W (stride 2: SwiGLU's gate|up halves)
            tensor_parallel.set_tensor_model_parallel_attributes(self.lora_b, True, 0,
                                                                 getattr(weight, "partition_stride", 1))
        elif kind == "row":  # A split on the input dim, as W
            tensor_parallel.set_tensor_model_parallel_attributes(self.lora_a, True, 1, 1)
        if kind != "whole" and self.sequence_parallel and not expert:  # summed over TP by finalize_model_grads
            (self.lora_a if kind == "column" else self.lora_b).sequence_parallel = True
        elif kind == "whole" and getattr(weight, "sequence_parallel", False):  # replicated on its rank's tokens
            self.lora_a.sequence_parallel = self.lora_b.sequence_parallel = True  # (MLA's down projections, SP)
        for param, method in ((self.lora_a, init_a), (self.lora_b, init_b)):
            param.allreduce = getattr(weight, "allreduce", True)  # an expert's (False): reduced over expert DP
            if record is not None:
                record(param, method)
            else:
                with torch.no_grad():
                    method(param)
        self.lora_scale, self.lora_dropout = alpha / rank, dropout

    def lora_delta(self, x: torch.Tensor) -> torch.Tensor:
        """scale * B A dropout(x), shaped as this layer's output. x: the layer's input."""
        kind, expert = self.lora_kind, getattr(self, "explicit_expert_comm", False)
        sp = kind != "whole" and self.sequence_parallel and not expert
        if self.lora_dropout and self.training:
            own_piece = kind == "row" or (kind == "column" and sp)  # each TP rank holds its own part of x
            if own_piece:  # an expert's: the expert-parallel stream (distinct over EP and expert TP)
                stream = [tensor_parallel.get_expert_parallel_rng_tracker_name()] if expert else []
                with tensor_parallel.get_cuda_rng_tracker().fork(*stream):
                    x = F.dropout(x, self.lora_dropout)
            elif expert:  # the same tokens on every expert-TP rank, but under SP the layers run in the TP
                # stream (models/stack.py forks it): the data-parallel stream, the default one's seed everywhere
                with tensor_parallel.get_cuda_rng_tracker().fork(tensor_parallel.get_data_parallel_rng_tracker_name()):
                    x = F.dropout(x, self.lora_dropout)
            else:
                x = F.dropout(x, self.lora_dropout)
        if expert:  # h not communicated; the factor replicated over expert TP: its gradient summed (docstring)
            a, b, copy = self.lora_a, self.lora_b, tensor_parallel.copy_to_tensor_model_parallel_region
            a, b = (copy(a, group=self.tp_group), b) if kind == "column" else (a, copy(b, group=self.tp_group))
            return F.linear(F.linear(x, a) * self.lora_scale, b)  # [tokens, r] -> [tokens, out(/etp)]
        h = F.linear(x, self.lora_a) * self.lora_scale  # [s(/tp), b, r]; row: a partial sum over TP
        if kind == "column":
            h = (tensor_parallel.gather_from_sequence_parallel_region(h, group=self.tp_group) if sp
                 else tensor_parallel.copy_to_tensor_model_parallel_region(h, group=self.tp_group))  # [s, b, r]
        elif kind == "row":
            h = (tensor_parallel.reduce_scatter_to_sequence_parallel_region(h, group=self.tp_group) if sp
                 else tensor_parallel.reduce_from_tensor_model_parallel_region(h, group=self.tp_group))
        return F.linear(h, self.lora_b)  # column: [s, b, out/tp]; row: [s(/tp), b, out]; whole: [s, b, out]

    def adapted_sharded_state_dict(self, prefix, sharded_offsets, metadata, axes: dict):
        """Megatron-Core's TP layers' sharded state dict with the adapter's keys split as they are sharded
        (axes: the base's {name: TP axis}); a B split with stride 2 saved as its two halves, as SwiGLU's W."""
        metadata = ensure_metadata_has_dp_cp_group(metadata)
        if self.has_lora:
            axes = {**axes, "lora_b" if self.lora_kind == "column" else "lora_a": axes["weight"]}
        state = make_sharded_tensors_for_checkpoint(self.state_dict(prefix="", keep_vars=True), prefix, axes,
                                                    sharded_offsets, tp_group=self.tp_group,
                                                    dp_cp_group=metadata["dp_cp_group"])
        if self.lora_kind == "column" and self.has_lora and self.lora_b.partition_stride == 2:
            state[f"{prefix}lora_b"] = apply_swiglu_sharded_factory(
                state[f"{prefix}lora_b"], sharded_offsets, tp_group=self.tp_group, dp_group=metadata["dp_cp_group"])
        return state


def add_adapters(module: torch.nn.Module, targets, rank: int, alpha: float, dropout: float = 0.0,
                 record=None) -> dict[str, int]:
    """Give every Adaptable linear under `module` whose own name is in `targets` an adapter. Returns how
    many linears each target adapted (0: the model has no linear of that name)."""
    found = {name: 0 for name in targets}
    for name, child in list(module.named_modules()):
        leaf = name.rsplit(".", 1)[-1]
        if leaf in found and isinstance(child, Adaptable):
            child.add_lora(rank, alpha, dropout, record)
            found[leaf] += 1
    return found


def adaptable_names(module: torch.nn.Module) -> list[str]:
    """The names a target may take in this model (its Adaptable linears' own names)."""
    return sorted({name.rsplit(".", 1)[-1] for name, m in module.named_modules() if isinstance(m, Adaptable)})


def is_adapter(name: str) -> bool:
    return name.rsplit(".", 1)[-1] in LORA_PARAMS
