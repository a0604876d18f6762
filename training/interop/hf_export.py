"""tools/convert_hf.py export (and the helpers import shares): a template checkpoint -> a Hugging Face
directory, streamed one parameter at a time from a torch_dist checkpoint (training/interop/ckpt_reader.py) into
safetensors shards of --max-shard-gb (training/interop/hf.py write_safetensors), config.json written last; a
LoRA run's adapters (--adapter) or merged model (--merge), and an FSDP checkpoint, through the loaded model.
"""

from __future__ import annotations

import contextlib
import json
import shutil
import time
from pathlib import Path

from training.errors import TemplateError

# What transformers' save_pretrained writes for a tokenizer (and its chat templates), and generation defaults
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "added_tokens.json",
                   "tokenizer.model", "vocab.json", "merges.txt", "chat_template.jinja", "chat_template.json",
                   "additional_chat_templates", "generation_config.json")

def empty_dir(path: Path, what: str) -> Path:
    if path.exists() and any(path.iterdir()):
        raise TemplateError(f"{what} {path} is not empty: choose a new directory (nothing is overwritten)")
    path.mkdir(parents=True, exist_ok=True)
    return path


def check(state, vocab_size: int, seq_length: int, hf_dir: Path, precision: str, tolerance: float | None,
          reference=None) -> bool:
    """A loaded model's logits vs transformers' (or reference(tokens)'s) on the same tokens (LoRA exports; a
    plain import / export checks streamed: training/interop/hf_check.py)."""
    from training.interop import hf, hf_check
    from training.parallel.dist import current_device

    tokens = hf.check_tokens(vocab_size, seq_length)
    ours = hf.full_logits(state, tokens.to(current_device()), vocab_size).cpu()
    reference = reference(tokens) if reference else hf.reference_logits(hf_dir, tokens)
    return hf_check.report(ours, reference, precision, tolerance)


@contextlib.contextmanager
def removed_on_failure(out: Path):
    """An --out directory this command created is removed when it fails or is interrupted: nothing
    half-written is left looking complete (and the same command can run again)."""
    try:
        yield
    except BaseException:
        shutil.rmtree(out, ignore_errors=True)
        raise


def tokenizer_source(given: str | None, run_tokenizer: str) -> Path | None:
    """Where export copies the tokenizer from: --tokenizer-dir, else the run's data.tokenizer if a directory."""
    if given:
        if not Path(given).is_dir():
            raise TemplateError(f"--tokenizer-dir {given} is not a directory (give the tokenizer's directory, e.g. "
                                f"the Hugging Face model the run was imported from)")
        return Path(given)
    return Path(run_tokenizer) if run_tokenizer != "byte" and Path(run_tokenizer).is_dir() else None


def copy_file(source: Path, target: Path) -> bool:
    """A tokenizer file or folder (additional_chat_templates/) into the export; False when there is none."""
    if source.is_dir():
        shutil.copytree(source, target)
    elif source.is_file():
        shutil.copy(source, target)
    return source.exists()


def export_adapter(args, state, cfg, path: Path, out: Path) -> bool:
    """export --adapter: the LoRA adapters as a PEFT adapter (training/interop/peft_export.py); --check: ours vs
    peft.PeftModel on the Hugging Face base (--base-hf-dir)."""
    from training.interop import peft_export

    base = args.base_hf_dir or (cfg.data.tokenizer if (Path(cfg.data.tokenizer) / "config.json").is_file() else None)
    size = peft_export.write_adapter(state, cfg.peft, out, str(Path(base).resolve()) if base else None)
    print(f"exported the LoRA adapters of {path} to {out} ({peft_export.ADAPTER_CONFIG}, "
          f"{peft_export.ADAPTER_WEIGHTS}: {size / 2**20:.2f} MiB)", flush=True)
    if not args.check:
        return True
    if base is None:
        raise TemplateError("export --adapter --check needs --base-hf-dir: the Hugging Face base model the "
                            "adapters apply to (the directory the base checkpoint was imported from)")
    return check(state, state.shape.vocab_size, cfg.model.seq_length, Path(base), cfg.train.precision,
                 args.tolerance, lambda tokens: peft_export.peft_logits(base, out, tokens))


