"""Every built-in block's activation_bytes (models/spec.py) against what its forward saves for backward.

One process, tp 1, dropout 0, torch's CPU flash-attention kernel (scaled_dot_product_attention picks it: no s x s
scores, as the GPU kernels), fp32 unless a case says bf16. Measured: the storages autograd saves during the
block's forward (torch.autograd.graph.saved_tensors_hooks), each once; parameters are excluded, and so is module
state, i.e. whatever a second forward saves again (RoPE's cached cos / sin). The declaration must be within 10%
(the built-in ones leave out O(s) statistics: norms' 1/rms, the softmax's log-sum-exp). Context parallelism's K/V
all-gather is replaced by cp copies of the local K and V (one process, the shapes of a CP rank). The fused SwiGLU
kernels run eagerly (torch.compiler's force_eager stance): what they save is their autograd.Function's choice.
"""

from __future__ import annotations

import pytest
import torch

from training.config.compose import compose

pytestmark = pytest.mark.fast  # ~13 s, most of it importing Megatron-Core and the first compose

TOLERANCE = 0.10
S, B = 64, 2  # tokens of each sequence on this rank, sequences per micro-batch
# tiny: h 128, 4 heads in 2 query groups of 32, ffn 352, RMSNorm, RoPE, SwiGLU; fused kernels pinned off (null
# would turn them on wherever CUDA is visible)
BASE = ["model=tiny", "model.vocab_size=256", "model.fused_kernels=false", "model.hidden_dropout=0",
        "model.attention_dropout=0", f"model.seq_length={S}", f"train.micro_batch_size={B}"]
MOE = ["model.moe.num_experts=4", "model.moe.top_k=2", "model.moe.first_dense=0"]
FUSED = ["model.fused_kernels=true"]
# name -> (overrides, the layer's sub-block measured; None: the whole layer against the estimate's layer)
CASES = {
    "norm-rmsnorm": ([], "input_layernorm"),
    "norm-layernorm": (["model.normalization=LayerNorm"], "input_layernorm"),
    "norm-zero-centered-bf16": (["model.norm_zero_centered=true", "train.precision=bf16"], "input_layernorm"),
    "attention-rope-gqa": ([], "self_attention"),
    "attention-rope-bf16": (["train.precision=bf16"], "self_attention"),
    "attention-learned-gqa": (["model.position_embedding=learned"], "self_attention"),
    "attention-learned-mha": (["model.position_embedding=learned", "model.num_query_groups=4"], "self_attention"),
    "attention-selective": (["model.recompute=selective"], "self_attention"),
    "attention-cp2": (["parallel.cp=2", f"model.seq_length={2 * S}"], "self_attention"),
    "attention-qk-norm": (["model.qk_norm=true", "model.qkv_bias=true", "model.kv_channels=48"], "self_attention"),
    "attention-qk-norm-cp2": (["model.qk_norm=true", "parallel.cp=2", f"model.seq_length={2 * S}"], "self_attention"),
    # a sliding window (SDPA, its mask shared by the layers); soft-capping and sinks: the explicit scores
    "attention-window": ([f"model.sliding_window={S // 4}"], "self_attention"),
    "attention-softcap-sinks": (["model.attn_logit_softcap=20", "model.attention_sinks=true"], "self_attention"),
    "attention-sinks-bf16-cp2": (["model.attention_sinks=true", "train.precision=bf16", "parallel.cp=2",
                                  f"model.seq_length={2 * S}"], "self_attention"),
    "attention-mla": (["model.attention=mla", "model.mla.q_lora_rank=48"], "self_attention"),
    "attention-mla-q-proj-bf16": (["model.attention=mla", "train.precision=bf16"], "self_attention"),
    "attention-qk-norm-projection": (["model.qk_norm=true", "model.qk_norm_span=projection"], "self_attention"),
    "mlp-swiglu": ([], "mlp"),
    "mlp-geglu-fused": (["model.activation=geglu_tanh", *FUSED], "mlp"),
    "mlp-swiglu-fused": (FUSED, "mlp"),
    "mlp-gelu": (["model.activation=gelu", "model.add_bias_linear=true"], "mlp"),
    "mlp-clamped-swiglu": (["model.activation=clamped_swiglu"], "mlp"),
    "gated_mlp-swiglu": (["model.mlp=gated_mlp"], "mlp"),
    "gated_mlp-gelu": (["model.mlp=gated_mlp", "model.activation=gelu"], "mlp"),
    "moe-swiglu": (MOE, "mlp"),
    "moe-swiglu-fused": ([*MOE, *FUSED], "mlp"),
    "moe-gelu": ([*MOE, "model.activation=gelu"], "mlp"),
    "moe-gpt-oss": ([*MOE, "model.activation=clamped_swiglu", "model.add_bias_linear=true"], "mlp"),
    "moe-shared-bf16": ([*MOE, "model.moe.shared_expert_ffn_hidden_size=64", "train.precision=bf16"], "mlp"),
    "layer-dense": ([], None),
    # Gemma 2/3's sandwich norms (four a layer), OLMo 2's post-norms (no input norms) with its QK-norm
    "layer-sandwich": (["model.norm_placement=sandwich", "model.norm_zero_centered=true"], None),
    "layer-post": (["model.norm_placement=post", "model.qk_norm=true", "model.qk_norm_span=projection"], None),
    "layer-moe-bf16": ([*MOE, "train.precision=bf16"], None),
}


