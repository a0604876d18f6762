"""Which checkpoint a run loads and whether it matches the config, read from the checkpoint's files alone (no
Megatron-Core, no process): tools/check_config.py before the launch, training/checkpoint/ on every rank (which
raise these lines as CheckpointError).

    path, weights_only = load_target(cfg)        # None: from scratch (checkpoint.dir absolute: the run's)
    run = json.loads((path / RUN_FILE).read_text())
    problems = match_problems(run, cfg, shape, path, weights_only, build_tokenizer)   # one line each; [] = loads

The tokenizer check needs training/data/tokenizer.py's build_tokenizer, which the callers pass in (data sits
above config in the layers: tests/test_structure.py).
"""

from __future__ import annotations

from pathlib import Path

from models.shape import WEIGHTS, ModelShape
from training.config.paths import LATEST, is_complete
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


def model_problem(run: dict, shape: ModelShape, preset: str, path: Path) -> str | None:
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
    hint = f"; it was written with model={name}: add model={name}" if name and name != preset else \
        "; set these model.* fields to the checkpoint's values"
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
    differ), else the model's differing fields and a weights-only checkpoint loaded without checkpoint.finetune."""
    if problem := tokenizer_problem(run, cfg.data.tokenizer, path, build_tokenizer):
        return [problem]
    found = [model_problem(run, shape, cfg.model.name, path)]
    if not weights_only and run.get("weights_only"):
        found.append(f"checkpoint {path} holds weights only (an import or conversion): load it with "
                     f"checkpoint.finetune=true")
    return [problem for problem in found if problem is not None]


def loadable(path: Path | None) -> Path | None:
    """The complete checkpoint load_target's path names (its `latest` followed), or None (paths.load_problem and
    the load itself say why not)."""
    if path is None:
        return None
    path = follow_latest(path)
    return path if is_complete(path) else None
