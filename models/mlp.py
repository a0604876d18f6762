"""MLP: ColumnParallelLinear (h -> ffn/tp, or 2*ffn/tp gate|up when gated) -> act -> RowParallelLinear.
Activations (model.activation): gelu; swiglu, SiLU(gate) * up; geglu_tanh, GeLU-tanh(gate) * up (Gemma);
clamped_swiglu, gpt-oss's g * sigmoid(1.702 g) * (u + 1) with g = min(gate, limit), u = clamp(up, -limit, limit)
(Megatron-Core's quick_gelu, glu_linear_offset and activation_func_clamp_value, as its experts' MLP computes it).

Weight layout (SwiGLU): the full fc1 weight is [gate; up] ([2*ffn, h]). `stride=2` makes each TP rank
hold [gate_r; up_r], so the local output splits into the rank's gate and up halves.
"""

import torch
import torch.nn.functional as F
from megatron.core.fusions.fused_bias_swiglu import bias_swiglu_impl
from megatron.core.transformer.mlp import apply_swiglu_sharded_factory
from megatron.core.transformer.module import MegatronModule
from megatron.core.transformer.transformer_config import TransformerConfig
from megatron.core.transformer.utils import ensure_metadata_has_dp_cp_group

from models.activations import ActivationContext
from models.linear import ColumnParallelLinear, RowParallelLinear
from models.shape import ModelShape, Split


class SwiGLU(torch.autograd.Function):
    """silu(gate) * up of x = [gate | up] ([..., 2*ffn] -> [..., ffn]), unfused (model.fused_kernels off: CPU).

    The same ops as autograd's `F.silu(gate) * up` (bit-identical forward and gradient), but the backward writes
    the gate and up gradients straight into their halves of one [..., 2*ffn] tensor instead of concatenating
    two (the chunk's gradient): one full copy less per layer and micro-batch."""

    @staticmethod
    def forward(ctx, x):
        gate, up = torch.chunk(x, 2, dim=-1)  # 2 x [..., ffn]
        activated = F.silu(gate)
        ctx.save_for_backward(gate, up, activated)
        return activated * up

    @staticmethod
    def backward(ctx, grad):  # grad [..., ffn] -> [..., 2*ffn]
        gate, up, activated = ctx.saved_tensors
        if torch.compiler.is_compiling():  # model.compile: dynamo cannot trace out= into strided halves (a graph
            # break per layer); inductor fuses the concatenation anyway. The same ops, the same values
            return torch.cat([torch.ops.aten.silu_backward(grad * up, gate), grad * activated], dim=-1)
        out = grad.new_empty((*grad.shape[:-1], 2 * grad.shape[-1]))
        d_gate, d_up = torch.chunk(out, 2, dim=-1)
        torch.ops.aten.silu_backward.grad_input(grad * up, gate, grad_input=d_gate)
        torch.mul(grad, activated, out=d_up)
        return out


