"""The layout planner's search (tools/plan.py is its command line; its docstring has the score's terms).

    rows = search(cfg, shape, settings, micro=None)   # one row per valid layout; micro None: 1, 2, 4, ... searched
    rows = rank(rows)                                  # the fitting ones by score, then the rest by memory

A row is a dict: the layout's sizes, its micro batch, memory (mem_gb), bubble, traffic (comm_gb), score and the
overrides that select it. The micro batch, when searched, is per layout: of the powers of two that divide the
global batch over its DP ranks and fit, the best-scored, ties to the larger (pipelining prefers more, smaller
micro-batches: a smaller bubble; without it the score does not change, and larger GEMMs and fewer kernel
launches, which it does not count, favour the larger).
"""

from __future__ import annotations

import dataclasses
import itertools
from functools import lru_cache

P2P_MESSAGE_S = 100e-6  # one pipeline send or receive: NCCL launch, the schedule's wait, small-message latency
DP_EXPOSED = 0.1  # share of the DP traffic not hidden behind the backward pass


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


@lru_cache(maxsize=256)
def _flops(shape, tp: int, kinds: tuple[str, ...] | None = None) -> float:
    from models.gpt import flops_per_token

    return flops_per_token(shape, tp, kinds=kinds)


def assess(option, shape, lay, settings: dict) -> dict:
    """Memory, bubble, traffic and score of one layout (shape: models/shape.py's ModelShape)."""
    from training.estimate.memory import GB, estimate

    t, recompute_mode = option.train, str(option.model.recompute)
    world, micro = lay.world, lay.num_microbatches
    est = estimate(option, shape, lay, settings["flash_attention"])
    vocab = shape.padded_vocab(lay.tp)
    e = 2 if t.precision == "bf16" else 4
    sbh = shape.seq_length // lay.cp * t.micro_batch_size * shape.hidden_size  # this rank's tokens
    flops_per_token = _flops(shape, lay.tp)  # 3 x forward
    share = 2 / 3 if est.adapters else 1.0  # peft=lora: frozen weights' gradient GEMMs skipped (backward = forward)
    flops_per_gpu = flops_per_token * share * t.global_batch_size * shape.seq_length / world
    whole = tuple(k for k in ("attention", "mlp", "vocab") if k not in lay.tp_blocks)  # computed on every TP rank
    redundant = (lay.tp - 1) * _flops(shape, lay.tp, whole) / flops_per_token if whole else 0.0
    recompute = {"none": 0.0, "full": (flops_per_token / 3 - 2 * shape.hidden_size * vocab) / flops_per_token,
                 "selective": 2 * shape.num_layers * shape.seq_length * shape.q_width / flops_per_token}[recompute_mode]
    recompute /= share  # of this run's training FLOPs
    # TP per layer and micro-batch: 2 all-reduces forward + 2 backward (SP: all-gathers + reduce-scatters of
    # the same volume; its backward re-gather overlaps the weight-gradient GEMMs); full recompute redoes forward
    collectives = 4 + (2 if recompute_mode == "full" else 0)
    split = sum(k in lay.tp_blocks for k in ("attention", "mlp")) / 2  # each split block: half the collectives
    tp_bytes = (shape.num_layers // lay.pp) * micro * collectives * split * 2 * (lay.tp - 1) / lay.tp * e * sbh
    shard = (lay.grad_group - 1) / lay.grad_group  # gradients are reduced over DP x CP
    reduced = est.adapters or est.params_per_gpu  # peft=lora: only the adapters' gradients are reduced
    dp_bytes = reduced * (shard * (4 + e) if lay.dist_opt else 2 * shard * 4)  # fp32 grads
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
    # the expert group: ep consecutive ranks of expert TP etp (Megatron-Core's expert rank order tp-ep-dp-pp folds
    # EP over the dense layout's TP and DP ranks), inside a node when etp x ep GPUs fit one
    ep_gbps = settings["link_gbps"] if lay.ep * lay.etp <= settings["gpus_per_node"] else settings["internode_gbps"]
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
                etp=lay.etp, sp=lay.sp, fsdp=lay.fsdp, micro_batch_size=t.micro_batch_size,
                global_batch_size=t.global_batch_size,
                dist_opt=lay.dist_opt, recompute=recompute_mode, fits=est.total / GB <= budget, mem_gb=est.mem_gb(),
                stage=est.stage, params_total=est.params_total, params_per_gpu=est.params_per_gpu, micro_batches=micro,
                bubble=round(bubble, 4), comm_gb={"tp": round(tp_bytes / GB, 3), "dp": round(dp_bytes / GB, 3),
                                                  "pp": round(pp_bytes / GB, 3), "ep": round(ep_bytes / GB, 3),
                                                  "cp": round(cp_bytes / GB, 3)},
                name=lay.name, overrides=" ".join(lay.overrides(explicit=True) + [f"model.recompute={recompute_mode}"]),
                score=round((1 + bubble) * (1 + recompute + redundant + tp_comm + ep_comm + cp_comm) +
                            pp_comm + dp_comm, 4))


def _with_micro(option, lay, micro: int):
    """The config and layout at another micro batch."""
    return (dataclasses.replace(option, train=dataclasses.replace(option.train, micro_batch_size=micro)),
            dataclasses.replace(lay, micro_batch_size=micro))


