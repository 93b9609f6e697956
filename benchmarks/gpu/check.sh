#!/usr/bin/env bash
# The GPU check in one unattended command: on a lent H200, within GPU_CHECK_BUDGET seconds (480 by default)
# including the install, every step under its own time limit and the whole under the budget's deadline.
#
#   bash benchmarks/gpu/check.sh                   # on the GPU machine, from a checkout carrying .whl/
#   bash benchmarks/gpu/check.sh --dry-run         # on a CPU: the same steps at tiny sizes, installed the same way
#   GPU_CHECK_BUDGET=200 bash benchmarks/gpu/check.sh --only throughput-1.7b   # a rerun of some steps (versions,
#                                                  # install, env and summary always run)
#
# Steps, in priority order (a step that cannot finish before the deadline is skipped, with a line saying so; each
# measuring step gets its own end as its deadline, GPU_CHECK_STEP_DEADLINE, so that a method that does not fit writes
# a `skipped` row instead of being killed; GPU_CHECK_SLOW_S=SECONDS makes every throughput method sleep first: the
# rehearsal of a slow step, e.g. `GPU_CHECK_SLOW_S=100 bash benchmarks/gpu/check.sh --dry-run --only throughput-1.7b`):
#   versions     nvidia-smi, Python, the packages already there; no CUDA: stop (without --dry-run)
#   install      the wheels of .whl/ (benchmarks/gpu/wheels.sh, run where pip works) for the pins of
#                benchmarks/gpu/requirements.txt, `pip install --no-index --no-deps --target`; never builds flash-attn
#                (a flash-attn wheel put into .whl/ is installed and used; else its backend is skipped, said so)
#   env          versions again, from where each package is imported; the GPU; the attention backends; imports
#                datasets, trl.trainer.utils and peft (what every baseline row needs): a mismatch fails in seconds
#   correctness  every backend's DTAEngine.forward_backward vs the float64 oracle, fp32 and bf16 autocast, no worse
#                than the dense path (Qwen2, Qwen3, Mistral window, Gemma 2 soft-cap; packed rows and walked segments)
#   throughput-1.7b  dense-ckpt, dta-torch, dta-triton, trl-tree, sparse-flex, dense (in that order) on tau2-airline
#                and grpo-p1024-g16-c256
#   throughput-0.6b  the throughput grid at Qwen3-0.6B
#   kernels      tests/attention_kernels on CUDA (bf16/fp16 cases per backend, head_dim, mask kind)
#   trainer      GRPOTrainer vs DTAGRPOTrainer with TRL's defaults, Qwen3-0.6B
#   prefix-memory    4096-token prompt, 4/32/128 siblings, Qwen3-1.7B
#   variants     the Triton variants compiled by this machine's Triton for sm_90: registers, spills, shared memory
#   summary      summary.md and throughput.png; in a dry run, fails unless every planned row was measured
# Output: everything under $OUT (the device tool's folder; else benchmarks/results/gpu-check[-dry]): gpu_check.log
# (this script's whole output, from its first line), correctness.csv, throughput.csv, trainer.csv, prefix_memory.csv,
# triton_variants.csv, summary.md, throughput.png; each CSV row is appended the moment it is measured.
# Exit status: 0 when every step that ran passed.
set -uo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/../.."
REPO=$PWD
DRY=""
ONLY=""
while [ $# -gt 0 ]; do
    case "$1" in
        --dry-run) DRY="--dry-run" ;;
        --only) ONLY=",$2,"; shift ;;
        *) echo "usage: bash benchmarks/gpu/check.sh [--dry-run] [--only STEP,STEP]"; exit 2 ;;
    esac
    shift
