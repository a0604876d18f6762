"""Same loss on one process and on many: train K steps from the same weights and data at every layout.

    .venv/bin/python tools/verify_layouts.py --steps 4 --layouts tp2,tp2sp,pp2,pp2vpp2,dp2,dp2distopt,tp2pp2,dp2-bf16
    .venv/bin/python tools/verify_layouts.py --steps 4 --layouts tp2,pp2 model=gpt2_124m model.num_layers=2  # yours
    .venv/bin/python tools/verify_layouts.py model=moe_tiny --layouts ep2dp2,tp2ep2dp2sp,pp2ep2dp2     # experts
    .venv/bin/python tools/verify_layouts.py model.seq_length=256 --layouts cp2,tp2cp2sp,cp2distopt    # long sequences
    .venv/bin/python tools/verify_layouts.py --layouts dp2zero3,dp2zero2,tp2dp2zero3                # ZeRO-3 / ZeRO-2
    .venv/bin/python tools/verify_layouts.py model=moe_tiny      # every layout this model can run (the rest: said why)
    .venv/bin/python tools/verify_layouts.py --fresh --layouts tp2,pp2,dp2  # each from its own init: same seed, model

It saves the initial weights once (train.iters=0), then launches train.py with torchrun for the
reference (1 process) and for each layout, every one loading those weights (checkpoint.finetune) and
reading the same batches. With --fresh every run starts from its own initialisation instead: the same seed
draws the same weights at every layout (training/engine/init.py), so this is the check a user makes after
switching layouts, through the whole path (init included). It prints
layout, processes, max relative loss difference over the steps, and pass/fail; exits 1 on any failure.

Tolerances: fp32 layouts must match the fp32 reference to 1e-5 relative (only the order of
floating-point reductions differs; a wrong gradient moves the loss by >= 1e-3 after one update).
bf16 layouts are compared with a bf16 1-process reference at 1e-3: the computation is the same and
only the order of the fp32 gradient reduction differs, which can flip the bf16 rounding of a few
updated weights (2^-9 relative each, ~1e-4 on the loss); measured on the tiny model at dp2: 0. Their
drift from fp32 (bf16's 8-bit mantissa, measured 7e-4 after 4 steps) is printed for information. The grad
norms (before clipping) are held to 1e-4 (fp32) and 1e-2 (bf16).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
FP32_TOL, BF16_TOL = 1e-5, 1e-3  # losses
FP32_GRAD_TOL, BF16_GRAD_TOL = 1e-4, 1e-2  # grad norms (one reduction order's more rounding)

# Each case: a layout (training/parallel/layout.py's names: tp2pp2dp2sp, ...) and, after a dash, what else the
# case changes. Global batch 16, micro 4 by default (conf/train/default.yaml).
CASES = {
    "tp2": [], "tp2sp": [], "pp2": [],
    # PP=2, 2 virtual stages: Megatron-Core's batched p2p corrupts gradients here (training/shims/upstream_fixes.py)
    "pp2vpp2": [],
    "dp2": ["train.micro_batch_size=8"],  # one micro-batch per rank
    "dp2distopt": ["parallel.overlap_grad_reduce=true", "parallel.overlap_param_gather=true"],
    "tp2pp2": [],
    "dp2-accum": ["train.micro_batch_size=4"],  # 2 micro-batches per rank
    "tp2-recompute-full": ["model.recompute=full"],
    "tp2sp-recompute-selective": ["model.recompute=selective"],
    "dp2-bf16": ["train.precision=bf16"],
    # Megatron-FSDP: ZeRO-3 and ZeRO-2 over DP, ZeRO-3 with TP
    "dp2zero3": [], "dp2zero2": [], "tp2dp2zero3": [],
    # context parallel (sequences split over ranks; needs model.seq_length divisible by 2 x cp (x tp with SP))
    "cp2": [], "tp2cp2sp": [], "cp2distopt": ["parallel.overlap_grad_reduce=true"],
    # a mixture of experts (model=moe_tiny): experts over 2 ranks, with TP+SP, the distributed optimizer, PP
    "ep2dp2": [], "tp2ep2dp2sp": [], "ep2dp2distopt": ["parallel.overlap_grad_reduce=true"], "pp2ep2dp2": [],
}


def case(name: str) -> tuple[int, list[str]]:
    """(processes, overrides) of a case: its layout's, then the case's own."""
    from training.parallel.layout import Layout

    layout = Layout.from_name(name.split("-")[0])
    return layout.world, [*layout.overrides(), *CASES[name]]


def default_layouts(user_overrides: list[str]) -> tuple[list[str], list[str]]:
    """(the layouts that can run this model, the others with why). A MoE's load-balancing loss depends on
    which sequences share a micro-batch: layouts that change the micro-batch size compute another loss."""
    from training.config.compose import compose
    from training.config.validate import problems

    cfg = compose(user_overrides)
    moe = bool(cfg.model.moe.num_experts)
    runnable, skipped = [], []
    for name in CASES:
        nproc, overrides = case(name)
        found = problems(compose([*user_overrides, *overrides]), nproc)
        if moe and any(o.startswith("train.micro_batch_size=") for o in overrides):
            skipped.append(f"{name} (changes the micro-batch: another MoE load-balancing loss)")
        elif found:
            skipped.append(f"{name} ({found[0]})")
        else:
            runnable.append(name)
    return runnable, skipped


def launch(nproc: int, run_dir: Path, overrides: list[str]) -> subprocess.CompletedProcess:
    from training.parallel.spawn import free_port

    cmd = [sys.executable, "-m", "torch.distributed.run", "--nnodes", "1", "--nproc-per-node", str(nproc),
           "--master-addr", "127.0.0.1", "--master-port", str(free_port()), str(ROOT / "train.py"),
           f"hydra.run.dir={run_dir}", *overrides]
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1")
    return subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True)


def shared_start(work: Path, user_overrides: list[str]) -> list[str] | None:
    """Save the initial weights once; the overrides that start every run from them (None: it failed)."""
    init = launch(1, work / "init", [*user_overrides, "train.iters=0", f"checkpoint.dir={work}/init/checkpoints"])
    if init.returncode != 0:
        print(f"error: saving the initial weights failed:\n{init.stdout[-2000:]}{init.stderr[-2000:]}", file=sys.stderr)
        return None
    return [f"checkpoint.load={work}/init/checkpoints/iter_0000000", "checkpoint.finetune=true"]


def curves(run_dir: Path) -> dict[str, list[float]]:
    records = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    return {key: [r[key] for r in records if "loss" in r] for key in ("loss", "grad_norm")}


def max_rel_diff(got: list[float], ref: list[float]) -> float:
    if len(got) != len(ref):
        return float("inf")
    return max(abs(a - b) / abs(b) for a, b in zip(got, ref))


def parse(argv: list[str]):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=4, help="optimizer steps per layout")
    parser.add_argument("--layouts", default=None, help=f"comma-separated from {', '.join(CASES)} (default: "
                                                        f"every one this model can run)")
    parser.add_argument("--fresh", action="store_true", help="every run from its own initialisation (same seed), "
                                                             "not from one saved set of weights")
    parser.add_argument("--work-dir", default=None, help="where run dirs go (default: a temporary dir)")
    args, user_overrides = parser.parse_known_args(argv)
    if args.layouts is None:
        args.names, skipped = default_layouts(user_overrides)
        for line in skipped:
            print(f"skipped: {line}")
    else:
        args.names = [n for n in args.layouts.split(",") if n]
    return args, user_overrides


def check(name: str, work: Path, common: list[str], references: dict) -> bool:
    """One case against its reference: a row (loss and grad-norm differences, tolerance, result)."""
    nproc, overrides = case(name)
    precision = "bf16" if "train.precision=bf16" in overrides else "fp32"
    tol, grad_tol = (BF16_TOL, BF16_GRAD_TOL) if precision == "bf16" else (FP32_TOL, FP32_GRAD_TOL)
    run = launch(nproc, work / name, [*common, *overrides])
    if run.returncode != 0:
        lines = run.stderr.strip().splitlines()
        last = next((line for line in lines if line.startswith("error:")), lines[-1] if lines else "no output")
        print(f"{name:<26}{nproc:>6}{'-':>13}{'-':>13}{tol:>10.0e}  FAIL (exit {run.returncode}: {last[:120]})")
        return False
    got, ref = curves(work / name), references[precision]
    diff, grad_diff = max_rel_diff(got["loss"], ref["loss"]), max_rel_diff(got["grad_norm"], ref["grad_norm"])
    ok = diff <= tol and grad_diff <= grad_tol
    note = f" (vs fp32: {max_rel_diff(got['loss'], references['fp32']['loss']):.1e})" if precision == "bf16" else ""
    print(f"{name:<26}{nproc:>6}{diff:>13.3e}{grad_diff:>13.3e}{tol:>10.0e}  {'pass' if ok else 'FAIL'}{note}")
    return ok


def main(argv: list[str]) -> int:
    args, user_overrides = parse(argv)
    if unknown := [n for n in args.names if n not in CASES]:
        print(f"error: unknown layouts {unknown}; choose from {', '.join(CASES)}", file=sys.stderr)
        return 2
    work = Path(args.work_dir or tempfile.mkdtemp(prefix="verify_layouts."))
    start = [] if args.fresh else shared_start(work, user_overrides)
    if start is None:
        return 2
    common = [*user_overrides, f"train.iters={args.steps}", "train.log_interval=1", "train.eval_interval=0",
              "train.tensorboard=false", "train.save_interval=0", "checkpoint.dir=null", *start]
    references = {}
    for precision in sorted({"bf16" if "train.precision=bf16" in CASES[n] else "fp32" for n in args.names} | {"fp32"}):
        run_dir = work / f"reference-{precision}"
        ref_run = launch(1, run_dir, [*common, f"train.precision={precision}"])
        if ref_run.returncode != 0:
            print(f"error: the 1-process {precision} reference failed:\n{ref_run.stderr[-3000:]}", file=sys.stderr)
            return 2
        references[precision] = curves(run_dir)
        shown = ", ".join(f"{x:.6f}" for x in references[precision]["loss"])
        print(f"reference {precision} (1 process): losses {shown}")
    print(f"{'layout':<26}{'procs':>6}{'loss diff':>13}{'gnorm diff':>13}{'tolerance':>10}  result")
    failures = sum(not check(name, work, common, references) for name in args.names)
    print(f"{len(args.names) - failures}/{len(args.names)} layouts match the 1-process reference over {args.steps} "
          f"steps{' from a fresh start' * args.fresh} ({'all pass' if not failures else f'{failures} FAILED'}); "
          f"runs in {work}")
    from compare_runs import draw, read_run  # tools/compare_runs.py: every run's curves in one picture

    runs = {name: read_run(work / name) for name in [*(f"reference-{p}" for p in references), *args.names]
            if (work / name / "metrics.jsonl").is_file()}
    print(f"curves: {draw(runs, work / 'layouts.png')}")
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
