#!/usr/bin/env bash
# GPU check in one command, within about 8 minutes on one H100/H200-class GPU (issue 11, item 5):
#   1. environment: versions, the GPU, which attention backends run (flash-attn missing: flash skipped, said so);
#   2. correctness: every backend's DTAEngine.forward_backward vs the per-sequence fp32 oracle (log-probs, every
#      parameter gradient) on Qwen2 / Qwen3 / Mistral (window) / Gemma 2 (soft-cap) in fp32 and in bf16 (no worse
#      than the dense bf16 path), packed subtree rows and walked segments;
#   3. the kernel tests on the GPU (flash-attn, Triton and torch's CUDA kernels against the float64 reference);
#   4. benchmarks per backend (dense-mb8 beside dta-<backend>, bf16): three workloads at qwen3-1.7b, two at qwen3-8b,
#      and issue 11's prefix-memory case at qwen3-8b; CSV/PNG/markdown under benchmarks/results/gpu-check-*.
# Every step has a time limit (550 s in all, worst case); a missing prerequisite stops the script at once with a line
# saying what is missing; a failed check sets a non-zero exit status and the later steps still run.
# Usage (repository root or anywhere; an environment with torch+CUDA, transformers, trl, this package, triton and
# optionally flash-attn>=2.7):
#   bash benchmarks/gpu_check.sh                  # exit status 0 = every check passed
#   bash benchmarks/gpu_check.sh --dry-run        # CPU, tiny shapes, no GPU: checks the script itself (~minutes)
#   OUT=/some/dir bash benchmarks/gpu_check.sh    # also copies the results and the log there
set -uo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}" TOKENIZERS_PARALLELISM=false
DRY=""
SLOW=1  # time limits x SLOW: the dry run's Triton kernels run in the (slow) interpreter on a CPU
[ "${1:-}" = "--dry-run" ] && DRY="--dry-run" && SLOW=6
TAG=$([ -n "$DRY" ] && echo gpu-check-dry || echo gpu-check)
LOG=benchmarks/results/$TAG.log
mkdir -p benchmarks/results
: > "$LOG"
status=0
step() { echo "=== $* ($(date +%T))" | tee -a "$LOG"; }
die() { echo "FAIL: $*" | tee -a "$LOG"; exit 1; }
run() {  # run LIMIT_S CMD...: the command's output to the log; a non-zero exit (or the time limit) fails the check
    local limit=$(($1 * SLOW)); shift
    timeout "$limit" "$@" 2>&1 | grep --line-buffered -v -i "warn" | tee -a "$LOG"
    local rc=${PIPESTATUS[0]}
    [ "$rc" -eq 124 ] && echo "FAIL: time limit ${limit}s reached: $*" | tee -a "$LOG"
    [ "$rc" -eq 0 ] || status=1
    return "$rc"
}

step "environment"
python -c "import torch, transformers, trl, trl_dta" 2>>"$LOG" ||
    die "torch, transformers, trl and trl_dta must import (pip install -e '.[dev,gpu]')"
run 60 python -m benchmarks.gpu_check env $DRY || die "no usable environment (see above)"

step "engine correctness per backend (fp32; bf16 no worse than dense bf16)"
run 100 python -m benchmarks.gpu_check correctness $DRY

if [ -z "$DRY" ]; then
    step "kernel tests on the GPU (flash-attn, Triton, torch CUDA kernels vs the float64 reference)"
    run 90 python -m pytest -x -q -p no:cacheprovider tests/kernels
fi

step "benchmarks per backend: qwen3-1.7b"
run 120 python -m benchmarks.gpu_check bench-small $DRY
step "benchmarks per backend: qwen3-8b"
run 100 python -m benchmarks.gpu_check bench-large $DRY
step "prefix memory (prompt 4096, 4/32/128 siblings): qwen3-8b"
run 80 python -m benchmarks.gpu_check bench-memory $DRY

step "done (status $status)"
if [ -n "${OUT:-}" ]; then cp benchmarks/results/"$TAG"* "$OUT"/ 2>/dev/null; fi
exit $status
