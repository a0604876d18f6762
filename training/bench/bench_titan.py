"""The torchtitan side of `tools/bench.py --compare`: torchtitan 0.3.0's Llama3Model (fused QKV, RoPE as a complex
multiply, nn.RMSNorm, nn.Linear) at our model's shape, loaded with our weights through torchtitan's own
`Llama3StateDictAdapter.from_hf` from the Hugging Face tensors of our model (training/interop/hf.py), and trained
as training/bench/bench_hf.py trains transformers' Llama (the same micro-batches, token-mean loss, torch AdamW,
clipping and schedule).

torchtitan is an optional bench extra, installed without its declared dependencies (datasets, torchdata, ...,
which its model does not import): `pip install --no-deps -c constraints.txt torchtitan==0.3.0` and
`pip install -c constraints.txt -e ".[bench]"` (its few pure-Python needs).

Attention: torchtitan 0.3.0 builds its language models with FlexAttention or varlen attention (document masks from
positions); a plain causal batch needs neither, so its `ScaledDotProductAttention` (F.scaled_dot_product_attention,
is_causal) is the inner attention here, the kernel ours and transformers' call.
"""

from __future__ import annotations

import importlib.util

import torch

from training.bench.bench_hf import PlainSide, check_plain, plain_side
from training.config.schema import Config
from training.errors import ConfigError
from training.interop import hf, hf_config

TORCHTITAN = "0.3.0"  # the release whose module layout this file builds (constraints.txt pins it)
INSTALL = (f'pip install --no-deps -c constraints.txt torchtitan=={TORCHTITAN} && pip install -c constraints.txt '
           f'-e ".[bench]"')


def titan_config(shape):
    """torchtitan's Llama3Model.Config at our shape (models/shape.py: sizes, norm epsilon, RoPE base and Llama 3
    scaling), SDPA attention, fused QKV as torchtitan's presets build it."""
    from torchtitan.models.common import ComplexRoPE, Embedding, Linear, RMSNorm
    from torchtitan.models.common.attention import ScaledDotProductAttention
    from torchtitan.models.common.config_utils import make_ffn_config, make_gqa_config
    from torchtitan.models.llama3 import Llama3Model
    from torchtitan.models.llama3.model import Llama3TransformerBlock

    if hf_config.family(shape) != "llama" or shape.qkv_bias or (shape.position_embedding, shape.normalization,
                                                                shape.activation) != ("rope", "RMSNorm", "swiglu") or \
            shape.kv_channels * shape.num_attention_heads != shape.hidden_size:
        raise ConfigError("--compare builds torchtitan's Llama 3: RoPE, no biases, no QK-norm, kv_channels = "
                          "hidden_size / heads (drop model.add_bias_linear, model.qkv_bias, model.qk_norm, "
                          "model.kv_channels; RoPE, RMSNorm, SwiGLU)")
    s, dim, vocab, eps = shape.rope_scaling, shape.hidden_size, shape.vocab_size, shape.norm_epsilon
    scaling = {} if s is None else dict(
        scaling="llama", scaling_factor=s.factor, low_freq_factor=s.low_freq_factor,
        high_freq_factor=s.high_freq_factor, original_max_position_embeddings=s.original_max_position)
    rope = ComplexRoPE.Config(dim=shape.kv_channels, max_seq_len=shape.seq_length, theta=shape.rotary_base,
                              **scaling)
    layers = [Llama3TransformerBlock.Config(
        attention_norm=RMSNorm.Config(normalized_shape=dim, eps=eps),
        ffn_norm=RMSNorm.Config(normalized_shape=dim, eps=eps),
        attention=make_gqa_config(dim=dim, n_heads=shape.num_attention_heads, n_kv_heads=shape.num_query_groups,
                                  wqkv_param_init={}, wo_param_init={}, fuse_qkv=True, rope=rope,
                                  inner_attention=ScaledDotProductAttention.Config()),
        feed_forward=make_ffn_config(dim=dim, hidden_dim=shape.ffn_hidden_size, w1_param_init={},
                                     w2w3_param_init={}))
        for _ in range(shape.num_layers)]
    return Llama3Model.Config(dim=dim, vocab_size=vocab, enable_weight_tying=shape.tie_embeddings,
                              tok_embeddings=Embedding.Config(num_embeddings=vocab, embedding_dim=dim),
                              norm=RMSNorm.Config(normalized_shape=dim, eps=eps),
                              lm_head=Linear.Config(in_features=dim, out_features=vocab), layers=layers)


def build_titan(state, cfg: Config, device: torch.device) -> PlainSide:
    """torchtitan's Llama3Model with the weights of our single-process model `state` (TrainState, tp = pp = 1),
    through Llama3StateDictAdapter.from_hf (its Q/K permutation to interleaved RoPE pairs, the fused QKV's
    load hook); every tensor of its state dict must be loaded."""
    if importlib.util.find_spec("torchtitan") is None:
        raise ConfigError(f"--compare needs torchtitan (an optional bench extra): {INSTALL}")
    from torchtitan.models.llama3 import Llama3StateDictAdapter

    check_plain(state, cfg, "--compare")
    config = titan_config(state.shape)
    with torch.device(device):
        model = config.build()
    tensors = Llama3StateDictAdapter(config, None).from_hf(dict(hf.hf_tensors(state)))
    model.load_state_dict(tensors, strict=True)  # raises on a missing or unexpected tensor
    return plain_side(model, cfg, lambda m, tokens: m(tokens))


def titan_state_dict_as_hf(side: PlainSide) -> dict:
    """The torchtitan model's weights under Hugging Face names (its adapter's to_hf), for comparisons."""
    from torchtitan.models.llama3 import Llama3StateDictAdapter

    return Llama3StateDictAdapter(side.model.config, None).to_hf(side.model.state_dict())
