"""`tools/bench.py --layouts tp1,tp2,dp2,pp2,...`: the same model and global batch at several layouts, one row
each: step time, tokens/s, this rank's memory (parameters + gradients + optimizer state, measured by tensor
accounting; activations saved for backward by the largest micro-batch) and the share of the step spent in
collectives (torch.profiler). Each layout runs as its own `tools/bench.py --json --detail` (its processes
spawned there), one after the other, so that rows do not compete for the cores.

A layout name is a run of parts: tp<N>, pp<N>, dp<N>, cp<N>, ep<N>, vpp<N>, sp, distopt, zero2, zero3
(parallel.fsdp=optim_grads / optim_grads_params); tp1 (or "single") is one process. Processes = tp x pp x cp x dp.
"""

from __future__ import annotations

import json
import re
import subprocess
import sys
from pathlib import Path

from training.errors import ConfigError

PART = re.compile(r"(tp|pp|dp|cp|ep|vpp)(\d+)|sp|distopt|zero2|zero3")
FLAGS = {"sp": ["parallel.sp=true"], "distopt": ["parallel.dist_opt=true"],
         "zero2": ["parallel.fsdp=optim_grads"], "zero3": ["parallel.fsdp=optim_grads_params"]}
ROOT = Path(__file__).resolve().parents[2]


def parse(name: str) -> tuple[int, list[str]]:
    """(processes, Hydra overrides) of a layout name."""
    if name == "single":
        return 1, []
    sizes, overrides, pos = {"tp": 1, "pp": 1, "dp": 1, "cp": 1}, [], 0
    while pos < len(name):
        match = PART.match(name, pos)
        if match is None:
            raise ConfigError(f"layout {name!r}: cannot read {name[pos:]!r}; a layout is parts like tp2, pp2, dp2, "
                              f"cp2, ep2, vpp2, sp, distopt, zero2, zero3 (e.g. tp2dp2distopt)")
        if match.group(1):
            kind, size = match.group(1), int(match.group(2))
            if kind in sizes:
                sizes[kind] = size
            if kind != "dp":
                overrides.append(f"parallel.{kind}={size}")
        else:
            overrides += FLAGS[match.group(0)]
        pos = match.end()
    return sizes["tp"] * sizes["pp"] * sizes["cp"] * sizes["dp"], overrides


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