def search(cfg, shape, settings: dict, micro: int | None) -> list[dict]:
    """One row per layout valid on settings' nodes x gpus_per_node GPUs at cfg's global batch: at micro batch
    `micro`, or (None) the best-scored of 1, 2, 4, ... that fit, ties to the larger (1 when none fits), its
    train.micro_batch_size then among the row's overrides. ValueError when no layout is valid."""
    world = settings["gpus_per_node"] * settings["nodes"]
    base = dataclasses.replace(cfg, train=dataclasses.replace(cfg.train, micro_batch_size=micro or 1))
    valid, rejected = candidates(base, world, settings["gpus_per_node"])
    if not valid:
        raise ValueError(f"no valid layout on {world} GPUs: " + "; ".join(rejected or ["none to try"]))
    rows = []
    for lay, option in valid:
        if micro:
            rows.append(assess(option, shape, lay, settings))
            continue
        best, size = None, 1
        while size * lay.dp <= lay.global_batch_size:
            trial, trial_lay = _with_micro(option, lay, size)
            if not trial_lay.batch_problems():  # interleaving needs micro-batches per step divisible by pp
                row = assess(trial, shape, trial_lay, settings)
                if best is None or row["fits"] and (not best["fits"] or row["score"] <= best["score"]):
                    best = row
                if not row["fits"]:  # a larger micro-batch only holds more
                    break
            size *= 2
        best["overrides"] += f" train.micro_batch_size={best['micro_batch_size']}"
        rows.append(best)
    return rows


def rank(rows: list[dict]) -> list[dict]:
    """The layouts that fit by score (ties: less memory), then the rest closest to fitting first; the first
    flagged recommended when it fits."""
    fit = sorted((r for r in rows if r["fits"]), key=lambda r: (r["score"], r["mem_gb"]["total"]))
    rest = sorted((r for r in rows if not r["fits"]), key=lambda r: (r["mem_gb"]["total"], r["score"]))
    out = fit + rest
    for i, r in enumerate(out):
        r["recommended"] = i == 0 and r["fits"]
    return out


def what_would_fit(cfg, shape, settings: dict, micro: int | None, rows: list[dict]) -> list[str]:
    """When no layout fits (rows ranked: the closest first), lines saying what would: a smaller micro batch,
    more nodes (planned again, from the first count whose GPUs could hold one copy of the weights and optimizer
    state), larger GPUs, a shorter sequence; and what the closest layout already uses (recompute, sharding)."""
    from training.estimate.memory import bytes_per_param

    closest, fraction = rows[0], cfg.train.max_memory_fraction
    g, budget = closest["mem_gb"], settings["gpu_mem_gb"] * fraction
    sharding = "ZeRO-3 (parallel.fsdp=optim_grads_params)" if closest["fsdp"] == "optim_grads_params" else \
        "ZeRO-2 (parallel.fsdp=optim_grads)" if closest["fsdp"] == "optim_grads" else \
        "the distributed optimizer" if closest["dist_opt"] else \
        "no optimizer sharding (dp x cp 1: no ranks to shard it over)" if closest["dp"] * closest["cp"] == 1 else \
        "no optimizer sharding"
    out = [f"nothing fits in {budget:g} GB per GPU: the closest layout ({closest['name']}, recompute "
           f"{closest['recompute']}, {sharding}, micro batch {closest['micro_batch_size']}) needs {g['total']:.1f} "
           f"GB (weights+optimizer {g['weights_and_optimizer']:.1f}, activations {g['activations']:.1f}); "
           f"what would fit:"]
    if micro and micro > 1:
        fit = rank([r for r in search(cfg, shape, settings, None) if r["fits"]])
        if fit:
            out.append(f"  a smaller micro batch: {len(fit)} layouts fit without train.micro_batch_size={micro} "
                       f"(searched from 1; the best: {fit[0]['name']} at micro batch {fit[0]['micro_batch_size']})")
    precision = str(cfg.train.precision)
    per_param = (2 if precision == "bf16" else 4) if str(cfg.peft.method) == "lora" else \
        bytes_per_param(precision, False, 1)  # peft=lora: the frozen base's weights alone
    one_copy = per_param * closest["params_total"] / 1e9  # GB, all GPUs
    for factor in (2, 4, 8):
        more = {**settings, "nodes": settings["nodes"] * factor}
        if one_copy / (more["nodes"] * more["gpus_per_node"]) > budget:
            continue  # not even perfectly sharded state fits
        try:
            fit = rank([r for r in search(cfg, shape, more, micro) if r["fits"]])
        except ValueError:  # no layout valid there (e.g. the global batch does not divide)
            continue
        if fit:
            out.append(f"  more GPUs: plan.nodes={more['nodes']} ({len(fit)} layouts fit; the best: {fit[0]['name']}, "
                       f"recompute {fit[0]['recompute']}, {fit[0]['mem_gb']['total']:.1f} GB)")
            break
    else:
        out.append(f"  more GPUs: not within plan.nodes={settings['nodes'] * 8}")
    need = -(-g["total"] // fraction)
    out.append(f"  larger GPUs: plan.gpu_mem_gb={need:g} or more (the closest layout at train.max_memory_fraction="
               f"{fraction:g})")
    if g["activations"] > g["weights_and_optimizer"]:
        out.append("  a shorter model.seq_length or more context parallelism: activations are most of it")
    return out
