"""tools/bench.py --preference: a DPO step against the token (SFT) step on the same packed pair sequences, with the
reference's log-probs stored (one model, no reference pass) and live (a frozen second model scored each step).

    result = preference(b)    # training/bench/runner.py's Bench: our model, the config, the layout

The sequences: random byte-token pairs (prompt seq/16, answers seq/8 each: two or three pairs a sequence) written to a
temporary preference dataset and read through training/post/pairs.py, as training reads them. The three steps
rotate window by window (rotated_windows: A B C, B C A, ...); each is a real optimizer step through
training/engine/step.py's train_step: the token loss on both answers' tokens (`sft`), the DPO loss with
`ref_logps` in the batch (`dpo_stored`), and the reference's forward-only pass first (`dpo_live`). The weights
change between the steps; only time is measured. Memory: the live reference's bytes (the estimate's term) and,
on a GPU, the peak allocated by each kind.
"""

from __future__ import annotations

import copy
import tempfile
import time
from pathlib import Path

import numpy as np


def synthetic_pairs(cfg, root: Path):
    """A packed-pairs dataset of 4 global batches of random pairs; every pair fits one sequence twice over."""
    from training.data.sft_write import write_sft
    from training.data.tokenizer import build_tokenizer
    from training.post import pairs

    byte = build_tokenizer("byte")

    class ByteChat:
        name, vocab_size, eod, template_hash = byte.name, byte.vocab_size, byte.eod, "none"

    s, rng, conversations = cfg.model.seq_length, np.random.default_rng(0), []
    prompt, answer = max(s // 16, 1), max(s // 8, 1)
    for _ in range(8 * cfg.train.global_batch_size):
        shared = rng.integers(32, 127, prompt)
        for _side in range(2):
            conversations.append((np.r_[shared, rng.integers(32, 127, answer)].astype(np.uint16),
                                  np.r_[np.zeros(prompt, np.uint8), np.ones(answer, np.uint8)]))
    write_sft(root / "pairs", conversations, ByteChat(), "preference")
    run = copy.deepcopy(cfg)
    run.data.format, run.data.paths, run.data.split, run.data.tokenizer = \
        type(cfg.data.format)("preference"), [str(root / "pairs")], "100,0,0", "byte"
    train, _ = pairs.build(run, byte, (4 * cfg.train.global_batch_size, 0), True)
    return run, train


def preference(b) -> dict:
    import torch

    from training.bench import benchmark as bm
    from training.config.schema_post import PostConfig
    from training.data.streams import micro_batch_streams
    from training.engine.build import build
    from training.engine.loop import TokenLoss
    from training.estimate.memory import estimate
    from training.post.reference import Reference
    from training.post.step import PreferenceObjective

    args, device, layout = b.args, b.device, b.layout
    with tempfile.TemporaryDirectory() as tmp:
        cfg, data = synthetic_pairs(b.cfg, Path(tmp))
        rows = [data[i] for i in range(cfg.train.global_batch_size)]  # one global batch, read before the files go
    cfg.post = PostConfig(objective=type(PostConfig.objective)("sigmoid"), reference=type(PostConfig.reference)("stored"))
    ref_state = build(cfg, b.shape, device, train=False)  # random weights: time only
    for chunk in ref_state.model:
        chunk.requires_grad_(False)
    stored, live = PreferenceObjective(cfg, b.ours), PreferenceObjective(cfg, b.ours)
    live.reference = Reference(ref_state.model, ref_state.config, cfg, base=False)
    chunks, micro = len(b.ours.model), cfg.train.micro_batch_size
    streams = lambda: micro_batch_streams(chunks, [dict(r) for r in rows], 0, micro, every_stage=True)  # noqa: E731

    def timer(objective):
        def run(n: int) -> list[float]:
            times = []
            for _ in range(n):
                bm.sync(device)
                start = time.perf_counter()
                objective.train_step(b.ours, streams(), layout, cfg, device)
                bm.sync(device)
                times.append(time.perf_counter() - start)
            return times
        return run

    timers = {"sft": timer(TokenLoss()), "dpo_stored": timer(stored), "dpo_live": timer(live)}
    peaks = {}
    for name, run in timers.items():
        if device.type == "cuda":
            torch.cuda.reset_peak_memory_stats(device)
        run(args.warmup)
        peaks[name] = torch.cuda.max_memory_allocated(device) / 1e9 if device.type == "cuda" else None
    out = bm.rotated_windows(timers["sft"], {k: v for k, v in timers.items() if k != "sft"}, args.windows,
                             args.steps)
    cfg.post.reference = type(cfg.post.reference)("live")
    reference_gb = estimate(cfg, b.shape, layout).reference / 1e9
    built_gb = sum(p.numel() * p.element_size() for c in ref_state.model for p in c.parameters()) / 1e9
    return {"sft_s": out["ours_s"], "dpo_stored_s": out["dpo_stored_s"], "dpo_live_s": out["dpo_live_s"],
            "dpo_stored_over_sft": 1 / out["ratio_dpo_stored"], "dpo_live_over_sft": 1 / out["ratio_dpo_live"],
            "pairs_per_step": sum(int((r["pair_index"] >= 0).sum()) for r in rows),
            "reference_gb_built": built_gb, "reference_gb_estimate": reference_gb, "peak_gb": peaks,
            "window_ratios_live": out["window_ratios_dpo_live"]}
