"""One transformer layer: x + drop(attn(norm(x))), then x + drop(mlp(norm(x))) (pre-norm, model.norm_placement=pre);
sandwich (Gemma 2/3): x + drop(norm(attn(norm(x)))), the same around the MLP; post (OLMo 2): x + drop(norm(attn(x))).

Its sub-blocks (attention, MLP, their norms) come from the layer spec (models/spec.py): the config picks the
attention and MLP blocks by name, so a new block needs no edit here. Under sequence parallelism x is [s/tp, b, h]: norms
and residuals act on the local sequence slice, the linear layers gather / reduce-scatter along the
sequence inside Megatron-Core. A sub-block left out of parallel.tp_blocks gets its replicated config
(models/tp_blocks.py) and its activation and parameter declarations see tp 1.
"""

import torch
from megatron.core.transformer.module import MegatronModule
from megatron.core.transformer.transformer_config import TransformerConfig

from models.activations import ActivationContext
from models.shape import ModelShape, Split
from models.spec import layer_spec
from models.tp_blocks import KIND, block_config

# Hugging Face (Llama) names of the sub-blocks, for training/interop/hf.py: ours -> theirs (model.layers.<i>.*)
HF_NAMES = {"input_layernorm": "input_layernorm", "self_attention": "self_attn",
            "pre_mlp_layernorm": "post_attention_layernorm", "mlp": "mlp"}
# Gemma 2/3 and OLMo 2 (norms after the sub-blocks): their post_attention_layernorm is the norm after attention
HF_NAMES_POST_NORMS = {"input_layernorm": "input_layernorm", "self_attention": "self_attn",
                       "post_attention_layernorm": "post_attention_layernorm",
                       "pre_mlp_layernorm": "pre_feedforward_layernorm", "mlp": "mlp",
                       "post_mlp_layernorm": "post_feedforward_layernorm"}


def hf_names(shape: ModelShape) -> dict[str, str]:
    """Our sub-block names -> Hugging Face's, for this model's norm placement."""
    return HF_NAMES if shape.norm_placement == "pre" else HF_NAMES_POST_NORMS


class TransformerLayer(MegatronModule):
    def __init__(self, config: TransformerConfig, shape: ModelShape, layer_number: int):
        super().__init__(config=config)
        self.layer_number = layer_number  # 1-based, global across pipeline stages (as in Megatron)
        spec = layer_spec(shape, layer_number)
        for name, block in spec.items():  # input_layernorm, self_attention, ...
            self.add_module(name, block(block_config(config, KIND.get(name)), layer_number))
        for name in spec.absent():  # the norms this placement leaves out
            self.add_module(name, None)
        self.dropout = torch.nn.Dropout(config.hidden_dropout)

    def _residual(self, x, out_and_bias, norm):
        out, bias = out_and_bias
        if bias is not None:
            out = out + bias
        if norm is not None:  # sandwich / post: the sub-block's output normalised before the residual add
            out = norm(out)
        return x + self.dropout(out)

    def forward(self, x: torch.Tensor, rotary_freqs: torch.Tensor | None = None, cache=None,
                attention_mask: torch.Tensor | None = None):  # [s(/tp), b, h]
        h = self.input_layernorm(x) if self.input_layernorm is not None else x
        # cache (generation, models/kv_cache.py) and attention_mask (packed sequences) only when given: an
        # attention block without them still trains on documents
        options = {k: v for k, v in (("cache", cache), ("attention_mask", attention_mask)) if v is not None}
        attention = self.self_attention(h, rotary_freqs, **options)
        x = self._residual(x, attention, self.post_attention_layernorm)
        h = self.pre_mlp_layernorm(x) if self.pre_mlp_layernorm is not None else x
        return self._residual(x, self.mlp(h), self.post_mlp_layernorm)

    @staticmethod
    def activation_bytes(shape: ModelShape, layer_number: int, split: Split, act: ActivationContext) -> float:
        """What layer `layer_number` keeps for backward, one micro-batch on one GPU: what its blocks declare
        (models/spec.py) + the two hidden-dropout masks (1 byte an element of [s(/tp), b, h], when p > 0)."""
        masks = 2 * act.tokens * shape.hidden_size / act.seq_split(split) if act.hidden_dropout else 0
        return masks + sum(block.activation_bytes(shape, split.of(KIND.get(name)), act) for name, block in
                           layer_spec(shape, layer_number).items())
