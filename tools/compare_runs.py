"""Runs side by side: each run's metrics.jsonl drawn against iteration (loss, val loss, lr, grad norm, tokens/s,
and any extra loss the runs log), one picture; optionally a check that their losses agree.

    .venv/bin/python tools/compare_runs.py outputs/2026-12-01/10-00-00 outputs/2026-12-01/11-00-00 --out runs.png
    .venv/bin/python tools/compare_runs.py RUN_A RUN_B --labels tp1,tp2 --out cmp.png --assert-close 1e-5

A run is a run directory (or its metrics.jsonl). --assert-close RTOL exits 1 when, at an iteration two runs
both logged, their losses differ by more than RTOL relative to the first run's (and prints the worst), or when
they share no iteration. Exit 0 otherwise, 2 on bad input.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

from training.errors import ConfigError, exit_on_error

PANELS = (("loss", "train loss"), ("val_loss", "validation loss"), ("lr", "learning rate"),
          ("grad_norm", "gradient norm"), ("tokens_per_s", "tokens / s"))
STANDARD = {"iteration", "loss", "val_loss", "lr", "grad_norm", "tokens_per_s", "tflops_per_gpu", "mfu", "mem_gb",
            "step_ms", "consumed_samples", "skipped", "restarts"}


def read_run(path: str) -> list[dict]:
    file = Path(path) / "metrics.jsonl" if Path(path).is_dir() else Path(path)
    if not file.is_file():
        raise ConfigError(f"{path}: no metrics.jsonl (give a run directory or its metrics.jsonl)")
    records = [json.loads(line) for line in file.read_text().splitlines() if line.strip()]
    if not records:
        raise ConfigError(f"{file}: empty")
    return records


def default_labels(paths: list[str]) -> list[str]:
    """Each run's shortest path suffix that no other run ends with: a/run and b/run for two runs named run
    (a metrics.jsonl stands for its directory; the same run twice stays the same label)."""
    parts = []
    for path in paths:
        full = Path(os.path.abspath(path))  # normalises `..` without following links
        parts.append((full.parent if full.name == "metrics.jsonl" else full).parts)
    labels = []
    for i, mine in enumerate(parts):
        others = parts[:i] + parts[i + 1:]
        k = next((k for k in range(1, len(mine)) if all(theirs[-k:] != mine[-k:] for theirs in others)), None)
        labels.append("/".join(mine[-k:]) if k else str(Path(*mine)))
    return labels


def series(records: list[dict], key: str) -> tuple[list[int], list[float]]:
    points = [(r["iteration"], r[key]) for r in records if r.get(key) is not None]
    return [p[0] for p in points], [p[1] for p in points]


def draw(runs: dict[str, list[dict]], out: Path) -> Path:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.ticker import MaxNLocator

    extra = sorted({k for records in runs.values() for r in records for k, v in r.items()
                    if k not in STANDARD and isinstance(v, (int, float))})
    panels = [p for p in PANELS if any(series(r, p[0])[0] for r in runs.values())] + [(k, k) for k in extra]
    columns = min(3, len(panels))
    rows = -(-len(panels) // columns)
    fig, axes = plt.subplots(rows, columns, figsize=(5 * columns, 3.4 * rows), squeeze=False)
    for ax, (key, title) in zip(axes.flat, panels):
        for i, (label, records) in enumerate(runs.items()):  # a run keeps its colour in every panel
            x, y = series(records, key)
            if x:
                ax.plot(x, y, color=f"C{i}", marker="o" if len(x) < 20 else None, markersize=3, label=label)
        ax.set_title(title)
        ax.set_xlabel("iteration")
        ax.xaxis.set_major_locator(MaxNLocator(integer=True))
        ax.grid(alpha=0.3)
        if key in ("lr",):
            ax.ticklabel_format(axis="y", style="sci", scilimits=(-3, 3))
    for ax in list(axes.flat)[len(panels):]:
        ax.axis("off")
    handles = [plt.Line2D([], [], color=f"C{i}", label=label) for i, label in enumerate(runs)]
    axes.flat[0].legend(handles=handles, fontsize=8)
    fig.tight_layout()
    out.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out, dpi=90)
    plt.close(fig)
    return out


def worst_difference(runs: dict[str, list[dict]]) -> tuple[float, str]:
    """The largest relative loss difference from the first run at an iteration both logged."""
    (first, base), *others = runs.items()
    reference = dict(zip(*series(base, "loss")))
    worst, where = 0.0, ""
    for label, records in others:
        shared = [(i, loss) for i, loss in zip(*series(records, "loss")) if i in reference]
        if not shared:
            return float("inf"), f"{label} and {first} share no logged iteration"
        for i, loss in shared:
            diff = abs(loss - reference[i]) / abs(reference[i])
            if diff > worst:
                worst, where = diff, f"{label} vs {first} at iteration {i}: {loss:.6f} vs {reference[i]:.6f}"
    return worst, where


def run(argv: list[str]) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("runs", nargs="+", help="run directories (or metrics.jsonl files)")
    ap.add_argument("--out", default="runs.png", help="the picture (PNG)")
    ap.add_argument("--labels", help="names for the runs, comma- (or, if a name has a comma, semicolon-) "
                                     "separated (default: their directories' shortest distinct endings)")
    ap.add_argument("--assert-close", type=float, metavar="RTOL", help="exit 1 if losses differ by more than RTOL")
    args = ap.parse_args(argv)
    if args.labels:
        labels = args.labels.split(";" if ";" in args.labels else ",")
    else:
        labels = default_labels(args.runs)
        if len(set(labels)) != len(labels):
            raise ConfigError(f"a run given twice ({labels}): name them apart with --labels, e.g. --labels a,b")
    if len(labels) != len(args.runs) or len(set(labels)) != len(labels):
        raise ConfigError(f"--labels: {len(args.runs)} distinct names needed, got {labels}")
    runs = {label: read_run(path) for label, path in zip(labels, args.runs)}
    print(f"wrote {draw(runs, Path(args.out))} ({len(runs)} runs)")
    if args.assert_close is not None and len(runs) > 1:
        worst, where = worst_difference(runs)
        ok = worst <= args.assert_close
        print(f"max relative loss difference {worst:.3e} (tolerance {args.assert_close:g}): "
              f"{'ok' if ok else 'FAILED'}{'; ' + where if where and not ok else ''}")
        return 0 if ok else 1
    return 0


def main(argv: list[str]) -> int:
    return exit_on_error(run, argv)


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
