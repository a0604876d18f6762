"""Canonical LoRA (Megatron-Bridge's name; Hugging Face PEFT's layout): separate adapters, each with its own A and
B, on the parts of a fused linear: attention's fused QKV (q, k, v) and a gated MLP's fc1 (gate, up). The fused
form (models/lora.py on linear_qkv / linear_fc1) has one A shared by the parts; this one is PEFT's q_proj /
k_proj / v_proj (gate_proj / up_proj) adapters exactly, so an adapter trained elsewhere imports and exports as it
is (training/interop/peft_import.py, peft_export.py). The target names (linear_q, ..., linear_fc1_up) are the
config's (training/parallel/peft.py SPLIT); here a fused linear learns its parts' names in its layout's order.

Each part's adapter is a child module of the fused linear, named by its target, so the base's names and keys do
not change: `...linear_qkv.linear_q.lora_a`, `...mlp.linear_fc1.linear_fc1_gate.lora_b`. On each TP rank the fused
output is G local groups with each part's rows side by side:

    QKV  [ng/tp groups, (np/ng)*hn q | hn k | hn v]     (models/attention.py)
    fc1  [1 group, ffn/tp gate | ffn/tp up]              (models/mlp.py: stride 2, each half split by TP)

so a part's global B (B_q [np*hn, r], B_k and B_v [ng*hn, r], B_gate and B_up [ffn, r]) is split by TP in
contiguous rows, whole heads with their groups / each half's own slice, exactly as its rows of the base weight;
its A [r, in] is replicated (a column base). Forward: h = scale * [A_1; A_2; ...] x in one GEMM ([s, b, parts*r]),
one copy-to-TP (SP: all-gather along the sequence) of those parts*r features, each B on its r columns of h, the
results interleaved into the fused layout; a part without a target adds zeros (PEFT's q_proj + v_proj only).
Gradients as the fused column adapter's: an A's gradient is whole after the copy's backward all-reduce; under SP
it is a partial sum that finalize_model_grads adds over TP (`sequence_parallel`). Dropout: each part its own mask
of the input, as PEFT's separate lora_dropout modules.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from megatron.core import tensor_parallel

from models.lora import Adaptable, init_a, init_b


@dataclass(frozen=True)
class SplitLayout:
    """A fused linear's local output [..., groups, sum(widths)]: names[i] (None: no adapter) over widths[i]."""
    groups: int
    widths: tuple[int, ...]
    names: tuple[str | None, ...]


class PartAdapter(torch.nn.Module):
    """One part's adapter: lora_a [r, in] (replicated), lora_b [groups * width, r] (split like the part's rows)."""

    def __init__(self, lora_a: torch.nn.Parameter, lora_b: torch.nn.Parameter):
        super().__init__()
        self.lora_a, self.lora_b = lora_a, lora_b


