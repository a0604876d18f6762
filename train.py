"""Train a GPT with Megatron-Core: Hydra config -> validation -> training/engine/loop.py.

    make train                                        # setup + the embedded default (2 CPU processes)
    NPROC=2 launch/train.sh parallel.tp=2 train.iters=30
    NPROC=8 launch/train.sh model=llama_1b parallel=tp2_sp train.precision=bf16
    python train.py train.iters=20                    # one process, no torchrun needed
    launch/multinode.sh / launch/slurm.sbatch / launch/docker.sh   # several nodes, SLURM, NGC container

Every rank runs this file; launch scripts give all ranks one run dir (`hydra.run.dir`). Invalid configs stop
with a one-line error per problem (exit 2) before any process group exists (training/engine/entry.py).
"""

import sys

import hydra

from training.config.schema import register
from training.engine.entry import precheck, start
from training.errors import exit_on_error
from training.shims.noise import quiet_known_noise

register()
quiet_known_noise()


@hydra.main(config_path="conf", config_name="config", version_base="1.3")
def main(composed) -> None:
    if code := exit_on_error(start, composed):
        sys.exit(code)


if __name__ == "__main__":  # the guard matters: dist_checkpointing's save re-imports __main__
    if code := exit_on_error(precheck, sys.argv[1:]):
        sys.exit(code)
    main()
