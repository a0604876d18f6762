"""Tokenizers: a built-in byte-level one (no download) and Hugging Face `tokenizer.json` files.

Both expose what Megatron-Core's GPT datasets and our preprocessing need: `vocab_size`, `eod`,
`encode(text) -> list[int]`, `decode(ids) -> str`, and a `name` recorded next to preprocessed data
so a dataset is never read with a tokenizer it was not written with.
"""

from __future__ import annotations

import os

from training.errors import ConfigError


class ByteTokenizer:
    """UTF-8 bytes 0..255 plus end-of-document = 256: vocab 257, lossless for any text."""

    name = "byte"
    vocab_size = 257
    eod = 256

    @property
    def unique_identifiers(self) -> dict:  # part of Megatron-Core's dataset cache key
        return {"class": self.name, "vocab_size": self.vocab_size}

    def encode(self, text: str) -> list[int]:
        return list(text.encode("utf-8"))

    def decode(self, ids) -> str:
        return bytes(int(i) for i in ids if int(i) < 256).decode("utf-8", errors="replace")


class HFTokenizer:
    """A local Hugging Face `tokenizer.json` (the `tokenizers` package; no network)."""

    def __init__(self, path: str):
        try:
            from tokenizers import Tokenizer
        except ImportError as err:
            raise ConfigError(f"data.tokenizer={path} needs the `tokenizers` package: "
                              f"pip install -e '.[hf]'") from err
        file = os.path.join(path, "tokenizer.json") if os.path.isdir(path) else path
        if not os.path.isfile(file):
            raise ConfigError(f"data.tokenizer={path}: no tokenizer.json there (use byte or a local file)")
        self._tok = Tokenizer.from_file(file)
        self.name = f"hf:{os.path.abspath(file)}"
        self.vocab_size = self._tok.get_vocab_size(with_added_tokens=True)
        eod = None
        for candidate in ("<|endoftext|>", "</s>", "<|end_of_text|>", "<eos>", "<|eot_id|>"):
            eod = self._tok.token_to_id(candidate)
            if eod is not None:
                break
        if eod is None:
            raise ConfigError(f"{file}: no end-of-document token (looked for </s>, <|endoftext|>, ...)")
        self.eod = eod

    @property
    def unique_identifiers(self) -> dict:  # part of Megatron-Core's dataset cache key
        return {"class": self.name, "vocab_size": self.vocab_size, "eod": self.eod}

    def encode(self, text: str) -> list[int]:
        return self._tok.encode(text, add_special_tokens=False).ids

    def decode(self, ids) -> str:
        return self._tok.decode([int(i) for i in ids])


def build_tokenizer(spec: str):
    """`byte` or a path to tokenizer.json (or a directory holding one)."""
    return ByteTokenizer() if spec == "byte" else HFTokenizer(spec)
