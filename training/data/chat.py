"""Conversations -> token ids and a loss mask, with the model's own chat template (tools/preprocess_data.py --format
sft; the training side, packing and loss: training/data/sft.py).

    tokenizer = ChatTokenizer("checkpoints/llama3-hf")   # a Hugging Face tokenizer directory, offline
    messages = conversation({"prompt": "2+2?", "completion": "4"}, "chats.jsonl", 1)   # [user, assistant]
    ids, mask = encode(tokenizer, messages)    # [n] token ids, [n] uint8: 1 on the assistant's tokens
    # writing them: training/data/sft_write.py (PREFIX.bin/.idx, PREFIX.mask.bin/.idx, PREFIX.json)

A record is {"messages": [{"role": "system"|"user"|"assistant", "content": str}, ...]}, ShareGPT's {"conversations":
[{"from": "system"|"human"|"gpt", "value": str}, ...]}, {"prompt": str, "completion": str}, or Alpaca's
{"instruction": str, "input": str, "output": str} (the user turn: the instruction, a newline and the input, or the
instruction alone when the input is empty or missing, as LLaMA-Factory and axolotl join them); the last two take an
optional "system": str, its system message. The ids are the template's rendering of the whole conversation,
tokenized once (add_special_tokens=False: the template writes its own BOS), exactly
tokenizer.apply_chat_template(messages). The mask comes from renderings, not from guessing the template's markup:
assistant turn i's answer is the text between the rendering of messages[:i] with the generation prompt and that
of messages[:i + 1] (its content and end-of-turn, e.g. `<|eot_id|>`, or `<|im_end|>` and a newline), and a token
is a target when its first character lies in an answer. A reasoning template (Qwen3) writes a `<think>` block
before the last answer only: an earlier answer is located without it, as the whole conversation renders it; so is
the eos_token a template writes after the last turn when no generation prompt follows (Phi-3, Phi-4-mini). Any
other template whose renderings are not prefixes of each other (one that rewrites earlier turns, e.g. Mistral
Nemo's moving the system prompt into the last user turn) is refused, naming the record.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import time
from pathlib import Path

import numpy as np

from training.config.paths import MASK_SUFFIX  # ".mask": PREFIX.mask.bin/.idx, the loss mask beside PREFIX.bin/.idx
from training.data.tokenizer import HFTokenizer
from training.errors import ConfigError

SHAREGPT = {"human": "user", "user": "user", "gpt": "assistant", "assistant": "assistant", "system": "system"}
ROLES = ("system", "user", "assistant")  # what every chat template renders (tool calls: not supported)
REASONING = re.compile(r"\s*<think>[\s\S]*?</think>\s*")  # a leading reasoning block (Qwen3, QwQ, DeepSeek-R1)
PAIRS = (("prompt", "completion"), ("instruction", "output"))  # one user turn and one answer: Alpaca's second
PROBE = [{"role": "user", "content": "Hello, how are you?"}, {"role": "assistant", "content": "Fine, thanks."}]


def mask_prefix(prefix: str | Path) -> str:
    """The indexed dataset of the loss mask of the conversations at `prefix`."""
    return f"{prefix}{MASK_SUFFIX}"


def hf_chat_tokenizer(directory: str | Path, hint: str):
    """transformers' tokenizer of a local directory (no network) that has a chat template; one line ending with
    `hint` when transformers is missing, cannot load it, or there is no template (tools/generate.py --chat too)."""
    try:
        from transformers import AutoTokenizer
    except ImportError as err:
        raise ConfigError(f"tokenizer {directory}: chat templates are rendered by transformers: pip install -e "
                          f"'.[hf]'") from err
    try:
        tokenizer = AutoTokenizer.from_pretrained(str(directory), local_files_only=True)
    except Exception as err:  # noqa: BLE001 - OSError, ValueError, whatever a broken config raises
        raise ConfigError(f"tokenizer {directory}: transformers cannot load it ({_reason(err)}): {hint}") from err
    if not tokenizer.chat_template:
        raise ConfigError(f"tokenizer {directory}: no chat template (no chat_template.jinja, no chat_template in "
                          f"tokenizer_config.json): {hint}")
    return tokenizer


class ChatTokenizer:
    """A Hugging Face tokenizer directory with a chat template. name, vocab_size, eod and the ids are those of
    training.data.tokenizer.HFTokenizer on the same tokenizer.json (what training checks PREFIX.json against);
    transformers renders the template (render)."""

    def __init__(self, path: str):
        if not os.path.isdir(path):
            what = ("the built-in byte tokenizer has no chat template" if path == "byte" else "a bare tokenizer "
                    "file has no chat template" if os.path.exists(path) else "no such directory")
            raise ConfigError(f"tokenizer {path}: {what}: --format sft needs the tokenizer's "
                              "directory (tokenizer.json, tokenizer_config.json, chat_template.jinja) as a Hugging "
                              "Face chat model ships it")
        base = HFTokenizer(path)  # checks tokenizer.json; gives the name training checks
        self.name, self.vocab_size, self.eod = base.name, base.vocab_size, base.eod
        from tokenizers import Tokenizer

        self.hf = hf_chat_tokenizer(path, "give the tokenizer directory of a chat (instruct) model")
        self._tok = Tokenizer.from_file(os.path.join(path, "tokenizer.json"))  # what HFTokenizer encodes with
        template = self.hf.chat_template
        text = template if isinstance(template, str) else json.dumps(template, sort_keys=True)  # named templates
        # one date for every rendering (Llama 3.2's template writes today's, strftime_now, unless given date_string):
        # a conversation rendered across midnight would not be prefix-stable
        self.date = {"date_string": time.strftime("%d %b %Y")} if "strftime_now" in text else {}
        self.template_hash = hashlib.sha256(text.encode()).hexdigest()[:16]
        ours, theirs = self.tokenize(self.render(PROBE, where=f"tokenizer {path}"))[0], self.reference(PROBE)
        if ours.tolist() != theirs:
            raise ConfigError(f"tokenizer {path}: transformers tokenizes differently from its tokenizer.json "
                              f"({theirs[:8]}... vs {ours[:8].tolist()}...): a slow or customised tokenizer class")

    def render(self, messages: list[dict], generation_prompt: bool = False, where: str = "a conversation") -> str:
        """The template's text of `messages` (with the assistant's header after them when generation_prompt)."""
        try:
            return self.hf.apply_chat_template(messages, tokenize=False, add_generation_prompt=generation_prompt,
                                               **self.date)
        except Exception as err:  # noqa: BLE001 - jinja's errors, and raise_exception() in a template
            raise ConfigError(f"{where}: the chat template refuses this conversation ({_reason(err)})") from err

    def tokenize(self, text: str) -> tuple[np.ndarray, np.ndarray]:
        """(token ids [n], start character of each token [n]) of `text`, as HFTokenizer(dir).encode(text)."""
        found = self._tok.encode(text, add_special_tokens=False)
        dtype = np.uint16 if self.vocab_size <= 1 << 16 else np.int32  # half the bytes to pickle from a worker
        return (np.asarray(found.ids, dtype=dtype),
                np.asarray([start for start, _ in found.offsets], dtype=np.int64).reshape(-1))

    def reference(self, messages: list[dict]) -> list[int]:
        """transformers' own ids of the conversation: apply_chat_template(messages, tokenize=True)."""
        found = self.hf.apply_chat_template(messages, tokenize=True, **self.date)
        return list(found["input_ids"] if hasattr(found, "keys") else found)  # 5.x: a BatchEncoding; 4.x: a list


