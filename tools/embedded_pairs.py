"""Preference pairs from the embedded corpus (Python's language reference), for the CPU recipe of docs/preference.md:
a prompt is the first four words of a sentence, the chosen answer its next four, the rejected one the same words in
reverse order. A model pretrained on the corpus prefers neither at first (DPO's reward accuracy starts at chance);
DPO teaches it the difference.

    .venv/bin/python tools/embedded_pairs.py --out data/embedded_pairs.jsonl [--pairs 2000] [--seed 0]
    .venv/bin/python tools/preprocess_data.py --format preference --input data/embedded_pairs.jsonl \\
        --output-prefix data/embedded_pairs --tokenizer byte

Each line: {"prompt": str, "chosen": str, "rejected": str} (the string layout training/post/records.py reads).
"""

from __future__ import annotations

import argparse
import json
import random
import re
import sys
from pathlib import Path


def pairs(count: int, seed: int, prompt_words: int = 4, answer_words: int = 4) -> list[dict]:
    from pydoc_data.topics import topics  # the embedded corpus (training/data/datasets.py embedded_documents)

    sentences = [s.split() for name in sorted(topics) for s in re.split(r"(?<=[.!?])\s+", topics[name])]
    usable = [(" ".join(w[:prompt_words]), w[prompt_words:prompt_words + answer_words]) for w in sentences
              if len(w) >= prompt_words + answer_words and len(set(w[prompt_words:prompt_words + answer_words])) > 2]
    rng = random.Random(seed)
    rng.shuffle(usable)
    return [{"prompt": prompt + " ", "chosen": " ".join(words), "rejected": " ".join(reversed(words))}
            for prompt, words in usable[:count]]


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", required=True, help="the JSON lines file to write")
    parser.add_argument("--pairs", type=int, default=2000, help="how many pairs (at most the corpus's sentences)")
    parser.add_argument("--seed", type=int, default=0, help="which sentences, in which order")
    args = parser.parse_args(argv)
    found = pairs(args.pairs, args.seed)
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text("".join(json.dumps(p) + "\n" for p in found))
    print(f"wrote {len(found)} pairs to {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
