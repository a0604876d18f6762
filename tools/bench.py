"""Training-step benchmark: median step time, tokens/s, TFLOP/s per device, MFU and peak memory of our GPT,
optionally side by side with Megatron-Core's own GPTModel at the same config, layout and weights.

    python tools/bench.py                                   # the default config (below), one process
    python tools/bench.py --compare-mcore --json            # ours vs Megatron-Core: {"ours_s", "mcore_s", "ratio", ...}
    python tools/bench.py --compare-hf --breakdown          # ours vs transformers' Llama + plain AdamW, by phase
    python tools/bench.py --layouts tp1,tp2,dp2,pp2         # one table row per layout (memory, comm share)
    python tools/bench.py --breakdown                       # + where a step's time goes (loop overhead share)
    python tools/bench.py --nproc 2 parallel.tp=2           # spawn 2 processes (gloo on CPU, NCCL on GPUs)
    torchrun --nproc-per-node 8 tools/bench.py parallel.tp=2 model=llama_1b train.precision=bf16
    python tools/bench.py experiment=llama_1b_single_gpu --compare-mcore --breakdown   # one GPU: MFU

Arguments other than the flags are Hydra overrides of the training config, composed exactly as train.py
composes it. With none, it is the quickstart's: the tiny preset (4 layers, h=128, GQA 4/2, SwiGLU, RMSNorm,
RoPE, tied; 0.8M parameters) at 16 x 128 tokens per step in 4 micro-batches of 4. A 2-core CPU steps it in
~0.15-0.4 s, long against timer and scheduling noise, and runs the comparison (2 models x (3 warm-up +
35 timed steps)) in about a minute.

Every timed step is a real training step, forward + backward + optimizer, through training.engine.build.build
and training.engine.step.train_step on one fixed synthetic global batch: it times compute and communication,
not data loading. With --compare-mcore, Megatron-Core's GPTModel (its local spec, or
its Transformer Engine spec with --te) is built by the same build() with our weights copied in, its loss
on the batch is checked against ours, and the two alternate A B A B ... in `--windows` windows of
`--steps` steps; `ratio` is the median over windows of (our median step) / (its median step). One step
per window by default: on a shared machine the load changes within seconds, and adjacent steps see
nearly the same load, so the ratios of neighbours stay tight where window-long medians scatter.

With --compare-hf the other side is transformers' LlamaForCausalLM with our weights and a plain PyTorch
step (training/bench/bench_hf.py), one process, fp32.

The vocabulary: our GPT masks padded vocabulary logits to -inf, Megatron-Core's (and HF's) does not. In a comparison
both models get the padded size as their real vocabulary (257 bytes -> 384), so neither masks and both
compute the same logits and loss: equal work.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys

from training.shims.noise import quiet_known_noise


def parse_args(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("overrides", nargs="*", help="Hydra overrides of the training config")
    versus = ap.add_mutually_exclusive_group()
    versus.add_argument("--compare-mcore", action="store_true", help="also time Megatron-Core's GPTModel, A B A B")
    versus.add_argument("--compare-hf", action="store_true",
                        help="also time transformers' LlamaForCausalLM with plain AdamW, A B A B (one process, fp32)")
    ap.add_argument("--te", action="store_true", help="Megatron-Core side: Transformer Engine spec (needs TE)")
    ap.add_argument("--json", action="store_true", help="print one JSON object instead of text")
    ap.add_argument("--warmup", type=int, default=3, help="untimed steps per model first (allocator, caches)")
    ap.add_argument("--steps", type=int, default=1, help="timed steps per window")
    ap.add_argument("--windows", type=int, default=35, help="timing windows per model (paired with --compare-mcore)")
    ap.add_argument("--breakdown", action="store_true", help="also split our step: forward/backward/optim/loop")
    ap.add_argument("--profile", type=int, default=0, metavar="N",
                    help="print torch.profiler's top-N ops of 3 steps per model (stderr)")
    ap.add_argument("--layouts", default=None, metavar="L1,L2,...",
                    help="one table row per layout (tp1, tp2, dp2, pp2, tp2dp2distopt, zero3, ...: "
                         "training/bench/layouts.py), each run as its own --detail bench")
    ap.add_argument("--detail", action="store_true", help="also measure per-rank state bytes, activations "
                    "saved per micro-batch and the collectives' share of the step (profiler, 3 steps)")
    ap.add_argument("--nproc", type=int, default=1, help="processes to spawn (ignored under torchrun)")
    ap.add_argument("--threads", type=int, default=None, help="torch threads per process (CPU); default "
                    "cores / processes")
    return ap.parse_args(argv)


def profile_table(run_steps, rows: int) -> str:
    import torch

    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU] + (
            [torch.profiler.ProfilerActivity.CUDA] if torch.cuda.is_available() else [])) as prof:
        run_steps(3)
    sort = "cuda_time_total" if torch.cuda.is_available() else "self_cpu_time_total"
    return prof.key_averages().table(sort_by=sort, row_limit=rows)


def measure(args) -> dict:
    """Runs on every rank inside one process group; returns the result (rank 0's timings)."""
    import torch

    from models.gpt import flops_per_token
    from models.shape import ModelShape
    from training.bench import benchmark as bm
    from training.bench.measure import measure_detail
    from training.config.compose import compose
    from training.config.validate import validate
    from training.data.tokenizer import build_tokenizer
    from training.engine.build import build
    from training.engine.losses import global_loss
    from training.engine.metrics import memory_gb, peak_tflops
    from training.engine.step import forward_step, run_schedule
    from training.estimate.memory import Layout, estimate
    from training.parallel import dist as D

    cfg = compose(args.overrides)
    derived = validate(cfg)
    p, m = cfg.parallel, cfg.model
    with D.distributed(**D.layout_of(cfg)) as info:
        device = info.device
        shape = ModelShape.of(m, m.vocab_size or build_tokenizer(cfg.data.tokenizer).vocab_size)
        if args.compare_mcore or args.compare_hf:  # equal work: no padded (masked) vocabulary rows in either model
            shape = ModelShape.of(m, shape.padded_vocab(p.tp))
        vocab = shape.vocab_size
        ours = build(cfg, shape, device)
        batch = bm.synthetic_batch(cfg, vocab)
        ours_streams = bm.batch_streams(ours, batch, cfg)

        def run_ours(n):
            return bm.time_steps(ours, ours_streams, derived, cfg, device, n)

        def loss_of(state, streams, step=forward_step):  # forward only, the global-batch token-mean loss
            reports = run_schedule(state, streams(), derived, cfg, forward_only=True, step=step)
            return global_loss(reports, device).item()

        padded = shape.padded_vocab(p.tp)
        flops_per_step = flops_per_token(shape, p.tp) * derived.tokens_per_step
        peak = peak_tflops(device, cfg.train.precision)
        load_before = os.getloadavg()
        run_ours(args.warmup)
        mem_ours = memory_gb(device)
        result = {"config": derived.describe(cfg), "model": m.name, "precision": cfg.train.precision,
                  "vocab": vocab, "padded_vocab": padded, "device": torch.cuda.get_device_name(device)
                  if device.type == "cuda" else f"cpu ({os.cpu_count()} cores)", "world": derived.world_size,
                  "threads": torch.get_num_threads(), "warmup": args.warmup, "steps": args.steps,
                  "windows": args.windows}
        if args.compare_mcore:
            resident = torch.cuda.memory_allocated(device) if device.type == "cuda" else 0
            if device.type == "cuda":
                torch.cuda.reset_peak_memory_stats(device)
            mcore = bm.build_mcore(cfg, shape, device, use_te=args.te)
            bm.copy_weights(ours, mcore)
            mcore_streams = bm.batch_streams(mcore, batch, cfg)
            result["loss_mcore"] = loss_of(mcore, mcore_streams, bm.mcore_forward_step)
            result["loss_ours"] = loss_of(ours, ours_streams)
            result["loss_rel_diff"] = abs(result["loss_ours"] - result["loss_mcore"]) / abs(result["loss_mcore"])

            def run_mcore(n):
                return bm.time_steps(mcore, mcore_streams, derived, cfg, device, n, step=bm.mcore_forward_step)

            run_mcore(args.warmup)
            result.update(bm.paired_windows(run_ours, run_mcore, args.windows, args.steps))
            mcore_s = result["mcore_s"]
            result["mcore_tokens_per_s"] = derived.tokens_per_step / mcore_s
            result["mcore_tflops_per_device"] = flops_per_step / mcore_s / derived.world_size / 1e12
            result["mcore_mem_gb"] = (torch.cuda.max_memory_allocated(device) - resident) / 1e9 \
                if device.type == "cuda" else None
            if args.profile:
                print(f"--- Megatron-Core GPTModel: top {args.profile} ops of 3 steps ---\n"
                      f"{profile_table(run_mcore, args.profile)}", file=sys.stderr)
        elif args.compare_hf:
            result.update(compare_hf(args, cfg, ours, batch, device, run_ours, loss_of(ours, ours_streams)))
        else:
            result["ours_steps_s"] = run_ours(args.windows * args.steps)
            result["ours_s"] = statistics.median(result["ours_steps_s"])
        ours_s = result["ours_s"]
        tflops = flops_per_step / ours_s / derived.world_size / 1e12
        est = estimate(cfg, shape, Layout.of(cfg, derived.dp), derived.num_microbatches)  # what plan.py says
        result.update(tokens_per_s=derived.tokens_per_step / ours_s, tflops_per_device=tflops,
                      mfu=None if peak is None else tflops / peak, mem_gb=mem_ours, estimate_gb=est.total / 1e9,
                      load_avg_1m=[load_before[0], os.getloadavg()[0]])
        if args.detail:
            result.update(measure_detail(ours, ours_streams, derived, cfg, device))
        if args.breakdown:
            result["breakdown"] = bm.breakdown(ours, ours_streams, derived, cfg, device, args.windows * args.steps)
        if args.profile:
            print(f"--- ours: top {args.profile} ops of 3 steps ---\n{profile_table(run_ours, args.profile)}",
                  file=sys.stderr)
        return result


def compare_hf(args, cfg, ours, batch, device, run_ours, loss_ours: float) -> dict:
    """transformers' LlamaForCausalLM at our shape and weights: its loss on the batch, then A B A B windows."""
    from training.bench import bench_hf
    from training.bench import benchmark as bm
    from training.errors import ConfigError

    p = cfg.parallel
    if p.tp * p.pp * p.cp > 1 or int(os.environ.get("WORLD_SIZE", "1")) > 1:
        raise ConfigError("--compare-hf runs one process (transformers' model is not tensor/pipeline/context "
                          "parallel): drop --nproc and the parallel.* overrides")
    side = bench_hf.build_hf(ours, cfg, device)
    micro = bench_hf.micro_batches(batch, cfg.train.micro_batch_size, device)
    out = {"loss_ours": loss_ours, "loss_hf": bench_hf.hf_loss(side, micro)}
    out["loss_rel_diff"] = abs(out["loss_ours"] - out["loss_hf"]) / abs(out["loss_hf"])

    def run_hf(n):
        return bench_hf.time_hf_steps(side, micro, device, n)

    run_hf(args.warmup)
    out.update(bm.paired_windows(run_ours, run_hf, args.windows, args.steps, other="hf"))
    if args.breakdown:
        out["hf_breakdown"] = bench_hf.hf_breakdown(side, micro, device, args.windows * args.steps)
    if args.profile:
        print(f"--- hf: top {args.profile} ops of 3 steps ---\n{profile_table(run_hf, args.profile)}", file=sys.stderr)
    return out


def report(result: dict) -> str:
    r = result
    lines = [f"{r['model']} | {r['config']} | {r['precision']} | vocab {r['vocab']} (padded {r['padded_vocab']}) | "
             f"{r['device']} x{r['world']}, {r['threads']} threads | load {r['load_avg_1m'][0]:.2f} -> "
             f"{r['load_avg_1m'][1]:.2f}",
             f"ours : {1e3 * r['ours_s']:.1f} ms/step | {r['tokens_per_s']:,.0f} tok/s | "
             f"{r['tflops_per_device']:.3f} TFLOP/s/dev | MFU "
             f"{'-' if r['mfu'] is None else format(r['mfu'], '.1%')} | mem {r['mem_gb']:.2f} GB"
             + ("" if r["device"].startswith("cpu") else f" (estimate {r['estimate_gb']:.2f} GB)")]  # CPU: RSS
    if "mcore_s" in r:
        lines.append(f"mcore: {1e3 * r['mcore_s']:.1f} ms/step | {r['mcore_tokens_per_s']:,.0f} tok/s | "
                     f"{r['mcore_tflops_per_device']:.3f} TFLOP/s/dev")
        q = statistics.quantiles(r["window_ratios"], n=4) if len(r["window_ratios"]) > 1 else [r["ratio"]] * 3
        lines.append(f"ratio ours/mcore {r['ratio']:.3f} (median of {len(r['window_ratios'])} paired windows of "
                     f"{r['steps']} step(s); quartiles {q[0]:.3f}-{q[2]:.3f}; fastest/fastest {r['ratio_min']:.3f})")
        lines.append(f"loss on the batch: ours {r['loss_ours']:.6f}, mcore {r['loss_mcore']:.6f} "
                     f"(rel diff {r['loss_rel_diff']:.1e})")
    if "hf_s" in r:
        q = statistics.quantiles(r["window_ratios"], n=4) if len(r["window_ratios"]) > 1 else [r["ratio"]] * 3
        lines.append(f"hf   : {1e3 * r['hf_s']:.1f} ms/step (transformers LlamaForCausalLM, SDPA, torch AdamW)")
        lines.append(f"ratio ours/hf {r['ratio']:.3f} (median of {len(r['window_ratios'])} paired windows of "
                     f"{r['steps']} step(s); quartiles {q[0]:.3f}-{q[2]:.3f}; fastest/fastest {r['ratio_min']:.3f})")
        lines.append(f"loss on the batch: ours {r['loss_ours']:.6f}, hf {r['loss_hf']:.6f} "
                     f"(rel diff {r['loss_rel_diff']:.1e})")
    if "breakdown" in r:
        b = r["breakdown"]
        shares = ", ".join(f"{k[:-6]} {v:.1%}" for k, v in b.items() if k.endswith("_share"))
        lines.append(f"breakdown of a {1e3 * b['step_s']:.1f} ms step: {shares}")
    if "hf_breakdown" in r:
        b = r["hf_breakdown"]
        shares = ", ".join(f"{k[:-6]} {v:.1%}" for k, v in b.items() if k.endswith("_share"))
        lines.append(f"hf breakdown of a {1e3 * b['step_s']:.1f} ms step: {shares}")
    if r["device"].startswith("cpu") and r["load_avg_1m"][0] > os.cpu_count():  # before our own steps
        lines.append(f"warning: load average {r['load_avg_1m'][0]:.1f} on {os.cpu_count()} cores before the run: "
                     f"other processes compete for the CPU and these timings are noisy")
    return "\n".join(lines)


def run(args) -> int:
    """In this process (torchrun or a spawned worker): measure; rank 0 prints. 2 on the user's error."""
    import torch

    from training.errors import exit_on_error

    quiet_known_noise()
    if not torch.cuda.is_available():
        world = int(os.environ.get("LOCAL_WORLD_SIZE", os.environ.get("WORLD_SIZE", "1")))
        torch.set_num_threads(args.threads or max(1, (os.cpu_count() or 1) // world))

    def measure_and_print():
        result = measure(args)
        if os.environ.get("RANK", "0") == "0":
            print(json.dumps(result) if args.json else report(result), flush=True)

    return exit_on_error(measure_and_print)


def _worker(rank: int, world: int, port: int, args) -> None:
    os.environ.update(RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=str(world), LOCAL_WORLD_SIZE=str(world),
                      MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    if code := run(args):
        raise SystemExit(code)


def bench_layouts(args) -> int:
    from training.bench import layouts as bl
    from training.errors import ConfigError

    names = [n for n in args.layouts.split(",") if n]
    try:
        for name in names:
            bl.parse(name)
    except ConfigError as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    flags = [f"--warmup={args.warmup}", f"--steps={args.steps}", f"--windows={args.windows}"]
    flags += [f"--threads={args.threads}"] if args.threads else []
    rows = []
    for name in names:
        rows.append(bl.run_row(name, args.overrides, flags))
        if not args.json:
            print(bl.table(rows).splitlines()[-1] if len(rows) > 1 else bl.table(rows), flush=True)
    if args.json:
        print(json.dumps(rows))
    return 0 if all("error" not in r for r in rows) else 1


def main(argv=None) -> int:
    from training.parallel.spawn import free_port

    args = parse_args(argv)
    if args.layouts:
        return bench_layouts(args)
    if "RANK" in os.environ:  # torchrun
        return run(args)
    if args.nproc == 1:
        _worker(0, 1, free_port(), args)
        return 0
    import torch.multiprocessing as mp

    try:
        mp.start_processes(_worker, args=(args.nproc, free_port(), args), nprocs=args.nproc, start_method="spawn")
    except mp.ProcessExitedException as error:  # a worker's SystemExit (its error is printed already)
        return error.exit_code or 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
