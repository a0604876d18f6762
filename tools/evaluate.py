"""The token-mean loss and perplexity of a checkpoint: on its run's validation batches (the ones its training
evaluated), on a text file, or on a preprocessed dataset, at any layout; or lm-evaluation-harness tasks (--tasks).

    .venv/bin/python tools/evaluate.py --ckpt outputs/<run>/checkpoints     # the run's own validation batches
    .venv/bin/python tools/evaluate.py --ckpt DIR --text notes.txt --json  # a text file (one document a line)
    .venv/bin/python tools/evaluate.py --ckpt DIR --data data/corpus --batches 20     # a dataset's validation split
    .venv/bin/python tools/evaluate.py --ckpt DIR --nproc 2 parallel.tp=2    # at another layout (it reshards)
    .venv/bin/python tools/evaluate.py --ckpt DPO_DIR --pairs data/pairs     # preference accuracy vs the reference
    .venv/bin/python tools/evaluate.py --ckpt DIR --tasks arc_easy,hellaswag --nproc 2 parallel.tp=2  # lm-eval tasks
    .venv/bin/python tools/evaluate.py --ckpt DIR --tasks my_task --include-path my_tasks/ --output results.json \
        --log-samples

The model, tokenizer, sequence length and batch sizes are the run's (run.json); the other arguments are
overrides (the layout, train.micro_batch_size, ...). Default: train.eval_iters global batches of the validation
split, built as the run built them, so the loss equals the run's logged val loss for that checkpoint. --text:
each non-empty line a document followed by end-of-document, all of them cut into windows of
model.seq_length + 1 tokens; every token is predicted once (the last window's tail is masked).
--tasks (the `lmeval` extra: pip install -e '.[lmeval]'): lm-eval's own task definitions, or your task YAMLs
(--include-path), scored by training/interop/lm_eval_adapter.py at max length model.seq_length on one model
replica (processes = tp x pp); prints lm-eval's table (--json: one line), --output writes lm-eval's results.
--pairs (a `--format preference` dataset): every pair of its validation split once (data.split=0,100,0: the whole
file), scored by the checkpoint and a reference (--reference, else the one its DPO run used): TRL's
rewards/accuracies (how often the chosen answer gains more over the reference than the rejected one), margins,
chosen / rejected rewards and log-probs, and the objective's loss (training/post/evaluate.py).
"""

from __future__ import annotations

import argparse
import json
import math
import os
import sys
from pathlib import Path

from training.errors import ConfigError, exit_on_error
from training.parallel.launch_local import run_local
from training.shims.noise import quiet_known_noise


def parse_args(argv):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("overrides", nargs="*", help="overrides: parallel.tp=2, train.micro_batch_size=8, ...")
    ap.add_argument("--ckpt", required=True, help="a checkpoint directory (with `latest`) or an iter_* directory")
    source = ap.add_mutually_exclusive_group()
    source.add_argument("--text", help="a text file: one document per non-empty line, each followed by the "
                        "end-of-document token (counted and predicted, as in training): every token once")
    source.add_argument("--data", help="a preprocessed dataset prefix (.bin/.idx): its validation split")
    source.add_argument("--tasks", help="lm-evaluation-harness tasks, comma-separated (lm-eval ls tasks)")
    source.add_argument("--pairs", help="a preference dataset prefix (--format preference): preference accuracy of "
                        "its validation split against --reference")
    ap.add_argument("--reference", help="--pairs: the reference checkpoint (default: the one the run trained against)")
    lm = ap.add_argument_group("lm-evaluation-harness (--tasks)")
    lm.add_argument("--include-path", action="append", default=[], help="a directory of your task YAMLs (repeat)")
    lm.add_argument("--num-fewshot", type=int, help="few-shot examples per prompt (default: each task's own)")
    lm.add_argument("--limit", type=float, help="examples per task (a fraction if < 1); for quick checks")
    lm.add_argument("--batch-size", type=int, default=8, help="requests per forward")
    lm.add_argument("--max-gen-toks", type=int, default=256, help="new tokens per generation unless the task says")
    lm.add_argument("--bootstrap-iters", type=int, default=100000, help="resamples for the stderr (0: none)")
    lm.add_argument("--seed", type=int, default=0, help="lm-eval's seeds and the sampling generator's")
    lm.add_argument("--output", help="write lm-eval's results (JSON) here")
    lm.add_argument("--log-samples", action="store_true", help="--output includes every request and response")
    ap.add_argument("--batches", type=int, help="global batches of the validation split (default: train.eval_iters)")
    ap.add_argument("--json", action="store_true", help="one JSON object instead of text")
    ap.add_argument("--nproc", type=int, default=1, help="processes to spawn (ignored under torchrun)")
    return ap.parse_args(argv)


