"""Cross-field checks on the composed config, run once before any process group exists (train.py; the launch
scripts' tools/check_config.py before they start any process).

Every problem is one line that names the numbers involved and what to change. `validate` collects all
problems and raises one ConfigError listing them (one per line), or returns the run's Layout
(training/parallel/layout.py: dp, micro-batches, ...). The rules come from their owners: the layout's sizes
and divisors from Layout, each parallel feature's from its module (FEATURES), the model's own, the data
format's and the run settings' from here (config imports no data/, checkpoint/ or estimate/ module: they
sit above it, tests/test_structure.py). Choices (activation, precision, ...) are Enums in the schema, refused
while composing.

Three rules need the tokenizer or the data and run at start-up instead (training/engine/loop.py and
training/data/datasets.py): the vocabulary fits the model, the blocks' extra-loss names do not clash
with the metrics' keys, and every dataset split has documents.
"""

from __future__ import annotations

import os
import shutil
from importlib.util import find_spec

from models.shape import ModelShape
from models.spec import block_problem
from training.config.schema import Config
from training.config.optim_defaults import min_lr, peak_lr, run_kind
from training.errors import ConfigError
from training.parallel import context, experts, fsdp, peft, tp_blocks
from training.parallel.layout import Layout

FEATURES = (context, experts, fsdp, peft, tp_blocks)  # each has problems(cfg, layout) -> list[str]


def _positive(cfg: Config) -> list[str]:
    out = [f"{group}.{name}={getattr(getattr(cfg, group), name)} must be >= 1"
           for group, name in (("model", "num_layers"), ("model", "hidden_size"), ("model", "num_attention_heads"),
                               ("model", "seq_length"), ("parallel", "tp"), ("parallel", "pp"), ("parallel", "cp"),
                               ("parallel", "ep"), ("parallel", "etp"), ("train", "micro_batch_size"),
                               ("train", "global_batch_size"), ("train", "log_interval"))
           if getattr(getattr(cfg, group), name) < 1]
    if cfg.train.iters < 0:
        out.append(f"train.iters={cfg.train.iters} must be >= 0 (0 saves the initial checkpoint)")
    return out


def model_problems(cfg: Config, shape: ModelShape) -> list[str]:
    """The model's own rules (those against the parallel split are Layout.shape_problems)."""
    m, out = cfg.model, []
    if m.num_attention_heads % shape.num_query_groups:
        out.append(f"model.num_attention_heads={m.num_attention_heads} is not divisible by "
                   f"model.num_query_groups={shape.num_query_groups}")
    if m.kv_channels is None and m.hidden_size % m.num_attention_heads:
        out.append(f"model.hidden_size={m.hidden_size} is not divisible by model.num_attention_heads="
                   f"{m.num_attention_heads}: set model.kv_channels")
    for key in ("attention", "mlp"):
        if problem := block_problem(getattr(m, key)):
            out.append(f"model.{key}={getattr(m, key)}: {problem}")
    if m.mlp == "moe":
        out.append("model.mlp=moe: MoE layers come from model.moe.num_experts (and model.moe.first_dense, "
                   "layer_freq); model.mlp names the dense layers' MLP")
    if not (0.0 <= m.hidden_dropout < 1.0 and 0.0 <= m.attention_dropout < 1.0):
        out.append(f"dropout must be in [0, 1): model.hidden_dropout={m.hidden_dropout}, "
                   f"model.attention_dropout={m.attention_dropout}")
    r = m.rope_scaling
    if str(r.type) != "none" and (str(m.position_embedding) != "rope" or r.factor < 1 or r.original_max_position < 1
                                  or not 0 < r.low_freq_factor < r.high_freq_factor):
        out.append(f"model.rope_scaling.type={r.type} needs model.position_embedding=rope (is {m.position_embedding}),"
                   f" factor >= 1 (is {r.factor}), original_max_position >= 1 (is {r.original_max_position}) and "
                   f"0 < low_freq_factor < high_freq_factor (are {r.low_freq_factor}, {r.high_freq_factor})")
    if outside := [i for i in m.moe.dense_layers if not 0 <= i < m.num_layers]:
        out.append(f"model.moe.dense_layers={list(m.moe.dense_layers)}: {outside} are not 0-based layer indices "
                   f"below model.num_layers={m.num_layers}")
    out += shape.problems()  # the shape's own rules (models/shape.py: seq_length within a sliding window)
    if m.max_position_embeddings and m.seq_length > m.max_position_embeddings and str(m.position_embedding) != "rope":
        out.append(f"model.seq_length={m.seq_length} > model.max_position_embeddings={m.max_position_embeddings}: "
                   f"learned position embeddings have a row per position up to {m.max_position_embeddings} (the "
                   f"checkpoint's): set model.seq_length <= {m.max_position_embeddings}")
    if m.make_vocab_size_divisible_by < 1:
        out.append(f"model.make_vocab_size_divisible_by={m.make_vocab_size_divisible_by} must be >= 1")
    if m.compile and not any(shutil.which(c) for c in (os.environ.get("CXX", "g++"), "g++", "clang++")):
        out.append("model.compile=true: torch.compile's inductor builds its kernels with a C/C++ compiler and none "
                   "is on PATH (CXX, g++, clang++): install g++ (apt-get install g++) or set model.compile=false")
    return out