def saved_bytes(module: torch.nn.Module, make_args) -> int:
    """Bytes of the storages `module`'s forward saves for backward, each once, less parameters and module state
    (what a second forward saves again). Both forwards' tensors stay referenced, so no address is reused."""
    params = {p.untyped_storage().data_ptr() for p in module.parameters()}
    runs = []
    for _ in range(2):
        saved: dict[int, torch.Tensor] = {}

        def pack(t: torch.Tensor, saved=saved) -> torch.Tensor:
            saved.setdefault(t.untyped_storage().data_ptr(), t)
            return t

        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            out = module(*make_args())
        runs.append((saved, out))
    skip = params | set(runs[0][0])
    return sum(t.untyped_storage().nbytes() for ptr, t in runs[1][0].items() if ptr not in skip)


def measure(case: str) -> tuple[float, float]:
    """(measured, declared) bytes of one case."""
    from megatron.core.models.common.embeddings.rotary_pos_embedding import RotaryEmbedding

    import models.context_parallel as context_parallel
    from models.activations import ActivationContext
    from models.extra_losses import take_recorded
    from models.layer import TransformerLayer
    from models.rope import rotary_dim
    from models.shape import ModelShape, Split
    from models.spec import layer_spec
    from training.engine.bridge import fused_kernels, params_dtype, transformer_config
    from training.estimate.memory import layer_activations
    from training.parallel.layout import Layout

    overrides, name = CASES[case]
    cfg = compose([*BASE, *overrides])
    cp = cfg.parallel.cp
    assert cfg.model.seq_length == S * cp, "a case's sequence is S tokens on each CP rank"
    shape, dtype = ModelShape.of(cfg.model), params_dtype(cfg)
    config = transformer_config(cfg, shape)
    rope = shape.position_embedding == "rope"
    freqs = RotaryEmbedding(rotary_dim(shape), rotary_percent=1.0, rotary_base=shape.rotary_base,
                            use_cpu_initialization=True)(S) if rope else None  # [s, 1, 1, hn]

    def args():
        x = torch.randn(S, B, shape.hidden_size, dtype=dtype, requires_grad=True)  # [s, b, h]
        return (x, freqs) if name in (None, "self_attention") else (x,)

    if name is None:
        module = TransformerLayer(config, shape, 1)
        declared = layer_activations(cfg, shape, Layout.of(cfg, cp), flash_attention=True)
    else:
        block = dict(layer_spec(shape, 1).items())[name]
        module = block(config, 1)
        act = ActivationContext(B, S, dtype.itemsize, cp=cp, fused=fused_kernels(cfg),
                                recompute=str(cfg.model.recompute))
        declared = block.activation_bytes(shape, Split(), act)
    gather, state = context_parallel.gather_from_sequence_parallel_region, context_parallel.parallel_state
    try:
        if cp > 1:  # one process: each CP rank's gathered K/V is cp local copies long, CP rank 0's mask
            context_parallel.gather_from_sequence_parallel_region = lambda t, group=None: torch.cat([t] * cp)
            context_parallel.parallel_state = _OneCpRank
        with torch.compiler.set_stance("force_eager"):
            measured = saved_bytes(module.to(dtype), args)
    finally:
        context_parallel.gather_from_sequence_parallel_region, context_parallel.parallel_state = gather, state
        take_recorded()  # the MoE router's statistics
    return measured, declared


