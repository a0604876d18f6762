"""tools/evaluate.py --pairs: how often a checkpoint prefers the chosen answer, against a reference, over every
pair of a preference dataset's split once (TRL's rewards/accuracies and margins; the objective's loss).

    cfg = pairs_config(cfg, run, args.pairs, args.reference)          # the launching process and every rank
    values = evaluate_pairs(cfg, state, layout, tokenizer, device)    # every rank; rank 0 prints them

The reference: --reference, else the one the checkpoint's own DPO run used (post.reference_load, or the
checkpoint it started from); SimPO's are reference-free. The objective and beta: the run's, or DPO's (sigmoid,
beta 0.1) for a checkpoint that was not preference-tuned. The split: data.split's validation share (the run's;
data.split=0,100,0 scores every pair of the file).
"""

from __future__ import annotations

import contextlib
import sys

from training.config.schema import Config
from training.config.schema_post import PostConfig
from training.errors import ConfigError


def pairs_config(cfg: Config, run: dict, prefix: str, reference: str | None) -> Config:
    """The evaluation config of a checkpoint's run on `prefix`'s pairs."""
    cfg.data.format, cfg.data.paths, cfg.data.weights, cfg.data.mock = type(cfg.data.format)("preference"), [prefix], \
        None, False
    if str(cfg.post.objective) == "none":
        cfg.post = PostConfig(objective=type(cfg.post.objective)("sigmoid"))
    if str(cfg.post.objective) == "simpo" or (str(cfg.post.reference) == "lora_base" and reference is None):
        return cfg  # reference-free, or the LoRA checkpoint's base (its adapters off)
    saved = run["config"]
    started = saved.get("checkpoint", {}).get("load")
    reference = reference or saved.get("post", {}).get("reference_load") or (
        started if str(saved.get("post", {}).get("objective", "none")) != "none" and started not in (None, "auto")
        else None)
    if reference is None:
        raise ConfigError(f"--pairs {prefix}: give --reference <checkpoint> (the model the preference is measured "
                          f"against, e.g. the SFT model): this checkpoint's run names none")
    cfg.post.reference, cfg.post.reference_load = type(cfg.post.reference)("live"), str(reference)
    return cfg


def evaluate_pairs(cfg: Config, state, layout, tokenizer, device) -> dict:
    from training.data.streams import micro_batch_streams
    from training.post import pairs
    from training.post.step import PreferenceObjective

    with contextlib.redirect_stdout(sys.stderr):  # the tool's stdout is its result
        objective = PreferenceObjective(cfg, state)
        _, valid = pairs.build(cfg, tokenizer, (0, 1), True)
    if valid is None or not len(valid.kept):
        raise ConfigError(f"--pairs {cfg.data.paths[0]}: no pair in its validation split (data.split={cfg.data.split}"
                          f"; data.split=0,100,0 scores every pair)")
    per_call = cfg.train.micro_batch_size * layout.dp * layout.num_microbatches
    epoch, rows = pairs.one_epoch(valid, per_call)
    streams = micro_batch_streams(len(state.model), rows, 0, cfg.train.micro_batch_size, every_stage=True)
    values = objective.measure(state, streams, layout, cfg, device, len(rows) // per_call)
    return {**values, "pairs": len(epoch.kept), "reference": cfg.post.reference_load, "objective":
            str(cfg.post.objective), "beta": cfg.post.beta}
