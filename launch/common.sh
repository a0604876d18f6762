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
# A failed or timed-out NCCL collective aborts the process instead of hanging the whole job: torch's own default
# (3: abort without the cleanup that can itself hang), which the flight recorder's dump on timeout relies on.
export TORCH_NCCL_ASYNC_ERROR_HANDLING="${TORCH_NCCL_ASYNC_ERROR_HANDLING:-3}"
# NCCL's flight recorder: the last 2000 collectives of every rank, dumped when a collective times out: which rank
# never joined which collective. The dumps go under the run dir (run_or_print sets TORCH_FR_DUMP_TEMP_FILE to
# RUN_DIR/flight_recorder/rank_; torch's default is node-local /tmp, gone with the node).
# (TORCH_FR_BUFFER_SIZE: the name the pinned torch reads; its old name TORCH_NCCL_TRACE_BUFFER_SIZE, which an
# older container's torch reads, makes every rank print a deprecation line: set it yourself for such a torch.)
export TORCH_FR_BUFFER_SIZE="${TORCH_FR_BUFFER_SIZE:-${TORCH_NCCL_TRACE_BUFFER_SIZE:-2000}}"
export TORCH_NCCL_DUMP_ON_TIMEOUT="${TORCH_NCCL_DUMP_ON_TIMEOUT:-1}"
# Growable allocator segments: activations of varying sizes fragment memory less (fewer OOMs near
# the limit that the planner's estimate assumes reachable).
# torch reads PYTORCH_CUDA_ALLOC_CONF first, then its newer name PYTORCH_ALLOC_CONF (an older container's torch
# reads only the first): set the first only when the user set neither, so a user's PYTORCH_ALLOC_CONF holds.
[ -n "${PYTORCH_ALLOC_CONF:-}" ] ||
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
# before starting any (one line per problem); PORT, when not empty, must be free on this host. RUN_DIR, when
# set, is where checkpoint.load=auto looks. It creates nothing: a refused run leaves no run dir.
check_config() {
  local world="$1" port="$2"
  shift 2
  WORLD_SIZE="$world" "$PYTHON" tools/check_config.py ${port:+--port "$port"} ${RUN_DIR:+--run-dir "$RUN_DIR"} "$@"
}

# override_value KEY ARGS...: the value the last KEY=... (or +KEY=, ++KEY=) among the Hydra overrides ARGS sets
# (Hydra's last one wins), empty if none.
override_value() {
  local key="$1" arg value=""
  shift
  for arg in "$@"; do
    case "$arg" in "$key="* | "+$key="* | "++$key="*) value="${arg#*=}" ;; esac
  done
  printf '%s' "$value"
}

# What torchrun writes passes through two awk filters (mawk reads a pipe in blocks unless -W interactive): on
# stderr launch/filter.awk (it drops torchrun's own report and notes what the summary needs in NOTES); on stdout
# STDOUT_WATCH, which notes `rundir DIR` and `stop N` (rank 0's "run dir:" and "stopping at iteration N" lines).
AWK=(awk)
awk -W version 2>/dev/null | grep -q mawk && AWK=(awk -W interactive)
STDERR_FILTER="$(dirname "${BASH_SOURCE[0]}")/filter.awk"
# shellcheck disable=SC2016
STDOUT_WATCH='
{ print; fflush() }
/^run dir: / { print "rundir " substr($0, 10) >> notes; fflush(notes) }
/^stopping at iteration [0-9]+: / { sub(/:$/, "", $4); print "stop " $4 >> notes; fflush(notes) }'

