"""Hugging Face <-> template checkpoints: Llama 2 / 3.x (RoPE scaling), Mistral, Qwen2 / Qwen2.5 (q, k, v biases),
Qwen3 (QK-norm, explicit head dim), Mixtral and Qwen3-MoE (mixtures of experts); GQA, tied or untied embeddings.
Which config.json fields map to which model.* fields: training/interop/hf_config.py.

    .venv/bin/python tools/convert_hf.py import --hf-dir ~/hf/Llama-2-7b-hf --out ckpts/llama2 --name llama2_hf --check
    NPROC=8 launch/train.sh model=local/llama2_hf parallel.tp=4 checkpoint.load=ckpts/llama2 checkpoint.finetune=true
    .venv/bin/python tools/convert_hf.py export --ckpt outputs/<run>/checkpoints --out ~/hf/llama2-tuned --check \
        --tokenizer-dir ~/hf/Llama-2-7b-hf

import: reads config.json + model.safetensors (or shards + model.safetensors.index.json), derives the model config from
config.json, writes it as a preset (conf/model/local/<name>.yaml, selected as model=local/<name>; git ignores
conf/model/local/ and the tests do not collect it; or --preset-out) and a template checkpoint (<out>/iter_0000000 +
<out>/latest, the model config in its run.json) that train.py loads at any tp / pp / dp layout. Extra arguments are
Hydra overrides of everything but the model's shape (e.g. model.seq_length=1024 trains shorter sequences than
max_position_embeddings; train.precision=bf16 stores bf16 weights: half the disk, not less memory, and a looser check).
A sliding window (Mistral's sliding_window) imports as model.sliding_window: every layer attends within it, as
transformers' (training/interop/hf_config.py).
export: loads a template checkpoint (saved at any layout: dist_checkpointing reshards) in one process and writes
config.json (LlamaConfig, derived from its run.json) + model.safetensors (shards above --max-shard-gb) that
transformers.AutoModelForCausalLM.from_pretrained loads, and the tokenizer files with their chat template
(tokenizer.json, tokenizer_config.json, chat_template.jinja, ...; config.json's bos/eos/pad ids) from --tokenizer-dir,
or else from the run's data.tokenizer when that is a directory, so the exported model's AutoTokenizer renders
conversations as the fine-tuned one was trained on. A LoRA run (peft=lora): export --adapter writes a Hugging Face PEFT
adapter, --merge the merged model (training/interop/peft_export.py; docs/peft.md).
--check (both): run our model and transformers' on the same token ids, print the max |logit diff| and the same
relative to max |logit|; exit 1 when the relative one exceeds --tolerance (fp32 1e-4, bf16 5e-2).

Memory: one process holds the bare model (built without gradient buffers or optimizer): 4 bytes/param at fp32 (7B: ~28
GB), 2 at bf16, plus the safetensors being read (memory-mapped: page cache); --check adds the transformers model (4
bytes/param at fp32). Random init is skipped (every weight is loaded). Import at fp32 (exact --check) and train with
train.precision=bf16: the fp32 checkpoint loads into a bf16 run. Exit codes: 0 ok, 1 the check failed, 2 an error.
"""

from __future__ import annotations

import argparse
import json
import re
import shutil
import sys
import time
from pathlib import Path

from training.errors import TemplateError, exit_on_error
from training.shims.noise import quiet_known_noise

ROOT = Path(__file__).resolve().parents[1]
# where an import writes its preset by default: in the model group (model=local/<name>), git-ignored, and not
# collected by the tests (they enumerate conf/model/*.yaml, the presets the repository ships)
LOCAL_PRESETS = ROOT / "conf" / "model" / "local"
# What transformers' save_pretrained writes for a tokenizer (and its chat templates), and generation defaults
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "added_tokens.json",
                   "tokenizer.model", "vocab.json", "merges.txt", "chat_template.jinja", "chat_template.json",
                   "additional_chat_templates", "generation_config.json")

def fixed_by_config_json() -> tuple[str, ...]:
    """The model.* fields config.json fixes (the shape's "weights" and "numerics" fields, models/shape.py);
    the others (seq_length, name, recompute, dropout, ...) may be overridden."""
    from models.shape import NUMERICS, WEIGHTS, ModelShape

    return ModelShape.config_fields(WEIGHTS, NUMERICS)


def selection(preset: Path) -> str:
    """The overrides that select a preset file: model=local/<name> for an import's default place, model=<name>
    for conf/model/, else model=<name> with Hydra's search path on the folder above the preset's."""
    folder = preset.parent.resolve()
    if folder == LOCAL_PRESETS.resolve():
        return f"model={LOCAL_PRESETS.name}/{preset.stem}"
    return f"model={preset.stem}" + ("" if folder == LOCAL_PRESETS.parent.resolve() else
                                     f" 'hydra.searchpath=[file://{folder.parent}]'")


def empty_dir(path: Path, what: str) -> Path:
    if path.exists() and any(path.iterdir()):
        raise TemplateError(f"{what} {path} is not empty: choose a new directory (nothing is overwritten)")
    path.mkdir(parents=True, exist_ok=True)
    return path


