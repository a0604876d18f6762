"""RoPE from a checkpoint's parameters: the inverse frequencies of every scaling type transformers ships, and the
angle tables the attention rotates q and k with.

    inv_freq(dim, base, scaling, end)   [dim/2] fp32: transformers' ROPE_INIT_FUNCTIONS (llama3: Megatron-Core's)
    attention_factor(scaling)           the scale of cos and sin (yarn, longrope; 1 otherwise)
    RotaryTables(shape)(length, end)    [length, 1, 1, rotary_dim] angles (or {kind: table}), CP-sliced

`dim` is the rotary dimension, int(kv_channels * partial_rotary_factor): only each head's first `dim` values
rotate. `end` is the position after the forward's last (transformers' max(position_ids) + 1): dynamic and
longrope depend on it as transformers' forward does (dynamic: the base grows with `end` past the original
length, recomputed for each forward; longrope: the long factors once `end` passes the original length). A
layer's kind is shape.layer_types[n - 1]; "sliding" layers use plain RoPE at model.rotary_base_local when it is
set (Gemma 3: 10k local, 1M + scaling global), else the full layers' table.
"""

from __future__ import annotations

import math

import torch
from megatron.core import parallel_state
from megatron.core.models.common.embeddings.rope_utils import get_pos_emb_on_this_cp_rank
from megatron.core.models.common.embeddings.rotary_pos_embedding import RotaryEmbedding

from models.shape import ModelShape, RopeScaling

LENGTH_DEPENDENT = ("dynamic", "longrope")  # their inv_freq depends on the forward's end position


def rotary_dim(shape: ModelShape) -> int:
    if shape.mla is not None:  # multi-latent attention rotates its decoupled qk_rope_head_dim part only
        return shape.mla.qk_rope_head_dim
    return int(shape.kv_channels * shape.partial_rotary_factor)


def _plain(dim: int, base: float, device=None) -> torch.Tensor:
    """1 / base^(2i/dim), Megatron-Core's RotaryEmbedding's expression (transformers' default: the same values)."""
    return 1.0 / (base ** (torch.arange(0, dim, 2, dtype=torch.float32, device=device) / dim))


def _exponents(dim: int, device=None) -> torch.Tensor:  # 2i/dim as transformers writes it (int64 -> float)
    return torch.arange(0, dim, 2, dtype=torch.int64, device=device).float() / dim


def _mscale(scale: float, mscale: float = 1.0) -> float:  # YaRN's 0.1 ln(s) + 1
    return 1.0 if scale <= 1 else 0.1 * mscale * math.log(scale) + 1.0


def attention_factor(scaling: RopeScaling | None) -> float:
    """What cos and sin are multiplied by (transformers' attention_scaling): yarn's and longrope's, else 1."""
    if scaling is None or scaling.type not in ("yarn", "longrope"):
        return 1.0
    if scaling.attention_factor is not None:
        return float(scaling.attention_factor)
    factor = scaling.factor
    if scaling.type == "longrope":
        return 1.0 if factor <= 1.0 else math.sqrt(1 + math.log(factor) / math.log(scaling.original_max_position))
    if scaling.mscale and scaling.mscale_all_dim:  # DeepSeek's ratio
        return float(_mscale(factor, scaling.mscale) / _mscale(factor, scaling.mscale_all_dim))
    return _mscale(factor)


def inv_freq(dim: int, base: float, scaling: RopeScaling | None = None, end: int | None = None,
             device=None) -> torch.Tensor:
    """[dim/2] fp32 inverse frequencies of RoPE at `base` with `scaling` for a forward ending at position `end`
    (None: the table transformers builds at init)."""
    kind = None if scaling is None else scaling.type
    if kind is None:
        return _plain(dim, base, device)
    if kind == "llama3":  # Megatron-Core's formula (transformers' is the same), with the checkpoint's parameters
        return RotaryEmbedding._apply_scaling(
            None, _plain(dim, base, device), factor=scaling.factor, low_freq_factor=scaling.low_freq_factor,
            high_freq_factor=scaling.high_freq_factor, original_max_position_embeddings=scaling.original_max_position)
    if kind == "linear":
        inv = _plain(dim, base, device)
        inv /= scaling.factor
        return inv
    if kind == "dynamic":
        return _dynamic(dim, base, scaling, end, device)
    if kind == "yarn":
        return _yarn(dim, base, scaling, device)
    if kind == "longrope":
        long = end is not None and end > scaling.original_max_position
        factors = torch.tensor(scaling.long_factor if long else scaling.short_factor, dtype=torch.float32,
                               device=device)
        return 1.0 / (factors * base ** _exponents(dim, device))
    raise ValueError(f"unknown RoPE scaling type {kind!r}")