# run_or_print COMMAND...: DRY_RUN=1 prints the exact command (shell-quoted); otherwise runs torchrun in its own
# session (a terminal's Ctrl-C reaches this script only), its output through the filters above, and ends with one
# summary line and the exit code (docs/faults.md):
# - a stop: SIGTERM / SIGINT to this script (relayed to torchrun's workers) or to torchrun itself (it relays to
#   them), or both at once (SLURM signals every process of the step): the workers checkpoint and exit 0
#   (training/engine/stopping.py); stop_summary says where and how to resume; exit 0 for a clean stop.
# - a failure: failure_summary names the rank that failed first; exit 2 / 3 when that rank exited 2 (the user's
#   error, whose `error:` lines are then the last before the summary) / 3 (watchdog), else torchrun's status.
# SIGUSR1 (SLURM's pre-timeout warning, launch/slurm.sbatch) is relayed to the workers; torchrun and the filters
# ignore it. The caller sets RUN_DIR and RESUME_CMD (the command that resumes).
run_or_print() {
  if [ "${DRY_RUN:-0}" = "1" ]; then
    printf '%q ' "$@"
    echo
    return
  fi
  local status=0 stopped="" out_fd err_fd out_pid err_pid sig
  export TORCH_FR_DUMP_TEMP_FILE="${TORCH_FR_DUMP_TEMP_FILE:-$RUN_DIR/flight_recorder/rank_}"  # <prefix><rank>
  mkdir -p "$(dirname "$TORCH_FR_DUMP_TEMP_FILE")"
  NOTES=$(mktemp)
  export TEMPLATE_ERRORS_FROM_EVERY_RANK=1  # every rank prints its errors; the filter says each once (above)
  trap '' USR1  # inherited by the filters and torchrun; the workers install their own handler
  exec {out_fd}> >(trap '' TERM INT; exec "${AWK[@]}" -v notes="$NOTES" "$STDOUT_WATCH")
  out_pid=$!
  exec {err_fd}> >(trap '' TERM INT; exec "${AWK[@]}" -v notes="$NOTES" -f "$STDERR_FILTER" >&2)
  err_pid=$!
  $(command -v setsid || true) "$@" 1>&"$out_fd" 2>&"$err_fd" &
  launched=$!
  exec {out_fd}>&- {err_fd}>&-
  trap 'pkill -USR1 -P "$launched" || true' USR1
  # no workers yet (torchrun in its rendezvous): to torchrun, which then ends (SignalException, filtered)
  # a second signal (the user's second Ctrl-C, a scheduler's during the save at the stop) is relayed the same way;
  # the summary names the first
  trap 'stopped=${stopped:-TERM}; pkill -TERM -P "$launched" || kill -TERM "$launched" 2>/dev/null || true' TERM
  # Ctrl-C reaches the ranks as SIGINT (their stop handler takes both): the ranks' line and the summary name one signal
  trap 'stopped=${stopped:-INT}; pkill -INT -P "$launched" || kill -INT "$launched" 2>/dev/null || true' INT
  wait "$launched" || status=$?
  while kill -0 "$launched" 2>/dev/null; do  # a relayed signal interrupted wait: wait on
    status=0
    wait "$launched" || status=$?
  done
  for _ in $(seq 100); do  # the filters' last lines (up to 10 s: an orphan may hold the pipe open)
    kill -0 "$out_pid" 2>/dev/null || kill -0 "$err_pid" 2>/dev/null || break
    sleep 0.1
  done
  # an orphan of a killed rank that still holds their input would keep the filters, and with them this script's
  # output (a pipe a caller reads to its end), open after this script ends: they ignore TERM (above)
  kill -KILL "$out_pid" "$err_pid" 2>/dev/null || true
  summary_status=$status
  sig=$(note sig)
  [ -n "$sig" ] && stopped=${stopped:-$(kill -l "$sig")}  # torchrun itself was signalled
  if [ -n "$stopped" ] && { [ "$status" = 0 ] || [ -n "$sig" ]; }; then
    stop_summary "$stopped" "$status"
  elif [ "$status" != 0 ]; then
    failure_summary "$status"
  fi
  status=$summary_status
  rm -f "$NOTES"
  exit "$status"
}

# note KEY: the last value noted for KEY (empty if none).
note() {
  awk -v key="$1" '$1 == key { sub(/^[^ ]+ ?/, ""); v = $0 } END { printf "%s", v }' "$NOTES"
}

# run_dir: the run dir rank 0 reported (Hydra's, absolute), else the one the launch script passed.
run_dir() {
  local dir
  dir=$(note rundir)
  echo "${dir:-$RUN_DIR}"
}

