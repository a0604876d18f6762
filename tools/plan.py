"""Layout planner: every valid (tp, tp_blocks, pp, vpp, cp, sp, dist_opt, recompute, ep) for a model on nodes x GPUs,
at a batch (stated in the header) with the micro batch searched per layout, the per-GPU memory estimate of
training/estimate/memory.py, the pipeline bubble and the communication volume per step; ranked, and the best
layout that fits is recommended with the overrides that select it (the batch's included).

    .venv/bin/python tools/plan.py model=llama3_1_8b plan.nodes=2
    .venv/bin/python tools/plan.py --json model=llama3_8b plan.nodes=4 train.global_batch_size=512
    .venv/bin/python tools/plan.py model=llama_1b plan.gpus_per_node=1 train.micro_batch_size=2 train.precision=bf16
    .venv/bin/python tools/plan.py model=llama3_1_70b peft=lora    # LoRA: a frozen base (training/estimate/lora.py)

Other arguments are Hydra overrides of the training config (model.seq_length, train.micro_batch_size,
train.global_batch_size, train.precision, ...): the planner composes what train.py would. The batch: yours
where you set it; else, for a model of >= 100 M parameters, ~2 M tokens a step (0.5 M below 1 B) and bf16, as
published runs use; the micro batch is searched (1, 2, 4, ...) unless you set train.micro_batch_size
(training/estimate/plan_batch.py). Settings:
    plan.gpus_per_node   8      an HGX/DGX node; TP stays inside a node (NVLink), so tp divides it
    plan.nodes           1      nodes in the job
    plan.gpu_mem_gb      80     H100/A100 80GB; fits = total <= this x train.max_memory_fraction (as preflight)
    plan.flash_attention true   SDPA on GPU keeps no s x s scores; false = Korthikanti's materialised scores
    plan.tflops          400    bf16 dense throughput an H100 sustains in large GEMMs (~40% of its 989 peak)
    plan.link_gbps       200    NCCL all-reduce bus bandwidth inside an NVLink node (H100 measures 350-450)
    plan.internode_gbps  40     per-GPU bandwidth between nodes (one 400 Gb/s InfiniBand NIC per GPU)
    plan.top             15     rows in the table (--json prints every layout)

Ranking: layouts that fit by score, the step time relative to an ideal step (lower is better), then the rest
by memory (closest to fitting first; when none fits, the planner says what would: a smaller micro batch, more
nodes, larger GPUs):
    score     = (1 + bubble) * (1 + recompute + redundant + tp_comm + ep_comm + cp_comm) + pp_comm + dp_comm
    bubble    = (pp - 1) / (vpp * m): idle share of (interleaved) 1F1B, m = micro-batches per step
    recompute = extra forward FLOPs / training FLOPs (full: the layers' forward; selective: core attention)
    redundant = (tp - 1) x the FLOPs of the sub-blocks tp leaves whole (parallel.tp_blocks) / training FLOPs
    tp_comm   = TP traffic time / compute time per GPU (TP collectives sit on the critical path; only the
                split attention / MLP blocks' collectives: [mlp] alone halves them)
    cp_comm   = CP traffic time / compute: each layer all-gathers K and V forward and reduce-scatters their
                gradients backward (on the critical path; inside a node when tp x cp GPUs fit one)
    pp_comm   = (PP bytes / link + 4 m vpp messages x 100 us) / compute: every virtual stage boundary costs
                a send and a receive forward and backward, and each costs a schedule sync, not only bytes
    dp_comm   = 10% of the DP traffic time / compute: the reduction overlaps the backward pass except for
                the last bucket and the parameter all-gather; across nodes it runs at plan.internode_gbps
    ep_comm   = EP all-to-all time / compute: dispatch and combine, forward and backward, top-k copies
Ties go to the smaller memory total, so sp and dist_opt win when they are free; a layout's searched micro batch
is its best-scored one that fits, ties to the larger (training/estimate/planner.py).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import shlex
import sys

from training.estimate.compare import minimal_tp_note, splits
from training.estimate.planner import assess, candidates, rank, search, what_would_fit  # noqa: F401 (tests)
from training.shims.noise import quiet_known_noise

PLAN_DEFAULTS = {"gpus_per_node": 8, "nodes": 1, "gpu_mem_gb": 80.0, "flash_attention": True,
                 "tflops": 400.0, "link_gbps": 200.0, "internode_gbps": 40.0, "top": 15}  # reasons: docstring
SHARDING = {"none": "on", "optim_grads": "z2", "optim_grads_params": "z3"}  # the dopt column: ZeRO-1/2/3


class _Parser(argparse.ArgumentParser):
    def error(self, message: str):  # one `error:` line (exit 2 through main), not argparse's usage + message
        raise ValueError(f"{message} (see tools/plan.py --help)")


def parser() -> argparse.ArgumentParser:
    """--json and --help; the other arguments are Hydra overrides and plan.* settings (the docstring's)."""
    parts = __doc__.split("\n\n")
    ap = _Parser(prog="tools/plan.py", usage="%(prog)s [-h] [--json] [KEY=VALUE ...] [plan.SETTING=VALUE ...]",
                 description=parts[0], epilog="\n\n".join(parts[1:3]), allow_abbrev=False,
                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--json", action="store_true", help="print every layout as JSON instead of the table")
    return ap


def parse_args(argv: list[str]) -> tuple[dict, list[str], bool]:
    """(plan settings, Hydra overrides, --json) from the command line; ValueError names a bad option or setting."""
    args, rest = parser().parse_known_args(argv)
    settings, overrides = dict(PLAN_DEFAULTS), []
    for arg in rest:
        if arg.startswith("-"):
            raise ValueError(f"unknown option {arg}: tools/plan.py takes --json and --help; the other arguments "
                             f"are Hydra overrides (key=value) and plan.* settings")
        if arg.startswith("plan."):
            key, _, value = arg[len("plan."):].partition("=")
            if key not in PLAN_DEFAULTS:
                known = ", ".join(f"plan.{k}" for k in PLAN_DEFAULTS)
                raise ValueError(f"unknown setting plan.{key}: use one of {known}")
            kind = type(PLAN_DEFAULTS[key])
            if kind is bool:
                if value.lower() not in ("true", "false"):
                    raise ValueError(f"plan.{key}={value} must be true or false")
                settings[key] = value.lower() == "true"
            else:
                try:
                    settings[key] = kind(value)
                except ValueError:
                    raise ValueError(f"plan.{key}={value} is not {'an integer' if kind is int else 'a number'}") \
                        from None
                if settings[key] <= 0:
                    raise ValueError(f"plan.{key}={value} must be > 0")
        else:
            overrides.append(arg)
    return settings, overrides, args.json


def table(rows: list[dict], top: int) -> str:
    moe = any(r["ep"] > 1 for r in rows)  # the EP columns only for a mixture of experts
    cp = any(r["cp"] > 1 for r in rows)  # the CP columns only where a layout splits sequences
    head = (f"{'#':>3} {'tp':>3} {'splits':>9} {'pp':>3} {'vpp':>3}{'  cp' if cp else ''} {'dp':>4}"
            f"{'   ep' if moe else ''} {'sp':>3} {'dopt':>4} {'mb':>3} "
            f"{'recomp':>9} | {'w+opt':>7} {'act':>7} {'total':>7} {'fits':>4} | {'bubble':>6} {'TP GB':>7} "
            f"{'  CP GB ' if cp else ''}{'DP GB':>7}{'   EP GB' if moe else ''} | score")
    lines = [head, "-" * len(head)]
    for i, r in enumerate(rows[:top], 1):
        g = r["mem_gb"]
        lines.append(f"{i:>3} {r['tp']:>3} {splits(r):>9} {r['pp']:>3} {r['vpp'] or '-':>3}"
                     f"{f' {r['cp']:>3}' if cp else ''} {r['dp']:>4}{f' {r['ep']:>4}' if moe else ''} "
                     f"{'on' if r['sp'] else '-':>3} {SHARDING[r['fsdp']] if r['dist_opt'] else '-':>4} "
                     f"{r['micro_batch_size']:>3} "
                     f"{r['recompute']:>9} | "
                     f"{g['weights_and_optimizer']:>7.1f} {g['activations']:>7.1f} {g['total']:>7.1f} "
                     f"{'yes' if r['fits'] else 'no':>4} | {r['bubble']:>6.3f} {r['comm_gb']['tp']:>7.1f} "
                     f"{f'{r['comm_gb']['cp']:>7.1f} ' if cp else ''}{r['comm_gb']['dp']:>7.1f}"
                     f"{f' {r['comm_gb']['ep']:>7.1f}' if moe else ''} | {r['score']:.3f}")
    return "\n".join(lines)


def prepare(settings: dict, overrides: list[str]):
    """(config with the plan's batch applied, the model's shape, the batch: training/estimate/plan_batch.py)."""
    from models.gpt import num_params
    from models.shape import ModelShape
    from training.config.compose import compose
    from training.data.datasets import resolve_vocab_size
    from training.data.tokenizer import build_tokenizer
    from training.estimate.plan_batch import plan_batch

    cfg = compose(overrides)
    if cfg.model.fused_kernels is None:  # null = on with CUDA: the GPUs planned for, not this machine
        cfg = dataclasses.replace(cfg, model=dataclasses.replace(cfg.model, fused_kernels=True))
    shape = ModelShape.of(cfg.model, resolve_vocab_size(cfg, build_tokenizer(cfg.data.tokenizer)))
    batch = plan_batch(cfg, overrides, num_params(shape), settings["gpus_per_node"] * settings["nodes"])
    return batch.apply(cfg), shape, batch


def plan(settings: dict, overrides: list[str], prepared: tuple | None = None) -> tuple[list[dict], str]:
    """Ranked rows (the recommended one flagged) and a header describing the problem, the batch included;
    prepared: prepare()'s answer when the caller has it."""
    from models.gpt import active_params

    cfg, shape, batch = prepared or prepare(settings, overrides)
    rows = rank(search(cfg, shape, settings, batch.micro))
    t, world = cfg.train, settings["gpus_per_node"] * settings["nodes"]
    active = f" ({active_params(shape) / 1e9:.3f} B active a token, embedding lookup aside)" if shape.num_experts else ""
    header = (f"{cfg.model.name}: {rows[0]['params_total'] / 1e9:.3f} B parameters{active}, seq {cfg.model.seq_length}; "
              f"{world} GPUs ({settings['nodes']} x {settings['gpus_per_node']}) of {settings['gpu_mem_gb']:g} GB, "
              f"budget {settings['gpu_mem_gb'] * t.max_memory_fraction:g} GB (train.max_memory_fraction="
              f"{t.max_memory_fraction:g}); flash attention {'assumed' if settings['flash_attention'] else 'off'}"
              f"{lora_note(cfg)}\n"
              f"{batch.header}")
    return rows, header


def lora_note(cfg) -> str:
    """peft=lora: the base frozen (its weights only), the adapters trained (training/estimate/lora.py)."""
    p = cfg.peft
    return "" if str(p.method) != "lora" else (f"; LoRA rank {p.rank} on {','.join(p.targets)}: the base frozen "
                                                f"(weights only), the adapters trained")


def command(settings: dict, overrides: list[str], layout: str) -> str:
    """The launch command as the shell takes it: one node, or every node's with what launch/multinode.sh needs
    set in front, its placeholders in <...> (the shell refuses them until they are filled in)."""
    nodes, nproc = settings["nodes"], settings["gpus_per_node"]
    launcher = "launch/train.sh" if nodes == 1 else (
        f"NNODES={nodes} NODE_RANK=<0..{nodes - 1}> MASTER_ADDR=<node-0-address> RUN_ID=<run-name> "
        f"launch/multinode.sh")
    return " ".join([f"NPROC={nproc}", launcher, *map(shlex.quote, overrides + layout.split())])


def run(argv: list[str]) -> int:
    quiet_known_noise()
    settings, overrides, as_json = parse_args(argv)
    cfg, shape, batch = prepared = prepare(settings, overrides)
    rows, header = plan(settings, overrides, prepared)
    if as_json:
        print(json.dumps(rows, indent=1))
        return 0
    fitting, top = sum(r["fits"] for r in rows), min(settings["top"], len(rows))
    shown = f"best {top}" if fitting else f"the {top} closest to fitting (least memory first)"
    print(f"{header}\n{len(rows)} layouts, {fitting} fit; {shown}:\n")
    print(table(rows, settings["top"]))
    if (note := minimal_tp_note(rows)) is not None:
        print(f"\n{note}")
    best = rows[0]
    if best["recommended"]:
        print(f"\nrecommended (#1): {command(settings, overrides + list(batch.overrides), best['overrides'])}")
        if settings["nodes"] > 1:
            print(f"on each of the {settings['nodes']} nodes with its own NODE_RANK (0 on the node MASTER_ADDR names), "
                  f"the same RUN_ID everywhere (launch/multinode.sh; launch/slurm.sbatch sets them under SLURM)")
    else:
        print("\n" + "\n".join(what_would_fit(cfg, shape, settings, batch.micro, rows)))
    return 0


def main(argv: list[str]) -> int:
    """run(argv), with the user's errors as one line each and exit code 2."""
    from training.errors import exit_on_error

    return exit_on_error(run, argv, also=(ValueError,))


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
