"""Which blocks a transformer layer is made of: a small typed spec built from the model's shape.

    spec = layer_spec(shape, layer_number)        # LayerSpec(input_layernorm=Norm, self_attention=..., ...)
    for name, block in spec.items(): ...          # the layer builds block(config, layer_number) as `name`

The config names the attention and MLP blocks (`model.attention`, `model.mlp`): a short name from BLOCKS
or any importable `package.module:Class`, so a new block is its own file plus a config value, with no
edit of the layer, the stack or the engine. A block is a Megatron-Core `MegatronModule` class:

    Block(config: TransformerConfig, layer_number: int)   forward as the layer calls it (attention:
                                                           (x, rotary_freqs), the others: (x)); returns
                                                           (out, bias or None), norms return out
    Block.num_params(shape, split) -> int                  parameters on one GPU, split = Split(tp, ep, etp)
                                                           (the memory estimate; checked against the built
                                                           model for every preset and layout)
    Block.flops_per_token(shape) -> float                  forward FLOPs per token (2 per multiply-add)
    Block.activation_bytes(shape, split, act) -> float     bytes its forward keeps for backward, one micro-batch
                                                           on one GPU, act = models/activations.py's context
                                                           (the memory estimate sums them; checked against
                                                           what autograd saves for every built-in block)
    Block.extra_losses: tuple[str, ...] = ()               names of the extra losses it attaches
                                                           (models/extra_losses.py), logged like the loss
    Block.extra_stats(shape) -> {name: Stat} (optional)    other statistics it records (tokens per expert)
    Block.from_hf / Block.to_hf (optional)                 its Hugging Face weight mapping (Llama, Qwen, Mixtral)
    Block.hf_name(config) (optional)                        its HF module name, when not the sub-block's (MoE)

The sub-block names are Megatron-Core's (`input_layernorm`, `self_attention`, `pre_mlp_layernorm`, `mlp`),
so parameter names match its GPTModel and the checkpoints line up. `model.norm_placement` picks the norms:
pre (those two), sandwich (Gemma 2/3: also `post_attention_layernorm` and `post_mlp_layernorm`, each on its
sub-block's output before the residual add), post (OLMo 2: only the two after).
"""

from __future__ import annotations

import functools
import importlib
from dataclasses import dataclass, fields

from models.extra_losses import Stat
from models.shape import ModelShape

# Built-in blocks by name; anything else is named as "package.module:Class".
BLOCKS = {
    "self_attention": "models.attention:SelfAttention",  # fused-QKV GQA, RoPE, SDPA
    "mlp": "models.mlp:MLP",  # GELU, or SwiGLU with one fused gate|up weight
    "gated_mlp": "models.gated_mlp:GatedMLP",  # the README's example: separate gate and up projections
    "mla": "models.mla:MLA",  # multi-latent attention (DeepSeek-V3): low-rank q and kv, decoupled RoPE
    "moe": "models.moe:MoE",  # mixture of experts (Megatron-Core's MoELayer): the layers model.moe picks
}


# What the engine's arithmetic reads from every block (the contract above).
REQUIRED = ("num_params", "flops_per_token", "activation_bytes")


class BlockError(ValueError):
    pass


def resolve_block(name: str) -> type:
    """A block class from its BLOCKS name or `package.module:Class`."""
    target = BLOCKS.get(name, name)
    module_name, _, class_name = target.partition(":")
    if not class_name:
        raise BlockError(f"unknown block {name!r}: use one of {', '.join(BLOCKS)} or 'package.module:Class'")
    try:
        block = getattr(importlib.import_module(module_name), class_name)
    except (ImportError, AttributeError) as err:
        raise BlockError(f"block {name!r}: cannot import {target} ({err})") from err
    # required, not defaulted: a guess for a block nobody measured is the silent error the estimate is there to
    # prevent (a subclass inherits its parent's declarations, e.g. tests/blocks.py's MLPs)
    missing = [m for m in REQUIRED if not callable(getattr(block, m, None))]
    if missing:
        raise BlockError(f"block {target} has no {' or '.join(missing)}: every block declares its parameter "
                         f"count, FLOPs and activation bytes (see models/spec.py and models/mlp.py)")
    return block


def block_problem(name: str) -> str | None:
    """Why `name` cannot be a block, or None. Built-in names are not imported (the config check before
    launching stays free of Megatron-Core's import); a `package.module:Class` is imported and checked."""
    if name in BLOCKS:
        return None
    try:
        resolve_block(name)
    except BlockError as err:
        return str(err)
    return None


@dataclass(frozen=True, kw_only=True)
class LayerSpec:
    """One layer's sub-blocks in forward order; the field names are the layer's module names. A norm the
    placement leaves out is None."""

    input_layernorm: type | None
    self_attention: type
    post_attention_layernorm: type | None = None
    pre_mlp_layernorm: type | None
    mlp: type
    post_mlp_layernorm: type | None = None

    def items(self) -> list[tuple[str, type]]:
        """The sub-blocks this layer has (name, class)."""
        return [(f.name, getattr(self, f.name)) for f in fields(self) if getattr(self, f.name) is not None]

    def absent(self) -> list[str]:
        """The names of the norms this layer leaves out."""
        return [f.name for f in fields(self) if getattr(self, f.name) is None]


def layer_spec(shape: ModelShape, layer_number: int) -> LayerSpec:
    """The blocks of layer `layer_number` (1-based, global across pipeline stages)."""
    from models.norm import Norm

    blocks = shape.layers[layer_number - 1]
    before = None if shape.norm_placement == "post" else Norm  # pre, sandwich: a norm on each sub-block's input
    after = None if shape.norm_placement == "pre" else Norm  # sandwich, post: one on each sub-block's output
    return LayerSpec(input_layernorm=before, self_attention=resolve_block(blocks.attention),
                     post_attention_layernorm=after, pre_mlp_layernorm=before, mlp=resolve_block(blocks.mlp),
                     post_mlp_layernorm=after)


@functools.lru_cache(maxsize=None)
def extra_stats(shape: ModelShape) -> dict[str, Stat]:
    """Every extra loss and statistic any layer records (models/extra_losses.py), in a fixed order: the same
    on every rank, whichever layers its pipeline stage holds."""
    stats: dict[str, Stat] = {}
    for number in range(1, shape.num_layers + 1):
        for _, block in layer_spec(shape, number).items():
            stats.update(dict.fromkeys(getattr(block, "extra_losses", ()), Stat(2)))
            if hasattr(block, "extra_stats"):
                stats.update(block.extra_stats(shape))
    return stats
