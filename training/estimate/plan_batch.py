"""The batch a layout plan is made for (tools/plan.py): the user's, or a realistic one for a published model.

    batch = plan_batch(cfg, overrides, params, world)
    batch.apply(cfg)      # the config the planner searches: its global batch, micro batch (1 when searched), precision
    batch.micro           # the user's train.micro_batch_size, or None: searched per layout (1, 2, 4, ...)
    batch.header          # one line saying each value and where it came from
    batch.overrides       # the planner's choices the launch command must repeat (the user's are in theirs)

The batch is part of the question a plan answers: the quickstart's 16 sequences of micro batch 4 cap data
parallelism at 4 and so push an 8 B model into context parallelism, and its micro batch 4 leaves a 30 B MoE
nothing that fits. Each value is the user's when given (on the command line or by a config file: a value that
differs from the schema's default); else, for a model of a published size (>= MIN_PARAMS):
- train.global_batch_size: TOKENS_PER_STEP / model.seq_length sequences, rounded to a multiple of the GPUs (every
  DP size divides it; at least one sequence per GPU);
- train.precision: bf16 (every published recipe trains these in bf16; fp32 is the CPU quickstart's default);
and for the small presets (tiny, moe_tiny) the config's. The micro batch is searched unless given.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

MIN_PARAMS = 1e8  # from GPT-2 small (124 M) up: a published model's shape; tiny (0.8 M) and moe_tiny (2.4 M) are not
# tokens per step, from GPT-3's table (Brown et al. 2020, Table 2.1: 0.5 M tokens up to 760 M parameters, 1-2 M at
# 1.3-13 B, 3.2 M at 175 B) and Megatron-Bridge's Llama 3 8B recipes (1 M: 128 x 8192 in its H100 benchmarks,
# 4 M: 512 x 8192 in its pre-training recipe): (from this many parameters, tokens)
TOKENS_PER_STEP = ((1e9, 2 ** 21), (MIN_PARAMS, 2 ** 19))


def given(cfg, overrides: list[str], key: str, default) -> bool:
    """Whether the user set train.<key>: typed as an override (key=, +key=, ++key=) or set by a config file."""
    typed = any(o.lstrip("+").split("=", 1)[0] == f"train.{key}" for o in overrides)
    return typed or str(getattr(cfg.train, key)) != str(default)


def published_tokens(params: int) -> int | None:
    """Tokens per step for a model of this many parameters; None below MIN_PARAMS (keep the config's batch)."""
    return next((tokens for least, tokens in TOKENS_PER_STEP if params >= least), None)


@dataclass(frozen=True)
class Batch:
    global_batch_size: int
    micro: int | None  # the user's micro batch; None: searched per layout
    precision: str
    header: str
    overrides: tuple[str, ...]

    def apply(self, cfg):
        train = dataclasses.replace(cfg.train, global_batch_size=self.global_batch_size,
                                    micro_batch_size=self.micro or 1, precision=type(cfg.train.precision)(
                                        self.precision))
        return dataclasses.replace(cfg, train=train)


def plan_batch(cfg, overrides: list[str], params: int, world: int) -> Batch:
    from training.config.schema import TrainConfig

    defaults = TrainConfig()
    t, seq = cfg.train, cfg.model.seq_length
    tokens = published_tokens(params)
    notes, extra = [], []
    micro = t.micro_batch_size if given(cfg, overrides, "micro_batch_size", defaults.micro_batch_size) else None
    users = given(cfg, overrides, "global_batch_size", defaults.global_batch_size)
    if users or tokens is None:
        global_batch = t.global_batch_size
        notes.append(f"global batch {global_batch} ({'yours' if users else 'the config default: a small model'})")
    else:
        unit = world * (micro or 1)  # every DP size's micro-batches divide it
        global_batch = max(1, round(tokens / seq / unit)) * unit
        extra.append(f"train.global_batch_size={global_batch}")
        notes.append(f"global batch {global_batch} = {global_batch * seq / 2 ** 20:.1f} M tokens a step (the "
                     f"planner's default for {params / 1e9:.1f} B parameters: ~{tokens / 2 ** 20:g} M tokens, as "
                     f"published runs use; set train.global_batch_size to plan yours)")
    notes.append(f"micro batch {micro} (yours)" if micro else
                 "micro batch searched per layout: 1, 2, 4, ... while it fits (the mb column; set "
                 "train.micro_batch_size to fix it)")
    precision = str(t.precision)
    if tokens is not None and not given(cfg, overrides, "precision", defaults.precision):
        precision = "bf16"
        extra.append("train.precision=bf16")
        notes.append("bf16 (the planner's default for a published model; set train.precision)")
    else:
        notes.append(precision)
    return Batch(global_batch, micro, precision, "batch: " + "; ".join(notes), tuple(extra))
