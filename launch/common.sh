#!/usr/bin/env bash
# Shared by the launch scripts (sourced, not run): interpreter, defaults, environment, preflight.

PYTHON="${PYTHON:-$( [ -x .venv/bin/python ] && echo .venv/bin/python || echo python3 )}"

# Threads per process: the CPU cores shared evenly (torch would otherwise start one per core in
# every process and oversubscribe the machine).
export OMP_NUM_THREADS="${OMP_NUM_THREADS:-1}"
# Megatron-Core with TP/SP overlap needs kernels queued in issue order on one hardware queue.
export CUDA_DEVICE_MAX_CONNECTIONS="${CUDA_DEVICE_MAX_CONNECTIONS:-1}"
# A failed NCCL collective raises in the process instead of hanging the job.
export TORCH_NCCL_ASYNC_ERROR_HANDLING="${TORCH_NCCL_ASYNC_ERROR_HANDLING:-1}"
# Python output reaches the log as it happens.
export PYTHONUNBUFFERED=1

default_nproc() {
  local gpus
  gpus=$(nvidia-smi -L 2>/dev/null | grep -c '^GPU' || true)
  if [ "${gpus:-0}" -gt 0 ]; then echo "$gpus"; else echo 2; fi
}

free_port() {
  "$PYTHON" -c 'import socket; s = socket.socket(); s.bind(("", 0)); print(s.getsockname()[1])'
}

# Validate the composed config for WORLD_SIZE processes before starting any (one line per problem).
check_config() {
  local world="$1"; shift
  WORLD_SIZE="$world" "$PYTHON" tools/check_config.py --port "$MASTER_PORT" "$@"
}

run_or_print() {
  if [ "${DRY_RUN:-0}" = "1" ]; then
    printf '%q ' "$@"; echo
  else
    exec "$@"
  fi
}
