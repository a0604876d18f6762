"""Cross-field checks on the composed config, run once (train.py; the launch scripts' tools/check_config.py
before they start any process) before any process group exists.

Every problem is one line that names the numbers involved and what to change. `validate` collects
all problems and raises one ConfigError listing them (one per line), or returns the sizes the rest of
the run uses (DP size, micro-batches per step, tokens per step). Choices (activation, precision, ...)
are Enums in the schema, refused while composing; the model's sizes are read from models/shape.py.
"""

from __future__ import annotations

import importlib.util
import os
from dataclasses import dataclass

from models.shape import ModelShape
from models.spec import block_problem
from training.config.schema import Config
from training.errors import ConfigError


@dataclass(frozen=True)
class Derived:
    world_size: int
    dp: int
    num_microbatches: int  # micro-batches per DP rank per optimizer step (gradient accumulation)
    tokens_per_step: int
    cp: int = 1  # context parallel: the ranks of one DP replica that share its sequences

    def describe(self, cfg: Config) -> str:
        t, p = cfg.train, cfg.parallel
        experts = "" if p.ep * p.etp == 1 else \
            f" (experts: ep {p.ep} x etp {p.etp} x edp {self.world_size // (p.pp * p.ep * p.etp)} per stage)"
        context = f" x cp {p.cp}" if p.cp > 1 else ""
        return (f"world {self.world_size} = tp {p.tp} x pp {p.pp}{context} x dp {self.dp}{experts}; "
                f"global batch {t.global_batch_size} = micro {t.micro_batch_size} x dp {self.dp} x "
                f"accumulation {self.num_microbatches}; {self.tokens_per_step} tokens/step")


def _get(cfg: Config, dotted: str):
    group, name = dotted.split(".")
    return getattr(getattr(cfg, group), name)


