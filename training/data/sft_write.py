"""Conversations -> an SFT dataset on disk (tools/preprocess_data.py --format sft; read by training/data/sft.py).

    write_sft("data/chats", [chat.encode(tokenizer, messages), None, ...], tokenizer)   # None: a skipped record

PREFIX.bin/.idx: a Megatron-Core indexed dataset, one sequence per conversation, its token ids as the chat template
renders them (nothing appended); PREFIX.mask.bin/.idx: uint8, the same lengths, 1 on the loss targets;
PREFIX.json: {"format": "sft", tokenizer, vocab_size, eod, documents, tokens, answer_tokens, chat_template (sha256
of the template, 16 hex digits), dropped}.
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np

from training.data.chat import mask_prefix
from training.errors import ConfigError

SFT_SUFFIXES = (".mask.bin", ".mask.idx", ".bin", ".idx", ".json")  # renamed in this order: PREFIX.json last


def write_sft(prefix: str | Path, pairs, tokenizer, data_format: str = "sft") -> dict:
    """Conversations as PREFIX.bin/.idx (token ids, one sequence each, nothing appended), PREFIX.mask.bin/.idx
    (uint8, the same lengths) and PREFIX.json; `pairs` yields (ids, mask) per conversation, or None for a skipped
    record (counted as "dropped"), consumed once in order. All files appear together or not at all
    (training.data.datasets.written_atomically). data_format "preference": the conversations are pairs, a
    chosen then a rejected one (training/post/pairs.py). Returns PREFIX.json's content."""
    from megatron.core.datasets.indexed_dataset import DType, IndexedDatasetBuilder

    from training.data.datasets import written_atomically

    with written_atomically(prefix, SFT_SUFFIXES) as tmp:
        builders = (IndexedDatasetBuilder(f"{tmp}.bin", dtype=DType.optimal_dtype(tokenizer.vocab_size)),
                    IndexedDatasetBuilder(f"{mask_prefix(tmp)}.bin", dtype=np.uint8))
        count = tokens = answers = dropped = 0
        try:
            for pair in pairs:
                if pair is None:
                    dropped += 1
                    continue
                ids, mask = pair
                if len(ids) != len(mask):
                    raise ValueError(f"{len(ids)} token ids but {len(mask)} mask values")
                for builder, values in zip(builders, pair):
                    builder.add_document(np.asarray(values), [len(values)])
                count, tokens, answers = count + 1, tokens + len(ids), answers + int(np.sum(mask))
        finally:
            for builder in builders:
                builder.data_file.close()  # finalize() closes it too; closing twice is harmless
        if count == 0:
            raise ConfigError(f"no conversations to write for {prefix} (the input is empty, or every record is)")
        builders[0].finalize(f"{tmp}.idx")
        builders[1].finalize(f"{mask_prefix(tmp)}.idx")
        if data_format == "preference" and count % 2:
            raise ValueError(f"{count} conversations: preference pairs come two by two")
        meta = {"format": data_format, "tokenizer": tokenizer.name, "vocab_size": tokenizer.vocab_size,
                "eod": tokenizer.eod, "documents": count, "tokens": tokens, "answer_tokens": answers,
                "chat_template": tokenizer.template_hash, "dropped": dropped}
        Path(f"{tmp}.json").write_text(json.dumps(meta, indent=1) + "\n")
    return meta
