"""The model's shape, resolved once from the config: every size that the model, the engine and the tools
derive (FFN width, query groups, head dim, padded vocabulary, each layer's blocks) is computed here and
read from here: by training/bridge.py (Megatron-Core's TransformerConfig), validation, the memory
estimate, the FLOPs count, the planner, Hugging Face conversion and the checkpoint shape check.

    shape = ModelShape.of(cfg.model, vocab_size)     # vocab_size: the tokenizer's (None before it is known)
    shape.ffn_hidden_size, shape.kv_channels, shape.padded_vocab(tp), shape.layers[i].mlp

Each field is tagged with what it changes: "weights" (the tensors' shapes: a checkpoint must agree),
"numerics" (the maths, not the tensors: rotary base, norm epsilon) or "run" (sequence length and vocab
padding, free to change between runs). The tags replace the hand-kept lists of the checkpoint check and
the HF converter. models/ does not import training/: `of` reads the config by attribute.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field, fields

WEIGHTS, NUMERICS, RUN = "weights", "numerics", "run"


def _tag(kind: str):
    return field(metadata={"kind": kind})


@dataclass(frozen=True)
class LayerBlocks:
    """The block names one layer is built from (models/spec.py resolves them to classes)."""

    attention: str
    mlp: str


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
    activation: str = _tag(WEIGHTS)  # gelu | swiglu
    add_bias_linear: bool = _tag(WEIGHTS)
    tie_embeddings: bool = _tag(WEIGHTS)
    layers: tuple[LayerBlocks, ...] = _tag(WEIGHTS)  # layer i+1's blocks (Megatron numbers layers from 1)
    rotary_base: float = _tag(NUMERICS)
    norm_epsilon: float = _tag(NUMERICS)
    seq_length: int = _tag(RUN)  # also the learned-positions table size
    make_vocab_size_divisible_by: int = _tag(RUN)

    @classmethod
    def of(cls, model, vocab_size: int | None = None) -> ModelShape:
        """From a training.config.ModelConfig (read by attribute); vocab_size overrides model.vocab_size."""
        heads, hidden = model.num_attention_heads, model.hidden_size
        blocks = LayerBlocks(attention=str(model.attention), mlp=str(model.mlp))
        return cls(
            num_layers=model.num_layers, hidden_size=hidden, num_attention_heads=heads,
            num_query_groups=model.num_query_groups or heads,
            kv_channels=model.kv_channels or hidden // heads,
            ffn_hidden_size=model.ffn_hidden_size or 4 * hidden,
            vocab_size=vocab_size if vocab_size is not None else model.vocab_size,
            position_embedding=str(model.position_embedding), normalization=str(model.normalization),
            activation=str(model.activation), add_bias_linear=bool(model.add_bias_linear),
            tie_embeddings=bool(model.tie_embeddings), layers=(blocks,) * model.num_layers,
            rotary_base=float(model.rotary_base), norm_epsilon=float(model.norm_epsilon),
            seq_length=model.seq_length, make_vocab_size_divisible_by=model.make_vocab_size_divisible_by)

    # ---- derived sizes ----------------------------------------------------------------------------------
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
    def gated(self) -> bool:  # SwiGLU: fc1 computes gate and up
        return self.activation == "swiglu"

    def padded_vocab(self, tp: int) -> int:
        if self.vocab_size is None:
            raise ValueError("the vocabulary size is not known yet (model.vocab_size=null: the tokenizer's)")
        return padded_vocab_size(self.vocab_size, self.make_vocab_size_divisible_by, tp)

    # ---- comparisons ------------------------------------------------------------------------------------
    def fields_of(self, *kinds: str) -> dict:
        """{field: value} of the fields tagged with these kinds (layers as a list of dicts)."""
        values = asdict(self)
        return {f.name: values[f.name] for f in fields(self) if f.metadata["kind"] in kinds}

    @classmethod
    def config_fields(cls, *kinds: str) -> tuple[str, ...]:
        """The ModelConfig fields behind the shape fields of these kinds (`layers` comes from attention, mlp)."""
        names = []
        for f in fields(cls):
            if f.metadata["kind"] in kinds:
                names += ["attention", "mlp"] if f.name == "layers" else [f.name]
        return tuple(names)
