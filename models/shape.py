"""The model's shape, resolved once from the config: every size that the model, the engine and the tools
derive (FFN width, query groups, head dim, padded vocabulary, each layer's blocks) is computed here and
read from here: by training/engine/bridge.py (Megatron-Core's TransformerConfig), validation, the memory
estimate, the FLOPs count, the planner, Hugging Face conversion and the checkpoint shape check.

    shape = ModelShape.of(cfg.model, vocab_size)     # vocab_size: the tokenizer's (None before it is known)
    shape.ffn_hidden_size, shape.kv_channels, shape.padded_vocab(tp), shape.layers[i].mlp

Each field is tagged with what it changes: "weights" (the tensors' shapes: a checkpoint must agree),
"numerics" (the maths, not the tensors: rotary base, norm epsilon) or "run" (sequence length and vocab
padding, free to change between runs). The tags replace the hand-kept lists of the checkpoint check and
the HF converter. models/ does not import training/: `of` reads the config by attribute.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field, fields, replace

from models.mla_shape import MLAShape, mla_of, mla_problems
from models.tp_blocks import TP_BLOCKS

WEIGHTS, NUMERICS, RUN = "weights", "numerics", "run"
LAYER_TYPES = ("full", "sliding")  # a layer's attention: causal over the whole sequence, or within the window


def _tag(kind: str, *config: str):
    """A field of this kind, read from the ModelConfig fields `config` (default: its own name)."""
    return field(metadata={"kind": kind, "config": config})


@dataclass(frozen=True)
class Split:
    """How one GPU's share of the weights is cut (what a block's num_params divides by)."""

    tp: int = 1  # tensor parallel: attention heads, FFN width, vocabulary
    ep: int = 1  # expert parallel: a MoE layer's experts
    etp: int = 1  # expert tensor parallel: one expert's FFN width
    tp_blocks: tuple[str, ...] = TP_BLOCKS  # the sub-blocks tp splits; the others are whole on every rank

    def of(self, kind: str | None) -> Split:
        """The cut a sub-block of this kind (models/tp_blocks.py) sees: tp 1 when it is replicated."""
        return self if kind is None or kind in self.tp_blocks or self.tp == 1 else replace(self, tp=1)


@dataclass(frozen=True)
class LayerBlocks:
    """The block names one layer is built from (models/spec.py resolves them to classes)."""

    attention: str
    mlp: str


@dataclass(frozen=True)
class RopeScaling:
    """RoPE frequency scaling, the checkpoint's parameters (models/rope.py computes the tables from them; the
    meaning of each: training/config/schema.py's RopeScalingConfig)."""

    type: str  # llama3 | linear | dynamic | yarn | longrope
    factor: float
    low_freq_factor: float = 1.0
    high_freq_factor: float = 4.0
    original_max_position: int = 8192
    beta_fast: float = 32.0
    beta_slow: float = 1.0
    mscale: float | None = None
    mscale_all_dim: float | None = None
    attention_factor: float | None = None
    truncate: bool = True
    short_factor: tuple[float, ...] | None = None
    long_factor: tuple[float, ...] | None = None