def do_export(args) -> bool:
    from models.shape import ModelShape
    from training import checkpoint
    from training.config.schema import ParallelConfig, to_config
    from training.engine.build import build
    from training.interop import ckpt_reader, hf, hf_check, hf_config
    from training.interop.progress import Progress, files_summary
    from training.parallel import dist as D

    path = checkpoint.resolve_path(args.ckpt)
    run = checkpoint.read_run(path)
    cfg = to_config(run["config"])
    cfg.parallel = ParallelConfig(timeout_minutes=cfg.parallel.timeout_minutes)  # tp1 pp1: load reshards
    cfg.checkpoint.dir, cfg.checkpoint.load, cfg.checkpoint.finetune = None, str(path), True  # weights only
    shape = ModelShape.of(cfg.model, run["vocab_size"])
    if (lora := str(cfg.peft.method) != "none") != bool(args.adapter or args.merge):
        raise TemplateError(f"checkpoint {path} holds LoRA adapters: export them with --adapter (a PEFT adapter for "
                            f"the base) or --merge (the merged model)" if lora else f"--adapter / --merge: checkpoint "
                            f"{path} has no LoRA adapters (peft.method=none): export it without them")
    config = hf_config.hf_config(shape, cfg.model, cfg.train.precision)
    tokenizer_dir = tokenizer_source(args.tokenizer_dir, cfg.data.tokenizer)
    source = tokenizer_dir / "config.json" if tokenizer_dir else None
    if source is not None and source.is_file():  # the tokenizer's special token ids
        for key, value in json.loads(source.read_text()).items():
            if key in ("bos_token_id", "eos_token_id", "pad_token_id"):
                setattr(config, key, value)
    out = empty_dir(Path(args.out), "--out")
    start = time.perf_counter()
    # streamed (one parameter at a time) from a torch_dist checkpoint; a LoRA run or an FSDP checkpoint: loaded whole
    streamed = not lora and not checkpoint.fmt(cfg, path).__name__.endswith("fsdp_dtensor")
    with D.distributed(tp=1, pp=1, seed=cfg.train.seed, timeout_minutes=cfg.parallel.timeout_minutes) as info:
        with removed_on_failure(out):
            state, restore = None, None
            if streamed:
                progress = Progress("export", ckpt_reader.param_bytes(cfg, shape))
                size = hf.write_safetensors(ckpt_reader.hf_tensors(cfg, shape, path), out,
                                            int(args.max_shard_gb * 2**30), progress)
                progress.close()
            else:
                state = build(cfg, shape, info.device, init=False, train=False)
                checkpoint.maybe_load(cfg, state)  # an adapters-only checkpoint: its base first
                if args.adapter:
                    return export_adapter(args, state, cfg, path, out)
                from training.interop.peft_export import merge
                restore = merge(state) if args.merge else None  # W + (alpha / r) B A; the check: the unmerged
                size = hf.write_safetensors(hf.hf_tensors(state), out, int(args.max_shard_gb * 2**30))
            copied = [name for name in TOKENIZER_FILES if tokenizer_dir and copy_file(tokenizer_dir / name, out / name)]
            config.save_pretrained(str(out))  # last: a directory with config.json has all its weights
            restore and restore()
        print(f"exported {path} (saved at tp/pp {run['layout']['tp']}/{run['layout']['pp']}, iteration "
              f"{run['iteration']}) to {out}: {size / 2**20:.1f} MiB of {cfg.train.precision} weights in "
              f"{time.perf_counter() - start:.1f} s ({files_summary(out)})"
              + (f"; tokenizer files from {tokenizer_dir}: {', '.join(copied)}" if copied else ""), flush=True)
        if not args.check:
            return True
        if streamed:
            return hf_check.check_checkpoint(cfg, shape, path, out, args.tolerance)
        return check(state, run["vocab_size"], cfg.model.seq_length, out, cfg.train.precision, args.tolerance)
