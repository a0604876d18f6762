"""The files a config names, checked before any process starts (tools/check_config.py, which the launch scripts
run before torchrun, and training/engine/entry.py on every rank): each data.paths prefix's .bin and .idx and the
format its PREFIX.json records against data.format, data.tokenizer's file, checkpoint.load's checkpoint. Pure
filesystem checks, no Megatron-Core import. A relative path is relative to the working directory, as the run
reads it (Hydra does not change it; the launch scripts run from the repository root).

    problems = path_problems(cfg)   # one line per problem, naming the path; [] = all there
    check_paths(cfg)                # the same, raised as one ConfigError
"""

from __future__ import annotations

import json
from pathlib import Path

from training.config.schema import Config
from training.errors import ConfigError

# A checkpoint directory (written by training/checkpoint/, which takes these from here): <dir>/latest names
# <dir>/iter_*, complete once it holds run.json (ours, written last) and metadata.json (the format's)
LATEST, RUN_FILE, METADATA = "latest", "run.json", "metadata.json"
MASK_SUFFIX = ".mask"  # data.format=sft: PREFIX.mask.bin/.idx, each conversation's loss mask (training/data/chat.py)


def is_complete(path: Path) -> bool:
    """A complete checkpoint: run.json and the format's metadata.json (a save interrupted before them is not)."""
    return (path / RUN_FILE).is_file() and (path / METADATA).is_file()


def prefix_problem(prefix: str) -> str | None:
    """A missing, partial or empty dataset at `prefix` (PREFIX.bin + PREFIX.idx), or None."""
    bin_file, idx_file = Path(f"{prefix}.bin"), Path(f"{prefix}.idx")
    if not bin_file.exists() and not idx_file.exists():
        if _is_number(prefix):
            return (f"data.paths: {prefix} is a number, not a dataset prefix: give blend weights in data.weights "
                    f"(one per path)")
        return (f"data.paths: no dataset at prefix {prefix} (expected {bin_file} and {idx_file}; create them with "
                f"tools/preprocess_data.py)")
    for present, missing in ((bin_file, idx_file), (idx_file, bin_file)):
        if not missing.exists():
            return (f"data.paths: {present} exists but {missing} is missing (an interrupted preprocessing run?): "
                    f"re-run tools/preprocess_data.py")
    for file in (bin_file, idx_file):
        if file.stat().st_size == 0:
            return f"data.paths: {file} is empty: re-run tools/preprocess_data.py"
    return None


def prefix_meta(prefix: str) -> dict | None:
    """PREFIX.json, which tools/preprocess_data.py writes beside the data (tokenizer, format, counts); None for a
    dataset another tool made (it has none); a ConfigError naming the file when it is not JSON."""
    meta_file = Path(f"{prefix}.json")
    if not meta_file.exists():
        return None
    try:
        return json.loads(meta_file.read_text())
    except ValueError as err:
        raise ConfigError(f"data.paths: {meta_file} is not valid JSON ({err})") from err


def format_problem(prefix: str, data_format: str) -> str | None:
    """The format PREFIX.json records (`sft`: conversations, written by --format sft; `preference`: pairs, by
    --format preference; else documents) against data.format (training/data/datasets.py check_prefix refuses the
    same on every rank)."""
    try:
        meta = prefix_meta(prefix)
    except ConfigError as err:
        return str(err)
    if meta is None or (written := meta.get("format", "text")) == data_format:
        return None
    holds = {"text": "plain documents", "sft": "conversations (tools/preprocess_data.py --format sft)",
             "preference": "preference pairs (tools/preprocess_data.py --format preference)"}
    return (f"data.paths: {prefix} holds {holds.get(written, written)}, but data.format={data_format}: set "
            f"data.format={written}" + (", or preprocess the records again with --format " + data_format
                                         if data_format != "text" else ""))


def tokenizer_problem(spec: str) -> str | None:
    """data.tokenizer: `byte`, a tokenizer.json, or a directory holding one (training/data/tokenizer.py)."""
    if spec == "byte":
        return None
    path = Path(spec)
    if path.is_dir() and not (path / "tokenizer.json").is_file():
        return f"data.tokenizer={spec}: no tokenizer.json in this directory"
    if not path.exists():
        return f"data.tokenizer={spec}: no such file (give `byte`, a local tokenizer.json or a directory holding one)"
    return None


def load_problem(spec: str | None) -> str | None:
    """checkpoint.load: null, auto, an iter_* directory, or a checkpoint.dir whose `latest` names one; complete
    (the rules of training/checkpoint/common.py resolve_path)."""
    if spec in (None, "auto"):
        return None
    path = Path(spec)
    if not path.exists():
        return f"checkpoint.load={spec} does not exist (use auto, null, or an existing checkpoint path)"
    if not path.is_dir():
        return f"checkpoint.load={spec} is a file, not a checkpoint directory (an iter_* directory or a checkpoint.dir)"
    if (path / LATEST).is_file():
        named = path / (path / LATEST).read_text().strip()
        if not is_complete(named):
            return (f"checkpoint.load={spec}: {path / LATEST} names {named}, which is missing or incomplete (no "
                    f"{RUN_FILE} / {METADATA}: an interrupted save?); point checkpoint.load at a complete iter_*")
        return None
    if is_complete(path):
        return None
    found = sorted(p.name for p in path.glob("iter_*") if is_complete(p))
    hint = (f"it holds {', '.join(found[-3:])} but no `{LATEST}` file: point checkpoint.load at one of them" if found
            else f"no `{LATEST}` file, no complete iter_* directory")
    return f"checkpoint.load={spec} is not a checkpoint (no {RUN_FILE} / {METADATA}; {hint})"


def path_problems(cfg: Config) -> list[str]:
    """Every missing file the config names and every dataset of another format, one line each (data.paths only
    when data.mock is off)."""
    prefixes, data_format = ([] if cfg.data.mock else [str(p) for p in cfg.data.paths]), str(cfg.data.format)
    found = [prefix_problem(p) or format_problem(p, data_format) for p in prefixes]
    if data_format in ("sft", "preference"):  # conversations: each with its loss mask (training/data/chat.py)
        found += [f"{problem} (the conversations' loss mask: tools/preprocess_data.py --format {data_format} "
                  f"writes it)"
                  for p, bad in zip(prefixes, list(found))
                  if not bad and (problem := prefix_problem(f"{p}{MASK_SUFFIX}"))]
    found += [tokenizer_problem(cfg.data.tokenizer), load_problem(cfg.checkpoint.load)]
    return [problem for problem in found if problem is not None]


def check_paths(cfg: Config) -> None:
    if found := path_problems(cfg):
        raise ConfigError("\n".join(found))


def _is_number(text: str) -> bool:
    try:
        float(text)
    except ValueError:
        return False
    return True