class MLP(MegatronModule):
    def __init__(self, config: TransformerConfig, layer_number: int | None = None):
        super().__init__(config=config)
        ffn = config.ffn_hidden_size
        self.gated = config.gated_linear_unit
        self.activation = config.activation_func
        self.linear_fc1 = ColumnParallelLinear(
            config.hidden_size, 2 * ffn if self.gated else ffn, config=config,
            init_method=config.init_method, bias=config.add_bias_linear, gather_output=False,
            stride=2 if self.gated else 1,
        )
        self.linear_fc2 = RowParallelLinear(
            ffn, config.hidden_size, config=config, init_method=config.output_layer_init_method,
            bias=config.add_bias_linear, input_is_parallel=True, skip_bias_add=True,
        )

    def forward(self, x: torch.Tensor):  # [s(/tp), b, h]
        x, _ = self.linear_fc1(x)  # [s, b, ffn/tp] or [s, b, 2*ffn/tp]; bias added inside
        if self.gated and self.config.bias_activation_fusion:
            x = bias_swiglu_impl(x, None)  # [s, b, 2*ffn/tp] -> [s, b, ffn/tp]: MCore's compiled SwiGLU
        elif self.gated and self.activation is F.silu:
            x = SwiGLU.apply(x)  # [s, b, 2*ffn/tp] -> [s, b, ffn/tp]
        elif self.gated and (limit := self.config.activation_func_clamp_value) is not None:  # clamped SwiGLU
            gate, up = torch.chunk(x, 2, dim=-1)  # 2 x [s, b, ffn/tp]
            x = self.activation(gate.clamp(max=limit)) * (up.clamp(-limit, limit) + self.config.glu_linear_offset)
        elif self.gated:  # GeGLU (the activation is F.gelu(approximate="tanh"), training/engine/bridge.py)
            gate, up = torch.chunk(x, 2, dim=-1)  # 2 x [s, b, ffn/tp]
            x = self.activation(gate) * up
        else:
            x = self.activation(x)
        return self.linear_fc2(x)  # ([s(/tp), b, h], bias or None): bias added with the residual

    def sharded_state_dict(self, prefix="", sharded_offsets=(), metadata=None):
        """SwiGLU's fc1 is saved as two TP-sharded halves (gate, up), so TP can change on load."""
        metadata = ensure_metadata_has_dp_cp_group(metadata)
        state = super().sharded_state_dict(prefix, sharded_offsets, metadata)
        if self.gated:
            for key in (f"{prefix}linear_fc1.weight", f"{prefix}linear_fc1.bias"):
                if key in state:
                    state[key] = apply_swiglu_sharded_factory(
                        state[key], sharded_offsets, tp_group=getattr(self.linear_fc1, "tp_group", None),
                        dp_group=metadata["dp_cp_group"])
        return state

    @staticmethod
    def num_params(shape: ModelShape, split: Split) -> int:
        h, ffn = shape.hidden_size, shape.ffn_hidden_size
        fc1 = 2 * ffn if shape.gated else ffn
        sharded = h * fc1 + ffn * h + (fc1 if shape.add_bias_linear else 0)
        return sharded // split.tp + (h if shape.add_bias_linear else 0)  # fc2's bias is replicated
        # (a replicated MLP, parallel.tp_blocks: split.tp is 1, models/tp_blocks.py)

    @staticmethod
    def flops_per_token(shape: ModelShape) -> float:  # SwiGLU: three h x ffn GEMMs (gate, up, down)
        return 2 * shape.hidden_size * shape.ffn_hidden_size * (3 if shape.gated else 2)

    @staticmethod
    def activation_bytes(shape: ModelShape, split: Split, act: ActivationContext) -> float:
        """fc1's input [s(/tp), b, h] and ffn/tp-wide tensors: GELU's input and output (fc2's input); SwiGLU the
        fc1 output (gate|up, 2 wide), SiLU(gate) and the product, or with the fused kernel (model.fused_kernels)
        only the fc1 output and the product (Megatron-Core's SwiGLUFunction recomputes the rest in backward).
        GeGLU (never fused) as unfused SwiGLU; the clamped SwiGLU (gpt-oss, never fused here) 7: fc1's output,
        min(gate, limit), its sigmoid, the quick GELU, clamp(up) + 1 and the product."""
        fused = act.fused and shape.activation == "swiglu"
        kept = 2 if not shape.gated else 3 if fused else 7 if shape.activation == "clamped_swiglu" else 4
        return act.bytes * act.tokens * (shape.hidden_size / act.seq_split(split) +
                                         kept * shape.ffn_hidden_size / split.tp)

    # ---- Hugging Face interop (Llama family): this block's weights <-> HF's `mlp.{gate,up,down}_proj` ---------
    # Full (tp=1) fc1 is [gate; up] ([2*ffn, h], see the module docstring) = cat(HF gate_proj, HF up_proj); fc2 is
    # HF down_proj. Biases (HF mlp_bias) follow the same layout. Phi-3 (config.hf_family, set by
    # training/interop/hf.py) fuses them as gate_up_proj = [gate; up]: our fc1 as it is. `get` reads a tensor by
    # name relative to the block.
    @staticmethod
    def from_hf(get, config: TransformerConfig) -> dict[str, torch.Tensor]:
        out = {}
        for kind in _hf_kinds(config):
            if getattr(config, "hf_family", None) == "phi3":
                out[f"linear_fc1.{kind}"] = get(f"gate_up_proj.{kind}")
            else:
                out[f"linear_fc1.{kind}"] = torch.cat([get(f"gate_proj.{kind}"), get(f"up_proj.{kind}")], dim=0)
            out[f"linear_fc2.{kind}"] = get(f"down_proj.{kind}")
        return out

    @staticmethod
    def to_hf(get, config: TransformerConfig) -> dict[str, torch.Tensor]:
        out = {}
        for kind in _hf_kinds(config):
            if getattr(config, "hf_family", None) == "phi3":
                out[f"gate_up_proj.{kind}"] = get(f"linear_fc1.{kind}")
            else:
                out[f"gate_proj.{kind}"], out[f"up_proj.{kind}"] = torch.chunk(get(f"linear_fc1.{kind}"), 2, dim=0)
            out[f"down_proj.{kind}"] = get(f"linear_fc2.{kind}")
        return out


def _hf_kinds(config: TransformerConfig) -> tuple[str, ...]:
    if not config.gated_linear_unit:
        raise ValueError("a Llama-style MLP is gated (model.activation=swiglu or geglu_tanh); this one is not")
    return ("weight", "bias") if config.add_bias_linear else ("weight",)
