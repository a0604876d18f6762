"""The GPT: embedding -> this stage's transformer layers -> final norm -> vocab-parallel output + loss.

One instance is one pipeline (virtual) stage: `pre_process` builds the embedding, `post_process` the
output layer; other stages receive their input through `set_input_tensor`, which Megatron-Core's
pipeline schedules call. Base class `LanguageModule` supplies Megatron-Core's tied-embedding
machinery: with `tie_embeddings` and PP > 1 the last stage holds a copy of the embedding weight that
is initialised from the first stage and whose gradient is summed with it over the embedding group
(`finalize_model_grads`).

The vocabulary is padded to a multiple of `make_vocab_size_divisible_by * tp` (Megatron's rule) so it
splits evenly; padded logits are masked to -inf, so padding never changes the loss or the gradients.
"""

from dataclasses import dataclass

import torch
from megatron.core import parallel_state, tensor_parallel
from megatron.core.enums import ModelType
from megatron.core.models.common.embeddings.rotary_pos_embedding import RotaryEmbedding
from megatron.core.models.common.language_module.language_module import LanguageModule
from megatron.core.transformer.transformer_config import TransformerConfig

from models.block import TransformerStack
from models.embedding import Embedding


@dataclass
class GPTOptions:
    """What the GPT needs beyond Megatron-Core's TransformerConfig."""

    vocab_size: int  # the tokenizer's vocabulary (before padding)
    max_sequence_length: int  # longest sequence (learned positions table size)
    position_embedding: str = "rope"  # "rope" | "learned"
    rotary_base: float = 10000.0  # RoPE theta
    tie_embeddings: bool = True  # output layer reuses the input embedding
    make_vocab_size_divisible_by: int = 128  # pad vocab for fast GEMMs; times tp so shards are equal