done
OUT=${OUT:-$REPO/benchmarks/results/gpu-check${DRY:+-dry}}
mkdir -p "$OUT"
LOG=$OUT/gpu_check.log
: > "$LOG"
exec > >(tee -a "$LOG") 2>&1
TEE=$!
trap 'exec >&- 2>&-; wait "$TEE" 2>/dev/null' EXIT  # the log complete before the files are collected
BUDGET=${GPU_CHECK_BUDGET:-480}
START=$(date +%s)
SLOW=1  # the dry run's Triton kernels run in the (slow) interpreter on 2 CPU cores: time limits x 4
[ -n "$DRY" ] && SLOW=4
# The steps end by the deadline (a step killed there gets 10 s to go); the summary's 30 s come after it.
DEADLINE=$((START + BUDGET * SLOW - 40))
WORK=${GPU_CHECK_WORK:-/tmp/gpu-check}
# Named site-packages on purpose: dill (datasets' fingerprints) pickles the modules of packages found outside such a
# folder by value, and fails on pyarrow's types (the dry run's image folder is named so for the same reason).
SITE=$WORK/site-packages
PY=python3
status=0
export TOKENIZERS_PARALLELISM=false PYTHONUNBUFFERED=1 TRL_EXPERIMENTAL_SILENCE=1 DTA_BENCH_START_METHOD=forkserver
echo "gpu_check $(date -u +%FT%TZ) ${DRY:-(GPU run)} budget ${BUDGET}s x $SLOW, out $OUT"

wanted() { [ -z "$ONLY" ] || [[ ",versions,install,env,summary,$ONLY" == *",$1,"* ]]; }
# step NAME LIMIT_S CMD...: run CMD under min(LIMIT x SLOW, time to the deadline); say how it ended
step() {
    local name=$1 limit=$(($2 * SLOW)); shift 2
    wanted "$name" || return 0
    local left=$((DEADLINE - $(date +%s)))
    if [ "$left" -lt 20 ]; then echo "=== $name: SKIPPED (${left}s left before the deadline)"; return 0; fi
    [ "$limit" -gt "$left" ] && limit=$left
    echo "=== $name (limit ${limit}s, $(date +%T))"
    local t0=$(date +%s)
    # the step's own end, less the time to write its last rows: its measuring commands skip what would run past it
    GPU_CHECK_STEP_DEADLINE=$((t0 + limit - 15)) timeout --kill-after=10 "$limit" "$@"
    local rc=$?
    local took=$(($(date +%s) - t0))
    if [ "$rc" -eq 0 ]; then echo "=== $name: OK (${took}s)"
    elif [ "$rc" -ge 124 ]; then echo "=== $name: FAIL, time limit ${limit}s reached"; status=1
    else echo "=== $name: FAIL (exit $rc, ${took}s)"; status=1; fi
    return "$rc"
}

versions() {
    command -v nvidia-smi >/dev/null && nvidia-smi --query-gpu=name,memory.total,driver_version,clocks.sm,clocks.mem \
        --format=csv || echo "nvidia-smi: not here"
    uname -srm; echo "cores $(nproc)"; $PY --version
    $PY - <<'PY'
import importlib.metadata as md
for name in ("torch", "triton", "transformers", "accelerate", "peft", "huggingface-hub", "tokenizers", "pyarrow",
             "numpy", "trl", "datasets", "flash-attn", "pytest-xdist"):
    try:
        print(f"  {name:16s} {md.version(name)}")
    except md.PackageNotFoundError:
        print(f"  {name:16s} not installed")
import torch
print(f"torch {torch.__version__}, CUDA {torch.version.cuda}, cuda available: {torch.cuda.is_available()}")
PY
}

# The dry run's stand-in for the GPU machine: a fresh environment holding only the packages of its image that exist
# here (benchmarks/gpu/image.txt), so that the carried wheels must supply the rest.
dry_environment() {
    rm -rf "$WORK" && mkdir -p "$WORK"
    python3 -m benchmarks.gpu.check device-image "$WORK/image/site-packages" || return 1
    python3 -m venv --without-pip "$WORK/venv" || return 1  # this environment's pip installs into it (below)
    local site_dir
    site_dir=$("$WORK/venv/bin/python" -c "import sysconfig; print(sysconfig.get_paths()['purelib'])")
    echo "$WORK/image/site-packages" > "$site_dir/gpu_image.pth"
    PY=$WORK/venv/bin/python
    echo "fresh environment $WORK/venv with the image's packages linked from $WORK/image/site-packages"
}

