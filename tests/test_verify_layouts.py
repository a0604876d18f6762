"""tools/verify_layouts.py, the user-facing "same loss on one process and many" check, on a subset, each
layout from its own initialisation (--fresh: the same seed must give the same model): the interleaved
pipeline (where Megatron-Core's batched p2p would corrupt gradients). Gradient accumulation across DP ranks and
the other layouts from a fresh start: tests/test_whole_step.py and the equivalence suite. The full list runs as
a command (docs/parallelism.md)."""

import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def test_verify_layouts_subset_passes(tmp_path):
    proc = subprocess.run([sys.executable, "tools/verify_layouts.py", "--steps", "3", "--layouts", "pp2vpp2",
                           "--fresh", "--work-dir", str(tmp_path)],
                          cwd=ROOT, capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0, proc.stdout + proc.stderr[-3000:]
    rows = {line.split()[0]: line for line in proc.stdout.splitlines()
            if line.split() and line.split()[0] == "pp2vpp2"}
    assert set(rows) == {"pp2vpp2"} and all(row.rstrip().endswith("pass") for row in rows.values())
    summary, curves = proc.stdout.strip().splitlines()[-2:]
    assert summary.startswith("1/1 layouts match the 1-process reference over 3 steps from a fresh start (all pass)")
    assert curves == f"curves: {tmp_path / 'layouts.png'}" and (tmp_path / "layouts.png").stat().st_size > 10_000


def test_verify_layouts_rejects_unknown_layout():
    proc = subprocess.run([sys.executable, "tools/verify_layouts.py", "--layouts", "tp3"], cwd=ROOT,
                          capture_output=True, text=True, timeout=60)
    assert proc.returncode == 2 and "unknown layouts ['tp3']" in proc.stderr