def parallel_problems(cfg: Config) -> list[str]:
    """parallel.* settings that are not sizes."""
    p, out = cfg.parallel, []
    if p.overlap_param_gather and not p.dist_opt:
        out.append("parallel.overlap_param_gather=true needs parallel.dist_opt=true (it overlaps the "
                   "distributed optimizer's parameter all-gather)")
    if p.overlap_param_gather and not p.overlap_grad_reduce:
        out.append("parallel.overlap_param_gather=true needs parallel.overlap_grad_reduce=true (Megatron-Core)")
    if p.timeout_minutes <= 0:
        out.append(f"parallel.timeout_minutes={p.timeout_minutes} must be > 0")
    return out


def wandb_missing(mode: str) -> str:
    """train.wandb asks for Weights & Biases, an optional extra (training/engine/wandb_log.py raises it too)."""
    return f"train.wandb.mode={mode} needs the wandb package, which is not installed: pip install -e '.[wandb]'"


def run_problems(cfg: Config) -> list[str]:
    """The optimizer, the schedule of the run, the data and the checkpoint settings."""
    o, t, c, d = cfg.optim, cfg.train, cfg.checkpoint, cfg.data
    rules = [
        (peak_lr(cfg) >= min_lr(cfg) >= 0, f"optim.lr={peak_lr(cfg)} must be >= optim.min_lr={min_lr(cfg)} >= 0"
         + ("" if o.lr is not None else f" (optim.lr: the {run_kind(cfg)} default)")),
        (o.warmup_iters >= 0, f"optim.warmup_iters={o.warmup_iters} must be >= 0"),
        (o.decay_iters is None or o.decay_iters >= 1, f"optim.decay_iters={o.decay_iters} must be >= 1"),
        (o.clip_grad >= 0, f"optim.clip_grad={o.clip_grad} must be >= 0 (0 disables clipping)"),
        (min(t.eval_interval, t.save_interval, t.exit_interval, t.save_interval_minutes) >= 0,
         "train.eval_interval, save_interval, save_interval_minutes and exit_interval must be >= 0"),
        (t.eval_interval == 0 or t.eval_iters >= 1,
         f"train.eval_iters={t.eval_iters} must be >= 1 when train.eval_interval > 0"),
        (not t.profile or 0 <= t.profile_start < t.profile_end,
         f"train.profile_start={t.profile_start} must be < train.profile_end={t.profile_end}"),
        (0.0 < t.max_memory_fraction, f"train.max_memory_fraction={t.max_memory_fraction} must be > 0"),
        (t.watchdog_factor >= 0 and t.watchdog_min_seconds >= 0,
         f"train.watchdog_factor={t.watchdog_factor} and train.watchdog_min_seconds={t.watchdog_min_seconds} "
         f"must be >= 0 (factor 0: no watchdog)"),
        (c.dir is not None or not (t.save_interval or t.save_interval_minutes or t.exit_interval
                                   or t.exit_duration_minutes),
         "train.save_interval / save_interval_minutes / exit_interval / exit_duration_minutes save checkpoints: "
         "set checkpoint.dir"),
        (len(d.weights or []) in (0, len(d.paths)),
         f"data.weights has {len(d.weights or [])} entries but data.paths has {len(d.paths)}"),
        (not d.weights or all(w >= 0 for w in d.weights) and sum(d.weights) > 0,
         f"data.weights={d.weights} must be >= 0 with a positive sum"),
        (t.wandb.mode == "disabled" or find_spec("wandb") is not None, wandb_missing(t.wandb.mode)),
        (c.keep >= 0, f"checkpoint.keep={c.keep} must be >= 0"),
        (not c.async_save or cfg.parallel.fsdp == "none",
         f"checkpoint.async_save=true writes Megatron-Core's torch_dist format; parallel.fsdp={cfg.parallel.fsdp} "
         f"saves synchronously: set checkpoint.async_save=false"),
        (not c.finetune or c.load not in (None, "auto"),
         f"checkpoint.finetune=true needs checkpoint.load=<a checkpoint path> (got {c.load})"),
        (c.load in (None, "auto") or os.path.exists(c.load),
         f"checkpoint.load={c.load} does not exist (use auto, null, or an existing checkpoint path)"),
    ]
    return [message for ok, message in rules if not ok]


