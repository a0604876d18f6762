"""Chat tokenizers for the fine-tuning tests, written offline: a byte-level BPE without merges (UTF-8 byte b is id
b, as the built-in `byte` tokenizer) plus a family's special tokens and its chat template, saved as a Hugging Face
tokenizer directory (tokenizer.json, tokenizer_config.json with `chat_template`) as an imported checkpoint ships.

    chat_tokenizer(out_dir, "llama3")   # <|begin_of_text|> ... <|start_header_id|>role<|end_header_id|> ... <|eot_id|>
    chat_tokenizer(out_dir, "chatml")   # Qwen's <|im_start|>role\\n ... <|im_end|>\\n, with its default system prompt

The templates are the published ones (Meta-Llama-3-8B-Instruct's; Qwen2.5-Instruct's without its tool branches).
The real templates of current families, verbatim (tests/fixtures/chat_templates/<name>.jinja, sources in its README):

    real_chat_tokenizer(out_dir, "qwen3")   # REAL: llama3.1, ..., gemma2, gemma3, phi4-mini
"""

from __future__ import annotations

import json
from pathlib import Path

LLAMA3_TEMPLATE = (
    "{% set loop_messages = messages %}{% for message in loop_messages %}{% set content = '<|start_header_id|>' + "
    "message['role'] + '<|end_header_id|>\n\n'+ message['content'] | trim + '<|eot_id|>' %}{% if loop.index0 == 0 %}"
    "{% set content = bos_token + content %}{% endif %}{{ content }}{% endfor %}{% if add_generation_prompt %}"
    "{{ '<|start_header_id|>assistant<|end_header_id|>\n\n' }}{% endif %}")
CHATML_TEMPLATE = (
    "{%- if messages[0]['role'] == 'system' %}{{- '<|im_start|>system\n' + messages[0]['content'] + '<|im_end|>\n' }}"
    "{%- else %}{{- '<|im_start|>system\nYou are Qwen, created by Alibaba Cloud. You are a helpful assistant."
    "<|im_end|>\n' }}{%- endif %}{%- for message in messages %}{%- if (message.role == 'user') or (message.role == "
    "'system' and not loop.first) or (message.role == 'assistant') %}{{- '<|im_start|>' + message.role + '\n' + "
    "message.content + '<|im_end|>' + '\n' }}{%- endif %}{%- endfor %}{%- if add_generation_prompt %}"
    "{{- '<|im_start|>assistant\n' }}{%- endif %}")
STYLES = {  # special tokens (the first is the end of document), bos, eos (the end of a turn), template
    "llama3": (["<|end_of_text|>", "<|begin_of_text|>", "<|start_header_id|>", "<|end_header_id|>", "<|eot_id|>"],
               "<|begin_of_text|>", "<|eot_id|>", LLAMA3_TEMPLATE),
    "chatml": (["<|endoftext|>", "<|im_start|>", "<|im_end|>"], None, "<|im_end|>", CHATML_TEMPLATE),
}


TEMPLATES = Path(__file__).resolve().parent / "fixtures" / "chat_templates"  # <name>.jinja, verbatim
LLAMA31 = ["<|end_of_text|>", "<|begin_of_text|>", "<|start_header_id|>", "<|end_header_id|>", "<|eot_id|>",
           "<|eom_id|>", "<|python_tag|>"]
QWEN = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
REAL = {  # name: special tokens (the first is the end of document), bos, eos (the end of a turn), added plain tokens
    "llama3.1": (LLAMA31, "<|begin_of_text|>", "<|eot_id|>", []),
    "llama3.2": (LLAMA31, "<|begin_of_text|>", "<|eot_id|>", []),
    "qwen2.5": (QWEN, None, "<|im_end|>", ["<tool_call>", "</tool_call>"]),
    "qwen3": (QWEN, None, "<|im_end|>", ["<tool_call>", "</tool_call>", "<think>", "</think>"]),
    "mistral-nemo": (["</s>", "<s>", "[INST]", "[/INST]", "[AVAILABLE_TOOLS]", "[/AVAILABLE_TOOLS]", "[TOOL_CALLS]",
                      "[TOOL_RESULTS]", "[/TOOL_RESULTS]"], "<s>", "</s>", []),
    "gemma2": (["<eos>", "<bos>", "<pad>", "<start_of_turn>", "<end_of_turn>"], "<bos>", "<eos>", []),
    "gemma3": (["<eos>", "<bos>", "<pad>", "<start_of_turn>", "<end_of_turn>", "<start_of_image>"], "<bos>", "<eos>", []),
    "phi4-mini": (["<|endoftext|>", "<|system|>", "<|user|>", "<|assistant|>", "<|end|>", "<|tool|>", "<|/tool|>"],
                  "<|endoftext|>", "<|endoftext|>", []),
}


def real_chat_tokenizer(out: Path, name: str) -> Path:
    """Writes the tokenizer directory `out` with the published template `name` (a REAL key); returns it."""
    specials, bos, eos, plain = REAL[name]
    return _write(out, specials, bos, eos, (TEMPLATES / f"{name}.jinja").read_text(encoding="utf-8"), plain)


def chat_tokenizer(out: Path, style: str = "llama3") -> Path:
    """Writes the tokenizer directory `out` (vocabulary: 256 bytes + the style's special tokens, in order from
    id 256); returns it."""
    specials, bos, eos, template = STYLES[style]
    return _write(out, specials, bos, eos, template)


def _write(out: Path, specials: list[str], bos: str | None, eos: str, template: str, plain: list[str] = ()) -> Path:
    """256 byte ids, then `specials`, then `plain` (added tokens that are not special, as Qwen's <think>)."""
    from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    printable = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    others = [b for b in range(256) if b not in printable]  # GPT-2's bytes_to_unicode: the rest from chr(256) up
    char = {**{b: chr(b) for b in printable}, **{b: chr(256 + i) for i, b in enumerate(others)}}
    vocab = {char[b]: b for b in range(256)} | {token: 256 + i for i, token in enumerate([*specials, *plain])}
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    tok.decoder = decoders.ByteLevel()
    tok.add_special_tokens([AddedToken(token, special=True) for token in specials])
    tok.add_tokens([AddedToken(token, special=False, normalized=False) for token in plain])
    out = Path(out)
    PreTrainedTokenizerFast(tokenizer_object=tok, bos_token=bos, eos_token=eos, pad_token=specials[0],
                            chat_template=template, clean_up_tokenization_spaces=False).save_pretrained(str(out))
    (out / "config.json").write_text(json.dumps({"eos_token_id": vocab[eos], "bos_token_id": vocab.get(bos)}))
    return out
