"""What a block's forward runs on, for its activation-bytes declaration (models/spec.py):

    Block.activation_bytes(shape: ModelShape, split: Split, act: ActivationContext) -> float

is the bytes of the tensors that block's forward keeps for its backward (what autograd saves: each storage once,
parameters not counted), for one micro-batch on one GPU. The cut of the weights comes from `split` (tp, ep, etp),
as for num_params; everything else from `act`. training/estimate/memory.py sums the declarations over each
layer's blocks, and tests/test_activation_bytes.py holds every built-in block's to what its forward saves.

Conventions the built-in blocks follow: a tensor that is replicated over TP is kept sequence-sharded under
sequence parallelism (Megatron-Core's linear layers save their input before the gather: `act.seq_split(split)`);
tensors of size O(s), not O(s x h) (norm and softmax statistics, RoPE's cos / sin tables, routing indices of a
few bytes a token) may be left out; anything that depends on the code path (fused kernels, flash attention,
selective recomputation, context parallelism) must follow it, because that is where estimates go wrong.
"""

from __future__ import annotations

from dataclasses import dataclass

from models.shape import Split


@dataclass(frozen=True)
class ActivationContext:
    micro_batch: int  # b: sequences in one micro-batch
    seq: int  # s: tokens of each sequence on this rank (model.seq_length / cp)
    bytes: int  # bytes per activation element: 2 (bf16) or 4 (fp32)
    sp: bool = False  # sequence parallel: TP-replicated tensors are kept as [s/tp, b, h] shards
    cp: int = 1  # context parallel: attention gathers K and V to cp * s tokens
    hidden_dropout: bool = False  # model.hidden_dropout > 0: torch keeps a 1-byte mask (none at p = 0)
    attention_dropout: bool = False  # model.attention_dropout > 0
    flash: bool = True  # attention kernels that keep no s x s scores (scaled_dot_product_attention's on GPU and CPU)
    fused: bool = False  # Megatron-Core's fused SwiGLU (model.fused_kernels; null = on with CUDA)
    recompute: str = "none"  # none | selective (full: the estimate keeps only each layer's input)

    @property
    def tokens(self) -> int:
        """s x b: the tokens of one micro-batch on this rank."""
        return self.seq * self.micro_batch

    def seq_split(self, split: Split) -> int:
        """What divides a TP-replicated tensor: tp under sequence parallelism, else 1."""
        return split.tp if self.sp else 1
