#!/usr/bin/env bash
# Shared by the launch scripts (sourced, not run; the caller has cd'd to the repository root):
# interpreter, environment for NCCL and Megatron-Core, config preflight, and DRY_RUN.
# Every variable below keeps a value the caller already exported.

PYTHON="${PYTHON:-$( [ -x .venv/bin/python ] && echo .venv/bin/python || echo python3 )}"

# One OpenMP thread per process: torch would otherwise start one per core in every process and
# oversubscribe the node (torchrun sets 1 too, with a warning). Raise it for CPU-heavy data work.
export OMP_NUM_THREADS="${OMP_NUM_THREADS:-1}"
# Megatron-Core's TP/SP communication overlap relies on kernels reaching the GPU in issue order,
# which one hardware queue per device guarantees (Megatron-LM warns without it). Megatron-FSDP wants the
# opposite (its all-gathers overlap on other queues): training/engine/loop.py raises it to 8 under parallel.fsdp.
export CUDA_DEVICE_MAX_CONNECTIONS="${CUDA_DEVICE_MAX_CONNECTIONS:-1}"
# A failed or timed-out NCCL collective aborts the process instead of hanging the whole job.
export TORCH_NCCL_ASYNC_ERROR_HANDLING="${TORCH_NCCL_ASYNC_ERROR_HANDLING:-1}"
# NCCL's flight recorder: the last 2000 collectives of every rank, dumped (to TORCH_NCCL_DEBUG_INFO_TEMP_FILE,
# /tmp/nccl_trace_rank_<n> by default) when a collective times out: which rank never joined which collective.
export TORCH_NCCL_TRACE_BUFFER_SIZE="${TORCH_NCCL_TRACE_BUFFER_SIZE:-2000}"
export TORCH_NCCL_DUMP_ON_TIMEOUT="${TORCH_NCCL_DUMP_ON_TIMEOUT:-1}"
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
  "$PYTHON" -m training.parallel.spawn  # prints a free port (the one helper the tools and tests use too)
}

# check_config WORLD_SIZE PORT OVERRIDES...: validate the composed config for WORLD_SIZE processes
# before starting any (one line per problem); PORT, when not empty, must be free on this host.
check_config() {
  local world="$1" port="$2"
  shift 2
  WORLD_SIZE="$world" "$PYTHON" tools/check_config.py ${port:+--port "$port"} "$@"
}

# run_or_print COMMAND...: DRY_RUN=1 prints the exact command (shell-quoted); otherwise runs torchrun,
# relays signals and exits with its status. SIGUSR1 (SLURM's pre-timeout warning, launch/slurm.sbatch;
# docker --init passes it here) and SIGTERM / SIGINT (a scheduler's stop, Ctrl-C) go to torchrun's workers,
# which checkpoint and exit 0 (training/engine/stopping.py); torchrun then ends on its own, without the
# SignalException traceback it prints when signalled itself, so it runs in its own session (a terminal's
# Ctrl-C reaches this script only) and ignores SIGUSR1. After a SIGTERM / SIGINT stop one line says where
# the run stopped and how to resume (stop_summary), exit 0; after a failure one line names the rank that
# died (failure_summary), exit torchrun's status. The caller sets RESUME_CMD (the command that resumes).
run_or_print() {
  if [ "${DRY_RUN:-0}" = "1" ]; then
    printf '%q ' "$@"
    echo
    return
  fi
  local errlog status=0 stopped=""
  errlog=$(mktemp)
  trap '' USR1  # inherited by torchrun; the workers install their own handler
  $(command -v setsid || true) "$@" 2> >(tee "$errlog" >&2) &
  launched=$!
  trap 'pkill -USR1 -P "$launched" || true' USR1
  trap 'stopped=TERM; pkill -TERM -P "$launched" || true' TERM
  trap 'stopped=INT; pkill -TERM -P "$launched" || true' INT
  wait "$launched" || status=$?
  while kill -0 "$launched" 2>/dev/null; do  # a relayed signal interrupted wait: wait on
    status=0
    wait "$launched" || status=$?
  done
  sleep 0.2  # tee's last lines
  if [ -n "$stopped" ] && [ "$status" = 0 ]; then
    stop_summary "$stopped"
  elif [ "$status" != 0 ]; then
    failure_summary "$errlog" "$status"
  fi
  rm -f "$errlog"
  exit "$status"
}

# stop_summary SIGNAL: the checkpoint a signalled stop left and the command that resumes from it.
stop_summary() {
  local latest="$RUN_DIR/checkpoints/latest"
  if [ -f "$latest" ]; then
    local name
    name=$(cat "$latest")
    echo "stopped by SIG$1 at iteration $((10#${name#iter_})): checkpoint $RUN_DIR/checkpoints/$name saved;" \
         "resume with: RUN_DIR=$RUN_DIR ${RESUME_CMD:-the same command}"
  else
    echo "stopped by SIG$1 before any checkpoint was saved (none in $RUN_DIR/checkpoints)"
  fi
}

# failure_summary TORCHRUN_STDERR STATUS: one line naming the failed rank, from torchrun's report: a rank
# killed by a signal first (its peers then fail too, on the broken connection), else the root cause.
failure_summary() {
  local rank code restarts latest="$RUN_DIR/checkpoints/latest" how="" failed
  # "rank code" per failed worker of the last report, a killed one (negative code) first
  failed=$(awk '/^ *rank *:/ {r=$3} /^ *exitcode *:/ {print r, $3}' "$1" | sort -k2,2n | head -n 1)
  rank=${failed%% *}
  code=${failed##* }
  restarts=$(grep -c "will restart worker group" "$1" || true)
  case "${code:-}" in -*) how=" (killed by signal ${code#-})" ;; esac
  echo "error: training failed: rank ${rank:-?} exited with code ${code:-$2}$how, after $restarts of" \
       "MAX_RESTARTS=${MAX_RESTARTS:-0} restart(s); the newest checkpoint:" \
       "$([ -f "$latest" ] && echo "$RUN_DIR/checkpoints/$(cat "$latest")" || echo none);" \
       "the same command resumes from it" >&2
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
