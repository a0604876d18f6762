#!/usr/bin/env bash
# Shared by the launch scripts (sourced, not run; the caller has cd'd to the repository root):
# interpreter, environment for NCCL and Megatron-Core, config preflight, and DRY_RUN.
# Every variable below keeps a value the caller already exported.

PYTHON="${PYTHON:-$( [ -x .venv/bin/python ] && echo .venv/bin/python || echo python3 )}"

# One OpenMP thread per process: torch would otherwise start one per core in every process and
# oversubscribe the node (torchrun sets 1 too, with a warning). Raise it for CPU-heavy data work.
export OMP_NUM_THREADS="${OMP_NUM_THREADS:-1}"
# Megatron-Core's TP/SP communication overlap relies on kernels reaching the GPU in issue order,
# which one hardware queue per device guarantees (Megatron-LM warns without it).
export CUDA_DEVICE_MAX_CONNECTIONS="${CUDA_DEVICE_MAX_CONNECTIONS:-1}"
# A failed or timed-out NCCL collective aborts the process instead of hanging the whole job.
export TORCH_NCCL_ASYNC_ERROR_HANDLING="${TORCH_NCCL_ASYNC_ERROR_HANDLING:-1}"
# Growable allocator segments: activations of varying sizes fragment memory less (fewer OOMs near
# the limit that the planner's estimate assumes reachable).
export PYTORCH_CUDA_ALLOC_CONF="${PYTORCH_CUDA_ALLOC_CONF:-expandable_segments:True}"
# NCCL prints only warnings (e.g. a fallback from InfiniBand to TCP sockets). Opt in to NCCL_DEBUG=INFO
# for topology and transport details when a multi-node run is slow or hangs at start.
export NCCL_DEBUG="${NCCL_DEBUG:-WARN}"
# Python output reaches the log as it happens (SLURM logs, docker logs).
export PYTHONUNBUFFERED=1

die() {
  echo "error: $*" >&2
  exit 2
}

# require_uint NAME...: each named variable holds a non-negative integer.
require_uint() {
  local name
  for name in "$@"; do
    [[ "${!name}" =~ ^[0-9]+$ ]] || die "$name=${!name} must be a non-negative integer"
  done
}

default_nproc() {
  local gpus
  gpus=$(nvidia-smi -L 2>/dev/null | grep -c '^GPU' || true)
  if [ "${gpus:-0}" -gt 0 ]; then echo "$gpus"; else echo 2; fi
}

free_port() {
  "$PYTHON" -m training.net  # prints a free port (the one helper the tools and tests use too)
}

# check_config WORLD_SIZE PORT OVERRIDES...: validate the composed config for WORLD_SIZE processes
# before starting any (one line per problem); PORT, when not empty, must be free on this host.
check_config() {
  local world="$1" port="$2"
  shift 2
  WORLD_SIZE="$world" "$PYTHON" tools/check_config.py ${port:+--port "$port"} "$@"
}

# run_or_print COMMAND...: DRY_RUN=1 prints the exact command (shell-quoted); otherwise runs torchrun
# and relays signals, exiting with its status. SIGUSR1 (SLURM's pre-timeout warning, launch/slurm.sbatch;
# docker --init passes it here) goes to torchrun's workers, which checkpoint and exit 0
# (training/stopping.py): torchrun itself neither relays it (its workers run in their own sessions)
# nor survives it (default action), so it ignores it. SIGTERM/SIGINT go to torchrun, which stops them.
run_or_print() {
  if [ "${DRY_RUN:-0}" = "1" ]; then
    printf '%q ' "$@"
    echo
    return
  fi
  trap '' USR1  # inherited by torchrun; the workers install their own handler
  "$@" &
  launched=$!
  trap 'pkill -USR1 -P "$launched" || true' USR1
  trap 'kill -TERM "$launched" 2>/dev/null || true' TERM INT
  local status=0
  wait "$launched" || status=$?
  while kill -0 "$launched" 2>/dev/null; do  # a relayed signal interrupted wait: wait on
    status=0
    wait "$launched" || status=$?
  done
  exit "$status"
}

# exec_or_print COMMAND...: DRY_RUN=1 prints the exact command; otherwise replaces this shell with it
# (for docker: its client must receive the signals itself to proxy them into the container).
exec_or_print() {
  if [ "${DRY_RUN:-0}" = "1" ]; then
    printf '%q ' "$@"
    echo
  else
    exec "$@"
  fi
}
