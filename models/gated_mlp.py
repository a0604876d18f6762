"""A gated MLP with separate gate and up projections: the README's "add a block" example, selected with
`model.mlp=gated_mlp` (or, for a block of your own, `model.mlp=models.my_block:MyBlock`).

    out = down(act(gate(x)) * up(x))      act = the config's activation: GELU (GeGLU) or SiLU (SwiGLU)

Three plain Megatron-Core layers (models/linear.py's: whole on every TP rank when parallel.tp_blocks leaves
the MLP out): gate and up are ColumnParallelLinear (each TP rank computes its ffn/tp
slice of both, so the product needs no communication), down is RowParallelLinear (it all-reduces, or
reduce-scatters under sequence parallelism, back to the full hidden size). Each weight is split along
one dimension in one piece, so checkpoints reshard across TP with Megatron-Core's default sharded state
dict: unlike models/mlp.py's fused gate|up weight, no stride and no custom sharded_state_dict. With
model.activation=swiglu it computes exactly models/mlp.py's SwiGLU (and maps to Llama's gate/up/down).
"""

import torch
from megatron.core.transformer.module import MegatronModule
from megatron.core.transformer.transformer_config import TransformerConfig

from models.activations import ActivationContext
from models.linear import ColumnParallelLinear, RowParallelLinear
from models.shape import ModelShape, Split


class GatedMLP(MegatronModule):
    def __init__(self, config: TransformerConfig, layer_number: int | None = None):
        super().__init__(config=config)
        h, ffn = config.hidden_size, config.ffn_hidden_size
        self.activation = config.activation_func  # F.gelu or F.silu (training/engine/bridge.py)

        def column():  # h -> ffn/tp on each TP rank
            return ColumnParallelLinear(h, ffn, config=config, init_method=config.init_method,
                                        bias=config.add_bias_linear, gather_output=False)

        self.gate, self.up = column(), column()
        self.down = RowParallelLinear(
            ffn, h, config=config, init_method=config.output_layer_init_method, bias=config.add_bias_linear,
            input_is_parallel=True, skip_bias_add=True)

    def forward(self, x: torch.Tensor):  # [s(/tp), b, h]
        gate, _ = self.gate(x)  # [s, b, ffn/tp] (SP: gathered along s)
        up, _ = self.up(x)  # [s, b, ffn/tp]
        return self.down(self.activation(gate) * up)  # ([s(/tp), b, h], bias or None)

    # What the engine's arithmetic reads (models/spec.py): the memory estimate and the FLOPs count.
    @staticmethod
    def num_params(shape: ModelShape, split: Split) -> int:  # on one GPU
        h, ffn, bias = shape.hidden_size, shape.ffn_hidden_size, shape.add_bias_linear
        sharded = 3 * h * ffn + (2 * ffn if bias else 0)  # gate, up, down weights; gate and up biases
        return sharded // split.tp + (h if bias else 0)  # down's bias is replicated

    @staticmethod
    def flops_per_token(shape: ModelShape) -> float:  # three h x ffn GEMMs, 2 FLOPs per multiply-add
        return 2 * 3 * shape.hidden_size * shape.ffn_hidden_size

    @staticmethod
    def activation_bytes(shape: ModelShape, split: Split, act: ActivationContext) -> float:  # one micro-batch
        """gate's and up's input [s(/tp), b, h], and 4 ffn/tp-wide tensors: gate's and up's outputs, act(gate)
        and the product (down's input), whichever the activation (GELU: GeGLU, SiLU: SwiGLU)."""
        return act.bytes * act.tokens * (shape.hidden_size / act.seq_split(split) +
                                         4 * shape.ffn_hidden_size / split.tp)

    # Optional: the Hugging Face (Llama) mapping, names relative to the block on each side.
    @staticmethod
    def from_hf(get, config: TransformerConfig) -> dict[str, torch.Tensor]:
        kinds = ("weight", "bias") if config.add_bias_linear else ("weight",)
        return {f"{ours}.{k}": get(f"{theirs}.{k}") for ours, theirs in _HF for k in kinds}

    @staticmethod
    def to_hf(get, config: TransformerConfig) -> dict[str, torch.Tensor]:
        kinds = ("weight", "bias") if config.add_bias_linear else ("weight",)
        return {f"{theirs}.{k}": get(f"{ours}.{k}") for ours, theirs in _HF for k in kinds}


_HF = (("gate", "gate_proj"), ("up", "up_proj"), ("down", "down_proj"))
