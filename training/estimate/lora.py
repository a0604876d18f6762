"""The memory estimate's view of LoRA (peft=lora, training/parallel/peft.py): a frozen base and small adapters.

    n = adapter_params(cfg, shape, lay, stage)      # A and B elements on one GPU of pipeline rank `stage`
    weights = frozen * e + n * bytes_per_param(...) # e: 2 bytes in bf16, 4 in fp32 (memory.py applies it)
    extra = adapter_activations(cfg, shape, lay, act, stage)  # bytes the adapters add per micro-batch

Frozen weights keep only themselves, in the training dtype: no gradient, no DDP main-grad buffer, no fp32 main
copy, no Adam state (Megatron-Core allocates those for requires_grad parameters only). The adapters are trained
parameters like any other: 2 + 4 + 12 = 18 bytes each in bf16 (16 in fp32), the distributed optimizer sharding
the 12 (8) over DP x CP. Their sharding is the base's (models/lora.py): column base [out/tp, in]: A [r, in]
whole, B [out/tp, r]; row base [out, in/tp]: A [r, in/tp], B [out, r] whole; a block tp leaves whole
(parallel.tp_blocks): both whole.

Activations: each adapted linear keeps h = scale * A x, [tokens, r], for B's gradient (a column adapter's h is
gathered to the full sequence; a row adapter's h is reduce-scattered along it under SP). A x saves x, which the
blocks' declarations already count (the linear's input, which a trained base saves too). With peft.dropout > 0,
each adapted linear's bool mask (1 byte an element, as CUDA's native dropout keeps it); A keeps the dropped copy
of x in place of x (which the frozen base does not keep): a copy more only where x is kept anyway, i.e. attention's
output that SDPA's flash kernel keeps (linear_proj's input), and every part but one of a canonical fused linear
(each part its own mask and copy of the same x). Measured: tests/test_activation_bytes.py's lora cases.

Not counted: peft.trainable's parameters (counted frozen); the routed experts' adapters' activations (their
parameters are: E/ep experts a GPU, each's A and B sharded over expert TP as above); the inputs a frozen,
unadapted linear no longer keeps (an overestimate when peft.targets leaves linears out); the linears of a custom
block not in linears() below.
"""

from __future__ import annotations

from models.activations import ActivationContext
from models.shape import ModelShape, Split
from models.tp_blocks import KIND


def linears(shape: ModelShape) -> dict[str, dict[str, tuple[int, int, str]]]:
    """The built-in blocks' adaptable linears, by block class: name -> (in, out, column | row), full (tp 1)
    sizes: models/attention.py's fused QKV and output projection, models/mlp.py's fc1 (gate|up when gated) and
    fc2, models/gated_mlp.py's gate, up and down."""
    h, q, kv, ffn = shape.hidden_size, shape.q_width, shape.kv_width, shape.ffn_hidden_size
    return {"SelfAttention": {"linear_qkv": (h, q + 2 * kv, "column"), "linear_proj": (q, h, "row"),
                              # canonical LoRA (models/lora_split.py): an adapter per part of the fused QKV / fc1
                              "linear_q": (h, q, "column"), "linear_k": (h, kv, "column"),
                              "linear_v": (h, kv, "column")},
            "MLP": {"linear_fc1": (h, 2 * ffn if shape.gated else ffn, "column"), "linear_fc2": (ffn, h, "row"),
                    "linear_fc1_gate": (h, ffn, "column"), "linear_fc1_up": (h, ffn, "column")},
            "GatedMLP": {"gate": (h, ffn, "column"), "up": (h, ffn, "column"), "down": (ffn, h, "row")},
            "MoE": {"linear_fc1": (h, (2 if shape.gated else 1) * (shape.moe_ffn_hidden_size or 0), "column"),
                    "linear_fc2": (shape.moe_ffn_hidden_size or 0, h, "row")}}  # each routed expert's


# canonical LoRA's parts (models/lora_split.py) -> the fused linear whose input they share
FUSED = {"linear_q": "linear_qkv", "linear_k": "linear_qkv", "linear_v": "linear_qkv", "linear_fc1_gate": "linear_fc1",
         "linear_fc1_up": "linear_fc1"}


def enabled(cfg) -> bool:
    return str(cfg.peft.method) == "lora"


def _adapted(cfg, shape: ModelShape, split: Split, numbers: list[int], experts: bool = False):
    """(layer, linear, kind, tp, in, out) of every adapted linear on one GPU holding layers `numbers`;
    experts=True: the routed experts' too, one per expert on this GPU (E/ep of them, split over etp)."""
    from models.spec import layer_spec

    table, targets = linears(shape), set(cfg.peft.targets)
    for n in numbers:
        for name, block in layer_spec(shape, n).items():
            if name not in KIND or block is None:
                continue
            moe = block.__name__ == "MoE"
            for linear, (inp, out, kind) in table.get(block.__name__, {}).items():
                if linear in targets and (experts or not moe):
                    for _ in range(shape.num_experts // split.ep if moe else 1):
                        yield n, linear, kind, split.etp if moe else split.of(KIND[name]).tp, inp, out


def stage_layers(shape: ModelShape, lay, stage: int) -> list[int]:
    from models.stack import stage_layer_numbers

    return stage_layer_numbers(shape.num_layers, lay.pp, lay.vpp, stage)


def adapter_params(cfg, shape: ModelShape, lay, stage: int, split: Split) -> int:
    """A's and B's elements on one GPU of pipeline rank `stage` (0 without peft=lora)."""
    if not enabled(cfg):
        return 0
    r, total = cfg.peft.rank, 0
    for _, _, kind, tp, inp, out in _adapted(cfg, shape, split, stage_layers(shape, lay, stage), experts=True):
        total += r * inp + r * out // tp if kind == "column" else r * inp // tp + r * out
    return total


def adapter_activations(cfg, shape: ModelShape, lay, act: ActivationContext, stage: int, split: Split) -> float:
    """Bytes the adapters of a stage's mean layer keep per micro-batch, times its layers (one layer-set: the
    caller scales by the layers in flight as it does the blocks' own)."""
    if not enabled(cfg) or act.recompute == "full":  # full recompute: only the layer's input survives
        return 0.0
    r, dropout, total, inputs = cfg.peft.rank, cfg.peft.dropout > 0, 0.0, set()
    numbers = stage_layers(shape, lay, stage)
    # SDPA's flash kernel keeps its output, linear_proj's input (explicit scores or a recomputed core do not)
    flash = act.flash and act.recompute == "none" and shape.attn_logit_softcap is None and not shape.attention_sinks
    for n, linear, kind, tp, inp, _ in _adapted(cfg, shape, split, numbers):
        sp = act.sp and tp > 1
        h_tokens = act.tokens / (tp if sp and kind == "row" else 1)  # column: gathered; row: scattered
        total += act.bytes * h_tokens * r
        if dropout:  # the mask; the dropped copy in place of x, a copy more where x is kept anyway (docstring)
            x = act.tokens / (tp if sp and kind == "column" else 1) * (inp / tp if kind == "row" else inp)
            fused = (n, FUSED.get(linear, linear))
            kept = fused in inputs or (linear == "linear_proj" and flash)
            inputs.add(fused)
            total += (1 + (act.bytes if kept else 0)) * x
    return total / len(numbers)