def text_windows(path: str, tokenizer, seq_length: int) -> list[dict]:
    """Samples (tokens, labels, loss_mask) covering every token of the file once."""
    import torch

    ids: list[int] = []
    for line in Path(path).read_text().splitlines():
        if line.strip():
            ids += tokenizer.encode(line) + [tokenizer.eod]
    if len(ids) < 2:
        raise ConfigError(f"{path}: no text to evaluate (no non-empty line)")
    samples = []
    for start in range(0, len(ids) - 1, seq_length):
        window = ids[start:start + seq_length + 1]
        real = len(window) - 1
        window = window + [tokenizer.eod] * (seq_length + 1 - len(window))
        mask = torch.zeros(seq_length)
        mask[:real] = 1.0
        text = torch.tensor(window)
        samples.append({"tokens": text[:-1], "labels": text[1:], "loss_mask": mask})
    return samples


def check_tasks(args) -> None:
    """--tasks's mistakes, before any process starts."""
    import importlib.util

    if importlib.util.find_spec("lm_eval") is None:
        raise ConfigError("--tasks needs lm-evaluation-harness, not installed: pip install -e '.[lmeval]'")
    if missing := [d for d in args.include_path if not Path(d).is_dir()]:
        raise ConfigError(f"--include-path {missing[0]}: no such directory (give a directory of task YAMLs)")
    if args.batch_size < 1 or args.max_gen_toks < 1:
        raise ConfigError(f"--batch-size={args.batch_size} and --max-gen-toks={args.max_gen_toks} must be >= 1")
    if args.limit is not None:
        args.limit = int(args.limit) if args.limit >= 1 else args.limit


