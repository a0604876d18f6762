"""Generate text from a checkpoint: ours at whatever layout it was saved, or one imported from Hugging Face.

    .venv/bin/python tools/generate.py --ckpt outputs/<run>/checkpoints --prompt "The import statement" \
        --max-new-tokens 200
    .venv/bin/python tools/generate.py --ckpt ckpts/my_llama --tokenizer ~/hf/Llama-2-7b-hf --prompt "Hello" --greedy \
        --json
    .venv/bin/python tools/generate.py --ckpt DIR --prompt-file prompts.txt --temperature 0.8 --top-p 0.95 --seed 3
    .venv/bin/python tools/generate.py --ckpt DIR --prompt "x" --nproc 2 parallel.tp=2      # 2 processes (gloo or NCCL)
    .venv/bin/python tools/generate.py --ckpt DIR --chat --system "Be brief." --prompt "Who are you?" --greedy
    .venv/bin/python tools/generate.py --ckpt DIR --chat                # on a terminal: a conversation, turn by turn
    torchrun --nproc-per-node 4 tools/generate.py --ckpt DIR --prompt "x" parallel.tp=2 parallel.pp=2

The checkpoint's run.json gives the model and the tokenizer it was trained with (--tokenizer overrides it);
arguments that are not flags are Hydra-style overrides, here the layout (parallel.tp, parallel.pp: the weights
reshard on load; one model replica, so processes = tp x pp). Prompts of different lengths share a batch.
Decoding stops at end-of-document or --max-new-tokens. With one prompt the text streams as it is written; with
--json each prompt gives one line {"prompt", "prompt_ids", "new_ids", "text"} (ids the tokenizer cannot spell,
where the model's vocabulary is larger than the tokenizer's, are in new_ids and left out of text).
--no-cache recomputes the whole sequence every step (the KV cache's reference); --bench prints tokens/s.

--chat: each prompt is a user message (after --system's, if given), rendered by the tokenizer directory's chat
template (transformers' apply_chat_template with add_generation_prompt=True: prompt_ids are exactly the
template's ids); decoding stops at the end of the assistant's turn (the tokenizer's eos token, the eos_token_id
of the directory's generation_config.json / config.json, end-of-document) and the output is the answer alone.
Without a prompt, on a terminal, one process: a multi-turn conversation (an empty line or Ctrl-D ends it).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

from training.errors import ConfigError, exit_on_error
from training.parallel.launch_local import run_local
from training.shims.noise import quiet_known_noise


def parse_args(argv):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("overrides", nargs="*", help="layout overrides: parallel.tp=2 parallel.pp=2")
    ap.add_argument("--ckpt", help="a checkpoint directory (with `latest`) or an iter_* directory")
    ap.add_argument("--random-init", action="store_true", help="no checkpoint: a randomly initialised model of the "
                                                               "overrides' config (model=llama_1b ...), for --bench")
    ap.add_argument("--tokenizer", help="byte or a tokenizer.json (or its directory); default: the run's")
    ap.add_argument("--prompt", action="append", default=[], help="a prompt (repeat for a batch)")
    ap.add_argument("--prompt-file", help="one prompt per line")
    ap.add_argument("--chat", action="store_true", help="prompts are user messages in the tokenizer's chat template; "
                                                        "the output is the assistant's answer")
    ap.add_argument("--system", help="with --chat: a system message before each prompt")
    ap.add_argument("--max-new-tokens", type=int, default=128)
    ap.add_argument("--greedy", action="store_true", help="the most likely token every step (default: sample)")
    ap.add_argument("--temperature", type=float, default=1.0)
    ap.add_argument("--top-k", type=int, default=0, help="sample from the k most likely tokens (0: all)")
    ap.add_argument("--top-p", type=float, default=1.0, help="sample from the smallest set reaching p (1: all)")
    ap.add_argument("--seed", type=int, default=0, help="the sampling generator's seed")
    ap.add_argument("--json", action="store_true", help="one JSON object per prompt instead of text")
    ap.add_argument("--no-cache", action="store_true", help="recompute every position each step (no KV cache)")
    ap.add_argument("--bench", action="store_true", help="also print new tokens per second")
    ap.add_argument("--nproc", type=int, default=1, help="processes to spawn (ignored under torchrun)")
    return ap.parse_args(argv)


def check(args) -> None:
    """The user's mistakes, before any process starts."""
    if (args.ckpt is None) == (not args.random_init):
        raise ConfigError("give --ckpt DIR, or --random-init with the model's overrides (for a benchmark)")
    if args.system is not None and not args.chat:
        raise ConfigError("--system is a chat template's system message: add --chat")
    if not args.prompt and not args.prompt_file and not interactive(args):
        raise ConfigError("give a prompt: --prompt TEXT (repeatable) or --prompt-file FILE"
                          + (" (or --chat on a terminal: a conversation)" if not args.chat else ""))
    if interactive(args) and args.nproc > 1:
        raise ConfigError(f"the conversation on a terminal runs in one process (--nproc={args.nproc}): give "
                          f"--prompt or --prompt-file to chat at parallel.tp * pp > 1")
    if args.chat and args.tokenizer:  # a missing template, before any process (the run's tokenizer: in run)
        from training.interop.chat_template import ChatTemplate

        ChatTemplate.load(args.tokenizer)
    if args.max_new_tokens < 1:
        raise ConfigError(f"--max-new-tokens={args.max_new_tokens} must be >= 1")
    if "WORLD_SIZE" not in os.environ and (args.nproc > 1 or any(o.startswith("parallel.") for o in args.overrides)):
        quiet_known_noise()  # before Megatron-Core's imports warn
        from training.interop.generation import inference_config, random_config  # the layout against --nproc

        cfg = (inference_config(args.ckpt, args.overrides) if args.ckpt else random_config(args.overrides))[0]
        if problem := replica_problem(args.nproc, cfg):
            raise ConfigError(problem)
    if not args.greedy and (args.temperature <= 0 or not 0 < args.top_p <= 1 or args.top_k < 0):
        raise ConfigError(f"--temperature={args.temperature} must be > 0, --top-p={args.top_p} in (0, 1], "
                          f"--top-k={args.top_k} >= 0 (or --greedy)")


