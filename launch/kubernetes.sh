#!/usr/bin/env bash
# Kubernetes: print the PyTorchJob (launch/pytorchjob.yaml) for this run, to pipe into `kubectl apply -f -`.
# Extra arguments are Hydra overrides, as for launch/train.sh.
#
#   IMAGE=registry.example.com/mcore-template:26.08 PVC=shared-runs NNODES=2 NPROC=8 RUN_ID=l7b-a \
#     launch/kubernetes.sh model=llama2_7b parallel.tp=8 | kubectl apply -f -
#
# Knobs (environment):
#   IMAGE         the image every pod runs: the Dockerfile's, pushed to a registry the cluster pulls from (required)
#   PVC           a ReadWriteMany PersistentVolumeClaim, mounted at /shared in every pod (required)
#   NNODES        pods, one per node (default 1); NPROC  GPUs and processes per pod (default 8)
#   RUN_ID        the job's name and the run's (default: mcore-<date>-<time>); RUN_DIR  (default /shared/runs/RUN_ID)
#   MAX_RESTARTS  torchrun's restarts of every rank (default 3); BACKOFF_LIMIT  pod restarts (default 3)
# The config is checked here for NNODES x NPROC processes before anything is printed (one line per problem).
set -euo pipefail
cd "$(dirname "$0")/.."
# shellcheck source=launch/common.sh
source launch/common.sh

[ -n "${IMAGE:-}" ] || die "set IMAGE=<the image every pod runs> (the Dockerfile's, in a registry the cluster reaches)"
[ -n "${PVC:-}" ] || die "set PVC=<a ReadWriteMany PersistentVolumeClaim> (the run dir every pod shares)"
NNODES="${NNODES:-1}"
NPROC="${NPROC:-8}"
RUN_ID="${RUN_ID:-mcore-$(date +%Y%m%d-%H%M%S)}"
RUN_DIR="${RUN_DIR:-/shared/runs/$RUN_ID}"
MAX_RESTARTS="${MAX_RESTARTS:-3}"
BACKOFF_LIMIT="${BACKOFF_LIMIT:-3}"
require_uint NNODES NPROC MAX_RESTARTS BACKOFF_LIMIT
[ "$NNODES" -ge 1 ] || die "NNODES=$NNODES must be at least 1"
[[ "$RUN_ID" =~ ^[a-z0-9]([-a-z0-9]*[a-z0-9])?$ ]] || die "RUN_ID=$RUN_ID must be a Kubernetes name" \
  "(lower-case letters, digits and '-', starting and ending with a letter or digit)"
check_config "$((NNODES * NPROC))" "" "$@" >&2
export IMAGE PVC NNODES NPROC RUN_ID RUN_DIR MAX_RESTARTS BACKOFF_LIMIT
"$PYTHON" - launch/pytorchjob.yaml "$@" <<'PY'
import json, os, re, sys

template, overrides = open(sys.argv[1]).read(), sys.argv[2:]
values = {name: os.environ[name] for name in ("IMAGE", "PVC", "RUN_ID", "RUN_DIR")}
values |= {name: str(os.environ[name]) for name in ("NNODES", "NPROC", "MAX_RESTARTS")}  # env values: strings
values |= {"JOB_NAME": os.environ["RUN_ID"], "OVERRIDES": overrides,
           "WORKERS": int(os.environ["NNODES"]) - 1, "BACKOFF_LIMIT": int(os.environ["BACKOFF_LIMIT"])}
body = template[template.index("apiVersion:"):]  # the header's own ${...} examples stay out
print(re.sub(r"\$\{(\w+)\}", lambda m: json.dumps(values[m.group(1)]), body), end="")
PY
