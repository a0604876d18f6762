#!/usr/bin/env bash
# One node: torchrun with NPROC processes. Extra arguments are Hydra overrides.
#
#   launch/train.sh                                   # the embedded default
#   NPROC=2 launch/train.sh parallel.tp=2 train.iters=30
#   NPROC=8 launch/train.sh model=llama_1b parallel=tp2_sp train.precision=bf16
#   DRY_RUN=1 launch/train.sh parallel.tp=2           # print the command, run nothing
#
# Knobs (environment):
#   NPROC        processes on this node (default: number of GPUs, or 2 without GPUs)
#   RUN_DIR      run directory shared by all ranks (default: outputs/<date>/<time>; a hydra.run.dir=...
#                override wins)
#   MASTER_PORT  rendezvous port (default: a free one below the kernel's ephemeral range)
#   MAX_RESTARTS times torchrun restarts every rank after one dies (default 0); each restart resumes from the
#                newest complete checkpoint (checkpoint.load=auto)
#   PYTHON       interpreter (default: .venv/bin/python if present, else python3)
#   DRY_RUN=1    print the exact command instead of running it
#   (NCCL and Megatron-Core environment: launch/common.sh, each setting with its reason)
set -euo pipefail
cd "$(dirname "$0")/.."
# shellcheck source=launch/common.sh
source launch/common.sh

NPROC="${NPROC:-$(default_nproc)}"
run_dir_override="$(override_value hydra.run.dir "$@")"  # the user's hydra.run.dir=... wins (Hydra's last)
RUN_DIR="${run_dir_override:-${RUN_DIR:-outputs/$(date +%Y-%m-%d/%H-%M-%S)}}"  # one clock read: no midnight split
# A port the user gives must be free (one line if not); one picked here was free a moment ago, and is left to
# torchrun's bind: checking it again could only find it taken in between and blame the user for it.
user_port="${MASTER_PORT:-}"
MASTER_PORT="${MASTER_PORT:-$(free_port)}"

require_uint NPROC MASTER_PORT
check_config "$NPROC" "$user_port" "$@"
MAX_RESTARTS="${MAX_RESTARTS:-0}"
require_uint MAX_RESTARTS
# the c10d rendezvous (not torchrun's static one): each restart gets a fresh store, so restarted ranks
# never read their predecessors' addresses
cmd=("$PYTHON" -m torch.distributed.run --nnodes 1 --nproc-per-node "$NPROC" --max-restarts "$MAX_RESTARTS"
     --rdzv-backend c10d --rdzv-endpoint "127.0.0.1:$MASTER_PORT"
     train.py "hydra.run.dir=$RUN_DIR" "$@")
RESUME_CMD="$(printf '%q ' "$0" "$@")"
RESUME_CMD="${RESUME_CMD% }"
run_or_print "${cmd[@]}"
