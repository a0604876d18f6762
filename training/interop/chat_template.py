"""A tokenizer directory's chat template, for tools/generate.py --chat: the prompt ids of a conversation as
transformers renders them (AutoTokenizer.apply_chat_template with add_generation_prompt=True: exactly the
template's ids, no special tokens added on top) and the ids that end the assistant's turn.

    chat = ChatTemplate.load(spec)          # --tokenizer or the run's data.tokenizer: a directory or its tokenizer.json
    ids = chat.prompt_ids(conversation("Hi", system="Be brief."))
    stops = chat.stop_ids(eod)              # the eos token, generation_config.json / config.json eos ids, eod

Local files only (no network); transformers is imported when a template is loaded.
"""

from __future__ import annotations

import json
from pathlib import Path

from training.data.chat import hf_chat_tokenizer
from training.errors import ConfigError

GIVE = ("give --tokenizer a Hugging Face tokenizer directory with one (chat_template.jinja or tokenizer_config.json's "
        "chat_template), e.g. the directory the model was imported from")


def conversation(user: str, system: str | None = None, history: list[dict] | None = None) -> list[dict]:
    """The messages of one prompt: the system message (if any), earlier turns, then the user's."""
    head = [{"role": "system", "content": system}] if system else []
    return head + list(history or []) + [{"role": "user", "content": user}]


class ChatTemplate:
    def __init__(self, directory: Path, tokenizer):
        self.directory, self.tokenizer = directory, tokenizer  # tokenizer: transformers' AutoTokenizer

    @classmethod
    def load(cls, spec: str) -> ChatTemplate:
        """The template of the tokenizer `spec`; a one-line ConfigError when it has none."""
        if spec == "byte":
            raise ConfigError(f"--chat: the tokenizer is `byte`, which has no chat template: {GIVE}")
        path = Path(spec)
        directory = path if path.is_dir() else path.parent
        return cls(directory, hf_chat_tokenizer(directory, GIVE))

    def prompt_ids(self, messages: list[dict]) -> list[int]:
        """The conversation rendered and tokenized by the template, ending with the assistant's header."""
        encoded = self.tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True,
                                                     return_dict=True)
        return [int(i) for i in encoded["input_ids"]]

    def stop_ids(self, eod: int) -> list[int]:
        """Ids that end the assistant's turn: the tokenizer's eos token, the eos_token_id(s) of the directory's
        generation_config.json and config.json, and the end of document."""
        ids = {int(eod)}
        if self.tokenizer.eos_token_id is not None:
            ids.add(int(self.tokenizer.eos_token_id))
        for name in ("generation_config.json", "config.json"):
            file = self.directory / name
            if file.is_file():
                value = json.loads(file.read_text()).get("eos_token_id")
                ids |= {int(i) for i in (value if isinstance(value, list) else [value]) if i is not None}
        return sorted(ids)