install() {
    ls .whl/*.whl >/dev/null 2>&1 || { echo "no .whl/: run 'bash benchmarks/gpu/wheels.sh' where pip works and carry .whl"; return 1; }
    rm -rf "$SITE"
    local extra=()
    ls .whl/flash_attn-*.whl >/dev/null 2>&1 && extra=(flash-attn) && echo "flash-attn wheel found: installing it"
    $PIP install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --disable-pip-version-check \
        --target "$SITE" --find-links .whl -r benchmarks/gpu/requirements.txt "${extra[@]}" || return 1
    ls "$SITE"
}

if [ -n "$DRY" ]; then
    export TRITON_INTERPRET=1
    step versions 30 bash -c "$(declare -f versions); PY=python3; versions"
    step install 120 bash -c "$(declare -f dry_environment install); WORK='$WORK' SITE='$SITE' PIP='python3 -m pip'; dry_environment && install"
    [ -x "$WORK/venv/bin/python" ] && PY=$WORK/venv/bin/python
else
    step versions 30 bash -c "$(declare -f versions); PY='$PY'; versions"
    $PY -c "import torch, sys; sys.exit(0 if torch.cuda.is_available() else 1)" ||
        { echo "FAIL: no CUDA device here (torch.cuda.is_available() is False); --dry-run runs on a CPU"; exit 1; }
    step install 60 bash -c "$(declare -f install); SITE='$SITE' PIP='$PY -m pip'; install"
fi
export PYTHONPATH="$REPO:$SITE"
[ -d "$SITE" ] || { echo "FAIL: nothing installed into $SITE"; exit 1; }

step env 60 $PY -m benchmarks.gpu.check env $DRY || { echo "FAIL: the environment is not usable (above)"; exit 1; }
step correctness 90 $PY -m benchmarks.gpu.check correctness --out "$OUT" $DRY
step throughput-1.7b 200 $PY -m benchmarks.gpu.bench throughput --shape qwen3-1.7b --out "$OUT" --deadline "$DEADLINE" $DRY
step throughput-0.6b 80 $PY -m benchmarks.gpu.bench throughput --shape qwen3-0.6b --out "$OUT" --deadline "$DEADLINE" $DRY
if [ -n "$DRY" ]; then  # the CPU cases run in the main test suite: here only the collection and the CUDA skips
    step kernels 60 $PY -m pytest -q -p no:cacheprovider tests/attention_kernels --ignore=tests/attention_kernels/test_triton_compile.py -k cuda
else
    XDIST=$($PY -c "import xdist" 2>/dev/null && echo "-n 8")
    step kernels 90 $PY -m pytest -q -p no:cacheprovider tests/attention_kernels --ignore=tests/attention_kernels/test_triton_compile.py \
        -k "cuda and not cpu" $XDIST
fi
step trainer 70 $PY -m benchmarks.gpu.bench trainer --shape qwen3-0.6b --out "$OUT" --deadline "$DEADLINE" $DRY
step prefix-memory 50 $PY -m benchmarks.gpu.bench prefix-memory --shape qwen3-1.7b --out "$OUT" --deadline "$DEADLINE" $DRY
if [ -n "$DRY" ]; then
    step variants 60 env -u TRITON_INTERPRET $PY -m benchmarks.gpu.triton_variants --arch 90 --dtype bf16 --max-variants 3 \
        --jobs 1 --out "$OUT/triton_variants.csv"
else
    step variants 40 $PY -m benchmarks.gpu.triton_variants --arch 90 --dtype bf16 fp16 --jobs "$(nproc)" \
        --out "$OUT/triton_variants.csv"
fi
EXPECT=(throughput=qwen3-1.7b throughput=qwen3-0.6b trainer=qwen3-0.6b prefix-memory=qwen3-1.7b)
if wanted summary; then  # always, also past the deadline: it only reads the CSVs
    echo "=== summary ($(date +%T))"
    timeout 30 $PY -m benchmarks.gpu.bench summary --out "$OUT" --expect "${EXPECT[@]}" $DRY || status=1
fi
echo "gpu_check done in $(($(date +%s) - START))s, status $status; files in $OUT:"
ls -l "$OUT"
exit $status