def check(state, vocab_size: int, seq_length: int, hf_dir: Path, precision: str, tolerance: float | None,
          reference=None) -> bool:
    """Our logits vs transformers' (or reference(tokens)'s) on the same tokens; prints both differences, True
    when within tolerance."""
    from training.interop import hf
    from training.parallel.dist import current_device

    tokens = hf.check_tokens(vocab_size, seq_length)
    ours = hf.full_logits(state, tokens.to(current_device()), vocab_size).cpu()
    reference = reference(tokens) if reference else hf.reference_logits(hf_dir, tokens)
    worst, relative = hf.logits_diff(ours, reference)
    limit = tolerance if tolerance is not None else hf.BF16_TOLERANCE if precision == "bf16" else hf.FP32_TOLERANCE
    ok = relative <= limit
    print(f"logits check ({tuple(tokens.shape)} tokens, {precision}): max |diff| {worst:.3e}, relative to max "
          f"|logit| {reference.abs().max().item():.3f}: {relative:.3e} (tolerance {limit:g}) -> "
          f"{'ok' if ok else 'FAILED'}", flush=True)
    return ok


def do_import(args, overrides: list[str]) -> bool:
    from omegaconf import OmegaConf

    from models.shape import ModelShape
    from training import checkpoint
    from training.config.compose import compose
    from training.config.schema import ParallelConfig
    from training.config.validate import validate
    from training.engine.build import build
    from training.interop import hf, hf_config
    from training.parallel import dist as D

    if args.adapter:  # a PEFT adapter onto an imported base checkpoint
        from training.interop.peft_import import import_adapter
        return import_adapter(args, overrides)
    hf_dir = Path(args.hf_dir or "--hf-dir not given")
    if not (hf_dir / "config.json").is_file():
        raise TemplateError(f"{hf_dir} has no config.json: point --hf-dir at a downloaded Hugging Face model")
    fields = hf_config.model_fields(json.loads((hf_dir / "config.json").read_text()))
    overridden = {o.split("=")[0].lstrip("+~") for o in overrides}
    fixed = sorted(f"model.{k}" for k in fixed_by_config_json() if f"model.{k}" in overridden)
    if fixed or any(k.startswith("parallel.") for k in overridden):
        raise TemplateError(f"not overridable on import: {fixed or 'parallel.*'} (the shape comes from "
                            f"config.json; import runs in one process; train at any layout afterwards)")
    cfg = compose(overrides)
    fields["name"] = args.name or (Path(args.preset_out).stem if args.preset_out else
                                   re.sub(r"[^a-z0-9_]+", "_", hf_dir.resolve().name.lower()).strip("_") or "hf")
    for group in ("moe", "rope_scaling"):  # a mixture of experts; Llama 3's RoPE scaling
        for key, value in fields.pop(group, {}).items():
            if f"model.{group}.{key}" not in overridden:
                setattr(getattr(cfg.model, group), key, value)
    for key, value in fields.items():
        if f"model.{key}" not in overridden:
            setattr(cfg.model, key, value)
    cfg.parallel = ParallelConfig(timeout_minutes=cfg.parallel.timeout_minutes)
    cfg.checkpoint.dir, cfg.checkpoint.load, cfg.checkpoint.finetune = str(Path(args.out).resolve()), None, False
    if (hf_dir / "tokenizer.json").is_file() and "data.tokenizer" not in overridden:
        cfg.data.tokenizer = str(hf_dir.resolve())  # run.json records it: a fine-tune with another one is refused
    validate(cfg, world_size=1)
    shape = ModelShape.of(cfg.model)
    preset = Path(args.preset_out) if args.preset_out else LOCAL_PRESETS / f"{cfg.model.name}.yaml"
    if preset.exists() and not args.force:
        raise TemplateError(f"preset {preset} exists: pass another --preset-out (or --name), or --force")
    empty_dir(Path(cfg.checkpoint.dir), "--out")
    start = time.perf_counter()
    with D.distributed(tp=1, pp=1, seed=cfg.train.seed, timeout_minutes=cfg.parallel.timeout_minutes) as info:
        state = build(cfg, shape, info.device, init=False, train=False)  # every weight is loaded
        weights = hf.HFWeights(hf_dir)
        count = hf.load_hf_weights(state, weights)
        if unread := weights.unread(tied=cfg.model.tie_embeddings):
            raise hf.HFError(f"tensors our GPT has no place for (another architecture?): {unread[:8]}")
        checkpoint.save(cfg, state, iteration=0, consumed_samples=0, model_only=True)
        preset.parent.mkdir(parents=True, exist_ok=True)
        preset.write_text(f"# {cfg.model.name}: imported from {hf_dir.resolve()} by tools/convert_hf.py (derived from "
                          f"its config.json;\n# the shape fields must match the checkpoint's weights).\n"
                          + OmegaConf.to_yaml(OmegaConf.structured(cfg.model)))
        tokenizer = f" data.tokenizer={cfg.data.tokenizer}" if cfg.data.tokenizer != "byte" else ""
        print(f"imported {count / 1e6:.2f}M parameters in {time.perf_counter() - start:.1f} s: checkpoint "
              f"{cfg.checkpoint.dir}, preset {preset}\ntrain it with: {selection(preset)} checkpoint.load="
              f"{cfg.checkpoint.dir} checkpoint.finetune=true{tokenizer}"
              + ("" if tokenizer else f"\nnote: {hf_dir} has no tokenizer.json: give data.tokenizer the model's when "
                                      f"you preprocess and train (else text is byte ids)"), flush=True)
        return not args.check or check(state, cfg.model.vocab_size, cfg.model.seq_length, hf_dir,
                                       cfg.train.precision, args.tolerance)


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
    from training.interop import hf, hf_config
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
    with D.distributed(tp=1, pp=1, seed=cfg.train.seed, timeout_minutes=cfg.parallel.timeout_minutes) as info:
        state = build(cfg, shape, info.device, init=False, train=False)
        checkpoint.maybe_load(cfg, state)  # an adapters-only checkpoint: its base first
        if args.adapter:
            return export_adapter(args, state, cfg, path, out)
        from training.interop.peft_export import merge
        restore = merge(state) if args.merge else None  # W + (alpha / r) B A, written; the check: the unmerged
        config.save_pretrained(str(out))
        size = hf.write_safetensors(hf.hf_tensors(state), out, int(args.max_shard_gb * 2**30))
        copied = [name for name in TOKENIZER_FILES if tokenizer_dir and copy_file(tokenizer_dir / name, out / name)]
        restore and restore()
        print(f"exported {path} (saved at tp/pp {run['layout']['tp']}/{run['layout']['pp']}, iteration "
              f"{run['iteration']}) to {out}: {size / 2**20:.1f} MiB in {time.perf_counter() - start:.1f} s"
              + (f"; tokenizer files from {tokenizer_dir}: {', '.join(copied)}" if copied else ""), flush=True)
        return not args.check or check(state, run["vocab_size"], cfg.model.seq_length, out, cfg.train.precision,
                                       args.tolerance)


