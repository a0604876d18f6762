"""The one bridge from our config schema to Megatron-Core's config objects.

`parallel.dist_opt` feeds both DDP and the optimizer here, so they cannot disagree; every other
Megatron-Core knob the template sets is in this file, with the reason.
"""

from __future__ import annotations

import functools

import torch
import torch.nn.functional as F
from megatron.core.distributed import DistributedDataParallelConfig
from megatron.core.fusions.fused_bias_geglu import quick_gelu
from megatron.core.optimizer import OptimizerConfig
from megatron.core.transformer.transformer_config import TransformerConfig

from models import mla
from models.shape import ModelShape
from training.config.schema import Activation, Config, Precision, Recompute
from training.config.optim_defaults import min_lr, peak_lr
from training.parallel import fsdp
from training.shims import upstream_fixes

# swiglu: SiLU(gate) * up, geglu_tanh: GeLU-tanh(gate) * up, clamped_swiglu: gpt-oss's g * sigmoid(1.702 g) *
# (up + 1) with both clamped: Megatron-Core's quick_gelu with glu_linear_offset and activation_func_clamp_value
# (its experts' MLP and models/mlp.py apply them) (gated: ModelShape.gated)
ACTIVATIONS = {Activation.gelu: F.gelu, Activation.swiglu: F.silu,
               Activation.geglu_tanh: functools.partial(F.gelu, approximate="tanh"),
               Activation.clamped_swiglu: quick_gelu}


def params_dtype(cfg: Config) -> torch.dtype:
    return torch.bfloat16 if cfg.train.precision == Precision.bf16 else torch.float32


def fused_kernels(cfg: Config) -> bool:
    """Megatron-Core's own fusions that need neither TE nor apex (torch.compile'd: SwiGLU, vocab-parallel
    cross entropy). null = on GPUs; off on CPU, where inductor's first compile costs ~30 s a process."""
    return torch.cuda.is_available() if cfg.model.fused_kernels is None else cfg.model.fused_kernels


