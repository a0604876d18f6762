"""Which sub-blocks split over the tensor-parallel group (parallel.tp_blocks); the others are replicated.

    TP_BLOCKS = ("attention", "mlp", "vocab")     # the default: everything splits (Megatron's TP)
    split_over_tp(config, "mlp")                  # does this kind of sub-block split in this model?
    block_config(config, "attention")             # the config a sub-block is built with
    Split(tp=2, tp_blocks=("mlp",)).of("attention")   # the cut a replicated block's num_params sees: tp 1

A replicated sub-block runs whole on every rank of the TP group: full weights, the same computation on the same
(TP-replicated) input, no TP communication. It is built with a copy of the model's TransformerConfig that says
"one TP rank" (tensor_model_parallel_size 1, no sequence parallel, `tp_replicated` set), so the block computes
its full sizes, and models/linear.py builds plain full linear layers (and models/embedding.py a full embedding
table) in place of Megatron-Core's TP layers. Their parameters carry no `tensor_model_parallel` attribute: to
Megatron-Core they are TP duplicates like the norms' (`param_is_not_tensor_parallel_duplicate`: counted once in
the grad norm; the default sharded state dict: one global tensor, replicated over TP), so a checkpoint holds the
same global tensors whichever blocks split and reshards between layouts.

The model reads two attributes the bridge (training/engine/bridge.py) sets on Megatron-Core's TransformerConfig:
`tp_blocks` (absent: all split) and, on a replicated block's copy, `tp_replicated`. Nothing here needs a
process group.
"""

from __future__ import annotations

import copy

TP_BLOCKS = ("attention", "mlp", "vocab")  # attention, the MLP, the vocabulary (embedding + output layer)
KIND = {"self_attention": "attention", "mlp": "mlp"}  # a layer's sub-blocks that may split; norms never do


def tp_blocks_of(config) -> tuple[str, ...]:
    return tuple(getattr(config, "tp_blocks", TP_BLOCKS))


def split_over_tp(config, kind: str) -> bool:
    """Whether sub-blocks of this kind split over TP (always true at tp = 1: nothing to split)."""
    return kind in tp_blocks_of(config)


def replicated(config) -> bool:
    """This config builds a replicated sub-block (full weights on every TP rank)."""
    return bool(getattr(config, "tp_replicated", False))


def block_config(config, kind: str):
    """`config` for a sub-block of this kind that splits; else a shallow copy as one TP rank sees it."""
    if kind is None or split_over_tp(config, kind) or config.tensor_model_parallel_size == 1:
        return config
    one = copy.copy(config)  # shallow: the init methods, dtypes and everything else are the model's
    one.tensor_model_parallel_size, one.sequence_parallel, one.tp_replicated = 1, False, True
    return one