def conversation(record, file: str, line: int) -> list[dict] | None:
    """A record (a JSON line's object, a Parquet/Arrow row's dict) -> [{"role", "content"}, ...]; None for an empty
    record (null or [] messages, null prompt and completion, or instruction and output: skipped and counted as
    dropped); a one-line error naming file:line for anything else that is not a conversation with an answer."""
    where = f"{file}:{line}"
    if not isinstance(record, dict):
        raise ConfigError(f"{where}: a {type(record).__name__}, not a JSON object with \"messages\" (or \"prompt\" "
                          f"and \"completion\")")
    key = "messages" if record.get("messages") is not None else "conversations"  # conversations: ShareGPT's
    if record.get(key) is not None:
        turns = record[key]
        if not isinstance(turns, list):
            raise ConfigError(f"{where}: \"{key}\" is a {type(turns).__name__}, not a list of "
                              f"{{\"role\", \"content\"}} objects")
        if key == "conversations":  # ShareGPT: {"from": "human" | "gpt" | "system", "value": ...}
            turns = [{"role": SHAREGPT.get(t.get("from"), t.get("from")), "content": t.get("value")}
                     if isinstance(t, dict) and "from" in t else t for t in turns]
    elif pair := next((p for p in PAIRS if p[0] in record or p[1] in record), None):
        if record.get(pair[0]) is None and record.get(pair[1]) is None:
            return None
        system = [] if record.get("system") is None else [{"role": "system", "content": record["system"]}]
        prompt = record.get(pair[0]) if pair[0] == "prompt" else alpaca_prompt(record, where)
        turns = system + [{"role": "user", "content": prompt}, {"role": "assistant", "content": record.get(pair[1])}]
    elif "messages" not in record and "conversations" not in record:
        raise ConfigError(f"{where}: no \"messages\" (or ShareGPT's \"conversations\"), nor \"prompt\" and "
                          f"\"completion\", nor Alpaca's \"instruction\" and \"output\" (its keys: "
                          f"{', '.join(map(str, record)) or 'none'})")
    else:
        return None
    if not turns:
        return None
    messages = [_message(turn, k, where) for k, turn in enumerate(turns)]
    roles = [m["role"] for m in messages]
    if "assistant" not in roles:
        raise ConfigError(f"{where}: no assistant turn (roles: {', '.join(roles)}): nothing to learn from")
    if roles[0] == "assistant":
        raise ConfigError(f"{where}: starts with the assistant: a chat template renders a prompt before an answer; "
                          f"begin with a user (or system) message")
    return messages


