"""Inference state for generation: each layer's keys and values so far (TP-sharded, as the heads that make
them) and the batch's left padding, from which the new tokens' positions and attention mask follow.

    cache = KVCache(max_length=T + n, pad=pad)     # pad[i]: the left-padding tokens of sequence i
    logits = gpt(prompts, cache=cache)             # prefill: the T prompt positions, cache.length = T
    logits = gpt(next_ids[:, None], cache=cache)   # decode: one token a step, attending to all before it

A model built for training takes cache=None and is unchanged. The attention block (models/attention.py)
stores its new keys and values with `store` and attends with `mask`; the GPT (models/gpt.py) takes the
rotary positions from `positions` and calls `advance` after each forward. A pipeline stage holds the
entries of its own layers. Nothing here communicates. A sliding-window layer keeps every position too and
narrows `mask` to its window (models/core_attention.with_window: cache slots q - window < k <= q; left
padding shifts queries and keys alike, as in transformers).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch


@dataclass
class KVCache:
    max_length: int  # prompt + new tokens the cache has room for
    pad: torch.Tensor  # [b] left-padding of each sequence (its first pad[i] positions are not tokens)
    length: int = 0  # positions already cached
    layers: dict[int, tuple[torch.Tensor, torch.Tensor]] = field(default_factory=dict)  # layer -> (K, V)
    _mask: tuple = (None, None)  # ((length, new), mask): one per forward, shared by every layer

    def positions(self, new: int) -> torch.Tensor:
        """[b, new] the positions of the next `new` tokens in their own sequence (padding does not count)."""
        steps = torch.arange(self.length, self.length + new, device=self.pad.device)
        return (steps[None, :] - self.pad[:, None]).clamp(min=0)

    def store(self, layer_number: int, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Append k, v [new, b, ng/tp, hn] (any two tensors [new, b, ...]) for this layer; returns all of them so
        far, [length + new, b, ...]."""
        new = k.shape[0]
        if self.length + new > self.max_length:
            raise ValueError(f"the cache holds {self.max_length} positions: {self.length} + {new} do not fit")
        if layer_number not in self.layers:  # each its own width (MLA caches its latent and k_pe: models/mla.py)
            self.layers[layer_number] = (k.new_empty(self.max_length, *k.shape[1:]),
                                         v.new_empty(self.max_length, *v.shape[1:]))
        keys, values = self.layers[layer_number]
        keys[self.length:self.length + new] = k
        values[self.length:self.length + new] = v
        return keys[:self.length + new], values[:self.length + new]

    def mask(self, new: int) -> torch.Tensor:
        """[b, 1, new, length + new] bool, True where a new token may attend: causal, never to padding. A
        padding position attends to itself only (a row with nothing to attend to would give NaN, and NaN
        values stay NaN even under a zero weight); no real token ever sees it."""
        if self._mask[0] == (self.length, new):
            return self._mask[1]
        total = self.length + new
        keys = torch.arange(total, device=self.pad.device)
        queries = torch.arange(self.length, total, device=self.pad.device)
        causal = keys[None, :] <= queries[:, None]  # [new, total]
        real = keys[None, :] >= self.pad[:, None]  # [b, total]
        itself = keys[None, :] == queries[:, None]  # [new, total]
        mask = ((causal[None] & real[:, None, :]) | itself[None])[:, None]  # [b, 1, new, total]
        self._mask = ((self.length, new), mask)
        return mask

    def advance(self, new: int) -> None:
        self.length += new