def problems(cfg: Config, world_size: int) -> list[str]:
    """All violated rules, one line each (empty when the config is valid)."""
    m, p, t, o = cfg.model, cfg.parallel, cfg.train, cfg.optim
    out: list[str] = []

    def need(ok: bool, message: str) -> None:
        if not ok:
            out.append(message)

    for key in ("model.num_layers", "model.hidden_size", "model.num_attention_heads", "model.seq_length",
                "parallel.tp", "parallel.pp", "parallel.cp", "train.micro_batch_size", "train.global_batch_size",
                "train.log_interval"):
        need(_get(cfg, key) >= 1, f"{key}={_get(cfg, key)} must be >= 1")
    need(t.iters >= 0, f"train.iters={t.iters} must be >= 0 (0 saves the initial checkpoint)")
    if out:  # the arithmetic below assumes positive sizes and known choices
        return out

    tp, pp, cp = p.tp, p.pp, p.cp
    shape = ModelShape.of(m)
    if cp == 1:
        need(world_size % (tp * pp) == 0,
             f"world size {world_size} is not divisible by parallel.tp * parallel.pp = {tp} * {pp} = {tp * pp}: "
             f"start a multiple of {tp * pp} processes (NPROC) or change tp/pp")
    else:
        need(world_size % (tp * pp * cp) == 0,
             f"world size {world_size} is not divisible by parallel.tp * pp * cp = {tp} * {pp} * {cp} = "
             f"{tp * pp * cp}: start a multiple of {tp * pp * cp} processes (NPROC) or change tp/pp/cp")
    need(m.num_attention_heads % tp == 0,
         f"model.num_attention_heads={m.num_attention_heads} is not divisible by parallel.tp={tp}")
    groups = shape.num_query_groups
    need(m.num_attention_heads % groups == 0,
         f"model.num_attention_heads={m.num_attention_heads} is not divisible by "
         f"model.num_query_groups={groups}")
    need(groups % tp == 0, f"model.num_query_groups={groups} is not divisible by parallel.tp={tp}: "
                           f"each TP rank needs whole K/V heads")
    need(m.kv_channels is not None or m.hidden_size % m.num_attention_heads == 0,
         f"model.hidden_size={m.hidden_size} is not divisible by model.num_attention_heads="
         f"{m.num_attention_heads}: set model.kv_channels")
    need(shape.ffn_hidden_size % tp == 0,
         f"model.ffn_hidden_size={shape.ffn_hidden_size} is not divisible by parallel.tp={tp}")
    for key in ("attention", "mlp"):
        problem = block_problem(getattr(m, key))
        need(problem is None, f"model.{key}={getattr(m, key)}: {problem}")
    need(m.mlp != "moe", "model.mlp=moe: MoE layers come from model.moe.num_experts (and model.moe.first_dense, "
                         "layer_freq); model.mlp names the dense layers' MLP")
    chunks = pp * (p.vpp or 1)
    need(m.num_layers % chunks == 0,
         f"model.num_layers={m.num_layers} is not divisible by parallel.pp * vpp = {pp} * {p.vpp or 1} = "
         f"{chunks}: every (virtual) pipeline stage needs the same number of layers")
    need(not p.sp or tp > 1, "parallel.sp=true needs parallel.tp > 1 (sequence parallel shards along TP)")
    need(not p.sp or m.seq_length % tp == 0,
         f"model.seq_length={m.seq_length} is not divisible by parallel.tp={tp} (needed by parallel.sp)")
    need(p.vpp is None or p.vpp >= 2, f"parallel.vpp={p.vpp} must be null or >= 2")
    need(p.vpp is None or pp > 1, f"parallel.vpp={p.vpp} needs parallel.pp > 1 (got pp={pp})")
    need(not p.overlap_param_gather or p.dist_opt,
         "parallel.overlap_param_gather=true needs parallel.dist_opt=true (it overlaps the "
         "distributed optimizer's parameter all-gather)")
    need(not p.overlap_param_gather or p.overlap_grad_reduce,
         "parallel.overlap_param_gather=true needs parallel.overlap_grad_reduce=true (Megatron-Core)")
    need(p.timeout_minutes > 0, f"parallel.timeout_minutes={p.timeout_minutes} must be > 0")
    need(0.0 <= m.hidden_dropout < 1.0 and 0.0 <= m.attention_dropout < 1.0,
         f"dropout must be in [0, 1): model.hidden_dropout={m.hidden_dropout}, "
         f"model.attention_dropout={m.attention_dropout}")
    need(m.make_vocab_size_divisible_by >= 1,
         f"model.make_vocab_size_divisible_by={m.make_vocab_size_divisible_by} must be >= 1")

    out += moe_problems(cfg, shape, world_size) + cp_problems(cfg) + fsdp_problems(cfg)
    if world_size % (tp * pp * cp) == 0:
        dp = world_size // (tp * pp * cp)
        per_step = t.micro_batch_size * dp
        need(t.global_batch_size % per_step == 0,
             f"train.global_batch_size={t.global_batch_size} is not divisible by train.micro_batch_size * dp "
             f"= {t.micro_batch_size} * {dp} = {per_step}")
        if t.global_batch_size % per_step == 0 and p.vpp is not None:
            micro = t.global_batch_size // per_step
            need(micro % pp == 0,
                 f"interleaved pipeline (parallel.vpp={p.vpp}) needs micro-batches per step divisible by "
                 f"parallel.pp: {t.global_batch_size} / ({t.micro_batch_size} * dp {dp}) = {micro} is not "
                 f"a multiple of {pp}")

    need(o.lr >= o.min_lr >= 0, f"optim.lr={o.lr} must be >= optim.min_lr={o.min_lr} >= 0")
    need(0 <= o.warmup_iters, f"optim.warmup_iters={o.warmup_iters} must be >= 0")
    need(o.decay_iters is None or o.decay_iters >= 1, f"optim.decay_iters={o.decay_iters} must be >= 1")
    need(o.clip_grad >= 0, f"optim.clip_grad={o.clip_grad} must be >= 0 (0 disables clipping)")
    need(min(t.eval_interval, t.save_interval, t.exit_interval, t.save_interval_minutes) >= 0,
         "train.eval_interval, save_interval, save_interval_minutes and exit_interval must be >= 0")
    need(t.eval_interval == 0 or t.eval_iters >= 1,
         f"train.eval_iters={t.eval_iters} must be >= 1 when train.eval_interval > 0")
    need(not t.profile or 0 <= t.profile_start < t.profile_end,
         f"train.profile_start={t.profile_start} must be < train.profile_end={t.profile_end}")
    need(0.0 < t.max_memory_fraction, f"train.max_memory_fraction={t.max_memory_fraction} must be > 0")
    need(t.watchdog_factor >= 0 and t.watchdog_min_seconds >= 0,
         f"train.watchdog_factor={t.watchdog_factor} and train.watchdog_min_seconds={t.watchdog_min_seconds} must be "
         f">= 0 (factor 0: no watchdog)")
    need(cfg.checkpoint.dir is not None or not (t.save_interval or t.save_interval_minutes or t.exit_interval
                                                or t.exit_duration_minutes),
         "train.save_interval / save_interval_minutes / exit_interval / exit_duration_minutes save checkpoints: "
         "set checkpoint.dir")
    need(len(cfg.data.weights or []) in (0, len(cfg.data.paths)),
         f"data.weights has {len(cfg.data.weights or [])} entries but data.paths has {len(cfg.data.paths)}")
    need(not cfg.data.weights or all(w >= 0 for w in cfg.data.weights) and sum(cfg.data.weights) > 0,
         f"data.weights={cfg.data.weights} must be >= 0 with a positive sum")
    need(cfg.checkpoint.keep >= 0, f"checkpoint.keep={cfg.checkpoint.keep} must be >= 0")
    load = cfg.checkpoint.load
    need(not cfg.checkpoint.finetune or load not in (None, "auto"),
         f"checkpoint.finetune=true needs checkpoint.load=<a checkpoint path> (got {load})")
    need(load in (None, "auto") or os.path.exists(load),
         f"checkpoint.load={load} does not exist (use auto, null, or an existing checkpoint path)")
    return out


