"""What both checkpoint formats share: the state they save (TrainState), the run directory, run.json, the layout
record, the one load-error wrapper, the model's state-dict keys and the compatibility checks (whose rules,
readable from the files before any process, are training/config/checkpoint_match.py's).

    <checkpoint.dir>/iter_0000010/   the format's files (its own metadata.json) + run.json, written last
    <checkpoint.dir>/latest          "iter_0000010": the newest complete checkpoint

A checkpoint is complete when it has both run.json and metadata.json. run.json holds the iteration, the
consumed samples, the layout it was saved at (exactly tp, pp, dp, cp), the train dataset size, whether it
holds weights only, the vocabulary size, the resolved config and the versions it was written with. run.json
and `latest` are written atomically (temp file + rename).
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import subprocess
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol

import torch
from megatron.core import parallel_state
from torch.distributed.checkpoint.api import CheckpointException

from models.shape import ModelShape
from training.checkpoint.safe_load import UnsafeCheckpoint, safe_unpickling
from training.config import checkpoint_match
from training.config.checkpoint_match import complete_checkpoints, follow_latest, match_problems, saved_model_config
from training.config.paths import LATEST, METADATA, RUN_FILE, is_complete
from training.config.schema import Config
from training.errors import TemplateError
from training.parallel.dist import print0


class CheckpointError(TemplateError):
    pass


class TrainState(Protocol):
    """What a checkpoint saves and loads: training/engine/build.py's TrainState is one (declared here, below the
    engine, so that checkpoint/ never imports it)."""

    model: list[Any]  # this rank's model chunks (DDP- or FSDP-wrapped; bare when built without training)
    optimizer: Any  # Megatron-Core's optimizer (or its ChainedOptimizer); None when built without training
    scheduler: Any  # OptimizerParamScheduler, or None
    shape: ModelShape  # the resolved sizes (models/shape.py)


@dataclass(frozen=True)
class Start:
    """Where a run starts: from scratch, from this run's checkpoint (resumed), or from weights."""

    iteration: int = 0
    consumed_samples: int = 0
    resumed: bool = False  # a checkpoint of this run was loaded (it is already on disk)
    train_samples: int | None = None  # the train dataset size the checkpointed run was built with
    saved_config: dict | None = None  # the resumed checkpoint's config (run.json): what its schedule was built from


# --- the run directory -------------------------------------------------------------------------------------

def iter_dir(root: str | Path, iteration: int) -> Path:
    return Path(root) / f"iter_{iteration:07d}"


def atomic_write(path: Path, text: str) -> None:
    tmp = path.with_name(f".{path.name}.tmp{os.getpid()}")
    tmp.write_text(text)
    os.replace(tmp, path)


def versions() -> dict:
    from importlib.metadata import version

    try:
        commit = subprocess.run(["git", "rev-parse", "HEAD"], cwd=Path(__file__).parent, capture_output=True,
                                text=True, timeout=5).stdout.strip() or "unknown"
    except (OSError, subprocess.SubprocessError):
        commit = "unknown"
    return {"torch": torch.__version__, "megatron-core": version("megatron-core"), "template_commit": commit}


def prune(root: Path, keep: int) -> None:
    """Keep the newest `keep` complete checkpoints (0: all)."""
    if keep <= 0:
        return
    for old in complete_checkpoints(root)[keep:]:
        shutil.rmtree(old, ignore_errors=True)


def newest_complete(root: Path) -> Path | None:
    """The checkpoint `latest` names if it is complete (else a warning), else the newest complete one, else None."""
    return checkpoint_match.newest_complete(root, print0)


def resolve_load_path(cfg: Config) -> tuple[Path | None, bool]:
    """checkpoint.load -> (the iter_* directory to load or None to start fresh, weights only?): the rules of
    training/config/checkpoint_match.py load_target; a path must name a complete checkpoint."""
    path, weights_only = checkpoint_match.load_target(cfg, print0)
    return (None if path is None else resolve_path(path)), weights_only


def resolve_path(spec: str | Path) -> Path:
    """A checkpoint path: an iter_* directory, or a checkpoint.dir (its `latest`); must be complete."""
    path = follow_latest(Path(spec))
    if not is_complete(path):
        inside = path / "checkpoints"  # a run dir, given for its checkpoint.dir
        if not path.exists():
            raise CheckpointError(f"checkpoint {path}: no such directory")
        if (inside / LATEST).is_file() or complete_checkpoints(inside):
            raise CheckpointError(f"checkpoint {path} is a run dir, not a checkpoint: give {inside}")
        complete = complete_checkpoints(path.parent) if path.name.startswith("iter_") else complete_checkpoints(path)
        raise CheckpointError(f"checkpoint {path} is incomplete or not a checkpoint (no {RUN_FILE} / {METADATA}: an "
                              f"interrupted save?)" + (f"; the newest complete one: {complete[0]}" if complete else ""))
    return path


