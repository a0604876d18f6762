"""Weights & Biases, beside TensorBoard: the records metrics.jsonl gets, as a W&B run whose config is the run's
resolved config. An optional extra (`pip install -e '.[wandb]'`); train.wandb.mode=disabled (the default)
imports nothing. training/engine/metrics.py's MetricsLogger opens it on the rank that writes metrics.jsonl
(global rank 0) and hands it every record.

    sink = WandbSink(cfg, run_dir, resumed)   # cheap, on every rank
    sink.open()                               # rank 0: wandb.init (nothing when train.wandb.mode=disabled)
    sink.log(scalars, iteration)              # a record's numbers (the TensorBoard scalars), step=iteration
    sink.close()                              # wandb.finish

Resume: the W&B run id is kept in <run dir>/wandb_run_id. A run that resumed from its checkpoint (the same run
dir: the launch scripts' "resume with" line, a torchrun restart, a SLURM requeue) continues that W&B run
(resume="allow"); a fresh start begins a new one. A W&B run's steps only increase: online, iterations logged
after the checkpoint and before the stop keep their first values (docs/config.md).
"""

from __future__ import annotations

import os
from pathlib import Path

from training.config.schema import Config
from training.errors import ConfigError

ID_FILE = "wandb_run_id"  # in the run dir


class WandbSink:
    def __init__(self, cfg: Config, run_dir: str | Path, resumed: bool):
        self.cfg, self.run_dir, self.resumed, self.run = cfg, Path(run_dir), resumed, None

    def open(self) -> None:
        w = self.cfg.train.wandb
        if w.mode == "disabled":
            return
        try:
            import wandb
        except ImportError as err:  # validate() checked the package is there; a broken install lands here
            from training.config.validate import wandb_missing

            raise ConfigError(f"{wandb_missing(w.mode)} ({err})") from None
        from omegaconf import OmegaConf

        id_file = self.run_dir / ID_FILE
        previous = id_file.read_text().strip() if self.resumed and id_file.is_file() else None
        local = w.dir if w.dir is not None else os.environ.get("WANDB_DIR", str(self.run_dir))
        Path(local).mkdir(parents=True, exist_ok=True)
        config = OmegaConf.to_container(OmegaConf.structured(self.cfg), enum_to_str=True)
        try:
            self.run = wandb.init(project=w.project, entity=w.entity, name=w.name, mode=str(w.mode), dir=local,
                                  id=previous, resume="allow", config=config, notes=f"run dir: {self.run_dir}",
                                  settings=wandb.Settings(silent=True, console="off"))
        except wandb.errors.Error as err:  # no API key, an unknown entity, ...: the user's to fix
            raise ConfigError(f"train.wandb: W&B did not start the run: {err} (train.wandb.mode=offline needs no "
                              f"account)") from None
        id_file.write_text(self.run.id + "\n")
        files = Path(self.run.dir).parent  # <local>/wandb/<offline-run-...>/files -> the run's own directory
        where = self.run.url if w.mode == "online" else f"upload it with `wandb sync {files}`"
        print(f"W&B: {'continuing' if previous else 'new'} {w.mode} run {self.run.id}: {where}", flush=True)

    def log(self, scalars: dict[str, float], iteration: int) -> None:
        """metrics.py's scalars of one record (every number but the iteration), at step=iteration."""
        if self.run is not None:
            self.run.log(scalars, step=iteration)

    def close(self) -> None:
        if self.run is not None:
            self.run.finish()
            self.run = None
