"""LayerNorm / RMSNorm over the hidden dimension, sequence-parallel aware.

Under sequence parallelism each TP rank normalises its own slice of the sequence with the same
(replicated) weight, so the weight's gradient is partial: the `sequence_parallel` attribute tells
Megatron-Core's `finalize_model_grads` to all-reduce it across the TP group.
"""

import torch
import torch.nn.functional as F
from megatron.core.transformer.module import MegatronModule
from megatron.core.transformer.transformer_config import TransformerConfig

from models.shape import ModelShape, Split


class Norm(MegatronModule):
    def __init__(self, config: TransformerConfig, layer_number: int | None = None):
        super().__init__(config=config)
        self.kind = config.normalization  # "LayerNorm" | "RMSNorm"
        self.eps = config.layernorm_epsilon
        self.weight = torch.nn.Parameter(torch.ones(config.hidden_size, dtype=config.params_dtype))
        if self.kind == "LayerNorm":
            self.bias = torch.nn.Parameter(torch.zeros(config.hidden_size, dtype=config.params_dtype))
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

    @staticmethod
    def num_params(shape: ModelShape, split: Split) -> int:  # replicated on every TP rank
        return shape.hidden_size * (2 if shape.normalization == "LayerNorm" else 1)

    @staticmethod
    def flops_per_token(shape: ModelShape) -> float:  # not counted (Megatron's formula counts GEMMs)
        return 0.0

    # ---- Hugging Face interop (Llama family): this block's weights <-> HF's `*layernorm` / `norm` ---------
    # The same names on both sides ("weight", "bias" for LayerNorm; Llama's RMSNorm has no bias). `get` reads
    # a tensor by name relative to the block, each side's names; training/tools/hf.py walks the model.
    @staticmethod
    def from_hf(get, config: TransformerConfig) -> dict[str, torch.Tensor]:
        return {name: get(name) for name in _hf_names(config)}

    @staticmethod
    def to_hf(get, config: TransformerConfig) -> dict[str, torch.Tensor]:
        return {name: get(name) for name in _hf_names(config)}


def _hf_names(config: TransformerConfig) -> tuple[str, ...]:
    return ("weight", "bias") if config.normalization == "LayerNorm" else ("weight",)
