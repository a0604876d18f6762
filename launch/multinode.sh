#!/usr/bin/env bash
# Several nodes: one torchrun per node, joined by a c10d rendezvous at MASTER_ADDR:MASTER_PORT (node 0).
# Run the same command on every node, each with its NODE_RANK. Extra arguments are Hydra overrides.
#
#   node 0:  NNODES=2 NODE_RANK=0 NPROC=8 MASTER_ADDR=10.0.0.1 RUN_ID=l7b-a launch/multinode.sh model=llama2_7b parallel.tp=8
#   node 1:  NNODES=2 NODE_RANK=1 NPROC=8 MASTER_ADDR=10.0.0.1 RUN_ID=l7b-a launch/multinode.sh model=llama2_7b parallel.tp=8
#   DRY_RUN=1 NNODES=2 MASTER_ADDR=10.0.0.1 RUN_ID=x launch/multinode.sh parallel.tp=2   # print, run nothing
#   (launch/slurm.sbatch sets all of this under SLURM)
#
# Knobs (environment):
#   NNODES       nodes in the job (default: SLURM_NNODES, else 1)
#   NODE_RANK    this node, 0..NNODES-1 (default: SLURM_NODEID, else 0); node 0 hosts the rendezvous.
#                Global ranks follow the rendezvous' order, not NODE_RANK.
#   MASTER_ADDR  node 0's address, reachable from every node (required with NNODES > 1; 127.0.0.1 for one machine)
#   MASTER_PORT  rendezvous port on node 0, the same on every node (default: 29500, torch's)
#   NPROC        processes per node, the same on every node (default: SLURM_GPUS_ON_NODE under SLURM, else the
#                number of GPUs, or 2 without GPUs). Every node checks the config for NNODES x NPROC processes and
#                every rank refuses a job of another size (a node started with another NPROC) in one line.
#   RUN_ID       the run's name: the same on every node and across restarts (default: SLURM_JOB_ID)
#   RUN_DIR      run dir on storage every node sees (default: outputs/run-$RUN_ID): the config, metrics
#                and checkpoints go there, and a relaunch with the same RUN_DIR resumes (checkpoint.load=auto).
#                Never derived from a clock: each node's would differ. A hydra.run.dir=... override wins.
#   LOCAL_ADDR   this node's address as the others reach it (default: its FQDN, torch's choice)
#   RDZV_TIMEOUT seconds a node waits for node 0's rendezvous store (default 900: the nodes may start in any
#                order within it; torch's own is 60; torch tries twice). A node whose node 0 never starts (its
#                config check refused) or ends says so in one line (docs/launch.md); under SLURM srun ends it.
#   MAX_RESTARTS times torchrun restarts every rank of the job after one dies (default 0): each restart
#                resumes from the newest complete checkpoint in RUN_DIR
#   PYTHON, DRY_RUN=1   as in launch/train.sh; NCCL/Megatron-Core environment in launch/common.sh
# Each node also writes what it prints to RUN_DIR/logs/node<NODE_RANK>.log (appended across restarts).
# Nodes with several networks: set NCCL_SOCKET_IFNAME and GLOO_SOCKET_IFNAME to the one they share.
set -euo pipefail
cd "$(dirname "$0")/.."
# shellcheck source=launch/common.sh
source launch/common.sh

NNODES="${NNODES:-${SLURM_NNODES:-1}}"
NODE_RANK="${NODE_RANK:-${SLURM_NODEID:-0}}"
MASTER_ADDR="${MASTER_ADDR:-}"
MASTER_PORT="${MASTER_PORT:-29500}"
NPROC="${NPROC:-${SLURM_GPUS_ON_NODE:-$(default_nproc)}}"  # SLURM's binding, not nvidia-smi's count
RUN_ID="${RUN_ID:-${SLURM_JOB_ID:-}}"
run_dir_override="$(override_value hydra.run.dir "$@")"  # the user's hydra.run.dir=... wins (Hydra's last)
RUN_DIR="${run_dir_override:-${RUN_DIR:-}}"
if [ -z "$RUN_ID" ]; then
  [ -n "${RUN_DIR:-}" ] || die "set RUN_ID=<name> or RUN_DIR=<shared dir>, the same on every node" \
                               "(no SLURM_JOB_ID to name the run)"
  RUN_ID="$(basename "$RUN_DIR")"
fi
RUN_DIR="${RUN_DIR:-outputs/run-$RUN_ID}"
MAX_RESTARTS="${MAX_RESTARTS:-0}"
RDZV_TIMEOUT="${RDZV_TIMEOUT:-900}"
require_uint NNODES NODE_RANK MASTER_PORT NPROC MAX_RESTARTS RDZV_TIMEOUT
if [ -z "$MASTER_ADDR" ]; then  # 127.0.0.1 on several nodes: each would wait for a store on itself
  [ "$NNODES" = 1 ] || die "set MASTER_ADDR=<node 0's address> (NNODES=$NNODES: every node must reach node 0)"
  MASTER_ADDR=127.0.0.1
fi
[ "$NODE_RANK" -lt "$NNODES" ] || die "NODE_RANK=$NODE_RANK must be below NNODES=$NNODES"

is_host=0
[ "$NODE_RANK" = 0 ] && is_host=1
# Only node 0 binds MASTER_PORT, so only there must it be free.
check_config "$((NNODES * NPROC))" "$([ "$is_host" = 1 ] && echo "$MASTER_PORT")" "$@"
# torchrun sums the nodes' own NPROC: the ranks compare the job's size with the one checked here (entry.py)
export LAUNCH_WORLD_SIZE="$((NNODES * NPROC))"
if [ "${DRY_RUN:-0}" != 1 ]; then  # this node's log, beside the shared console (slurm-%j.out interleaves nodes)
  mkdir -p "$RUN_DIR/logs"  # tee outlives the stop signals (SLURM sends them to every process of the step)
  exec > >(trap '' TERM INT USR1; exec tee -a "$RUN_DIR/logs/node$NODE_RANK.log") \
       2> >(trap '' TERM INT USR1; exec tee -a "$RUN_DIR/logs/node$NODE_RANK.log" >&2)
fi
cmd=("$PYTHON" -m torch.distributed.run --nnodes "$NNODES" --nproc-per-node "$NPROC" --max-restarts "$MAX_RESTARTS"
     --rdzv-backend c10d --rdzv-endpoint "$MASTER_ADDR:$MASTER_PORT" --rdzv-id "$RUN_ID"
     --rdzv-conf "is_host=$is_host,read_timeout=$RDZV_TIMEOUT" ${LOCAL_ADDR:+--local-addr "$LOCAL_ADDR"}
     train.py "hydra.run.dir=$RUN_DIR" "$@")
RESUME_CMD="$(printf '%q ' "$0" "$@")"
RESUME_CMD="${RESUME_CMD% } (with the same RUN_ID on every node)"
run_or_print "${cmd[@]}"
