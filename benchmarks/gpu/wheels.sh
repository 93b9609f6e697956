#!/usr/bin/env bash
# Downloads into .whl/ (ignored by git, carried to the GPU machine by the device tool's `carry`) exactly the wheels the
# GPU machine lacks (benchmarks/gpu/requirements.txt): for its Python (cp312, manylinux x86-64) and for this
# machine's Python (the dry run installs the same pins from the same folder). Checks that the working tree plus the
# wheels stay under the 64 MiB a device call carries.
#   bash benchmarks/gpu/wheels.sh
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/../.."
REQ=benchmarks/gpu/requirements.txt
mkdir -p .whl
python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
    --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 \
    -d .whl -r "$REQ"
python3 -m pip download -q --no-deps --only-binary=:all: -d .whl -r "$REQ"   # this machine's Python (dry run)
ls -l .whl
wheels=$(du -sb .whl | cut -f1)
tree=$(git ls-files -z | xargs -0 du -cb 2>/dev/null | tail -1 | cut -f1)
total=$((wheels + tree))
echo "wheels $((wheels / 1024)) KiB + tracked files $((tree / 1024)) KiB = $((total / 1024)) KiB of the 65536 KiB a call carries"
[ "$total" -lt $((64 * 1024 * 1024)) ] || { echo "FAIL: over 64 MiB"; exit 1; }
