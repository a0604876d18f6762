"""What train.py runs on every rank: the composed config -> the typed config -> validation -> the loop.

    precheck(sys.argv[1:])    # before @hydra.main: a value the schema refuses is one line (Hydra prints several)
    start(composed)           # inside @hydra.main: paths, validation, the files named, the resolved config, the loop
"""

from __future__ import annotations

import os
from pathlib import Path

from training.config.schema import to_config


def precheck(argv: list[str]) -> None:
    """Compose as @hydra.main will, so that a value the schema refuses is one line (Hydra prints several)."""
    from training.config.compose import compose

    compose([arg for arg in argv if not arg.startswith("-")])


def check_launch_world() -> None:
    """launch/multinode.sh checked the config for NNODES x NPROC processes (LAUNCH_WORLD_SIZE); torchrun sums the
    nodes' own NPROC, so a node started with another NPROC makes a job of a size nobody checked."""
    from training.errors import ConfigError

    expected, world = os.environ.get("LAUNCH_WORLD_SIZE"), os.environ.get("WORLD_SIZE")
    if expected and world and expected != world:
        raise ConfigError(f"the job has {world} processes but the launcher checked the config for {expected} "
                          f"(NNODES x NPROC; this node runs {os.environ.get('LOCAL_WORLD_SIZE', '?')}): start "
                          f"every node with the same NPROC")


def start(composed) -> None:
    """Validate once and check the files the config names, before any process group (exit 2 with one line per
    problem), then train."""
    from hydra.core.hydra_config import HydraConfig
    from omegaconf import OmegaConf

    from training.config.paths import check_paths
    from training.config.validate import validate
    from training.engine.loop import run
    from training.parallel.dist import single_process_env

    check_launch_world()
    cfg = to_config(composed)
    run_dir = Path(HydraConfig.get().runtime.output_dir)
    if cfg.checkpoint.dir is not None and not os.path.isabs(cfg.checkpoint.dir):
        cfg.checkpoint.dir = str(run_dir / cfg.checkpoint.dir)  # relative: inside the run dir
    layout = validate(cfg)
    check_paths(cfg)  # python train.py alone refuses missing files too (the launch scripts checked them already)
    single_process_env()
    if os.environ.get("RANK", "0") == "0":
        run_dir.mkdir(parents=True, exist_ok=True)
        resolved = OmegaConf.to_yaml(OmegaConf.structured(cfg))
        (run_dir / "config.yaml").write_text(resolved)
        print(f"run dir: {run_dir}\n{resolved}", flush=True)
    run(cfg, layout, run_dir)
