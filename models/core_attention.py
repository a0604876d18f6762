"""The attention core: softmax(q k^T * scale) v on this rank's heads (models/attention.py builds on it;
models/context_parallel.py extends it with K/V gathered over the context-parallel group).

Options, each read from Megatron-Core's TransformerConfig as the bridge (training/engine/bridge.py) sets it:
- a sliding window on this layer (`window_size` = (window - 1, 0), `window_attn_skip_freq` = the per-layer
  pattern, Megatron-Core's `is_layer_window_attention`): a query at position q sees keys k with
  q - window < k <= q (transformers' `sliding_window_overlay`: the window counts the query itself);
- a softmax scale other than 1/sqrt(hn) (`softmax_scale`: Gemma's query_pre_attn_scalar ** -0.5);
- attention-logit soft-capping (`attn_logit_softcap`, Gemma 2): scores = cap * tanh(scores / cap), before the mask;
- learned attention sinks (`softmax_type="learnable"`, gpt-oss): one logit per head in the softmax denominator,
  the parameter `softmax_offset` [np/tp] (Megatron-Core's name), split over TP like the heads.
Plain and windowed attention run in torch's scaled_dot_product_attention (the window as an additive mask);
soft-capping and sinks, which SDPA cannot express, compute the [b, np/tp, s, s_k] scores explicitly.
"""

import contextlib
import functools

import torch
import torch.nn.functional as F
from megatron.core import parallel_state, tensor_parallel
from megatron.core.transformer.transformer_config import TransformerConfig
from megatron.core.transformer.utils import is_layer_window_attention, make_sharded_tensors_for_checkpoint
from megatron.core.utils import divide

from models.tp_blocks import replicated


