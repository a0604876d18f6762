"""Layout planner: every valid (tp, tp_blocks, pp, vpp, cp, sp, dist_opt, recompute, ep) for a model on nodes x GPUs,
the per-GPU memory estimate of training/estimate/memory.py, the pipeline bubble and the communication volume per
step; ranked, and the best layout that fits is recommended with the overrides that select it.

    python tools/plan.py model=llama2_7b plan.gpus_per_node=8 plan.nodes=1 plan.gpu_mem_gb=80
    python tools/plan.py --json model=llama3_8b plan.nodes=4 train.global_batch_size=512
    python tools/plan.py model=llama_1b plan.gpus_per_node=1 train.micro_batch_size=2 train.precision=bf16

Other arguments are Hydra overrides of the training config (model.seq_length, train.micro_batch_size,
train.global_batch_size, train.precision, ...): the planner composes what train.py would. Settings:
    plan.gpus_per_node   8      an HGX/DGX node; TP stays inside a node (NVLink), so tp divides it
    plan.nodes           1      nodes in the job
    plan.gpu_mem_gb      80     H100/A100 80GB; fits = total <= this x train.max_memory_fraction (as preflight)
    plan.flash_attention true   SDPA on GPU keeps no s x s scores; false = Korthikanti's materialised scores
    plan.tflops          400    bf16 dense throughput an H100 sustains in large GEMMs (~40% of its 989 peak)
    plan.link_gbps       200    NCCL all-reduce bus bandwidth inside an NVLink node (H100 measures 350-450)
    plan.internode_gbps  40     per-GPU bandwidth between nodes (one 400 Gb/s InfiniBand NIC per GPU)
    plan.top             15     rows in the table (--json prints every layout)

Ranking: layouts that fit first, then by score, the step time relative to an ideal step (lower is better):
    score     = (1 + bubble) * (1 + recompute + redundant + tp_comm) + pp_comm + dp_comm
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
Ties go to the smaller memory total, so sp and dist_opt win when they are free.
"""

from __future__ import annotations

import argparse
import dataclasses
import itertools
import json
import shlex
import sys

from training.estimate.compare import minimal_tp_note, splits
from training.shims.noise import quiet_known_noise

PLAN_DEFAULTS = {"gpus_per_node": 8, "nodes": 1, "gpu_mem_gb": 80.0, "flash_attention": True,
                 "tflops": 400.0, "link_gbps": 200.0, "internode_gbps": 40.0, "top": 15}  # reasons: docstring
SHARDING = {"none": "on", "optim_grads": "z2", "optim_grads_params": "z3"}  # the dopt column: ZeRO-1/2/3
P2P_MESSAGE_S = 100e-6  # one pipeline send or receive: NCCL launch, the schedule's wait, small-message latency
DP_EXPOSED = 0.1  # share of the DP traffic not hidden behind the backward pass


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


def divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


