"""The GPT: embedding -> this stage's transformer layers -> final norm -> vocab-parallel output + loss.

One instance is one pipeline (virtual) stage: `pre_process` builds the embedding, `post_process` the
output layer; other stages receive their input through `set_input_tensor`, which Megatron-Core's
pipeline schedules call. Base class `LanguageModule` supplies Megatron-Core's tied-embedding
machinery: with `tie_embeddings` and PP > 1 the last stage holds a copy of the embedding weight that
is initialised from the first stage and whose gradient is summed with it over the embedding group
(`finalize_model_grads`).

The vocabulary is padded to a multiple of `make_vocab_size_divisible_by * tp` (Megatron's rule, in
models/shape.py) so it splits evenly; padded logits are masked to -inf, so padding never changes the loss
or the gradients. `num_params` and `flops_per_token` below sum what each block declares (models/spec.py).
With the vocabulary left out of parallel.tp_blocks (models/tp_blocks.py) the embedding and the output layer
are whole on every TP rank and the loss is torch's cross entropy over the full logits.
"""

import torch
import torch.nn.functional as F
from megatron.core import parallel_state
from megatron.core.enums import ModelType
from megatron.core.models.common.language_module.language_module import LanguageModule
from megatron.core.transformer.transformer_config import TransformerConfig
from megatron.core.utils import make_sharded_tensor_for_checkpoint

from models.core_attention import packed_mask
from models.embedding import Embedding
from models.kv_cache import KVCache
from models.layer import hf_names
from models.linear import ColumnParallelLinear
from models.norm import Norm
from models.rope import RotaryTables
from models.shape import ModelShape, Split
from models.spec import layer_spec
from models.stack import TransformerStack, stage_layer_numbers
from models.tp_blocks import KIND, TP_BLOCKS, block_config, replicated


