"""Training-step benchmark: median step time, tokens/s, TFLOP/s per device, MFU and peak memory of our GPT,
optionally side by side with Megatron-Core's own GPTModel at the same config, layout and weights.

    .venv/bin/python tools/bench.py                               # the default config (below), one process
    .venv/bin/python tools/bench.py --compare-mcore --json        # ours vs Megatron-Core (JSON: ours_s, mcore_s, ratio)
    .venv/bin/python tools/bench.py --compare-hf --breakdown      # ours vs transformers' Llama + plain AdamW, by phase
    .venv/bin/python tools/bench.py --compare                     # ours vs transformers' and torchtitan's Llama, A B C
    .venv/bin/python tools/bench.py --compare --compile           # the same, every side's layers torch.compile'd
    .venv/bin/python tools/bench.py --layouts tp1,tp2,dp2,pp2     # one table row per layout (memory, comm share)
    .venv/bin/python tools/bench.py --preference --windows 10     # DPO (stored / live reference) vs an SFT step
    .venv/bin/python tools/bench.py --breakdown                   # + where a step's time goes (loop overhead share)
    .venv/bin/python tools/bench.py --nproc 2 parallel.tp=2       # spawn 2 processes (gloo on CPU, NCCL on GPUs)
    torchrun --nproc-per-node 8 tools/bench.py parallel.tp=2 model=llama_1b train.precision=bf16
    .venv/bin/python tools/bench.py experiment=llama_1b_single_gpu --compare-mcore --breakdown   # one GPU: MFU

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
step (training/bench/bench_hf.py), one process, fp32. --compare adds torchtitan 0.3.0's Llama3Model beside it
(training/bench/bench_titan.py: our weights through its own Llama3StateDictAdapter.from_hf; an optional
extra, `pip install --no-deps -c constraints.txt torchtitan==0.3.0 && pip install -e ".[bench]"`), the three
rotating A B C, B C A, ... in each window, and reports both ratios. --compile compiles each transformer layer of
every side (torch.compile per block, as torchtitan's own --compile does; ours through model.compile); the warm-up
steps pay the compiles.

The vocabulary: our GPT masks padded vocabulary logits to -inf, Megatron-Core's (and HF's) does not. In a comparison
both models get the padded size as their real vocabulary (257 bytes -> 384), so neither masks and both
compute the same logits and loss: equal work.

This file parses the flags; the work is in training/bench/ (runner.py builds, times and compares in every
process, report.py writes the text, layouts.py runs --layouts rows), and the processes are started by
training.parallel.launch_local.run_local, as for tools/generate.py and tools/evaluate.py.
"""

from __future__ import annotations

import argparse
import sys

from training.bench.layouts import run_layouts
from training.bench.runner import run
from training.parallel.launch_local import run_local


def parse_args(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("overrides", nargs="*", help="Hydra overrides of the training config")
    versus = ap.add_mutually_exclusive_group()
    versus.add_argument("--compare-mcore", action="store_true", help="also time Megatron-Core's GPTModel, A B A B")
    versus.add_argument("--compare-hf", action="store_true",
                        help="also time transformers' LlamaForCausalLM with plain AdamW, A B A B (one process, fp32)")
    versus.add_argument("--preference", action="store_true", help="a DPO step (stored and live reference) vs the "
                        "token step on the same packed pairs (training/bench/bench_post.py)")
    versus.add_argument("--compare", action="store_true",
                        help="also time transformers' and torchtitan's Llama (needs the bench extra), A B C")
    ap.add_argument("--compile", action="store_true", help="torch.compile each transformer layer on every side "
                    "(ours: model.compile=true; transformers' and torchtitan's decoder layers alike)")
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


def main(argv=None) -> int:
    args = parse_args(argv)
    if args.layouts:  # each layout is its own `tools/bench.py --json --detail` (training/bench/layouts.py)
        return run_layouts(args)
    return run_local(run, args, args.nproc)  # here, under torchrun, or on --nproc spawned processes


if __name__ == "__main__":  # the guard matters: spawned workers re-import this file
    sys.exit(main())
