"""Rewards for RL on verifiable tasks: each a batched function (TRL's contract), several combined with weights.

    rewards = Rewards.of({"math": 1.0, "format": 0.1, "my_pkg.scoring:score": 0.5})
    per_function, total = rewards(samples)    # samples: [{"prompt": str, "completion": str, **the record's fields}]

A reward function takes the list of samples and returns one float per sample. Built in (the record's ground truth
under "answer"):
  exact_match  1.0 if the completion's final answer (the last \\boxed{...}, else the completion stripped) is the
               answer string, else 0.0
  math         math-verify's parse and verify of the completion against the answer (LaTeX, numbers, sets,
               expressions: 1/2 = 0.5 = \\frac{1}{2}), as the RL frameworks score math
  format       1.0 if the completion contains a \\boxed{...} answer, else 0.0 (the shape the others read)
Your own: "package.module:function" (importable from the working directory). A function that raises, returns
something other than one real number per sample, or a NaN stops the run with one line naming the function, the
sample and what it returned: never a silent zero.
"""

from __future__ import annotations

import importlib
import math
import re
from dataclasses import dataclass
from typing import Callable

from training.errors import ConfigError


class RewardError(ConfigError):
    """A reward function's failure, one line naming it and the sample."""


def final_answer(text: str) -> str:
    """The content of the last \\boxed{...} (braces balanced), else the text stripped."""
    start = text.rfind("\\boxed{")
    if start < 0:
        return text.strip()
    depth, i = 0, start + len("\\boxed{")
    for j in range(i, len(text)):
        depth += {"{": 1, "}": -1}.get(text[j], 0)
        if depth < 0:
            return text[i:j].strip()
    return text[i:].strip()


def exact_match(samples: list[dict]) -> list[float]:
    return [float(final_answer(s["completion"]) == str(s["answer"]).strip()) for s in samples]


def math_reward(samples: list[dict]) -> list[float]:
    from math_verify import parse, verify

    out = []
    for s in samples:
        gold = parse(f"${s['answer']}$") or parse(str(s["answer"]))
        out.append(float(bool(gold) and verify(gold, parse(s["completion"]))))
    return out


def format_reward(samples: list[dict]) -> list[float]:
    return [float(re.search(r"\\boxed\{.+?\}", s["completion"], re.S) is not None) for s in samples]


BUILT_IN: dict[str, Callable] = {"exact_match": exact_match, "math": math_reward, "format": format_reward}


def resolve(name: str) -> Callable:
    if name in BUILT_IN:
        return BUILT_IN[name]
    if ":" not in name:
        raise ConfigError(f"reward {name!r}: not a built-in ({', '.join(BUILT_IN)}) nor package.module:function")
    module, _, attr = name.partition(":")
    try:
        fn = getattr(importlib.import_module(module), attr)
    except (ImportError, AttributeError) as err:
        raise ConfigError(f"reward {name!r}: {type(err).__name__}: {err} (is {module} importable from here?)") from err
    if not callable(fn):
        raise ConfigError(f"reward {name!r}: {module}.{attr} is a {type(fn).__name__}, not a function")
    return fn


def _where(samples: list[dict], k: int) -> str:
    prompt = str(samples[k].get("prompt", ""))
    return f"sample {k} (prompt {prompt[:60]!r}{'...' if len(prompt) > 60 else ''})"


@dataclass
class Rewards:
    functions: dict[str, Callable]
    weights: dict[str, float]

    @classmethod
    def of(cls, weights: dict[str, float]) -> Rewards:
        if not weights:
            raise ConfigError("post.rl.rewards is empty: name at least one reward (math, exact_match, format, or "
                              "package.module:function) with its weight")
        return cls({name: resolve(name) for name in weights}, {k: float(v) for k, v in weights.items()})

    def __call__(self, samples: list[dict]) -> tuple[dict[str, list[float]], list[float]]:
        table = {}
        for name, fn in self.functions.items():
            try:
                values = fn(samples)
            except Exception as err:  # noqa: BLE001 - the user's function: its error, named, in one line
                raise RewardError(f"reward {name} raised on a batch of {len(samples)} samples: {type(err).__name__}: "
                                  f"{' '.join(str(err).split())}") from err
            values = list(values) if isinstance(values, (list, tuple)) else values
            if not isinstance(values, list) or len(values) != len(samples):
                raise RewardError(f"reward {name} returned {type(values).__name__}"
                                  f"{f' of {len(values)}' if isinstance(values, list) else ''} for {len(samples)} "
                                  f"samples: it must return one float per sample")
            for k, v in enumerate(values):
                if not isinstance(v, (int, float)) or math.isnan(v) or math.isinf(v):
                    raise RewardError(f"reward {name} returned {v!r} for {_where(samples, k)}: a reward is a finite "
                                      f"real number")
            table[name] = [float(v) for v in values]
        total = [sum(self.weights[n] * table[n][k] for n in table) for k in range(len(samples))]
        return table, total
