"""Which checkpoint a run loads and whether it matches the config, read from the checkpoint's files alone (no
Megatron-Core, no process): tools/check_config.py before the launch, training/checkpoint/ on every rank (which
raise these lines as CheckpointError).

    path, weights_only = load_target(cfg)        # None: from scratch (checkpoint.dir absolute: the run's)
    run = json.loads((path / RUN_FILE).read_text())
    problems = match_problems(run, cfg, shape, path, weights_only, build_tokenizer)   # one line each; [] = loads
    base = lora_base(cfg)     # peft=lora: the base checkpoint its adapters-only checkpoints name, or None

The tokenizer check needs training/data/tokenizer.py's build_tokenizer, which the callers pass in (data sits
above config in the layers: tests/test_structure.py).
"""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

from models.shape import WEIGHTS, ModelShape
from training.config.paths import LATEST, RUN_FILE, is_complete
from training.config.schema import Config, ModelConfig, to_config


def complete_checkpoints(root: Path) -> list[Path]:
    """Complete iter_* directories, newest first."""
    if not root.is_dir():
        return []
    found = [p for p in root.glob("iter_*") if p.is_dir() and is_complete(p)]
    return sorted(found, key=lambda p: p.name, reverse=True)


def newest_complete(root: Path, warn=lambda message: None) -> Path | None:
    """The checkpoint `latest` names if it is complete (else warn(...) says so), else the newest complete one,
    else None."""
    candidates = complete_checkpoints(root)
    latest = root / LATEST
    if latest.is_file():
        named = root / latest.read_text().strip()
        if not is_complete(named):
            warn(f"warning: {latest} names {named}, which is incomplete; using the newest complete one")
        elif named in candidates:
            return named
    return candidates[0] if candidates else None


def follow_latest(path: Path) -> Path:
    """A checkpoint.dir -> the iter_* its `latest` names; anything else as it is."""
    return path / (path / LATEST).read_text().strip() if (path / LATEST).is_file() else path


def load_target(cfg: Config, warn=lambda message: None) -> tuple[Path | None, bool]:
    """checkpoint.load -> (what to load, weights only?): this run's newest complete checkpoint in checkpoint.dir
    (auto), checkpoint.load as given (a path), or None to start fresh. With checkpoint.finetune the weights of
    checkpoint.load start the run, unless checkpoint.dir already holds this run's own checkpoint: then a restarted
    (requeued) fine-tune resumes itself."""
    spec, own = cfg.checkpoint.load, None
    if cfg.checkpoint.dir is not None:
        own = newest_complete(Path(cfg.checkpoint.dir), warn)
    if cfg.checkpoint.finetune:
        return (own, False) if own is not None else (Path(spec), True)
    if spec is None:
        return None, False
    return (own, False) if spec == "auto" else (Path(spec), False)


def saved_model_config(run: dict) -> ModelConfig:
    """A checkpoint's model config (run.json) on today's schema: fields added since take their defaults;
    fused_kernels, a run setting that was a string (auto/on/off) before it became a bool, is left out."""
    model = {k: v for k, v in run["config"]["model"].items() if k != "fused_kernels"}
    return to_config({"model": model}).model


def tokenizer_problem(run: dict, spec: str, path: Path, build_tokenizer) -> str | None:
    """A checkpoint written with another tokenizer than data.tokenizer=spec (by content: a Hugging Face
    tokenizer's name hashes its tokenizer.json): its token ids would stand for other text. A recorded path that
    no longer exists (another machine) is not compared."""
    saved = run.get("config", {}).get("data", {}).get("tokenizer", "byte")
    if saved == spec or (saved != "byte" and not Path(saved).exists()):
        return None
    if build_tokenizer(saved).name == build_tokenizer(spec).name:
        return None
    return (f"checkpoint {path} was written with the tokenizer {saved}, this run has data.tokenizer={spec}: its "
            f"token ids stand for other text. Set data.tokenizer={saved} (and preprocess the data with it)")


def model_problem(run: dict, shape: ModelShape, preset: str, path: Path, hint: bool = True) -> str | None:
    """Every field whose weights' shapes differ between the checkpoint and the config (the shape fields tagged
    "weights", resolved: ffn_hidden_size=null and 4h are the same), in one line; the checkpoint's preset when it
    names another than the config's (model=<preset>)."""
    saved = ModelShape.of(saved_model_config(run), run["vocab_size"]).fields_of(WEIGHTS)
    current = shape.fields_of(WEIGHTS)
    differ = [f"{k}: checkpoint {_brief(saved[k])} vs config {_brief(current[k])}"
              for k in current if saved[k] != current[k]]
    if not differ:
        return None
    name = run["config"]["model"].get("name")
    hint = "" if not hint else f"; it was written with model={name}: add model={name}" if name and name != preset \
        else "; set these model.* fields to the checkpoint's values"
    return f"the model in the config (model={preset}) does not match checkpoint {path}: " + "; ".join(differ) + hint


def _brief(value):
    """A layer list shown by its length and distinct entries (it repeats one dict per layer)."""
    if isinstance(value, (list, tuple)):
        distinct = [dict(t) for t in dict.fromkeys(tuple(sorted(d.items())) for d in value)]
        return f"{len(value)} x {distinct[0]}" if len(distinct) == 1 else f"{len(value)} of {distinct}"
    return value