def _dynamic(dim: int, base: float, s: RopeScaling, end: int | None, device) -> torch.Tensor:
    """NTK: base * (factor * end / original - (factor - 1))^(dim / (dim - 2)) past the original length.
    transformers builds the init table in Python floats and recomputes it in the forward from max(position_ids)
    + 1, a 0-dim int64 tensor (so in fp32) once that passes the original length: both reproduced here."""
    original, factor = s.original_max_position, s.factor
    if end is None or end <= original:
        grown = base * ((factor * original / original) - (factor - 1)) ** (dim / (dim - 2))
    else:
        length = torch.tensor(end, device=device)
        grown = base * ((factor * length / original) - (factor - 1)) ** (dim / (dim - 2))
    return 1.0 / (grown ** _exponents(dim, device))


def _yarn(dim: int, base: float, s: RopeScaling, device) -> torch.Tensor:
    """YaRN's NTK-by-parts: frequencies turning more than beta_fast times in the original context kept, fewer than
    beta_slow times divided by factor, a linear ramp between (transformers' _compute_yarn_parameters)."""
    beta_fast, beta_slow = s.beta_fast or 32, s.beta_slow or 1

    def correction_dim(rotations: float) -> float:
        return (dim * math.log(s.original_max_position / (rotations * 2 * math.pi))) / (2 * math.log(base))

    low, high = correction_dim(beta_fast), correction_dim(beta_slow)
    if s.truncate:
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, dim - 1)
    if low == high:
        high += 0.001  # transformers' guard against a zero-width ramp
    pos_freqs = base ** (torch.arange(0, dim, 2, device=device).to(dtype=torch.float) / dim)
    extrapolation, interpolation = 1.0 / pos_freqs, 1.0 / (s.factor * pos_freqs)
    ramp = torch.clamp((torch.arange(dim // 2, dtype=torch.float32) - low) / (high - low), 0, 1)
    keep = 1 - ramp.to(device=device, dtype=torch.float)  # 1: the original frequency, 0: interpolated
    return interpolation * (1 - keep) + extrapolation * keep


class RotaryTables(torch.nn.Module):
    """The angle tables of every layer kind, [length, 1, 1, rotary_dim] (both halves equal: Megatron-Core's
    non-interleaved layout), cached per (length, end) so each forward returns the same tensor (the attention
    caches cos / sin by identity). Under context parallelism each table keeps this rank's zigzag rows of the
    full length's, as Megatron-Core's RotaryEmbedding does. No weights, no state in checkpoints."""

    def __init__(self, shape: ModelShape, use_cpu_initialization: bool = True):
        super().__init__()
        self.dim = rotary_dim(shape)
        full = (shape.rotary_base, shape.rope_scaling)
        local = full if shape.rotary_base_local is None else (shape.rotary_base_local, None)
        self.specs = {kind: local if kind == "sliding" else full for kind in dict.fromkeys(shape.layer_types)}
        self.shared = len(set(self.specs.values())) == 1  # one table serves every layer (all but Gemma 3-like)
        self.length_dependent = any(s is not None and s.type in LENGTH_DEPENDENT for _, s in self.specs.values())
        # Megatron-Core's choice of device for inv_freq (the default table stays bit-identical to its own)
        self.device = "cpu" if use_cpu_initialization or not torch.cuda.is_available() else torch.cuda.current_device()
        self.cp_group = parallel_state.get_context_parallel_group(check_initialized=False)
        self._cache: dict = {}

    def attention_factor(self, kind: str) -> float:
        return attention_factor(self.specs[kind][1])

    def forward(self, length: int, end: int | None = None, cp_slice: bool = True):
        """Rows 0..length-1 of each kind's table: one tensor when every layer shares it, else {kind: table}.
        end: the forward's end position (only dynamic and longrope read it; None: `length`). cp_slice: keep this
        CP rank's zigzag rows (training); False: every row (generation and packed sequences index by position)."""
        end = (end or length) if self.length_dependent else None
        key = (length, end, cp_slice)
        if key not in self._cache:
            if len(self._cache) >= 32:  # generation with dynamic / longrope asks for a new end every step
                self._cache.clear()
            tables = {kind: self._table(length, end, base, scaling, cp_slice)
                      for kind, (base, scaling) in self.specs.items()}
            self._cache[key] = next(iter(tables.values())) if self.shared else tables
        return self._cache[key]

    def _table(self, length: int, end: int | None, base: float, scaling: RopeScaling | None, cp_slice: bool):
        inv = inv_freq(self.dim, base, scaling, end, device=self.device).to(
            torch.cuda.current_device() if torch.cuda.is_available() else "cpu")
        angles = torch.outer(torch.arange(length, device=inv.device, dtype=inv.dtype), inv)  # [length, dim/2]
        emb = torch.cat((angles, angles), dim=-1)[:, None, None, :]  # [length, 1, 1, dim]
        if cp_slice and self.cp_group is not None and self.cp_group.size() > 1:
            emb = get_pos_emb_on_this_cp_rank(emb, 0, self.cp_group)
        return emb


def for_layer(freqs, kind: str):
    """The table a layer of this kind rotates with, from what RotaryTables returned (a tensor or {kind: table})."""
    return freqs[kind] if isinstance(freqs, dict) else freqs
