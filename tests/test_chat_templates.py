"""training.data.chat.encode on the chat templates users bring, verbatim as published (tests/fixtures/chat_templates,
sources in its README): Llama 3.1 / 3.2 Instruct (tool-capable, a dated system block), Qwen2.5 Instruct (with its
tool branch), Qwen3 (reasoning blocks), Mistral Nemo, Gemma 2, Gemma 3 (system folded into the first user turn),
Phi-4-mini (`<|end|>`; eos_token after the last turn), each on a byte vocabulary plus the family's special
tokens (tests/chat_fixtures.py). The reference is transformers' apply_chat_template: an accepted conversation gives
exactly its ids, and its masked tokens are exactly each answer as the template writes it with its end of turn (Qwen3's
last answer with the empty reasoning block the template adds); the others are refused in one line. In-process, seconds.
"""

import hashlib
from datetime import datetime

import numpy as np
import pytest
from chat_fixtures import REAL, TEMPLATES, real_chat_tokenizer
from corpora import EXPECTED_WARNINGS

from training.data import chat
from training.errors import ConfigError

pytestmark = EXPECTED_WARNINGS

SHA256 = {"llama3.1": "e10ca381b1ccc5cf", "llama3.2": "5816fce10444e03c", "qwen2.5": "cd8e9439f0570856",
          "qwen3": "87a2728cb8dc9fe4", "mistral-nemo": "e4676cb56dffea77", "gemma2": "ecd6ae513fe103f0",
          "gemma3": "7de1c58e208eda46", "phi4-mini": "febf589225c9728a"}
SINGLE = [{"role": "user", "content": "Capital of France?"}, {"role": "assistant", "content": "Paris."}]
SYSTEM = [{"role": "system", "content": "Answer in one word."}, *SINGLE]
MULTI = [{"role": "user", "content": "héllo 中文, 2+2?"}, {"role": "assistant", "content": "4 😀"},
         {"role": "user", "content": "And 3+3?"}, {"role": "assistant", "content": "  6, with spaces  "}]
CONVERSATIONS = {"single": SINGLE, "system": SYSTEM, "multi": MULTI}
THINK = "<think>\n\n</think>\n\n"  # what Qwen3 writes before the last answer (and only the last)
UNSTABLE = "the chat template is not prefix-stable (rendering the conversation up to assistant turn {} does not"
EXPECTED = {  # (template, conversation): the text of each masked run, or how the one-line refusal begins
    ("llama3.1", "single"): ["Paris.<|eot_id|>"],
    ("llama3.1", "system"): ["Paris.<|eot_id|>"],
    ("llama3.1", "multi"): ["4 😀<|eot_id|>", "6, with spaces<|eot_id|>"],  # the template trims answers
    ("llama3.2", "single"): ["Paris.<|eot_id|>"],
    ("llama3.2", "system"): ["Paris.<|eot_id|>"],
    ("llama3.2", "multi"): ["4 😀<|eot_id|>", "6, with spaces<|eot_id|>"],
    ("qwen2.5", "single"): ["Paris.<|im_end|>\n"],
    ("qwen2.5", "system"): ["Paris.<|im_end|>\n"],
    ("qwen2.5", "multi"): ["4 😀<|im_end|>\n", "  6, with spaces  <|im_end|>\n"],
    ("qwen3", "single"): [THINK + "Paris.<|im_end|>\n"],
    ("qwen3", "system"): [THINK + "Paris.<|im_end|>\n"],
    # turn 1 alone is rendered with THINK, the whole conversation without it there: located without it
    ("qwen3", "multi"): ["4 😀<|im_end|>\n", THINK + "  6, with spaces  <|im_end|>\n"],
    ("mistral-nemo", "single"): ["Paris.</s>"],
    ("mistral-nemo", "system"): UNSTABLE.format(2),  # the system text goes into the LAST user turn, if it is last
    ("mistral-nemo", "multi"): ["4 😀</s>", "  6, with spaces  </s>"],
    ("gemma2", "single"): ["Paris.<end_of_turn>\n"],
    ("gemma2", "system"): "the chat template refuses this conversation (System role not supported)",
    ("gemma2", "multi"): ["4 😀<end_of_turn>\n", "6, with spaces<end_of_turn>\n"],
    ("gemma3", "single"): ["Paris.<end_of_turn>\n"],  # the `model` role; the system folded into the first user turn
    ("gemma3", "system"): ["Paris.<end_of_turn>\n"],
    ("gemma3", "multi"): ["4 😀<end_of_turn>\n", "6, with spaces<end_of_turn>\n"],
    # Phi writes eos_token after the last turn when no generation prompt follows: the last answer ends with it
    ("phi4-mini", "single"): ["Paris.<|end|><|endoftext|>"],
    ("phi4-mini", "system"): ["Paris.<|end|><|endoftext|>"],
    ("phi4-mini", "multi"): ["4 😀<|end|>", "  6, with spaces  <|end|><|endoftext|>"],
}


