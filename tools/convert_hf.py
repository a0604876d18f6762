"""Hugging Face <-> template checkpoints, for the families listed below (config.json's model_type; what each adds:
docs/hf.md), from a downloaded directory or a hub id (`--hf-dir Qwen/Qwen3-8B`: huggingface_hub's cache and token).
Which config.json fields map to which model.* fields: training/interop/hf_config.py.

    .venv/bin/python tools/convert_hf.py import --hf-dir ~/hf/Llama-2-7b-hf --out ckpts/llama2 --name llama2_hf --check
    .venv/bin/python tools/convert_hf.py import --hf-dir Qwen/Qwen3-8B --revision main --out ckpts/qwen3 --name qwen3
    NPROC=8 launch/train.sh model=local/llama2_hf parallel.tp=4 checkpoint.load=ckpts/llama2 checkpoint.finetune=true
    .venv/bin/python tools/convert_hf.py export --ckpt outputs/<run>/checkpoints --out ~/hf/llama2-tuned --check \
        --tokenizer-dir ~/hf/Llama-2-7b-hf

import: --hf-dir is a directory or a hub id (owner/name, not a local path): the hub's files a conversion reads
(config.json, *.safetensors, the tokenizer and chat template) are downloaded into the Hugging Face cache (HF_HOME /
HF_HUB_CACHE; a progress bar while it downloads; HF_TOKEN or `hf auth login` for gated models; HF_HUB_OFFLINE=1:
from the cache only) at --revision (a branch, tag or commit; default main); --adapter takes a hub id too. It
reads config.json + model.safetensors (or shards + model.safetensors.index.json), derives the model config from
config.json, writes it as a preset (conf/model/local/<name>.yaml, selected as model=local/<name>; git ignores
conf/model/local/ and the tests do not collect it; or --preset-out) and a template checkpoint (<out>/iter_0000000 +
<out>/latest, the model config in its run.json) that train.py loads at any tp / pp / dp layout, in the checkpoint's
dtype (bf16 stays bf16; train.precision=fp32 on request; either loads into a run of either precision). Extra
arguments are Hydra overrides of everything but the model's shape (e.g. model.seq_length=1024). Sliding windows,
soft-caps, RoPE variants: training/interop/hf_config.py and hf_families.py.
export: reads a template checkpoint (saved at any layout: dist_checkpointing reshards) and writes the safetensors
shards (--max-shard-gb) + model.safetensors.index.json, then config.json, that transformers' from_pretrained loads,
and the tokenizer files with their chat template (tokenizer.json, tokenizer_config.json, chat_template.jinja, ...;
config.json's bos/eos/pad ids) from --tokenizer-dir, or else from the run's data.tokenizer when that is a directory.
A LoRA run (peft=lora): export --adapter writes a Hugging Face PEFT adapter, --merge the merged model
(training/interop/peft_export.py; docs/peft.md).
--check (both): run our model and transformers' on the same token ids (fp32), print the max |logit diff| and the same
relative to max |logit|, and how each side was run; exit 1 when the relative one exceeds --tolerance (default 1e-4).

Memory (streamed, docs/hf.md "Big checkpoints"): import and export never hold the model: the model is built on the
meta device, import writes the checkpoint tensor by tensor as it reads the safetensors (training/interop/
hf_stream.py), export reads one parameter at a time (ckpt_reader.py) into shards written tensor by tensor, and --check
runs both models with each module's weights loaded just before its forward (hf_check.py). Peak: about 1 GB of
libraries + a few of the largest tensor (import: + one checkpoint file of at most 1 GiB; safetensors are read with
pread, never mapped) (tools/bench_convert.py measures it). Not streamed: a
LoRA run's export and an FSDP checkpoint's (the model is loaded whole). An interrupted or failed conversion removes
its --out. Exit codes: 0 ok, 1 the check failed, 2 an error.
"""

from __future__ import annotations

import argparse
import json
import re
import sys
import time
from pathlib import Path

from training.errors import TemplateError, exit_on_error
from training.shims.noise import quiet_known_noise

ROOT = Path(__file__).resolve().parents[1]
# where an import writes its preset by default: in the model group (model=local/<name>), git-ignored, and not
# collected by the tests (they enumerate conf/model/*.yaml, the presets the repository ships)
LOCAL_PRESETS = ROOT / "conf" / "model" / "local"
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


