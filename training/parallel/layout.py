"""The parallel layout: one frozen type, built from the config, read by everything that needs a size.

    lay = Layout.of(cfg, world=8)        # tp, pp, vpp, cp, ep, etp, sp, dist_opt, fsdp from cfg.parallel
    lay.dp, lay.edp                      # data parallel = world / (tp pp cp); expert DP = world / (pp ep etp)
    lay.num_microbatches(16, 2)          # micro-batches per DP rank per step (gradient accumulation)
    lay.problems()                       # the rules of the sizes alone, each one line naming every number
    lay.describe(), lay.name             # "tp 2 x pp 2 x dp 2 ...", "tp2pp2dp2"
    Layout.from_name("tp2pp2dp2sp")      # the same scheme back (tools/bench.py --layouts, verify_layouts)
    Layout.from_name("tp2mlp")           # tp 2 splitting only the MLP (parallel.tp_blocks=[mlp]; attn, vocab)

Nothing else computes dp or edp: validation (training/config/validate.py), distributed init (dist.py), the
memory estimate and the planner, checkpoint metadata and the benchmarks all ask a Layout. Its rules need no
process group. Rules that involve one parallel feature's other settings (FSDP's tested combinations, context
parallelism with MoE, ...) live in that feature's module (fsdp.py, context.py, experts.py), which validation
asks in turn. Modelled on torchtitan's ParallelDims (distributed/parallel_dims.py).
"""

from __future__ import annotations

import re
from dataclasses import dataclass, fields

from models.tp_blocks import TP_BLOCKS

NAME_PART = re.compile(r"(tp|pp|dp|cp|ep|etp|vpp)(\d+)|sp|distopt|zero2|zero3|attn|mlp|vocab")
FSDP_NAMES = {"zero2": "optim_grads", "zero3": "optim_grads_params"}
BLOCK_NAMES = {"attn": "attention", "mlp": "mlp", "vocab": "vocab"}  # name parts: the sub-blocks tp splits