def candidates(cfg, world: int, gpus_per_node: int) -> tuple[list, list[str]]:
    """[(Layout, config with that layout)] for every layout training/config/validate.py accepts at this world,
    and the problems of the first rejected one (all of them rejected = a problem no layout can fix)."""
    from models.tp_blocks import TP_BLOCKS
    from training.config.schema import Recompute
    from training.config.validate import problems
    from training.parallel.layout import Layout

    m, p = cfg.model, cfg.parallel
    found_first: list[str] = []
    valid = []
    for tp in divisors(gpus_per_node):
        for pp, cp in itertools.product(divisors(world), divisors(world)):
            base = Layout(world, tp, pp, cp=cp)
            if base.problems():
                continue
            per_stage = m.num_layers // pp if m.num_layers % pp == 0 else 0
            # MoE: experts over EP ranks of the data-parallel ranks (expert TP stays 1: experts are small)
            eps = [e for e in divisors(tp * base.dp) if m.moe.num_experts % e == 0] if m.moe.num_experts else [1]
            # the optimizer shards over DP x CP (none when that is 1); Megatron-FSDP where validation allows it
            sharding = [(False, "none")] + [(True, "none")] * (base.grad_group > 1) + \
                [(True, "optim_grads"), (True, "optim_grads_params")] * base.dp_enabled
            # minimal TP (parallel.tp_blocks): only the MLP, or the MLP and the vocabulary split (without SP)
            sp_and_blocks = [(False, TP_BLOCKS)] + [(True, TP_BLOCKS), (False, ("mlp",)),
                                                    (False, ("mlp", "vocab"))] * (tp > 1)
            for vpp, (sp, blocks), (dist_opt, fsdp), recompute, ep in itertools.product(
                    [None] + ([v for v in divisors(per_stage) if v >= 2] if pp > 1 else []), sp_and_blocks, sharding,
                    Recompute, eps):
                parallel = dataclasses.replace(p, tp=tp, pp=pp, vpp=vpp, cp=cp, sp=sp, dist_opt=dist_opt, ep=ep,
                                               etp=1, fsdp=fsdp, tp_blocks=list(blocks),
                                               overlap_param_gather=p.overlap_param_gather and dist_opt)
                option = dataclasses.replace(cfg, parallel=parallel, model=dataclasses.replace(m, recompute=recompute))
                found = problems(option, world)
                if found:
                    found_first = found_first or found
                else:
                    valid.append((Layout.of(option, world), option))
    return valid, found_first


