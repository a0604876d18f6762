"""The model's part of the typed config schema (model.*: training/config/schema.py composes it into Config, and
re-exports these names). Every field has a default and a one-line reason; a field with a fixed set of choices is
an Enum (OmegaConf refuses any other value while composing)."""

from __future__ import annotations

from dataclasses import dataclass, field
from enum import StrEnum
from typing import Optional

from training.config.schema_rope import RopeScalingConfig

class PositionEmbedding(StrEnum):
    rope = "rope"
    learned = "learned"


class Normalization(StrEnum):
    LayerNorm = "LayerNorm"
    RMSNorm = "RMSNorm"


class Activation(StrEnum):
    gelu = "gelu"
    swiglu = "swiglu"  # gated: SiLU(gate) * up, fc1 doubled
    geglu_tanh = "geglu_tanh"  # gated: GeLU(gate, tanh approximation) * up (Gemma's gelu_pytorch_tanh)
    # gated (gpt-oss): g * sigmoid(1.702 g) * (clamp(up, -limit, limit) + 1), g = min(gate, limit)
    clamped_swiglu = "clamped_swiglu"


class NormPlacement(StrEnum):
    pre = "pre"  # a norm before attention and before the MLP (Llama, GPT-2)
    sandwich = "sandwich"  # also one after each, before the residual add: four a layer (Gemma 2 / 3)
    post = "post"  # only after each, before the residual add; no input norms (OLMo 2)


class QkNormSpan(StrEnum):
    head = "head"  # one norm over hn, shared by every head (Qwen3, Gemma 3)
    projection = "projection"  # one RMSNorm over all of q (np*hn) and one over all of k (ng*hn) (OLMo 2)


class Recompute(StrEnum):
    none = "none"
    selective = "selective"  # core attention only
    full = "full"  # every layer from its input


class ScoreFunction(StrEnum):
    softmax = "softmax"  # Mixtral, Qwen-MoE
    sigmoid = "sigmoid"  # DeepSeek-V3


class Dispatcher(StrEnum):
    alltoall = "alltoall"  # tokens travel to their experts' ranks: the expert-parallel default
    allgather = "allgather"  # every rank gathers all tokens and keeps its experts' (small EP, or EP=1)


@dataclass
class MoEConfig:
    num_experts: Optional[int] = None  # experts in each MoE layer; null = a dense model
    top_k: int = 2  # experts each token goes to (Mixtral: 2 of 8)
    ffn_hidden_size: Optional[int] = None  # one expert's FFN width; null = model.ffn_hidden_size (Mixtral)
    shared_expert_ffn_hidden_size: Optional[int] = None  # an always-on shared expert (Qwen-MoE); null = none
    layer_freq: int = 1  # after first_dense, every k-th layer is MoE, from the first (1: all of them)
    first_dense: int = 0  # the first n layers keep a dense MLP (DeepSeek: 1 to 3)
    aux_loss_coeff: float = 1e-2  # load-balancing loss weight (Switch Transformer's 1e-2); 0 = off
    z_loss_coeff: Optional[float] = None  # router z-loss weight (ST-MoE: 1e-3); null = off
    score_function: ScoreFunction = ScoreFunction.softmax  # router scores
    pre_softmax: bool = False  # softmax over all experts before top-k (Qwen); false: over the k (Mixtral)
    dispatcher: Dispatcher = Dispatcher.alltoall  # how tokens reach the experts (Megatron-LM's EP default)
    dense_layers: list[int] = field(default_factory=list)  # 0-based layers also kept dense (HF mlp_only_layers)
    capacity_factor: Optional[float] = None  # drop tokens beyond this x an expert's mean load; null = none
    grouped_gemm: bool = False  # Transformer Engine's grouped GEMM experts (TEGroupedMLP); needs TE
    # DeepSeek-V3's router (Megatron-Core's TopKRouter fields); all off: Mixtral's / Qwen's routing
    router_expert_bias: bool = False  # aux-loss-free balancing: a per-expert bias, updated from the load (sigmoid)
    router_bias_update_rate: float = 1e-3  # the bias's step: rate * sign(mean load - load) (DeepSeek-V3's 1e-3)
    router_num_groups: Optional[int] = None  # group-limited routing: n equal expert groups (HF n_group); null = none
    router_group_topk: Optional[int] = None  # groups a token's experts may come from (HF topk_group); null = all
    router_topk_scaling_factor: Optional[float] = None  # routed weights times this (HF routed_scaling_factor); null = 1


@dataclass
class MLAConfig:
    """Multi-latent attention's sizes (DeepSeek-V2/V3; models/mla.py), read when model.attention=mla."""

    q_lora_rank: Optional[int] = None  # q's low-rank latent (DeepSeek-V3: 1536); null = one plain q projection
    kv_lora_rank: int = 64  # the compressed K/V latent every head expands from (DeepSeek-V3: 512)
    qk_nope_head_dim: int = 32  # each head's q/k part without RoPE (DeepSeek-V3: 128)
    qk_rope_head_dim: int = 16  # each head's rotated q/k part; k's is one, shared by every head (DeepSeek-V3: 64)
    v_head_dim: int = 32  # each head's value width (DeepSeek-V3: 128), independent of q/k's