@dataclass(frozen=True)
class Layout:
    world: int = 1  # processes in the job
    tp: int = 1  # tensor parallel
    pp: int = 1  # pipeline parallel (stages)
    vpp: int | None = None  # virtual stages per pipeline rank (interleaved 1F1B); None = plain 1F1B
    cp: int = 1  # context parallel: each rank holds 1/cp of every sequence
    ep: int = 1  # expert parallel (MoE experts split over ranks)
    etp: int = 1  # expert tensor parallel (each expert's FFN split over ranks)
    sp: bool = False  # sequence parallel (along TP)
    dist_opt: bool = False  # distributed optimizer: optimizer state sharded over DP x CP (ZeRO-1)
    fsdp: str = "none"  # Megatron-FSDP: none | optim_grads (ZeRO-2) | optim_grads_params (ZeRO-3)
    micro_batch_size: int = 1  # sequences per micro-batch per DP rank
    global_batch_size: int = 0  # sequences per optimizer step; 0 = micro_batch_size x dp (no accumulation)
    tp_blocks: tuple[str, ...] = TP_BLOCKS  # the sub-blocks tp splits (models/tp_blocks.py); the rest replicated

    @classmethod
    def of(cls, cfg, world: int) -> Layout:
        """The layout of a config (training/config/schema.py's Config) on `world` processes."""
        p = cfg.parallel
        blocks = tuple(b for b in TP_BLOCKS if b in {str(x) for x in p.tp_blocks})  # in TP_BLOCKS' order
        return cls(world, p.tp, p.pp, p.vpp, p.cp, p.ep, p.etp, bool(p.sp), bool(p.dist_opt), str(p.fsdp),
                   cfg.train.micro_batch_size, cfg.train.global_batch_size, blocks)

    # -- derived sizes ------------------------------------------------------------------------------------
    @property
    def model_parallel(self) -> int:
        """Ranks of one data-parallel replica: tp x pp x cp."""
        return self.tp * self.pp * self.cp

    @property
    def dp(self) -> int:
        """Data-parallel replicas: world / (tp x pp x cp)."""
        return self.world // self.model_parallel

    @property
    def edp(self) -> int:
        """Expert data parallel: the ranks that hold the same experts, world / (pp x ep x etp)."""
        return self.world // (self.pp * self.ep * self.etp)

    @property
    def grad_group(self) -> int:
        """Ranks that reduce a dense gradient (and shard its optimizer state): dp x cp."""
        return self.dp * self.cp

    @property
    def chunks(self) -> int:
        """Model chunks over the pipeline: pp x vpp (every chunk the same number of layers)."""
        return self.pp * (self.vpp or 1)

    @property
    def seq_divisor(self) -> int:
        """What the sequence length must divide by: 2 x cp zigzag chunks (CP), then tp shards (SP)."""
        return (2 * self.cp if self.cp > 1 else 1) * (self.tp if self.sp else 1)

    tp_enabled = property(lambda self: self.tp > 1)
    pp_enabled = property(lambda self: self.pp > 1)
    cp_enabled = property(lambda self: self.cp > 1)
    ep_enabled = property(lambda self: self.ep * self.etp > 1)
    dp_enabled = property(lambda self: self.dp > 1)
    fsdp_enabled = property(lambda self: self.fsdp != "none")
    partial_tp = property(lambda self: self.tp > 1 and self.tp_blocks != TP_BLOCKS)  # some sub-blocks replicated

    @property
    def num_microbatches(self) -> int:
        """Micro-batches per DP rank per optimizer step (gradient accumulation)."""
        return max(1, self.global_batch_size // (self.micro_batch_size * self.dp))

    # -- rules ------------------------------------------------------------------------------------------------
    def problems(self) -> list[str]:
        """The rules of the sizes alone, one line each, every number named (empty when they hold)."""
        out = [f"parallel.{k}={getattr(self, k)} must be >= 1" for k in ("tp", "pp", "cp", "ep", "etp")
               if getattr(self, k) < 1]
        if self.world < 1:
            out.append(f"world size {self.world}: start at least one process (NPROC >= 1)")
        if out:
            return out
        mp = self.model_parallel
        if self.world % mp:
            names, by, fix = ("parallel.tp * pp * cp", f"{self.tp} * {self.pp} * {self.cp}", "tp/pp/cp") \
                if self.cp > 1 else ("parallel.tp * parallel.pp", f"{self.tp} * {self.pp}", "tp/pp")
            out.append(f"world size {self.world} is not divisible by {names} = {by} = {mp}: start a multiple of "
                       f"{mp} processes (NPROC) or change {fix}")
        experts = self.pp * self.ep * self.etp
        if self.ep_enabled and self.world % experts:
            out.append(f"world size {self.world} is not divisible by parallel.pp * ep * etp = {self.pp} * {self.ep} "
                       f"* {self.etp} = {experts}: the expert layout (expert data parallel = world / (pp * ep * etp)) "
                       f"must tile the world")
        if self.sp and self.tp == 1:
            out.append("parallel.sp=true needs parallel.tp > 1 (sequence parallel shards along TP)")
        if self.vpp is not None and self.vpp < 2:
            out.append(f"parallel.vpp={self.vpp} must be null or >= 2")
        elif self.vpp is not None and self.pp == 1:
            out.append(f"parallel.vpp={self.vpp} needs parallel.pp > 1 (got pp={self.pp})")
        return out

    def batch_problems(self) -> list[str]:
        """The global batch must split into whole micro-batches on every DP rank (and, interleaved, into a
        multiple of pp of them)."""
        if self.world < 1 or self.world % self.model_parallel or not self.global_batch_size \
                or self.micro_batch_size < 1:
            return []  # said by problems() or run_problems(), or no global batch given
        global_batch_size, micro_batch_size, per_step = self.global_batch_size, self.micro_batch_size, \
            self.micro_batch_size * self.dp
        if global_batch_size % per_step:
            fits = [m for m in range(micro_batch_size - 1, 0, -1) if global_batch_size % (m * self.dp) == 0]
            smaller = f", or train.micro_batch_size={fits[0]} ({global_batch_size} = {fits[0]} * dp {self.dp} * " \
                      f"{global_batch_size // (fits[0] * self.dp)} accumulation step(s))" if fits else ""
            return [f"train.global_batch_size={global_batch_size} is not divisible by train.micro_batch_size * dp "
                    f"= {micro_batch_size} * {self.dp} = {per_step}: set train.global_batch_size to a multiple of "
                    f"{per_step} (e.g. {-(-global_batch_size // per_step) * per_step}){smaller}"]
        micro = global_batch_size // per_step
        if self.vpp is not None and micro % self.pp:
            return [f"interleaved pipeline (parallel.vpp={self.vpp}) needs micro-batches per step divisible by "
                    f"parallel.pp: {global_batch_size} / ({micro_batch_size} * dp {self.dp}) = {micro} is not "
                    f"a multiple of {self.pp}"]
        return []

    def shape_problems(self, shape) -> list[str]:
        """A model's sizes (models/shape.py's ModelShape) against the split: heads, K/V groups and FFN width
        over tp, layers over pp x vpp, the sequence over cp and sp, experts over ep and etp."""
        out = []

        def need(ok: bool, message: str) -> None:
            if not ok:
                out.append(message)

        tp = self.tp
        need(shape.num_attention_heads % tp == 0,
             f"model.num_attention_heads={shape.num_attention_heads} is not divisible by parallel.tp={tp}")
        need(shape.num_query_groups % tp == 0, f"model.num_query_groups={shape.num_query_groups} is not divisible "
                                               f"by parallel.tp={tp}: each TP rank needs whole K/V heads")
        need(shape.ffn_hidden_size % tp == 0,
             f"model.ffn_hidden_size={shape.ffn_hidden_size} is not divisible by parallel.tp={tp}")
        need(shape.num_layers % self.chunks == 0,
             f"model.num_layers={shape.num_layers} is not divisible by parallel.pp * vpp = {self.pp} * "
             f"{self.vpp or 1} = {self.chunks}: every (virtual) pipeline stage needs the same number of layers")
        if self.sp and self.cp == 1:
            need(shape.seq_length % tp == 0,
                 f"model.seq_length={shape.seq_length} is not divisible by parallel.tp={tp} (needed by parallel.sp)")
        elif self.cp > 1 and shape.seq_length % self.seq_divisor:
            by = f"2 * parallel.cp * tp = 2 * {self.cp} * {tp}" if self.sp else f"2 * parallel.cp = 2 * {self.cp}"
            out.append(f"model.seq_length={shape.seq_length} is not divisible by {by} = {self.seq_divisor}: context "
                       f"parallelism splits every sequence into 2 x cp chunks{' (then SP over TP)' * self.sp}")
        if shape.num_experts:
            need(shape.num_experts % self.ep == 0,
                 f"model.moe.num_experts={shape.num_experts} is not divisible by parallel.ep={self.ep}: every rank "
                 f"of an expert-parallel group holds the same number of experts")
            need(shape.moe_ffn_hidden_size % self.etp == 0,
                 f"model.moe.ffn_hidden_size={shape.moe_ffn_hidden_size} is not divisible by parallel.etp={self.etp}")
            shared = shape.moe_shared_ffn_hidden_size
            need(not shared or shared % tp == 0,
                 f"model.moe.shared_expert_ffn_hidden_size={shared} is not divisible by parallel.tp={tp}")
        return out

    # -- names ------------------------------------------------------------------------------------------------
    def describe(self) -> str:
        context = f" x cp {self.cp}" if self.cp_enabled else ""
        experts = f" (experts: ep {self.ep} x etp {self.etp} x edp {self.edp} per stage)" if self.ep_enabled else ""
        vpp = f" (vpp {self.vpp})" if self.vpp else ""
        extras = [x for x, on in ((f"tp splits {'+'.join(self.tp_blocks)} only", self.partial_tp), ("sp", self.sp),
                                  ("dist_opt", self.dist_opt and not self.fsdp_enabled),
                                  (f"fsdp {self.fsdp}", self.fsdp_enabled)) if on]
        batch = (f"; global batch {self.global_batch_size} = micro {self.micro_batch_size} x dp {self.dp} x "
                 f"accumulation {self.num_microbatches}" if self.global_batch_size else "")
        return (f"world {self.world} = tp {self.tp} x pp {self.pp}{vpp}{context} x dp {self.dp}{experts}"
                + (f" [{', '.join(extras)}]" if extras else "") + batch)

    @property
    def name(self) -> str:
        """tp2pp2dp2sp: the sizes above 1 (dp always when it is the only one), then the flags; "single" for 1."""
        blocks = "".join(short for short, full in BLOCK_NAMES.items() if full in self.tp_blocks) \
            if self.partial_tp else ""
        parts = [f"{k}{getattr(self, k)}" + (blocks if k == "tp" else "")
                 for k in ("tp", "pp", "vpp", "cp", "ep", "etp") if (getattr(self, k) or 1) > 1]
        if self.dp > 1:
            parts.append(f"dp{self.dp}")
        parts += [flag for flag, on in (("sp", self.sp), ("distopt", self.dist_opt and not self.fsdp_enabled))
                  if on]
        parts += [short for short, full in FSDP_NAMES.items() if self.fsdp == full]
        return "".join(parts) or "single"

    @classmethod
    def from_name(cls, name: str) -> Layout:
        """The layout a name describes (the inverse of .name; parts in any order, dp1/tp1 allowed)."""
        from training.errors import ConfigError

        sizes = {"tp": 1, "pp": 1, "dp": 1, "cp": 1, "ep": 1, "etp": 1, "vpp": None}
        flags = {"sp": False, "dist_opt": False, "fsdp": "none"}
        blocks: list[str] = []
        pos = 0
        while name != "single" and pos < len(name):
            match = NAME_PART.match(name, pos)
            if match is None:
                raise ConfigError(f"layout {name!r}: cannot read {name[pos:]!r}; a layout is parts like tp2, pp2, "
                                  f"dp2, cp2, ep2, etp2, vpp2, sp, distopt, zero2, zero3, and mlp, attn, vocab "
                                  f"after tp (the sub-blocks it splits; e.g. tp2dp2distopt, tp2mlp)")
            if match.group(1):
                sizes[match.group(1)] = int(match.group(2))
            elif match.group(0) in BLOCK_NAMES:
                blocks.append(BLOCK_NAMES[match.group(0)])
            elif match.group(0) in FSDP_NAMES:
                flags.update(fsdp=FSDP_NAMES[match.group(0)], dist_opt=True)
            else:
                flags["sp" if match.group(0) == "sp" else "dist_opt"] = True
            pos = match.end()
        tp, dp = sizes.pop("tp"), sizes.pop("dp")
        tp_blocks = tuple(b for b in TP_BLOCKS if b in blocks) if blocks else TP_BLOCKS
        return cls(tp * sizes["pp"] * sizes["cp"] * dp, tp=tp, **sizes, **flags, tp_blocks=tp_blocks)

    def overrides(self, explicit: bool = False) -> list[str]:
        """The Hydra overrides that select this layout (the world is the number of processes started): the
        fields that differ from one process's, or with explicit also tp, pp, vpp, sp and dist_opt (so that they
        override a preset such as parallel=tp2_sp)."""
        always = ("tp", "pp", "vpp", "sp", "dist_opt") if explicit else ()
        shown = [f.name for f in fields(self) if f.name not in ("world", "micro_batch_size", "global_batch_size")
                 and (getattr(self, f.name) != f.default or f.name in always)]
        return [f"parallel.{k}={_value(getattr(self, k))}" for k in shown
                if not (k == "dist_opt" and self.fsdp_enabled and not explicit)]


def _value(v) -> str:
    if isinstance(v, tuple):  # tp_blocks: Hydra's list syntax
        return f"[{','.join(v)}]"
    return "null" if v is None else str(v).lower() if isinstance(v, bool) else str(v)
