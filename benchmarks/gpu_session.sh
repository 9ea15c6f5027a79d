#!/usr/bin/env bash
# One batched session on the GPU machine: info, demo, GPU tests, quick suite. Logs and results to $OUT.
# Usage (from the project root, wheels carried in .whl/): bash benchmarks/gpu_session.sh [tests|bench|all]
# Every wheel folder present is installed: .whl/ (the GPU kit), and where carried before on the same warm machine
# (64 MiB a call), .whl-remote/ (aiohttp: benchmarks.remote's server) and .whl-s3/ (moto: the S3 tests).
set -uo pipefail
what=${1:-all}
OUT=${OUT:-/tmp/gdsload-out}
mkdir -p "$OUT"
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl*/*.whl \
  || exit 1
export PYTHONPATH=/tmp/site:$PWD PYTHONUNBUFFERED=1
python3 -m gdsload info 2>&1 | tee "$OUT/info.txt"
rc=0
if [[ $what == tests || $what == all ]]; then
  python3 -m gdsload demo 2>&1 | tee "$OUT/demo.txt"
  python3 -m pytest -m gpu -q -p no:cacheprovider tests/ 2>&1 | tee "$OUT/pytest_gpu.txt" | tail -25
  rc=${PIPESTATUS[0]}
  python3 -m pytest -q -p no:cacheprovider tests/ 2>&1 | tail -3 | tee "$OUT/pytest_all.txt"
fi
if [[ $what == bench || $what == all ]]; then
  python3 -m benchmarks.suite --quick --out "$OUT" 2>&1 | tee "$OUT/suite.log"
fi
exit $rc
