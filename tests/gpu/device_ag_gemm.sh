#!/bin/bash
# One device call for the AG+GEMM work: build (or reuse a carried build), single-GPU N-rank tests, the
# 2-rank torchrun checks and the TP=2 timings.  Logs and the built extension go to $OUT.
#   PREBUILT=dir  reuse dir/_C*.so instead of building (carry dir).
#   STEPS="test 2rank bench"  which steps to run.
set -u
export PYTHONUNBUFFERED=1 FLUXINDUCTOR_BUILD_JOBS=16 FLUXINDUCTOR_REQUIRE_EXTENSION=1
OUT=${OUT:-/tmp/ag_gemm_out}
STEPS=${STEPS:-"test 2rank bench"}
mkdir -p "$OUT"
nvidia-smi --query-gpu=name,clocks.max.sm,power.limit --format=csv,noheader
python3 -m pip install -q --no-index --no-deps .whl/nvidia_cutlass-4.2.0.0-py3-none-any.whl
if [ -n "${PREBUILT:-}" ] && ls "$PREBUILT"/_C*.so >/dev/null 2>&1; then
  python3 -m pip install -q --no-build-isolation --no-deps -e . --config-settings editable_mode=compat >/dev/null 2>&1 || true
  cp "$PREBUILT"/_C*.so fluxinductor/
else
  start=$(date +%s)
  if ! python3 -m pip install --no-build-isolation --no-deps -e . > "$OUT/build.log" 2>&1; then
    tail -60 "$OUT/build.log"; exit 1
  fi
  echo "build took $(( $(date +%s) - start )) s"
fi
so=$(python3 -c "import fluxinductor._C as c; print(c.__file__)") || exit 1
echo "extension: $so"; cp "$so" "$OUT/"
for step in $STEPS; do
  case $step in
    test) timeout 240 python3 -m pytest -q -rs tests/gpu/test_ag_gemm.py -k "not torchrun" 2>&1 \
            | tee "$OUT/pytest.log" | tail -40 ;;
    2rank) timeout 240 torchrun --nproc-per-node 2 tests/gpu/run_ag_gemm_2rank.py --calls 1000 2>&1 \
             | tee "$OUT/2rank.log" | grep -v "^\s*$" | tail -40 ;;
    bench) timeout 240 torchrun --nproc-per-node 2 tests/gpu/run_ag_gemm_2rank.py --skip-checks \
             --bench "$OUT/ag_gemm_bench.json" 2>&1 | tee "$OUT/bench.log" | tail -20 ;;
  esac
done
