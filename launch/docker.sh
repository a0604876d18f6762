#!/usr/bin/env bash
# Run a launch script (or any command) inside the NGC PyTorch container, built from the Dockerfile on
# first use. The repository is mounted at the image's working dir (the image's editable install points
# at it, so edits need no rebuild) and DATA_DIR at /data. Arguments: the command, then its overrides.
#
#   launch/docker.sh                                          # launch/train.sh, all GPUs of this node
#   launch/docker.sh launch/train.sh model=llama_1b parallel=tp2_sp train.precision=bf16
#   NNODES=2 NODE_RANK=0 MASTER_ADDR=10.0.0.1 RUN_ID=a launch/docker.sh launch/multinode.sh parallel.tp=8
#   launch/docker.sh python tools/plan.py model=llama2_7b     # anything else
#   DRY_RUN=1 launch/docker.sh launch/train.sh parallel.tp=2  # print the docker command, run nothing
#
# Knobs (environment):
#   NGC_TAG    NGC PyTorch release (default: the Dockerfile's ARG NGC_TAG; tests/test_launch.py keeps them equal)
#   IMAGE      image to run (default: mcore-template:$NGC_TAG, built from the Dockerfile if missing)
#   DATA_DIR   host directory mounted at /data, e.g. for data.paths=[/data/...] (default: ./data)
#   DRY_RUN=1  print the exact docker command instead of running it
# The launch knobs (NPROC, NNODES, NODE_RANK, MASTER_ADDR, MASTER_PORT, RUN_ID, RUN_DIR, LOCAL_ADDR, MAX_RESTARTS,
# RDZV_TIMEOUT), NCCL_*, TORCH_NCCL_*, TORCH_FR_*, UCX_*, FI_*, GLOO_SOCKET_IFNAME, CUDA_DEVICE_MAX_CONNECTIONS and
# the allocator settings are passed into the container when set. An absolute RUN_DIR is mounted at its own path;
# the container runs as the calling user (files it writes are yours, not root's); InfiniBand devices are passed
# when the host has them (without them NCCL falls back to TCP sockets, saying so only at NCCL_DEBUG=INFO).
# For one workstation: inside a SLURM job, use launch/slurm.sbatch with CONTAINER_IMAGE (pyxis/enroot) instead:
# docker would run outside the job's cgroup and GPU binding, and outlive a cancelled step.
set -euo pipefail
cd "$(dirname "$0")/.."
# shellcheck source=launch/common.sh
source launch/common.sh

NGC_TAG="${NGC_TAG:-26.08-py3}"
IMAGE="${IMAGE:-mcore-template:$NGC_TAG}"
DATA_DIR="${DATA_DIR:-$PWD/data}"
WORKDIR=/workspace/mcore-template  # the Dockerfile's WORKDIR
[ $# -gt 0 ] || set -- launch/train.sh
[ -z "${SLURM_JOB_ID:-}" ] || die "inside SLURM job $SLURM_JOB_ID docker runs outside the" \
  "job's cgroup: use CONTAINER_IMAGE=<image> sbatch launch/slurm.sbatch (pyxis/enroot)"

# Host network: the rendezvous and NCCL reach other nodes directly. --init: a PID 1 that relays
# signals (SIGUSR1 from SLURM, SIGTERM from docker stop) to the launch script. PYTHON=python: the
# image's interpreter, not a host .venv inside the mounted repository.
# --user: HOME=/tmp inside, the user's home is not in the image.
envs=(-e PYTHON=python -e HOME=/tmp)
for name in NPROC NNODES NODE_RANK MASTER_ADDR MASTER_PORT RUN_ID RUN_DIR LOCAL_ADDR MAX_RESTARTS RDZV_TIMEOUT \
            GLOO_SOCKET_IFNAME CUDA_DEVICE_MAX_CONNECTIONS PYTORCH_ALLOC_CONF PYTORCH_CUDA_ALLOC_CONF \
            $(compgen -v NCCL_ || true) $(compgen -v TORCH_NCCL_ || true) $(compgen -v TORCH_FR_ || true) \
            $(compgen -v UCX_ || true) $(compgen -v FI_ || true); do
  if [ -n "${!name:-}" ]; then envs+=(-e "$name=${!name}"); fi
done
mounts=(-v "$PWD:$WORKDIR" -v "$DATA_DIR:/data")
[[ "${RUN_DIR:-}" != /* ]] || mounts+=(-v "$RUN_DIR:$RUN_DIR")  # checkpoints outlive the container
devices=()
[ ! -d /dev/infiniband ] || devices=(--device /dev/infiniband --cap-add IPC_LOCK)  # RDMA for NCCL
cmd=(docker run --rm --init --gpus all --ipc=host --network=host --user "$(id -u):$(id -g)" "${devices[@]}"
     --ulimit memlock=-1 --ulimit stack=67108864
     "${mounts[@]}" -w "$WORKDIR" "${envs[@]}" "$IMAGE" "$@")
if [ "${DRY_RUN:-0}" != 1 ]; then
  command -v docker >/dev/null || die "docker is not installed here (DRY_RUN=1 prints the command)"
  if ! docker image inspect "$IMAGE" >/dev/null 2>&1; then
    echo "building $IMAGE from the Dockerfile (first use)" >&2
    docker build --build-arg "NGC_TAG=$NGC_TAG" -t "$IMAGE" .
  fi
  mkdir -p "$DATA_DIR" ${RUN_DIR:+"$RUN_DIR"}
fi
exec_or_print "${cmd[@]}"
