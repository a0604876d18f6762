"""This pipeline stage's slice of the transformer layers (+ the final norm on the last stage).

Which layers a stage (and virtual stage) builds comes from Megatron-Core's own helpers, so the layer
numbering is exactly Megatron's: with L layers, P stages and V virtual chunks, chunk v of stage p holds
layers v*L/V + p*L/(P*V) ... + L/(P*V). Checkpoint keys use the global layer index, so a checkpoint
loads into any pipeline layout.
"""

import contextlib

import torch
from megatron.core import tensor_parallel
from megatron.core.dist_checkpointing.utils import replace_prefix_for_sharding
from megatron.core.transformer.module import MegatronModule
from megatron.core.transformer.transformer_block import get_num_layers_to_build
from megatron.core.transformer.transformer_config import TransformerConfig
from megatron.core.transformer.transformer_layer import get_transformer_layer_offset
from megatron.core.transformer.utils import sharded_state_dict_default

from models.layer import TransformerLayer
from models.norm import Norm
from models.rope import for_layer
from models.shape import ModelShape


def stage_layer_numbers(num_layers: int, pp: int, vpp: int | None, stage: int) -> list[int]:
    """The layer numbers (1-based) pipeline rank `stage` holds over all its virtual chunks, by the rule
    above: what Megatron-Core's helpers give each chunk (the memory estimate reads it; a test compares)."""
    chunks = vpp or 1
    per_chunk = num_layers // (pp * chunks)
    return [v * num_layers // chunks + stage * per_chunk + i + 1 for v in range(chunks) for i in range(per_chunk)]


class TransformerStack(MegatronModule):
    def __init__(self, config: TransformerConfig, shape: ModelShape, post_process: bool, vp_stage: int | None):
        super().__init__(config=config)
        self.vp_stage = vp_stage
        self.offset = get_transformer_layer_offset(config, vp_stage)
        count = get_num_layers_to_build(config, vp_stage)
        self.layers = torch.nn.ModuleList(
            TransformerLayer(config, shape, layer_number=self.offset + i + 1) for i in range(count)
        )
        self.final_layernorm = Norm(config) if post_process else None
        self.layer_kinds = [shape.layer_types[layer.layer_number - 1] for layer in self.layers]  # full | sliding
        self.full_recompute = config.recompute_granularity == "full"

    def forward(self, x: torch.Tensor, rotary_freqs, cache=None,
                attention_mask: torch.Tensor | None = None):  # [s(/tp), b, h]; mask [b, 1, s, s] (packed)
        # rotary_freqs: one RoPE table [s, 1, 1, rd] for every layer, or {layer kind: table} (models/rope.py)
        # Under SP each TP rank holds different tokens: hidden dropout must differ across ranks.
        rng = tensor_parallel.get_cuda_rng_tracker().fork() if self.config.sequence_parallel \
            else contextlib.nullcontext()
        with rng:
            for layer, kind in zip(self.layers, self.layer_kinds):
                freqs = for_layer(rotary_freqs, kind)  # its kind's RoPE table (models/rope.py: Gemma 3's local base)
                if self.full_recompute and self.training:  # keep only each layer's input
                    x = tensor_parallel.checkpoint(layer, False, x, freqs, None, attention_mask)
                else:
                    x = layer(x, freqs, cache, attention_mask)
        if self.final_layernorm is not None:
            x = self.final_layernorm(x)
        return x

    def sharded_state_dict(self, prefix="", sharded_offsets=(), metadata=None):
        """Keys `layers.<global index>.*` (Megatron's TransformerBlock scheme) so PP can change on load."""
        state = {}
        for local_index, layer in enumerate(self.layers):
            local_prefix = f"{prefix}layers.{local_index}."
            global_prefix = f"{prefix}layers.{layer.layer_number - 1}."
            layer_state = layer.sharded_state_dict(local_prefix, sharded_offsets, metadata)
            replace_prefix_for_sharding(layer_state, local_prefix, global_prefix)
            state.update(layer_state)
        if self.final_layernorm is not None:
            state.update(sharded_state_dict_default(self.final_layernorm, f"{prefix}final_layernorm.",
                                                    sharded_offsets, metadata))
        return state