def parse(argv: list[str]):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    sub = parser.add_subparsers(dest="command", required=True)
    imp = sub.add_parser("import", help="Hugging Face directory -> template checkpoint + model preset")
    imp.add_argument("--hf-dir", help="local directory with config.json and *.safetensors")
    imp.add_argument("--out", required=True, help="checkpoint directory to create (checkpoint.load=...)")
    imp.add_argument("--adapter", help="a PEFT LoRA adapter directory onto --base: an adapters-only checkpoint")
    imp.add_argument("--base", help="--adapter: the base model's checkpoint (written by convert_hf import)")
    imp.add_argument("--name", help="preset name (model=NAME); default: the directory's name")
    imp.add_argument("--preset-out", help="preset YAML path; default conf/model/local/<name>.yaml (model=local/<name>)")
    imp.add_argument("--force", action="store_true", help="overwrite an existing preset file")
    exp = sub.add_parser("export", help="template checkpoint -> Hugging Face directory")
    exp.add_argument("--ckpt", required=True, help="a checkpoint directory (with `latest`) or an iter_* directory")
    exp.add_argument("--out", required=True, help="directory to create (from_pretrained(...))")
    exp.add_argument("--max-shard-gb", type=float, default=5.0, help="safetensors shard size (Hub's default)")
    exp.add_argument("--tokenizer-dir", help="copy the tokenizer files and chat template (and config.json's "
                                             "bos/eos/pad ids) from here, e.g. the imported HF directory; default: "
                                             "the run's data.tokenizer when it is a directory")
    how = exp.add_mutually_exclusive_group()
    how.add_argument("--adapter", action="store_true", help="a LoRA run: its adapters as a Hugging Face PEFT adapter")
    how.add_argument("--merge", action="store_true", help="a LoRA run: write the model with the adapters merged")
    exp.add_argument("--base-hf-dir", help="--adapter: the HF base (base_model_name_or_path; --check loads it)")
    for p in (imp, exp):
        p.add_argument("--check", action="store_true", help="compare logits with transformers' (exit 1 if off)")
        p.add_argument("--tolerance", type=float, help="max relative logits diff (fp32 1e-4, bf16 5e-2)")
    return parser.parse_known_args(argv)


def convert(argv: list[str]) -> int:
    from training.parallel.dist import single_process_env

    args, overrides = parse(argv)
    if args.command == "export" and overrides:
        raise TemplateError(f"export takes no overrides (the checkpoint's run.json defines the model): {overrides}")
    quiet_known_noise()
    single_process_env()
    try:
        ok = do_import(args, overrides) if args.command == "import" else do_export(args)
    except ImportError as err:
        if err.name not in ("transformers", "safetensors"):
            raise
        raise TemplateError(f"{err}: install the Hugging Face extra: pip install -e '.[hf]'") from err
    return 0 if ok else 1


def main(argv: list[str]) -> int:
    """convert(argv), with the user's errors as one line each and exit code 2."""
    return exit_on_error(convert, argv)


if __name__ == "__main__":  # the guard matters: dist_checkpointing's save re-imports __main__
    sys.exit(main(sys.argv[1:]))