def transformer_config(cfg: Config, shape: ModelShape) -> TransformerConfig:
    """Megatron-Core's TransformerConfig: the sizes from the resolved shape, the rest from cfg."""
    m, p = cfg.model, cfg.parallel
    fuse = fused_kernels(cfg)
    dtype = params_dtype(cfg)
    recompute = None if m.recompute == Recompute.none else str(m.recompute)
    config = TransformerConfig(
        # shape (models/shape.py resolved every default: GQA groups, head dim, FFN width)
        num_layers=shape.num_layers, hidden_size=shape.hidden_size, num_attention_heads=shape.num_attention_heads,
        num_query_groups=shape.num_query_groups, ffn_hidden_size=shape.ffn_hidden_size,
        kv_channels=shape.kv_channels, normalization=shape.normalization, layernorm_epsilon=shape.norm_epsilon,
        add_bias_linear=shape.add_bias_linear, add_qkv_bias=shape.qkv_bias, gated_linear_unit=shape.gated,
        # per head: also tells finalize_model_grads to sum the q/k norms' grads over TP; over the projections
        # (OLMo 2, models/qk_norm.py) the weights are TP shards with whole gradients: nothing to sum
        qk_layernorm=shape.qk_norm and shape.qk_norm_span == "head",
        layernorm_zero_centered_gamma=shape.norm_zero_centered,  # (1 + weight) in every norm (models/norm.py)
        activation_func=ACTIVATIONS[m.activation],
        **({"glu_linear_offset": 1.0, "activation_func_clamp_value": shape.swiglu_limit}
           if m.activation == Activation.clamped_swiglu else {}),
        hidden_dropout=m.hidden_dropout, attention_dropout=m.attention_dropout,
        init_method_std=m.init_method_std,
        # parallelism
        tensor_model_parallel_size=p.tp, pipeline_model_parallel_size=p.pp,
        virtual_pipeline_model_parallel_size=p.vpp, sequence_parallel=p.sp,
        context_parallel_size=p.cp,  # models/context_parallel.py: all-gather-KV attention (no TE needed)
        expert_model_parallel_size=p.ep, expert_tensor_parallel_size=p.etp,
        **moe_settings(cfg, shape),
        **attention_settings(shape),
        **upstream_fixes.pipeline_p2p_settings(p.pp, p.vpp),
        # CPU: build each full weight once and slice it (TP init then equals one process's); on GPU,
        # Megatron's per-rank init on the device is much faster for large models.
        use_cpu_initialization=not torch.cuda.is_available(),
        # precision: bf16 params/activations; fp32 main params and grads live in the optimizer/DDP
        params_dtype=dtype, pipeline_dtype=dtype, bf16=dtype == torch.bfloat16,
        # the loss is a token sum; finalize_model_grads divides grads by the global batch's token count
        calculate_per_token_loss=True,
        recompute_granularity=recompute,
        recompute_method="uniform" if recompute == "full" else None,
        recompute_num_layers=1 if recompute == "full" else None,
        # free pipeline outputs once sent (Megatron-LM's default): activation memory of PP stages
        deallocate_pipeline_outputs=True,
        # torch.compile'd fusions (fused_kernels above): SwiGLU (models/mlp.py; MCore fuses gelu only with
        # a bias) and the vocab-parallel cross entropy (LanguageModule.compute_language_model_loss). The
        # latter only in bf16: 0.19.2's native version returns bf16 logit gradients whatever the dtype
        # (fusions/fused_cross_entropy.py), exactly what bf16 runs get unfused, a ~1e-3 error in fp32.
        bias_activation_fusion=fuse and m.activation == Activation.swiglu, cross_entropy_fusion_impl="native",
        cross_entropy_loss_fusion=fuse and dtype == torch.bfloat16,
        # these need TE or apex (RoPE, softmax, weight-grad accumulation) or add nothing here (bias-dropout
        # fusion: our dropout is 0 for pretraining); TE's versions come with the TE path
        bias_dropout_fusion=False, apply_rope_fusion=False, masked_softmax_fusion=False,
        gradient_accumulation_fusion=False,
    )
    # which sub-blocks split over TP (parallel.tp_blocks); the rest are built whole (models/tp_blocks.py)
    config.tp_blocks = tuple(str(block) for block in p.tp_blocks)
    # the model's options Megatron-Core has no field for: models/qk_norm.py, models/embedding.py read them
    config.qk_norm_span = shape.qk_norm_span if shape.qk_norm else None
    config.scale_embedding = shape.scale_embedding
    config.attn_logit_softcap = shape.attn_logit_softcap  # Gemma 2's (models/core_attention.py); no MCore field
    config.mla = shape.mla  # multi-latent attention's sizes (models/mla.py), None otherwise
    return config


def attention_settings(shape: ModelShape) -> dict:
    """Megatron-Core's fields for the attention options models/core_attention.py reads: the window as TE's
    (left, right) = (window - 1, 0) on the layers marked 1, the softmax scale, learned sinks."""
    window = shape.sliding_window
    return dict(
        window_size=(window - 1, 0) if window else None,
        window_attn_skip_freq=[int(kind == "sliding") for kind in shape.layer_types] if window else None,
        softmax_scale=mla.softmax_scale(shape) if shape.mla else
        shape.query_pre_attn_scalar ** -0.5 if shape.query_pre_attn_scalar else None,
        softmax_type="learnable" if shape.attention_sinks else "vanilla",
    )