def alpaca_prompt(record: dict, where: str):
    """Alpaca's user turn: the instruction, a newline and the input where there is one (null, missing or "": the
    instruction alone). LLaMA-Factory's and axolotl's chat join; torchtune's AlpacaToMessages instead wraps both in
    the original "Below is an instruction ... ### Response:" prompt, which a chat template makes redundant."""
    instruction, extra = record.get("instruction"), record.get("input")
    if record.get("history"):  # LLaMA-Factory's earlier [[instruction, output], ...]: not dropped silently
        raise ConfigError(f"{where}: Alpaca's \"history\" (earlier turns) is not read: write this record as "
                          f"\"messages\" (a user and an assistant message per turn)")
    if extra is not None and not isinstance(extra, str):
        raise ConfigError(f"{where}: \"input\" is a {type(extra).__name__}, not a string")
    return f"{instruction}\n{extra}" if extra and isinstance(instruction, str) else instruction


def _message(turn, k: int, where: str) -> dict:
    if not isinstance(turn, dict):
        raise ConfigError(f"{where}: message {k} is a {type(turn).__name__}, not a {{\"role\", \"content\"}} object")
    role, content = turn.get("role"), turn.get("content")
    if role not in ROLES:
        raise ConfigError(f"{where}: message {k} has role {role!r}: use {', '.join(ROLES)}")
    if not isinstance(content, str):
        raise ConfigError(f"{where}: message {k} ({role}) has content of type {type(content).__name__}, not a string")
    return {"role": role, "content": content}


def encode(tokenizer: ChatTokenizer, messages: list[dict], where: str = "a conversation") -> tuple[np.ndarray,
                                                                                                     np.ndarray]:
    """(token ids [n], loss mask [n] uint8) of a conversation: 1 on every token whose first character lies in an
    assistant turn's answer (its content and end-of-turn text), found by rendering (the module docstring)."""
    full = tokenizer.render(messages, where=where)
    answers = []  # [(start, end)] character spans of the answers in `full`
    for i, message in enumerate(messages):
        if message["role"] != "assistant":
            continue
        before = tokenizer.render(messages[:i], generation_prompt=True, where=where)
        answer = tokenizer.render(messages[:i + 1], where=where)
        stable = answer.startswith(before) and full.startswith(before)
        answer = answer[len(before):]
        if stable and not full.startswith(answer, len(before)) and (cut := REASONING.match(answer)):
            answer = answer[cut.end():]  # a reasoning template (Qwen3) keeps the block on the last answer only
        eos = tokenizer.hf.eos_token or ""
        if stable and not full.startswith(answer, len(before)) and eos and answer.endswith(eos):
            answer = answer[:-len(eos)]  # Phi ends the text with eos_token: after the last turn only
        if not (stable and full.startswith(answer, len(before))):
            raise ConfigError(f"{where}: the chat template is not prefix-stable (rendering the conversation up to "
                              f"assistant turn {i} does not begin the longer rendering: it rewrites earlier turns), "
                              f"so the answers cannot be located; use a template that renders turns in order")
        answers.append((len(before), len(before) + len(answer)))
    ids, starts = tokenizer.tokenize(full)  # [n] each
    mask = np.zeros(len(ids), dtype=np.uint8)
    for start, end in answers:
        mask[(starts >= start) & (starts < end)] = 1
    return ids, mask


def _reason(err: Exception) -> str:
    return (str(err) or type(err).__name__).splitlines()[0]