class GPT(LanguageModule):
    def __init__(self, config: TransformerConfig, shape: ModelShape, pre_process: bool = True,
                 post_process: bool = True, vp_stage: int | None = None):
        super().__init__(config=config)
        self.shape = shape
        self.pre_process, self.post_process, self.vp_stage = pre_process, post_process, vp_stage
        self.share_embeddings_and_output_weights = shape.tie_embeddings
        self.vocab_size = shape.vocab_size
        self.padded_vocab_size = shape.padded_vocab(config.tensor_model_parallel_size)
        self.model_type = ModelType.encoder_or_decoder  # what Megatron-Core's schedules look for
        self.input_tensor = None
        vocab_config = block_config(config, "vocab")  # the model's, or one TP rank's (replicated vocabulary)
        self.vocab_replicated = replicated(vocab_config)

        if pre_process:
            self.embedding = Embedding(vocab_config, self.padded_vocab_size, shape.seq_length,
                                       learned_positions=shape.position_embedding == "learned")
        self.rotary_pos_emb = None
        if shape.position_embedding == "rope":  # every scaling type, partial rotary, a local base (models/rope.py)
            self.rotary_pos_emb = RotaryTables(shape, use_cpu_initialization=config.use_cpu_initialization)
        self.decoder = TransformerStack(config, shape, post_process=post_process, vp_stage=vp_stage)
        for layer in self.decoder.layers if self.rotary_pos_emb is not None else ():  # yarn / longrope: cos, sin
            scale = self.rotary_pos_emb.attention_factor(shape.layer_types[layer.layer_number - 1])  # scaled
            if scale != 1.0 and not hasattr(layer.self_attention, "rope_scale"):
                raise ValueError(f"{type(layer.self_attention).__name__} has no rope_scale: it cannot apply "
                                 f"model.rope_scaling.type={shape.rope_scaling.type}'s attention factor {scale}")
            if scale != 1.0:
                layer.self_attention.rope_scale = scale
        if post_process:
            self.output_layer = ColumnParallelLinear(
                config.hidden_size, self.padded_vocab_size, config=vocab_config, init_method=config.init_method,
                bias=False, gather_output=False,
                skip_weight_param_allocation=pre_process and self.share_embeddings_and_output_weights,
            )
            self._local_valid_vocab = self._valid_vocab_on_this_rank()
        if pre_process or post_process:
            self.setup_embeddings_and_output_layer()

    def _valid_vocab_on_this_rank(self) -> int:
        """How many of this TP rank's vocab rows are real tokens (the rest is padding)."""
        if self.vocab_replicated:
            return self.vocab_size
        per_rank = self.padded_vocab_size // self.config.tensor_model_parallel_size
        start = parallel_state.get_tensor_model_parallel_rank() * per_rank
        return max(0, min(per_rank, self.vocab_size - start))

    def set_input_tensor(self, input_tensor) -> None:
        """Called by Megatron-Core's pipeline schedules with the previous stage's activations."""
        if isinstance(input_tensor, (list, tuple)):
            input_tensor = input_tensor[0]
        self.input_tensor = input_tensor

    def forward(self, input_ids: torch.Tensor | None, labels: torch.Tensor | None = None,
                cache: KVCache | None = None, position_ids: torch.Tensor | None = None,
                segment_ids: torch.Tensor | None = None):
        """input_ids (first stage only), labels [b, s]. Returns per-token loss [b, s] (with labels), else logits
        [b, s, V_padded/tp] on the last stage, else this stage's activations [s(/tp), b, h]. cache: generation
        (models/kv_cache.py): the new tokens take their positions from it and attend to what it holds.
        position_ids [b, s]: the tokens' positions when they are not 0..s-1 (context parallel: this rank's
        zigzag share, s = seq/cp; learned positions read them, RoPE slices its own table the same way).
        segment_ids [b, s]: packed sequences (every stage; with position_ids from 0 in each): a token attends
        only to its own segment (models/core_attention.packed_mask) and RoPE takes its position_ids."""
        if cache is not None:
            position_ids = cache.positions(input_ids.shape[1] if self.pre_process else self.input_tensor.shape[0])
        x = self.embedding(input_ids, position_ids) if self.pre_process else self.input_tensor  # [s(/tp), b, h]
        freqs = mask = None
        if segment_ids is not None:
            mask = packed_mask(segment_ids, x.dtype)  # [b, 1, s, s], once for every layer
        rope = self.rotary_pos_emb
        if rope is not None and (cache is not None or segment_ids is not None):  # per token
            longest = cache.max_length if cache is not None else segment_ids.shape[1]
            end = int(position_ids.max()) + 1 if rope.length_dependent else None  # dynamic, longrope: transformers'
            tables = rope(longest, end, cp_slice=False)  # [longest, 1, 1, rd] (or {kind: table})
            freqs = _per_token(tables, position_ids)  # [s, b, 1, rd]
        elif rope is not None:
            sp_factor = self.config.tensor_model_parallel_size if self.config.sequence_parallel else 1
            # the full length's table; under CP this rank's zigzag rows of it (as Megatron-Core's RotaryEmbedding)
            freqs = rope(x.shape[0] * sp_factor * self.config.context_parallel_size)  # [s/cp, 1, 1, rd]
        x = self.decoder(x, freqs, cache, mask)
        if cache is not None:
            cache.advance(x.shape[0])
        if not self.post_process:
            return x
        weight = self.shared_embedding_or_output_weight() if self.share_embeddings_and_output_weights \
            else None
        logits, _ = self.output_layer(x, weight=weight)  # [s, b, V_padded/tp] (SP: gathered along s)
        if (cap := self.shape.final_logit_softcap) is not None:  # Gemma 2; elementwise: TP-safe. Before the
            logits = torch.tanh(logits / cap) * cap  # padding mask (tanh(-inf) would give padding -cap)
        if self._local_valid_vocab < logits.shape[-1]:  # padded vocab rows get no probability mass
            pad = torch.arange(logits.shape[-1], device=logits.device) >= self._local_valid_vocab
            logits = logits.masked_fill(pad, float("-inf"))
        if labels is None:
            return logits.transpose(0, 1).contiguous()  # [b, s, V_padded/tp]
        return self.compute_language_model_loss(labels, logits)  # [b, s]

    def compute_language_model_loss(self, labels: torch.Tensor, logits: torch.Tensor) -> torch.Tensor:
        """Per-token cross entropy [b, s] of logits [s, b, V_padded/tp] and labels [b, s]. With the whole
        vocabulary on this rank (tp = 1) torch's fused cross entropy computes what the vocab-parallel one
        does (in fp32, as it does) with one kernel instead of ~15 ops and 3 size-1 all-reduces; with TP,
        or with the bf16 fused kernel (model.fused_kernels), Megatron-Core's."""
        split = self.config.tensor_model_parallel_size > 1 and not self.vocab_replicated
        if split or (self.config.cross_entropy_loss_fusion and not self.vocab_replicated):
            return super().compute_language_model_loss(labels, logits)
        s, b, v = logits.shape
        loss = F.cross_entropy(logits.float().view(s * b, v), labels.t().reshape(s * b), reduction="none")
        return loss.view(s, b).t().contiguous()  # [s*b] -> [b, s]

    def sharded_state_dict(self, prefix="", sharded_offsets=(), metadata=None):
        """LanguageModule's, except the last stage's copy of a tied, replicated vocabulary (PP > 1): Megatron-Core
        declares it a TP shard of the embedding; here it is the whole table, replicated over TP."""
        state = super().sharded_state_dict(prefix, sharded_offsets, metadata)
        key = f"{prefix}output_layer.weight"
        if self.vocab_replicated and self.share_embeddings_and_output_weights and key in state and \
                not self.pre_process:
            replica = (1, parallel_state.get_tensor_model_parallel_rank(),
                       parallel_state.get_data_parallel_rank(with_context_parallel=True))
            state[key] = make_sharded_tensor_for_checkpoint(self.output_layer.weight, state[key].key,
                                                            replica_id=replica, allow_shape_mismatch=True)
        return state


