"""Preference records -> (chosen, rejected) conversations and their token ids, the loss on the last answer only.

    chosen, rejected = conversations(record, "pairs.jsonl", 3)     # message lists sharing every turn but the last
    (ids_c, mask_c), (ids_r, mask_r) = encode_pair(tokenizer, record, "pairs.jsonl", 3)

The layouts (one JSON line or Parquet/Arrow row each):
  {"prompt": str, "chosen": str, "rejected": str[, "system": str]}          (HH-RLHF-style, TRL's standard format)
  {"prompt": [messages], "chosen": [assistant message], "rejected": [...]}   (TRL's conversational format)
  {"chosen": [messages], "rejected": [messages][, "prompt": str]}           (UltraFeedback-binarized: whole
      conversations sharing the prompt turns; its "prompt" string is the first user turn, not read)
Both conversations are rendered with the tokenizer's chat template (training/data/chat.py, as SFT); the mask is
1 on the last assistant answer only (earlier assistant turns are prompt). Every malformed record is one line
naming file:line: a missing key, an empty answer, chosen == rejected, conversations that differ before the
last turn.
"""

from __future__ import annotations

import numpy as np

from training.data import chat
from training.errors import ConfigError

LAYOUTS = ('{"prompt", "chosen", "rejected"} as strings, {"prompt": [messages], "chosen": [assistant message], '
           '"rejected": [...]}, or {"chosen": [messages], "rejected": [messages]} sharing all but the last turn')


def conversations(record, file: str, line: int) -> tuple[list[dict], list[dict]]:
    where = f"{file}:{line}"
    if not isinstance(record, dict):
        raise ConfigError(f"{where}: a {type(record).__name__}, not a JSON object: a preference record is {LAYOUTS}")
    missing = [key for key in ("chosen", "rejected") if record.get(key) is None]
    if missing:
        raise ConfigError(f"{where}: no {' and no '.join(repr(k) for k in missing)} (its keys: "
                          f"{', '.join(map(str, record)) or 'none'}): a preference record is {LAYOUTS}")
    chosen, rejected, prompt = record["chosen"], record["rejected"], record.get("prompt")
    if isinstance(chosen, str) != isinstance(rejected, str):
        raise ConfigError(f"{where}: \"chosen\" is a {type(chosen).__name__} but \"rejected\" a "
                          f"{type(rejected).__name__}: give both as strings or both as message lists")
    if isinstance(chosen, str):  # the standard format: a prompt string, two answers
        if not isinstance(prompt, (str, list)):
            raise ConfigError(f"{where}: answers as strings need a \"prompt\" (a string or a message list)")
        head = _prompt(prompt, record, where)
        pair = head + [{"role": "assistant", "content": chosen}], head + [{"role": "assistant", "content": rejected}]
    elif isinstance(prompt, list):  # conversational: the prompt's messages, then each answer's
        head = _prompt(prompt, record, where)
        pair = head + _turns(chosen, "chosen", where), head + _turns(rejected, "rejected", where)
    else:  # whole conversations (UltraFeedback-binarized)
        pair = _turns(chosen, "chosen", where), _turns(rejected, "rejected", where)
    for name, messages in zip(("chosen", "rejected"), pair):
        if messages[-1]["role"] != "assistant":
            raise ConfigError(f"{where}: the {name} conversation ends with a {messages[-1]['role']} turn, not the "
                              f"assistant's answer")
        if not messages[-1]["content"].strip():
            raise ConfigError(f"{where}: the {name} answer is empty")
        if messages[0]["role"] == "assistant" or len(messages) < 2:
            raise ConfigError(f"{where}: the {name} conversation has no prompt before its answer")
    if pair[0][:-1] != pair[1][:-1]:
        raise ConfigError(f"{where}: the chosen and rejected conversations differ before their last turn: a pair "
                          f"shares its prompt turns")
    if pair[0][-1]["content"] == pair[1][-1]["content"]:
        raise ConfigError(f"{where}: the chosen and rejected answers are the same: nothing to prefer")
    return pair


def _prompt(prompt, record: dict, where: str) -> list[dict]:
    system = [] if record.get("system") is None else [{"role": "system", "content": record["system"]}]
    if isinstance(prompt, str):
        if not prompt.strip():
            raise ConfigError(f"{where}: the prompt is empty")
        return system + [{"role": "user", "content": prompt}]
    return system + _turns(prompt, "prompt", where)


def _turns(turns, name: str, where: str) -> list[dict]:
    if not isinstance(turns, list) or not turns:
        raise ConfigError(f"{where}: \"{name}\" is {'empty' if turns == [] else 'a ' + type(turns).__name__}, not "
                          f"a list of {{\"role\", \"content\"}} messages")
    return [chat._message(turn, k, f"{where} ({name})") for k, turn in enumerate(turns)]


def last_answer(mask: np.ndarray) -> np.ndarray:
    """The mask of the last answer alone: its final run of ones (chat.encode marks every assistant turn)."""
    ones = np.flatnonzero(mask)
    out = np.zeros_like(mask)
    if len(ones):
        breaks = np.flatnonzero(np.diff(ones) > 1)
        start = ones[breaks[-1] + 1] if len(breaks) else ones[0]
        out[start:ones[-1] + 1] = 1
    return out


class PlainTokenizer:
    """A tokenizer without a chat template (`byte`, a bare tokenizer.json): a pair in the string layout is the
    prompt's text then each answer's, ending with the end-of-document token (TRL's standard, non-conversational
    format: prompt and completion concatenated, EOS after the completion)."""

    template_hash = "none"

    def __init__(self, base):
        self.base, self.name, self.vocab_size, self.eod = base, base.name, base.vocab_size, base.eod

    def encode(self, text: str) -> list[int]:
        return self.base.encode(text)


def plain_pair(tokenizer: PlainTokenizer, record, file: str, line: int):
    where = f"{file}:{line}"
    conversations(record, file, line)  # the same checks: keys, empty answers, chosen == rejected
    if not all(isinstance(record.get(k), str) for k in ("prompt", "chosen", "rejected")):
        raise ConfigError(f"{where}: --tokenizer {tokenizer.name} has no chat template: a record is {{\"prompt\", "
                          f"\"chosen\", \"rejected\"}} as strings (message lists need a tokenizer directory with "
                          f"a chat template)")
    prompt = np.asarray(tokenizer.encode(record["prompt"]), np.int64)
    out = []
    for key in ("chosen", "rejected"):
        answer = np.asarray(tokenizer.encode(record[key]) + [tokenizer.eod], np.int64)
        out.append((np.r_[prompt, answer], np.r_[np.zeros(len(prompt), np.uint8), np.ones(len(answer), np.uint8)]))
    return tuple(out)


def encode_pair(tokenizer, record, file: str, line: int):
    """((ids, mask) of the chosen conversation, (ids, mask) of the rejected one): the mask on the last answer."""
    where = f"{file}:{line}"
    if isinstance(tokenizer, PlainTokenizer):
        return plain_pair(tokenizer, record, file, line)
    out = []
    for messages in conversations(record, file, line):
        ids, mask = chat.encode(tokenizer, messages, where)
        out.append((ids, last_answer(mask)))
    if not out[0][1].any() or not out[1][1].any():
        raise ConfigError(f"{where}: an answer renders to no tokens")
    return tuple(out)