@pytest.fixture(scope="module")
def tokenizers(tmp_path_factory):
    """{template name: its ChatTokenizer}."""
    root = tmp_path_factory.mktemp("templates")
    return {name: chat.ChatTokenizer(str(real_chat_tokenizer(root / name, name))) for name in REAL}


def masked_runs(tok: chat.ChatTokenizer, ids: np.ndarray, mask: np.ndarray) -> list[str]:
    """The text of each maximal run of masked tokens, special tokens included."""
    edges = np.flatnonzero(np.diff(np.concatenate([[0], mask.astype(int), [0]])))  # [2 * runs] starts and ends
    return [tok._tok.decode(ids[a:b].tolist(), skip_special_tokens=False) for a, b in zip(edges[::2], edges[1::2])]


def test_the_fixtures_are_the_published_templates(tokenizers):
    for name, (specials, _, _, plain) in REAL.items():
        text = (TEMPLATES / f"{name}.jinja").read_bytes()
        assert hashlib.sha256(text).hexdigest()[:16] == SHA256[name], f"{name}.jinja is not the published template"
        tok = tokenizers[name]
        assert tok.hf.chat_template == text.decode(), name
        for token in [*specials, *plain]:  # one id each, as in the family's own vocabulary
            assert len(tok.tokenize(token)[0]) == 1, (name, token)
    before = datetime.now().strftime("%d %b %Y")  # Llama 3.2 dates its system block with strftime_now
    dated = tokenizers["llama3.2"].render(SINGLE)
    assert any(f"Cutting Knowledge Date: December 2023\nToday Date: {day}\n\n<|eot_id|>" in dated
               for day in (before, datetime.now().strftime("%d %b %Y"))), dated
    today, tokenizers["llama3.2"].date["date_string"] = tokenizers["llama3.2"].date["date_string"], "01 Jan 2000"
    assert "\nToday Date: 01 Jan 2000\n\n" in tokenizers["llama3.2"].render(SINGLE)  # one date, fixed at loading:
    tokenizers["llama3.2"].date["date_string"] = today  # no rendering changes at midnight
    assert "\nToday Date: 26 Jul 2024\n\n" in tokenizers["llama3.1"].render(SINGLE)
    assert "You are Qwen, created by Alibaba Cloud." in tokenizers["qwen2.5"].render(SINGLE)
    assert tokenizers["qwen3"].render(SINGLE).startswith("<|im_start|>user\n")  # no default system prompt


@pytest.mark.parametrize("name", sorted(REAL))
def test_encode_equals_the_template_or_refuses_in_one_line(tokenizers, name):
    tok = tokenizers[name]
    for conversation, messages in CONVERSATIONS.items():
        expected = EXPECTED[name, conversation]
        if isinstance(expected, str):
            with pytest.raises(ConfigError) as refused:
                chat.encode(tok, messages, where="chats.jsonl:3")
            message = str(refused.value)
            assert message.startswith(f"chats.jsonl:3: {expected}") and "\n" not in message, (conversation, message)
            continue
        ids, mask = chat.encode(tok, messages, where="chats.jsonl:3")
        assert mask.dtype == np.uint8 and ids.shape == mask.shape
        assert ids.tolist() == tok.hf.apply_chat_template(messages, tokenize=True)["input_ids"], conversation
        assert masked_runs(tok, ids, mask) == expected, conversation


@pytest.mark.parametrize("name, prompt_text, turn_end", [
    # Gemma 3: the system message folded into the first user turn, the answer under the `model` role
    ("gemma3", "<bos><start_of_turn>user\nAnswer in one word.\n\nCapital of France?<end_of_turn>\n"
               "<start_of_turn>model\n", "<end_of_turn>"),
    ("phi4-mini", "<|system|>Answer in one word.<|end|><|user|>Capital of France?<|end|><|assistant|>", "<|end|>"),
])
def test_generate_chat_prompts_and_stops_with_gemma3_and_phi(tokenizers, tmp_path, name, prompt_text, turn_end):
    """generate --chat (training/interop/chat_template.py): the prompt is the template's with the generation prompt,
    and decoding stops at the end of the turn that the family's generation_config.json lists (Gemma 3: <eos> and
    <end_of_turn>; Phi-4-mini: <|end|> and <|endoftext|>), as the published configs do."""
    import shutil

    from training.interop.chat_template import ChatTemplate, conversation

    tok = tokenizers[name]
    directory = tmp_path / name
    shutil.copytree(tok.hf.name_or_path, directory)
    end, eos = (int(tok.tokenize(t)[0][0]) for t in (turn_end, tok.hf.eos_token))
    (directory / "generation_config.json").write_text(f'{{"eos_token_id": [{eos}, {end}]}}')
    chat = ChatTemplate.load(str(directory))
    ids = chat.prompt_ids(conversation("Capital of France?", system="Answer in one word."))
    assert ids == tok.tokenize(prompt_text)[0].tolist()
    assert end in chat.stop_ids(eod=tok.eod) and eos in chat.stop_ids(eod=tok.eod)