def do_import(args, overrides: list[str]) -> bool:
    import torch
    from omegaconf import OmegaConf

    from models.shape import ModelShape
    from training import checkpoint
    from training.config.compose import compose
    from training.config.schema import ParallelConfig
    from training.config.validate import validate
    from training.engine.build import build
    from training.interop import hf, hf_check, hf_config, hf_deepseek, hf_stream, hub
    from training.interop.hf_export import empty_dir, removed_on_failure
    from training.interop.progress import Progress, files_summary
    from training.parallel import dist as D

    if args.adapter:  # a PEFT adapter onto an imported base checkpoint
        from training.interop.peft_import import import_adapter
        args.adapter = str(hub.model_dir(args.adapter, args.revision, "--adapter"))
        return import_adapter(args, overrides)
    from_hub = bool(args.hf_dir) and hub.is_hub_id(args.hf_dir)  # named after the repository, not its snapshot
    hf_dir = hub.model_dir(args.hf_dir, args.revision) if args.hf_dir else Path("--hf-dir not given")
    source = f"{args.hf_dir}@{args.revision or 'main'} ({hf_dir.resolve()})" if from_hub else str(hf_dir.resolve())
    if not (hf_dir / "config.json").is_file():
        raise TemplateError(f"{hf_dir} has no config.json: point --hf-dir at a downloaded Hugging Face model")
    published = json.loads((hf_dir / "config.json").read_text())
    fields = hf_config.model_fields(published)
    if note := hf_deepseek.skipped(published):  # multi-token prediction layers
        print(note)
    overridden = {o.split("=")[0].lstrip("+~") for o in overrides}
    fixed = sorted(f"model.{k}" for k in fixed_by_config_json() if f"model.{k}" in overridden)
    if fixed or any(k.startswith("parallel.") for k in overridden):
        raise TemplateError(f"not overridable on import: {fixed or 'parallel.*'} (the shape comes from "
                            f"config.json; import runs in one process; train at any layout afterwards)")
    cfg = compose(overrides)
    folder = args.hf_dir.rsplit("/", 1)[-1] if from_hub else hf_dir.resolve().name
    fields["name"] = args.name or (Path(args.preset_out).stem if args.preset_out else
                                   re.sub(r"[^a-z0-9_]+", "_", folder.lower()).strip("_") or "hf")
    for group in ("moe", "rope_scaling", "mla"):  # a mixture of experts; Llama 3's RoPE scaling; DeepSeek's MLA
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
    weights = hf.HFWeights(hf_dir)
    if "train.precision" not in overridden:  # keep the checkpoint's dtype: bf16 stays bf16 (fp32 on request)
        cfg.train.precision = "bf16" if weights.dtype() == torch.bfloat16 else "fp32"
    validate(cfg, world_size=1)
    shape = ModelShape.of(cfg.model)
    preset = Path(args.preset_out) if args.preset_out else LOCAL_PRESETS / f"{cfg.model.name}.yaml"
    if preset.exists() and not args.force:
        raise TemplateError(f"preset {preset} exists: pass another --preset-out (or --name), or --force")
    out = empty_dir(Path(cfg.checkpoint.dir), "--out")
    start = time.perf_counter()
    with D.distributed(tp=1, pp=1, seed=cfg.train.seed, timeout_minutes=cfg.parallel.timeout_minutes):
        with removed_on_failure(out):
            with torch.device("meta"):  # shapes only: the checkpoint is written tensor by tensor (hf_stream.py)
                state = build(cfg, shape, torch.device("meta"), init=False, train=False)
            count = hf_stream.plan(state, weights, tied=cfg.model.tie_embeddings)
            progress = Progress("import", hf_stream.param_bytes(state))
            path = checkpoint.save(cfg, state, iteration=0, consumed_samples=0, model_only=True,
                                   strategy=hf_stream.streaming_save(state, weights, progress))
            progress.close()
        preset.parent.mkdir(parents=True, exist_ok=True)
        preset.write_text(f"# {cfg.model.name}: imported from {source} by tools/convert_hf.py (derived from "
                          f"its config.json;\n# the shape fields must match the checkpoint's weights).\n"
                          + OmegaConf.to_yaml(OmegaConf.structured(cfg.model)))
        tokenizer = f" data.tokenizer={cfg.data.tokenizer}" if cfg.data.tokenizer != "byte" else ""
        print(f"imported {count / 1e6:.2f}M parameters ({cfg.train.precision}) in {time.perf_counter() - start:.1f} "
              f"s: checkpoint {path} ({files_summary(path)}), preset {preset}\ntrain it with: {selection(preset)} "
              f"checkpoint.load={cfg.checkpoint.dir} checkpoint.finetune=true{tokenizer}"
              + ("" if tokenizer else f"\nnote: {hf_dir} has no tokenizer.json: give data.tokenizer the model's when "
                                      f"you preprocess and train (else text is byte ids)"), flush=True)
        if (published.get("quantization_config") or {}).get("quant_method") == "mxfp4":
            print("note: the experts were stored in MXFP4: imported dequantized to bf16 (an export writes bf16)")
        return not args.check or hf_check.check_checkpoint(cfg, shape, path, hf_dir, args.tolerance)


def families() -> str:
    """Every config.json model_type import takes (training/interop/hf_config.py), for --help."""
    from training.interop.hf_config import FAMILIES

    return "families (config.json model_type): " + ", ".join(FAMILIES)


def parse(argv: list[str]):
    description = __doc__.split("\n\n")[0].replace("\n", " ")
    parser = argparse.ArgumentParser(description=description, epilog=families() + "; more: the module docstring "
                                     "(tools/convert_hf.py) and docs/hf.md")
    sub = parser.add_subparsers(dest="command", required=True)
    imp = sub.add_parser("import", help="Hugging Face directory or hub id -> template checkpoint + model preset",
                         epilog=families())
    imp.add_argument("--hf-dir", help="a directory with config.json and *.safetensors, or a hub id (owner/name: "
                                      "downloaded into the Hugging Face cache, HF_TOKEN for gated models)")
    imp.add_argument("--revision", help="a hub id's branch, tag or commit (default: main)")
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
    from training.interop.ckpt_reader import return_freed_memory
    from training.parallel.dist import single_process_env

    args, overrides = parse(argv)
    if args.command == "export" and overrides:
        raise TemplateError(f"export takes no overrides (the checkpoint's run.json defines the model): {overrides}")
    quiet_known_noise()
    single_process_env()
    return_freed_memory()  # streamed conversions free what they read: let the memory go back
    try:
        from training.interop.hf_export import do_export

        ok = do_import(args, overrides) if args.command == "import" else do_export(args)
    except OSError as err:  # disk full, permissions: the --out directory was removed (removed_on_failure)
        raise TemplateError(f"{args.command} failed ({err}): --out {args.out} was removed (nothing half-written "
                            f"is left); fix the cause and run the same command again") from err
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