def packed_mask(segment_ids: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """[b, s] segment ids of packed sequences (data.format=sft: 1, 2, ... one per conversation, 0 padding) ->
    [b, 1, s, s] additive mask: 0 where query i may attend to key j (same segment, j <= i), else -inf. Each
    conversation sees only itself; a padding token sees the padding before it (never an empty row: no NaN).
    Additive and built once per micro-batch: SDPA would turn a boolean mask into an additive one in every layer."""
    s = segment_ids.shape[1]
    causal = torch.ones(s, s, dtype=torch.bool, device=segment_ids.device).tril_()  # [s, s]
    allowed = (segment_ids[:, :, None] == segment_ids[:, None, :]) & causal  # [b, s, s]
    return torch.zeros(allowed.shape, dtype=dtype, device=segment_ids.device).masked_fill_(
        ~allowed, float("-inf"))[:, None]  # [b, 1, s, s]


def allowed(queries: torch.Tensor, keys: torch.Tensor, window: int | None) -> torch.Tensor:
    """[len(queries), len(keys)] bool from positions: causal (k <= q), and q - k < window with a window."""
    diff = queries[:, None] - keys[None, :]
    return (diff >= 0) & (diff < window) if window is not None else diff >= 0


@functools.lru_cache(maxsize=8)
def band_mask(s: int, s_k: int, window: int | None, device: torch.device, dtype: torch.dtype) -> torch.Tensor:
    """[s, s_k] additive causal (and windowed) mask of s queries at the last s of s_k positions; shared by every
    layer of its kind (one tensor, not one per layer: the kernels keep their mask for backward)."""
    queries = torch.arange(s_k - s, s_k, device=device)
    ok = allowed(queries, torch.arange(s_k, device=device), window)
    return torch.zeros(ok.shape, dtype=dtype, device=device).masked_fill_(~ok, float("-inf"))


_banded = (None, None, None)  # (a micro-batch's mask, window, it with the band): once per micro-batch and kind


def with_window(mask: torch.Tensor | None, s: int, s_k: int, window: int, dtype, device) -> torch.Tensor:
    """The mask of a windowed layer: `mask` (None: causal; [b, 1, s, s_k] additive: packed sequences; bool:
    generation's cache) and the band, queries at the last s of the s_k positions (training: s = s_k)."""
    global _banded
    band = band_mask(s, s_k, window, device, dtype)
    if mask is None:
        return band
    if _banded[0] is not mask or _banded[1] != window:  # every sliding layer of a micro-batch reuses it
        out = mask & torch.isfinite(band) if mask.dtype == torch.bool else mask + band
        _banded = (mask, window, out)
    return _banded[2]


class CoreAttention(torch.nn.Module):
    """softmax(q k^T * scale) v with a causal (or the given) mask and this layer's options (module docstring).

    Attention dropout acts on sharded heads, so it is drawn from the TP-distinct RNG stream; in a replicated
    attention (left out of parallel.tp_blocks: every TP rank holds every head) from the default stream, the same
    on every TP rank, so the replicas stay identical.
    """

    def __init__(self, config: TransformerConfig, layer_number: int = 1):
        super().__init__()
        self.dropout_p = config.attention_dropout
        self.tp_stream = not replicated(config)
        sliding = is_layer_window_attention(config.window_size, config.window_attn_skip_freq, layer_number)
        self.window = config.window_size[0] + 1 if sliding else None  # keys q - window < k <= q
        self.scale = config.softmax_scale  # None: 1/sqrt(hn)
        self.softcap = getattr(config, "attn_logit_softcap", None)
        self.softmax_offset = None
        if config.softmax_type == "learnable":  # [np/tp], drawn like a weight (training/engine/init.py records it)
            heads = divide(config.num_attention_heads, config.tensor_model_parallel_size)
            self.softmax_offset = torch.nn.Parameter(torch.zeros(heads, dtype=config.params_dtype))
            if self.tp_stream:
                tensor_parallel.set_tensor_model_parallel_attributes(self.softmax_offset, True, 0, 1)
            if config.perform_initialization:
                config.init_method(self.softmax_offset)
        elif config.softmax_type != "vanilla":
            raise ValueError(f"softmax_type={config.softmax_type!r}: vanilla or learnable (attention sinks)")

    def forward(self, q, k, v, mask=None):  # q [s, b, np/tp, hn]; k, v [s_k, b, ng/tp, hn]; mask [b, 1, s, s_k]
        # mask: generation's cache (bool), or packed sequences (packed_mask); None: causal. Queries are the
        # last s of the s_k positions; a sliding layer adds its window to the mask
        if self.window is not None:
            mask = with_window(mask, q.shape[0], k.shape[0], self.window, q.dtype, q.device)
        return self.attend(q, k, v, mask)

    def attend(self, q, k, v, mask):  # mask: the final one (None: causal)
        q, k, v = (t.permute(1, 2, 0, 3) for t in (q, k, v))  # [b, heads/tp, s(_k), hn]
        dropout_p = self.dropout_p if self.training else 0.0
        # without dropout no random numbers are drawn: the fork (~40 us of RNG state copies) would cost ~15% of
        # a small attention call on CPU for nothing
        fork = dropout_p > 0 and self.tp_stream
        with tensor_parallel.get_cuda_rng_tracker().fork() if fork else contextlib.nullcontext():
            if self.softcap is None and self.softmax_offset is None:
                out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, dropout_p=dropout_p,
                                                     is_causal=mask is None, scale=self.scale,
                                                     enable_gqa=k.shape[1] != q.shape[1])
            else:
                out = self._explicit(q, k, v, mask, dropout_p)
        b, n, s, hn = out.shape
        return out.permute(2, 0, 1, 3).reshape(s, b, n * hn)  # [s, b, np/tp * hn]

    def _explicit(self, q, k, v, mask, dropout_p):
        """transformers' eager attention (Gemma 2's soft-cap, gpt-oss's sinks): the scores in full, fp32 softmax."""
        b, n, s, hn = q.shape
        g, s_k = k.shape[1], k.shape[2]
        scale = self.scale if self.scale is not None else hn ** -0.5
        # each query group's heads against its K at once (no repeated K / V): [b, ng, (np/ng) s, s_k]
        scores = torch.matmul(q.reshape(b, g, n // g * s, hn), k.transpose(-1, -2)).view(b, n, s, s_k) * scale
        if self.softcap is not None:  # before the mask: a masked score must stay -inf
            scores = torch.tanh(scores / self.softcap) * self.softcap
        if mask is None:
            mask = band_mask(s, s_k, None, q.device, q.dtype)
        scores = scores.masked_fill(~mask, float("-inf")) if mask.dtype == torch.bool else scores + mask
        if self.softmax_offset is not None:  # one more logit a head, in the denominator only
            sink = self.softmax_offset.to(scores.dtype).view(1, n, 1, 1).expand(b, n, s, 1)
            probs = torch.softmax(torch.cat([scores, sink], dim=-1).float(), dim=-1)[..., :-1]
        else:
            probs = torch.softmax(scores.float(), dim=-1)
        probs = F.dropout(probs.to(v.dtype), p=dropout_p) if dropout_p > 0 else probs.to(v.dtype)
        return torch.matmul(probs.view(b, g, n // g * s, s_k), v).view(b, n, s, hn)

    def sharded_state_dict(self, prefix="", sharded_offsets=(), metadata=None):
        """The sinks' checkpoint key, split over TP like the heads (replicated in a replicated attention)."""
        state = self.state_dict(prefix="", keep_vars=True)
        axes = {"softmax_offset": 0} if self.tp_stream else {}
        return make_sharded_tensors_for_checkpoint(
            state, prefix, axes, sharded_offsets, tp_group=parallel_state.get_tensor_model_parallel_group(),
            dp_cp_group=(metadata or {}).get("dp_cp_group") or
            parallel_state.get_data_parallel_group(with_context_parallel=True))
