"""One pre-norm transformer layer: x + drop(attn(norm(x))), then x + drop(mlp(norm(x))).

Under sequence parallelism x is [s/tp, b, h]: norms and residuals act on the local sequence slice,
the linear layers gather / reduce-scatter along the sequence inside Megatron-Core.
"""

import torch
from megatron.core.transformer.module import MegatronModule
from megatron.core.transformer.transformer_config import TransformerConfig

from models.attention import SelfAttention
from models.mlp import MLP
from models.norm import Norm


class TransformerLayer(MegatronModule):
    def __init__(self, config: TransformerConfig, layer_number: int):
        super().__init__(config=config)
        self.layer_number = layer_number  # 1-based, global across pipeline stages (as in Megatron)
        self.input_layernorm = Norm(config, config.hidden_size)
        self.self_attention = SelfAttention(config)
        self.pre_mlp_layernorm = Norm(config, config.hidden_size)
        self.mlp = MLP(config)
        self.dropout = torch.nn.Dropout(config.hidden_dropout)

    def _residual(self, x, out_and_bias):
        out, bias = out_and_bias
        if bias is not None:
            out = out + bias
        return x + self.dropout(out)

    def forward(self, x: torch.Tensor, rotary_freqs: torch.Tensor | None = None):  # [s(/tp), b, h]
        x = self._residual(x, self.self_attention(self.input_layernorm(x), rotary_freqs))
        return self._residual(x, self.mlp(self.pre_mlp_layernorm(x)))


# ---- Hugging Face interop (Llama family): this layer's weights <-> HF's `model.layers.<i>.*` -----------------
# (our sub-block prefix, HF's, the module declaring that block's mapping); change a block here and there together.
def _hf_blocks():
    from models import attention, mlp, norm

    return (("input_layernorm.", "input_layernorm.", norm), ("self_attention.", "self_attn.", attention),
            ("pre_mlp_layernorm.", "post_attention_layernorm.", norm), ("mlp.", "mlp.", mlp))


def from_hf(get, config: TransformerConfig) -> dict[str, torch.Tensor]:
    out = {}
    for ours, hf, block in _hf_blocks():
        out.update({ours + k: v for k, v in block.from_hf(lambda n, hf=hf: get(hf + n), config).items()})
    return out


def to_hf(get, config: TransformerConfig) -> dict[str, torch.Tensor]:
    out = {}
    for ours, hf, block in _hf_blocks():
        out.update({hf + k: v for k, v in block.to_hf(lambda n, ours=ours: get(ours + n), config).items()})
    return out