@dataclass
class ModelConfig:
    name: str = "tiny"  # preset name, for logs and checkpoint metadata
    num_layers: int = 4  # transformer layers in the whole model (split across pipeline stages)
    hidden_size: int = 128  # model width h
    num_attention_heads: int = 4  # query heads; must divide by tp
    num_query_groups: Optional[int] = 2  # K/V heads for GQA (Llama 2 70B, Llama 3); null = one per query head (MHA)
    ffn_hidden_size: Optional[int] = 352  # MLP width (~8h/3 rounded, as Llama for SwiGLU); null = 4h (GPT-2)
    kv_channels: Optional[int] = None  # head dim; null = hidden_size / num_attention_heads
    vocab_size: Optional[int] = None  # null = the tokenizer's (byte: 256 bytes + EOD = 257)
    seq_length: int = 128  # training sequence length (tokens per sample)
    max_position_embeddings: Optional[int] = None  # context length a Hugging Face export records; null: seq_length
    sliding_window: Optional[int] = None  # "sliding" layers' window (Mistral: 4096): a query sees itself + window - 1
    layer_types: Optional[list[str]] = None  # per layer "full" | "sliding" (HF's layer_types); null: all sliding with a window
    attn_logit_softcap: Optional[float] = None  # scores = cap * tanh(scores / cap) (Gemma 2: 50.0); null: none
    final_logit_softcap: Optional[float] = None  # logits = cap * tanh(logits / cap) (Gemma 2: 30.0); null: none
    query_pre_attn_scalar: Optional[float] = None  # softmax scale = this ** -0.5 (Gemma's); null: 1/sqrt(head dim)
    attention_sinks: bool = False  # a learned logit per head in the softmax denominator (gpt-oss's sinks); off: plain
    position_embedding: PositionEmbedding = PositionEmbedding.rope  # RoPE is what modern decoders use
    rotary_base: float = 10000.0  # RoPE theta (Llama 2: 1e4, Llama 3: 5e5)
    rotary_base_local: Optional[float] = None  # "sliding" layers' theta, plain RoPE (Gemma 3: 1e4); null: as full
    partial_rotary_factor: float = 1.0  # share of each head RoPE rotates, from its start (Phi-4-mini: 0.75)
    normalization: Normalization = Normalization.RMSNorm  # RMSNorm (Llama) | LayerNorm (GPT-2)
    norm_epsilon: float = 1e-5  # epsilon inside the norms
    activation: Activation = Activation.swiglu  # swiglu (Llama) | gelu (GPT-2) | geglu_tanh (Gemma) | clamped_swiglu
    swiglu_limit: float = 7.0  # clamped_swiglu's clamp of gate (above) and up (both sides) (gpt-oss: 7.0)
    add_bias_linear: bool = False  # biases in the linear layers (GPT-2 yes, Llama no)
    qkv_bias: bool = False  # biases on the q, k and v projections only (Qwen2); add_bias_linear implies them
    qk_norm: bool = False  # a norm over each query and key head before RoPE (Qwen3; Megatron-Core's qk_layernorm)
    qk_norm_span: QkNormSpan = QkNormSpan.head  # what model.qk_norm spans: head (Qwen3) | projection (OLMo 2)
    norm_placement: NormPlacement = NormPlacement.pre  # where a layer's norms sit: pre (Llama) | sandwich | post
    norm_zero_centered: bool = False  # norms apply (1 + weight), weights start at 0 (Gemma; MCore's 1p norm)
    scale_embedding: bool = False  # multiply the token embeddings by sqrt(hidden_size) in their dtype (Gemma)
    rope_scaling: RopeScalingConfig = field(default_factory=RopeScalingConfig)  # RoPE frequency scaling (docs/config.md)
    tie_embeddings: bool = True  # output layer reuses the embedding (also across pipeline stages)
    attention: str = "self_attention"  # the layers' attention block: a name in models/spec.py's BLOCKS or module:Class
    mlp: str = "mlp"  # the layers' MLP block: a name in models/spec.py's BLOCKS or module:Class
    moe: MoEConfig = field(default_factory=MoEConfig)  # mixture of experts: model.moe.num_experts > 0 turns it on
    mla: MLAConfig = field(default_factory=MLAConfig)  # multi-latent attention's sizes (model.attention=mla)
    hidden_dropout: float = 0.0  # dropout after attention/MLP and on embeddings; 0 for pretraining
    attention_dropout: float = 0.0  # dropout on attention probabilities
    init_method_std: float = 0.02  # normal init std (output projections scaled by 1/sqrt(2L), Megatron)
    make_vocab_size_divisible_by: int = 128  # vocab padded to a multiple of this times tp (fast GEMMs)
    recompute: Recompute = Recompute.none  # selective (core attention) | full (every layer): compute for memory
    fused_kernels: Optional[bool] = None  # Megatron-Core's torch.compile'd SwiGLU + cross entropy; null = on with CUDA
    compile: bool = False  # torch.compile each transformer layer (as torchtitan); opt-in: the first step compiles