def moe_problems(cfg: Config, shape: ModelShape, world_size: int) -> list[str]:
    """Mixture of experts and expert parallelism (parallel.ep, parallel.etp), with Megatron-Core's rules."""
    m, p, moe = cfg.model, cfg.parallel, cfg.model.moe
    out: list[str] = []

    def need(ok: bool, message: str) -> None:
        if not ok:
            out.append(message)

    for key, value in (("parallel.ep", p.ep), ("parallel.etp", p.etp)):
        need(value >= 1, f"{key}={value} must be >= 1")
    if not moe.num_experts:
        need(p.ep == 1 and p.etp == 1, f"parallel.ep={p.ep} / parallel.etp={p.etp} split experts: they need a "
                                       f"mixture-of-experts model (model.moe.num_experts, e.g. model=moe_tiny)")
        return out
    if out:
        return out
    need(moe.num_experts >= 1 and 1 <= moe.top_k <= moe.num_experts,
         f"model.moe.top_k={moe.top_k} must be between 1 and model.moe.num_experts={moe.num_experts}")
    need(moe.num_experts % p.ep == 0,
         f"model.moe.num_experts={moe.num_experts} is not divisible by parallel.ep={p.ep}: every rank of an "
         f"expert-parallel group holds the same number of experts")
    experts = p.pp * p.ep * p.etp
    need(world_size % experts == 0,
         f"world size {world_size} is not divisible by parallel.pp * ep * etp = {p.pp} * {p.ep} * {p.etp} = "
         f"{experts}: the expert layout (expert data parallel = world / (pp * ep * etp)) must tile the world")
    need(shape.moe_ffn_hidden_size % p.etp == 0,
         f"model.moe.ffn_hidden_size={shape.moe_ffn_hidden_size} is not divisible by parallel.etp={p.etp}")
    need(not shape.moe_shared_ffn_hidden_size or shape.moe_shared_ffn_hidden_size % p.tp == 0,
         f"model.moe.shared_expert_ffn_hidden_size={shape.moe_shared_ffn_hidden_size} is not divisible by "
         f"parallel.tp={p.tp}")
    need(p.tp == 1 or p.sp, f"a mixture of experts with parallel.tp={p.tp} needs parallel.sp=true "
                            f"(Megatron-Core's MoE layer takes sequence-parallel tokens under TP)")
    need(not m.add_bias_linear, "a mixture of experts needs model.add_bias_linear=false (Megatron-Core's MoE "
                                "layer returns no bias)")
    need(moe.layer_freq >= 1 and 0 <= moe.first_dense < m.num_layers,
         f"model.moe.layer_freq={moe.layer_freq} must be >= 1 and model.moe.first_dense={moe.first_dense} below "
         f"model.num_layers={m.num_layers}: at least one layer must be MoE")
    need(moe.aux_loss_coeff >= 0 and (moe.z_loss_coeff is None or moe.z_loss_coeff >= 0),
         "model.moe.aux_loss_coeff and model.moe.z_loss_coeff must be >= 0")
    need(moe.capacity_factor is None or moe.capacity_factor > 0,
         f"model.moe.capacity_factor={moe.capacity_factor} must be > 0 (null: no token dropping)")
    need(not moe.grouped_gemm or importlib.util.find_spec("transformer_engine") is not None,
         "model.moe.grouped_gemm=true needs Transformer Engine (the NGC PyTorch container has it)")
    return out


