"""tools/bench.py's work in each process of a run: build our model once, time it (alone, or A B A B against
Megatron-Core's GPTModel or transformers' Llama, or A B C against transformers' and torchtitan's Llamas), add the
derived numbers, and print rank 0's result.

    run(args)        in every process (training.parallel.launch_local.run_local starts them): prints the result
    measure(args)    the result dict (the keys tools/bench.py --json prints)

Heavy imports (torch, Megatron-Core, the engine) happen inside the functions: the launching process of a
spawned run, and `tools/bench.py --help`, stay light.
"""

from __future__ import annotations

import json
import os
import statistics
import sys
from dataclasses import dataclass
from typing import TYPE_CHECKING, Callable

if TYPE_CHECKING:
    import argparse

    import torch

    from models.shape import ModelShape
    from training.config.schema import Config
    from training.engine.build import TrainState
    from training.parallel.layout import Layout


def profile_table(run_steps, rows: int) -> str:
    """torch.profiler's top `rows` ops of 3 steps of `run_steps(n)`."""
    import torch

    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU] + (
            [torch.profiler.ProfilerActivity.CUDA] if torch.cuda.is_available() else [])) as prof:
        run_steps(3)
    sort = "cuda_time_total" if torch.cuda.is_available() else "self_cpu_time_total"
    return prof.key_averages().table(sort_by=sort, row_limit=rows)


def _print_profile(title: str, run_steps, rows: int) -> None:
    print(f"--- {title}: top {rows} ops of 3 steps ---\n{profile_table(run_steps, rows)}", file=sys.stderr)


@dataclass
class Bench:
    """One run's shared pieces: the flags, the config and its derived numbers, the device, our built model
    (`ours`, a TrainState) and the fixed synthetic global batch it steps on."""

    args: argparse.Namespace
    cfg: Config
    layout: Layout
    device: torch.device
    shape: ModelShape
    ours: TrainState
    batch: list[dict]
    ours_streams: Callable  # () -> fresh micro-batch streams of the batch (benchmark.batch_streams)

    def run_ours(self, n: int) -> list[float]:
        from training.bench import benchmark as bm

        return bm.time_steps(self.ours, self.ours_streams, self.layout, self.cfg, self.device, n)

    def loss_of(self, state, streams, step=None) -> float:
        """Forward only: the global-batch token-mean loss of `state` on the batch."""
        from training.engine.losses import global_loss
        from training.engine.step import forward_step, run_schedule

        reports = run_schedule(state, streams(), self.layout, self.cfg, forward_only=True,
                               step=step or forward_step)
        return global_loss(reports, self.device).item()


def _build(args, cfg: Config, layout: Layout, device: torch.device) -> Bench:
    """Our model at the config (the vocabulary padded up front when comparing) and its synthetic batch."""
    from models.shape import ModelShape
    from training.bench import benchmark as bm
    from training.data.tokenizer import build_tokenizer
    from training.engine.build import build

    m = cfg.model
    shape = ModelShape.of(m, m.vocab_size or build_tokenizer(cfg.data.tokenizer).vocab_size)
    if args.compare_mcore or args.compare_hf or args.compare:  # equal work: no padded (masked) vocab rows
        shape = ModelShape.of(m, shape.padded_vocab(cfg.parallel.tp))
    ours = build(cfg, shape, device)
    batch = bm.synthetic_batch(cfg, shape.vocab_size)
    return Bench(args, cfg, layout, device, shape, ours, batch, bm.batch_streams(ours, batch, cfg))


def compare_mcore(b: Bench, flops_per_step: float) -> dict:
    """Megatron-Core's GPTModel at our config, layout and weights: its loss on the batch, then A B A B windows."""
    import torch

    from training.bench import benchmark as bm

    args, device, layout = b.args, b.device, b.layout
    resident = torch.cuda.memory_allocated(device) if device.type == "cuda" else 0
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
    mcore = bm.build_mcore(b.cfg, b.shape, device, use_te=args.te)
    bm.copy_weights(b.ours, mcore)
    mcore_streams = bm.batch_streams(mcore, b.batch, b.cfg)
    out = {"loss_mcore": b.loss_of(mcore, mcore_streams, bm.mcore_forward_step)}
    out["loss_ours"] = b.loss_of(b.ours, b.ours_streams)
    out["loss_rel_diff"] = abs(out["loss_ours"] - out["loss_mcore"]) / abs(out["loss_mcore"])

    def run_mcore(n):
        return bm.time_steps(mcore, mcore_streams, layout, b.cfg, device, n, step=bm.mcore_forward_step)

    run_mcore(args.warmup)
    out.update(bm.paired_windows(b.run_ours, run_mcore, args.windows, args.steps))
    mcore_s = out["mcore_s"]
    out["mcore_tokens_per_s"] = b.cfg.train.global_batch_size * b.cfg.model.seq_length / mcore_s
    out["mcore_tflops_per_device"] = flops_per_step / mcore_s / layout.world / 1e12
    out["mcore_mem_gb"] = (torch.cuda.max_memory_allocated(device) - resident) / 1e9 \
        if device.type == "cuda" else None
    if args.profile:
        _print_profile("Megatron-Core GPTModel", run_mcore, args.profile)
    return out


