"""Token embedding (vocab-parallel) + optional learned positions -> dropout, in [s, b, h] layout.

Under sequence parallelism the output is scattered along the sequence ([s/tp, b, h]) and dropout
is drawn from the TP-distinct RNG stream (each rank holds different tokens). Without SP the
activations are replicated across TP ranks and dropout uses the default stream, identical on all
of them, as in Megatron-Core's LanguageModelEmbedding. With the vocabulary left out of parallel.tp_blocks
(models/tp_blocks.py: the config is marked `tp_replicated`) the table is whole on every TP rank (a TP duplicate,
no all-reduce); its rows are padded as at the layout's tp either way, so checkpoints keep one shape.
`model.scale_embedding` (Gemma) multiplies the token embeddings by sqrt(hidden_size) rounded to their dtype, as
transformers does (`torch.tensor(hidden ** 0.5, dtype=x.dtype)`: 11.3125 in bf16 for h 128, not 11.3137); the
output layer (tied or not) reads the table unscaled.
"""

import torch
from megatron.core import tensor_parallel
from megatron.core.transformer.module import MegatronModule
from megatron.core.transformer.transformer_config import TransformerConfig
from megatron.core.utils import make_sharded_tensor_for_checkpoint

from models.shape import ModelShape, Split
from models.tp_blocks import replicated


class ReplicatedEmbedding(MegatronModule):
    """The whole [V_padded, h] table on every TP rank: Megatron-Core's VocabParallelEmbedding at one TP rank."""

    def __init__(self, num_embeddings: int, config: TransformerConfig):
        super().__init__(config=config)
        self.weight = torch.nn.Parameter(torch.empty(num_embeddings, config.hidden_size, dtype=config.params_dtype))
        if config.perform_initialization:  # recorded by training/engine/init.py, drawn by name
            config.embedding_init_method(self.weight)

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:  # [b, s] -> [b, s, h]
        return torch.nn.functional.embedding(input_ids, self.weight)

    def sharded_state_dict(self, prefix="", sharded_offsets=(), metadata=None):
        """One global tensor replicated over TP; the padded row count may differ from the checkpoint's (as
        VocabParallelEmbedding's: `allow_shape_mismatch`)."""
        return {f"{prefix}weight": make_sharded_tensor_for_checkpoint(self.weight, f"{prefix}weight", sharded_offsets,
                                                                      allow_shape_mismatch=True)}


class Embedding(MegatronModule):
    def __init__(self, config: TransformerConfig, vocab_size: int, max_sequence_length: int,
                 learned_positions: bool):
        super().__init__(config=config)
        self.word_embeddings = ReplicatedEmbedding(vocab_size, config) if replicated(config) else \
            tensor_parallel.VocabParallelEmbedding(vocab_size, config.hidden_size,
                                                   init_method=config.embedding_init_method, config=config)
        self.position_embeddings = None
        if learned_positions:
            self.position_embeddings = torch.nn.Embedding(max_sequence_length, config.hidden_size,
                                                          dtype=config.params_dtype)
            if config.perform_initialization:
                config.embedding_init_method(self.position_embeddings.weight)
        self.dropout = torch.nn.Dropout(config.hidden_dropout)

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor | None = None) -> torch.Tensor:
        """input_ids [b, s]; positions [b, s] (generation: each sequence's own), else 0..s-1."""
        x = self.word_embeddings(input_ids)  # [b, s, h] (VocabParallelEmbedding all-reduces over TP)
        if getattr(self.config, "scale_embedding", False):  # set by training/engine/bridge.py
            x = x * torch.tensor(self.config.hidden_size ** 0.5, dtype=x.dtype, device=x.device)  # in x's dtype
        if self.position_embeddings is not None:
            if positions is None:
                positions = torch.arange(input_ids.shape[1], device=input_ids.device)
            x = x + self.position_embeddings(positions)  # [s, h] broadcast over b, or [b, s, h]
        x = x.transpose(0, 1).contiguous()  # [s, b, h]
        if self.config.sequence_parallel:
            x = tensor_parallel.scatter_to_sequence_parallel_region(x)  # [s/tp, b, h]
            with tensor_parallel.get_cuda_rng_tracker().fork():
                return self.dropout(x)
        return self.dropout(x)

    @staticmethod
    def num_params(shape: ModelShape, split: Split) -> int:
        """The vocab-parallel table (padded rows split over TP) + learned positions (replicated)."""
        positions = shape.seq_length * shape.hidden_size if shape.position_embedding == "learned" else 0
        rows = shape.padded_vocab(split.tp)  # padded as at the layout's tp, also when replicated
        return rows * shape.hidden_size // split.of("vocab").tp + positions

    # ---- Hugging Face interop (Llama family): this block's weights <-> HF's `model.embed_tokens` --------------
    # `get` reads a tensor by name relative to the block, each side's names. Full (unsharded) tensors, vocab rows
    # as stored (models/gpt.py pads / unpads them). Llama has no learned positions.
    @staticmethod
    def from_hf(get, config: TransformerConfig) -> dict[str, torch.Tensor]:
        return {"word_embeddings.weight": get("weight")}  # [V, h]

    @staticmethod
    def to_hf(get, config: TransformerConfig) -> dict[str, torch.Tensor]:
        return {"weight": get("word_embeddings.weight")}