def replica_problem(world: int, cfg) -> str | None:
    p = cfg.parallel
    if world != p.tp * p.pp:
        return (f"generation runs one model replica: {world} processes but parallel.tp * pp = {p.tp} * {p.pp} = "
                f"{p.tp * p.pp} (start tp * pp processes: --nproc {p.tp * p.pp})")
    return None


def interactive(args) -> bool:
    """--chat without prompts, typed on a terminal: a conversation."""
    return args.chat and not args.prompt and not args.prompt_file and sys.stdin.isatty()


def prompts_of(args) -> list[str]:
    texts = list(args.prompt)
    if args.prompt_file:
        texts += [line for line in Path(args.prompt_file).read_text().splitlines() if line.strip()]
    return texts


def run(args) -> None:
    """In every process (torchrun or a spawned worker)."""
    quiet_known_noise()  # before Megatron-Core's imports warn
    import torch

    from training.data.tokenizer import build_tokenizer
    from training.interop.chat_template import ChatTemplate, conversation
    from training.interop.generation import Sampling, generate, inference_config, load_model, random_config
    from training.parallel import dist as D

    cfg, shape, path = inference_config(args.ckpt, args.overrides) if args.ckpt else random_config(args.overrides)
    world = int(os.environ.get("WORLD_SIZE", "1"))
    if problem := replica_problem(world, cfg):  # under torchrun (spawned here, check found it before any process)
        raise ConfigError(problem)
    texts = prompts_of(args)
    if not texts and world > 1:  # only a terminal's conversation has no prompts (check)
        raise ConfigError(f"the conversation on a terminal runs in one process ({world} here): give --prompt or "
                          f"--prompt-file to chat at parallel.tp * pp = {world}")
    spec = args.tokenizer or cfg.data.tokenizer
    tokenizer = build_tokenizer(spec)
    chat = ChatTemplate.load(spec) if args.chat else None  # before the model: a missing template fails fast
    stops = chat.stop_ids(tokenizer.eod) if chat else [tokenizer.eod]
    if chat:
        prompts = [chat.prompt_ids(conversation(text, args.system)) for text in texts]
    else:
        prompts = [tokenizer.encode(text) for text in texts]
    sampling = Sampling(args.greedy, args.temperature, args.top_k, args.top_p, args.seed)
    rank0 = os.environ.get("RANK", "0") == "0"

    def spell(ids) -> str:  # the stop ids, and ids the tokenizer cannot spell, are left out
        return tokenizer.decode([i for i in ids if i < tokenizer.vocab_size and i not in stops])

    with D.distributed(**D.layout_of(cfg)) as info:
        if not torch.cuda.is_available():
            torch.set_num_threads(max(1, (os.cpu_count() or 1) // world))
        state = load_model(cfg, shape, info.device)

        def complete(batch: list[list[int]], echo: str | None) -> list[list[int]]:
            """New ids per prompt; with echo (one prompt) the text streams after echo."""
            written: list[int] = []

            def on_step(step, picked):
                if echo is not None:  # the text so far, minus what is already on the terminal
                    if not written:  # the prompt after the first forward: what it warns lands before the text
                        print(echo, end="", flush=True)
                    before = spell(written)
                    written.append(int(picked[0]))
                    print(spell(written)[len(before):], end="", flush=True)

            return generate(state, batch, args.max_new_tokens, sampling, stops, info.device,
                            use_cache=not args.no_cache, on_step=on_step)

        if not texts:  # a conversation on a terminal
            return converse(args, chat, conversation, complete, spell)
        stream = rank0 and not args.json and len(prompts) == 1
        start = time.perf_counter()
        new_ids = complete(prompts, ("" if chat else texts[0]) if stream else None)
        seconds = time.perf_counter() - start
        if not rank0:
            return
        if stream:
            print()
        for text, ids, new in zip(texts, prompts, new_ids):
            if args.json:
                print(json.dumps({"prompt": text, "prompt_ids": ids, "new_ids": new, "text": spell(new)}), flush=True)
            elif not stream:
                print(f"--- {text!r}\n{'' if chat else text}{spell(new)}", flush=True)
        if args.bench:
            count = sum(len(n) for n in new_ids)
            print(f"{count} new tokens in {seconds:.2f} s: {count / seconds:,.1f} tokens/s ({len(prompts)} "
                  f"prompts, {'no cache' if args.no_cache else 'KV cache'}, {path or 'random weights'}, "
                  f"{cfg.model.name})", flush=True)


def converse(args, chat, conversation, complete, spell) -> None:
    """Turn by turn on a terminal (one process): each answer joins the history the next prompt renders."""
    history: list[dict] = []
    print("(an empty line or Ctrl-D ends the conversation)", file=sys.stderr, flush=True)
    while True:
        try:
            print("you> ", end="", flush=True)  # on stdout (input's own prompt goes to stderr without readline)
            user = input()
        except (EOFError, KeyboardInterrupt):
            print()
            return
        if not user.strip():
            return
        (new,) = complete([chat.prompt_ids(conversation(user, args.system, history))], "")
        print(flush=True)
        history += [{"role": "user", "content": user}, {"role": "assistant", "content": spell(new)}]


def main(argv=None) -> int:
    args = parse_args(argv)
    if code := exit_on_error(check, args):
        return code
    return run_local(run, args, args.nproc)


if __name__ == "__main__":  # the guard matters: spawned workers re-import this file
    sys.exit(main(sys.argv[1:]))
