"""Chat tokenizers for the fine-tuning tests, written offline: a byte-level BPE without merges (UTF-8 byte b is id
b, as the built-in `byte` tokenizer) plus a family's special tokens and its chat template, saved as a Hugging Face
tokenizer directory (tokenizer.json, tokenizer_config.json with `chat_template`) as an imported checkpoint ships.

    chat_tokenizer(out_dir, "llama3")   # <|begin_of_text|> ... <|start_header_id|>role<|end_header_id|> ... <|eot_id|>
    chat_tokenizer(out_dir, "chatml")   # Qwen's <|im_start|>role\\n ... <|im_end|>\\n, with its default system prompt

The templates are the published ones (Meta-Llama-3-8B-Instruct's; Qwen2.5-Instruct's without its tool branches).
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


def chat_tokenizer(out: Path, style: str = "llama3") -> Path:
    """Writes the tokenizer directory `out` (vocabulary: 256 bytes + the style's special tokens, in order from
    id 256); returns it."""
    from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    specials, bos, eos, template = STYLES[style]
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    others = [b for b in range(256) if b not in printable]  # GPT-2's bytes_to_unicode: the rest from chr(256) up
    char = {**{b: chr(b) for b in printable}, **{b: chr(256 + i) for i, b in enumerate(others)}}
    vocab = {char[b]: b for b in range(256)} | {token: 256 + i for i, token in enumerate(specials)}
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    tok.decoder = decoders.ByteLevel()
    tok.add_special_tokens([AddedToken(token, special=True) for token in specials])
    out = Path(out)
    PreTrainedTokenizerFast(tokenizer_object=tok, bos_token=bos, eos_token=eos, pad_token=specials[0],
                            chat_template=template, clean_up_tokenization_spaces=False).save_pretrained(str(out))
    (out / "config.json").write_text(json.dumps({"eos_token_id": vocab[eos], "bos_token_id": vocab.get(bos)}))
    return out
