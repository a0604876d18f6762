"""Train a GPT with Megatron-Core: Hydra config -> validation -> training.loop.run.

    make train                                        # setup + the embedded default (2 CPU processes)
    NPROC=2 launch/train.sh parallel.tp=2 train.iters=30
    NPROC=8 launch/train.sh model=llama_1b parallel=tp2_sp train.precision=bf16
    python train.py train.iters=20                    # one process, no torchrun needed
    launch/multinode.sh / launch/slurm.sbatch / launch/docker.sh   # several nodes, SLURM, NGC container

Every rank runs this file; launch scripts give all ranks one run dir (`hydra.run.dir`). Invalid
configs stop here with a one-line error per problem (exit 2) before any process group exists.
"""

import os
import sys
from pathlib import Path

import hydra
from hydra.core.hydra_config import HydraConfig
from omegaconf import DictConfig, OmegaConf

from training.config import register, to_config
from training.errors import TemplateError
from training.noise import quiet_known_noise

register()
quiet_known_noise()


def single_process_defaults() -> None:
    """`python train.py` without torchrun: a world of one on a free local port."""
    if "RANK" not in os.environ and "WORLD_SIZE" not in os.environ:
        import socket

        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        os.environ.update(RANK="0", LOCAL_RANK="0", WORLD_SIZE="1", MASTER_ADDR="127.0.0.1",
                          MASTER_PORT=str(port))


@hydra.main(config_path="conf", config_name="config", version_base="1.3")
def main(composed: DictConfig) -> None:
    rank0 = os.environ.get("RANK", "0") == "0"
    try:
        cfg = to_config(composed)
        run_dir = Path(HydraConfig.get().runtime.output_dir)
        if cfg.checkpoint.dir is not None and not os.path.isabs(cfg.checkpoint.dir):
            cfg.checkpoint.dir = str(run_dir / cfg.checkpoint.dir)
        from training.validate import validate

        validate(cfg)
        single_process_defaults()
        if rank0:
            run_dir.mkdir(parents=True, exist_ok=True)
            (run_dir / "config.yaml").write_text(OmegaConf.to_yaml(OmegaConf.structured(cfg)))
            print(f"run dir: {run_dir}\n{OmegaConf.to_yaml(OmegaConf.structured(cfg))}", flush=True)
        from training.loop import run

        run(cfg, run_dir)
    except TemplateError as err:
        if rank0:
            print("\n".join(f"error: {line}" for line in str(err).splitlines()), file=sys.stderr, flush=True)
        sys.exit(2)


if __name__ == "__main__":  # the guard matters: dist_checkpointing's save re-imports __main__
    main()
