"""The planner's rows side by side (tools/plan.py): what minimal tensor parallelism (parallel.tp_blocks) saves.

    splits(row)             "all", "mlp", "mlp+vocab" (what tp splits), "-" at tp 1
    than(gb, other)         `1.2 GB (15%) less` / `0.3 GB (4%) more` / `about the same`, never a negative "less"
    minimal_tp_note(rows)   one line: the best-ranked partial-TP row against DP alone and against full TP at
                            the same other settings (pp, vpp, cp, ep, optimizer sharding, recompute)

The founding note's reasoning (docs/parallelism.md): DP first; when a few GB are missing, split only the largest
block (the MLP) over a few GPUs: less memory than DP alone, less TP traffic than splitting everything.
"""

from __future__ import annotations

SAME = ("pp", "vpp", "cp", "ep", "dist_opt", "fsdp", "recompute")  # the settings a comparison holds fixed


def splits(row: dict) -> str:
    """What tp splits: all (Megatron's TP), or the sub-blocks parallel.tp_blocks names (mlp, mlp+vocab)."""
    return "-" if row["tp"] == 1 else "all" if len(row["tp_blocks"]) == 3 else "+".join(row["tp_blocks"])


def _find(rows: list[dict], like: dict, **fixed) -> dict | None:
    return next((r for r in rows if all(r[k] == like[k] for k in SAME) and
                 all(r[k] == v for k, v in fixed.items())), None)


def minimal_tp_note(rows: list[dict]) -> str | None:
    """None when no row splits only some blocks (tp 1 everywhere, or none valid)."""
    index, row = next(((i, r) for i, r in enumerate(rows, 1) if r["tp"] > 1 and splits(r) != "all"), (0, None))
    if row is None:
        return None
    total = row["mem_gb"]["total"]
    out = (f"minimal TP (#{index}: tp {row['tp']} splits {splits(row)} only, pp {row['pp']}, dp {row['dp']}, "
           f"{'dist_opt, ' if row['dist_opt'] else ''}recompute {row['recompute']}): {total:.1f} GB per GPU, "
           f"fits: {'yes' if row['fits'] else 'no'}")
    if (dp := _find(rows, row, tp=1)) is not None:
        out += f"; without TP (dp {dp['dp']}): {dp['mem_gb']['total']:.1f} GB, so {than(total, dp['mem_gb']['total'])}"
    if (full := _find(rows, row, tp=row["tp"], sp=False, tp_blocks=["attention", "mlp", "vocab"])) is not None:
        out += (f"; full TP (tp {full['tp']}): {full['mem_gb']['total']:.1f} GB, so "
                f"{than(total, full['mem_gb']['total'])}, for {row['comm_gb']['tp']:.1f} GB of TP traffic a step "
                f"instead of {full['comm_gb']['tp']:.1f}")
    return out


def than(gb: float, other: float) -> str:
    """`1.2 GB (15%) less` / `0.3 GB (4%) more` / `about the same` (within 0.05 GB): gb against other."""
    if abs(gb - other) < 0.05:
        return "about the same"
    share = f" ({abs(gb - other) / other:.0%})" if other > 0 else ""
    return f"{abs(gb - other):.1f} GB{share} {'less' if gb < other else 'more'}"
