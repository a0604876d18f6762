"""Token embedding (vocab-parallel) + optional learned positions -> dropout, in [s, b, h] layout.

Under sequence parallelism the output is scattered along the sequence ([s/tp, b, h]) and dropout
is drawn from the TP-distinct RNG stream (each rank holds different tokens). Without SP the
activations are replicated across TP ranks and dropout uses the default stream, identical on all
of them, as in Megatron-Core's LanguageModelEmbedding.
"""

import torch
from megatron.core import tensor_parallel
from megatron.core.transformer.module import MegatronModule
from megatron.core.transformer.transformer_config import TransformerConfig

from models.shape import ModelShape, Split


class Embedding(MegatronModule):
    def __init__(self, config: TransformerConfig, vocab_size: int, max_sequence_length: int,
                 learned_positions: bool):
        super().__init__(config=config)
        self.word_embeddings = tensor_parallel.VocabParallelEmbedding(
            vocab_size, config.hidden_size, init_method=config.embedding_init_method, config=config,
        )
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
        return shape.padded_vocab(split.tp) * shape.hidden_size // split.tp + positions

    # ---- Hugging Face interop (Llama family): this block's weights <-> HF's `model.embed_tokens` --------------
    # `get` reads a tensor by name relative to the block, each side's names. Full (unsharded) tensors, vocab rows
    # as stored (models/gpt.py pads / unpads them). Llama has no learned positions.
    @staticmethod
    def from_hf(get, config: TransformerConfig) -> dict[str, torch.Tensor]:
        return {"word_embeddings.weight": get("weight")}  # [V, h]

    @staticmethod
    def to_hf(get, config: TransformerConfig) -> dict[str, torch.Tensor]:
        return {"weight": get("word_embeddings.weight")}