def padded_vocab_size(vocab_size: int, divisible_by: int, tp: int) -> int:
    """Megatron's rule: a multiple of divisible_by * tp, so every TP rank holds an equal, aligned shard."""
    multiple = divisible_by * tp
    return -(-vocab_size // multiple) * multiple


@dataclass(frozen=True)
class ModelShape:
    num_layers: int = _tag(WEIGHTS)
    hidden_size: int = _tag(WEIGHTS)
    num_attention_heads: int = _tag(WEIGHTS)
    num_query_groups: int = _tag(WEIGHTS)  # resolved: the head count for MHA
    kv_channels: int = _tag(WEIGHTS)  # resolved: hidden_size / heads
    ffn_hidden_size: int = _tag(WEIGHTS)  # resolved: 4 * hidden_size
    vocab_size: int | None = _tag(WEIGHTS)  # the tokenizer's (unpadded); None until it is known
    position_embedding: str = _tag(WEIGHTS)  # rope | learned
    normalization: str = _tag(WEIGHTS)  # LayerNorm | RMSNorm
    activation: str = _tag(WEIGHTS)  # gelu | swiglu | geglu_tanh | clamped_swiglu
    add_bias_linear: bool = _tag(WEIGHTS)
    qkv_bias: bool = _tag(WEIGHTS)  # resolved: also true with add_bias_linear
    qk_norm: bool = _tag(WEIGHTS)
    qk_norm_span: str = _tag(WEIGHTS)  # head: weights [hn] | projection: [np*hn] and [ng*hn] (models/qk_norm.py)
    norm_placement: str = _tag(WEIGHTS)  # pre | sandwich | post: which norms a layer has (models/spec.py)
    tie_embeddings: bool = _tag(WEIGHTS)
    # layer i+1's blocks (Megatron numbers layers from 1): a MoE layer's MLP is "moe"
    layers: tuple[LayerBlocks, ...] = _tag(WEIGHTS, "attention", "mlp", "moe.layer_freq", "moe.first_dense",
                                           "moe.dense_layers")
    num_experts: int | None = _tag(WEIGHTS, "moe.num_experts")  # None: a dense model
    moe_ffn_hidden_size: int | None = _tag(WEIGHTS, "moe.ffn_hidden_size")  # one expert's; resolved: ffn
    moe_shared_ffn_hidden_size: int | None = _tag(WEIGHTS, "moe.shared_expert_ffn_hidden_size")
    rotary_base: float = _tag(NUMERICS)
    rope_scaling: RopeScaling | None = _tag(NUMERICS, *(f"rope_scaling.{k}" for k in (
        "type", "factor", "low_freq_factor", "high_freq_factor", "original_max_position", "beta_fast", "beta_slow",
        "mscale", "mscale_all_dim", "attention_factor", "truncate", "short_factor", "long_factor")))  # None: plain
    partial_rotary_factor: float = _tag(NUMERICS)  # RoPE rotates the first int(kv_channels * this) of each head
    rotary_base_local: float | None = _tag(NUMERICS)  # "sliding" layers' base, plain RoPE; None: as full layers
    norm_epsilon: float = _tag(NUMERICS)
    swiglu_limit: float = _tag(NUMERICS)  # clamped_swiglu's clamp (gpt-oss)
    norm_zero_centered: bool = _tag(NUMERICS)  # every norm applies (1 + weight) (Gemma; models/norm.py)
    scale_embedding: bool = _tag(NUMERICS)  # embeddings times sqrt(hidden_size) (Gemma; models/embedding.py)
    moe_top_k: int = _tag(NUMERICS, "moe.top_k")
    moe_score_function: str = _tag(NUMERICS, "moe.score_function")
    moe_pre_softmax: bool = _tag(NUMERICS, "moe.pre_softmax")
    # the sliding layers' attention window (a query sees itself and the window - 1 tokens before it, as
    # transformers' Mistral: q - window < k <= q); None: none
    sliding_window: int | None = _tag(NUMERICS)
    # each layer's attention: "sliding" (within sliding_window) or "full"; resolved: all sliding with a window
    layer_types: tuple[str, ...] = _tag(NUMERICS, "layer_types", "sliding_window")
    attn_logit_softcap: float | None = _tag(NUMERICS)  # Gemma 2's cap * tanh(scores / cap); None: none
    final_logit_softcap: float | None = _tag(NUMERICS)  # Gemma 2's cap * tanh(logits / cap); None: none
    query_pre_attn_scalar: float | None = _tag(NUMERICS)  # softmax scale = this ** -0.5; None: 1/sqrt(kv_channels)
    attention_sinks: bool = _tag(WEIGHTS)  # gpt-oss's learned per-head logit in the softmax denominator
    mla: MLAShape | None = _tag(WEIGHTS, "attention", *(f"mla.{k}" for k in (
        "q_lora_rank", "kv_lora_rank", "qk_nope_head_dim", "qk_rope_head_dim", "v_head_dim")))  # None: not MLA
    seq_length: int = _tag(RUN)  # also the learned-positions table size
    make_vocab_size_divisible_by: int = _tag(RUN)

    @classmethod
    def of(cls, model, vocab_size: int | None = None) -> ModelShape:
        """From a training.config.schema.ModelConfig (read by attribute); vocab_size overrides model.vocab_size."""
        heads, hidden = model.num_attention_heads, model.hidden_size
        moe = model.moe
        ffn = model.ffn_hidden_size or 4 * hidden
        layers = tuple(LayerBlocks(attention=str(model.attention),
                                   mlp="moe" if _is_moe_layer(moe, number) else str(model.mlp))
                       for number in range(1, model.num_layers + 1))
        return cls(
            num_layers=model.num_layers, hidden_size=hidden, num_attention_heads=heads,
            num_query_groups=model.num_query_groups or heads,
            kv_channels=model.kv_channels or hidden // heads,
            ffn_hidden_size=ffn,
            vocab_size=vocab_size if vocab_size is not None else model.vocab_size,
            position_embedding=str(model.position_embedding), normalization=str(model.normalization),
            activation=str(model.activation), add_bias_linear=bool(model.add_bias_linear),
            qkv_bias=bool(model.qkv_bias or model.add_bias_linear), qk_norm=bool(model.qk_norm),
            qk_norm_span=str(model.qk_norm_span), norm_placement=str(model.norm_placement),
            norm_zero_centered=bool(model.norm_zero_centered), scale_embedding=bool(model.scale_embedding),
            tie_embeddings=bool(model.tie_embeddings), layers=layers,
            num_experts=moe.num_experts or None, moe_ffn_hidden_size=(moe.ffn_hidden_size or ffn) if moe.num_experts
            else None, moe_shared_ffn_hidden_size=moe.shared_expert_ffn_hidden_size or None,
            rotary_base=float(model.rotary_base), rope_scaling=_rope_scaling(model.rope_scaling),
            partial_rotary_factor=float(model.partial_rotary_factor),
            rotary_base_local=None if model.rotary_base_local is None else float(model.rotary_base_local),
            norm_epsilon=float(model.norm_epsilon), swiglu_limit=float(getattr(model, "swiglu_limit", 7.0)),
            moe_top_k=moe.top_k, moe_score_function=str(moe.score_function), moe_pre_softmax=bool(moe.pre_softmax),
            sliding_window=model.sliding_window,
            layer_types=_layer_types(model),
            attn_logit_softcap=_optional_float(model, "attn_logit_softcap"),
            final_logit_softcap=_optional_float(model, "final_logit_softcap"),
            query_pre_attn_scalar=_optional_float(model, "query_pre_attn_scalar"),
            attention_sinks=bool(getattr(model, "attention_sinks", False)),
            mla=mla_of(model),
            seq_length=model.seq_length, make_vocab_size_divisible_by=model.make_vocab_size_divisible_by)

    # ---- derived sizes ----------------------------------------------------------------------------------
    @property
    def moe_layer_numbers(self) -> tuple[int, ...]:
        return tuple(n for n, blocks in enumerate(self.layers, 1) if blocks.mlp == "moe")

    @property
    def heads_per_group(self) -> int:
        return self.num_attention_heads // self.num_query_groups

    @property
    def q_width(self) -> int:  # all query heads: np * hn
        return self.num_attention_heads * self.kv_channels

    @property
    def kv_width(self) -> int:  # K (or V) of all query groups: ng * hn
        return self.num_query_groups * self.kv_channels

    @property
    def gated(self) -> bool:  # SwiGLU, GeGLU: fc1 computes gate and up
        return self.activation in ("swiglu", "geglu_tanh", "clamped_swiglu")

    def padded_vocab(self, tp: int) -> int:
        if self.vocab_size is None:
            raise ValueError("the vocabulary size is not known yet (model.vocab_size=null: the tokenizer's)")
        return padded_vocab_size(self.vocab_size, self.make_vocab_size_divisible_by, tp)

    def problems(self) -> list[str]:
        """The shape's own rules, one line each (training/config/validate.py asks for them)."""
        if (problem := _norm_problem(self)) is not None:
            return [problem]
        if rope := _rope_problems(self):
            return rope
        if self.mla is not None and (mla := mla_problems(self)):
            return mla
        window = self.sliding_window
        if window is not None and window < 1:
            return [f"model.sliding_window={window} must be >= 1 (or null: no window)"]
        if len(self.layer_types) != self.num_layers or not set(self.layer_types) <= set(LAYER_TYPES):
            return [f"model.layer_types={list(self.layer_types)}: one of {', '.join(LAYER_TYPES)} for each of the "
                    f"model.num_layers={self.num_layers} layers (or null)"]
        if window is None and "sliding" in self.layer_types:
            return ["model.layer_types names sliding layers: set model.sliding_window (their window, in tokens)"]
        if self.activation == "clamped_swiglu" and any(b.mlp in _UNCLAMPED for b in self.layers):  # act(gate) * up
            return ["model.mlp=gated_mlp computes act(gate) * up, not model.activation=clamped_swiglu's clamps and "
                    "up + 1: use model.mlp=mlp"]
        return [f"model.{name}={value} must be > 0 (or null: none)" for name in
                ("attn_logit_softcap", "final_logit_softcap", "query_pre_attn_scalar")
                if (value := getattr(self, name)) is not None and not value > 0]

    # ---- comparisons ------------------------------------------------------------------------------------
    def fields_of(self, *kinds: str) -> dict:
        """{field: value} of the fields tagged with these kinds (layers as a list of dicts)."""
        values = asdict(self)
        return {f.name: values[f.name] for f in fields(self) if f.metadata["kind"] in kinds}

    @classmethod
    def config_fields(cls, *kinds: str) -> tuple[str, ...]:
        """The ModelConfig fields (dotted below model.) behind the shape fields of these kinds."""
        return tuple(name for f in fields(cls) if f.metadata["kind"] in kinds for name in f.metadata["config"] or
                     (f.name,))


def _is_moe_layer(moe, number: int) -> bool:
    """Layer `number` (1-based) has a MoE MLP: after moe.first_dense dense layers, every moe.layer_freq-th,
    except the 0-based indices in moe.dense_layers (Hugging Face's mlp_only_layers)."""
    return (bool(moe.num_experts) and number > moe.first_dense and (number - moe.first_dense - 1) % moe.layer_freq == 0
            and number - 1 not in moe.dense_layers)


def _layer_types(model) -> tuple[str, ...]:
    if getattr(model, "layer_types", None) is not None:
        return tuple(str(t) for t in model.layer_types)
    return ("sliding" if model.sliding_window is not None else "full",) * model.num_layers


def _optional_float(model, name: str) -> float | None:
    value = getattr(model, name, None)
    return None if value is None else float(value)


def _rope_problems(shape: ModelShape) -> list[str]:
    """RoPE's own rules: whole pairs rotated, a local base > 0, longrope's factors one per rotated pair."""
    p, hn = shape.partial_rotary_factor, shape.kv_channels
    dim = int(hn * p)
    if not 0 < p <= 1 or dim < 2 or dim % 2:
        return [f"model.partial_rotary_factor={p}: RoPE rotates int(kv_channels * it) = {dim} of each head's {hn} "
                f"values, which must be an even number >= 2 (0 < factor <= 1)"]
    if shape.rotary_base_local is not None and shape.rotary_base_local <= 0:
        return [f"model.rotary_base_local={shape.rotary_base_local} must be > 0 (or null: the full layers' base)"]
    r = shape.rope_scaling
    if r is not None and r.type == "longrope" and not len(r.short_factor or ()) == len(r.long_factor or ()) == dim // 2:
        return [f"model.rope_scaling.type=longrope needs short_factor and long_factor with one value per rotated pair: "
                f"{dim // 2} each (have {len(r.short_factor or ())}, {len(r.long_factor or ())})"]
    return []


def _rope_scaling(scaling) -> RopeScaling | None:
    if str(scaling.type) == "none":
        return None
    floats = lambda v: None if v is None else tuple(float(x) for x in v)  # noqa: E731 (hashable: the shape is a key)
    optional = lambda v: None if v is None else float(v)  # noqa: E731
    return RopeScaling(
        str(scaling.type), float(scaling.factor), float(scaling.low_freq_factor), float(scaling.high_freq_factor),
        int(scaling.original_max_position), float(scaling.beta_fast), float(scaling.beta_slow),
        optional(scaling.mscale), optional(scaling.mscale_all_dim), optional(scaling.attention_factor),
        bool(scaling.truncate), floats(scaling.short_factor), floats(scaling.long_factor))


_UNCLAMPED = ("gated_mlp", "models.gated_mlp:GatedMLP")  # the README's example block: GeGLU / SwiGLU only


def _norm_problem(shape: ModelShape) -> str | None:
    """The whole-projection QK-norm (OLMo 2) is an RMSNorm, and model.qk_norm turns it on."""
    if shape.qk_norm_span == "projection" and not shape.qk_norm:
        return "model.qk_norm_span=projection says what model.qk_norm spans: set model.qk_norm=true as well"
    if shape.qk_norm and shape.qk_norm_span == "projection" and shape.normalization != "RMSNorm":
        return (f"model.qk_norm_span=projection is OLMo 2's RMSNorm over all of q and k: set "
                f"model.normalization=RMSNorm (it is {shape.normalization}) or model.qk_norm_span=head")
    return None
