"""LayerNorm / RMSNorm over the hidden dimension, sequence-parallel aware.

Under sequence parallelism each TP rank normalises its own slice of the sequence with the same
(replicated) weight, so the weight's gradient is partial: the `sequence_parallel` attribute tells
Megatron-Core's `finalize_model_grads` to all-reduce it across the TP group.

Zero-centred (`model.norm_zero_centered`, Megatron-Core's `layernorm_zero_centered_gamma`, Gemma): the norm
applies (1 + weight) and the weight starts at 0; the stored weight is Gemma's as it is. (1 + weight) and, below
fp32, the norm itself are computed in fp32 and rounded once, as transformers' Gemma2RMSNorm does (bf16's 1 + w
would round a small w away).
"""

import torch
import torch.nn.functional as F
from megatron.core.transformer.module import MegatronModule
from megatron.core.transformer.transformer_config import TransformerConfig

from models.activations import ActivationContext
from models.shape import ModelShape, Split


class RMSNormCPU(torch.autograd.Function):
    """F.rms_norm with a hand-written backward, for CPU: torch has a fused RMSNorm backward kernel only for CUDA,
    and on CPU differentiates the decomposed forward (pow, mean, rsqrt, 3 muls: ~25 kernels for the gradient).
    The forward is torch's own kernel (bit-identical output), which also returns 1/rms; the backward is 7:
        x^ = x r,  t = g x^,  dw = sum_tokens t,  dx = r (g w - x^ (t . w) / h)     (r = 1/rms over h)
    in fp32 (as torch computes the norm) and rounded once to the input's dtype. Measured on 2 cores, forward +
    backward: 0.93x at [128, 4, 128], 0.72x at [256, 4, 512]; the gradient within 1e-7 (fp32) of autograd's."""

    @staticmethod
    def forward(ctx, x, weight, eps):  # x [s(/tp), b, h], weight [h]
        y, rstd = torch.ops.aten._fused_rms_norm(x, [x.shape[-1]], weight, eps)  # y like x; rstd [s, b, 1] fp32
        ctx.save_for_backward(x, weight, rstd)
        return y

    @staticmethod
    def backward(ctx, grad):  # grad [s, b, h]
        x, weight, rstd = ctx.saved_tensors
        h = x.shape[-1]
        dtype = torch.promote_types(x.dtype, torch.float32)  # fp32 for bf16 / fp16 / fp32
        g, w = grad.to(dtype), weight.to(dtype)
        x_hat = x.to(dtype) * rstd  # [s, b, h]
        t = g * x_hat
        grad_w = t.reshape(-1, h).sum(0).to(weight.dtype) if ctx.needs_input_grad[1] else None  # [h]
        dot = t.matmul(w).unsqueeze(-1)  # [s, b, 1]: sum over h of g w x^
        grad_x = torch.addcmul(g * w, x_hat, dot, value=-1.0 / h).mul_(rstd)
        return grad_x.to(x.dtype), grad_w, None


class Norm(MegatronModule):
    """Over the last dimension of `size` (default: hidden_size; models/attention.py's QK-norm: the head dim)."""

    def __init__(self, config: TransformerConfig, layer_number: int | None = None, size: int | None = None):
        super().__init__(config=config)
        self.kind = config.normalization  # "LayerNorm" | "RMSNorm"
        self.eps = config.layernorm_epsilon
        size = size or config.hidden_size
        self.zero_centered = config.layernorm_zero_centered_gamma
        init = torch.zeros if self.zero_centered else torch.ones  # a constant: training/engine/init.py keeps it
        self.weight = torch.nn.Parameter(init(size, dtype=config.params_dtype))
        if self.kind == "LayerNorm":
            self.bias = torch.nn.Parameter(torch.zeros(size, dtype=config.params_dtype))
        elif self.kind == "RMSNorm":
            self.register_parameter("bias", None)
        else:
            raise ValueError(f"unknown normalization {self.kind!r}: use LayerNorm or RMSNorm")
        for param in self.parameters():
            param.sequence_parallel = config.sequence_parallel

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # [s(/tp), b, h] (or [s, b, heads/tp, hn]) -> same
        if self.zero_centered:  # (1 + w) and the norm in fp32 (module docstring), rounded once to x's dtype
            return self._norm(x.float(), self.weight.float() + 1).to(x.dtype)
        return self._norm(x, self.weight)

    def _norm(self, x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
        shape = (x.shape[-1],)
        if self.kind == "LayerNorm":
            bias = self.bias.to(x.dtype) if self.bias is not None else None
            return F.layer_norm(x, shape, weight, bias, self.eps)
        if x.device.type == "cpu" and torch.is_grad_enabled():  # CUDA has a fused backward kernel; CPU has not
            return RMSNormCPU.apply(x, weight, self.eps)
        return F.rms_norm(x, shape, weight, self.eps)

    @staticmethod
    def num_params(shape: ModelShape, split: Split) -> int:  # replicated on every TP rank
        return shape.hidden_size * (2 if shape.normalization == "LayerNorm" else 1)

    @staticmethod
    def flops_per_token(shape: ModelShape) -> float:  # not counted (Megatron's formula counts GEMMs)
        return 0.0

    @staticmethod
    def activation_bytes(shape: ModelShape, split: Split, act: ActivationContext) -> float:
        """Its input [s(/tp), b, h] (the fp32 statistics, 1 or 2 per token, are left out); zero-centred, the
        input's fp32 copy below fp32."""
        e = max(act.bytes, 4) if shape.norm_zero_centered else act.bytes
        return e * act.tokens * shape.hidden_size / act.seq_split(split)

    # ---- Hugging Face interop (Llama family): this block's weights <-> HF's `*layernorm` / `norm` ---------
    # The same names on both sides ("weight", "bias" for LayerNorm; Llama's RMSNorm has no bias). `get` reads
    # a tensor by name relative to the block, each side's names; training/interop/hf.py walks the model.
    @staticmethod
    def from_hf(get, config: TransformerConfig) -> dict[str, torch.Tensor]:
        return {name: get(name) for name in _hf_names(config)}

    @staticmethod
    def to_hf(get, config: TransformerConfig) -> dict[str, torch.Tensor]:
        return {name: get(name) for name in _hf_names(config)}


def _hf_names(config: TransformerConfig) -> tuple[str, ...]:
    return ("weight", "bias") if config.normalization == "LayerNorm" else ("weight",)
