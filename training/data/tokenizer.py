"""Tokenizers: a built-in byte-level one (no download) and Hugging Face `tokenizer.json` files.

Both expose what Megatron-Core's GPT datasets and our preprocessing need: `vocab_size`, `eod`,
`encode(text) -> list[int]`, `decode(ids) -> str`, and a `name` recorded next to preprocessed data
so a dataset is never read with a tokenizer it was not written with.
"""

from __future__ import annotations

import hashlib
import os
from pathlib import Path

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
    """A local Hugging Face `tokenizer.json` (the `tokenizers` package; no network).

    Its `name` is a hash of the file's content, not its path: moving a checkout keeps preprocessed data
    valid, and editing the file in place is caught instead of silently mis-reading old token ids."""

    EOD_CANDIDATES = ("<|endoftext|>", "</s>", "<|end_of_text|>", "<eos>", "<|eot_id|>")

    def __init__(self, path: str):
        file = os.path.join(path, "tokenizer.json") if os.path.isdir(path) else path
        if not os.path.isfile(file):
            raise ConfigError(f"tokenizer {path}: no such file (give `byte`, a local tokenizer.json or a "
                              f"directory holding one)")
        try:
            from tokenizers import Tokenizer
        except ImportError as err:
            raise ConfigError(f"tokenizer {file} needs the `tokenizers` package: pip install -e '.[hf]'") from err
        try:
            content = Path(file).read_bytes()
            self._tok = Tokenizer.from_str(content.decode("utf-8"))
        except Exception as err:  # noqa: BLE001 - OSError, UnicodeError or the Rust parser's Exception
            reason = (str(err) or type(err).__name__).splitlines()[0]
            raise ConfigError(f"tokenizer {file} is not a readable tokenizer.json: {reason}") from err
        self.name = f"hf:sha256-{hashlib.sha256(content).hexdigest()[:16]}"
        self.vocab_size = self._tok.get_vocab_size(with_added_tokens=True)
        eod = next((i for i in map(self._tok.token_to_id, self.EOD_CANDIDATES) if i is not None), None)
        if eod is None:
            raise ConfigError(f"{file}: no end-of-document token (looked for {', '.join(self.EOD_CANDIDATES)})")
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
