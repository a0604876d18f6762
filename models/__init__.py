"""The team's GPT, built from Megatron-Core tensor-parallel layers.

Nothing here creates a process group or calls a collective directly: each block gets a
`TransformerConfig` and Megatron-Core's layers and parallel state do the communication.
"""

from models.gpt import GPT, GPTOptions, padded_vocab_size

__all__ = ["GPT", "GPTOptions", "padded_vocab_size"]
