"""QK-norm, the norm on the queries and keys before RoPE (model.qk_norm), over one of two spans:

    head        one norm over hn, its weight [hn] shared by every head (Qwen3, Gemma 3): models/norm.py's Norm
    projection  one RMSNorm over the whole q projection (np*hn) and one over the whole k (ng*hn) (OLMo 2)

Over the projection, with TP each rank holds np/tp heads but the mean of squares spans the heads of every rank:
the local sums of squares are all-reduced over the TP group (divided by the full width), and so is the one sum
the input's gradient needs. The weights, [np*hn] and [ng*hn], are split over TP like the heads: rank r holds
the contiguous slice of its heads (a TP-sharded parameter; its gradient is whole on its rank: nothing to sum).
"""

import torch
import torch.distributed as dist
from megatron.core import parallel_state
from megatron.core.tensor_parallel.layers import set_tensor_model_parallel_attributes
from megatron.core.transformer.module import MegatronModule
from megatron.core.transformer.transformer_config import TransformerConfig
from megatron.core.transformer.utils import make_sharded_tensors_for_checkpoint
from megatron.core.utils import divide

from models.norm import Norm
from models.shape import ModelShape, Split


def qk_norm_params(shape: ModelShape, split: Split) -> int:
    """QK-norm's parameters on one GPU: per head 2 x [hn] (LayerNorm: and biases), replicated; over the
    projections [np*hn] + [ng*hn], split over TP like the heads."""
    if not shape.qk_norm:
        return 0
    if shape.qk_norm_span == "projection":
        return (shape.q_width + shape.kv_width) // split.tp
    return 2 * shape.kv_channels * (2 if shape.normalization == "LayerNorm" else 1)


def qk_norms(config: TransformerConfig) -> tuple[torch.nn.Module | None, torch.nn.Module | None]:
    """(q's norm, k's norm) for models/attention.py, or (None, None) without QK-norm. The names it gives them,
    q_layernorm / k_layernorm, are those Megatron-Core's finalize_model_grads sums over TP (per head only:
    training/engine/bridge.py sets qk_layernorm for that span alone)."""
    if getattr(config, "qk_norm_span", None) == "projection":
        return ProjectionNorm(config, config.num_attention_heads), ProjectionNorm(config, config.num_query_groups)
    if config.qk_layernorm:
        return Norm(config, size=config.kv_channels), Norm(config, size=config.kv_channels)
    return None, None


class _ProjectionRMSNorm(torch.autograd.Function):
    """y = x w / rms(x) over the last two dims of every rank's x together, in fp32, rounded once to x's dtype:
        r = (sum_ranks sum x^2 / n + eps)^-1/2,  dw = sum_tokens g x r,  dx = r (g w - x r (sum_ranks g w x r) / n)
    (n: the full width). Saves x, the weight and r [s, b, 1, 1], as models/norm.py's RMSNormCPU does."""

    @staticmethod
    def forward(ctx, x, weight, eps: float, width: int, group):  # x [s, b, heads/tp, hn]; weight [heads/tp, hn]
        squares = x.float().square().sum((-2, -1), keepdim=True)  # [s, b, 1, 1]: this rank's heads
        if group is not None:
            dist.all_reduce(squares, group=group)  # every rank's heads
        rstd = torch.rsqrt(squares / width + eps)
        ctx.save_for_backward(x, weight, rstd)
        ctx.width, ctx.group = width, group
        return (x.float() * rstd * weight.float()).to(x.dtype)

    @staticmethod
    def backward(ctx, grad):  # grad [s, b, heads/tp, hn]
        x, weight, rstd = ctx.saved_tensors
        x_hat, g = x.float() * rstd, grad.float()
        gw = g * weight.float()
        dot = (gw * x_hat).sum((-2, -1), keepdim=True)  # [s, b, 1, 1]
        if ctx.group is not None:
            dist.all_reduce(dot, group=ctx.group)
        grad_x = (gw - x_hat * (dot / ctx.width)) * rstd
        grad_w = (g * x_hat).reshape(-1, *weight.shape).sum(0).to(weight.dtype) if ctx.needs_input_grad[1] else None
        return grad_x.to(x.dtype), grad_w, None, None, None


class ProjectionNorm(MegatronModule):
    """RMSNorm over all `heads` x hn of q (heads = np) or k (heads = ng), the weight split over TP like them."""

    def __init__(self, config: TransformerConfig, heads: int):
        super().__init__(config=config)
        tp = config.tensor_model_parallel_size  # 1 also when attention is whole on every rank (parallel.tp_blocks)
        self.split = tp > 1
        self.width, self.eps = heads * config.kv_channels, config.layernorm_epsilon
        self.zero_centered = config.layernorm_zero_centered_gamma
        init = torch.zeros if self.zero_centered else torch.ones  # a constant: training/engine/init.py keeps it
        self.weight = torch.nn.Parameter(init(divide(heads, tp) * config.kv_channels, dtype=config.params_dtype))
        if self.split:  # [heads/tp * hn]: this rank's heads' slice (checkpoints, the layout tests' slicing)
            set_tensor_model_parallel_attributes(self.weight, True, 0, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # [s, b, heads/tp, hn] -> same
        group = parallel_state.get_tensor_model_parallel_group() if self.split else None
        weight = self.weight.float() + 1 if self.zero_centered else self.weight
        return _ProjectionRMSNorm.apply(x, weight.view(-1, x.shape[-1]), self.eps, self.width, group)

    def sharded_state_dict(self, prefix="", sharded_offsets=(), metadata=None):
        """The weight as TP shards of one global [heads*hn] tensor (whole when not split)."""
        state = {"weight": self.weight}
        return make_sharded_tensors_for_checkpoint(state, prefix, {"weight": 0} if self.split else {},
                                                   sharded_offsets)