def compare_plain(b: Bench) -> dict:
    """transformers' LlamaForCausalLM (--compare-hf), and torchtitan's Llama3Model beside it (--compare), at our
    shape and weights with plain AdamW: their losses on the batch, then alternating windows (paired with one
    other side, rotated with two)."""
    from functools import partial

    from training.bench import bench_hf, bench_titan
    from training.bench import benchmark as bm
    from training.errors import ConfigError

    args, p = b.args, b.cfg.parallel
    flag = "--compare" if args.compare else "--compare-hf"
    if p.tp * p.pp * p.cp > 1 or int(os.environ.get("WORLD_SIZE", "1")) > 1:
        raise ConfigError(f"{flag} runs one process (the plain PyTorch models are not tensor/pipeline/context "
                          "parallel): drop --nproc and the parallel.* overrides")
    loss_ours = b.loss_of(b.ours, b.ours_streams)
    sides = {"hf": bench_hf.build_hf(b.ours, b.cfg, b.device, flag)}
    if args.compare:
        sides["titan"] = bench_titan.build_titan(b.ours, b.cfg, b.device)
    if args.compile:  # as model.compile does ours: each decoder layer
        for side in sides.values():
            bench_hf.compile_layers(side)
    micro = bench_hf.micro_batches(b.batch, b.cfg.train.micro_batch_size, b.device)
    out, timers = {"loss_ours": loss_ours}, {}
    for name, side in sides.items():
        out[f"loss_{name}"] = bench_hf.hf_loss(side, micro)
        out[f"loss_rel_diff_{name}"] = abs(loss_ours - out[f"loss_{name}"]) / abs(out[f"loss_{name}"])
        timers[name] = partial(bench_hf.time_hf_steps, side, micro, b.device)
        timers[name](args.warmup)
    if args.compare:
        out.update(bm.rotated_windows(b.run_ours, timers, args.windows, args.steps))
    else:
        out["loss_rel_diff"] = out.pop("loss_rel_diff_hf")
        out.update(bm.paired_windows(b.run_ours, timers["hf"], args.windows, args.steps, other="hf"))
    for name, side in sides.items():
        if args.breakdown:
            out[f"{name}_breakdown"] = bench_hf.hf_breakdown(side, micro, b.device, args.windows * args.steps)
        if args.profile:
            _print_profile(name, timers[name], args.profile)
    return out


def _header(b: Bench) -> dict:
    """What was measured: the result's first keys."""
    import torch

    device, m = b.device, b.cfg.model
    return {"config": b.layout.describe(), "model": m.name, "precision": b.cfg.train.precision,
            "vocab": b.shape.vocab_size, "padded_vocab": b.shape.padded_vocab(b.cfg.parallel.tp),
            "device": torch.cuda.get_device_name(device) if device.type == "cuda" else f"cpu ({os.cpu_count()} cores)",
            "world": b.layout.world, "threads": torch.get_num_threads(), "warmup": b.args.warmup,
            "steps": b.args.steps, "windows": b.args.windows}


def measure(args) -> dict:
    """Runs on every rank inside one process group; returns the result (rank 0's timings)."""
    from models.gpt import flops_per_token
    from training.bench import benchmark as bm
    from training.bench.measure import measure_detail
    from training.config.compose import compose
    from training.config.validate import validate
    from training.engine.metrics import memory_gb, peak_tflops
    from training.errors import ConfigError
    from training.estimate.memory import estimate
    from training.parallel import dist as D

    if args.compile and args.compare_mcore:
        raise ConfigError("--compile compiles our layers and the plain PyTorch models' (--compare, --compare-hf), "
                          "not Megatron-Core's GPTModel: drop --compile or --compare-mcore")
    cfg = compose(list(args.overrides) + (["model.compile=true"] if args.compile else []))
    layout = validate(cfg)
    with D.distributed(**D.layout_of(cfg)) as info:
        b = _build(args, cfg, layout, info.device)
        tokens_per_step = cfg.train.global_batch_size * cfg.model.seq_length
        flops_per_step = flops_per_token(b.shape, cfg.parallel.tp) * tokens_per_step
        peak = peak_tflops(b.device, cfg.train.precision)
        load_before = os.getloadavg()
        b.run_ours(args.warmup)
        mem_ours = memory_gb(b.device)
        result = _header(b)
        if args.compare_mcore:
            result.update(compare_mcore(b, flops_per_step))
        elif args.compare_hf or args.compare:
            result.update(compare_plain(b))
        elif args.preference:  # the token step is ours_s: the same packed pair sequences
            from training.bench.bench_post import preference

            result.update(preference(b))
            result["ours_s"] = result["sft_s"]
        else:
            result["ours_steps_s"] = b.run_ours(args.windows * args.steps)
            result["ours_s"] = statistics.median(result["ours_steps_s"])
        ours_s = result["ours_s"]
        tflops = flops_per_step / ours_s / layout.world / 1e12
        est = estimate(cfg, b.shape, layout)  # what plan.py says
        result.update(tokens_per_s=tokens_per_step / ours_s, tflops_per_device=tflops,
                      mfu=None if peak is None else tflops / peak, mem_gb=mem_ours, estimate_gb=est.total / 1e9,
                      load_avg_1m=[load_before[0], os.getloadavg()[0]])
        if args.detail:
            result.update(measure_detail(b.ours, b.ours_streams, layout, cfg, b.device))
        if args.breakdown:
            result["breakdown"] = bm.breakdown(b.ours, b.ours_streams, layout, cfg, b.device,
                                               args.windows * args.steps)
        if args.profile:
            _print_profile("ours", b.run_ours, args.profile)
        return result


def run(args) -> None:
    """In this process (torchrun, one process, or a spawned worker): measure; rank 0 prints."""
    import torch

    from training.bench.report import report
    from training.shims.noise import quiet_known_noise

    quiet_known_noise()
    if not torch.cuda.is_available():
        world = int(os.environ.get("LOCAL_WORLD_SIZE", os.environ.get("WORLD_SIZE", "1")))
        torch.set_num_threads(args.threads or max(1, (os.cpu_count() or 1) // world))
    result = measure(args)
    if os.environ.get("RANK", "0") == "0":
        print(json.dumps(result) if args.json else report(result), flush=True)