def padded_vocab_size(vocab_size: int, divisible_by: int, tp: int) -> int:
    multiple = divisible_by * tp
    return -(-vocab_size // multiple) * multiple


class GPT(LanguageModule):
    def __init__(self, config: TransformerConfig, options: GPTOptions, pre_process: bool = True,
                 post_process: bool = True, vp_stage: int | None = None):
        super().__init__(config=config)
        self.options = options
        self.pre_process, self.post_process, self.vp_stage = pre_process, post_process, vp_stage
        self.share_embeddings_and_output_weights = options.tie_embeddings
        self.vocab_size = options.vocab_size
        self.padded_vocab_size = padded_vocab_size(
            options.vocab_size, options.make_vocab_size_divisible_by, config.tensor_model_parallel_size)
        self.model_type = ModelType.encoder_or_decoder  # what Megatron-Core's schedules look for
        self.input_tensor = None

        if pre_process:
            self.embedding = Embedding(config, self.padded_vocab_size, options.max_sequence_length,
                                       learned_positions=options.position_embedding == "learned")
        self.rotary_pos_emb = None
        if options.position_embedding == "rope":
            self.rotary_pos_emb = RotaryEmbedding(config.kv_channels, rotary_percent=1.0,
                                                  rotary_base=options.rotary_base,
                                                  use_cpu_initialization=config.use_cpu_initialization)
        self.decoder = TransformerStack(config, post_process=post_process, vp_stage=vp_stage)
        if post_process:
            self.output_layer = tensor_parallel.ColumnParallelLinear(
                config.hidden_size, self.padded_vocab_size, config=config, init_method=config.init_method,
                bias=False, gather_output=False,
                skip_weight_param_allocation=pre_process and self.share_embeddings_and_output_weights,
            )
            self._local_valid_vocab = self._valid_vocab_on_this_rank()
        if pre_process or post_process:
            self.setup_embeddings_and_output_layer()

    def _valid_vocab_on_this_rank(self) -> int:
        """How many of this TP rank's vocab rows are real tokens (the rest is padding)."""
        per_rank = self.padded_vocab_size // self.config.tensor_model_parallel_size
        start = parallel_state.get_tensor_model_parallel_rank() * per_rank
        return max(0, min(per_rank, self.vocab_size - start))

    def set_input_tensor(self, input_tensor) -> None:
        """Called by Megatron-Core's pipeline schedules with the previous stage's activations."""
        if isinstance(input_tensor, (list, tuple)):
            input_tensor = input_tensor[0]
        self.input_tensor = input_tensor

    def forward(self, input_ids: torch.Tensor | None, labels: torch.Tensor | None = None):
        """input_ids (first stage only), labels [b, s]. Returns per-token loss [b, s] (with labels), else logits
        [b, s, V_padded/tp] on the last stage, else this stage's activations [s(/tp), b, h]."""
        x = self.embedding(input_ids) if self.pre_process else self.input_tensor  # [s(/tp), b, h]
        freqs = None
        if self.rotary_pos_emb is not None:
            sp_factor = self.config.tensor_model_parallel_size if self.config.sequence_parallel else 1
            freqs = self.rotary_pos_emb(x.shape[0] * sp_factor)  # [s, 1, 1, hn]
        x = self.decoder(x, freqs)
        if not self.post_process:
            return x
        weight = self.shared_embedding_or_output_weight() if self.share_embeddings_and_output_weights \
            else None
        logits, _ = self.output_layer(x, weight=weight)  # [s, b, V_padded/tp] (SP: gathered along s)
        if self._local_valid_vocab < logits.shape[-1]:  # padded vocab rows get no probability mass
            pad = torch.arange(logits.shape[-1], device=logits.device) >= self._local_valid_vocab
            logits = logits.masked_fill(pad, float("-inf"))
        if labels is None:
            return logits.transpose(0, 1).contiguous()  # [b, s, V_padded/tp]
        return self.compute_language_model_loss(labels, logits)  # [b, s]


# ---- Hugging Face interop (Llama family): the whole GPT's weights <-> HF's LlamaForCausalLM names -------------
# Walks the blocks (each declares its own mapping: models/embedding.py, layer.py -> attention.py, mlp.py, norm.py)
# one layer at a time, so a converter can stream. `get` reads a full (unsharded) tensor by name, each side's
# names; the GPT side is the full state of this config's layout, so vocab rows are padded to
# padded_vocab_size(..., tp) with zeros on the way in and the padding is dropped on the way out.
# lm_head exists only for untied embeddings; RoPE has no weights (Llama has no learned positions).

def _hf_walk(config: TransformerConfig, options: GPTOptions):
    """(our prefix, HF prefix, mapping module, holds vocab rows) for every block, in model order."""
    from models import embedding, layer, norm

    if options.position_embedding != "rope":
        raise ValueError("Llama-style models use RoPE (model.position_embedding=rope), not learned positions")
    yield "embedding.", "model.embed_tokens.", embedding, True
    for i in range(config.num_layers):
        yield f"decoder.layers.{i}.", f"model.layers.{i}.", layer, False
    yield "decoder.final_layernorm.", "model.norm.", norm, False
    if not options.tie_embeddings:
        yield "output_layer.", "lm_head.", _OutputLayerHF, True


class _OutputLayerHF:
    """The output layer (defined in this file): our output_layer.weight [V, h] is HF's lm_head.weight."""

    @staticmethod
    def from_hf(get, config: TransformerConfig) -> dict[str, torch.Tensor]:
        return {"weight": get("weight")}

    to_hf = from_hf


def from_hf(get, config: TransformerConfig, options: GPTOptions):
    """Yields (our parameter name, full tensor) from HF tensors read with get(hf name)."""
    rows = padded_vocab_size(options.vocab_size, options.make_vocab_size_divisible_by,
                             config.tensor_model_parallel_size)
    for ours, hf, block, vocab_rows in _hf_walk(config, options):
        for name, tensor in block.from_hf(lambda n, hf=hf: get(hf + n), config).items():
            if vocab_rows:  # [V, h] -> [V_padded, h], zero rows (their logits are masked anyway)
                tensor = torch.cat([tensor, tensor.new_zeros(rows - tensor.shape[0], *tensor.shape[1:])])
            yield ours + name, tensor


def to_hf(get, config: TransformerConfig, options: GPTOptions):
    """Yields (HF name, full tensor) from our full tensors read with get(our parameter name)."""
    for ours, hf, block, vocab_rows in _hf_walk(config, options):
        for name, tensor in block.to_hf(lambda n, ours=ours: get(ours + n), config).items():
            yield hf + name, tensor[: options.vocab_size] if vocab_rows else tensor
