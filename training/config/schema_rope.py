"""model.rope_scaling: RoPE frequency scaling, every type transformers' ROPE_INIT_FUNCTIONS has (models/rope.py
computes the tables; training/interop/hf_rope.py reads and writes a config.json's). Apart from schema.py to keep
it small; schema.py re-exports both.
"""

from __future__ import annotations

from dataclasses import dataclass
from enum import StrEnum
from typing import Optional


class RopeScalingType(StrEnum):
    none = "none"  # plain RoPE
    llama3 = "llama3"  # Llama 3.1+: long wavelengths divided by factor, a smooth band between
    linear = "linear"  # position interpolation: every frequency divided by factor
    dynamic = "dynamic"  # NTK: the base grows with the sequence past original_max_position
    yarn = "yarn"  # YaRN (gpt-oss, DeepSeek, Qwen long context): NTK-by-parts ramp + an attention factor
    longrope = "longrope"  # Phi-3/Phi-4: per-frequency short/long factors + an attention factor


@dataclass
class RopeScalingConfig:
    # the types and their maths are transformers' ROPE_INIT_FUNCTIONS (models/rope.py); docs/config.md lists them
    type: RopeScalingType = RopeScalingType.none  # none | llama3 | linear | dynamic | yarn | longrope
    factor: float = 8.0  # how much longer the context gets than original_max_position (Llama 3.1: 8, 3.2: 32)
    low_freq_factor: float = 1.0  # llama3: wavelengths above original_max_position / this are divided by factor
    high_freq_factor: float = 4.0  # llama3: wavelengths below original_max_position / this stay as they are
    # the context length the model was pretrained at before scaling (dynamic: where the base starts to grow)
    original_max_position: int = 8192
    beta_fast: float = 32.0  # yarn: frequencies turning more than this often in the original context stay (paper)
    beta_slow: float = 1.0  # yarn: frequencies turning less than this often are divided by factor (paper)
    mscale: Optional[float] = None  # yarn (DeepSeek): attention factor's numerator weight; null: plain YaRN
    mscale_all_dim: Optional[float] = None  # yarn (DeepSeek): its denominator weight; null: plain YaRN
    attention_factor: Optional[float] = None  # yarn, longrope: cos and sin scale; null: from factor, as the paper
    truncate: bool = True  # yarn: round the ramp's ends to whole dimensions (transformers' default; gpt-oss: false)
    short_factor: Optional[list[float]] = None  # longrope: per-frequency divisors up to original_max_position
    long_factor: Optional[list[float]] = None  # longrope: the divisors for sequences longer than that