def _per_token(tables, position_ids: torch.Tensor):
    """Each token's row of a [longest, 1, 1, rd] table (or of each kind's): [s, b, 1, rd]."""
    if isinstance(tables, dict):
        return {kind: _per_token(table, position_ids) for kind, table in tables.items()}
    return tables[:, 0, 0, :][position_ids.t()].unsqueeze(2)


# ---- sizes: the whole model's parameter count and FLOPs, summed from each block's own declaration ----------

def num_params(shape: ModelShape, tp: int = 1, pp: int = 1, stage: int = 0, vpp: int | None = None, ep: int = 1,
               etp: int = 1, experts_only: bool = False, tp_blocks: tuple[str, ...] = TP_BLOCKS) -> int:
    """Parameters on one GPU of pipeline rank `stage` (all its virtual chunks): its layers' blocks; the first
    stage adds the embedding, the last the final norm and the output layer, which is its own weight unless
    tied within one stage (tied across stages, the last stage holds a copy with its own gradient and optimizer
    state). num_params(shape) is the whole model, every weight once. A test compares with the built model.
    experts_only: the MoE experts' share (their gradients and optimizer state live in other DP groups).
    tp_blocks: the sub-blocks tp splits (parallel.tp_blocks); the others count whole."""
    split = Split(tp, ep, etp, tuple(tp_blocks))
    layers = [(split.of(KIND.get(name)), block) for n in stage_layer_numbers(shape.num_layers, pp, vpp, stage)
              for name, block in layer_spec(shape, n).items()]
    if experts_only:
        return sum(block.num_expert_params(shape, cut) for cut, block in layers if hasattr(block, "num_expert_params"))
    count = sum(block.num_params(shape, cut) for cut, block in layers)
    if stage == 0:
        count += Embedding.num_params(shape, split)
    if stage == pp - 1:
        count += Norm.num_params(shape, split)
        if not shape.tie_embeddings or pp > 1:
            count += shape.padded_vocab(tp) * shape.hidden_size // split.of("vocab").tp  # output_layer [V_padded/tp, h]
    return count


def active_params(shape: ModelShape) -> int:
    """The parameters one token's forward uses: a MoE layer's router, shared expert and top_k of its routed experts
    (not the other E - top_k), and not the input embedding (a row lookup) unless it is tied to the output layer.
    gpt-oss's model card counts so (120b: 5.13 B of 116.83 B); Qwen's counts the embedding too (Qwen3-30B-A3B:
    3.04 B here + 0.31 B embedding = its 3.3 B)."""
    idle = sum(block.num_expert_params(shape, Split()) * (shape.num_experts - shape.moe_top_k) // shape.num_experts
               for n in range(1, shape.num_layers + 1) for _, block in layer_spec(shape, n).items()
               if hasattr(block, "num_expert_params"))
    embedding = 0 if shape.tie_embeddings else shape.padded_vocab(1) * shape.hidden_size
    return num_params(shape) - idle - embedding


