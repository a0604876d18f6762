#!/usr/bin/env bash
# The GPU path in one go, on one GPU of a node (~6 minutes on an H200, estimated): the GPU-marked tests,
# a bf16 distributed-optimizer run with a checkpoint save and a resume (NCCL, launch/train.sh), and
# the ~1.2B preset's benchmark (tools/bench.py) with fused kernels off / on and without recompute.
#
#   tools/gpu_check.sh                 # logs + summary.txt in outputs/gpu_check-<date>-<time>/
#   OUT=/tmp/check tools/gpu_check.sh  # elsewhere
#
# Exit status: the number of failed steps (0 = all ran). Each step has its own time limit, so one
# stuck step does not cost the rest; a step's full output is in <OUT>/<step>.log.
set -u
cd "$(dirname "$0")/.." || exit 2
# shellcheck source=launch/common.sh
source launch/common.sh  # PYTHON and the NCCL / Megatron-Core environment of every launch

OUT="${OUT:-outputs/gpu_check-$(date +%Y%m%d-%H%M%S)}"
mkdir -p "$OUT"
"$PYTHON" -c 'import sys, torch; sys.exit(0 if torch.cuda.is_available() else 1)' \
  || die "no CUDA GPU is visible to $PYTHON: this script checks the GPU path (CPU: make test)"

failed=0
step() {  # step NAME SECONDS COMMAND...: run, log, print the status and the log's last lines
  local name=$1 limit=$2 start=$SECONDS rc
  shift 2
  timeout "$limit" "$@" >"$OUT/$name.log" 2>&1
  rc=$?
  [ "$rc" -eq 0 ] || failed=$((failed + 1))
  echo "=== $name: exit $rc after $((SECONDS - start)) s" | tee -a "$OUT/summary.txt"
  grep -v -i "warn" "$OUT/$name.log" | tail -n 3 | cut -c1-300
}

step pytest_gpu 300 "$PYTHON" -m pytest -q -ra -m gpu tests/
run=(env NPROC=1 RUN_DIR="$OUT/run" launch/train.sh train.precision=bf16 parallel=distopt train.save_interval=20
     train.log_interval=10)
step train 300 "${run[@]}" train.iters=30
step resume 300 "${run[@]}" train.iters=40
bench=("$PYTHON" tools/bench.py experiment=llama_1b_single_gpu --json --warmup 2 --windows 4)
step bench_fused_off 300 "${bench[@]}" model.fused_kernels=false
step bench_fused_on 300 "${bench[@]}" model.fused_kernels=true
step bench_fused_on_no_recompute 300 "${bench[@]}" model.fused_kernels=true model.recompute=none

"$PYTHON" - "$OUT" <<'EOF' | tee -a "$OUT/summary.txt"
import json, pathlib, sys
for log in sorted(pathlib.Path(sys.argv[1]).glob("bench_*.log")):
    lines = [l for l in log.read_text().splitlines() if l.startswith("{")]
    if not lines:
        print(f"{log.stem:<32} no result (see {log})")
        continue
    r = json.loads(lines[-1])
    mfu = f"{r['mfu']:.1%}" if r.get("mfu") is not None else "-"
    est = r["estimate_gb"]  # training/estimate/memory.py's estimate vs torch.cuda.max_memory_allocated (goal: 10%)
    print(f"{log.stem:<32} {1e3 * r['ours_s']:8.1f} ms/step {r['tokens_per_s']:>10,.0f} tok/s "
          f"{r['tflops_per_device']:7.1f} TFLOP/s  MFU {mfu}  mem {r['mem_gb']:.2f} GB (estimate {est:.2f}, "
          f"{r['mem_gb'] / est - 1:+.1%})  ({r['device']})")
EOF
echo "$failed failed step(s); logs in $OUT"
exit "$failed"
