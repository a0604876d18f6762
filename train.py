"""Train a GPT with Megatron-Core: Hydra config -> validation -> training.engine.loop.run.

    make train                                        # setup + the embedded default (2 CPU processes)
    NPROC=2 launch/train.sh parallel.tp=2 train.iters=30
    NPROC=8 launch/train.sh model=llama_1b parallel=tp2_sp train.precision=bf16
    python train.py train.iters=20                    # one process, no torchrun needed
    launch/multinode.sh / launch/slurm.sbatch / launch/docker.sh   # several nodes, SLURM, NGC container

Every rank runs this file; launch scripts give all ranks one run dir (`hydra.run.dir`). Invalid
configs stop here with a one-line error per problem (exit 2) before any process group exists: values
the schema refuses while composing, then the cross-field rules (training/config/validate.py), checked once.
"""

import os
import sys
from pathlib import Path

import hydra
from hydra.core.hydra_config import HydraConfig
from omegaconf import DictConfig, OmegaConf

from training.config.schema import register, to_config
from training.errors import exit_on_error
from training.shims.noise import quiet_known_noise

register()
quiet_known_noise()


def precheck(argv: list[str]) -> None:
    """Compose as @hydra.main will, so that a value the schema refuses is one line (Hydra prints several)."""
    from training.config.compose import compose

    compose([arg for arg in argv if not arg.startswith("-")])


def start(composed: DictConfig) -> None:
    from training.config.validate import validate
    from training.parallel.dist import single_process_env

    cfg = to_config(composed)
    run_dir = Path(HydraConfig.get().runtime.output_dir)
    if cfg.checkpoint.dir is not None and not os.path.isabs(cfg.checkpoint.dir):
        cfg.checkpoint.dir = str(run_dir / cfg.checkpoint.dir)
    layout = validate(cfg)
    single_process_env()
    if os.environ.get("RANK", "0") == "0":
        run_dir.mkdir(parents=True, exist_ok=True)
        resolved = OmegaConf.to_yaml(OmegaConf.structured(cfg))
        (run_dir / "config.yaml").write_text(resolved)
        print(f"run dir: {run_dir}\n{resolved}", flush=True)
    from training.engine.loop import run

    run(cfg, layout, run_dir)


@hydra.main(config_path="conf", config_name="config", version_base="1.3")
def main(composed: DictConfig) -> None:
    if code := exit_on_error(start, composed):
        sys.exit(code)


if __name__ == "__main__":  # the guard matters: dist_checkpointing's save re-imports __main__
    if code := exit_on_error(precheck, sys.argv[1:]):
        sys.exit(code)
    main()
