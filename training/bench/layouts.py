"""`tools/bench.py --layouts tp1,tp2,dp2,pp2,...`: the same model and global batch at several layouts, one row
each: step time, tokens/s, this rank's memory (parameters + gradients + optimizer state, measured by tensor
accounting; activations saved for backward by the largest micro-batch) and the share of the step spent in
collectives (torch.profiler). Each layout runs as its own `tools/bench.py --json --detail` (its processes
spawned there), one after the other, so that rows do not compete for the cores.

A layout name (training/parallel/layout.py's scheme, as verify_layouts') is a run of parts: tp<N>, pp<N>, dp<N>,
cp<N>, ep<N>, etp<N>, vpp<N>, sp, distopt, zero2, zero3
(parallel.fsdp=optim_grads / optim_grads_params), and after tp the sub-blocks it splits, mlp, attn, vocab
(parallel.tp_blocks: tp2mlp splits only the MLP, attention and the vocabulary whole on both ranks; minimal TP,
docs/parallelism.md); tp1 (or "single") is one process. Processes = tp x pp x cp x dp.

    run_layouts(args)    tools/bench.py --layouts: check every name, then one row each (printed as it comes)
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

from training.errors import ConfigError
from training.parallel.layout import Layout

ROOT = Path(__file__).resolve().parents[2]


def parse(name: str) -> tuple[int, list[str]]:
    """(processes, Hydra overrides) of a layout name (training/parallel/layout.py's scheme)."""
    layout = Layout.from_name(name)
    return layout.world, layout.overrides()


def run_row(name: str, user_overrides: list[str], flags: list[str]) -> dict:
    """One layout's bench result (rank 0's JSON), or {"error": the tool's last line}."""
    nproc, overrides = parse(name)
    cmd = [sys.executable, str(ROOT / "tools" / "bench.py"), "--json", "--detail", "--nproc", str(nproc), *flags,
           *user_overrides, *overrides]
    proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True)
    lines = proc.stdout.strip().splitlines()
    if proc.returncode != 0 or not lines:
        last = (proc.stderr.strip().splitlines() or proc.stdout.strip().splitlines() or ["no output"])[-1]
        return {"layout": name, "nproc": nproc, "error": f"exit {proc.returncode}: {last}"}
    return {"layout": name, "nproc": nproc, **json.loads(lines[-1])}


def table(rows: list[dict]) -> str:
    head = (f"{'layout':<16}{'procs':>6}{'step ms':>10}{'tok/s':>10}{'state MB/rank':>15}{'act MB/mb':>11}"
            f"{'comm':>7}  config")
    lines = [head, "-" * len(head)]
    for r in rows:
        if "error" in r:
            lines.append(f"{r['layout']:<16}{r['nproc']:>6}  {r['error'][:150]}")
            continue
        lines.append(f"{r['layout']:<16}{r['nproc']:>6}{1e3 * r['ours_s']:>10.1f}{r['tokens_per_s']:>10,.0f}"
                     f"{r['state_bytes'] / 1e6:>15.2f}{r['activation_bytes'] / 1e6:>11.2f}"
                     f"{r['comm_share']:>7.1%}  {r['config']}")
    return "\n".join(lines)


def run_layouts(args) -> int:
    """tools/bench.py --layouts: every name checked first (a bad one is one error line, exit 2), then the rows
    one after the other, each printed when done (the whole list as JSON at the end with --json). 1 when a
    layout failed."""
    names = [n for n in args.layouts.split(",") if n]
    try:
        for name in names:
            parse(name)
    except ConfigError as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    flags = [f"--warmup={args.warmup}", f"--steps={args.steps}", f"--windows={args.windows}"]
    flags += [f"--threads={args.threads}"] if args.threads else []
    rows = []
    for name in names:
        rows.append(run_row(name, args.overrides, flags))
        if not args.json:
            print(table(rows).splitlines()[-1] if len(rows) > 1 else table(rows), flush=True)
    if args.json:
        print(json.dumps(rows))
    return 0 if all("error" not in r for r in rows) else 1