def cp_problems(cfg: Config) -> list[str]:
    """Context parallelism (parallel.cp): each rank holds 2 of the 2 x cp chunks of every sequence
    (Megatron-Core's zigzag split), and under sequence parallelism its tokens split again over TP."""
    m, p = cfg.model, cfg.parallel
    if p.cp == 1:
        return []
    out = []
    chunks = 2 * p.cp * (p.tp if p.sp else 1)
    if m.seq_length % chunks:
        by = f"2 * parallel.cp * tp = 2 * {p.cp} * {p.tp}" if p.sp else f"2 * parallel.cp = 2 * {p.cp}"
        out.append(f"model.seq_length={m.seq_length} is not divisible by {by} = {chunks}: context parallelism "
                   f"splits every sequence into 2 x cp chunks{' (then SP over TP)' if p.sp else ''}")
    if m.moe.num_experts:
        out.append(f"parallel.cp={p.cp} with a mixture of experts is not supported here yet: use parallel.cp=1")
    return out


def fsdp_problems(cfg: Config) -> list[str]:
    """Megatron-FSDP (parallel.fsdp) where this template has tested it: TP (+SP) x DP, dense models."""
    m, p = cfg.model, cfg.parallel
    if p.fsdp == "none":
        return []
    others = [f"parallel.{k}={v}" for k, v in (("pp", p.pp), ("cp", p.cp), ("ep", p.ep)) if v > 1]
    others += ["model.moe.num_experts"] if m.moe.num_experts else []
    if others:
        return [f"parallel.fsdp={p.fsdp} is tested here with TP, SP and DP only: drop {', '.join(others)} (or use "
                f"parallel.fsdp=none with parallel.dist_opt=true)"]
    return []


def validate(cfg: Config, world_size: int | None = None) -> Derived:
    """Raise ConfigError listing every problem; else return the derived sizes."""
    if world_size is None:
        world_size = int(os.environ.get("WORLD_SIZE", "1"))
    found = problems(cfg, world_size)
    if found:
        raise ConfigError("\n".join(found))
    p, t = cfg.parallel, cfg.train
    dp = world_size // (p.tp * p.pp * p.cp)
    return Derived(world_size=world_size, dp=dp, num_microbatches=t.global_batch_size // (t.micro_batch_size * dp),
                   tokens_per_step=t.global_batch_size * cfg.model.seq_length, cp=p.cp)