def flops_per_token(shape: ModelShape, tp: int = 1, kinds: tuple[str, ...] | None = None) -> float:
    """Training FLOPs per token: 3 x forward (backward = 2 x forward; recomputation not counted), as in
    Megatron-LM's `num_floating_point_operations`: each block's GEMMs + the output layer over the padded
    vocabulary (what the GPUs compute at this TP size). kinds: only the sub-blocks of these kinds
    (models/tp_blocks.py), e.g. those a layout replicates (every TP rank computes them whole)."""
    forward = sum(block.flops_per_token(shape) for n in range(1, shape.num_layers + 1)
                  for name, block in layer_spec(shape, n).items() if kinds is None or KIND.get(name) in kinds)
    vocab = 2 * shape.hidden_size * shape.padded_vocab(tp) if kinds is None or "vocab" in kinds else 0
    return 3.0 * (forward + vocab)


# ---- Hugging Face interop (Llama family): the whole GPT's weights <-> HF's LlamaForCausalLM names -------------
# Walks the blocks (each declares its own mapping as from_hf / to_hf: models/embedding.py, attention.py, mlp.py,
# norm.py; the layer's sub-block names are models/layer.py's hf_names) one layer at a time, so a converter can
# stream. `get` reads a full (unsharded) tensor by name, each side's names; the GPT side is the full state of
# this config's layout, so vocab rows are padded to shape.padded_vocab(tp) with zeros on the way in and the
# padding is dropped on the way out. lm_head exists only for untied embeddings; RoPE has no weights.

class _OutputLayerHF:
    """The output layer (defined in this file): our output_layer.weight [V, h] is HF's lm_head.weight."""

    @staticmethod
    def from_hf(get, config: TransformerConfig) -> dict[str, torch.Tensor]:
        return {"weight": get("weight")}

    to_hf = from_hf


def _hf_walk(shape: ModelShape, config: TransformerConfig):
    """(our prefix, HF prefix, block class with from_hf / to_hf, holds vocab rows) for every block, in order."""
    if shape.position_embedding != "rope":
        raise ValueError("Llama-style models use RoPE (model.position_embedding=rope), not learned positions")
    yield "embedding.", "model.embed_tokens.", Embedding, True
    for i in range(shape.num_layers):
        for name, block in layer_spec(shape, i + 1).items():
            if not hasattr(block, "from_hf"):
                raise ValueError(f"block {block.__module__}.{block.__name__} ({name}) has no Hugging Face "
                                 f"mapping: give it from_hf / to_hf (see models/mlp.py)")
            hf_name = block.hf_name(config) if hasattr(block, "hf_name") else hf_names(shape)[name]  # MoE: Mixtral's
            # block_sparse_moe or Qwen3-MoE's mlp
            yield f"decoder.layers.{i}.{name}.", f"model.layers.{i}.{hf_name}.", block, False
    yield "decoder.final_layernorm.", "model.norm.", Norm, False
    if not shape.tie_embeddings:
        yield "output_layer.", "lm_head.", _OutputLayerHF, True


def from_hf(get, config: TransformerConfig, shape: ModelShape):
    """Yields (our parameter name, full tensor) from HF tensors read with get(hf name)."""
    rows = shape.padded_vocab(config.tensor_model_parallel_size)
    for ours, hf, block, vocab_rows in _hf_walk(shape, config):
        for name, tensor in block.from_hf(lambda n, hf=hf: get(hf + n), config).items():
            if vocab_rows and rows > tensor.shape[0]:  # [V, h] -> [V_padded, h], zero rows (logits masked anyway)
                tensor = torch.cat([tensor, tensor.new_zeros(rows - tensor.shape[0], *tensor.shape[1:])])
            yield ours + name, tensor


def to_hf(get, config: TransformerConfig, shape: ModelShape):
    """Yields (HF name, full tensor) from our full tensors read with get(our parameter name)."""
    for ours, hf, block, vocab_rows in _hf_walk(shape, config):
        for name, tensor in block.to_hf(lambda n, ours=ours: get(ours + n), config).items():
            yield hf + name, tensor[: shape.vocab_size] if vocab_rows else tensor