def data_problems(cfg: Config, layout: Layout) -> list[str]:
    """data.format=sft's and preference's rules (packed per sequence: training/data/sft.py, training/post/pairs.py),
    and post.objective's."""
    d, fmt = cfg.data, str(cfg.data.format)
    out = post_problems(cfg)
    if fmt not in ("sft", "preference"):
        return out
    what = "conversations" if fmt == "sft" else "preference pairs"
    if not d.paths or d.mock:
        out.append(f"data.format={fmt} needs data.paths: {what} written by tools/preprocess_data.py --format {fmt} "
                   "(the embedded corpus and data.mock are plain text)")
    if d.weights:
        out.append(f"data.format={fmt} reads data.paths one after another: remove data.weights={list(d.weights)}")
    if layout.cp > 1:
        out.append(f"data.format={fmt} with parallel.cp={layout.cp}: context parallelism does not take packed "
                   f"sequences here (each rank's zigzag share would cut through {what}): use parallel.cp=1")
    return out


def post_problems(cfg: Config) -> list[str]:
    """post.*: a preference objective trains on pairs, with a reference where it needs one (training/post/)."""
    p, fmt, objective = cfg.post, str(cfg.data.format), str(cfg.post.objective)
    if objective == "grpo":
        from training.config.validate_rl import rl_problems

        return rl_problems(cfg)
    if objective == "none":
        return ["data.format=preference trains with a preference objective: add post=dpo (or post=simpo)"] \
            if fmt == "preference" else []
    out = [] if fmt == "preference" else [f"post.objective={objective} trains on preference pairs: set "
                                          f"data.format=preference (tools/preprocess_data.py --format preference)"]
    reference, free = str(p.reference), objective == "simpo"
    if free and reference != "none":
        out.append(f"post.objective=simpo is reference-free: set post.reference=none (it is {reference})")
    if not free and reference == "none":
        out.append(f"post.objective={objective} compares the policy with a reference: set post.reference=stored "
                   f"(or live, or lora_base with peft=lora)")
    if reference == "lora_base" and str(cfg.peft.method) != "lora":
        out.append("post.reference=lora_base is the policy with its adapters off: it needs peft=lora")
    if reference in ("live", "stored") and p.reference_load is None and cfg.checkpoint.load in (None, "auto"):
        out.append(f"post.reference={reference} scores with the reference model: set post.reference_load="
                   "<checkpoint> (or checkpoint.load=<the SFT checkpoint> with checkpoint.finetune=true)")
    if p.beta <= 0:
        out.append(f"post.beta={p.beta} must be > 0")
    if not 0 <= p.label_smoothing < 0.5:
        out.append(f"post.label_smoothing={p.label_smoothing} must be in [0, 0.5)")
    if p.label_smoothing and objective not in ("robust", "simpo"):
        out.append(f"post.label_smoothing={p.label_smoothing} is read by post.objective=robust and simpo, not "
                   f"{objective}")
    if p.sft_weight < 0:
        out.append(f"post.sft_weight={p.sft_weight} must be >= 0")
    return out


def notes(cfg: Config) -> list[str]:
    """What is allowed but worth a line: printed before the config line (tools/check_config.py, the ranks)."""
    m, out = cfg.model, []
    if (m.max_position_embeddings and m.seq_length > m.max_position_embeddings
            and str(m.position_embedding) == "rope"):  # learned positions: a problem (model_problems)
        scaled = f" (model.rope_scaling.type={m.rope_scaling.type})" if str(m.rope_scaling.type) != "none" else ""
        out.append(f"note: model.seq_length={m.seq_length} > model.max_position_embeddings={m.max_position_embeddings}"
                   f", the context the checkpoint was trained for: RoPE{scaled} runs past it, untrained there (set "
                   f"model.rope_scaling.* to extend the context, or model.seq_length <= {m.max_position_embeddings})")
    return out


def problems(cfg: Config, world_size: int) -> list[str]:
    """All violated rules, one line each (empty when the config is valid)."""
    out = _positive(cfg)
    if out:  # the arithmetic below assumes positive sizes
        return out
    layout = Layout.of(cfg, world_size)
    shape = ModelShape.of(cfg.model)
    out = layout.problems() + model_problems(cfg, shape) + layout.shape_problems(shape) + parallel_problems(cfg)
    for feature in FEATURES:
        out += feature.problems(cfg, layout)
    out += data_problems(cfg, layout)
    return out + layout.batch_problems() + run_problems(cfg)


def validate(cfg: Config, world_size: int | None = None) -> Layout:
    """Raise ConfigError listing every problem; else return the run's layout."""
    if world_size is None:
        world_size = int(os.environ.get("WORLD_SIZE", "1"))
    found = problems(cfg, world_size)
    if found:
        raise ConfigError("\n".join(found))
    return Layout.of(cfg, world_size)
