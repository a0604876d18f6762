"""LayerNorm / RMSNorm over the hidden dimension, sequence-parallel aware.

Under sequence parallelism each TP rank normalises its own slice of the sequence with the same
(replicated) weight, so the weight's gradient is partial: the `sequence_parallel` attribute tells
Megatron-Core's `finalize_model_grads` to all-reduce it across the TP group.
"""

import torch
import torch.nn.functional as F
from megatron.core.transformer.module import MegatronModule
from megatron.core.transformer.transformer_config import TransformerConfig


class Norm(MegatronModule):
    def __init__(self, config: TransformerConfig, hidden_size: int):
        super().__init__(config=config)
        self.kind = config.normalization  # "LayerNorm" | "RMSNorm"
        self.eps = config.layernorm_epsilon
        self.weight = torch.nn.Parameter(torch.ones(hidden_size, dtype=config.params_dtype))
        if self.kind == "LayerNorm":
            self.bias = torch.nn.Parameter(torch.zeros(hidden_size, dtype=config.params_dtype))
        elif self.kind == "RMSNorm":
            self.register_parameter("bias", None)
        else:
            raise ValueError(f"unknown normalization {self.kind!r}: use LayerNorm or RMSNorm")
        for param in self.parameters():
            param.sequence_parallel = config.sequence_parallel

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # [s(/tp), b, h] -> same
        shape = (x.shape[-1],)
        if self.kind == "LayerNorm":
            return F.layer_norm(x, shape, self.weight, self.bias, self.eps)
        return F.rms_norm(x, shape, self.weight, self.eps)


# ---- Hugging Face interop (Llama family): this block's weights <-> HF's `*layernorm` / `norm` -------------
# The same names on both sides ("weight", "bias" for LayerNorm; Llama's RMSNorm has no bias). `get` reads a
# tensor by name relative to the block, each side's names; training/hf.py walks the model with these.

def _hf_names(config: TransformerConfig) -> tuple[str, ...]:
    return ("weight", "bias") if config.normalization == "LayerNorm" else ("weight",)


def from_hf(get, config: TransformerConfig) -> dict[str, torch.Tensor]:
    return {name: get(name) for name in _hf_names(config)}


def to_hf(get, config: TransformerConfig) -> dict[str, torch.Tensor]:
    return {name: get(name) for name in _hf_names(config)}