def assess(option, shape, lay, settings: dict) -> dict:
    """Memory, bubble, traffic and score of one layout (shape: models/shape.py's ModelShape)."""
    from models.gpt import flops_per_token as training_flops
    from training.estimate.memory import GB, estimate

    t, recompute_mode = option.train, str(option.model.recompute)
    world, micro = lay.world, lay.num_microbatches
    est = estimate(option, shape, lay, settings["flash_attention"])
    vocab = shape.padded_vocab(lay.tp)
    e = 2 if t.precision == "bf16" else 4
    sbh = shape.seq_length // lay.cp * t.micro_batch_size * shape.hidden_size  # this rank's tokens
    flops_per_token = training_flops(shape, lay.tp)  # 3 x forward
    flops_per_gpu = flops_per_token * t.global_batch_size * shape.seq_length / world
    whole = tuple(k for k in ("attention", "mlp", "vocab") if k not in lay.tp_blocks)  # computed on every TP rank
    redundant = (lay.tp - 1) * training_flops(shape, lay.tp, kinds=whole) / flops_per_token if whole else 0.0
    recompute = {"none": 0.0, "full": (flops_per_token / 3 - 2 * shape.hidden_size * vocab) / flops_per_token,
                 "selective": 2 * shape.num_layers * shape.seq_length * shape.q_width / flops_per_token}[recompute_mode]
    # TP per layer and micro-batch: 2 all-reduces forward + 2 backward (SP: all-gathers + reduce-scatters of
    # the same volume; its backward re-gather overlaps the weight-gradient GEMMs); full recompute redoes forward
    collectives = 4 + (2 if recompute_mode == "full" else 0)
    split = sum(k in lay.tp_blocks for k in ("attention", "mlp")) / 2  # each split block: half the collectives
    tp_bytes = (shape.num_layers // lay.pp) * micro * collectives * split * 2 * (lay.tp - 1) / lay.tp * e * sbh
    shard = (lay.grad_group - 1) / lay.grad_group  # gradients are reduced over DP x CP
    dp_bytes = est.params_per_gpu * (shard * (4 + e) if lay.dist_opt else 2 * shard * 4)  # fp32 grads
    if lay.fsdp == "optim_grads_params":  # ZeRO-3: its weights gathered for forward and again for backward
        dp_bytes = est.params_per_gpu * lay.dp * shard * (4 + 2 * e)
    pp_bytes = 2 * micro * (lay.vpp or 1) * e * sbh / (lay.tp if lay.sp else 1) if lay.pp > 1 else 0.0
    compute_s = flops_per_gpu / (settings["tflops"] * 1e12)
    tp_comm = (tp_bytes / (settings["link_gbps"] * GB)) / compute_s
    messages = 4 * micro * (lay.vpp or 1) if lay.pp > 1 else 0
    pp_comm = (pp_bytes / (settings["link_gbps"] * GB) + messages * P2P_MESSAGE_S) / compute_s
    dp_gbps = settings["link_gbps"] if settings["nodes"] == 1 else settings["internode_gbps"]
    dp_comm = DP_EXPOSED * dp_bytes / (dp_gbps * GB) / compute_s
    # EP: each MoE layer's dispatch and combine all-to-alls, forward and backward, carry k copies of this
    # rank's tokens, (ep-1)/ep of them to other ranks; on the critical path like TP's
    moe_layers = len(shape.moe_layer_numbers) / lay.pp
    tokens = shape.seq_length * t.micro_batch_size / (lay.tp if lay.sp else 1)
    ep_bytes = moe_layers * micro * 4 * (shape.moe_top_k or 0) * tokens * shape.hidden_size * e * (lay.ep - 1) / lay.ep
    ep_gbps = settings["link_gbps"] if lay.ep * lay.tp <= settings["gpus_per_node"] else settings["internode_gbps"]
    ep_comm = ep_bytes / (ep_gbps * GB) / compute_s
    # CP: per layer and micro-batch, K and V all-gathered forward (again in a full recompute) and their
    # gradients reduce-scattered backward: (cp-1)/cp of the full-length [s, b, kv/tp] tensors each
    gathers = 2 + (2 if recompute_mode == "full" else 0) + 2
    cp_bytes = (shape.num_layers // lay.pp) * micro * gathers * (lay.cp - 1) / lay.cp * e * \
        shape.seq_length * t.micro_batch_size * shape.kv_width / lay.tp
    cp_gbps = settings["link_gbps"] if lay.tp * lay.cp <= settings["gpus_per_node"] else settings["internode_gbps"]
    cp_comm = cp_bytes / (cp_gbps * GB) / compute_s
    bubble = (lay.pp - 1) / ((lay.vpp or 1) * micro)
    budget = settings["gpu_mem_gb"] * t.max_memory_fraction
    return dict(tp=lay.tp, tp_blocks=list(lay.tp_blocks), pp=lay.pp, vpp=lay.vpp, cp=lay.cp, dp=lay.dp, ep=lay.ep,
                etp=lay.etp, sp=lay.sp, fsdp=lay.fsdp,
                dist_opt=lay.dist_opt, recompute=recompute_mode, fits=est.total / GB <= budget, mem_gb=est.mem_gb(),
                stage=est.stage, params_total=est.params_total, params_per_gpu=est.params_per_gpu, micro_batches=micro,
                bubble=round(bubble, 4), comm_gb={"tp": round(tp_bytes / GB, 3), "dp": round(dp_bytes / GB, 3),
                                                  "pp": round(pp_bytes / GB, 3), "ep": round(ep_bytes / GB, 3),
                                                  "cp": round(cp_bytes / GB, 3)},
                name=lay.name, overrides=" ".join(lay.overrides(explicit=True) + [f"model.recompute={recompute_mode}"]),
                score=round((1 + bubble) * (1 + recompute + redundant + tp_comm + ep_comm + cp_comm) + pp_comm +
                            dp_comm, 4))


def table(rows: list[dict], top: int) -> str:
    moe = any(r["ep"] > 1 for r in rows)  # the EP columns only for a mixture of experts
    cp = any(r["cp"] > 1 for r in rows)  # the CP columns only where a layout splits sequences
    head = (f"{'#':>3} {'tp':>3} {'splits':>9} {'pp':>3} {'vpp':>3}{'  cp' if cp else ''} {'dp':>4}"
            f"{'   ep' if moe else ''} {'sp':>3} {'dopt':>4} "
            f"{'recomp':>9} | {'w+opt':>7} {'act':>7} {'total':>7} {'fits':>4} | {'bubble':>6} {'TP GB':>7} "
            f"{'  CP GB ' if cp else ''}{'DP GB':>7}{'   EP GB' if moe else ''} | score")
    lines = [head, "-" * len(head)]
    for i, r in enumerate(rows[:top], 1):
        g = r["mem_gb"]
        lines.append(f"{i:>3} {r['tp']:>3} {splits(r):>9} {r['pp']:>3} {r['vpp'] or '-':>3}"
                     f"{f' {r['cp']:>3}' if cp else ''} {r['dp']:>4}{f' {r['ep']:>4}' if moe else ''} "
                     f"{'on' if r['sp'] else '-':>3} {SHARDING[r['fsdp']] if r['dist_opt'] else '-':>4} "
                     f"{r['recompute']:>9} | "
                     f"{g['weights_and_optimizer']:>7.1f} {g['activations']:>7.1f} {g['total']:>7.1f} "
                     f"{'yes' if r['fits'] else 'no':>4} | {r['bubble']:>6.3f} {r['comm_gb']['tp']:>7.1f} "
                     f"{f'{r['comm_gb']['cp']:>7.1f} ' if cp else ''}{r['comm_gb']['dp']:>7.1f}"
                     f"{f' {r['comm_gb']['ep']:>7.1f}' if moe else ''} | {r['score']:.3f}")
    return "\n".join(lines)


def plan(settings: dict, overrides: list[str]) -> tuple[list[dict], str]:
    """Ranked rows (the recommended one flagged) and a header describing the problem."""
    from models.gpt import num_params
    from models.shape import ModelShape
    from training.config.compose import compose
    from training.data.datasets import resolve_vocab_size
    from training.data.tokenizer import build_tokenizer

    cfg = compose(overrides)
    shape = ModelShape.of(cfg.model, resolve_vocab_size(cfg, build_tokenizer(cfg.data.tokenizer)))
    world = settings["gpus_per_node"] * settings["nodes"]
    valid, rejected = candidates(cfg, world, settings["gpus_per_node"])
    if not valid:
        raise ValueError(f"no valid layout on {world} GPUs: " + "; ".join(rejected or ["none to try"]))
    rows = [assess(option, shape, lay, settings) for lay, option in valid]
    rows.sort(key=lambda r: (not r["fits"], r["score"], r["mem_gb"]["total"]))
    rows[0]["recommended"] = rows[0]["fits"]
    for r in rows[1:]:
        r["recommended"] = False
    total = num_params(shape)
    t = cfg.train
    header = (f"{cfg.model.name}: {total / 1e9:.3f} B parameters, seq {cfg.model.seq_length}, micro batch "
              f"{t.micro_batch_size}, global batch {t.global_batch_size}, {t.precision}; {world} GPUs "
              f"({settings['nodes']} x {settings['gpus_per_node']}) of {settings['gpu_mem_gb']:g} GB, budget "
              f"{settings['gpu_mem_gb'] * t.max_memory_fraction:g} GB (train.max_memory_fraction="
              f"{t.max_memory_fraction:g}); flash attention {'assumed' if settings['flash_attention'] else 'off'}")
    return rows, header


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
    rows, header = plan(settings, overrides)
    if as_json:
        print(json.dumps(rows, indent=1))
        return 0
    fitting = sum(r["fits"] for r in rows)
    print(f"{header}\n{len(rows)} layouts, {fitting} fit; best {min(settings['top'], len(rows))}:\n")
    print(table(rows, settings["top"]))
    if (note := minimal_tp_note(rows)) is not None:
        print(f"\n{note}")
    best = rows[0]
    if best["recommended"]:
        print(f"\nrecommended (#1): {command(settings, overrides, best['overrides'])}")
        if settings["nodes"] > 1:
            print(f"on each of the {settings['nodes']} nodes with its own NODE_RANK (0 on the node MASTER_ADDR names), "
                  f"the same RUN_ID everywhere (launch/multinode.sh; launch/slurm.sbatch sets them under SLURM)")
    else:
        print(f"\nnothing fits: the smallest needs {min(r['mem_gb']['total'] for r in rows):.1f} GB per GPU; add "
              f"GPUs (plan.nodes), lower train.micro_batch_size or model.seq_length, or use larger GPUs")
    return 0


def main(argv: list[str]) -> int:
    """run(argv), with the user's errors as one line each and exit code 2."""
    from training.errors import exit_on_error

    return exit_on_error(run, argv, also=(ValueError,))


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