def moe_settings(cfg: Config, shape: ModelShape) -> dict:
    """Megatron-Core's MoE fields (none for a dense model): models/moe.py builds its MoELayer from them."""
    if not shape.num_experts:
        return {}
    moe = cfg.model.moe
    return dict(
        num_moe_experts=shape.num_experts, moe_router_topk=shape.moe_top_k,
        moe_ffn_hidden_size=shape.moe_ffn_hidden_size,
        moe_shared_expert_intermediate_size=shape.moe_shared_ffn_hidden_size,
        # Switch Transformer's load-balancing loss over each micro-batch's tokens (Megatron-LM's default)
        moe_router_load_balancing_type="aux_loss" if moe.aux_loss_coeff > 0 else "none",
        moe_aux_loss_coeff=moe.aux_loss_coeff, moe_z_loss_coeff=moe.z_loss_coeff,
        moe_router_score_function=shape.moe_score_function, moe_router_pre_softmax=shape.moe_pre_softmax,
        moe_token_dispatcher_type=str(moe.dispatcher),
        # no token dropping unless asked: every token reaches its experts, as in one process
        moe_expert_capacity_factor=moe.capacity_factor, moe_token_drop_policy="probs",
        moe_pad_expert_input_to_capacity=False,
        moe_grouped_gemm=moe.grouped_gemm,
        # the router in fp32 (its softmax and top-k decide which expert a token goes to, also under bf16)
        moe_router_dtype="fp32",
        # DeepSeek-V3's: the expert-bias correction (updated in finalize_model_grads from the load summed over
        # TP x CP x DP), group-limited top-k, the routed weights' scale (sigmoid: top-k renormalised when k > 1)
        moe_router_enable_expert_bias=moe.router_expert_bias, moe_router_bias_update_rate=moe.router_bias_update_rate,
        moe_router_num_groups=moe.router_num_groups, moe_router_group_topk=moe.router_group_topk,
        moe_router_topk_scaling_factor=moe.router_topk_scaling_factor,
    )


def ddp_config(cfg: Config) -> DistributedDataParallelConfig:
    p = cfg.parallel
    return DistributedDataParallelConfig(
        grad_reduce_in_fp32=True,  # reduce and accumulate gradients in fp32 also under bf16
        overlap_grad_reduce=p.overlap_grad_reduce, overlap_param_gather=p.overlap_param_gather,
        use_distributed_optimizer=p.dist_opt, bucket_size=p.bucket_size,
        average_in_collective=False,  # the per-token loss is normalised in finalize_model_grads
        **fsdp.ddp_settings(cfg),  # Megatron-FSDP's (training/parallel/fsdp.py): ZeRO-2 / ZeRO-3 over DP
    )


def optimizer_config(cfg: Config) -> OptimizerConfig:
    o = cfg.optim
    dtype = params_dtype(cfg)
    return OptimizerConfig(
        optimizer="adam", lr=peak_lr(cfg), min_lr=min_lr(cfg), weight_decay=o.weight_decay,
        adam_beta1=o.adam_beta1, adam_beta2=o.adam_beta2, adam_eps=o.adam_eps, clip_grad=o.clip_grad,
        bf16=dtype == torch.bfloat16, params_dtype=dtype,
        use_distributed_optimizer=cfg.parallel.dist_opt,
        overlap_param_gather=cfg.parallel.overlap_param_gather,
    )


def scheduler_kwargs(cfg: Config) -> dict:
    """Arguments of Megatron-Core's OptimizerParamScheduler, stepped once per iteration."""
    o = cfg.optim
    decay_end = o.decay_iters if o.decay_iters is not None else max(cfg.train.iters, 1)
    return dict(
        init_lr=0.0, max_lr=peak_lr(cfg), min_lr=min_lr(cfg), lr_warmup_steps=o.warmup_iters,
        lr_decay_steps=max(decay_end, o.warmup_iters + 1), lr_decay_style=str(o.decay_style),
        start_wd=o.weight_decay, end_wd=o.weight_decay, wd_incr_steps=decay_end, wd_incr_style="constant",
        # the config, not the checkpoint, defines the schedule: raising train.iters on resume extends it
        use_checkpoint_opt_param_scheduler=False, override_opt_param_scheduler=True,
    )




def lr_at(cfg: Config, iteration: int) -> float:
    """The learning rate cfg's schedule (scheduler_kwargs) gives at `iteration`, without building an optimizer."""
    from megatron.core.optimizer_param_scheduler import OptimizerParamScheduler

    group = {"lr": 0.0, "weight_decay": 0.0}
    scheduler = OptimizerParamScheduler(type("Groups", (), {"param_groups": [group]})(), **scheduler_kwargs(cfg))
    scheduler.num_steps = iteration
    return scheduler.get_lr(group)