def run(args) -> None:
    quiet_known_noise()  # before Megatron-Core's imports warn, in every process
    if args.tasks:
        from training.interop.lm_eval_adapter import run_tasks

        return run_tasks(args)
    import torch
    from megatron.core import parallel_state as ps

    from training import checkpoint
    from training.config.validate import validate
    from training.data.build import build_datasets
    from training.data.streams import micro_batch_streams, reads_data
    from training.data.tokenizer import build_tokenizer
    from training.engine.losses import global_loss_sum
    from training.engine.step import run_schedule
    from training.interop.generation import load_model
    from training.parallel import dist as D

    cfg, shape, path = eval_config(args, int(os.environ.get("WORLD_SIZE", "1")))
    run_json = checkpoint.read_run(path)
    layout = validate(cfg)
    tokenizer = build_tokenizer(cfg.data.tokenizer)
    with D.distributed(**D.layout_of(cfg)) as info:
        state = load_model(cfg, shape, info.device)
        if args.pairs:
            return print_pairs(args, cfg, state, layout, tokenizer, info.device, path)
        chunks, micro, g = len(state.model), cfg.train.micro_batch_size, cfg.train.global_batch_size
        packed = str(cfg.data.format) in ("sft", "preference") and not args.text  # conversations: every stage reads its batches
        if args.text:
            samples = text_windows(args.text, tokenizer, cfg.model.seq_length)
            blank = {k: torch.zeros_like(v) for k, v in samples[0].items()}
            samples += [blank] * (-len(samples) % g)  # the last global batch filled with masked samples
            batches, start = len(samples) // g, lambda k: k * g
        else:
            batches = args.batches or cfg.train.eval_iters
            t = cfg.train
            evals = t.iters // t.eval_interval + 1 if t.eval_interval else 1  # sized as the run built it
            sizes = (run_json.get("train_samples") or t.iters * g, max(evals * t.eval_iters, batches) * g)
            _, samples = build_datasets(cfg, tokenizer, sizes, reads_data(chunks, packed))
            start = lambda k: k * g  # noqa: E731
        total = torch.zeros(2, dtype=torch.float64, device=info.device)
        with torch.no_grad():
            for k in range(batches):
                streams = micro_batch_streams(chunks, samples, start(k), micro, packed)
                total += global_loss_sum(run_schedule(state, streams, layout, cfg, forward_only=True), info.device)
        loss = (total[0] / total[1]).item()
        if os.environ.get("RANK", "0") == "0":
            layout = (f"tp {ps.get_tensor_model_parallel_world_size()} pp "
                      f"{ps.get_pipeline_model_parallel_world_size()} cp {layout.cp} dp {layout.dp}")
            result = {"loss": loss, "ppl": math.exp(min(loss, 30)), "tokens": int(total[1].item()),
                      "batches": batches, "source": args.text or args.data or "validation split",
                      "checkpoint": str(path), "layout": layout}
            print(json.dumps(result) if args.json else
                  f"loss {loss:.6f} | ppl {result['ppl']:.3f} | {result['tokens']:,} tokens in {batches} global "
                  f"batches of {result['source']} | {result['layout']} | {path}", flush=True)


def print_pairs(args, cfg, state, layout, tokenizer, device, path) -> None:
    from training.post.evaluate import evaluate_pairs

    values = evaluate_pairs(cfg, state, layout, tokenizer, device)
    if os.environ.get("RANK", "0") == "0":
        values.update(checkpoint=str(path), source=args.pairs)
        print(json.dumps(values) if args.json else
              f"preference accuracy {values['rewards/accuracies']:.4f} | margins {values['rewards/margins']:.4f} | "
              f"loss {values['loss']:.4f} ({values['objective']}, beta {values['beta']}) | {values['pairs']} pairs "
              f"of {args.pairs} | reference {values['reference']} | {path}", flush=True)


def eval_config(args, world: int):
    """(config, shape, checkpoint path) of the evaluation on `world` processes: the checkpoint's run at the
    overrides' layout, reading --data's dataset, or --text one micro-batch per DP rank a step (its windows in order)."""
    from training.interop.generation import inference_config

    cfg, shape, path = inference_config(args.ckpt, args.overrides, for_generation=False)
    if args.pairs:
        from training import checkpoint
        from training.post.evaluate import pairs_config

        cfg = pairs_config(cfg, checkpoint.read_run(path), args.pairs, args.reference)
    if args.data:
        cfg.data.paths, cfg.data.weights = [args.data], None
    if args.text:
        dp = max(world // (cfg.parallel.tp * cfg.parallel.pp * cfg.parallel.cp), 1)
        cfg.train.global_batch_size = cfg.train.micro_batch_size * dp
    return cfg, shape, path


def check_layout(args) -> None:
    """Spawned here (not under torchrun): the layout against --nproc before any process starts."""
    quiet_known_noise()  # before Megatron-Core's imports warn
    from training.config.validate import validate

    validate(eval_config(args, args.nproc)[0], args.nproc)


def main(argv=None) -> int:
    args = parse_args(argv)
    if args.tasks and (code := exit_on_error(check_tasks, args)):
        return code
    if not args.tasks and "WORLD_SIZE" not in os.environ and (code := exit_on_error(check_layout, args)):
        return code
    return run_local(run, args, args.nproc)


if __name__ == "__main__":  # the guard matters: spawned workers re-import this file
    sys.exit(main(sys.argv[1:]))