# --- the layout record ---------------------------------------------------------------------------------------

def layout() -> dict:
    """This process's layout as run.json records it: exactly tp, pp, dp, cp (old checkpoints keep loading)."""
    return {"tp": parallel_state.get_tensor_model_parallel_world_size(),
            "pp": parallel_state.get_pipeline_model_parallel_world_size(),
            "dp": parallel_state.get_data_parallel_world_size(),
            "cp": parallel_state.get_context_parallel_world_size()}


def same_tp_pp(run: dict) -> bool:
    """Saved at this run's TP and PP (the model's shards and the RNG streams per (pp, tp) rank line up)."""
    now = layout()
    return all(run["layout"][k] == now[k] for k in ("tp", "pp"))


# --- errors ------------------------------------------------------------------------------------------------

def describe(err: BaseException, limit: int = 400) -> str:
    """`Type: its message` on one line (its lines joined by " / ", at most `limit` characters): DCP's messages
    name the file that failed on their second line."""
    text = " / ".join(line.strip() for line in str(err).splitlines() if line.strip())
    return f"{type(err).__name__}: {text[:limit]}{'...' if len(text) > limit else ''}"


def earlier(path: Path) -> str:
    """"; an earlier complete checkpoint: DIR" when path's directory holds one older than path, else ""."""
    older = [p for p in complete_checkpoints(path.parent) if p.name < path.name]
    return f"; an earlier complete checkpoint: {older[0]}" if older else ""


def read_run(path: Path) -> dict:
    """A checkpoint's run.json (its config and progress), or one CheckpointError naming the file."""
    try:
        return json.loads((path / RUN_FILE).read_text())
    except (OSError, ValueError) as err:
        raise CheckpointError(f"cannot load checkpoint {path}: {RUN_FILE}: {describe(err)}{earlier(path)}") from None


def _chain(err: BaseException, seen: set | None = None):
    """err and its causes, also the per-rank failures DCP's CheckpointException wraps."""
    seen = set() if seen is None else seen
    while err is not None and id(err) not in seen:
        seen.add(id(err))
        yield err
        for failure in getattr(err, "failures", {}).values():  # rank -> (exception, its stack)
            failure = failure[0] if isinstance(failure, tuple) else failure
            if isinstance(failure, BaseException):
                yield from _chain(failure, seen)
        err = err.__cause__ or err.__context__


@contextlib.contextmanager
def loading(what: str, path: Path | None = None):
    """Read checkpoint files: nothing in them runs code (safe_load.py), and any failure becomes one
    CheckpointError, "cannot load <what>: <cause>", the cause an UnsafeCheckpoint if one is in the chain, and
    an earlier complete checkpoint beside `path` if there is one."""
    try:
        with safe_unpickling():
            yield
    except (Exception, CheckpointException) as err:  # noqa: BLE001 - the files are not usable (DCP's exception
        # for a failure on some rank derives from BaseException, not Exception)
        cause = next((e for e in _chain(err) if isinstance(e, UnsafeCheckpoint)), err)
        raise CheckpointError(f"cannot load {what}: {describe(cause)}{earlier(path) if path else ''}") from err


# --- the model and compatibility -----------------------------------------------------------------------------

def model_keys(chunks: list) -> list[str]:
    """The state-dict key of each model chunk: "model", or model0, model1, ... (virtual pipeline)."""
    return ["model"] if len(chunks) == 1 else [f"model{i}" for i in range(len(chunks))]


def check_match(run: dict, cfg: Config, shape: ModelShape, path: Path, weights_only: bool) -> None:
    """Refuse a checkpoint written with another tokenizer, whose model differs from the config's (every field
    named), or that holds weights only without checkpoint.finetune (training/config/checkpoint_match.py, the
    rules tools/check_config.py applies before the launch)."""
    from training.data.tokenizer import build_tokenizer

    if problems := match_problems(run, cfg, shape, path, weights_only, build_tokenizer):
        raise CheckpointError("\n".join(problems))


def check_same_optimizer(cfg: Config, run: dict, path: Path) -> None:
    """The distributed and the plain optimizer save different state layouts: resume with the same one."""
    saved = run["config"]["parallel"]["dist_opt"]
    if saved != cfg.parallel.dist_opt:
        raise CheckpointError(
            f"checkpoint {path} was saved with parallel.dist_opt={str(saved).lower()} but this run has "
            f"parallel.dist_opt={str(cfg.parallel.dist_opt).lower()}: resume with the same setting (TP, PP and "
            f"DP may change), or load the weights only with checkpoint.finetune=true")