class _OneCpRank:
    get_context_parallel_group = staticmethod(lambda: None)
    get_context_parallel_rank = staticmethod(lambda: 0)


@pytest.mark.parametrize("case", list(CASES))
def test_declared_activation_bytes_match_what_the_forward_saves(case, one_process):
    measured, declared = measure(case)
    assert measured > 0 and abs(declared - measured) <= TOLERANCE * measured, \
        f"{case}: declared {declared:,.0f} bytes, measured {measured:,} ({declared / measured - 1:+.1%})"


def test_a_block_without_activation_bytes_is_refused():
    from models.spec import BlockError, resolve_block

    with pytest.raises(BlockError, match="activation_bytes"):
        resolve_block("models.embedding:Embedding")  # declares num_params only


STEP = ["model=tiny", "model.num_layers=2", "model.vocab_size=256", "model.fused_kernels=false",
        f"model.seq_length={S}", f"train.micro_batch_size={B}", f"train.global_batch_size={2 * B}",
        "checkpoint=none", "train.tensorboard=false"]


# packed conversations (data.format=sft) at a longer sequence, where their [b, 1, s, s] mask is ~16% of the total
SFT = ["model.recompute=none", "data.format=sft", "data.paths=[unused]", "model.seq_length=1024"]


def _whole_step(recomputes: list[str]) -> dict:
    """Per model.recompute (or "sft": packed conversations): (bytes the forward passes of one micro-batch saved in
    a real train_step, measured by training/bench/measure.py as tools/bench.py --detail does; the estimate's
    bytes for them)."""
    from models.shape import ModelShape
    from training.bench import benchmark as bm
    from training.bench.measure import SavedActivations, activation_estimate
    from training.config.validate import validate
    from training.engine.build import build
    from training.engine.step import forward_step, train_step
    from training.parallel import dist as D

    out = {}
    with D.distributed(timeout_minutes=2) as info:
        for recompute in recomputes:
            cfg = compose([*STEP, *(SFT if recompute == "sft" else [f"model.recompute={recompute}"])])
            layout = validate(cfg)
            state = build(cfg, ModelShape.of(cfg.model), info.device)
            batch, s = bm.synthetic_batch(cfg, 256), cfg.model.seq_length
            for sample in batch if recompute == "sft" else ():  # two conversations a sequence, positions from 0
                sample["position_ids"] = torch.cat([torch.arange(s // 2), torch.arange(s - s // 2)])  # [s]
                sample["segment_ids"] = (torch.arange(s) >= s // 2).long() + 1  # [s]: 1 then 2
            streams = bm.batch_streams(state, batch, cfg)
            saved = SavedActivations(state)
            train_step(state, streams(), layout, cfg, info.device, step=saved.forward_step(forward_step))
            out[recompute] = (saved.peak, activation_estimate(cfg, state.shape, layout, info.device))
    return out


def test_bench_counts_what_the_forward_saves_with_recomputation():
    """tools/bench.py --detail's activations per micro-batch (training/bench/measure.py) at every model.recompute,
    within 10% of the estimate: recomputation in backward saves again what the forward dropped, which must not
    count (it did: selective and full read 0.02-0.66 of the estimate, varying run to run); and with packed
    conversations, whose block-diagonal mask each micro-batch keeps."""
    from harness import run_distributed

    (r,) = run_distributed(_whole_step, world_size=1, args=(["none", "selective", "full", "sft"],), timeout=300)
    for recompute, (measured, declared) in r.items():
        assert measured > 0 and abs(declared - measured) <= TOLERANCE * measured, \
            f"{recompute}: estimate {declared:,.0f} bytes, measured {measured:,} ({declared / measured - 1:+.1%})"
    assert r["full"][0] < 0.5 * r["none"][0], r  # full keeps each layer's input only