def _layout(fused: str, layer) -> tuple[int, tuple[int, ...]]:
    """(local groups, each part's rows per group) of fused linear `fused`'s output on this rank."""
    c = layer.config
    tp = layer.tp_group.size() if layer.lora_kind == "column" else 1  # a replicated ("whole") block: full
    if fused == "linear_qkv":
        ng, hn = c.num_query_groups or c.num_attention_heads, c.kv_channels
        groups, widths = ng // tp, (c.num_attention_heads // ng * hn, hn, hn)  # [ng/tp, q | k | v]
    elif fused == "linear_fc1":
        if not c.gated_linear_unit:
            raise ValueError("separate gate / up adapters need a gated MLP (model.activation=swiglu | geglu_tanh)")
        groups, widths = 1, (layer.output_size // 2 // tp,) * 2  # [1, ffn/tp gate | ffn/tp up]
    else:
        raise ValueError(f"{fused} has no separate parts (only linear_qkv and linear_fc1 do)")
    if groups * sum(widths) * tp != layer.output_size:
        raise ValueError(f"{fused}: output {layer.output_size} is not the {groups * tp} x {widths} rows of "
                         f"separate part adapters (a custom block under that name?)")
    return groups, widths


def add_split(layer, fused: str, names: tuple[str | None, ...], rank: int, alpha: float, dropout: float = 0.0,
              record=None) -> None:
    """Give the fused linear `layer` (named `fused`) one adapter per named part (names: in the layout's order,
    None for a part without one). record(param, init): draw by checkpoint key (training/engine/init.py)."""
    weight, kind = layer.weight, layer.lora_kind
    if weight is None or kind == "row" or layer.has_lora or getattr(layer, "explicit_expert_comm", False) \
            or getattr(layer, "gather_output", False):
        raise ValueError(f"{fused}: separate part adapters are for a fused column linear without a fused adapter, "
                         f"not an expert's, with gather_output=False")
    groups, widths = _layout(fused, layer)
    if len(names) != len(widths):
        raise ValueError(f"{fused}: {len(names)} part names for {len(widths)} parts")
    make = lambda *shape: torch.nn.Parameter(  # noqa: E731
        torch.empty(*shape, dtype=weight.dtype, device=weight.device))
    for name, width in zip(names, widths):
        if name is None:
            continue
        a, b = make(rank, layer.input_size), make(groups * width, rank)  # [r, in], [G * w (= part rows / tp), r]
        if kind == "column":  # B split on its rows by TP, contiguously (stride 1): whole groups / half's slice
            tensor_parallel.set_tensor_model_parallel_attributes(b, True, 0, 1)
            if layer.sequence_parallel:  # A's gradient from this rank's tokens: summed by finalize_model_grads
                a.sequence_parallel = True
        for param, method in ((a, init_a), (b, init_b)):
            param.allreduce = True  # a dense (not expert) parameter to DDP
            if record is not None:
                record(param, method)
            else:
                with torch.no_grad():
                    method(param)
        layer.add_module(name, PartAdapter(a, b))
    layer.lora_split = SplitLayout(groups, widths, tuple(names))
    layer.lora_scale, layer.lora_dropout = alpha / rank, dropout


def add_split_adapters(module: torch.nn.Module, fused: str, names: tuple[str | None, ...], rank: int,
                       alpha: float, dropout: float = 0.0, record=None) -> int:
    """add_split on every Adaptable linear under `module` named `fused`; returns how many."""
    count = 0
    for name, child in list(module.named_modules()):
        if name.rsplit(".", 1)[-1] == fused and isinstance(child, Adaptable):
            add_split(child, fused, names, rank, alpha, dropout, record)
            count += 1
    return count


def parts(layer) -> list[tuple[str, PartAdapter]]:
    """(target name, adapter) of a linear's part adapters, in its layout's order ([] without)."""
    split = getattr(layer, "lora_split", None)
    return [] if split is None else [(n, getattr(layer, n)) for n in split.names if n is not None]


def place(layer, values: dict[str, torch.Tensor]) -> torch.Tensor:
    """Parts' values [..., G * w_i] (by name; a missing part: zeros) -> the fused layout [..., G * sum(w)]."""
    split = layer.lora_split
    lead = next(iter(values.values())).shape[:-1]
    pieces = [values[n].view(*lead, split.groups, w) if n in values else  # [..., G, w_i]
              next(iter(values.values())).new_zeros(*lead, split.groups, w) for n, w in zip(split.names, split.widths)]
    return torch.cat(pieces, dim=-1).flatten(-2)  # [..., G, sum(w)] -> [..., G * sum(w)]


def split_delta(layer, x: torch.Tensor) -> torch.Tensor:
    """scale * B_i A_i dropout_i(x) of every part, in the fused output's layout [s, b, out/tp]. x: [s(/tp), b, in]."""
    adapters, kind = parts(layer), layer.lora_kind
    sp = kind == "column" and layer.sequence_parallel
    if layer.lora_dropout and layer.training:  # each part its own mask; SP: each rank its own tokens
        def drop(t):
            if not sp:
                return F.dropout(t, layer.lora_dropout)
            with tensor_parallel.get_cuda_rng_tracker().fork():
                return F.dropout(t, layer.lora_dropout)
        h = torch.cat([F.linear(drop(x), a.lora_a) for _, a in adapters], dim=-1)  # [s(/tp), b, parts*r]
    else:
        h = F.linear(x, torch.cat([a.lora_a for _, a in adapters]))  # [s(/tp), b, parts*r]
    h = h * layer.lora_scale
    if kind == "column":  # every rank: all tokens' h (backward: dL/dh all-reduced / reduce-scattered over TP)
        h = (tensor_parallel.gather_from_sequence_parallel_region(h, group=layer.tp_group) if sp
             else tensor_parallel.copy_to_tensor_model_parallel_region(h, group=layer.tp_group))  # [s, b, parts*r]
    hs = h.split(adapters[0][1].lora_a.shape[0], dim=-1)  # parts x [s, b, r]
    return place(layer, {n: F.linear(hi, a.lora_b) for (n, a), hi in zip(adapters, hs)})  # [s, b, out/tp]


def merged_delta(layer) -> torch.Tensor:
    """scale * the parts' B_i A_i as the fused weight's rows [out, in] (fp32; export --merge at tp1)."""
    deltas = {n: (a.lora_b.float() @ a.lora_a.float()).T for n, a in parts(layer)}  # [in, G * w_i]
    return layer.lora_scale * place(layer, deltas).T  # [G * sum(w), in]


def sharded_axes(layer) -> dict[str, int]:
    """The parts' TP-split keys for the linear's sharded state dict: each B on its rows (A: replicated)."""
    return {f"{n}.lora_b": 0 for n, _ in parts(layer)} if layer.lora_kind == "column" else {}