def match_problems(run: dict, cfg: Config, shape: ModelShape, path: Path, weights_only: bool,
                   build_tokenizer) -> list[str]:
    """What refuses this load, one line each: another tokenizer (alone: it is also why a vocabulary would
    differ), else the model's differing fields, a weights-only checkpoint loaded without checkpoint.finetune, LoRA
    adapters the config's peft.* would not hold as trained, and an adapters-only checkpoint's base."""
    if problem := tokenizer_problem(run, cfg.data.tokenizer, path, build_tokenizer):
        return [problem]
    found = [model_problem(run, shape, cfg.model.name, path)]
    if not weights_only and run.get("weights_only"):
        found.append(f"checkpoint {path} holds weights only (an import or conversion): load it with "
                     f"checkpoint.finetune=true")
    found += [peft_problem(run, cfg, path), base_problem(run, cfg, path, weights_only)]
    return [problem for problem in found if problem is not None]


def loadable(path: Path | None) -> Path | None:
    """The complete checkpoint load_target's path names (its `latest` followed), or None (paths.load_problem and
    the load itself say why not)."""
    if path is None:
        return None
    path = follow_latest(path)
    return path if is_complete(path) else None


# --- LoRA: a checkpoint of adapters only, on a base checkpoint named in its run.json ----------------------------
# run.json's "peft_base": {"path": the base's iter_* directory, "fingerprint": the SHA-256 of its integrity.json
# (Megatron-Core's per-file SHA-256 manifest: other weights at the same path are another base)}

def fingerprint(path: Path) -> str | None:
    """The SHA-256 of a torch_dist checkpoint's integrity manifest; None for a checkpoint without one."""
    manifest = path / "integrity.json"
    return hashlib.sha256(manifest.read_bytes()).hexdigest() if manifest.is_file() else None


def base_of(path: Path, run: dict) -> dict | None:
    """The base a LoRA fine-tune from checkpoint `path` (its run.json `run`) sits on: the base an adapters-only
    checkpoint names, else the checkpoint itself (a torch_dist one: with a fingerprint)."""
    if run.get("peft_base"):
        return run["peft_base"]
    digest = fingerprint(path)
    return {"path": str(path.resolve()), "fingerprint": digest} if digest else None


def lora_base(cfg: Config) -> dict | None:
    """The base a peft=lora run's checkpoints name (they then save the adapters and peft.trainable only): the
    base of the checkpoint it resumes, or the checkpoint a fine-tune starts from; None (full checkpoints) for
    peft=none, a LoRA run from scratch, or one resumed from a full checkpoint."""
    if str(cfg.peft.method) == "none":
        return None
    target, weights_only = load_target(cfg)
    path = loadable(target)
    if path is None:
        return None
    run = json.loads((path / RUN_FILE).read_text())
    return base_of(path, run) if weights_only else run.get("peft_base")


def peft_settings(peft) -> dict:
    """What shapes and scales a LoRA adapter (a config's peft or a run.json's), comparable."""
    get = (lambda key, default: peft.get(key, default)) if isinstance(peft, dict) else \
        (lambda key, default: getattr(peft, key))
    method = str(get("method", "none"))
    return {"method": method} if method == "none" else {"method": method, "rank": int(get("rank", 0)),
                                                       "alpha": float(get("alpha", 0)),
                                                       "targets": sorted(get("targets", []))}


def peft_problem(run: dict, cfg: Config, path: Path) -> str | None:
    """A checkpoint holding LoRA adapters, loaded by a run that would not hold them as trained: peft=none (they
    would be dropped; an adapters-only checkpoint has no other weights), another rank or targets (their shapes),
    another alpha (their scale): one line naming the checkpoint's settings and the overrides that load it."""
    saved, ours = peft_settings(run.get("config", {}).get("peft", {})), peft_settings(cfg.peft)
    if saved["method"] == "none" or saved == ours:
        return None

    def shown(value) -> str:
        return f"[{','.join(value)}]" if isinstance(value, list) else f"{value:g}" if isinstance(value, float) \
            else str(value)

    differ = ", ".join(f"peft.{k}={shown(saved[k])} (this run: {shown(ours[k])})"  # peft=none: the method alone
                       for k in ours if saved[k] != ours[k])
    give = (f"peft={saved['method']} peft.rank={saved['rank']} peft.alpha={saved['alpha']:g} "
            f"'peft.targets=[{','.join(saved['targets'])}]'")
    merged = " (a full fine-tune of the merged weights: tools/convert_hf.py export --merge, then import)" \
        if ours["method"] == "none" else ""
    return f"checkpoint {path} holds LoRA adapters trained with {differ}: pass {give} to load them{merged}"


def base_problem(run: dict, cfg: Config, path: Path, weights_only: bool) -> str | None:
    """An adapters-only checkpoint whose base is missing, changed, or not the base the config names
    (checkpoint.finetune=true with checkpoint.load=BASE, resuming its own checkpoint): one line naming both."""
    base = run.get("peft_base")
    if not base:
        return None
    where = Path(base["path"])
    if not is_complete(where):
        return (f"checkpoint {path} holds LoRA adapters only, on the base {where}, which is missing or incomplete: "
                f"restore the base there (the adapters need its weights)")
    if fingerprint(where) != base["fingerprint"]:
        return (f"checkpoint {path} holds LoRA adapters trained on the base {where}, whose weights changed since "
                f"(its integrity.json differs): restore the base the adapters were trained on")
    named = loadable(Path(cfg.checkpoint.load)) if cfg.checkpoint.finetune and cfg.checkpoint.load else None
    if not weights_only and named is not None and named.resolve() != path.resolve():
        other = base_of(named, json.loads((named / RUN_FILE).read_text()))
        if other is None or Path(other["path"]) != where:
            return (f"checkpoint {path} holds LoRA adapters trained on the base {where}, but this run's base is "
                    f"checkpoint.load={cfg.checkpoint.load} ({other['path'] if other else named}): give "
                    f"checkpoint.load={where}, or a new checkpoint.dir to start another fine-tune")
    return None