# checkpoint_dir RUN_DIR: where the run saves (checkpoint.dir of the config rank 0 wrote, absolute; empty when
# checkpoint.dir is null), else RUN_DIR/checkpoints.
checkpoint_dir() {
  local dir=""
  [ -f "$1/config.yaml" ] && dir=$(awk '/^checkpoint:/ {c = 1; next} /^[^ ]/ {c = 0}
    c && $1 == "dir:" {sub(/^ *dir: */, ""); gsub(/^['"'"'"]|['"'"'"]$/, ""); print; exit}' "$1/config.yaml")
  [ "$dir" = null ] && return
  echo "${dir:-$1/checkpoints}"
}

# newest_checkpoint CHECKPOINT_DIR: the name `latest` gives (empty if none).
newest_checkpoint() {
  [ -n "$1" ] && [ -f "$1/latest" ] && cat "$1/latest"
  true
}

# stop_summary SIGNAL STATUS: where a signalled stop left the run. Exit (summary_status) 0 when the ranks
# stopped cleanly (a checkpoint at the stop, unless checkpoint.dir is null); 128 + the signal when torchrun was
# signalled and they did not (killed after torchrun's --shutdown-timeout, 30 s).
stop_summary() {
  local dir ckpts latest at clean=0
  dir=$(run_dir)
  ckpts=$(checkpoint_dir "$dir")
  latest=$(newest_checkpoint "$ckpts")
  at=$(note stop)
  if [ -z "$at" ] && [ "$2" = 0 ] && [ -n "$latest" ]; then at=$((10#${latest#iter_})); fi
  [ -n "$at" ] && { [ -z "$ckpts" ] || { [ -n "$latest" ] && [ "$((10#${latest#iter_}))" = "$at" ]; }; } && clean=1
  summary_status=$([ "$clean" = 1 ] || [ "$2" = 0 ] && echo 0 || echo $((128 + $(kill -l "$1"))))
  if [ "$clean" = 1 ] && [ -n "$ckpts" ]; then
    echo "stopped by SIG$1 at iteration $at: checkpoint $ckpts/$latest saved; resume with: RUN_DIR=$dir" \
         "${RESUME_CMD:-the same command}"
  elif [ "$clean" = 1 ]; then
    echo "stopped by SIG$1 at iteration $at; run dir $dir (checkpoint.dir is null: no checkpoint)"
  elif [ -n "$latest" ]; then
    echo "stopped by SIG$1 before a checkpoint at the stop was saved; run dir $dir; the newest checkpoint:" \
         "$ckpts/$latest; resume with: RUN_DIR=$dir ${RESUME_CMD:-the same command}"
  else
    echo "stopped by SIG$1 before any checkpoint was saved; run dir $dir (no checkpoint in ${ckpts:-it})"
  fi
}

# failure_summary STATUS: one line naming the rank that failed first, from torchrun's report (the ranks it
# stopped itself, by SIGTERM, last; a rank that exited 2, the user's error, or was killed by another signal
# first; then torchrun's own "first observed"), the run dir, the newest checkpoint and, only if there is one,
# the command that resumes from it. Exit (summary_status) 2 or 3 when that rank exited so, else STATUS. Another
# node's torchrun (launch/multinode.sh) that lost node 0's rendezvous store (`rdzv lost`: node 0's torchrun ended)
# says so; one that never reached it (`rdzv connect`) says where it looked, exit 2.
failure_summary() {
  local first rank code how="" dir ckpts latest restarts where rdzv
  first=$(awk '$1 == "fail" { c = $3 + 0; k = (c == 2) ? 0 : (c < 0 && c != -15) ? 1 : (c != -15) ? 2 : 3
                             k = 2 * k + ($4 == 1 ? 0 : 1); if (best == "" || k < best) { best = k; f = $2 " " $3 } }
                END { print f }' "$NOTES")
  rank=${first% *}
  code=${first#* }
  case "$code" in
    -9) how=" (killed by signal 9: kill -9, or the kernel's out-of-memory killer, which dmesg names)" ;;
    -*) how=" (killed by signal ${code#-})" ;;
    2) how=" (the user's error)"
       if grep -q '^err ' "$NOTES"; then how=" (the user's error, above)"; fi ;;
    3) how=" (the watchdog: a stalled rank)" ;;
  esac
  summary_status=$([ "$code" = 2 ] || [ "$code" = 3 ] && echo "$code" || echo "$1")
  if [ "$code" = 2 ] && grep -qx out "$NOTES"; then  # later lines hid the error: say it again, last
    awk '$1 == "errs" {n = 0} $1 == "err" {sub(/^err /, ""); e[++n] = $0} END {for (i = 1; i <= n; i++) print e[i]}' \
        "$NOTES" >&2
  fi
  dir=$(run_dir)
  ckpts=$(checkpoint_dir "$dir")
  latest=$(newest_checkpoint "$ckpts")
  # torchrun logs its restarts at INFO, which it does not print: rank 0's "run dir:" line starts every attempt
  restarts=$(awk '$0 == "restart" { r++ } $1 == "rundir" { n++ } END { n--; print (r > n ? r : n) + 0 }' "$NOTES")
  if [ -n "$latest" ]; then
    where="the newest checkpoint: $ckpts/$latest; resume with: RUN_DIR=$dir ${RESUME_CMD:-the same command}"
  else
    where="the newest checkpoint: none $([ -n "$ckpts" ] && echo "in $ckpts" || echo "(checkpoint.dir is null)")"
  fi
  rdzv=""
  [ -n "$rank" ] || rdzv=$(note rdzv)
  if [ "$rdzv" = connect ]; then  # the launch of another node: not this one's to report
    summary_status=2
    echo "error: node ${NODE_RANK:-0} found no rendezvous at ${MASTER_ADDR:-}:${MASTER_PORT:-} within" \
         "RDZV_TIMEOUT=${RDZV_TIMEOUT:-} s (torch tries twice): node 0 did not start (its output, $dir/logs/node0.log," \
         "says why) or MASTER_ADDR:MASTER_PORT is not node 0's" >&2
    return
  fi
  echo "error: training failed: $(if [ -n "$rank" ]; then echo "rank $rank exited with code $code$how, the first to fail"
       elif [ "$rdzv" = lost ]; then echo "node 0's torchrun ended (the job failed on a node: see $dir/logs/node*.log)"
       else echo "torchrun exited with code $1"; fi), after $restarts of MAX_RESTARTS=${MAX_RESTARTS:-0} restart(s);" \
       "run dir $dir; $where" >&2
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
