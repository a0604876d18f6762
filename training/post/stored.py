"""post.reference=stored: the reference's log-probs of every pair, scored once at the training layout and kept
beside the dataset, so that training holds one model (Megatron-Bridge's offline scoring; NeMo-RL #2484).

    tables = load_or_score(cfg, state, layout, {"train": train_ds, "valid": valid_ds})   # every rank, at setup

The file (`post.reference_logps`, or PREFIX.ref-<digest>.npz beside the first of data.paths) holds, per split, a
[pairs, 2] float64 table (chosen, rejected; NaN for a pair left out) and what it was scored from: each dataset's
PREFIX.json and index size, data.split, model.seq_length, the reference checkpoint and its run.json. A file that was
scored from anything else is refused in one line; a missing one is scored (the reference built at this layout,
Megatron-Core's schedule forward-only over one epoch of the split's packed pairs, every DP rank its share), written
by rank 0, and the reference freed before training starts.
"""

from __future__ import annotations

import hashlib
import json
import os
from pathlib import Path

import numpy as np
import torch
import torch.distributed as dist
from megatron.core import parallel_state as ps

from training.config.schema import Config
from training.errors import ConfigError
from training.parallel import dist as D
from training.post.reference import Reference, live_model, peek


def fingerprint(cfg: Config) -> dict:
    from training.checkpoint import resolve_path

    reference = resolve_path(cfg.post.reference_load or cfg.checkpoint.load)
    digest = lambda path: hashlib.sha256(Path(path).read_bytes()).hexdigest()[:16]  # noqa: E731
    return {"data": [[str(p), digest(f"{p}.json"), os.path.getsize(f"{p}.idx")] for p in cfg.data.paths],
            "split": cfg.data.split, "seq_length": cfg.model.seq_length, "reference": str(reference),
            "reference_run": digest(reference / "run.json")}


def table_path(cfg: Config, meta: dict) -> Path:
    if cfg.post.reference_logps:
        return Path(cfg.post.reference_logps)
    key = hashlib.sha256(json.dumps(meta, sort_keys=True).encode()).hexdigest()[:12]
    return Path(f"{cfg.data.paths[0]}.ref-{key}.npz")


def load_or_score(cfg: Config, state, layout, datasets: dict) -> dict[str, np.ndarray]:
    """{split: [pairs, 2]} for every split the run reads (None: not read), from the file; a split the file lacks
    (a run that evaluated nothing wrote no valid table) is scored now and the file rewritten with it."""
    meta = fingerprint(cfg)
    path, tables = table_path(cfg, meta), {}
    if path.exists():
        with np.load(path) as saved:
            written = json.loads(str(saved["meta"]))
            if written != meta:
                diff = ", ".join(f"{k}: {written.get(k)} vs {meta[k]}" for k in meta if written.get(k) != meta[k])
                raise ConfigError(f"post.reference_logps={path} was scored from other data or another reference ({diff}):"
                                  f" remove it (it is scored again) or give another path")
            tables = {name: saved[name] for name in saved.files if name != "meta"}
    missing = [name for name, data in datasets.items() if data is not None and name not in tables]
    if not missing:
        D.print0(f"reference log-probs: {path} (scored from {meta['reference']})")
        return tables
    reference = Reference(*live_model(cfg, state), cfg, base=False)
    tables |= {name: score(reference, datasets[name], layout, cfg) for name in missing}
    if D.is_rank0():
        tmp = path.with_name(path.name + ".tmp.npz")
        np.savez(tmp, meta=json.dumps(meta), **tables)
        os.replace(tmp, path)
    dist.barrier()
    scored = sum(int(np.isfinite(tables[name][:, 0]).sum()) for name in missing)
    D.print0(f"reference log-probs: scored {scored} pairs ({', '.join(missing)}) with {meta['reference']}, written "
             f"to {path}; the reference is freed (post.reference=stored)")
    del reference
    return tables


def score(reference, data, layout, cfg: Config) -> np.ndarray:
    """[pairs, 2] of `data`'s split: one epoch of its pairs packed, scored by this layout's DP ranks together."""
    from training.data.streams import micro_batch_streams
    from training.post.pairs import one_epoch

    micro, count = cfg.train.micro_batch_size, layout.num_microbatches
    per_call = micro * layout.dp * count
    epoch, rows = one_epoch(data, per_call)  # every kept pair once
    table = torch.zeros(len(data.lengths), 2, dtype=torch.float64)
    streams = micro_batch_streams(len(reference.chunks), rows, 0, micro, every_stage=True)
    reports = ps.is_pipeline_last_stage(ignore_virtual=True) and ps.get_tensor_model_parallel_rank() == 0
    for _ in range(len(rows) // per_call):
        batches, iterators = peek(streams, count)
        reference.score(iterators, count)
        for batch in batches[-1] if reports else []:  # the last chunk's: the last stage's batches
            mask = batch["pair_index"] >= 0
            table[batch["pair_index"][mask]] = batch["ref_logps"][mask].double()
        for stream in (streams if isinstance(streams, list) else [streams]):
            for _ in range(count):
                if stream is not None:
                    next(stream)
    dist.all_reduce(table)  # each pair scored on one DP rank, reported by one rank of its model replica
    out = table.numpy()
    out[~np.isin(np.arange(len(out)), epoch.kept)] = np.nan
    return out
